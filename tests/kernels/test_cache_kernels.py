"""Cache write and block copy kernels vs plain torch indexing (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import copy_blocks, write_kv_cache
from tests.reference import seeded


@pytest.mark.parametrize(
    "dtype,head_dim,block_size,num_kv_heads",
    [(torch.float16, 64, 16, 2), (torch.bfloat16, 80, 1, 1), (torch.float32, 96, 32, 4), (torch.float16, 256, 5, 1)],
)
def test_write_kv_cache(dtype, head_dim, block_size, num_kv_heads):
    batch, q_len, num_blocks = 3, 5, 17
    gen = seeded(0)
    # HF hands over [B, KVH, Q, D]; the launcher takes the transposed view [B, Q, KVH, D].
    key = torch.randn(batch, num_kv_heads, q_len, head_dim, generator=gen).to(dtype).transpose(1, 2)
    value = torch.randn(batch, num_kv_heads, q_len, head_dim, generator=gen).to(dtype).transpose(1, 2)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[: batch * q_len].view(batch, q_len)
    slots[1, :2] = -1  # left padding
    slots[2, :4] = -1
    write_kv_cache(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots)

    expected_k, expected_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    real = slots >= 0
    expected_k.view(-1, num_kv_heads, head_dim)[slots[real]] = key[real]
    expected_v.view(-1, num_kv_heads, head_dim)[slots[real]] = value[real]
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_copy_blocks_all_layers_one_launch(dtype):
    num_layers, shape = 3, (9, 16, 2, 64)
    key_caches = [torch.randn(shape).to(dtype) for _ in range(num_layers)]
    value_caches = [torch.randn(shape).to(dtype) for _ in range(num_layers)]
    expected = [c.clone() for c in key_caches + value_caches]
    src, dst = torch.tensor([8, 0, 3]), torch.tensor([1, 7, 5])
    copy_blocks(key_caches=key_caches, value_caches=value_caches, src_block_ids=src, dst_block_ids=dst)
    for cache, want in zip(key_caches + value_caches, expected):
        want[dst] = want[src]
        assert torch.equal(cache, want)


def test_copy_blocks_nothing_to_copy():
    caches = [torch.randn(2, 1, 1, 64)]
    before = caches[0].clone()
    empty = torch.empty(0, dtype=torch.int64)
    copy_blocks(key_caches=caches, value_caches=[torch.randn(2, 1, 1, 64)], src_block_ids=empty, dst_block_ids=empty)
    assert torch.equal(caches[0], before)
