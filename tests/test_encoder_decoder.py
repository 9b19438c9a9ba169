"""Encoder-decoder models on `hf_paged.EncoderDecoderPagedCache`: decoder self-attention paged, cross-attention K/V
stored once per request and shared by its beams and samples; every family of `tests/encdec_matrix.py` against
transformers' own `EncoderDecoderCache` with sdpa/eager."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, DynamicCache, EncoderDecoderCache, LlamaConfig, LlamaForCausalLM

import hf_paged
from hf_paged.attention import handoff
from hf_paged.attention.shared_kv import attend_shared
from hf_paged.cache.cross import CrossAttentionCache
from encdec_matrix import (
    ENCODER_DECODERS,
    MAKE_TEST,
    EncDecCase,
    failing,
    generate_kwargs,
    inputs_for,
    load,
    passing,
    reference_attention,
    tiny_config,
)
from helpers import tiered

CASES = {c.model_type: c for c in ENCODER_DECODERS}
MODES = {
    "greedy": dict(do_sample=False),
    "beams": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "samples": dict(do_sample=True, num_return_sequences=2),
}


def _generate(model, inputs, cache, seed: int = 5, **kwargs):
    torch.manual_seed(seed)
    extra = {} if cache is None else hf_paged.cache_kwargs(cache)
    return model.generate(
        **inputs,
        **extra,
        **generate_kwargs(model),
        max_new_tokens=6,
        return_dict_in_generate=True,
        output_scores=True,
        **kwargs,
    )


def _assert_same(reference, paged) -> None:
    assert torch.equal(reference.sequences, paged.sequences), (reference.sequences, paged.sequences)
    for a, b in zip(reference.scores, paged.scores, strict=True):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("case", tiered(passing(), MAKE_TEST))
def test_family_matches_transformers(case: EncDecCase) -> None:
    """Greedy, beam search and sampling (with num_return_sequences): the tokens and scores of transformers' own cache
    with sdpa/eager; each request's cross-attention K/V stored once; every invariant holds."""
    paged = load(case, "paged")
    reference = load(case, reference_attention(paged))
    inputs = inputs_for(paged)
    batch = next(iter(inputs.values())).shape[0]
    shared_reads = []
    original_attend = CrossAttentionCache.attend
    for name, kwargs in MODES.items():
        with (
            hf_paged.EncoderDecoderPagedCache(paged.config, block_size=4) as cache,
            pytest.MonkeyPatch.context() as patch,
        ):
            patch.setattr(
                CrossAttentionCache, "attend", lambda *a, **k: shared_reads.append(1) or original_attend(*a, **k)
            )
            out = _generate(paged, inputs, cache, **kwargs)
            assert shared_reads, "the cross-attention did not read the shared entries through the paged attention"
            _assert_same(_generate(reference, inputs, None, **kwargs), out)
            cache.check()
            stats = cache.cross_stats()
            assert stats.num_entries == batch and stats.num_rows > batch or name == "greedy", (name, stats)
        cache.check()
        assert cache.stats().blocks_in_use == 0 and cache.cross_stats().bytes_in_use == 0


@pytest.mark.parametrize("case", tiered(failing(), MAKE_TEST))
def test_unsupported_family_is_refused_at_load(case: EncDecCase) -> None:
    with pytest.raises(hf_paged.UnsupportedModelError, match=case.error) as info:
        load(case, "paged")
    assert repr(case.model_type) in str(info.value) and "eager" in str(info.value)


def test_beams_share_one_entry_and_reorders_copy_nothing() -> None:
    """5 beams of one request: one cross-attention entry (a fifth of transformers' bytes); the `"paged"` attention reads
    the entries in place (never the per-row view), and beam reorders keep the very same tensors."""
    case = CASES["whisper"]
    model = load(case, "paged")
    inputs = inputs_for(model, batch=1)
    theirs = EncoderDecoderCache(DynamicCache(), DynamicCache())
    model.set_attn_implementation("sdpa")
    reference = model.generate(**inputs, **hf_paged.cache_kwargs(theirs), num_beams=5, max_new_tokens=6)
    model.set_attn_implementation("paged")
    cache = hf_paged.EncoderDecoderPagedCache(model.config)
    cross = cache.cross_attention_cache
    per_row_reads, storages = [], set()
    original_per_row, original_reorder = CrossAttentionCache._per_row, CrossAttentionCache.reorder_cache

    def per_row(self, entries):
        per_row_reads.append(entries.shape)
        return original_per_row(self, entries)

    def reorder(self, beam_idx):
        storages.update(k.data_ptr() for k in self._keys)
        original_reorder(self, beam_idx)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CrossAttentionCache, "_per_row", per_row)
        patch.setattr(CrossAttentionCache, "reorder_cache", reorder)
        out = model.generate(**inputs, **hf_paged.cache_kwargs(cache), num_beams=5, max_new_tokens=6)
    assert torch.equal(reference, out)
    assert not per_row_reads and len(storages) == len(cross.layers)  # no per-row K/V, the same tensors every step
    theirs_bytes = sum(t.nbytes for layer in theirs.cross_attention_cache.layers for t in (layer.keys, layer.values))
    assert cross.stats().ref_counts == (5,) and cross.bytes_in_use() * 5 == theirs_bytes
    cache.check()


def test_other_attention_reads_per_row_kv() -> None:
    """A model loaded with sdpa over an EncoderDecoderPagedCache: the cache hands every reader per-row K/V."""
    case = CASES["bart"]
    model = load(case, "sdpa")
    inputs = inputs_for(model)
    reference = _generate(model, inputs, None, **MODES["beams"])
    with hf_paged.EncoderDecoderPagedCache(model.config) as cache:
        _assert_same(reference, _generate(model, inputs, cache, **MODES["beams"]))
        cache.check()


def test_a_note_left_by_another_model_does_not_hand_shared_kv_to_sdpa() -> None:
    """A `"paged"` causal attention over K/V of no PagedCache (a decoder-only model with a DynamicCache, say) leaves a
    note on its thread that its layer's self-attention ran. An sdpa encoder-decoder model on the same thread must
    still read per-row cross-attention K/V at that layer, not the shared entries meant for `"paged"`."""
    case = CASES["bart"]
    model = load(case, "sdpa")
    inputs = inputs_for(model)
    reference = _generate(model, inputs, None, **MODES["beams"])
    handoff.note_self_attention(0)
    with hf_paged.EncoderDecoderPagedCache(model.config) as cache:
        _assert_same(reference, _generate(model, inputs, cache, **MODES["beams"]))
        cache.check()


def test_decoder_input_ids_fork_and_reuse() -> None:
    """`decoder_input_ids` given; a `deepcopy` (fork) of the filled cache shares its entries; `reset()` lets the cache
    serve another generate()."""
    case = CASES["bart"]
    model, reference = load(case, "paged"), load(case, "sdpa")
    inputs = inputs_for(model)
    inputs["decoder_input_ids"] = torch.tensor([[1, 5, 7], [1, 9, 4]])
    cache = hf_paged.EncoderDecoderPagedCache(model.config, block_size=2)
    _assert_same(_generate(reference, inputs, None), _generate(model, inputs, cache))
    other = copy.deepcopy(cache)
    assert other.cross_attention_cache.read(0)[0].data_ptr() == cache.cross_attention_cache.read(0)[0].data_ptr()
    assert other.self_attention_cache.block_tables() == cache.self_attention_cache.block_tables()
    other.release()
    cache.check()
    cache.reset()
    _assert_same(
        _generate(reference, inputs, None, **MODES["beams"]), _generate(model, inputs, cache, **MODES["beams"])
    )
    cache.check()


def test_bare_paged_cache_is_refused_with_what_to_use() -> None:
    """A PagedCache alone receives the cross-attention K/V too (generate() wraps only caches it makes): refused,
    naming EncoderDecoderPagedCache."""
    model = load(CASES["bart"], "paged")
    cache = hf_paged.PagedCache()
    with pytest.raises(hf_paged.UnsupportedModelError, match="EncoderDecoderPagedCache"):
        _generate(model, inputs_for(model), cache)
    cache.pool.check()
    with pytest.raises(ValueError, match="not one"):
        hf_paged.EncoderDecoderPagedCache(AutoConfig.for_model("llama"))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(language="de", task="translate", num_beams=3, num_return_sequences=2),
        dict(language="en", task="transcribe", do_sample=True, num_return_sequences=2),
        dict(language="en", task="transcribe", assistant_model=True),
    ],
    ids=["beams", "samples", "assisted"],
)
def test_whisper_language_and_task_tokens(kwargs: dict) -> None:
    """Whisper's forced language and task tokens (with beams, samples, an assistant model): the tokens and scores of
    transformers' own EncoderDecoderCache given to generate() the same way. (Given a cache and no attention_mask,
    Whisper's generate() takes the forced tokens to be in the cache already, with either cache.)"""
    paged = load(CASES["whisper"], "paged")
    reference = load(CASES["whisper"], reference_attention(paged))
    for model in (paged, reference):
        config = model.generation_config
        config.lang_to_id, config.task_to_id = {"<|en|>": 50, "<|de|>": 51}, {"transcribe": 52, "translate": 53}
        config.is_multilingual, config.no_timestamps_token_id, config.forced_decoder_ids = True, 54, None
    inputs = inputs_for(paged, seed=3)
    inputs["attention_mask"] = torch.ones(inputs["input_features"].shape[0], inputs["input_features"].shape[-1])
    if kwargs.pop("assistant_model", False):
        inputs = {name: value[:1] for name, value in inputs.items()}  # (assisted decoding takes one request)
        want = _generate(reference, inputs, EncoderDecoderCache(DynamicCache(), DynamicCache()), **kwargs,
                         assistant_model=load(CASES["whisper"], reference_attention(paged)))
        kwargs["assistant_model"] = load(CASES["whisper"], "paged")
    else:
        want = _generate(reference, inputs, EncoderDecoderCache(DynamicCache(), DynamicCache()), **kwargs)
    with hf_paged.EncoderDecoderPagedCache(paged.config) as cache:
        _assert_same(want, _generate(paged, inputs, cache, **kwargs))
        cache.check()


@pytest.mark.parametrize("model_type", ["bart", "whisper"])
def test_rows_with_equal_decoder_tokens_and_other_inputs_keep_their_own_kv(model_type: str) -> None:
    """Two requests whose decoders start with the same tokens (Whisper's forced language and task tokens) and whose
    encoder inputs differ: only the first layer's K/V are equal, every row keeps its own (logits as transformers')."""
    paged = load(CASES[model_type], "paged")
    reference = load(CASES[model_type], reference_attention(paged))
    inputs = inputs_for(paged, seed=3)
    decoder_input_ids = torch.tensor([[1, 50, 52, 54]] * 2)
    with torch.no_grad(), hf_paged.EncoderDecoderPagedCache(paged.config) as cache:
        got = paged(**inputs, decoder_input_ids=decoder_input_ids, **hf_paged.cache_kwargs(cache)).logits
        cache.check()
        assert cache.stats().blocks_in_use == 2  # a block per row: nothing stored once for both
        want = reference(**inputs, decoder_input_ids=decoder_input_ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_engine_refuses_encoder_decoders_naming_what_to_use() -> None:
    model = load(CASES["bart"], "paged")
    with pytest.raises(hf_paged.UnsupportedModelError, match="encoder-decoder.*EncoderDecoderPagedCache"):
        hf_paged.Engine(model)


def test_a_kv_pool_never_serves_decoder_blocks_of_another_encoder_input() -> None:
    """Decoder self-attention K/V depend on the encoder's output (through cross-attention): requests with the same
    decoder start and other inputs share a KVPool without prefix hits, and get transformers' tokens."""
    model = load(CASES["bart"], "paged")
    reference = load(CASES["bart"], reference_attention(model))
    pool = hf_paged.KVPool(model.config)
    for seed in (0, 1, 0):
        inputs = inputs_for(model, seed=seed)
        with hf_paged.EncoderDecoderPagedCache(model.config, pool=pool) as cache:
            _assert_same(_generate(reference, inputs, None), _generate(model, inputs, cache))
        pool.check()
    assert pool.stats().prefix_hit_rate == 0


def _cross_cache(rows: list[int], layers: int = 2, kv_len: int = 5) -> tuple[CrossAttentionCache, list[torch.Tensor]]:
    """A CrossAttentionCache of a 2-layer BART after its first forward over rows whose K/V are `rows[r]`'s."""
    cache = CrossAttentionCache(tiny_config(CASES["bart"]))
    per_layer = []
    for layer in range(layers):
        distinct = torch.randn(max(rows) + 1, 4, kv_len, 8)
        keys = distinct[rows]
        per_layer.append(keys)
        cache.update(keys, keys + 1, layer)
    return cache, per_layer


def test_a_read_from_outside_after_a_decoder_only_forward_is_per_row() -> None:
    """A decoder-only model's `"paged"` forward on this thread leaves no note that a cross-attention follows: a
    cross-attention cache read from outside a forward afterwards gives per-row K/V (it gave the stored entries)."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    decoder_only = LlamaForCausalLM(config).eval()
    decoder_only.set_attn_implementation("paged")
    with torch.no_grad():
        decoder_only(torch.tensor([[1, 2, 3]]), **hf_paged.cache_kwargs(hf_paged.PagedCache()))
    cache, layers = _cross_cache([0, 1, 0, 1, 1])
    torch.testing.assert_close(cache.read(1)[0], layers[1])


def test_rows_are_grouped_by_content_and_reference_counted() -> None:
    cache, layers = _cross_cache([0, 1, 0, 1, 1])
    assert cache.row_entries == [0, 1, 0, 1, 1] and cache.ref_counts == [2, 3]
    cache.check()
    torch.testing.assert_close(cache.read(1)[0], layers[1])  # read from outside a forward: per row
    cache.reorder_cache(torch.tensor([1, 1, 3, 3, 4]))
    assert cache.row_entries == [0, 0, 0, 0, 0] and cache.ref_counts == [5]  # entry 0 dropped, entry 1 renumbered
    assert cache.read(0)[0].stride(0) == 0  # one entry for every row: a view
    cache.check()
    cache.batch_select_indices(torch.tensor([0, 2]))
    cache.batch_repeat_interleave(2)
    assert cache.ref_counts == [4] and cache.stats().num_rows == 4
    cache.check()
    with pytest.raises(IndexError):
        cache.reorder_cache(torch.tensor([7]))
    cache.ref_counts[0] = 3  # a corrupted count is caught
    with pytest.raises(AssertionError, match="reference counts"):
        cache.check()


def test_a_decoder_only_forward_leaves_no_note_for_a_cross_attention_read(recwarn) -> None:
    """A decoder-only model's `"paged"` layers read gathered (no PagedCache here) leave no "inside a decoder layer"
    note behind: a cross-attention cache read afterwards from outside a forward gets its rows, not its entries."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="paged")
    with torch.no_grad():
        LlamaForCausalLM(config).eval()(torch.tensor([[1, 2, 3]]))
    assert not handoff.follows_attention_of(1)
    cache, layers = _cross_cache([0, 1, 0, 1, 1])
    torch.testing.assert_close(cache.read(1)[0], layers[1])


def test_a_row_differing_in_a_later_layer_gets_its_own_entry() -> None:
    cache = CrossAttentionCache(tiny_config(CASES["bart"]))
    first = torch.randn(1, 4, 5, 8).expand(3, -1, -1, -1).contiguous()
    cache.update(first, first, 0)
    assert cache.ref_counts == [3]
    second = torch.randn(3, 4, 5, 8)
    second[1] = second[0]
    cache.update(second, second, 1)
    assert cache.row_entries == [0, 0, 1] and cache.ref_counts == [2, 1]
    cache.check()
    for layer, full in enumerate((first, second)):
        torch.testing.assert_close(cache.read(layer)[0], full)


def test_update_of_a_stored_layer_is_refused() -> None:
    cache, _ = _cross_cache([0, 0])
    with pytest.raises(ValueError, match="reset"):
        cache.update(torch.zeros(2, 4, 5, 8), torch.zeros(2, 4, 5, 8), 0)
    cache.reset()
    cache.check()
    assert cache.bytes_in_use() == 0 and not handoff.shared_staged(0)


@pytest.mark.parametrize("counts", [[2, 2, 2], [1, 3, 2]])
@pytest.mark.parametrize("gqa", [1, 2])
def test_attend_shared_matches_per_row_attention(counts: list[int], gqa: int) -> None:
    """Rows grouped by entry (equal or unequal groups, shuffled rows), with a padding mask, an additive bias and GQA,
    against plain attention over per-row copies."""
    torch.manual_seed(0)
    entries, heads, q_len, kv_len, dim = len(counts), 4, 3, 7, 8
    row_entries = torch.tensor([e for e, c in enumerate(counts) for _ in range(c)])[torch.randperm(sum(counts))]
    batch = row_entries.numel()
    query = torch.randn(batch, heads, q_len, dim)
    keys, values = torch.randn(entries, heads // gqa, kv_len, dim), torch.randn(entries, heads // gqa, kv_len, dim)
    mask = torch.ones(batch, kv_len, dtype=torch.bool)
    mask[0, -3:] = False
    bias = torch.randn(1, heads, q_len, kv_len)
    out, probs = attend_shared(query, keys, values, row_entries, mask, 0.3, bias, want_weights=True)
    k = keys[row_entries].repeat_interleave(gqa, dim=1)
    v = values[row_entries].repeat_interleave(gqa, dim=1)
    scores = query @ k.transpose(-1, -2) * 0.3 + bias
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    expected = (scores.softmax(-1) @ v).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs, scores.softmax(-1), atol=1e-5, rtol=1e-5)
    fast, _ = attend_shared(query, keys, values, row_entries, mask, 0.3, bias)
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)
    as_ints, _ = attend_shared(query, keys, values, row_entries, mask.long(), 0.3, bias)  # an attention_mask of 0/1
    torch.testing.assert_close(as_ints, expected, atol=1e-5, rtol=1e-5)
