"""The pool's two tensor layouts (`memory/slots.py`): head-major for the PyTorch path, token-major (contiguous) for
the Triton kernels. A layer keeps its layout through growth, and both give the same logits and stored K/V."""

from __future__ import annotations

import weakref

import pytest
import torch

import hf_paged
from hf_paged.memory import pool as pool_module
from hf_paged.memory.slots import slots_flat, slots_view
from helpers import left_padded, load, saved_model


def _head_major(cache: torch.Tensor) -> bool:
    """Whether a pool tensor `[num_blocks, block_size, num_kv_heads, head_dim]` keeps each KV head's slots adjacent."""
    return cache.stride(1) == cache.shape[3] and cache.stride(2) == cache.shape[0] * cache.shape[1] * cache.shape[3]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_each_path_gets_its_layout_and_growth_keeps_it(backend, monkeypatch):
    """On the PyTorch path a layer's tensors are head-major: one row's run of blocks is one contiguous span per KV
    head. Where the Triton kernels read them they are contiguous. Growing keeps the layout and every stored slot."""
    monkeypatch.setattr(pool_module, "backend_for", lambda device: backend)
    pool = pool_module.BlockPool(block_size=4)
    keys = torch.randn(1, 3, 1, 8)
    pool.ensure_allocators(keys)
    pool.allocators[0].allocate(3)
    key_cache, value_cache = pool.storage_for_write(0, keys, 6)
    assert slots_flat(key_cache) and slots_flat(value_cache)
    assert key_cache.shape[0] > 0 and _head_major(key_cache) == _head_major(value_cache) == (backend == "torch")
    assert key_cache.is_contiguous() == (backend == "triton")
    if backend == "torch":
        view = slots_view(key_cache, 4, 8)  # [1, num_kv_heads, 8, head_dim]: blocks 1 and 2
        assert all(view[0, head].is_contiguous() for head in range(3))
    key_cache.view(-1, 3, 8).copy_(torch.randn(key_cache.shape[0] * 4, 3, 8))
    before = key_cache.clone()
    monkeypatch.setattr(pool_module, "backend_for", lambda device: "triton" if backend == "torch" else "torch")
    pool.allocators[0].allocate(before.shape[0] + 1)  # more blocks than the tensors hold: the next write grows them
    grown, _ = pool.storage_for_write(0, keys, 6)
    assert grown.shape[0] > before.shape[0] and _head_major(grown) == (backend == "torch")
    assert torch.equal(grown[: before.shape[0]], before)


def test_both_layouts_give_the_same_logits_and_blocks(monkeypatch):
    """Beam search over rows of unequal lengths (forks, copy-on-write, pool growth): the head-major pool gives the
    token-major pool's scores and stored K/V bit for bit, and both the sdpa model's tokens."""
    path = saved_model("llama", num_hidden_layers=2)
    model, ref = load(path, "paged"), load(path, "sdpa")
    ids, mask = left_padded([7, 19, 12], seed=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, num_beams=3, do_sample=False, output_scores=True,
                  return_dict_in_generate=True)
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setattr(pool_module, "backend_for", lambda device, b=backend: b)
        cache = hf_paged.PagedCache(block_size=4)
        with torch.no_grad():
            out = model.generate(ids, **hf_paged.cache_kwargs(cache), **kwargs)
        stored = [cache.pool.layer_storage(layer) for layer in range(2)]
        assert all(_head_major(t) == (backend == "torch") for pair in stored for t in pair)
        runs[backend] = out, [t.contiguous() for pair in stored for t in pair]
    (head_major, head_blocks), (token_major, token_blocks) = runs["torch"], runs["triton"]
    assert torch.equal(head_major.sequences, token_major.sequences)
    assert all(torch.equal(a, b) for a, b in zip(head_major.scores, token_major.scores, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(head_blocks, token_blocks, strict=True))
    with torch.no_grad():
        expected = ref.generate(ids, **kwargs)
    assert torch.equal(head_major.sequences, expected.sequences)


def test_layers_reusing_kv_read_the_store_layer_of_their_type():
    """`kv_readers`: from the config's sharing modes where the release has them, else from `num_kv_shared_layers`
    (the last layers read the last earlier layer of their type); a sharing mode it does not know is refused."""
    from types import SimpleNamespace

    from hf_paged import UnsupportedModelError
    from hf_paged.memory.layers import kv_readers

    types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    counted = SimpleNamespace(model_type="t", num_hidden_layers=5, layer_types=types, num_kv_shared_layers=2)
    assert kv_readers(counted) == {3: 2, 4: 1}
    modes = SimpleNamespace(model_type="t", num_hidden_layers=5, layer_types=types, num_kv_shared_layers=2,
                            kv_sharing_modes=[None, "store", "store", "reuse", "reuse"])
    assert kv_readers(modes) == {3: 2, 4: 1}
    assert kv_readers(SimpleNamespace(model_type="t", num_hidden_layers=2, layer_types=types[:2])) == {}
    other = SimpleNamespace(model_type="t", num_hidden_layers=2, layer_types=types[:2],
                            kv_sharing_modes=[None, "reuse_but_indexer"])
    with pytest.raises(UnsupportedModelError, match="shares K/V in a way a paged cache does not serve"):
        kv_readers(other)


@pytest.mark.parametrize("grow", ["as_layers_write", "all_layers_at_once"])
def test_a_growing_pool_replaces_one_layer_at_a_time(grow, monkeypatch):
    """While a pool grows, the only superseded tensors still alive are the K/V of the layer being grown: each layer
    gets its new tensors, copies its blocks and drops the old ones before the next layer grows. The peak is the new
    blocks plus one layer's old ones, not every layer's (a tensor stacking all layers would hold them all). Decoding
    grows each layer as it writes; `grow_storage` (before a compiled step; `copy_blocks` grows the same way) grows
    every layer in one call."""
    path = saved_model("llama", num_hidden_layers=4)
    model = load(path, "paged")
    ids, mask = left_padded([5, 9], seed=1)
    superseded: dict[int, list[weakref.ref]] = {}
    latest: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    growing: list[int] = []
    alive_beside: list[int] = []
    storage_for_write, new_pool_tensor = pool_module.BlockPool.storage_for_write, pool_module.new_pool_tensor

    def tracked_storage(self, layer_idx, *args, **kwargs):
        growing.append(layer_idx)
        try:
            out = storage_for_write(self, layer_idx, *args, **kwargs)
        finally:
            growing.pop()
        if layer_idx in latest and out[0] is not latest[layer_idx][0]:
            superseded.setdefault(layer_idx, []).extend(weakref.ref(t) for t in latest[layer_idx])
        latest[layer_idx] = out
        return out

    def tracked_new(*args, **kwargs):
        others = (ref for layer, refs in superseded.items() if layer != growing[-1] for ref in refs)
        alive_beside.append(sum(ref() is not None for ref in others))
        return new_pool_tensor(*args, **kwargs)

    monkeypatch.setattr(pool_module.BlockPool, "storage_for_write", tracked_storage)
    monkeypatch.setattr(pool_module, "new_pool_tensor", tracked_new)
    cache = hf_paged.PagedCache(block_size=4)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=80, min_new_tokens=80, do_sample=False,
                       **hf_paged.cache_kwargs(cache))
    if grow == "all_layers_at_once":
        superseded.clear()
        alive_beside.clear()
        pool = cache.pool
        capacity = pool.allocators[0].capacity
        pool.allocators[0].allocate(pool.allocators[0].num_available + 1)  # past the capacity: the allocator grows
        assert pool.allocators[0].capacity > capacity
        pool.grow_storage()
        assert all(pool.layer_storage(layer)[0].shape[0] == pool.allocators[0].capacity for layer in range(4))
    assert sorted(superseded) == [0, 1, 2, 3]
    assert min(len(refs) for refs in superseded.values()) >= (4 if grow == "as_layers_write" else 2)  # K and V
    assert alive_beside and max(alive_beside) == 0
