"""The short way of one row's decode step on the PyTorch path (`dispatch.OneRowDecode`): taken by every layer
once a group's first layer recorded it, equal to the general way, and left to the general way whenever a
layer's call is not what the step was recorded for."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged import dispatch
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
