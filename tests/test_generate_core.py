"""PagedCache + "paged" against DynamicCache + sdpa under stock generate() (issue 2)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from helpers import generate_both, left_padded, load, max_logit_diff, saved_model

MODELS = {
    "llama": {},
    "qwen2": {},
    "mistral": {"sliding_window": 24},
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request):
    path = saved_model(request.param, **MODELS[request.param])
    return load(path, "paged"), load(path, "sdpa")


@pytest.mark.parametrize("lengths", [[23], [7, 30, 18]], ids=["batch1", "left_padded"])
def test_greedy_matches_dynamic_cache(pair, lengths):
    paged_model, ref_model = pair
    ids, mask = left_padded(lengths)
    paged, ref, cache = generate_both(
        paged_model, ref_model, input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False
    )
    assert max_logit_diff(paged, ref) < 1e-3
    assert torch.equal(paged.sequences, ref.sequences)
    cache.pool.check()


@pytest.mark.parametrize("lengths", [[23], [7, 30, 18]], ids=["batch1", "left_padded"])
def test_seeded_sampling_matches_dynamic_cache(pair, lengths):
    paged_model, ref_model = pair
    ids, mask = left_padded(lengths, seed=3)
    paged, ref, _ = generate_both(
        paged_model, ref_model, seed=7, input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=True, top_k=0
    )
    assert max_logit_diff(paged, ref) < 1e-3
    assert torch.equal(paged.sequences, ref.sequences)


def test_second_turn_continues_from_returned_cache(pair):
    paged_model, ref_model = pair
    ids, mask = left_padded([12, 20], seed=5)
    cache, ref_cache = hf_paged.PagedCache(), DynamicCache()
    first = paged_model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), max_new_tokens=9, do_sample=False, pad_token_id=0)
    first_ref = ref_model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(ref_cache), max_new_tokens=9, do_sample=False, pad_token_id=0)
    assert torch.equal(first, first_ref)
    follow = torch.randint(1, 128, (2, 6))
    ids2 = torch.cat([first, follow], dim=1)
    mask2 = torch.cat([mask, torch.ones(2, ids2.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    kw = dict(attention_mask=mask2, max_new_tokens=11, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    second = paged_model.generate(ids2, **hf_paged.cache_kwargs(cache), **kw)
    second_ref = ref_model.generate(ids2, **hf_paged.cache_kwargs(ref_cache), **kw)
    assert max_logit_diff(second, second_ref) < 1e-3
    assert torch.equal(second.sequences, second_ref.sequences)
    assert cache.get_seq_length() == ref_cache.get_seq_length()


def test_prompt_lookup_continues_a_returned_cache(pair):
    """Assisted and prompt-lookup decoding feed their first forward the whole prompt, whatever the cache holds: a
    returned cache lets go of what it holds and stores the prompt once, so a second turn with prompt lookup gives
    the tokens and logits of a cache that held nothing (transformers' own cache, continued, stores the first turn
    twice), and a third, greedy turn continues from what the second stored."""
    paged_model, ref_model = pair
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    cache = hf_paged.PagedCache()
    first = paged_model.generate(ids, **hf_paged.cache_kwargs(cache), max_new_tokens=9, **common)
    ids2 = torch.cat([first, torch.tensor([[5, 6, 7]])], dim=1)
    kw = dict(max_new_tokens=12, prompt_lookup_num_tokens=3, return_dict_in_generate=True, output_logits=True, **common)
    second = paged_model.generate(ids2, **hf_paged.cache_kwargs(cache), **kw)
    fresh = ref_model.generate(ids2, **hf_paged.cache_kwargs(DynamicCache()), **kw)
    assert torch.equal(second.sequences, fresh.sequences)
    assert max_logit_diff(second, fresh) < 1e-3
    assert cache.get_seq_length() == second.sequences.shape[1] - 1
    cache.pool.check()
    ids3 = torch.cat([second.sequences, torch.tensor([[9, 8]])], dim=1)
    third = paged_model.generate(ids3, **hf_paged.cache_kwargs(cache), max_new_tokens=5, **common)
    assert torch.equal(third, ref_model.generate(ids3, max_new_tokens=5, **common))
    cache.pool.check()


def test_past_recording_then_a_decode_step_or_a_crop_keeps_the_cache(pair):
    """`activate_past_recording()` announces assisted decoding's first forward, which feeds the whole prompt again. A
    next forward no wider than what the rows hold (a decode step, as after transformers' deferred stop check), or any
    forward after a `crop()`, continues the rows: each turn gives a continued `DynamicCache`'s tokens."""
    paged_model, ref_model = pair
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    cache, ref_cache = hf_paged.PagedCache(), DynamicCache()
    out = paged_model.generate(ids, **hf_paged.cache_kwargs(cache), max_new_tokens=5, **common)
    ref_model.generate(ids, **hf_paged.cache_kwargs(ref_cache), max_new_tokens=5, **common)
    for new, crop in (([9, 9], False), (list(range(20, 60)), True)):  # the second turn is wider than the cache held
        cache.activate_past_recording()
        if crop:
            cache.crop(0)
        ids = torch.cat([out, torch.tensor([new])], dim=1)
        out = paged_model.generate(ids, **hf_paged.cache_kwargs(cache), max_new_tokens=4, **common)
        assert torch.equal(out, ref_model.generate(ids, **hf_paged.cache_kwargs(ref_cache), max_new_tokens=4, **common))
        assert cache.get_seq_length() == ref_cache.get_seq_length()
    cache.pool.check()


def test_prompt_lookup_on_a_returned_cache_read_gathered_is_refused():
    """Under an attention that reads the cache gathered, transformers' mask for assisted decoding's first forward
    spans the held tokens and the whole prompt again: refused before anything changes."""
    model = load(saved_model("llama"), "sdpa")
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    cache = hf_paged.PagedCache()
    first = model.generate(ids, **hf_paged.cache_kwargs(cache), max_new_tokens=4, **common)
    ids2 = torch.cat([first, torch.tensor([[5, 6]])], dim=1)
    with pytest.raises(ValueError, match="feed their first forward the whole prompt"):
        model.generate(ids2, **hf_paged.cache_kwargs(cache), max_new_tokens=4, prompt_lookup_num_tokens=2, **common)
    assert cache.get_seq_length() == first.shape[1] - 1
    cache.pool.check()
    second = model.generate(ids2, **hf_paged.cache_kwargs(cache), max_new_tokens=4, **common)  # greedy goes on
    assert torch.equal(second, model.generate(ids2, max_new_tokens=4, **common))


def test_padding_is_never_stored():
    path = saved_model("llama")
    model = load(path, "paged")
    ids, mask = left_padded([3, 40, 17], seed=1)
    cache = hf_paged.PagedCache(block_size=4)
    model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), max_new_tokens=5, do_sample=False, pad_token_id=0)
    # The cache processed 40 + 4 columns (the last sampled token is not fed back).
    assert cache.get_seq_length() == 44
    assert cache.seq_lens == [3 + 4, 40 + 4, 17 + 4]
    stats = cache.stats()
    assert stats.tokens_stored == 7 + 44 + 21
    assert stats.blocks_in_use == 2 + 11 + 6  # ceil(n / 4) per row: only the last block of a row is partial
    cache.pool.check()


def test_sdpa_with_paged_cache_gathers_and_matches():
    path = saved_model("llama")
    model = load(path, "sdpa")
    ids, mask = left_padded([9, 21], seed=2)
    cache = hf_paged.PagedCache()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    out = model.generate(**hf_paged.cache_kwargs(cache), **kw)
    ref = model.generate(**hf_paged.cache_kwargs(DynamicCache()), **kw)
    assert cache.mode == "gather"
    assert max_logit_diff(out, ref) < 1e-4
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("first_new_tokens", [1, 4])
def test_sdpa_with_paged_cache_continues_a_second_turn(first_new_tokens):
    """A cache made without a config, read gathered, learns its number of layers only when a forward after its first
    begins (after a one-token first turn: not yet); a second turn still continues it (transformers 5.24 slices a
    continued prompt by the cache's length only when `cache.is_linear` is not all True)."""
    model = load(saved_model("llama"), "sdpa")
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    cache, ref_cache = hf_paged.PagedCache(), DynamicCache()
    first = model.generate(ids, **hf_paged.cache_kwargs(cache), max_new_tokens=first_new_tokens, **common)
    model.generate(ids, **hf_paged.cache_kwargs(ref_cache), max_new_tokens=first_new_tokens, **common)
    assert cache.is_linear[0] is False
    ids2 = torch.cat([first, torch.tensor([[5, 6]])], dim=1)
    second = model.generate(ids2, **hf_paged.cache_kwargs(cache), max_new_tokens=4, **common)
    assert torch.equal(second, model.generate(ids2, **hf_paged.cache_kwargs(ref_cache), max_new_tokens=4, **common))
    assert cache.get_seq_length() == ref_cache.get_seq_length()


def test_paged_over_dynamic_cache_is_correct_and_warns_once(recwarn):
    path = saved_model("llama")
    paged_model, ref_model = load(path, "paged"), load(path, "sdpa")
    ids, mask = left_padded([9, 21], seed=2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    import hf_paged.attention.paged as attention

    attention._warned_contiguous = False
    out = paged_model.generate(**hf_paged.cache_kwargs(DynamicCache()), **kw)
    ref = ref_model.generate(**hf_paged.cache_kwargs(DynamicCache()), **kw)
    assert max_logit_diff(out, ref) < 1e-4
    warned = [w for w in recwarn if "not a hf_paged.PagedCache" in str(w.message)]
    assert len(warned) == 1


def test_set_attn_implementation_switches_paths():
    path = saved_model("llama")
    model = load(path, "sdpa")
    model.set_attn_implementation("paged")
    ids, mask = left_padded([5, 11], seed=4)
    cache = hf_paged.PagedCache(config=model.config)
    out = model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert cache.mode == "paged"
    ref = load(path, "sdpa").generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)


def test_forward_plan_is_built_once_per_forward(monkeypatch):
    """Planning (slot mapping, block tables) happens on the first layer only; later layers reuse it."""
    path = saved_model("llama", num_hidden_layers=4)
    model = load(path, "paged")
    from hf_paged.cache.rows import Rows

    calls = []
    original = Rows.plan_forward
    monkeypatch.setattr(Rows, "plan_forward", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    ids, mask = left_padded([6, 13, 9, 4], seed=6)
    model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(hf_paged.PagedCache()), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert len(calls) == 5  # one prefill + four decode forwards, for 4 layers each


def test_get_mask_sizes_and_seq_length_track_columns():
    cache = hf_paged.PagedCache()
    assert cache.get_seq_length() == 0
    assert cache.get_mask_sizes(7, 0) == (7, 0)
    model = load(saved_model("llama"), "paged")
    ids, mask = left_padded([5, 9], seed=8)
    model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache))
    assert cache.get_seq_length() == 9
    assert cache.get_mask_sizes(1, 0) == (10, 0)
    assert cache.batch_size == 2


def test_a_configless_cache_read_gathered_has_its_layers_after_generate():
    """A `PagedCache()` under sdpa counts the model's layers in its first forward: after generate() its `layers`
    (and `len()`) are the model's, as a `DynamicCache`'s are, without a `finish_forward()` first."""
    model = load(saved_model("llama"), "sdpa")
    ids, mask = left_padded([5, 9], seed=8)
    cache = hf_paged.PagedCache()
    model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), max_new_tokens=3, do_sample=False,
                   pad_token_id=0)
    assert len(cache) == model.config.num_hidden_layers
    assert cache.layers[0].keys.shape[2] == cache.get_seq_length() == 11
    dynamic = DynamicCache(config=model.config)
    model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(dynamic), max_new_tokens=3, do_sample=False,
                   pad_token_id=0)
    iterated = list(cache)  # as iterating a DynamicCache: (keys, values, sliding window tensor) per layer
    assert len(iterated) == len(list(dynamic)) == model.config.num_hidden_layers
    for (keys, values, window), (want_keys, want_values, _) in zip(iterated, dynamic, strict=True):
        real = mask.bool()[:, None, :, None]  # (padding columns: zeros here, what DynamicCache stored there)
        assert torch.allclose(keys[..., :9, :] * real, want_keys[..., :9, :] * real, atol=1e-5)
        assert torch.allclose(values[..., 9:, :], want_values[..., 9:, :], atol=1e-5) and window is None


def test_kv_read_gathered_are_contiguous_like_a_dynamic_caches():
    """Under sdpa, `update()` returns the rows' K/V as one contiguous tensor each, as `DynamicCache`'s `torch.cat`
    does: some models `view()` them (gpt_neox_japanese)."""
    model = load(saved_model("llama"), "sdpa")
    ids, mask = left_padded([5, 9], seed=8)
    cache = hf_paged.PagedCache()
    model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache))
    new = torch.randn(2, model.config.num_key_value_heads, 1, model.config.head_dim)
    for layer_idx in range(model.config.num_hidden_layers):
        keys, values = cache.update(new, new, layer_idx)
        assert keys.shape[2] == values.shape[2] == 10 and keys.is_contiguous() and values.is_contiguous()


def test_kv_memory_below_dynamic_cache_for_a_padded_batch():
    """Issue 2 acceptance: prompts of 50, 200, 400, 1000 tokens + 32 new tokens, left-padded."""
    path = saved_model("llama")
    paged_model, ref_model = load(path, "paged"), load(path, "sdpa")
    ids, mask = left_padded([50, 200, 400, 1000], seed=9)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    cache = hf_paged.PagedCache()
    paged_model.generate(**hf_paged.cache_kwargs(cache), **kw)
    dynamic = DynamicCache()
    ref_model.generate(**hf_paged.cache_kwargs(dynamic), **kw)
    dynamic_bytes = hf_paged.contiguous_cache_bytes(dynamic)
    stats = cache.stats()
    assert stats.bytes_in_use <= dynamic_bytes
    # 31 of the 32 new tokens are fed back: every row holds prompt + 31 tokens, and only its last block is partial.
    assert stats.tokens_stored == 50 + 200 + 400 + 1000 + 4 * 31
    unused_slots = stats.blocks_in_use * stats.block_size - stats.tokens_stored
    assert unused_slots < 4 * stats.block_size
    print(f"paged bytes_in_use={stats.bytes_in_use} dynamic={dynamic_bytes} ratio={stats.bytes_in_use / dynamic_bytes:.3f}")


def test_a_batch_keeps_its_rows_in_runs_read_in_place(pair, monkeypatch):
    """A batch's rows take their prompt blocks as runs spread over the pool and grow into the room after them: at
    the end every row is one run of ids at one stride from the previous row's, each decode step read them as one
    view of the pool (no gather, no cascade), and the tokens and logits are the default cache's."""
    import hf_paged.attention.torch_backend as backend

    paged_model, ref_model = pair
    reads = []
    original = backend._gathered

    def recorded(cache, meta, batch, *args):
        reads.append((batch, meta.gather_table is None and meta.leading is None, meta.row_stride))
        return original(cache, meta, batch, *args)

    monkeypatch.setattr(backend, "_gathered", recorded)
    ids = torch.randint(1, 128, (4, 21), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    paged, ref, cache = generate_both(
        paged_model, ref_model, input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False
    )
    assert torch.equal(paged.sequences, ref.sequences) and max_logit_diff(paged, ref) < 1e-3
    for layer in range(paged_model.config.num_hidden_layers):
        tables = cache.block_tables(layer)
        stride = tables[1][0] - tables[0][0]
        assert stride > 0 and all(t == list(range(t[0], t[0] + len(t))) for t in tables), tables
        assert [t[0] for t in tables] == [tables[0][0] + r * stride for r in range(4)]
    decode = [r for r in reads if r[0] == 4]
    assert decode and all(in_place and stride > 0 for _, in_place, stride in decode)
    cache.pool.check()


def test_a_custom_4d_mask_is_applied_as_given(pair):
    """A caller's own 4D mask (here: a causal prompt whose first four tokens also see each other, then a second
    forward of three tokens that do not see the prompt's second token) reaches a PagedCache forward under "paged":
    the rows' K/V are read back and the mask applied as sdpa applies it over a DynamicCache; a decode step after it
    takes the 2D padding mask again."""
    paged, ref = pair
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    prompt = torch.ones(9, 9).tril().bool()
    prompt[:4, :4] = True
    more = torch.ones(3, 12).tril(diagonal=9).bool()
    more[:, 1] = False
    caches = {"paged": hf_paged.PagedCache(block_size=4), "ref": DynamicCache(config=ref.config)}
    logits = {}
    with torch.no_grad():
        for name, model in (("paged", paged), ("ref", ref)):
            cache = caches[name]
            first = model(input_ids=ids[:, :6], attention_mask=prompt[None, None, :6, :6].expand(2, 1, 6, 6),
                          past_key_values=cache).logits
            second = model(input_ids=ids[:, 6:], attention_mask=more[None, None, :, :9].expand(2, 1, 3, 9),
                           past_key_values=cache).logits
            step = model(input_ids=ids[:, -1:], attention_mask=torch.ones(2, 10, dtype=torch.long),
                         past_key_values=cache).logits
            logits[name] = (first, second, step)
    for got, want in zip(logits["paged"], logits["ref"], strict=True):
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert caches["paged"].mode == "paged" and caches["paged"].get_seq_length() == 10


def test_a_sliding_layers_kv_read_back_are_zero_where_the_window_freed_its_blocks():
    """`cache.layers[i].keys` of a sliding-window layer after blocks left the window: the last `window - 1` columns
    are DynamicCache's, and the freed columns read zeros, never the pool block another cache holds now."""
    path = saved_model("mistral", sliding_window=8)
    paged, ref = load(path, "paged"), load(path, "sdpa")
    pool = hf_paged.KVPool(paged.config, block_size=4)
    other_ids = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(0))
    other = pool.new_cache(other_ids)  # holds block 0
    with torch.no_grad():
        paged(input_ids=other_ids, **hf_paged.cache_kwargs(other))
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    cache, dynamic = pool.new_cache(ids), DynamicCache(config=ref.config)
    options = dict(max_new_tokens=100, min_new_tokens=100, do_sample=False, pad_token_id=0)  # window 8 + margin 64
    paged.generate(ids, **hf_paged.cache_kwargs(cache), **options)
    ref.generate(ids, **hf_paged.cache_kwargs(dynamic), **options)
    assert -1 in cache.block_table(0)  # blocks the window left were freed
    keys, want = cache.layers[0].keys, dynamic.layers[0].keys
    assert torch.allclose(keys[..., -want.shape[2]:, :], want, atol=1e-5)
    freed = 4 * cache.block_table(0).count(-1)
    assert bool((keys[..., :freed, :] == 0).all())
    cache.release(), other.release()
    pool.check()


def test_a_custom_float_mask_adds_its_values_and_right_padding_is_refused(pair):
    """A float 4D mask adds its finite values to the scores, as sdpa adds them (a soft penalty on some keys); a row
    with padding after its tokens is refused with what to do, before anything is stored."""
    paged, ref = pair
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(6))
    mask = torch.zeros(1, 1, 7, 7).masked_fill(~torch.ones(7, 7).tril().bool(), torch.finfo(torch.float32).min)
    mask[..., 2] = mask[..., 2].clamp(max=-2.0)  # every query sees key 2 at a penalty of 2
    with torch.no_grad():
        got = paged(input_ids=ids, attention_mask=mask, past_key_values=hf_paged.PagedCache(block_size=4)).logits
        want = ref(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=ref.config)).logits
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    right = torch.ones(1, 1, 7, 7).tril().bool()
    right[..., 5:] = False  # the last two columns are padding, after the row's tokens
    cache = hf_paged.PagedCache(block_size=4)
    with pytest.raises(hf_paged.UnsupportedModelError, match="Pad on the left"), torch.no_grad():
        paged(input_ids=ids, attention_mask=right, past_key_values=cache)
    assert cache.get_seq_length() == 0
