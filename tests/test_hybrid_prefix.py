"""Prefix hits of hybrid models: a `KVPool` hit restores the recurrent states at the hit's end (a snapshot an indexed
block holds), and its results are transformers' own (DynamicCache + sdpa) and a miss's, token for token and logit for
logit. jamba's recurrent layers restart every multi-token forward from zero states (transformers' Mamba scan), so its
prompts stay misses, never split.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.compat import RECURRENT_PAST
from hf_paged.memory.pool import STATE_SHARE

from helpers import left_padded
from matrix import HYBRIDS, load, saved

FAMILIES = ["qwen3_next", "jamba", "falcon_h1", "lfm2"]
HITTING = [f for f in FAMILIES if f != "jamba"]
BLOCK_SIZE = 4
ATOL = 1e-4
COMMON = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
              output_logits=True)


@functools.lru_cache(maxsize=None)
def _models(family: str):
    """(paged model, reference model) of a family, loaded once."""
    config = HYBRIDS[family][0]
    path = saved(family, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items())))
    return load(path, "paged"), load(path, "sdpa")


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed))


def _reference(family: str, ids: torch.Tensor, mask: torch.Tensor, **kwargs):
    _, ref_model = _models(family)
    args = {**COMMON, **kwargs}
    return ref_model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)), **args)


def _run(pool: hf_paged.KVPool, family: str, ids: torch.Tensor, mask: torch.Tensor, **kwargs):
    """generate() on `pool.new_cache(ids, mask, model=)`; returns (output, prefix hit tokens). Checks the pool."""
    paged_model, _ = _models(family)
    args = {**COMMON, **kwargs}
    with pool.new_cache(ids, mask, model=paged_model) as cache:
        hit = cache.prefix_hit_tokens
        out = paged_model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), **args)
        pool.check()
    pool.check()
    return out, hit


def _assert_same(paged, reference) -> None:
    assert torch.equal(paged.sequences, reference.sequences)
    for step, (a, b) in enumerate(zip(paged.logits, reference.logits, strict=True)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


def _one(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens[None], torch.ones(1, len(tokens), dtype=torch.long)


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_same_prompt_twice(family: str) -> None:
    """The second run of a prompt hits up to its last block end (restoring the states there) and gives the miss's and
    transformers' tokens and logits; jamba misses both times."""
    paged_model, _ = _models(family)
    pool = hf_paged.KVPool(paged_model.config, block_size=BLOCK_SIZE)
    ids, mask = _one(_tokens(19, 1))
    reference = _reference(family, ids, mask)
    miss, hit0 = _run(pool, family, ids, mask)
    again, hit1 = _run(pool, family, ids, mask)
    assert hit0 == 0
    assert hit1 == (16 if family in HITTING else 0)
    _assert_same(miss, reference)
    _assert_same(again, reference)
    stats = pool.stats()
    assert stats.prefix_hit_tokens == hit1 and stats.state_slots_in_use == 0
    if family in HITTING:
        assert stats.state_snapshots == 1 and stats.state_snapshot_bytes == pool.state_slots.bytes_per_slot > 0
    else:
        assert stats.state_snapshots == 0 and stats.state_snapshot_bytes == 0
    pool.clear_prefix_cache()
    assert pool.stats().state_snapshots == 0 and pool.state_slots.num_in_use == 0
    pool.check()


@torch.no_grad()
@pytest.mark.parametrize("family", HITTING)
def test_shared_prefix_different_suffix(family: str) -> None:
    """A system prompt that ended a block-aligned forward of one prompt is hit by another prompt starting with it."""
    paged_model, _ = _models(family)
    pool = hf_paged.KVPool(paged_model.config, block_size=BLOCK_SIZE)
    system = _tokens(16, 2)
    first = torch.cat([system, _tokens(3, 3)])  # its last block end is the system prompt's end
    second = torch.cat([system, _tokens(7, 4)])
    _run(pool, family, *_one(first))
    out, hit = _run(pool, family, *_one(second))
    assert hit == 16
    _assert_same(out, _reference(family, *_one(second)))


@torch.no_grad()
@pytest.mark.parametrize("family", HITTING)
def test_left_padded_batches(family: str) -> None:
    """Rows of different lengths are prepared row by row, so the same left-padded batch hits again, a row's snapshot
    serves its tokens alone, and a batch of a known and a new prompt hits the known one."""
    paged_model, _ = _models(family)
    pool = hf_paged.KVPool(paged_model.config, block_size=BLOCK_SIZE)
    long, short = _tokens(19, 5), _tokens(6, 6)
    ids, mask = left_padded([19, 6], seed=0)
    ids[0], ids[1, 13:] = long, short
    reference = _reference(family, ids, mask)
    out, hit = _run(pool, family, ids, mask)
    assert hit == 0
    _assert_same(out, reference)
    assert pool.stats().state_snapshots == 2  # at each row's last block end
    out, hit = _run(pool, family, ids, mask)
    assert hit == 16 + 4
    _assert_same(out, reference)
    out, hit = _run(pool, family, *_one(short))
    assert hit == 4
    _assert_same(out, _reference(family, *_one(short)))
    ids, mask = left_padded([19, 3], seed=7)
    ids[0] = long
    out, hit = _run(pool, family, ids, mask)  # row 0 hits 16 tokens, row 1 is new
    assert hit == 16
    _assert_same(out, _reference(family, ids, mask))


@torch.no_grad()
@pytest.mark.parametrize("family", ["qwen3_next", "lfm2"])
def test_hit_then_eviction_then_miss(family: str) -> None:
    """Under a small max_memory, other prompts evict a prefix's blocks and their snapshot with them (LRU); the prompt
    then misses and is still right."""
    paged_model, _ = _models(family)
    pool = hf_paged.KVPool(paged_model.config, block_size=BLOCK_SIZE, max_memory=40_000)
    ids, mask = _one(_tokens(19, 8))
    reference = _reference(family, ids, mask)
    _run(pool, family, ids, mask)
    out, hit = _run(pool, family, ids, mask)
    assert hit == 16
    _assert_same(out, reference)
    blocks = pool.fixed_capacity()
    for seed in range(20, 20 + blocks // 5 + 2):  # 6 blocks each: more than the pool holds
        _run(pool, family, *_one(_tokens(19, seed)))
    stats = pool.stats()
    assert stats.evictions > 0
    kv_bytes = stats.bytes_reserved - stats.state_bytes_reserved
    assert kv_bytes <= (1 - STATE_SHARE) * 40_000  # K/V blocks get the rest of the budget
    assert 0 < stats.state_snapshot_bytes <= STATE_SHARE * 40_000  # snapshots stay within the state share
    out, hit = _run(pool, family, ids, mask)
    assert hit == 0
    _assert_same(out, reference)


@torch.no_grad()
@pytest.mark.parametrize("family", HITTING)
def test_beams_and_fork_after_hit(family: str) -> None:
    """Beams and a fork of a hit cache share the snapshot's slot copy-on-write; the index's snapshot stays intact."""
    paged_model, ref_model = _models(family)
    pool = hf_paged.KVPool(paged_model.config, block_size=BLOCK_SIZE)
    ids, mask = _one(_tokens(19, 9))
    _run(pool, family, ids, mask)
    beams = dict(num_beams=3, num_return_sequences=2, output_scores=True, output_logits=False)
    with pool.new_cache(ids, mask, model=paged_model) as cache, pytest.raises(ValueError, match="repeat_interleave"):
        paged_model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), **{**COMMON, **beams})
    # the prompts repeated as generate() repeats them for the beams: each row hits the one snapshot
    with pool.new_cache(ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0), model=paged_model) as cache:
        assert cache.prefix_hit_tokens == 3 * 16 and len(set(cache.states.slots)) == 1
        out = paged_model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), **{**COMMON, **beams})
        pool.check()
    reference = _reference(family, ids, mask, **beams)
    assert torch.equal(out.sequences, reference.sequences)
    torch.testing.assert_close(out.sequences_scores, reference.sequences_scores, atol=ATOL, rtol=1e-4)
    cache = pool.new_cache(ids, mask, model=paged_model)
    ref_cache = DynamicCache(config=ref_model.config)
    paged_model(input_ids=ids[:, 16:], attention_mask=mask, **hf_paged.cache_kwargs(cache))
    ref_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(ref_cache))
    fork = cache.fork()
    ref_fork = ref_cache.__class__(config=ref_model.config)
    ref_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(ref_fork))
    step_mask = torch.ones(1, 20, dtype=torch.long)
    for token, mine, theirs in ((7, cache, ref_cache), (9, fork, ref_fork)):
        step = torch.tensor([[token]])
        got = paged_model(input_ids=step, attention_mask=step_mask, **hf_paged.cache_kwargs(mine)).logits
        want = ref_model(input_ids=step, attention_mask=step_mask, **hf_paged.cache_kwargs(theirs)).logits
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    cache.finish_forward(), fork.finish_forward()
    pool.check()
    fork.release(), cache.release()
    out, hit = _run(pool, family, ids, mask)
    assert hit == 16
    _assert_same(out, _reference(family, ids, mask))


@torch.no_grad()
@pytest.mark.parametrize("family", HITTING)
def test_wrong_state_would_show(family: str) -> None:
    """The comparisons above would catch a hit that reused the blocks with other states: the same hit with its
    snapshot zeroed, or replaced by another prompt's (stale), gives other logits."""
    paged_model, _ = _models(family)
    pool = hf_paged.KVPool(paged_model.config, block_size=BLOCK_SIZE)
    ids, mask = _one(_tokens(19, 10))
    other = _one(_tokens(19, 11))
    reference = _reference(family, ids, mask)
    _run(pool, family, ids, mask)
    _run(pool, family, *other)
    for corrupt in ("zero", "stale"):
        cache = pool.new_cache(ids, mask, model=paged_model)
        other_cache = pool.new_cache(*other, model=paged_model)  # its row holds the other prompt's snapshot
        assert cache.prefix_hit_tokens == other_cache.prefix_hit_tokens == 16
        cache.states.release_all()  # the rows start from other states than the hit's snapshot
        with pool.lock:
            fresh = pool.state_slots.allocate(1)
            if corrupt == "zero":
                pool.state_slots.clear(fresh)
            else:
                pool.state_slots.copy(other_cache.states.slots, fresh)
        cache.states.adopt(fresh)
        out = paged_model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), **COMMON)
        diff = max((a - b).abs().max().item() for a, b in zip(out.logits, reference.logits, strict=True))
        assert diff > 100 * ATOL, f"{corrupt} state: logits within {diff}"
        cache.release(), other_cache.release()
        pool.check()
    out, hit = _run(pool, family, ids, mask)
    assert hit == 16
    _assert_same(out, reference)


@torch.no_grad()
def test_forward_ending_on_block_end_without_model() -> None:
    """Without `model=`, a forward that ends on a block end of known tokens still leaves a snapshot: a prompt of whole
    blocks computed by generate() is hit by a longer prompt starting with it."""
    family = "qwen3_next"
    paged_model, _ = _models(family)
    pool = hf_paged.KVPool(paged_model.config, block_size=BLOCK_SIZE)
    prompt = _tokens(16, 12)
    ids, mask = _one(prompt)
    with pool.new_cache(ids, mask) as cache:
        paged_model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), **COMMON)
    assert pool.stats().state_snapshots == 1
    longer = _one(torch.cat([prompt, _tokens(5, 13)]))
    with pool.new_cache(*longer) as cache:
        assert cache.prefix_hit_tokens == 16
        out = paged_model.generate(longer[0], attention_mask=longer[1], **hf_paged.cache_kwargs(cache), **COMMON)
    _assert_same(out, _reference(family, *longer))
    pool.check()


@torch.no_grad()
def test_zeroed_rows_beside_a_hit() -> None:
    """One forward column for a batch (rows alike in length, `new_cache` without model): a row keeping nothing starts
    from zeroed states beside a row restored from its snapshot."""
    family = "qwen3_next"
    paged_model, _ = _models(family)
    pool = hf_paged.KVPool(paged_model.config, block_size=BLOCK_SIZE)
    prompt = _tokens(16, 14)
    with pool.new_cache(*_one(prompt)) as cache:
        paged_model.generate(prompt[None], attention_mask=torch.ones(1, 16, dtype=torch.long),
                             **hf_paged.cache_kwargs(cache), **COMMON)
    ids, mask = left_padded([19, 3], seed=15)
    ids[0, :16] = prompt
    with pool.new_cache(ids, mask) as cache:
        assert cache.prefix_hit_tokens == 16 and cache.seq_lens == [16, 0]
        out = paged_model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), **COMMON)
        pool.check()
    _assert_same(out, _reference(family, ids, mask))
    pool.check()


@torch.no_grad()
def test_prompt_fed_again_after_hit_refused() -> None:
    """A hit cache fed its whole prompt again (not what generate() does) raises instead of mixing states."""
    family = "lfm2"
    paged_model, _ = _models(family)
    pool = hf_paged.KVPool(paged_model.config, block_size=BLOCK_SIZE)
    ids, mask = _one(_tokens(19, 16))
    _run(pool, family, ids, mask)
    cache = pool.new_cache(ids, mask, model=paged_model)
    assert cache.prefix_hit_tokens == 16
    with pytest.raises(ValueError, match="remaining"):
        paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache))
    cache.release()
    pool.check()
    _, hit = _run(pool, family, ids, mask)
    assert hit == 16


@pytest.mark.skipif(not RECURRENT_PAST, reason="before transformers 5.25, generate() refuses assisted decoding on "
                    "stateful models first")
def test_prompt_lookup_on_a_hit_cache_feeds_the_whole_prompt_again() -> None:
    """Prompt lookup feeds the whole prompt on its first forward, whatever the cache holds: a cache holding a hit
    stores the prompt anew in that forward, its recurrent layers starting from no state (the hit is no longer
    counted as served), and gives transformers' tokens."""
    family = "lfm2"
    paged_model, _ = _models(family)
    pool = hf_paged.KVPool(paged_model.config, block_size=BLOCK_SIZE)
    ids, mask = _one(_tokens(19, 16))
    _run(pool, family, ids, mask)
    lookup = dict(prompt_lookup_num_tokens=3, return_dict_in_generate=False)
    with pool.new_cache(ids, mask, model=paged_model) as cache:
        assert cache.prefix_hit_tokens == 16
        out = paged_model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), **{**COMMON, **lookup})
        assert cache.prefix_hit_tokens == 0
        assert cache.get_seq_length() == out.shape[1] - 1
        pool.check()
    assert torch.equal(out, _reference(family, ids, mask, **lookup))
    pool.check()


def test_right_padded_prompts_refused_before_any_forward() -> None:
    """Prompts of different lengths that are not left-padded are refused as for any model, before anything runs."""
    paged_model, _ = _models("lfm2")
    pool = hf_paged.KVPool(paged_model.config, block_size=BLOCK_SIZE)
    ids, mask = left_padded([9, 5], seed=17)
    with pytest.raises(ValueError, match="left-padded"):
        pool.new_cache(ids, mask.flip(1), model=paged_model)
    assert pool.stats().blocks_in_use == 0 and pool.state_slots.num_in_use == 0
    pool.check()


@torch.no_grad()
def test_pool_for_model_prefills_without_model_argument() -> None:
    """`KVPool.for_model(model)`: `generate(cache=pool.new_cache(ids, mask))` twice with one prompt hits the second
    time, with no `model=` (and no weights salt)."""
    family = "falcon_h1"
    paged_model, _ = _models(family)
    pool = hf_paged.KVPool.for_model(paged_model, block_size=BLOCK_SIZE)
    ids, mask = _one(_tokens(19, 18))
    reference = _reference(family, ids, mask)
    for expected_hit in (0, 16):
        with pool.new_cache(ids, mask) as cache:
            assert cache.prefix_hit_tokens == expected_hit
            out = paged_model.generate(ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), **COMMON)
        _assert_same(out, reference)
        pool.check()
