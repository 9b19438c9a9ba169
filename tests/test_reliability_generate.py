"""Exhaustion, interruption, dropped caches and threads under stock `generate()` with a tiny Llama."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import hf_paged
from helpers import left_padded, load, paged_llama_one_thread, saved_model


model = pytest.fixture(scope="module")(paged_llama_one_thread)


def greedy(model, ids, mask, cache, max_new_tokens=6, **kwargs):
    return model.generate(
        input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=0, **kwargs,
    )


def allocator_state(pool: hf_paged.KVPool) -> list:
    return [([b.ref_count for b in a.blocks], sorted(a.free_ids), sorted(a.evictable)) for a in pool.allocators]


def assert_whole(pool: hf_paged.KVPool) -> None:
    pool.check()
    for allocator in pool.allocators or []:
        assert all(b.ref_count == 0 for b in allocator.blocks), "a block leaked"
        assert len(allocator.free_ids) + len(allocator.evictable) == allocator.capacity
    assert pool.stats().blocks_in_use == 0


class Snapshots(LogitsProcessor):
    """Records the pool after every forward (logits processors run between forwards)."""

    def __init__(self, pool):
        self.pool, self.states = pool, []

    def __call__(self, input_ids, scores):
        self.pool.check()
        self.states.append(allocator_state(self.pool))
        return scores


def test_exhaustion_mid_generate_raises_and_leaves_the_pool_as_before_the_step(model):
    ids, mask = left_padded([7, 4], seed=1)
    reference = greedy(model, ids, mask, hf_paged.PagedCache(), max_new_tokens=12)
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=6, prefix_caching=False)
    hog = pool.new_cache()
    greedy(model, ids[:1], mask[:1], hog, max_new_tokens=1)  # holds 2 blocks
    before_call = allocator_state(pool)
    snapshots = Snapshots(pool)
    cache = pool.new_cache()
    with pytest.raises(hf_paged.OutOfBlocksError, match="out of blocks") as info:
        greedy(model, ids, mask, cache, max_new_tokens=12, logits_processor=LogitsProcessorList([snapshots]))
    assert info.value.blocks_needed > info.value.blocks_free
    assert len(snapshots.states) >= 2, "the pool should run out in the middle of generate(), not at once"
    pool.check()
    assert allocator_state(pool) == snapshots.states[-1], "the failing step changed the pool"
    cache.release()  # the steps that did complete are returned with the cache
    assert allocator_state(pool) == before_call
    # The next call works once there is room, and computes what an unbounded cache computes.
    hog.release()
    with pool.new_cache() as cache:
        out = greedy(model, ids, mask, cache, max_new_tokens=4)
    assert torch.equal(out, reference[:, : out.shape[1]])
    assert_whole(pool)


class Boom(Exception):
    pass


class RaiseAt(StoppingCriteria):
    def __init__(self, step, exc):
        self.step, self.exc, self.calls = step, exc, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.step:
            raise self.exc
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class RaisingStreamer:
    def __init__(self, step, exc):
        self.step, self.exc, self.calls = step, exc, 0

    def put(self, value):
        self.calls += 1
        if self.calls == self.step:
            raise self.exc

    def end(self):
        pass


def test_exception_at_a_random_step_of_generate_leaks_nothing_50_times(model):
    """50 generate() calls, each interrupted at a random forward step: by a stopping criterion, a streamer or
    a layer (mid-forward, after some layers wrote), with an Exception or KeyboardInterrupt."""
    rng = random.Random(0)
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=64)
    expected = {}
    for call in range(50):
        lengths = [rng.randint(1, 9) for _ in range(rng.randint(1, 3))]
        ids, mask = left_padded(lengths, seed=call % 7)
        step = rng.randint(1, 6)
        exc = rng.choice([Boom("injected"), KeyboardInterrupt()])
        where = rng.choice(["stopping", "streamer", "layer"])
        kwargs, hook = {}, None
        if where == "stopping":
            kwargs["stopping_criteria"] = StoppingCriteriaList([RaiseAt(step, exc)])
        elif where == "streamer":
            kwargs["streamer"] = RaisingStreamer(step + 1, exc)  # put() also receives the prompt first
        else:
            layer = model.model.layers[rng.randrange(len(model.model.layers))]
            counter = {"n": 0}

            def raise_in_layer(module, args, _counter=counter, _step=step, _exc=exc):
                _counter["n"] += 1
                if _counter["n"] == _step:
                    raise _exc

            hook = layer.register_forward_pre_hook(raise_in_layer) if rng.random() < 0.5 else (
                layer.self_attn.register_forward_hook(lambda m, a, o, f=raise_in_layer: f(m, a))
            )
        cache = pool.new_cache(ids, mask, salt=rng.choice([None, "t"]))
        try:
            with cache, pytest.raises(type(exc)):
                greedy(model, ids, mask, cache, max_new_tokens=6, **kwargs)
        finally:
            if hook is not None:
                hook.remove()
        assert_whole(pool)
        # The pool still serves correct results afterwards.
        if call % 10 == 9:
            key = tuple(lengths), call % 7
            with pool.new_cache(ids, mask) as cache:
                out = greedy(model, ids, mask, cache, max_new_tokens=3)
            with hf_paged.PagedCache() as fresh:
                expected[key] = greedy(model, ids, mask, fresh, max_new_tokens=3)
            assert torch.equal(out, expected[key])
            assert_whole(pool)


def test_interrupted_forward_is_rolled_back_and_the_cache_continues(model):
    """A layer raises mid-forward (after layer 0 wrote): the cache reports the length before that forward,
    and continuing generate() from it gives the uninterrupted result."""
    ids, mask = left_padded([6, 3], seed=3)
    full = greedy(model, ids, mask, hf_paged.PagedCache(), max_new_tokens=6)
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=32)
    cache = pool.new_cache()
    first = greedy(model, ids, mask, cache, max_new_tokens=3)
    seq_len = cache.get_seq_length()
    calls = {"n": 0}

    def raise_once(module, args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise Boom("mid-forward")

    hook = model.model.layers[1].register_forward_pre_hook(raise_once)
    next_mask = torch.cat([mask, torch.ones_like(first[:, ids.shape[1] :])], 1)
    try:
        with pytest.raises(Boom):
            greedy(model, first, next_mask, cache, max_new_tokens=3)
    finally:
        hook.remove()
    pool.check()
    assert cache.get_seq_length() == seq_len
    out = greedy(model, first, next_mask, cache, max_new_tokens=3)
    assert torch.equal(out, full)
    cache.release()
    assert_whole(pool)


def test_an_interrupted_decode_step_into_a_partial_block_is_rolled_back(model):
    """A batch-1 decode step whose token goes into its partial last block changes no table, only lengths and
    filled counts: when a layer raises in it, the lengths and the block's filled count come back, and generation
    continues as if nothing happened."""
    ids = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    full = greedy(model, ids, mask, hf_paged.PagedCache(), max_new_tokens=6)
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=16)
    cache = pool.new_cache()
    first = greedy(model, ids, mask, cache, max_new_tokens=3)
    assert cache.get_seq_length() == 9
    filled = [b.filled for b in pool.allocators[0].blocks]

    def boom(module, args):
        raise Boom("mid-forward")

    hook = model.model.layers[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(Boom):  # token 10 goes into the third block's second slot
            greedy(model, first, torch.ones_like(first), cache, max_new_tokens=1)
    finally:
        hook.remove()
    cache.finish_forward()  # (an incomplete forward rolls back when it ends: here, or at the next forward)
    pool.check()
    assert cache.get_seq_length() == 9 and [b.filled for b in pool.allocators[0].blocks] == filled
    out = greedy(model, first, torch.ones_like(first), cache, max_new_tokens=3)
    assert torch.equal(out, full)
    cache.release()
    assert_whole(pool)


def test_dropped_cache_returns_its_blocks(model):
    ids, mask = left_padded([5, 8], seed=4)
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=32)
    cache = pool.new_cache(ids, mask)
    greedy(model, ids, mask, cache)
    assert pool.stats().blocks_in_use > 0
    del cache  # no release(), no gc.collect(): the finalizer runs when the last reference goes
    assert_whole(pool)
    # Also when dropped in the middle of a forward (a layer raised).
    cache = pool.new_cache()

    def boom(module, args):
        raise Boom

    hook = model.model.layers[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(Boom):
            greedy(model, ids, mask, cache)
    finally:
        hook.remove()
    assert pool.stats().blocks_in_use > 0
    del cache
    assert_whole(pool)


def test_threads_share_one_pool(model):
    """4 threads run generate() concurrently with caches of one pool (shared prompt prefixes, prefix hits,
    beams): every output equals the serial run's and the pool is consistent and whole afterwards."""
    jobs = []
    for i in range(8):
        ids, mask = left_padded([9, 5 + i % 3], seed=i % 3)  # seeds repeat: prefix hits across threads
        jobs.append((ids, mask, {"num_beams": 2} if i % 4 == 3 else {}))

    def run(pool, job):
        ids, mask, kwargs = job
        with pool.new_cache(ids, mask) as cache:
            return greedy(model, ids, mask, cache, max_new_tokens=5, **kwargs)

    serial_pool = hf_paged.KVPool(model.config, block_size=4)
    serial = [run(serial_pool, job) for job in jobs]
    for pool in (hf_paged.KVPool(model.config, block_size=4), hf_paged.KVPool(model.config, block_size=4, num_blocks=256)):
        results: dict[int, torch.Tensor] = {}
        errors: list[BaseException] = []
        barrier = threading.Barrier(4)

        def worker(k, pool=pool, results=results, errors=errors, barrier=barrier):
            try:
                barrier.wait()
                for j in range(k, len(jobs), 4):
                    results[j] = run(pool, jobs[j])
                    pool.check()
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for j, out in enumerate(serial):
            assert torch.equal(results[j], out), f"job {j} differs from the serial run"
        assert_whole(pool)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_pool_first_filled_under_inference_mode_serves_later_calls(model, kv_dtype):
    """Blocks and scales made by a forward under `torch.inference_mode()` are normal tensors: a later generate()
    (under `no_grad`) and an Engine step write into the same pool, as they would into a `DynamicCache`, and the
    later call's prefix hit gives the first call's tokens."""
    ids, mask = left_padded([20], seed=11)
    pool = hf_paged.KVPool(model.config, block_size=8, kv_dtype=kv_dtype)
    with torch.inference_mode():
        first = greedy(model, ids, mask, pool.new_cache(ids, mask))
    assert torch.equal(greedy(model, ids, mask, pool.new_cache(ids, mask)), first)
    assert pool.stats().prefix_hit_rate > 0
    hf_paged.Engine(model, pool).generate([ids[0].tolist()], max_new_tokens=4, progress=False)
    assert_whole(pool)
