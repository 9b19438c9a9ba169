"""Never silently wrong: the cases that used to give wrong output without an error, on several families.

Each compares PagedCache + "paged" with transformers' own cache + a reference attention: equal tokens and
per-step logits, or (only where a paged cache cannot be right) a clear error before anything is stored.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_paged

from helpers import load, left_padded, max_logit_diff, saved_model

ATOL = 1e-3
#: (model type, config overrides, reference attention)
FAMILIES = {
    "llama": ({}, "sdpa"),
    "mistral": ({"sliding_window": 8}, "sdpa"),
    "qwen2": ({}, "sdpa"),
    "gemma2": ({"sliding_window": 8}, "eager"),
    "qwen3": ({}, "sdpa"),
}


def models(family: str):
    overrides, ref = FAMILIES[family]
    path = saved_model(family, **overrides)
    return load(path, "paged"), load(path, ref)


def generate_pair(paged_model, ref_model, paged_cache=None, ref_cache=None, **kwargs):
    common = dict(return_dict_in_generate=True, output_logits=True, pad_token_id=0, do_sample=False, **kwargs)
    extra = {} if paged_cache is None else hf_paged.cache_kwargs(paged_cache)
    ref_extra = {} if ref_cache is None else hf_paged.cache_kwargs(ref_cache)
    return paged_model.generate(**extra, **common), ref_model.generate(**ref_extra, **common)


def assert_same(paged, ref) -> None:
    assert torch.equal(paged.sequences, ref.sequences)
    assert max_logit_diff(paged, ref) < ATOL


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_chunked_prefill_over_left_padding(family: str, chunk: int) -> None:
    """One-column (and any-width) forwards over padded rows: padding is never counted as a token."""
    paged_model, ref_model = models(family)
    ids, mask = left_padded([5, 11, 3], seed=chunk)
    cache = hf_paged.PagedCache(block_size=4)
    paged, ref = generate_pair(
        paged_model, ref_model, cache, DynamicCache(config=ref_model.config),
        input_ids=ids, attention_mask=mask, max_new_tokens=6, prefill_chunk_size=chunk,
    )
    assert_same(paged, ref)
    groups = len(cache.pool.layout.groups)  # tokens are counted per block group (sliding, global)
    assert cache.stats().tokens_stored == (sum([5, 11, 3]) + 3 * 5) * groups  # the last new token is never stored
    cache.pool.check()


def _holey_batch(columns: int):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (4, columns), generator=gen)
    mask = torch.ones(4, columns, dtype=torch.long)
    mask[0, columns - 3 :] = 0  # right padding
    mask[1, 3] = 0  # a hole
    mask[2, :2] = 0  # left padding
    mask[3, 1] = mask[3, columns - 1] = 0  # both
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_right_padding_and_holes(family: str) -> None:
    """Store only real tokens: logits on real tokens equal the reference's; a second forward continues."""
    paged_model, ref_model = models(family)
    ids, mask = _holey_batch(7)  # within mistral's window of 8: its columns and tokens agree
    cache, ref = hf_paged.PagedCache(block_size=4), DynamicCache(config=ref_model.config)
    ours = paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache)).logits
    theirs = ref_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(ref)).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=ATOL, rtol=1e-4)
    assert cache.stats().tokens_stored == int(mask.sum())
    cache.pool.check()
    if FAMILIES[family][0].get("sliding_window"):
        return
    nxt = torch.randint(1, 128, (4, 1))
    mask2 = torch.cat([mask, torch.ones(4, 1, dtype=mask.dtype)], dim=1)
    ours = paged_model(input_ids=nxt, attention_mask=mask2, **hf_paged.cache_kwargs(cache)).logits
    theirs = ref_model(input_ids=nxt, attention_mask=mask2, **hf_paged.cache_kwargs(ref)).logits
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=1e-4)


def test_gap_past_a_sliding_window_is_refused_before_anything_is_stored() -> None:
    paged_model, _ = models("mistral")
    ids, mask = _holey_batch(12)  # longer than the window of 8: columns and tokens would disagree
    cache = hf_paged.PagedCache(block_size=4)
    with pytest.raises(ValueError, match="Left-pad the batch"):
        paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache))
    assert cache.get_seq_length() == 0 and cache.stats().tokens_stored == 0
    cache.pool.check()


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_paged_attention_over_static_caches(family: str) -> None:
    """A StaticCache (sliding/hybrid for windowed families) hands back its whole buffer: visibility comes
    from its real length, not from "keys end at the query"."""
    paged_model, ref_model = models(family)
    ids, mask = left_padded([5, 9, 3])
    paged, ref = generate_pair(
        paged_model, ref_model, input_ids=ids, attention_mask=mask, max_new_tokens=6, cache_implementation="static"
    )
    assert_same(paged, ref)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_paged_attention_over_a_dynamic_cache(family: str) -> None:
    paged_model, ref_model = models(family)
    ids, mask = left_padded([5, 12, 3])
    paged, ref = generate_pair(
        paged_model, ref_model, DynamicCache(config=paged_model.config), DynamicCache(config=ref_model.config),
        input_ids=ids, attention_mask=mask, max_new_tokens=12,
    )
    assert_same(paged, ref)


class _CopyingCache(hf_paged.PagedCache):
    """A cache whose update() output is copied (a model calling `.contiguous()` or `.clone()` on K/V)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        key, value = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return key.clone(), value.clone()


class _ChangingCache(hf_paged.PagedCache):
    """A cache whose update() output is changed before the attention sees it."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        key, value = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return key * 2.0, value


def test_hand_off_survives_copies_and_refuses_changes() -> None:
    paged_model, ref_model = models("llama")
    ids, mask = left_padded([5, 9, 3])
    cache = _CopyingCache(config=paged_model.config)
    paged, ref = generate_pair(
        paged_model, ref_model, cache, DynamicCache(config=ref_model.config),
        input_ids=ids, attention_mask=mask, max_new_tokens=5,
    )
    assert_same(paged, ref)
    assert cache.mode == "paged" and cache.stats().tokens_stored > 0
    changing = _ChangingCache(config=paged_model.config)
    with pytest.raises(hf_paged.UnsupportedModelError, match="changes the K/V"):
        paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(changing))
    assert changing.get_seq_length() == 0
    changing.pool.check()


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_prompt_lookup_and_assisted_decoding_of_any_draft_length_on_sliding_windows(family: str) -> None:
    paged_model, ref_model = models(family)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 12, (1, 60), generator=gen)  # repetitive: long lookups hit
    cache = hf_paged.PagedCache(block_size=4)
    paged, ref = generate_pair(
        paged_model, ref_model, cache, DynamicCache(config=ref_model.config),
        input_ids=ids, max_new_tokens=90, prompt_lookup_num_tokens=100,
    )
    assert torch.equal(paged.sequences, ref.sequences)
    cache.pool.check()
    draft_path = saved_model(family, scale=3.0, num_hidden_layers=1, **FAMILIES[family][0])
    paged_draft, ref_draft = load(draft_path, "paged"), load(draft_path, FAMILIES[family][1])
    cache = hf_paged.PagedCache(block_size=4)
    assisted = dict(input_ids=ids, max_new_tokens=90, do_sample=False, pad_token_id=0,
                    num_assistant_tokens=80, num_assistant_tokens_schedule="constant")
    paged = paged_model.generate(assistant_model=paged_draft, **hf_paged.cache_kwargs(cache), **assisted)
    ref = ref_model.generate(assistant_model=ref_draft, **assisted)
    assert torch.equal(paged, ref)
    cache.pool.check()


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_output_attentions_returns_the_weights(family: str) -> None:
    """Weights laid out like the reference cache's (padding columns zero), equal on real queries."""
    overrides, _ = FAMILIES[family]
    path = saved_model(family, **overrides)
    paged_model, eager_model = load(path, "paged"), load(path, "eager")
    ids, mask = left_padded([5, 9, 3])
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0, do_sample=False,
                  output_attentions=True, return_dict_in_generate=True)
    paged = paged_model.generate(**hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=4)), **common)
    ref = eager_model.generate(**hf_paged.cache_kwargs(DynamicCache(config=eager_model.config)), **common)
    assert torch.equal(paged.sequences, ref.sequences)
    assert len(paged.attentions) == len(ref.attentions)
    for step, (ours, theirs) in enumerate(zip(paged.attentions, ref.attentions, strict=True)):
        for a, b in zip(ours, theirs, strict=True):
            assert a.shape == b.shape
            real_queries = mask.bool()[:, None, :, None] if step == 0 else torch.ones(1, dtype=torch.bool)
            torch.testing.assert_close(a * real_queries, b * real_queries, atol=1e-4, rtol=1e-4)


def test_an_interrupted_forward_leaves_no_hand_off_behind() -> None:
    """A layer that raises between update() and the attention must not leak its K/V into the next forward,
    even one over another cache."""
    paged_model, ref_model = models("llama")
    ids, mask = left_padded([5, 9, 3])
    calls = {"n": 0}

    def boom(module, args, kwargs):
        calls["n"] += 1
        raise RuntimeError("boom")

    attn = paged_model.model.layers[0].self_attn
    hook = attn.o_proj.register_forward_pre_hook(boom, with_kwargs=True)  # after update() and the attention
    try:
        with pytest.raises(RuntimeError, match="boom"):
            paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(hf_paged.PagedCache()))
    finally:
        hook.remove()
    original = attn.forward

    def update_then_raise(*args, **kwargs):  # stage a slot, then fail before the attention takes it
        cache = kwargs.get(hf_paged.CACHE_KWARG)
        hidden = args[0] if args else kwargs["hidden_states"]
        shape = (*hidden.shape[:-1], -1, attn.head_dim)
        cache.update(attn.k_proj(hidden).view(shape).transpose(1, 2), attn.v_proj(hidden).view(shape).transpose(1, 2), 0)
        raise RuntimeError("between")

    attn.forward = update_then_raise
    try:
        with pytest.raises(RuntimeError, match="between"):
            paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(hf_paged.PagedCache(config=paged_model.config)))
    finally:
        attn.forward = original
    paged, ref = generate_pair(
        paged_model, ref_model, DynamicCache(config=paged_model.config), DynamicCache(config=ref_model.config),
        input_ids=ids, attention_mask=mask, max_new_tokens=4,
    )
    assert_same(paged, ref)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_from_right_padded_prompts(family: str) -> None:
    """The last column of a right-padded row is padding; its query sees the row's real tokens, as in
    transformers' masks, so the first generated token matches."""
    paged_model, ref_model = models(family)
    ids = torch.tensor([[5, 6, 0, 0], [7, 8, 9, 10], [11, 12, 13, 0]])
    cache = hf_paged.PagedCache(block_size=4)
    paged, ref = generate_pair(
        paged_model, ref_model, cache, DynamicCache(config=ref_model.config),
        input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=5,
    )
    assert_same(paged, ref)
    cache.pool.check()


def test_a_refused_crop_changes_nothing() -> None:
    paged_model, ref_model = models("mistral")
    ids = torch.tensor([[0, 0, 5, 5, 5], [7, 7, 7, 7, 7]])
    mask = (ids != 0).long()
    cache = hf_paged.PagedCache(block_size=4)
    out = paged_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=80, do_sample=False, pad_token_id=0,
                               eos_token_id=None,
                               **hf_paged.cache_kwargs(cache))
    cache.crop(0)
    before = (cache.get_seq_length(), cache.block_tables())
    with pytest.raises(ValueError, match="steps back further"):
        cache.crop(-70)
    after = (cache.get_seq_length(), cache.block_tables())
    assert before == after
    cache.pool.check()
    more = torch.cat([out, torch.tensor([[20], [22]])], dim=1)
    more_mask = torch.cat([mask, torch.ones(2, more.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    paged, ref = generate_pair(
        paged_model, ref_model, cache, DynamicCache(config=ref_model.config),
        input_ids=more, attention_mask=more_mask, max_new_tokens=3,
    )
    assert torch.equal(paged.sequences[:, -3:], ref.sequences[:, -3:])


def test_crop_over_padding_after_real_tokens_is_refused() -> None:
    """crop(-n) removes n columns; over a hole a paged cache cannot tell how many tokens those were."""
    paged_model, _ = models("llama")
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 3] = 0
    cache = hf_paged.PagedCache(block_size=4)
    paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache))
    cache.crop(-2)  # the last 2 columns are real in every row: exact
    assert cache.get_seq_length() == 4
    with pytest.raises(ValueError, match="reaches back over padding"):
        cache.crop(-1)
    assert cache.get_seq_length() == 4
    cache.pool.check()


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_continue_after_right_padding_equals_a_continued_dynamic_cache(family: str) -> None:
    """A returned cache continued after right padding gives what a DynamicCache continued the same way gives.

    transformers' generate() numbers a right-padded row's new tokens from its last column's position (a pad,
    position 0), so a continued cache and a from-scratch recompute of the same ids differ in transformers
    itself (checked below); the paged cache follows the model's `position_ids`, as DynamicCache does."""
    paged_model, ref_model = models(family)
    ids, mask = torch.tensor([[3, 3, 0], [3, 3, 3]]), torch.tensor([[1, 1, 0], [1, 1, 1]])
    cache, ref_cache = hf_paged.PagedCache(block_size=4), DynamicCache(config=ref_model.config)
    first, ref_first = generate_pair(paged_model, ref_model, cache, ref_cache,
                                     input_ids=ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
    assert_same(first, ref_first)
    ids2 = torch.cat([first.sequences[:, :4], torch.tensor([[3], [3]])], dim=1)
    mask2 = torch.cat([mask, torch.ones(2, 2, dtype=torch.long)], dim=1)
    paged, ref = generate_pair(paged_model, ref_model, cache, ref_cache,
                               input_ids=ids2, attention_mask=mask2, max_new_tokens=3, eos_token_id=None)
    assert_same(paged, ref)
    cache.pool.check()
    fresh = ref_model.generate(input_ids=ids2, attention_mask=mask2, max_new_tokens=1, eos_token_id=None,
                               return_dict_in_generate=True, output_logits=True, pad_token_id=0, do_sample=False)
    assert max_logit_diff_row(fresh, ref, row=0) > ATOL  # transformers' own continued vs recomputed


def max_logit_diff_row(a, b, row: int) -> float:
    return (a.logits[0][row] - b.logits[0][row]).abs().max().item()


@pytest.mark.parametrize(("family", "speculative"), [("qwen2", "lookup"), ("mistral", "lookup"), ("llama", "assisted")])
def test_prefix_hit_then_speculative_decoding(family: str, speculative: str) -> None:
    """Assisted and prompt-lookup decoding feed the whole prompt on their first step whatever the cache holds:
    a cache from `pool.new_cache()` releases its prefix hit then (stored once, right positions), so the output
    equals a generate() without any cache. (A DynamicCache pre-filled with the prefix would store it twice.)"""
    paged_model, ref_model = models(family)
    prompt = torch.tensor([[120, 94, 32, 3, 88, 25, 3, 110, 19, 29, 99, 92, 111, 66]])
    warm = torch.tensor([[120, 94, 32, 3, 88, 25, 3, 3, 29]])
    pool = hf_paged.KVPool(paged_model.config, block_size=1)
    with pool.new_cache(warm) as c:
        out = paged_model.generate(input_ids=warm, max_new_tokens=3, do_sample=False, pad_token_id=0,
                                   **hf_paged.cache_kwargs(c))
        c.commit_tokens(out)
    cache = pool.new_cache(prompt)
    assert cache.get_seq_length() == 7
    if speculative == "lookup":
        kwargs = {"prompt_lookup_num_tokens": 2}
    else:
        draft = load(saved_model(family, **FAMILIES[family][0]), "paged")
        kwargs = {"assistant_model": draft}
    paged, ref = generate_pair(paged_model, ref_model, cache, None, input_ids=prompt, max_new_tokens=6, **kwargs)
    assert_same(paged, ref)
    assert cache.stats().prefix_hit_tokens == 0  # the hit was released, and is not reported as served
    pool.check()


def test_sliding_prefix_hit_keeps_the_crop_margin() -> None:
    """After a prefix hit, sliding-window layers hold what a cache that computed the prompt holds (the window
    and up to SLIDING_MARGIN tokens before it), so crop() steps back as far."""
    paged_model, ref_model = models("mistral")  # window 8
    prompt = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    pool = hf_paged.KVPool(paged_model.config, block_size=4)
    with pool.new_cache(prompt) as c:
        out = paged_model.generate(input_ids=prompt, max_new_tokens=2, do_sample=False, pad_token_id=0,
                                   **hf_paged.cache_kwargs(c))
        c.commit_tokens(out)
    longer = torch.cat([prompt, torch.tensor([[7, 8, 9]])], dim=1)
    cache = pool.new_cache(longer)
    assert cache.get_seq_length() == 40
    paged, _ = generate_pair(paged_model, ref_model, cache, None, input_ids=longer, max_new_tokens=2)
    cache.crop(-20)  # back into the prefix, beyond the window
    ids2 = torch.cat([paged.sequences[:, : cache.get_seq_length()], torch.tensor([[5, 6]])], dim=1)
    again, ref = generate_pair(paged_model, ref_model, cache, None, input_ids=ids2, max_new_tokens=4)
    assert_same(again, ref)
    pool.check()


@pytest.mark.parametrize("chunk", [2, 4])
def test_padding_only_forward_of_identical_rows_at_a_block_boundary(chunk: int) -> None:
    """Right-padded identical rows, chunked prefill, block size 1: the last forwards hold padding columns only,
    and every stored token lies in blocks all rows share. A padding query must see those tokens (the shared
    prefix) and nothing else (found by the differential fuzzer)."""
    paged_model, ref_model = models("llama")
    ids = torch.tensor([[3, 3, 3, 3, 3, 3, 4, 4, 5, 5, 0, 0, 0, 0, 0, 0, 0]] * 2)
    mask = (ids != 0).long()
    cache = hf_paged.PagedCache(block_size=1)
    paged, ref = generate_pair(
        paged_model, ref_model, cache, DynamicCache(config=ref_model.config),
        input_ids=ids, attention_mask=mask, max_new_tokens=3, prefill_chunk_size=chunk,
    )
    assert_same(paged, ref)
    cache.pool.check()
