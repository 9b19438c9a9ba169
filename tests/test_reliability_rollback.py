"""Forwards that do not complete (an exception after some layers, pool exhaustion) roll back exactly,
driven without a model through `PagedCache.attend` (see `test_property.py` for the K/V oracle)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

import hf_paged
from hf_paged.attention.plan import AttentionFeatures
from test_property import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS, FakeAttention, token_kv

CONFIG = LlamaConfig(
    num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
    hidden_size=NUM_HEADS * HEAD_DIM,
)
MODULES = [FakeAttention(i, CONFIG) for i in range(NUM_LAYERS)]


def feed(cache: hf_paged.PagedCache, history: list[list[int]], new: list[list[int]], layers: int = NUM_LAYERS):
    """One forward of `new` tokens per row after `history`, through the first `layers` layers."""
    batch, q_len = len(new), len(new[0])
    keys = torch.zeros(NUM_LAYERS, batch, NUM_KV_HEADS, q_len, HEAD_DIM)
    values = torch.zeros_like(keys)
    for b in range(batch):
        for i in range(q_len):
            kv = token_kv(None, tuple(history[b] + new[b][: i + 1]))
            keys[:, b, :, i], values[:, b, :, i] = kv[:, 0], kv[:, 1]
    query = torch.randn(batch, NUM_HEADS, q_len, HEAD_DIM)
    for layer in range(layers):
        cache.attend(MODULES[layer], query, keys[layer], values[layer], layer, None, AttentionFeatures(HEAD_DIM**-0.5))
    for b in range(batch):
        history[b] = history[b] + new[b]


def assert_holds(cache: hf_paged.PagedCache, history: list[list[int]]) -> None:
    pool, bs = cache.pool, cache.pool.block_size
    for layer in range(NUM_LAYERS):
        key_cache = pool.key_caches[layer].view(-1, NUM_KV_HEADS, HEAD_DIM)
        for b, tokens in enumerate(history):
            table = cache.block_table(b, layer)
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(len(tokens))])
            expected = torch.stack([token_kv(None, tuple(tokens[: p + 1]))[layer, 0] for p in range(len(tokens))])
            assert torch.equal(key_cache[slots], expected), f"row {b} layer {layer} reads other K/V"


def test_rollback_after_copy_on_write_keeps_the_source_block():
    """An interrupted forward copied the shared last partial block (copy-on-write) and dropped its
    reference to the source; the fork that shared it is released, the source block is freed and reused
    by another cache. Rolling back must not put the reused block back into the first cache's table."""
    pool = hf_paged.KVPool(CONFIG, block_size=4, num_blocks=8, prefix_caching=False)
    cache, hist = pool.new_cache(), [[]]
    feed(cache, hist, [[1, 2, 3, 4, 1, 2]])  # blocks [0, 1]; block 1 holds 2 of 4 tokens
    fork = cache.fork()  # shares blocks 0 and 1
    cache.get_seq_length()
    feed(cache, [list(hist[0])], [[3]], layers=1)  # interrupted: copy-on-write of block 1 into a fresh block
    pool.check()
    fork.release()  # the source block loses its last table reference
    pool.check()
    other, other_hist = pool.new_cache(), [[]]
    feed(other, other_hist, [[4, 4, 4, 4] * pool.allocators[0].num_available])  # takes every free block
    pool.check()
    feed(cache, hist, [[2]])  # rolls the interrupted forward back, then computes a new token
    pool.check()
    assert_holds(other, other_hist)
    assert_holds(cache, hist)
    cache.release()
    other.release()
    pool.check()
    assert all(b.ref_count == 0 for b in pool.allocators[0].blocks)


def test_failed_first_forward_does_not_keep_row_expansion():
    pool = hf_paged.KVPool(CONFIG, block_size=2, num_blocks=4, prefix_caching=True)
    prompt = torch.tensor([[1, 2, 3, 1, 2]])
    with pool.new_cache(prompt) as warm:
        feed(warm, [[]], [prompt[0].tolist()])
        warm.commit_tokens(prompt)
    cache = pool.new_cache(prompt)  # holds the first 4 tokens (2 cached blocks)
    assert cache.get_seq_length() == 4
    hog = pool.new_cache()
    feed(hog, [[]], [[4, 4, 4]])  # takes the remaining free blocks
    refs = [b.ref_count for b in pool.allocators[0].blocks]
    with pytest.raises(hf_paged.OutOfBlocksError):
        feed(cache, [[1, 2, 3, 1]] * 3, [[2]] * 3)  # generate(num_return_sequences=3): 3 rows
    pool.check()
    assert [b.ref_count for b in pool.allocators[0].blocks] == refs
    assert cache.num_rows == 1


def test_interrupted_first_forward_does_not_keep_row_expansion():
    """The same expansion, by a first forward that stops after its first layer (an exception in the model):
    closing it rolls the rows back to the prepared one."""
    pool = hf_paged.KVPool(CONFIG, block_size=2, num_blocks=16, prefix_caching=True)
    prompt = torch.tensor([[1, 2, 3, 1, 2]])
    with pool.new_cache(prompt) as warm:
        feed(warm, [[]], [prompt[0].tolist()])
        warm.commit_tokens(prompt)
    cache = pool.new_cache(prompt)  # holds the first 4 tokens (2 cached blocks)
    refs = [b.ref_count for b in pool.allocators[0].blocks]
    feed(cache, [[1, 2, 3, 1]] * 3, [[2]] * 3, layers=1)  # generate(num_return_sequences=3), interrupted
    assert cache.num_rows == 3  # the forward is still open
    cache.finish_forward()
    pool.check()
    assert [b.ref_count for b in pool.allocators[0].blocks] == refs
    assert (cache.num_rows, cache.seq_lens, cache.get_seq_length()) == (1, [4], 4)


def test_out_of_blocks_evicts_nothing_and_leaves_the_allocator_exactly_as_it_was():
    """Row 0 of a step fits, row 1 does not: the step must fail before row 0 takes (or evicts) a block."""
    pool = hf_paged.KVPool(CONFIG, block_size=2, num_blocks=6, prefix_caching=True)
    prompt = torch.tensor([[1, 2, 3, 4]])
    with pool.new_cache(prompt) as warm:
        feed(warm, [[]], [[1, 2, 3, 4]])
        warm.commit_tokens(prompt)
    allocator = pool.allocators[0]
    assert len(allocator.evictable) == 2 and len(allocator.free_ids) == 4
    before = ([b.ref_count for b in allocator.blocks], list(allocator.free_ids), list(allocator.evictable),
              dict(allocator.index), allocator.num_evictions)
    cache = pool.new_cache()
    with pytest.raises(hf_paged.OutOfBlocksError) as info:
        feed(cache, [[], []], [[4, 4, 4, 4, 4, 4, 4, 4], [3, 3, 3, 3, 3, 3, 3, 3]])  # 4 + 4 blocks > 6
    assert info.value.blocks_needed == 8 and info.value.blocks_free == 6
    after = ([b.ref_count for b in allocator.blocks], list(allocator.free_ids), list(allocator.evictable),
             dict(allocator.index), allocator.num_evictions)
    assert after == before
    pool.check()
    assert cache.get_seq_length() == 0
    hit = pool.new_cache(prompt)  # the cached prefix survived
    assert hit.get_seq_length() == 2  # whole blocks short of the last prompt token (its block is recomputed)
    hit.release()
    cache.release()
    pool.check()


def test_crop_into_an_indexed_block_keeps_its_slots_filled():
    """`crop()` back into a full block that the prefix index serves leaves the block full: a later prompt that
    takes it from the index reads all its slots (found by the state machine at 300 examples)."""
    pool = hf_paged.KVPool(CONFIG, block_size=2, num_blocks=16, prefix_caching=True)
    prompt = torch.tensor([[1, 2, 3, 1, 4, 4]])
    cache = pool.new_cache(prompt)
    feed(cache, [[]], [prompt[0].tolist()])
    cache.finish_forward()  # commit: the three full blocks are indexed
    cache.crop(-1)  # the row now ends inside its (indexed) last block
    pool.check()
    cache.release()
    again = pool.new_cache(torch.tensor([[1, 2, 3, 1, 4, 4, 5]]))
    assert again.seq_lens == [6]  # the whole indexed prompt, last block included
    pool.check()
    hist = [[1, 2, 3, 1, 4, 4]]
    feed(again, hist, [[5]])
    pool.check()
    assert_holds(again, hist)
