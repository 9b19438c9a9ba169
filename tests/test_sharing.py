"""Prefix sharing: copy-on-write forks, beams, parallel samples, prefix caching across calls (issue 4)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.attention import dispatch, torch_meta
from hf_paged.attention.torch_meta import row_runs
from hf_paged.memory.pool import BlockPool
from helpers import generate_both, left_padded, load, max_logit_diff, saved_model
from matrix import MODELS, saved_case


@pytest.fixture(scope="module")
def models():
    path = saved_model("llama")
    return load(path, "paged"), load(path, "sdpa")


class _CopyCounter:
    """Counts blocks copied by copy-on-write (KVPool.copy_blocks), per call."""

    def __init__(self, monkeypatch):
        self.calls: list[int] = []
        original = BlockPool.copy_blocks

        def counting(pool, group_id, src, dst):
            self.calls.append(len(src))
            return original(pool, group_id, src, dst)

        monkeypatch.setattr(BlockPool, "copy_blocks", counting)


def test_beam_search_equals_dynamic_cache_and_copies_only_partial_blocks(models, monkeypatch):
    paged_model, ref_model = models
    counter = _CopyCounter(monkeypatch)
    ids, mask = left_padded([37], seed=11)
    paged, ref, cache = generate_both(
        paged_model, ref_model, input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=30,
        do_sample=False, output_scores=True,
    )
    assert torch.equal(paged.sequences, ref.sequences)
    assert torch.allclose(paged.sequences_scores, ref.sequences_scores, atol=1e-5)
    # Each forward copies at most one (partial, shared) block per beam, never a full history.
    assert counter.calls and max(counter.calls) <= 4
    cache.pool.check()


def test_beam_sampling_equals_dynamic_cache(models):
    paged_model, ref_model = models
    ids, mask = left_padded([21], seed=12)
    paged, ref, _ = generate_both(
        paged_model, ref_model, seed=3, input_ids=ids, attention_mask=mask, num_beams=3, do_sample=True,
        max_new_tokens=16,
    )
    assert torch.equal(paged.sequences, ref.sequences)


def test_parallel_samples_store_the_prompt_once(models):
    paged_model, ref_model = models
    ids, mask = left_padded([400], seed=13)
    paged, ref, cache = generate_both(
        paged_model, ref_model, seed=5, input_ids=ids, attention_mask=mask, num_return_sequences=8,
        do_sample=True, max_new_tokens=16,
    )
    assert torch.equal(paged.sequences, ref.sequences)
    stats = cache.stats()
    # 400 prompt tokens = 25 full blocks stored once; each sample owns the one block of its 15 tokens.
    assert stats.blocks_shared == 25
    assert stats.blocks_in_use == 25 + 8
    dynamic = DynamicCache()
    torch.manual_seed(5)
    ref_model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(dynamic), num_return_sequences=8, do_sample=True, max_new_tokens=16, pad_token_id=0)
    assert stats.bytes_in_use <= 0.25 * hf_paged.contiguous_cache_bytes(dynamic)
    cache.pool.check()


def test_sharing_off_gives_the_same_outputs(models):
    paged_model, _ = models
    ids, mask = left_padded([40], seed=14)
    kw = dict(input_ids=ids, attention_mask=mask, num_return_sequences=4, do_sample=True, max_new_tokens=12, pad_token_id=0)
    torch.manual_seed(9)
    shared = paged_model.generate(**hf_paged.cache_kwargs(hf_paged.PagedCache()), **kw)
    torch.manual_seed(9)
    unshared = paged_model.generate(**hf_paged.cache_kwargs(hf_paged.PagedCache(dedupe_rows=False)), **kw)
    assert torch.equal(shared, unshared)


@torch.no_grad()
def test_fork_shares_blocks_and_copies_on_write(models):
    paged_model, ref_model = models
    ids, mask = left_padded([37], seed=15)
    cache = hf_paged.PagedCache()
    paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache))
    fork = cache.fork()
    assert fork.block_tables() == cache.block_tables() and fork.seq_lens == cache.seq_lens == [37]
    pool = cache.pool
    assert pool.stats().blocks_shared == 3  # 37 tokens: 2 full + 1 partial, all shared
    a = torch.tensor([[5]])
    b = torch.tensor([[9]])
    out_a = paged_model(input_ids=a, **hf_paged.cache_kwargs(cache)).logits
    out_b = paged_model(input_ids=b, **hf_paged.cache_kwargs(fork)).logits
    # the partial block was copied for one of them; the full blocks stay shared
    assert cache.block_table(0)[:2] == fork.block_table(0)[:2]
    assert cache.block_table(0)[2] != fork.block_table(0)[2]
    pool.check()
    ref = DynamicCache()
    ref_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(ref))
    import copy

    ref2 = copy.deepcopy(ref)
    assert torch.allclose(out_a, ref_model(input_ids=a, **hf_paged.cache_kwargs(ref)).logits, atol=1e-4)
    assert torch.allclose(out_b, ref_model(input_ids=b, **hf_paged.cache_kwargs(ref2)).logits, atol=1e-4)
    fork.release()
    cache.release()
    assert pool.stats().blocks_in_use == 0
    pool.check()


def test_pickling_a_cache_says_what_to_do_instead():
    """Its K/V live in a pool's blocks: `pickle` and `torch.save` refuse with the in-process copy and the way to
    resume elsewhere, not an error about a lock or a weak reference."""
    import io
    import pickle

    cache = hf_paged.PagedCache()
    with pytest.raises(TypeError, match=r"cannot be pickled.*copy\.deepcopy\(cache\).*KVPool\.new_cache"):
        pickle.dumps(cache)
    with pytest.raises(TypeError, match="cannot be pickled"):
        torch.save(cache, io.BytesIO())


def test_pool_prefix_hit_computes_only_the_suffix(models):
    paged_model, _ = models
    pool = hf_paged.KVPool(block_size=16)
    prefix = torch.randint(1, 128, (1, 100))
    prompt = torch.cat([prefix, torch.randint(1, 128, (1, 7))], dim=1)
    with pool.new_cache(prompt) as cold:
        assert cold.get_seq_length() == 0
        first = paged_model.generate(prompt, **hf_paged.cache_kwargs(cold), max_new_tokens=12, do_sample=False, pad_token_id=0)
    stats = pool.stats()
    assert stats.blocks_cached == 6  # 107 prompt tokens -> 6 full blocks indexed, kept after release
    with pool.new_cache(prompt) as warm:
        assert warm.get_seq_length() == 96
        second = paged_model.generate(prompt, **hf_paged.cache_kwargs(warm), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert warm.prefix_hit_tokens == 96
    assert torch.equal(first, second)
    assert pool.stats().prefix_hit_tokens == 96
    pool.check()


@pytest.mark.parametrize("chunk", [5, 16, 33])
def test_chunked_prefill_of_a_new_cache_indexes_its_prompt(models, chunk, recwarn):
    """`prefill_chunk_size` feeds the prompt in several forwards: its blocks are indexed all the same, and a
    later cache of the same prompt hits them (after a hit, the rest is chunked too)."""
    paged_model, ref_model = models
    pool = hf_paged.KVPool(block_size=16)
    prompt = torch.randint(1, 128, (1, 70), generator=torch.Generator().manual_seed(chunk))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, prefill_chunk_size=chunk)
    expected = ref_model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for hit in (0, 64):
        with pool.new_cache(prompt) as cache:
            assert cache.get_seq_length() == hit
            out = paged_model.generate(prompt, **hf_paged.cache_kwargs(cache), **kwargs)
        assert torch.equal(out, expected)
        assert pool.stats().blocks_cached == 4  # 70 prompt tokens -> 4 full blocks
    assert not [w for w in recwarn if "prepared for prompts" in str(w.message)]
    pool.check()


def test_prefix_hits_in_a_left_padded_batch(models):
    paged_model, ref_model = models
    pool = hf_paged.KVPool(block_size=16)
    shared = torch.randint(1, 128, (40,))
    rows = [torch.cat([shared, torch.randint(1, 128, (n,))]) for n in (3, 20)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    with pool.new_cache(ids[1:], mask[1:]) as warmup:
        paged_model.generate(ids[1:], attention_mask=mask[1:], **hf_paged.cache_kwargs(warmup), max_new_tokens=2, do_sample=False, pad_token_id=0)
    cache = pool.new_cache(ids, mask)
    # row 0 (17 pads) finds 2 blocks (17 + 32 columns), row 1 (no pad) finds 3 (48 columns): generate
    # sees one length, the minimum, so row 0 keeps 31 of its tokens (the last block partially).
    assert cache.get_seq_length() == 48
    assert cache.seq_lens == [31, 48]
    out = paged_model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), max_new_tokens=10, do_sample=False, pad_token_id=0)
    ref = ref_model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    cache.release()
    pool.check()


@pytest.mark.parametrize("read", ["sdpa", "mla"])
def test_a_gathered_left_padded_batch_indexes_no_block_of_its_padding(models, read):
    """A cache read gathered (an sdpa model, or an MLA model whose `"paged"` attention reads it gathered) stores
    every column of a left-padded batch, padding included: the padded row's blocks start with padding, so none of
    them is indexed under its tokens (a later prompt starting with them misses instead of reading padding K/V),
    and `commit_tokens` takes its sequences. The unpadded row is indexed as always."""
    if read == "sdpa":
        model, ref = models[1], models[1]
    else:
        path = saved_case(next(case for case in MODELS if case.model_type == "deepseek_v3"))
        model, ref = load(path, "paged"), load(path, "eager")
    pool = hf_paged.KVPool(model.config, block_size=4)
    gen = torch.Generator().manual_seed(3)
    long, short = torch.randint(3, 128, (23,), generator=gen), torch.randint(3, 128, (6,), generator=gen)
    ids = torch.zeros(2, 23, dtype=torch.long)
    ids[0], ids[1, 17:] = long, short
    mask = (ids != 0).long()
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with pool.new_cache(ids, mask, model=model) as cache:
        out = model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), **options)
        assert cache.mode == "gather" and cache.seq_lens == [28, 28]
        cache.commit_tokens(out)
    assert torch.equal(out, ref.generate(ids, attention_mask=mask, **options))
    for prompt, hit in ((torch.cat([short, torch.tensor([5, 6, 7])]), 0), (long, 20)):
        with pool.new_cache(prompt[None], model=model) as cache:
            assert cache.prefix_hit_tokens == hit
            got = model.generate(prompt[None], **hf_paged.cache_kwargs(cache), **options)
        assert torch.equal(got, ref.generate(prompt[None], **options))
    pool.check()


def test_salt_keeps_tenants_apart(models):
    paged_model, _ = models
    pool = hf_paged.KVPool(block_size=16)
    prompt = torch.randint(1, 128, (1, 70))
    with pool.new_cache(prompt, salt="alice") as cache:
        paged_model.generate(prompt, **hf_paged.cache_kwargs(cache), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert pool.new_cache(prompt, salt="bob").get_seq_length() == 0
    assert pool.new_cache(prompt).get_seq_length() == 0
    assert pool.new_cache(prompt, salt="alice").get_seq_length() == 64


def test_lru_eviction_only_when_free_blocks_run_out(models):
    paged_model, _ = models
    pool = hf_paged.KVPool(block_size=16, num_blocks=12)
    prompts = [torch.randint(1, 128, (1, 48)) for _ in range(3)]
    for prompt in prompts[:2]:  # 3 full blocks each are indexed, 4 blocks used while running
        with pool.new_cache(prompt) as cache:
            paged_model.generate(prompt, **hf_paged.cache_kwargs(cache), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert pool.stats().blocks_cached == 6 and pool.stats().evictions == 0
    with pool.new_cache(prompts[0]) as cache:  # touch prompt 0: now the most recently used
        assert cache.get_seq_length() == 32  # whole blocks, and the last prompt token left: its block is recomputed
    with pool.new_cache(prompts[2]) as cache:
        # 8 blocks: 6 free, then the two least recently used. A finished row's blocks are cached last block
        # first, so those are prompt 0's last block (untouched: its hit ends before it) and prompt 1's last, not
        # prompt 1's first (which would take every hit on prompt 1 with it)
        paged_model.generate(prompts[2], **hf_paged.cache_kwargs(cache), min_new_tokens=76, max_new_tokens=76, do_sample=False, pad_token_id=0)
    assert pool.stats().evictions == 2
    # both prompts keep their hits: a prompt's last block is never a hit for the same prompt
    assert pool.new_cache(prompts[0]).get_seq_length() == 32
    assert pool.new_cache(prompts[1]).get_seq_length() == 32
    pool.check()


def test_batches_on_a_pool_full_of_cached_blocks_stay_rows_in_runs(models, monkeypatch):
    """Round after round of new prompts (no hits) on one pool with prefix caching on: the pool's ids all hold
    cached blocks after the first round, yet every round's rows are one run of ids each at one stride, prefill
    and growth alike (cached blocks in their way are moved), so the PyTorch path reads them in place. The same
    digests are dropped as by a pool that does not move (hit rates do not change), and the tokens are sdpa's."""
    paged_model, ref_model = models
    reads = []
    original = torch_meta.torch_inputs

    def recorded(plan, *args, **kwargs):
        inputs = original(plan, *args, **kwargs)
        reads.append(inputs.meta.contiguous_start is not None)
        return inputs

    monkeypatch.setattr(dispatch, "torch_inputs", recorded)
    moving, still = hf_paged.KVPool(block_size=4), hf_paged.KVPool(block_size=4)
    for round_ in range(3):
        ids = torch.randint(1, 128, (3, 10), generator=torch.Generator().manual_seed(round_))
        tables, outs, in_place = {}, {}, {}
        for pool in (moving, still):
            reads.clear()
            with pool.new_cache(ids) as cache:
                outs[pool] = paged_model.generate(ids, **hf_paged.cache_kwargs(cache), max_new_tokens=11, do_sample=False)
                tables[pool], in_place[pool] = cache.block_tables(), all(reads[1:])  # (decode steps)
            for allocator in still.allocators or []:
                allocator.on_move = None  # (the allocators exist from the first forward on)
            pool.check()
        assert torch.equal(outs[moving], ref_model.generate(ids, max_new_tokens=11, do_sample=False))
        assert torch.equal(outs[still], outs[moving])
        assert row_runs(tables[moving]) is not None and in_place[moving], (round_, tables[moving])
        if round_:  # without moves the rows are scattered: what the test guards
            assert row_runs(tables[still]) is None and not in_place[still]
        assert set(moving.allocators[0].index) == set(still.allocators[0].index)
        assert moving.stats().evictions == still.stats().evictions
    assert moving.stats().evictions > 0 and moving.allocators[0].num_moves > 0 and still.allocators[0].num_moves == 0


def test_multi_turn_chat_reuses_the_conversation(models):
    paged_model, ref_model = models
    pool = hf_paged.KVPool(block_size=16)
    conversation = torch.randint(1, 128, (1, 30))
    for turn in range(3):
        with pool.new_cache(conversation) as cache:
            reused = cache.get_seq_length()
            out = paged_model.generate(conversation, **hf_paged.cache_kwargs(cache), max_new_tokens=20, do_sample=False, pad_token_id=0)
            cache.commit_tokens(out)
        ref = ref_model.generate(conversation, max_new_tokens=20, do_sample=False, pad_token_id=0)
        assert torch.equal(out, ref)
        if turn:
            assert reused >= (conversation.shape[1] - 20 - 5) // 16 * 16 - 16
        conversation = torch.cat([out, torch.randint(1, 128, (1, 5))], dim=1)
    pool.check()


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("mistral", {"sliding_window": 32}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1}),
    ],
    ids=["all-sliding", "hybrid-full-and-sliding"],
)
def test_prefix_hit_on_sliding_window_models(model_type, overrides):
    """Sliding groups free blocks out of the window; a hit needs only the last window's blocks there."""
    path = saved_model(model_type, **overrides)
    paged_model, ref_model = load(path, "paged"), load(path, "sdpa")
    pool = hf_paged.KVPool(block_size=16)
    prompt = torch.randint(1, 128, (1, 200))
    with pool.new_cache(prompt) as cold:
        first = paged_model.generate(prompt, **hf_paged.cache_kwargs(cold), max_new_tokens=8, do_sample=False, pad_token_id=0)
        sliding = [g.group_id for g in pool.layout.groups if g.sliding_window is not None]
        sliding_layers = [layer for g in sliding for layer in pool.layers_of_group(g)]
        assert sliding_layers and all(cold.block_table(0, layer)[0] == -1 for layer in sliding_layers)  # freed
    with pool.new_cache(prompt) as warm:
        assert warm.get_seq_length() == 192
        second = paged_model.generate(prompt, **hf_paged.cache_kwargs(warm), max_new_tokens=8, do_sample=False, pad_token_id=0)
        pool.check()
    ref = ref_model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(first, ref) and torch.equal(second, ref)


def test_pool_built_from_a_sibling_config_follows_the_calling_model(models, recwarn):
    """The attention that reads a cache is the calling model's, not the one whose config built the pool."""
    paged_model, ref_model = models
    pool = hf_paged.KVPool(ref_model.config)  # an sdpa model's config
    prompt = torch.randint(1, 128, (1, 60))
    with pool.new_cache(prompt) as cache:
        paged_model.generate(prompt, **hf_paged.cache_kwargs(cache), max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert cache.mode == "paged"
    with pool.new_cache(prompt) as cache:  # a prefix hit, read by the sdpa model: gathered, still correct
        assert cache.get_seq_length() == 48
        out = ref_model.generate(prompt, **hf_paged.cache_kwargs(cache), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert cache.mode == "gather"
    assert torch.equal(out, ref_model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))
    with pool.new_cache(prompt) as cache:  # and by the paged model: paged, from the first layer on
        out = paged_model.generate(prompt, **hf_paged.cache_kwargs(cache), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert cache.mode == "paged"
    assert torch.equal(out, ref_model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))
    assert not [w for w in recwarn if "not a hf_paged.PagedCache" in str(w.message)]
    pool.check()


def test_max_memory_as_a_share_of_free_memory(models, monkeypatch):
    """`max_memory="N%"` sizes a fixed pool up front from the free memory of each device holding layers."""
    from hf_paged.memory import budget

    paged_model, _ = models
    free = {"cpu": 10 * 2**20, "meta": 2**20}
    monkeypatch.setattr(budget, "free_memory", lambda device: free[device.type])
    cfg = paged_model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    block_bytes = 16 * cfg.num_key_value_heads * head_dim * 4 * 2  # K and V, float32, one layer
    pool = hf_paged.KVPool.for_model(paged_model, max_memory="50%")
    with pool.new_cache() as cache:
        paged_model(input_ids=torch.tensor([[5, 6, 7]]), **hf_paged.cache_kwargs(cache))
        assert pool.stats().blocks_total == (5 * 2**20) // (block_bytes * cfg.num_hidden_layers)
    # Layers on a second device with less free memory: the smaller budget decides.
    devices = {i: torch.device("meta" if i % 2 else "cpu") for i in range(cfg.num_hidden_layers)}
    per_device = block_bytes * cfg.num_hidden_layers // 2
    assert budget.blocks_in_budget(0.5, block_bytes, range(cfg.num_hidden_layers), devices, torch.device("cpu")) == (
        2**19 // per_device
    )
    for bad in ("0%", "150%", "x%", -1, 1.5, True):
        with pytest.raises(ValueError, match="max_memory"):
            hf_paged.KVPool(cfg, max_memory=bad)
    with pytest.raises(ValueError, match="cannot hold one block"):
        budget.blocks_in_budget(1e-9, block_bytes, range(2), {}, torch.device("cpu"))
