"""A layer group's K/V stacked into one slab (`slab.py`, `BlockPool.consolidate`): made by a batch-1 decode step
once the group's layers have proven alike, grown as one, read through views made for all of its layers at once,
equal to sdpa; never made where it could cost memory (fixed pools), where layers differ, or for quantized pools."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import LlamaConfig

import hf_paged
from hf_paged.memory.pool import BlockPool
from helpers import generate_both, load, max_logit_diff, saved_model


@pytest.fixture(scope="module")
def models():
    path = saved_model("llama", num_hidden_layers=4)
    return load(path, "paged"), load(path, "sdpa")


def _greedy(models, cache, ids: torch.Tensor, new_tokens: int):
    out, expected, _ = generate_both(*models, cache, input_ids=ids, max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False)  # fmt: skip
    assert torch.equal(out.sequences, expected.sequences)
    assert max_logit_diff(out, expected) < 1e-4


def _stacked(pool: BlockPool, num_layers: int) -> bool:
    """Whether every layer's K and V are views of one slab, at the slab's place for the layer."""
    slab = pool.slab_of(0)
    if slab is None:
        return False
    for layer_idx in range(num_layers):
        key_cache, value_cache = pool.layer_storage(layer_idx)
        position = slab.position(layer_idx)
        if pool.slab_of(layer_idx) is not slab or key_cache.data_ptr() != slab.key[position].data_ptr():
            return False
        if value_cache.data_ptr() != slab.value[position].data_ptr() or not key_cache.is_contiguous():
            return False
    return True


def test_a_decode_step_stacks_the_group_and_reads_it_equal_to_sdpa(models):
    ids = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    cache = hf_paged.PagedCache()
    _greedy(models, cache, ids, 12)
    assert _stacked(cache.pool, 4)
    cache.pool.check()


def test_a_slab_grows_as_one_and_keeps_every_layers_blocks(models):
    """Block size 4: 75 tokens outgrow the first 16 blocks after the slab was made; the tokens stay sdpa's."""
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    cache = hf_paged.PagedCache(block_size=4)
    _greedy(models, cache, ids, 70)
    slab = cache.pool.slab_of(0)
    assert _stacked(cache.pool, 4) and slab.key.shape[1] == cache.pool.stats().blocks_total > 16
    cache.pool.check()


def test_fixed_and_quantized_pools_keep_a_tensor_per_layer(models):
    """A fixed pool has no room for the copy stacking takes; a quantized one is not read the short way."""
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    fixed = hf_paged.KVPool(models[0].config, num_blocks=32).new_cache()
    _greedy(models, fixed, ids, 8)
    quantized = hf_paged.PagedCache(kv_dtype="int8")
    models[0].generate(ids, **hf_paged.cache_kwargs(quantized), max_new_tokens=8, do_sample=False)
    for cache in (fixed, quantized):
        assert all(cache.pool.slab_of(i) is None for i in range(4))


def _pool(num_layers: int = 3) -> BlockPool:
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=num_layers)
    pool = BlockPool(config, block_size=4)
    pool.ensure_allocators(torch.zeros(1, 2, 1, 8))[0].allocate(1)  # block 0 (the allocator grows to 16 blocks)
    return pool


def test_only_a_group_whose_layers_are_all_stored_and_alike_is_stacked():
    unlike = _pool()
    for layer_idx, heads in enumerate((2, 2, 4)):
        unlike.storage(layer_idx, torch.zeros(1, heads, 1, 8))
    missing = _pool()
    for layer_idx in (0, 1):
        missing.storage(layer_idx, torch.zeros(1, 2, 1, 8))
    other_dtype = _pool()
    for layer_idx, dtype in enumerate((torch.float32, torch.float32, torch.float64)):
        other_dtype.storage(layer_idx, torch.zeros(1, 2, 1, 8, dtype=dtype))
    for pool in (unlike, missing, other_dtype):
        version = pool.storage_version
        pool.consolidate(0)
        assert pool.slab_of(0) is None and pool.storage_version == version
    alike = _pool()
    for layer_idx in range(3):
        keys = torch.full((1, 2, 1, 8), float(layer_idx))
        alike.storage(layer_idx, keys)[0][0, 0].copy_(keys[0, :, 0])  # a token of each layer in slot 0
    alike.consolidate(0)
    assert _stacked(alike, 3)
    for layer_idx in range(3):  # the stacking copied each layer's blocks
        assert torch.equal(alike.layer_storage(layer_idx)[0][0, 0], torch.full((2, 8), float(layer_idx)))
    version, slab = alike.storage_version, alike.slab_of(0)
    alike.consolidate(0)  # already one slab: nothing changes
    assert alike.slab_of(0) is slab and alike.storage_version == version


def test_a_step_lets_go_of_its_slab_views_so_a_grown_slab_is_freed(models):
    """A cache's last decode step keeps its plan, but not the views of the slab it read: when another cache of the
    pool grows the slab, the old one is freed at once."""
    pool = hf_paged.KVPool(models[0].config, block_size=4)
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    first = pool.new_cache()
    models[0].generate(ids, **hf_paged.cache_kwargs(first), max_new_tokens=6, do_sample=False)
    old = weakref.ref(pool.slab_of(0).key)
    long_prompt = torch.randint(1, 128, (1, 80), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        models[0](long_prompt, **hf_paged.cache_kwargs(pool.new_cache()))  # 20 more blocks: the slab grows
    gc.collect()
    assert pool.slab_of(0).key.shape[1] > 16 and old() is None
