"""Launches laid out once (`step=`): later calls whose tensors have the same layouts (the other layers, the next
forwards) repeat the first call's launches with their own tensors (`kernels.launch.Repeatable`), equal to a call
made from scratch, and any call that differs in layout or scalars is checked and laid out again (interpreter on
CPU)."""

from __future__ import annotations

import sys

import pytest
import torch

from hf_paged.kernels import paged_attention, write_kv_cache
from tests.reference import make_paged_inputs, reference_paged_attention, seeded

attention_module = sys.modules["hf_paged.kernels.paged_attention"]
write_module = sys.modules["hf_paged.kernels.write_kv_cache"]


def _count(monkeypatch, module, name: str) -> list[int]:
    calls, original = [0], getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _layer(inp, seed: int, dtype=torch.float32):
    """Another layer's query and pools over the same tables: new tensors of the same layout."""
    gen = seeded(seed)
    shapes = (inp.query.shape, inp.key_cache.shape, inp.value_cache.shape)
    return tuple(torch.randn(shape, generator=gen).to(dtype) for shape in shapes)


@pytest.mark.parametrize(
    "num_splits,features", [(1, {}), (3, {"sinks": True, "softcap": 5.0}), (1, {"sliding_window": 7})]
)
def test_later_layers_repeat_the_first_layers_launches(monkeypatch, num_splits, features):
    inp = make_paged_inputs(seq_lens=[54, 97, 9], query_lens=[1, 1, 1], num_heads=8, num_kv_heads=2, head_dim=64,
                            block_size=16, seed=1)
    laid_out = _count(monkeypatch, attention_module, "attention_launches")
    step: dict = {}
    for seed in range(3):
        query, key_cache, value_cache = _layer(inp, seed)
        sinks = torch.randn(8, generator=seeded(seed)) if features.get("sinks") else None
        extra = {k: v for k, v in features.items() if k != "sinks"}
        out = paged_attention(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=inp.block_tables,
                              seq_lens=inp.seq_lens, query_lens=inp.query_lens, scale=0.125, sinks=sinks,
                              num_splits=num_splits, step=step, **extra)
        ref = reference_paged_attention(query, key_cache, value_cache, inp.block_tables, inp.seq_lens, inp.query_lens,
                                        scale=0.125, sinks=sinks, **extra)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert laid_out[0] == 1


def test_a_call_unlike_the_first_is_checked_and_laid_out_again(monkeypatch):
    """Other tables and lengths of the same layout (the next forward) are rebound; another dtype, scale, table
    width or a tensor passed as both K and V is checked and laid out again."""
    inp = make_paged_inputs(seq_lens=[54, 97], query_lens=[1, 1], num_heads=4, num_kv_heads=2, head_dim=64,
                            block_size=16, seed=2)
    laid_out = _count(monkeypatch, attention_module, "attention_launches")
    step: dict = {}

    def call(query, key_cache, value_cache, block_tables=inp.block_tables, seq_lens=inp.seq_lens, scale=0.125):
        out = paged_attention(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                              seq_lens=seq_lens, query_lens=inp.query_lens, scale=scale, step=step)
        ref = reference_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, inp.query_lens,
                                        scale=scale)
        tolerance = 2e-3 if query.dtype == torch.float16 else 2e-5
        torch.testing.assert_close(out, ref.to(out.dtype), atol=tolerance, rtol=tolerance)

    call(*_layer(inp, 0))
    # The next forward: its rows' blocks moved and one row is shorter (same shapes): repeated, not laid out.
    moved, shorter = inp.block_tables.flip(0).contiguous(), torch.tensor([90, 40], dtype=torch.int32)
    call(*_layer(inp, 1), block_tables=moved, seq_lens=shorter)
    assert laid_out[0] == 1
    call(*_layer(inp, 2, torch.float16))  # another dtype
    call(*_layer(inp, 3), scale=0.5)  # another scale
    query, key_cache, value_cache = _layer(inp, 4)
    call(query, key_cache, key_cache)  # one tensor for K and V: never kept for other tensors
    call(query, key_cache, value_cache)
    call(*_layer(inp, 5))
    assert laid_out[0] == 5
    wider = torch.cat([inp.block_tables, torch.full((2, 1), -1, dtype=torch.int32)], dim=1)
    call(*_layer(inp, 6), block_tables=wider)
    assert laid_out[0] == 6
    # A later call whose pool is not contiguous has another layout: it is checked, and refused.
    strided = torch.randn(key_cache.shape[0], key_cache.shape[1], key_cache.shape[2], 128)[..., ::2]
    with pytest.raises(ValueError, match="contiguous"):
        call(query, strided, value_cache)


def test_cache_write_repeats_its_launch_for_later_layers(monkeypatch):
    batch, q_len, heads, head_dim, shape = 2, 3, 2, 64, (9, 4, 2, 64)
    gen = seeded(3)
    slots = torch.tensor([[5, 6, 7], [-1, 20, 21]])
    laid_out = _count(monkeypatch, write_module, "write_launches")
    step: dict = {}
    for _ in range(3):
        key = torch.randn(batch, heads, q_len, head_dim, generator=gen).transpose(1, 2)
        value = torch.randn(batch, heads, q_len, head_dim, generator=gen).transpose(1, 2)
        key_cache, value_cache = torch.zeros(shape), torch.zeros(shape)
        write_kv_cache(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots,
                       step=step)
        real = slots >= 0
        assert torch.equal(key_cache.view(-1, heads, head_dim)[slots[real]], key[real])
        assert torch.equal(value_cache.view(-1, heads, head_dim)[slots[real]], value[real])
        assert key_cache.view(-1, heads, head_dim).abs().sum(dim=(1, 2)).count_nonzero() == int(real.sum())
    assert laid_out[0] == 1


def test_a_later_call_with_a_non_tensor_input_gets_the_input_checks_error():
    inp = make_paged_inputs(seq_lens=[9], query_lens=[1], num_heads=2, num_kv_heads=2, head_dim=64, block_size=4,
                            seed=5)
    step: dict = {}
    kw = dict(query=inp.query, key_cache=inp.key_cache, value_cache=inp.value_cache, seq_lens=inp.seq_lens,
              query_lens=inp.query_lens, scale=0.125, step=step)
    paged_attention(block_tables=inp.block_tables, **kw)
    with pytest.raises(TypeError, match="block_tables must be a torch.Tensor"):
        paged_attention(block_tables=inp.block_tables.tolist(), **kw)


def test_inputs_a_position_already_matched_are_not_read_again(monkeypatch):
    """The step's tables (the same tensors in every layer) and a layer's pools (the same tensors in every step) are
    compared by identity once a position matched them; only new tensors have their layouts read."""
    inp = make_paged_inputs(seq_lens=[20, 33], query_lens=[1, 1], num_heads=4, num_kv_heads=2, head_dim=64,
                            block_size=16, seed=6)
    launch_module = sys.modules["hf_paged.kernels.launch"]
    read = _count(monkeypatch, launch_module, "tensor_layout")
    step: dict = {}
    layers = [_layer(inp, seed) for seed in range(3)]

    def call(query, key_cache, value_cache):
        out = paged_attention(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=inp.block_tables,
                              seq_lens=inp.seq_lens, query_lens=inp.query_lens, scale=0.125, step=step)
        ref = reference_paged_attention(query, key_cache, value_cache, inp.block_tables, inp.seq_lens, inp.query_lens,
                                        scale=0.125)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)

    call(*layers[0])  # laid out: every input's layout read once
    first = read[0]
    call(*layers[1])  # a new layer: its query and pools are new tensors, the tables are not
    assert read[0] - first == 3
    before = read[0]
    call(*layers[1])  # the same layer again (the next step): nothing new
    assert read[0] == before
    call(layers[2][0].clone(), *layers[0][1:])  # a fresh query over pools seen before
    assert read[0] - before == 1
