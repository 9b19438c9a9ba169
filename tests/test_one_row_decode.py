"""The short way of one row's decode step on the PyTorch path (`dispatch.OneRowDecode`): taken by every layer
once a group's first layer recorded it, equal to the general way, and left to the general way whenever a
layer's call is not what the step was recorded for."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.attention import dispatch
from helpers import generate_both, load, max_logit_diff, saved_model


@pytest.fixture(scope="module")
def models():
    path = saved_model("llama", num_hidden_layers=4)
    return load(path, "paged"), load(path, "sdpa")


def _count(monkeypatch) -> dict[str, int]:
    """Counts the short way's answers (taken / declined) and the general way's attention calls."""
    counts = {"short": 0, "declined": 0, "general": 0}
    short, general = dispatch._one_row_decode, dispatch.torch_paged_attention

    def counted_short(*args, **kwargs):
        out = short(*args, **kwargs)
        counts["short" if out is not None else "declined"] += 1
        return out

    def counted_general(*args, **kwargs):
        counts["general"] += 1
        return general(*args, **kwargs)

    monkeypatch.setattr(dispatch, "_one_row_decode", counted_short)
    monkeypatch.setattr(dispatch, "torch_paged_attention", counted_general)
    return counts


def _greedy_matches(models, rows: int, prompt: int, new_tokens: int, seed: int) -> None:
    """Greedy generation with PagedCache + "paged" gives DynamicCache + sdpa's tokens and logits."""
    ids = torch.randint(1, 128, (rows, prompt), generator=torch.Generator().manual_seed(seed))
    out, expected, _ = generate_both(*models, input_ids=ids, max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(out.sequences, expected.sequences)
    assert max_logit_diff(out, expected) < 1e-4


def test_batch_one_decode_takes_the_short_way_and_matches(models, monkeypatch):
    counts = _count(monkeypatch)
    _greedy_matches(models, rows=1, prompt=21, new_tokens=12, seed=3)
    # 11 decode steps of 4 layers: all short (the first layer decides the step, then takes it too); the prefill's
    # 4 layers take the general way.
    assert counts == {"short": 11 * 4, "declined": 0, "general": 1 * 4}


def test_no_short_way_with_several_rows_or_quantized_pools(models, monkeypatch):
    counts = _count(monkeypatch)
    _greedy_matches(models, rows=2, prompt=9, new_tokens=5, seed=4)
    one = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    cache = hf_paged.PagedCache(kv_dtype="int8")
    models[0].generate(one, **hf_paged.cache_kwargs(cache), max_new_tokens=5, do_sample=False)
    assert counts["short"] == counts["declined"] == 0 and counts["general"] > 0


def test_a_layer_unlike_the_recorded_step_goes_the_general_way(models, monkeypatch):
    """Gradients on (the pool must not join a graph), or a layer whose K/V are not in the pool's dtype: the short
    way declines; with gradients on, the general way computes the same result."""
    paged, ref = models
    counts = _count(monkeypatch)
    ids = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    cache = hf_paged.PagedCache()
    paged(ids, **hf_paged.cache_kwargs(cache))  # prefill
    nxt = torch.tensor([[7]])
    with torch.enable_grad():
        logits = paged(nxt, **hf_paged.cache_kwargs(cache)).logits
    assert counts["short"] == 0 and counts["declined"] == 4
    reference = ref(torch.cat([ids, nxt], 1)).logits[:, -1:]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    # A step recorded for float32 K/V, then a layer giving float64 K/V: declined.
    step = dispatch.OneRowDecode(torch.device("cpu"), 7, 0, 8)
    key = torch.zeros(1, 2, 1, 16, dtype=torch.float64)
    query = torch.zeros(1, 4, 1, 16, dtype=torch.float64)
    assert dispatch._one_row_decode(cache.pool, step, 1, query, key, key, 0.25) is None


def _count_decisions(monkeypatch) -> list[int]:
    """Counts the steps decided in full (the consecutive-blocks check), not carried over from the step before."""
    decided, check = [0], dispatch.consecutive_start

    def counted(block_ids):
        decided[0] += 1
        return check(block_ids)

    monkeypatch.setattr(dispatch, "consecutive_start", counted)
    return decided


def test_a_decode_step_carries_the_step_before_over(models, monkeypatch):
    """Batch-1 decoding decides the short way once, then carries it one token on per step, across block
    boundaries whose new block follows the last (block size 4: 40 tokens fill 10 blocks), equal to sdpa."""
    counts, decided = _count(monkeypatch), _count_decisions(monkeypatch)
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(8))
    cache = hf_paged.PagedCache(block_size=4)
    out = models[0].generate(ids, **hf_paged.cache_kwargs(cache), max_new_tokens=40, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    expected = models[1].generate(ids, max_new_tokens=40, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, expected.sequences)
    assert max_logit_diff(out, expected) < 1e-4
    assert decided[0] == 1 and counts["short"] == 39 * 4 and counts["general"] == 4


def test_a_step_is_not_carried_past_a_block_that_does_not_follow(models, monkeypatch):
    """Two caches of one pool: the second's prompt takes the blocks after the first's, so the first row's next
    block is elsewhere. That step is decided again: its blocks are not consecutive, so the general way takes it,
    and the logits stay equal to sdpa's."""
    paged, ref = models
    pool = hf_paged.KVPool(paged.config, block_size=4)
    a, b = (torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(s)) for s in (9, 10))
    first, second = pool.new_cache(), pool.new_cache()
    paged(a, **hf_paged.cache_kwargs(first))  # blocks 0, 1 (6 tokens)
    paged(b, **hf_paged.cache_kwargs(second))  # blocks 2, 3
    counts, decided = _count(monkeypatch), _count_decisions(monkeypatch)
    tokens = [5, 17, 29]  # positions 6, 7 (block 1, carried), then 8: a new block after block 3
    with torch.no_grad():  # (the short way declines under gradients)
        logits = [paged(torch.tensor([[t]]), **hf_paged.cache_kwargs(first)).logits[:, -1] for t in tokens]
    reference = ref(torch.cat([a, torch.tensor([tokens])], 1)).logits[0, -3:]
    torch.testing.assert_close(torch.cat(logits), reference, atol=1e-4, rtol=1e-4)
    assert decided[0] == 2 and counts["short"] == 2 * 4 and counts["general"] == 4


def test_a_step_is_not_carried_over_a_crop(models, monkeypatch):
    """A decode step, `crop(-1)`, and another token at the same position: the slot is the one the step before
    wrote, not the next, so the step is decided again (and the logits are the new token's)."""
    paged, ref = models
    ids = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(11))
    cache = hf_paged.PagedCache(block_size=4)
    paged(ids, **hf_paged.cache_kwargs(cache))
    counts, decided = _count(monkeypatch), _count_decisions(monkeypatch)
    with torch.no_grad():
        paged(torch.tensor([[3]]), **hf_paged.cache_kwargs(cache))
        cache.crop(-1)
        logits = paged(torch.tensor([[44]]), **hf_paged.cache_kwargs(cache)).logits[:, -1]
    reference = ref(torch.cat([ids, torch.tensor([[44]])], 1)).logits[:, -1]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    assert decided[0] == 2 and counts["short"] == 2 * 4


def test_a_layers_pool_tensors_are_checked_once_per_run_of_steps_and_again_once_grown(models, monkeypatch):
    """The short way checks a layer's pool tensors (device, contiguity, dtype, capacity) once for a run of carried
    steps (`dispatch.ShortLayer`), and again for the new tensors whenever the pool grows (block size 4: 75 tokens
    outgrow the first 16 blocks); the tokens stay sdpa's."""
    paged, ref = models
    made, seen = [0], {}
    short_layer, short = dispatch.ShortLayer, dispatch._one_row_decode

    def counted_layer(*args):
        made[0] += 1
        return short_layer(*args)

    def watched(pool, step, layer_idx, *args):
        key_cache = pool.layer_storage(layer_idx)[0]
        tensors = seen.setdefault(layer_idx, [])
        if not any(t is key_cache for t in tensors):
            tensors.append(key_cache)  # (held: an id is not reused while the test holds the tensor)
        return short(pool, step, layer_idx, *args)

    monkeypatch.setattr(dispatch, "ShortLayer", counted_layer)
    monkeypatch.setattr(dispatch, "_one_row_decode", watched)
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(12))
    cache = hf_paged.PagedCache(block_size=4)
    out = paged.generate(ids, **hf_paged.cache_kwargs(cache), max_new_tokens=70, min_new_tokens=70, do_sample=False)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=70, min_new_tokens=70, do_sample=False))
    grown = [len(tensors) for tensors in seen.values()]
    assert len(grown) == 4 and min(grown) >= 2  # every layer's tensors were replaced by a growth at least once
    assert made[0] == sum(grown)
