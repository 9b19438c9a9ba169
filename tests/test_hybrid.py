"""Hybrid models (recurrent layers beside attention) on paged memory: every generate() feature against transformers'
own cache (DynamicCache + sdpa), with the pool's invariants checked after each run.

Greedy and sampling over left-padded batches for every hybrid family run in the support matrix
(`tests/matrix.py` HYBRIDS); here the other features run on three families that differ in how their recurrent
layers use the cache: gated DeltaNet (qwen3_next: conv + recurrent state, attention after it), Mamba (jamba),
and Mamba2 beside attention in the same layer (falcon_h1: `hybrid` layers).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged import OutOfBlocksError, UnsupportedModelError
from hf_paged.compat import RECURRENT_PAST

from helpers import left_padded
from matrix import HYBRIDS, load, saved

FAMILIES = ["qwen3_next", "jamba", "falcon_h1"]
BLOCK_SIZE = 4
ATOL = 1e-4


def _path(family: str):
    config = HYBRIDS[family][0]
    return saved(family, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items())))


@functools.lru_cache(maxsize=None)
def _models(family: str):
    """(paged model, reference model) of a family, loaded once."""
    return load(_path(family), "paged"), load(_path(family), "sdpa")


def _prompts(lengths=(5, 11, 2)):
    return left_padded(list(lengths), seed=1, low=3)


def _both(family: str, seed: int = 0, cache=None, **kwargs):
    """generate() with a PagedCache + "paged" and with a DynamicCache + sdpa, same inputs and seed."""
    paged_model, ref_model = _models(family)
    ids, mask = _prompts()
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True,
                  output_logits=True, pad_token_id=0, eos_token_id=None)
    common.update(kwargs)
    cache = cache if cache is not None else hf_paged.PagedCache(paged_model.config, block_size=BLOCK_SIZE)
    torch.manual_seed(seed)
    paged = paged_model.generate(**hf_paged.cache_kwargs(cache), **common)
    torch.manual_seed(seed)
    reference = ref_model.generate(**hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)), **common)
    return paged, reference, cache


def _assert_same(paged, reference) -> None:
    assert torch.equal(paged.sequences, reference.sequences)
    for step, (a, b) in enumerate(zip(paged.logits, reference.logits, strict=True)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_cache_layers_as_transformers(family: str) -> None:
    """`is_linear`, `is_sliding`, the layer count and `has_previous_state` are transformers' own."""
    paged_model, _ = _models(family)
    cache, reference = hf_paged.PagedCache(paged_model.config), DynamicCache(config=paged_model.config)
    assert cache.is_linear == reference.is_linear and cache.is_sliding == reference.is_sliding
    assert len(cache.layers) == len(reference.layers)
    assert not cache.has_previous_state() and not cache.is_croppable
    ids, mask = _prompts()
    paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache))
    assert cache.has_previous_state()
    linear = [i for i, layer in enumerate(reference.layers) if hasattr(layer, "conv_states")]
    assert cache.layers[linear[0]].conv_states[0].shape[0] == ids.shape[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search(family: str) -> None:
    """Beams reorder block tables and state slots together (shared, copied only when a row diverges)."""
    paged, reference, cache = _both(family, num_beams=3, num_return_sequences=2, do_sample=False,
                                    output_scores=True, output_logits=False)
    assert torch.equal(paged.sequences, reference.sequences)
    torch.testing.assert_close(paged.sequences_scores, reference.sequences_scores, atol=ATOL, rtol=1e-4)
    cache.finish_forward()
    cache.pool.check()


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_num_return_sequences(family: str) -> None:
    """Samples of one prompt share its blocks; each gets its own state slot."""
    paged, reference, cache = _both(family, seed=3, do_sample=True, num_return_sequences=3, top_k=0, top_p=1.0)
    _assert_same(paged, reference)
    cache.finish_forward()
    stats = cache.stats()
    assert stats.blocks_shared > 0 and stats.state_slots_in_use == 9
    cache.pool.check()


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill(family: str) -> None:
    """generate(prefill_chunk_size=...) continues each recurrent state from the previous chunk."""
    paged, reference, cache = _both(family, do_sample=False, prefill_chunk_size=4)
    _assert_same(paged, reference)
    cache.pool.check()


@pytest.mark.parametrize("family", FAMILIES)
def test_continue_returned_cache(family: str) -> None:
    """A returned cache continues a conversation: its states are where the last forward left them."""
    paged_model, ref_model = _models(family)
    ids, mask = _prompts()
    first = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    cache = hf_paged.PagedCache(paged_model.config, block_size=BLOCK_SIZE)
    ref_cache = DynamicCache(config=ref_model.config)
    out = paged_model.generate(ids, **hf_paged.cache_kwargs(cache), **first)
    ref_out = ref_model.generate(ids, **hf_paged.cache_kwargs(ref_cache), **first)
    assert torch.equal(out, ref_out)
    more = torch.randint(3, 128, (ids.shape[0], 3), generator=torch.Generator().manual_seed(5))
    ids2 = torch.cat([out, more], dim=1)
    mask2 = torch.cat([mask, torch.ones_like(out[:, ids.shape[1]:]), torch.ones_like(more)], dim=1)
    second = dict(attention_mask=mask2, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None,
                  return_dict_in_generate=True, output_logits=True)
    paged = paged_model.generate(ids2, **hf_paged.cache_kwargs(cache), **second)
    reference = ref_model.generate(ids2, **hf_paged.cache_kwargs(ref_cache), **second)
    _assert_same(paged, reference)
    cache.pool.check()


@pytest.mark.parametrize("family", ["qwen3_next", "falcon_h1"])  # (not jamba: see the docstring)
def test_beam_search_continues_a_returned_cache_once_its_rows_are_repeated(family: str) -> None:
    """Beam search over a returned cache expands its rows after the recurrent layers read their states: refused,
    naming `batch_repeat_interleave` (transformers' own cache fails too: on a tensor shape, and its own
    `batch_repeat_interleave` on its recurrent layers); once repeated, the beams continue from the states the cache
    holds and give the tokens of beam search without a cache. (Jamba's Mamba layers, transformers' own code, restart
    a multi-token input from a zero state, so there a continued turn differs from one without a cache.)"""
    paged_model, ref_model = _models(family)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    cache = hf_paged.PagedCache(paged_model.config, block_size=BLOCK_SIZE)
    out = paged_model.generate(ids, **hf_paged.cache_kwargs(cache), max_new_tokens=5, **common)
    ids2 = torch.cat([out, torch.tensor([[7, 8, 9]])], dim=1)
    beams = dict(max_new_tokens=5, num_beams=2, **common)
    with pytest.raises(ValueError, match=r"cache\.batch_repeat_interleave\(2\)"):
        paged_model.generate(ids2, **hf_paged.cache_kwargs(cache), **beams)
    cache.batch_repeat_interleave(2)
    paged = paged_model.generate(ids2, **hf_paged.cache_kwargs(cache), **beams)
    assert torch.equal(paged, ref_model.generate(ids2, **beams))
    cache.pool.check()


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_fork(family: str) -> None:
    """A fork shares blocks and state slots; each side diverges without touching the other."""
    paged_model, ref_model = _models(family)
    ids, mask = _prompts()
    cache = hf_paged.PagedCache(paged_model.config, block_size=BLOCK_SIZE)
    ref_cache = DynamicCache(config=ref_model.config)
    paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache))
    ref_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(ref_cache))
    fork, ref_fork = cache.fork(), copy.deepcopy(ref_cache)
    assert fork.states.slots == cache.states.slots  # shared until one side writes
    assert cache.pool.stats().state_slots_in_use == ids.shape[0]
    mask1 = torch.cat([mask, torch.ones(ids.shape[0], 1, dtype=mask.dtype)], dim=1)
    for step_ids, mine, theirs in (  # the original moves first; the fork must still see the states of the fork point
        (torch.full((ids.shape[0], 1), 7), cache, ref_cache),
        (torch.full((ids.shape[0], 1), 9), fork, ref_fork),
    ):
        model_kwargs = dict(input_ids=step_ids, attention_mask=mask1)
        got = paged_model(**model_kwargs, **hf_paged.cache_kwargs(mine)).logits
        want = ref_model(**model_kwargs, **hf_paged.cache_kwargs(theirs)).logits
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    cache.finish_forward(), fork.finish_forward()
    assert set(fork.states.slots).isdisjoint(cache.states.slots)
    cache.pool.check()
    fork.release()
    cache.pool.check()
    assert cache.pool.stats().state_slots_in_use == ids.shape[0]


@pytest.mark.skipif(not RECURRENT_PAST, reason="before transformers 5.25, generate() refuses assisted decoding on "
                    "stateful models (test_assisted_decoding_refused_before_5_25 checks that release line)")
@pytest.mark.parametrize("family", FAMILIES)
def test_assisted_decoding_steps_states_back(family: str) -> None:
    """Assisted decoding with a draft model crops the rejected drafts every round: the recurrent states step back
    through the past the cache records, and the tokens are DynamicCache's and plain greedy decoding's. A second turn
    on the returned cache, whose first forward feeds the whole prompt again, gives plain greedy decoding's too."""
    paged_model, ref_model = _models(family)
    draft = load(saved("llama", (("num_hidden_layers", 1),), scale=3.0), "sdpa")
    ids, mask = _prompts((9,))
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, eos_token_id=None)
    plain = ref_model.generate(**common)
    reference = ref_model.generate(**hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)), **common,
                                   assistant_model=draft)
    cache = hf_paged.PagedCache(paged_model.config, block_size=BLOCK_SIZE)
    paged = paged_model.generate(**hf_paged.cache_kwargs(cache), **common, assistant_model=draft)
    assert torch.equal(paged, reference) and torch.equal(paged, plain)
    assert cache.get_seq_length() == paged.shape[1] - 1 and cache.is_recording_past(0)
    cache.pool.check()
    ids2 = torch.cat([paged, ids[:, -3:]], dim=1)
    second = dict(common, input_ids=ids2, attention_mask=torch.ones_like(ids2))
    paged2 = paged_model.generate(**hf_paged.cache_kwargs(cache), **second, assistant_model=draft)
    assert torch.equal(paged2, ref_model.generate(**second))
    assert cache.get_seq_length() == paged2.shape[1] - 1
    cache.pool.check()


@pytest.mark.skipif(RECURRENT_PAST, reason="from transformers 5.25 on, the cache records its recurrent states' past "
                    "(test_assisted_decoding_steps_states_back)")
def test_assisted_decoding_refused_before_5_25() -> None:
    """Before 5.25 the recurrent layers cannot record their past: assisted decoding fails with transformers' own
    message, before anything is stored, and `activate_past_recording()` refuses with ours."""
    paged_model, ref_model = _models("qwen3_next")
    ids, mask = _prompts((6,))
    kwargs = dict(attention_mask=mask, prompt_lookup_num_tokens=2, max_new_tokens=4, pad_token_id=0)
    with pytest.raises(ValueError) as theirs:
        ref_model.generate(ids, **hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)), **kwargs)
    cache = hf_paged.PagedCache(paged_model.config, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError) as ours:
        paged_model.generate(ids, **hf_paged.cache_kwargs(cache), **kwargs)
    assert str(ours.value) == str(theirs.value)
    assert cache.num_rows == 0 and cache.pool.stats().state_slots_in_use == 0
    with pytest.raises(ValueError, match="Assisted decoding requires a cache that can be cropped.*5.25"):
        cache.activate_past_recording()


@torch.no_grad()
@pytest.mark.skipif(not RECURRENT_PAST, reason="the recurrent layers record their past from transformers 5.25 on")
@pytest.mark.parametrize("family", FAMILIES)
def test_crop_puts_states_back(family: str) -> None:
    """After a recorded forward of 4 tokens, `crop(-3)` leaves every state slot as a cache that saw only the first
    of them holds it, and the next forward's logits are that cache's. A crop past the recorded tokens (or of tokens
    stored before the recording began), or without recording, is refused before anything changes. `record_past =
    False` on a layer (what transformers does when it gives a cache back) stops the recording."""
    paged_model, _ = _models(family)
    ids, mask = _prompts((7,))
    steps = torch.tensor([[11, 12, 13, 14]])
    recorded = hf_paged.PagedCache(paged_model.config, block_size=BLOCK_SIZE)
    plain = hf_paged.PagedCache(paged_model.config, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="activate_past_recording"):
        plain.crop(-1)  # nothing stored yet, but a hybrid's cache cannot crop without its past
    recorded.activate_past_recording(recurrent_states_to_keep=3)
    assert recorded.is_croppable and not plain.is_croppable
    recorded_logits = paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(recorded)).logits
    plain_logits = paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(plain)).logits
    torch.testing.assert_close(recorded_logits, plain_logits, atol=ATOL, rtol=1e-4)
    late = hf_paged.PagedCache(paged_model.config, block_size=BLOCK_SIZE)
    paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(late))
    late.activate_past_recording()
    with pytest.raises(ValueError, match="reach 0 tokens back"):
        late.crop(-1)  # the prompt's states were not recorded
    late.release()
    with pytest.raises(ValueError, match="reach 3 tokens back"):
        recorded.crop(-4)  # the prompt's layers handed over the states after its last 4 tokens, not the one before
    recorded.crop(0)  # as assisted decoding after each round: the past starts here
    mask = torch.cat([mask, torch.ones(1, 4, dtype=mask.dtype)], dim=-1)
    paged_model(input_ids=steps, attention_mask=mask, **hf_paged.cache_kwargs(recorded))
    paged_model(input_ids=steps[:, :1], attention_mask=mask[:, :-3], **hf_paged.cache_kwargs(plain))
    with pytest.raises(ValueError, match="reach 4 tokens back"):
        recorded.crop(-5)
    assert recorded.get_seq_length() == 11
    recorded.crop(-3)
    plain.finish_forward()
    assert recorded.get_seq_length() == plain.get_seq_length() == 8
    pool = recorded.pool.state_slots
    for key in pool.keys():
        want = plain.pool.state_slots.read(key, plain.states.slots)
        torch.testing.assert_close(pool.read(key, recorded.states.slots), want, atol=ATOL, rtol=1e-4,
                                   msg=lambda m, k=key: f"{k}: {m}")
    nxt = torch.tensor([[20]])
    got = paged_model(input_ids=nxt, attention_mask=mask[:, :-2], **hf_paged.cache_kwargs(recorded)).logits
    want = paged_model(input_ids=nxt, attention_mask=mask[:, :-2], **hf_paged.cache_kwargs(plain)).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    recorded.layers[recorded.pool.layout.state_layers[0]].record_past = False
    assert not recorded.is_recording_past(0) and not recorded.is_croppable
    with pytest.raises(ValueError, match="activate_past_recording"):
        recorded.crop(-1)
    recorded.pool.check()


@torch.no_grad()
@pytest.mark.skipif(not RECURRENT_PAST, reason="the recurrent layers record their past from transformers 5.25 on")
def test_recorded_past_follows_reordered_rows() -> None:
    """Rows reordered while recording (beam search on a cache that assisted decoding left recording) keep their own
    past: a crop after the reorder gives each row the states its own tokens led to."""
    paged_model, _ = _models("qwen3_next")
    ids, mask = _prompts((5, 7))
    steps = torch.tensor([[11, 12, 13], [21, 22, 23]])
    recorded = hf_paged.PagedCache(paged_model.config, block_size=BLOCK_SIZE)
    recorded.activate_past_recording(recurrent_states_to_keep=3)
    paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(recorded))
    recorded.crop(0)
    longer = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], dim=-1)
    paged_model(input_ids=steps, attention_mask=longer, **hf_paged.cache_kwargs(recorded))
    recorded.reorder_cache(torch.tensor([1, 0]))
    recorded.crop(-2)
    swapped = hf_paged.PagedCache(paged_model.config, block_size=BLOCK_SIZE)
    paged_model(input_ids=ids[[1, 0]], attention_mask=mask[[1, 0]], **hf_paged.cache_kwargs(swapped))
    paged_model(input_ids=steps[[1, 0], :1], attention_mask=longer[[1, 0], :-2], **hf_paged.cache_kwargs(swapped))
    swapped.finish_forward()
    pool = recorded.pool.state_slots
    for key in pool.keys():
        want = swapped.pool.state_slots.read(key, swapped.states.slots)
        torch.testing.assert_close(pool.read(key, recorded.states.slots), want, atol=ATOL, rtol=1e-4,
                                   msg=lambda m, k=key: f"{k}: {m}")
    recorded.pool.check()


@torch.no_grad()
def test_failed_forward_leaves_states() -> None:
    """A forward that cannot get its blocks (fixed pool) changes no state slot; the cache then continues as
    transformers' own cache does."""
    paged_model, ref_model = _models("jamba")
    ids, mask = _prompts((5, 6))
    pool = hf_paged.KVPool(paged_model.config, block_size=BLOCK_SIZE, num_blocks=5)
    cache = pool.new_cache()
    ref_cache = DynamicCache(config=ref_model.config)
    paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache))
    ref_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(ref_cache))
    cache.finish_forward()
    before = {k: t.clone() for k, t in pool.state_slots.tensors.items()}
    slots = list(cache.states.slots)
    long = torch.randint(3, 128, (2, 12))
    long_mask = torch.cat([mask, torch.ones_like(long)], dim=1)
    with pytest.raises(OutOfBlocksError):
        paged_model(input_ids=long, attention_mask=long_mask, **hf_paged.cache_kwargs(cache))
    cache.finish_forward()
    assert cache.states.slots == slots
    for key, tensor in pool.state_slots.tensors.items():
        assert torch.equal(tensor[slots], before[key][slots]), key
    pool.check()
    step, step_mask = torch.full((2, 1), 9), torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    got = paged_model(input_ids=step, attention_mask=step_mask, **hf_paged.cache_kwargs(cache)).logits
    want = ref_model(input_ids=step, attention_mask=step_mask, **hf_paged.cache_kwargs(ref_cache)).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_state_bytes_in_stats() -> None:
    """State slots count in `stats()`: per sequence, every recurrent layer's conv and recurrent state."""
    paged, _, cache = _both("qwen3_next", do_sample=False)
    cache.finish_forward()
    stats = cache.stats()
    slots = cache.pool.state_slots
    assert stats.state_slots_in_use == 3 and stats.state_bytes_in_use == 3 * slots.bytes_per_slot > 0
    expected = sum(t[0].numel() * t.element_size() for t in slots.tensors.values())
    assert slots.bytes_per_slot == expected
    assert stats.bytes_in_use > stats.state_bytes_in_use
    cache.release()
    assert cache.pool.stats().state_slots_in_use == 0
    cache.pool.check()


def test_gather_mode_hybrid() -> None:
    """Under sdpa a PagedCache made with the config stores K/V in blocks and returns them gathered; one made
    without config whose model ends on an attention layer refuses clearly instead of a wrong length."""
    _, ref_model = _models("qwen3_next")
    ids, mask = _prompts()
    common = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = ref_model.generate(ids, **hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)), **common)
    cache = hf_paged.PagedCache(ref_model.config, block_size=BLOCK_SIZE)
    assert torch.equal(ref_model.generate(ids, **hf_paged.cache_kwargs(cache), **common), want)
    assert cache.mode == "gather"
    with pytest.raises(UnsupportedModelError, match="config="):
        ref_model.generate(ids, **hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=BLOCK_SIZE)), **common)


@pytest.mark.parametrize("family", ["kimi_linear", "bailing_hybrid"])
def test_multi_latent_hybrids_with_the_config(family: str) -> None:
    """Kimi delta attention beside multi-latent attention: `PagedCache(config=model.config)` gives DynamicCache's
    tokens over a left-padded batch (the matrix checks the clear error of a `PagedCache()` without config)."""
    from matrix import _MLA_HYBRID

    path = saved(family, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in _MLA_HYBRID.items())))
    paged, reference = load(path, "paged"), load(path, "sdpa")
    ids = torch.randint(3, 100, (2, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    cache = hf_paged.PagedCache(config=paged.config)
    out = paged.generate(ids, **hf_paged.cache_kwargs(cache), **kwargs)
    expected = reference.generate(ids, **hf_paged.cache_kwargs(DynamicCache(config=reference.config)), **kwargs)
    assert torch.equal(out, expected)
    cache.pool.check()
