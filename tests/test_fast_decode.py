"""The one fast path (`attention/fast_decode.py`): a single row's decode step, its blocks read in place when
consecutive and gathered otherwise. It is taken by every layer of such a step, declines whatever it was not decided
for, and gives logits and stored blocks bitwise equal to the general path's (`HF_PAGED_FAST_DECODE=0`) over block
boundaries, pool growth, forks and rollbacks."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import hf_paged
from hf_paged.attention import dispatch, fast_decode, torch_backend
from helpers import generate_both, load, max_logit_diff, saved_model


@pytest.fixture(scope="module")
def models():
    path = saved_model("llama", num_hidden_layers=4)
    return load(path, "paged"), load(path, "sdpa")


@pytest.fixture(scope="module")
def windowed():
    """A Mistral whose layers see their last 10 tokens: with 4-token blocks, rows pass it and free blocks."""
    path = saved_model("mistral", num_hidden_layers=4, sliding_window=10)
    return load(path, "paged"), load(path, "sdpa")


def _count(monkeypatch) -> dict[str, int]:
    """Counts the fast path's answers (taken / declined; `gathered`: taken by a row whose blocks are not
    consecutive) and the general path's attention calls."""
    counts = {"fast": 0, "declined": 0, "general": 0, "gathered": 0}
    fast, general = fast_decode.FastDecode.attend, dispatch.torch_paged_attention

    def counted_fast(self, *args, **kwargs):
        out = fast(self, *args, **kwargs)
        counts["fast" if out is not None else "declined"] += 1
        counts["gathered"] += out is not None and self.blocks is not None
        return out

    def counted_general(*args, **kwargs):
        counts["general"] += 1
        return general(*args, **kwargs)

    monkeypatch.setattr(fast_decode.FastDecode, "attend", counted_fast)
    monkeypatch.setattr(dispatch, "torch_paged_attention", counted_general)
    return counts


def test_batch_one_decode_takes_the_fast_path_in_every_layer(models, monkeypatch):
    counts = _count(monkeypatch)
    ids = torch.randint(1, 128, (1, 21), generator=torch.Generator().manual_seed(3))
    out, expected, _ = generate_both(*models, input_ids=ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, expected.sequences) and max_logit_diff(out, expected) < 1e-4
    # 11 decode steps of 4 layers take the fast path; the prefill's 4 layers the general one
    assert counts == {"fast": 11 * 4, "declined": 0, "general": 4, "gathered": 0}


def test_a_sliding_window_reads_its_last_tokens_on_the_fast_path(windowed, monkeypatch):
    """Layers with a sliding window take the fast path too, within the window and past it (where the blocks out of
    it are freed, and the row reads its last `window` slots, from inside a block); the tokens and logits stay sdpa's,
    and the step declines a layer whose window is not the one it was decided for."""
    counts = _count(monkeypatch)
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(13))
    cache = hf_paged.PagedCache(block_size=4)
    out, expected, _ = generate_both(
        *windowed, cache=cache, input_ids=ids, max_new_tokens=80, min_new_tokens=80, do_sample=False
    )
    assert torch.equal(out.sequences, expected.sequences) and max_logit_diff(out, expected) < 1e-4
    # every decode step's layers on the fast path, but the one at which the pool grows (declined: the general path
    # grows the layers' tensors)
    assert counts["fast"] + counts["declined"] == 79 * 4 and counts["declined"] <= 4 and counts["gathered"] == 0
    assert counts["general"] == 4 + counts["declined"]
    # 85 tokens stored, a window of 10 (and the 64 tokens kept beyond it): the first blocks were freed
    assert cache.block_table(0)[:2] == [-1, -1]
    cpu = torch.device("cpu")
    step = fast_decode.FastDecode.of_row(cpu, [-1, 4, 5, 6], 14, 6 * 4 + 1, 4, window=10)
    assert (step.first, step.count, step.blocks) == (4 * 4, 10, None)  # positions 4..13: block 4 on, in place
    step = fast_decode.FastDecode.of_row(cpu, [-1, 7, 5, 6], 15, 6 * 4 + 2, 4, window=10)
    assert (step.first, step.count, step.blocks.tolist(), step.skip) == (None, 10, [7, 5, 6], 1)  # gathered
    assert fast_decode.FastDecode.of_row(cpu, [-1, 4, 5, 6], 14, 6 * 4 + 1, 4, window=11) is None  # needs block 0
    query, key = torch.zeros(1, 4, 1, 16), torch.zeros(1, 2, 1, 16)
    assert step.attend(cache.pool, 0, query, key, key, 0.25, window=None) is None  # not the window decided for


def test_no_fast_path_for_several_rows_or_quantized_pools(models, monkeypatch):
    counts = _count(monkeypatch)
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    out, expected, _ = generate_both(*models, input_ids=ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(out.sequences, expected.sequences)
    cache = hf_paged.PagedCache(kv_dtype="int8")
    models[0].generate(ids[:1], **hf_paged.cache_kwargs(cache), max_new_tokens=5, do_sample=False)
    assert counts["fast"] == counts["declined"] == 0 and counts["general"] > 0


def test_the_fast_path_declines_what_it_was_not_decided_for(models, monkeypatch):
    """Gradients on (the pool must not join a graph), or a layer whose K/V are not in the pool's dtype: declined,
    nothing written, and the general path computes the same result."""
    paged, ref = models
    counts = _count(monkeypatch)
    ids = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    cache = hf_paged.PagedCache()
    paged(ids, **hf_paged.cache_kwargs(cache))  # prefill
    nxt = torch.tensor([[7]])
    with torch.enable_grad():
        logits = paged(nxt, **hf_paged.cache_kwargs(cache)).logits
    assert counts["fast"] == 0 and counts["declined"] == 4
    reference = ref(torch.cat([ids, nxt], 1)).logits[:, -1:]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    step = fast_decode.FastDecode(torch.device("cpu"), 8, 0, 9)
    stored = cache.pool.layer_storage(1)[0].clone()
    key = torch.ones(1, 2, 1, 16, dtype=torch.float64)
    assert step.attend(cache.pool, 1, torch.zeros(1, 4, 1, 16, dtype=torch.float64), key, key, 0.25) is None
    assert torch.equal(cache.pool.layer_storage(1)[0], stored)


def test_blocks_that_do_not_follow_are_gathered(models, monkeypatch):
    """Two caches of a full pool: the second's prompt takes the block after the first's, so the first row's next
    block is elsewhere: from then on its steps gather its blocks (still the fast path), and the logits stay sdpa's."""
    paged, ref = models
    pool = hf_paged.KVPool(paged.config, block_size=4, num_blocks=5)
    a, b = (torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(s)) for s in (9, 10))
    first, second = pool.new_cache(), pool.new_cache()
    paged(a, **hf_paged.cache_kwargs(first))  # blocks 1, 2 (6 tokens; a run with room after it)
    paged(b, **hf_paged.cache_kwargs(second))  # no room left for a run: the first free ids, blocks 0 and 3
    assert first.block_table(0) == [1, 2] and second.block_table(0) == [0, 3]
    counts = _count(monkeypatch)
    tokens = [5, 17, 29]  # positions 6, 7 (block 2: consecutive), then 8: block 4, not after block 2
    with torch.no_grad():
        logits = [paged(torch.tensor([[t]]), **hf_paged.cache_kwargs(first)).logits[:, -1] for t in tokens]
    assert first.block_table(0) == [1, 2, 4]
    reference = ref(torch.cat([a, torch.tensor([tokens])], 1)).logits[0, -3:]
    torch.testing.assert_close(torch.cat(logits), reference, atol=1e-4, rtol=1e-4)
    assert counts == {"fast": 3 * 4, "declined": 0, "general": 0, "gathered": 4}


def test_a_row_after_a_prefix_hit_is_read_in_place(models, monkeypatch):
    """The same prompt twice on one pool: the second row takes the first's cached prompt blocks but the last, which
    it computes again. The cached block after them (the first row's last prompt block) is moved away, so that the
    row's blocks stay one run of ids and every decode step reads them in place; the tokens stay sdpa's."""
    paged, ref = models
    pool = hf_paged.KVPool(paged.config, block_size=4)
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(12))
    first = pool.new_cache(ids)
    want = paged.generate(ids, **hf_paged.cache_kwargs(first), max_new_tokens=10, do_sample=False)
    first.release()
    counts = _count(monkeypatch)
    second = pool.new_cache(ids)
    assert pool.stats().prefix_hit_tokens == 8  # blocks 0 and 1 (the last prompt block is computed again)
    out = paged.generate(ids, **hf_paged.cache_kwargs(second), max_new_tokens=10, do_sample=False)
    assert second.block_table(0) == list(range(6))
    assert pool.allocators[0].num_moves == 1  # block 2, the first row's, now at another id
    assert counts["fast"] == 9 * 4 and counts["gathered"] == 0
    assert torch.equal(out, want)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=10, do_sample=False))
    second.release()
    pool.check()


def _decode_run(model, enabled: bool, monkeypatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of every step, and every layer's stored K/V at the end, of one scripted batch-1 run: a prefill,
    decode steps over block boundaries and pool growth (block size 4, a growing pool that starts at 16 blocks),
    a fork decoding on its own, a crop and a forward interrupted in its second layer (both rolled back), and more
    steps after them."""
    monkeypatch.setattr(fast_decode, "ENABLED", enabled)
    gen = torch.Generator().manual_seed(21)
    prompt = torch.randint(1, 128, (1, 9), generator=gen)
    tokens = torch.randint(1, 128, (90,), generator=gen).tolist()
    cache = hf_paged.PagedCache(block_size=4)
    logits, stored = [], []

    def step(c, token):
        with torch.no_grad():
            logits.append(model(torch.tensor([[token]]), **hf_paged.cache_kwargs(c)).logits[:, -1])

    with torch.no_grad():
        logits.append(model(prompt, **hf_paged.cache_kwargs(cache)).logits[:, -1])
    for token in tokens[:60]:  # past 16 blocks: the pool grows
        step(cache, token)
    fork = cache.fork()
    for token in tokens[60:66]:
        step(fork, token)
        step(cache, token + 1)
    cache.crop(-3)
    for token in tokens[66:72]:
        step(cache, token)

    def boom(module, args):
        raise RuntimeError("interrupted")

    hook = model.model.layers[1].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        step(cache, tokens[72])
    hook.remove()
    for token in tokens[73:]:
        step(cache, token)
    cache.finish_forward()
    cache.pool.check()
    for layer in range(4):
        stored.extend(cache.pool.layer_storage(layer))
    return logits, stored


@pytest.mark.parametrize("family", ["llama", "windowed"])
@pytest.mark.parametrize("fold_from_bytes", [None, 0])  # these tiny rows' keys attend unfolded, or always folded
def test_fast_and_general_paths_are_bitwise_equal(family, fold_from_bytes, request, monkeypatch):
    if fold_from_bytes is not None:  # (GQA folded into the query length at any size: `decode_attention`)
        monkeypatch.setattr(torch_backend, "FOLD_GQA_MIN_BYTES", fold_from_bytes)
    model = request.getfixturevalue("models" if family == "llama" else "windowed")[0]
    counts = _count(monkeypatch)
    fast_logits, fast_stored = _decode_run(model, True, monkeypatch)
    assert counts["fast"] > 60 * 4  # (the script really took the fast path)
    assert counts["gathered"] >= 6 * 4  # (and gathered: the fork's blocks after its copied block are elsewhere)
    taken = counts["fast"]
    general_logits, general_stored = _decode_run(model, False, monkeypatch)
    assert counts["fast"] == taken  # switched off: not once
    assert len(fast_logits) == len(general_logits)
    for a, b in zip(fast_logits, general_logits, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fast_stored, general_stored, strict=True):
        assert torch.equal(a, b)


def _fields(step: fast_decode.FastDecode | None) -> tuple | None:
    if step is None:
        return None
    blocks = None if step.blocks is None else step.blocks.tolist()
    return step.device, step.slot, step.first, step.count, blocks, step.num_slots, step.window, step.skip


@pytest.mark.parametrize("family", ["llama", "windowed"])
def test_a_step_taken_over_from_the_step_before_is_the_one_decided_afresh(family, request, monkeypatch):
    """`FastDecode.next_token`: the row's next step, within the previous step's block, advances that step by one
    slot instead of deciding again. Over the scripted run (block boundaries, growth, a fork, a crop, a rollback),
    every step it hands over (rows read in place and gathered rows alike) equals `FastDecode.decide`'s, and it
    declines at block boundaries and for sliding windows."""
    model = request.getfixturevalue("models" if family == "llama" else "windowed")[0]
    seen = {"taken_over": 0, "decided": 0}
    fast_step, next_token = fast_decode.step, fast_decode.FastDecode.next_token

    def checked(pool, plan, group_id, layer_idx, query, window):
        step = fast_step(pool, plan, group_id, layer_idx, query, window)
        fresh = fast_decode.FastDecode.decide(pool, plan, group_id, query)
        assert _fields(step) == _fields(fresh)
        return step

    def counted(self, plan, group_id):
        step = next_token(self, plan, group_id)
        seen["taken_over" if step is not None else "decided"] += 1
        return step

    monkeypatch.setattr(fast_decode, "step", checked)
    monkeypatch.setattr(fast_decode.FastDecode, "next_token", counted)
    _decode_run(model, True, monkeypatch)
    if family == "llama":  # 4-token blocks: three of four steps continue the block of the step before
        assert seen["taken_over"] > 2 * seen["decided"] > 0
    else:  # a sliding window: every step decides afresh
        assert seen["taken_over"] == 0 and seen["decided"] > 0


@pytest.mark.parametrize("family", ["llama", "windowed"])
def test_a_step_within_the_last_blocks_is_planned_as_the_general_planner_plans_it(family, request, monkeypatch):
    """`Rows.plan_forward` plans a one-token step whose rows all write into their own partial last block without
    deciding any growth: the same plans (tables, slots, lengths, what a rollback restores) as the general planner
    over the scripted run and over left-padded rows of different lengths, and the same logits and stored K/V; also
    for layers with a sliding window, whose rows free the blocks that fall out of it."""
    from hf_paged.cache.rows import Rows  # noqa: PLC0415

    model = request.getfixturevalue("models" if family == "llama" else "windowed")[0]
    plan_forward, within = Rows.plan_forward, Rows._within_last_blocks

    def run(in_place: bool) -> tuple[list, list, list]:
        plans, taken = [], [0]

        def recorded(self, *args, **kwargs):
            plan = plan_forward(self, *args, **kwargs)
            groups = [(list(map(list, g.tables)), g.write_rows, g.write_slots, g.sliding_window) for g in plan.groups]
            plans.append((plan.q_len, plan.query_lens, plan.seq_lens, groups, list(plan.undo.filled)))
            return plan

        def counted(self):
            answer = in_place and within(self)
            taken[0] += answer
            return answer

        monkeypatch.setattr(Rows, "plan_forward", recorded)
        monkeypatch.setattr(Rows, "_within_last_blocks", counted)
        logits, stored = _decode_run(model, True, monkeypatch)
        ids = torch.randint(1, 128, (3, 7), generator=torch.Generator().manual_seed(8))
        mask = torch.ones_like(ids)
        mask[0, :3] = mask[1, :1] = 0
        out = model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=4)),
                             max_new_tokens=11, do_sample=False, output_scores=True, return_dict_in_generate=True)
        monkeypatch.undo()
        assert taken[0] > 50 if in_place else not taken[0]
        return plans, logits + list(out.scores), stored

    fast, general = run(True), run(False)
    assert fast[0] == general[0]
    for a, b in zip(fast[1] + fast[2], general[1] + general[2], strict=True):
        assert torch.equal(a, b)


def test_the_environment_switch_turns_the_fast_path_off(monkeypatch):
    """`HF_PAGED_FAST_DECODE` is read when the module is imported: a fresh copy of the module (the one in
    `sys.modules` stays as it is) runs its code under each value, as an import in a new process would."""
    spec = importlib.util.find_spec("hf_paged.attention.fast_decode")
    for value, expected in (("0", False), ("1", True)):
        monkeypatch.setenv("HF_PAGED_FAST_DECODE", value)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.ENABLED is expected


def test_new_prompts_on_a_pool_full_of_cached_blocks_are_read_in_place(models, monkeypatch):
    """One new prompt after another on one pool with prefix caching on: from the second on, every id holds a cached
    block, and the row still takes one run of ids (at the pool's end, cached blocks there moved away), so every
    decode step reads it in place; the tokens stay sdpa's."""
    paged, ref = models
    pool = hf_paged.KVPool(paged.config, block_size=4)
    gen = torch.Generator().manual_seed(13)
    for round_ in range(6):
        ids = torch.randint(1, 128, (1, 10 + 3 * round_), generator=gen)
        counts = _count(monkeypatch)
        with pool.new_cache(ids) as cache:
            out = paged.generate(ids, **hf_paged.cache_kwargs(cache), max_new_tokens=9, do_sample=False)
        assert counts["fast"] == 8 * 4 and counts["gathered"] == 0, (round_, counts)
        assert torch.equal(out, ref.generate(ids, max_new_tokens=9, do_sample=False))
        monkeypatch.undo()
    assert pool.stats().evictions > 0 and pool.allocators[0].num_moves > 0  # (the pool did fill with cached blocks)
    pool.check()
