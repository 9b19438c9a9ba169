"""hf_paged under a changed default device: the tokens of the same runs with the default device left alone.

A user who calls `torch.set_default_device("cuda")` (common in GPU notebooks) and then generates with a
`PagedCache` or an `Engine` runs hf_paged's host-side bookkeeping (block tables, lengths, masks, positions, the
prompt ids its logits processors read) under that default: every tensor hf_paged makes for it must name its device,
or it lands on the GPU, gets mixed with CPU tensors, or is read back with `.item()` / `.tolist()` (a sync at best).

These tests stand in `meta` for the user's `cuda`, so that they run on a CPU-only machine: a tensor made on `meta`
holds no data, so one that hf_paged makes without naming a device fails loudly at its first read, copy to the host
or mix with a CPU tensor, where on `cuda` it might only cost a silent copy and a sync. The model and its inputs stay
where they are (the CPU here); only the default device changes, around the hf_paged calls (`_meta_default`).

Beam search is the exception: transformers' own `_beam_search` builds a tensor on the default device and copies it to
the inputs' device (`top_num_beam_mask`), which works under `cuda` but not under `meta`, with `DynamicCache` and sdpa
too. The beam test therefore makes `meta` the default inside the model's forwards and the cache's methods that
`generate()` calls between them (`reorder_cache`, ...), where all of hf_paged's work in a beam search runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

import hf_paged
from hf_paged.memory import rotation
from tests.helpers import load, saved_model

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK_SIZE = 4


@contextmanager
def _meta_default() -> Iterator[None]:
    """`meta` as the default device within, the previous default restored after (also on an error)."""
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None if previous.type == "cpu" else previous)


def _on_meta(fn: Callable) -> Callable:
    """`fn` run with `meta` as the default device."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _meta_default():
            return fn(*args, **kwargs)

    return wrapped


@pytest.fixture(scope="module")
def llama():
    return load(saved_model("llama"), "paged")


@pytest.fixture(scope="module")
def mistral():
    """Every layer sliding, with a window shorter than prompt + output."""
    return load(saved_model("mistral", sliding_window=4), "paged")


def _left_padded(model, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (pad 0), made on the CPU and moved to the model's device."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long, device="cpu")
    mask = torch.zeros((len(lengths), width), dtype=torch.long, device="cpu")
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, 128, (n,), generator=gen, device="cpu")
        mask[row, width - n :] = 1
    return ids.to(model.device), mask.to(model.device)


def _generate(model, cache, ids, mask, **kwargs) -> list[list[int]]:
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
        **hf_paged.cache_kwargs(cache), **kwargs,
    )
    return out.tolist()


def _both(run: Callable[[], object]) -> tuple[object, object]:
    """`run()` with the default device untouched, then with `meta` as the default."""
    want = run()
    with _meta_default():
        got = run()
    return want, got


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8_e4m3"])
def test_generate_left_padded(llama, kv_dtype, monkeypatch):
    """Greedy over left-padded rows of several blocks, on a pool in the model's dtype and on quantized ones (a
    float8 pool also rotates what it stores: its rotation matrix is built on the host)."""
    ids, mask = _left_padded(llama, [9, 6, 2])

    def run():
        return _generate(llama, hf_paged.PagedCache(kv_dtype=kv_dtype, block_size=BLOCK_SIZE), ids, mask)

    want = run()
    monkeypatch.setattr(rotation, "_MATRICES", {})  # (the rotation matrices are kept per process: built again)
    with _meta_default():
        got = run()
    assert got == want


def test_generate_sliding_window_and_chunked_prefill(mistral):
    """A window shorter than the rows (blocks out of it freed), prefilled in chunks of 4 columns."""
    ids, mask = _left_padded(mistral, [13, 9])
    want, got = _both(lambda: _generate(mistral, hf_paged.PagedCache(block_size=BLOCK_SIZE), ids, mask,
                                        prefill_chunk_size=4))
    assert got == want


def test_generate_output_attentions(llama):
    """`output_attentions=True`: the probabilities read back from the pool (`readback.py`)."""
    ids, mask = _left_padded(llama, [7, 4])

    def run():
        out = llama.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
            output_attentions=True, return_dict_in_generate=True,
            **hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=BLOCK_SIZE)),
        )
        return out.sequences.tolist(), [a.cpu() for step in out.attentions for a in step]

    (want_ids, want_probs), (got_ids, got_probs) = _both(run)
    assert got_ids == want_ids
    assert all(torch.equal(g, w) for g, w in zip(got_probs, want_probs, strict=True))


class _MetaPagedCache(hf_paged.PagedCache):
    """A `PagedCache` whose methods that `generate()` calls run with `meta` as the default device."""


for _name in ("update", "get_seq_length", "get_mask_sizes", "reorder_cache", "batch_repeat_interleave",
              "batch_select_indices", "crop"):
    setattr(_MetaPagedCache, _name, _on_meta(getattr(hf_paged.PagedCache, _name)))


def test_beam_search(llama, monkeypatch):
    """Beams (the rows' blocks shared and reordered between steps) with `meta` as the default in every forward and
    cache call (see the module docstring for why not around `generate()` as a whole)."""
    ids, mask = _left_padded(llama, [9, 5])
    want = _generate(llama, hf_paged.PagedCache(block_size=BLOCK_SIZE), ids, mask, num_beams=2)
    reorders = []
    reorder = _MetaPagedCache.reorder_cache
    monkeypatch.setattr(_MetaPagedCache, "reorder_cache", lambda self, idx: reorders.append(1) or reorder(self, idx))
    llama.forward = _on_meta(llama.forward)  # (an instance attribute over the class's method, deleted after)
    try:
        got = _generate(llama, _MetaPagedCache(block_size=BLOCK_SIZE), ids, mask, num_beams=2)
    finally:
        del llama.forward
    assert got == want
    assert reorders  # (the beams were reordered under meta)


def test_kvpool_prefix_hit(llama):
    """A second cache of a `KVPool` holding the first call's prompt blocks: its prefix hit and the rest."""
    ids, mask = _left_padded(llama, [14, 10], seed=1)

    def run():
        pool = hf_paged.KVPool(llama.config, num_blocks=64, block_size=BLOCK_SIZE)
        out = []
        for _ in range(2):
            with pool.new_cache(ids, mask) as cache:
                hit = cache.get_seq_length()
                out.append((hit, _generate(llama, cache, ids, mask)))
        return out

    want, got = _both(run)
    assert got == want
    assert got[1][0] > 0  # (the second call hit)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=gen, device="cpu").tolist() for n in lengths]


def _engine_run(model, prompts: list[list[int]], **engine_kwargs) -> Callable[[], tuple[list, int]]:
    def run():
        pool = hf_paged.KVPool(model.config, num_blocks=96, block_size=BLOCK_SIZE)
        engine = hf_paged.Engine(model, pool, max_batch_tokens=16, max_seqs=3, **engine_kwargs)
        out = engine.generate(prompts, max_new_tokens=6, do_sample=False, eos_token_id=None, progress=False)
        again = engine.generate(prompts[:1], max_new_tokens=6, do_sample=False, eos_token_id=None, progress=False)
        return out + again, engine.stats().prefix_hit_tokens

    return run


def test_engine(llama):
    """Packed steps with chunked prefill (16 tokens a step), and a second call whose prompt hits the first's blocks."""
    want, got = _both(_engine_run(llama, _prompts([5, 21, 3, 12], seed=2)))
    assert got == want
    assert got[1] > 0


def test_engine_prefix_hits_and_sliding_window(llama, mistral):
    """Requests sharing a 12-token prefix (hits within one call), on a full-attention and a sliding-window model."""
    shared = _prompts([12], seed=3)[0]
    prompts = [shared + tail for tail in _prompts([2, 1, 3], seed=4)]
    for model in (llama, mistral):
        want, got = _both(_engine_run(model, prompts))
        assert got == want
        assert got[1] > 0


@pytest.mark.slow
def test_compiled_engine(llama):
    """The decode step compiled whole (`compile=True`), compiled and run with `meta` as the default."""
    prompts = _prompts([5, 17, 3, 11], seed=5)
    want, _ = _engine_run(llama, prompts)()
    steps = []

    def run():
        pool = hf_paged.KVPool(llama.config, num_blocks=96, block_size=BLOCK_SIZE)
        engine = hf_paged.Engine(llama, pool, max_batch_tokens=16, max_seqs=3, compile=True)
        out = engine.generate(prompts, max_new_tokens=6, do_sample=False, eos_token_id=None, progress=False)
        compiled = engine.graphs._compiled
        engine.graphs._compiled = lambda *a: steps.append(a[0].shape[0]) or compiled(*a)
        out += engine.generate(prompts[:1], max_new_tokens=6, do_sample=False, eos_token_id=None, progress=False)
        return out

    with _meta_default():
        got = run()
    assert got == want
    assert steps  # (decode steps ran in the compiled graph)
