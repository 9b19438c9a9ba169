"""Architecture matrix: every model of `tests/matrix.py` gives the same results with PagedCache + "paged" as
with DynamicCache + sdpa (or eager), or raises the documented clear error. No case is skipped: `make test` runs the
cells of `matrix.MAKE_TEST`, `make test-models` the others (marked `models`)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged import UnsupportedModelError

from helpers import left_padded, tiered
from matrix import (
    HYBRIDS,
    MAKE_TEST,
    MODELS,
    PASS,
    VIA_CONFIG,
    VIA_GENERATE,
    VIA_LOAD,
    Case,
    failing,
    load,
    reference_attention,
    passing,
    saved,
    saved_case,
    tiny_config,
)

LENGTHS = [5, 11, 2]  # left-padded batch: rows of different lengths, one shorter than a block
BLOCK_SIZE = 4
NEW_TOKENS = 9  # prompt + output exceed the sliding window (8) and end mid-block
ATOL = 1e-4  # fp32: per-step logits of the paged path vs the reference


def _prompts():
    return left_padded(LENGTHS, seed=1, low=3)


def run_both(path, ref: str, seed: int = 0, **kwargs):
    """generate() with PagedCache + "paged" and with DynamicCache + `ref`, same seed and inputs."""
    ids, mask = _prompts()
    common = dict(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=0,
        eos_token_id=None,  # random weights: never stop early, compare every step
    )
    common.update(kwargs)
    paged_model, ref_model = load(path, "paged"), load(path, ref)
    cache = hf_paged.PagedCache(block_size=BLOCK_SIZE)
    torch.manual_seed(seed)
    paged = paged_model.generate(**hf_paged.cache_kwargs(cache), **common)
    torch.manual_seed(seed)
    reference = ref_model.generate(**hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)), **common)
    return paged, reference, cache


def assert_same(paged, reference, atol: float = ATOL) -> None:
    assert len(paged.logits) == len(reference.logits) == NEW_TOKENS
    for step, (a, b) in enumerate(zip(paged.logits, reference.logits, strict=True)):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")
    assert torch.equal(paged.sequences, reference.sequences)


def check_cell(case: Case, **kwargs) -> None:
    paged, reference, cache = run_both(saved_case(case), case.ref, **kwargs)
    assert_same(paged, reference)
    assert cache.mode == case.mode, f"{case.id} ran through {cache.mode!r}, the matrix says {case.mode!r}"
    cache.pool.check()
    stats = cache.stats()
    assert stats.blocks_in_use > 0 and stats.tokens_stored > 0


@pytest.mark.parametrize("case", tiered(passing(), MAKE_TEST))
def test_greedy_left_padded(case: Case) -> None:
    check_cell(case, do_sample=False)


@pytest.mark.parametrize("case", tiered(passing(), MAKE_TEST))
def test_sampling(case: Case) -> None:
    check_cell(case, do_sample=True, top_k=0, top_p=1.0, temperature=1.0, seed=7)


@pytest.mark.parametrize("case", tiered([c for c in passing() if c.model_type in HYBRIDS], MAKE_TEST))
def test_prompt_lookup_on_hybrids(case: Case) -> None:
    """Assisted decoding (here prompt lookup) crops rejected drafts: on a hybrid model the cache steps its recurrent
    states back through the past it records (transformers 5.25 on) and gives greedy decoding's tokens, leaving
    exactly the accepted ones. (transformers' own cache, when a round rejects all its drafts, restores the state
    from before the round: on jamba and olmo_hybrid its tokens here differ from greedy decoding's.) A second turn
    on the returned cache, whose first forward feeds the whole prompt again, starts its recurrent layers from no
    state and gives greedy decoding's tokens too. Where transformers' own cache cannot crop the model (or, before
    5.25, refuses stateful models), ours refuses with a clear error."""
    path = saved_case(case)
    paged_model, ref_model = load(path, "paged"), load(path, case.ref)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    common = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                  prompt_lookup_num_tokens=3, pad_token_id=0, eos_token_id=None)
    try:
        ref_model.generate(**hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)), **common)
        refused = False
    except (ValueError, IndexError):  # stateful models refused (up to 5.24), or a layer that cannot crop (zamba)
        refused = True
    cache = hf_paged.PagedCache(paged_model.config, block_size=BLOCK_SIZE)
    if refused:
        with pytest.raises(ValueError, match="Assisted decoding requires a cache that can be cropped"):
            paged_model.generate(**hf_paged.cache_kwargs(cache), **common)
        return
    paged = paged_model.generate(**hf_paged.cache_kwargs(cache), **common)
    greedy = {k: v for k, v in common.items() if k != "prompt_lookup_num_tokens"}
    reference = ref_model.generate(**hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)), **greedy)
    assert torch.equal(paged, reference)
    assert cache.get_seq_length() == paged.shape[1] - 1  # crop() left exactly the accepted tokens
    cache.pool.check()
    ids2 = torch.cat([paged, ids[:, :3]], dim=1)
    second = dict(common, input_ids=ids2, attention_mask=torch.ones_like(ids2))
    paged2 = paged_model.generate(**hf_paged.cache_kwargs(cache), **second)
    greedy2 = {k: v for k, v in second.items() if k != "prompt_lookup_num_tokens"}
    assert torch.equal(paged2, ref_model.generate(**hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)), **greedy2))
    assert cache.get_seq_length() == paged2.shape[1] - 1
    cache.pool.check()


def _unsupported_cells() -> list:
    names = {VIA_CONFIG: "config", VIA_GENERATE: "generate", VIA_LOAD: "load"}
    return [
        pytest.param(case, via, id=f"{case.id}-{names[via]}", marks=() if case.id in MAKE_TEST else pytest.mark.models)
        for case in failing()
        for via in case.via
    ]


@pytest.mark.parametrize(("case", "via"), _unsupported_cells())
def test_unsupported_raises_clear_error(case: Case, via: str) -> None:
    """Unsupported models raise UnsupportedModelError naming the problem and the alternative."""
    if via == VIA_CONFIG:
        config = tiny_config(case.model_type, case.config)
        with pytest.raises(UnsupportedModelError) as info:
            hf_paged.PagedCache(config=config)
        assert repr(case.model_type) in str(info.value)  # names the model type
    elif via == VIA_LOAD:
        with pytest.raises(UnsupportedModelError) as info:
            load(saved_case(case), "paged")
        assert repr(case.model_type) in str(info.value)
    else:
        model = load(saved_case(case), "paged")
        ids = torch.randint(3, 128, (2, 6))
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, pad_token_id=0)
        if model.config.is_encoder_decoder:
            kwargs["decoder_start_token_id"] = 0
        with pytest.raises(UnsupportedModelError) as info:
            model.generate(**hf_paged.cache_kwargs(hf_paged.PagedCache()), **kwargs)
    message = str(info.value)
    assert re.search(case.error, message), message
    assert "sdpa" in message or "default cache" in message or "is_decoder" in message  # says what to use


def test_matrix_is_well_formed() -> None:
    ids = [case.id for case in MODELS]
    assert len(ids) == len(set(ids)), "duplicate ids in the matrix"
    required = {"llama", "mistral", "qwen2", "gemma2", "gemma3_text", "phi3", "gpt_neox", "opt", "gpt2"}
    assert required <= {case.model_type for case in passing()}
    assert {case.expect for case in MODELS} <= {PASS, "unsupported"}
    assert MAKE_TEST <= set(ids), "a cell of make test's slice is not in the matrix"
    for case in failing():
        assert case.error and case.via


# A model type not in the matrix, e.g. picked by a reviewer: `HF_PAGED_EXTRA_MODELS=olmo3,cohere2_moe`.
_EXTRA = [t for t in os.environ.get("HF_PAGED_EXTRA_MODELS", "").split(",") if t]


@pytest.mark.parametrize("model_type", _EXTRA or ["helium"])
def test_extra_model_type(model_type: str) -> None:
    """Any decoder-only model type through AttentionInterface, with the generic tiny config and no code change."""
    path = saved(model_type, (("sliding_window", 8),) if hasattr(tiny_config(model_type), "sliding_window") else ())
    ref = reference_attention(tiny_config(model_type))
    paged, reference, _ = run_both(path, ref, do_sample=False)
    assert_same(paged, reference)


@pytest.mark.parametrize(
    "case", tiered([c for c in passing() if "num_kv_shared_layers" in c.config], {"gemma4_text"}), ids=lambda c: c.id
)
def test_layers_reusing_kv_attend_over_the_earlier_layers_blocks(case: Case) -> None:
    """Layers that reuse an earlier layer's K/V (Gemma 3n, Gemma 4) attend under `"paged"` over that layer's
    blocks and store nothing: eager's tokens with a configured and a config-less PagedCache on a left-padded batch
    (Gemma 4 then keeps only the last query in those layers and cuts its masks to it), after a KVPool prefix hit, and
    through the Engine's packed steps (its compiled step: `test_graph_decode.py`)."""
    path = saved_case(case)
    paged, eager = load(path, "paged"), load(path, "eager")
    ids, mask = left_padded([13, 6, 9], seed=3, low=3)
    options = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = eager.generate(ids, attention_mask=mask, **options)
    readers = {2: 0, 3: 1}  # each of the last two layers reads the last earlier layer of its type
    for cache in (hf_paged.PagedCache(config=paged.config, block_size=4), hf_paged.PagedCache(block_size=4)):
        assert torch.equal(paged.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), **options), want)
        assert cache.pool.layout.readers == readers
        assert [cache.pool.layer_storage(i) is None for i in range(4)] == [False, False, True, True]
    pool = hf_paged.KVPool(paged.config, block_size=4)
    for _ in range(2):  # the second call serves the first 12 prompt tokens from the first call's blocks
        cache = pool.new_cache(ids[:1])
        assert torch.equal(paged.generate(ids[:1], **hf_paged.cache_kwargs(cache), **options), want[:1])
        cache.release()
    assert pool.stats().prefix_hit_rate > 0
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    engine = hf_paged.Engine(paged, max_seqs=2)  # three requests: one joins while the others decode
    assert engine.generate(prompts, max_new_tokens=10) == [
        row[ids.shape[1]:].tolist() for row in want
    ]


def test_gemma4_prefill_attends_only_the_kept_queries_in_layers_reusing_kv(monkeypatch) -> None:
    """In a prefill, Gemma 4 keeps only the last query in the layers that reuse K/V: those layers attend that one
    query per row over the rows' blocks (not the whole prompt's queries), with eager's tokens."""
    from hf_paged.cache import paged_cache  # noqa: PLC0415

    case = next(c for c in passing() if c.model_type == "gemma4_text")
    path = saved_case(case)
    paged, eager = load(path, "paged"), load(path, "eager")
    ids, mask = left_padded([13, 6, 9], seed=5, low=3)
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    widths: list[int] = []
    attend_stored = paged_cache.attend_stored

    def recorded(pool, plan, *args):
        widths.append(plan.q_len)
        return attend_stored(pool, plan, *args)

    monkeypatch.setattr(paged_cache, "attend_stored", recorded)
    cache = hf_paged.PagedCache(block_size=4)
    got = paged.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), **options)
    assert torch.equal(got, eager.generate(ids, attention_mask=mask, **options))
    assert widths == [1] * 2 * 4  # two reading layers, one prefill and three decode steps: one column each


def test_the_plan_of_a_forwards_last_columns() -> None:
    """`ForwardPlan.last_columns`: the same rows, tables and lengths, each row's real new tokens cut to the width,
    nothing written, and the facts that choose a path (padding after a real token) kept; refused with reordered
    columns."""
    from hf_paged.attention.plan import ForwardPlan, GroupPlan  # noqa: PLC0415

    group = GroupPlan([[3, 4, 7], [1]], [0, 1], [12, 13], None)
    plan = ForwardPlan(q_len=5, query_lens=[5, 2], seq_lens=[9, 2], groups=[group], block_size=4, num_layers=4,
                       gapped=True, real_tail=2)
    tail = plan.last_columns(3)
    assert (tail.q_len, tail.query_lens, tail.seq_lens, tail.real_tail, tail.gapped) == (3, [3, 2], [9, 2], 2, True)
    assert tail.groups[0].tables == [[3, 4, 7], [1]] and tail.groups[0].write_slots == []
    assert plan.last_columns(3) is tail
    plan.column_order = torch.zeros(2, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match="last 4 columns"):
        plan.last_columns(4)
