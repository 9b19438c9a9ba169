"""`hf_paged.Engine` on hybrid models (recurrent layers beside attention): batched steps with one request per row,
each row's recurrent states in its state slot (`engine/rows_step.py`).

Every hybrid family of the support matrix (`tests/matrix.py` HYBRIDS) gives, per request, the greedy tokens of
single-request `generate()` with a `PagedCache` and with transformers' `DynamicCache`, over prompts of different
lengths, chunked prefills and several requests per step; the pool's invariants hold after every step (`make test`
runs the five families of `FAMILIES`, `make test-models` the others). Preemption under a small pool, streaming, the
incremental API, samples sharing a prompt's state, and the batching itself run on five families that differ in how
their recurrent layers use the cache: gated DeltaNet (qwen3_next), Mamba (jamba), Mamba2 beside attention in one
layer (falcon_h1), short convolutions (lfm2) and Mamba2 + attention (bamba).
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

import hf_paged
from hf_paged import UnsupportedModelError
from hf_paged.engine.scheduler import Scheduler

from helpers import tiered
from matrix import HYBRIDS, load, saved

pytestmark = [pytest.mark.xdist_group("engine"), pytest.mark.usefixtures("one_thread")]

FAMILIES = ["qwen3_next", "jamba", "falcon_h1", "lfm2", "bamba"]
LENGTHS = [5, 37, 3, 21, 12, 50]
NEW_TOKENS = [12, 5, 9, 7, 12, 4]


@functools.lru_cache(maxsize=None)
def _path(family: str):
    config = HYBRIDS[family][0]
    return saved(family, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items())))


@functools.lru_cache(maxsize=None)
def _model(family: str, attn_implementation: str = "paged"):
    return load(_path(family), attn_implementation)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]


def _configs(new_tokens: list[int]) -> list[GenerationConfig]:
    return [GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=2) for n in new_tokens]


@functools.lru_cache(maxsize=None)
def _reference(family: str, prompt: tuple[int, ...], max_new_tokens: int, dynamic: bool = False) -> list[int]:
    """Single-request greedy generate(): the paged model with a PagedCache, or sdpa with a DynamicCache."""
    model = _model(family, "sdpa" if dynamic else "paged")
    cache = DynamicCache(config=model.config) if dynamic else hf_paged.PagedCache()
    ids = torch.tensor([prompt])
    out = model.generate(ids, **hf_paged.cache_kwargs(cache), generation_config=_configs([max_new_tokens])[0])
    return out[0, len(prompt) :].tolist()


def _references(family: str, prompts: list[list[int]], new_tokens: list[int]) -> list[list[int]]:
    return [_reference(family, tuple(p), n) for p, n in zip(prompts, new_tokens, strict=True)]


def _checked(engine: hf_paged.Engine) -> None:
    """After every step: the pool's invariants, and no state slot beyond the requests in flight."""
    engine.pool.check()
    stats = engine.stats()
    assert stats.pool.state_slots_in_use <= stats.running


@pytest.mark.parametrize("family", tiered(HYBRIDS, FAMILIES, id=str))
def test_greedy_parity_per_request(family: str) -> None:
    """16 tokens per step, 4 requests in flight: chunked prefills of several rows, decode steps of several rows."""
    model = _model(family)
    prompts = _prompts(LENGTHS)
    expected = _references(family, prompts, NEW_TOKENS)
    engine = hf_paged.Engine(model, max_batch_tokens=16, max_seqs=4, on_step=_checked)
    outputs = engine.generate(prompts, _configs(NEW_TOKENS), progress=False)
    assert outputs == expected
    if family in FAMILIES:  # transformers' own cache agrees
        assert expected == [_reference(family, tuple(p), n, dynamic=True) for p, n in zip(prompts, NEW_TOKENS)]
    stats = engine.stats()
    assert stats.finished == len(prompts) and stats.waiting == stats.running == 0 and stats.preemptions == 0
    assert stats.generated_tokens == sum(map(len, outputs))
    assert stats.prompt_tokens_computed == sum(LENGTHS)  # every prompt token once
    assert stats.pool.blocks_in_use == 0 and stats.pool.state_slots_in_use == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_recomputes_states(family: str) -> None:
    """A pool of about two requests' blocks: preempted requests give back their blocks and state slot, and their
    states are recomputed from prompt + output when they run again; outputs are unchanged."""
    model = _model(family)
    prompts = _prompts(LENGTHS)
    expected = _references(family, prompts, NEW_TOKENS)
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=30)
    engine = hf_paged.Engine(model, pool, max_batch_tokens=32, max_seqs=6, on_step=_checked)
    outputs: list[list[int]] = [[] for _ in prompts]
    for index, token, _ in engine.stream(prompts, _configs(NEW_TOKENS)):
        outputs[index].append(token)
    assert outputs == expected
    stats = engine.stats()
    assert stats.preemptions > 0
    assert stats.prompt_tokens_computed > sum(LENGTHS)  # preempted requests' tokens computed again
    assert stats.pool.blocks_in_use == 0 and stats.pool.state_slots_in_use == 0


def test_a_forward_out_of_blocks_rolls_back_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step's blocks cannot be counted before the pool knows its layers: three prompts that do not fit
    together make the batched prefill run out of blocks inside its forward. It is rolled back, every row goes back
    to its request, the latest request is preempted and the step retried; outputs are unchanged."""
    model = _model("qwen3_next")
    prompts = _prompts([12, 12, 12], seed=8)
    failed_steps: list[list[int]] = []  # the prefilling requests' fed counts when a forward ran out of blocks
    on_out_of_blocks = Scheduler.on_out_of_blocks

    def counted(sched: Scheduler, error: hf_paged.OutOfBlocksError) -> None:
        failed_steps.append([r.fed for r in sched.prefilling])
        on_out_of_blocks(sched, error)

    monkeypatch.setattr(Scheduler, "on_out_of_blocks", counted)
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=8)
    engine = hf_paged.Engine(model, pool, max_batch_tokens=64, on_step=_checked)
    assert engine.generate(prompts, _configs([6, 6, 6]), progress=False) == _references("qwen3_next", prompts, [6] * 3)
    assert failed_steps == [[0, 0, 0]]
    assert engine.stats().preemptions > 0 and pool.stats().state_slots_in_use == 0


def test_steps_are_batched_rows_without_padding() -> None:
    """Every step is one forward `[num_rows, seq_len]` of equal rows (no padding): decode steps of several rows
    `[k, 1]`, prefill steps of several rows `[k, chunk_len]`; each token is fed once."""
    model = _model("qwen3_next")
    shapes: list[tuple[int, ...]] = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                 with_kwargs=True)
    try:
        engine = hf_paged.Engine(model, max_batch_tokens=16, max_seqs=4)
        outputs = engine.generate(_prompts(LENGTHS), _configs(NEW_TOKENS), progress=False)
    finally:
        hook.remove()
    assert len(shapes) == engine.stats().steps
    assert any(rows > 1 and seq == 1 for rows, seq in shapes)  # batched decode
    assert any(rows > 1 and seq > 1 for rows, seq in shapes)  # batched prefill chunks
    assert all(rows * seq <= 16 for rows, seq in shapes)
    assert sum(rows * seq for rows, seq in shapes) == sum(LENGTHS) + sum(len(o) - 1 for o in outputs)


def test_states_stay_with_their_request() -> None:
    """Requests in the same steps keep their own states: each gives its tokens alone, and they differ (a state read
    from another row, or carried over from a request before it in a slot, would change them)."""
    model = _model("falcon_h1")
    prompts = _prompts([9, 9, 9], seed=4)  # one length: the prefill runs as one step of three rows
    configs = _configs([8, 8, 8])
    engine = hf_paged.Engine(model, max_batch_tokens=64, on_step=_checked)
    together = engine.generate(prompts, configs, progress=False)
    alone = [engine.generate([p], [c], progress=False)[0] for p, c in zip(prompts, configs)]
    assert together == alone == _references("falcon_h1", prompts, [8, 8, 8])
    assert len({tuple(o) for o in together}) == 3
    later = engine.generate(prompts[::-1], configs, progress=False)  # slots reused in another order
    assert later == together[::-1]


def test_jamba_prefills_each_prompt_in_one_forward() -> None:
    """transformers' Jamba Mamba restarts a multi-token input from a zero state, so a chunked prefill would be wrong:
    each prompt runs in one forward (past `max_batch_tokens` if it is longer), beside prompts of its length."""
    model = _model("jamba")
    prompts = _prompts([21, 21, 9], seed=5)
    expected = _references("jamba", prompts, [5, 5, 5])
    for max_batch_tokens, prefills in ((8, {(1, 21), (1, 9)}), (64, {(2, 21), (1, 9)})):
        shapes: list[tuple[int, ...]] = []
        hook = model.model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                     with_kwargs=True)
        try:
            engine = hf_paged.Engine(model, max_batch_tokens=max_batch_tokens)
            assert engine.generate(prompts, _configs([5, 5, 5]), progress=False) == expected
        finally:
            hook.remove()
        assert {shape for shape in shapes if shape[1] > 1} == prefills


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2"])
def test_samples_share_the_prompt_state(family: str) -> None:
    """`num_return_sequences` samples share the prompt's blocks and state slot, each copied on its first write:
    with `top_k=1` every sample is the greedy output."""
    model = _model(family)
    prompts = _prompts([7, 13], seed=6)
    engine = hf_paged.Engine(model, max_batch_tokens=16, on_step=_checked)
    outputs = engine.generate(prompts, do_sample=True, top_k=1, num_return_sequences=3, max_new_tokens=6,
                              eos_token_id=2, progress=False)
    expected = _references(family, prompts, [6, 6])
    assert outputs == [expected[0]] * 3 + [expected[1]] * 3
    assert engine.pool.stats().state_slots_in_use == 0


def test_incremental_api_and_abort() -> None:
    model = _model("lfm2")
    prompts = _prompts([6, 17, 11], seed=7)
    engine = hf_paged.Engine(model, max_batch_tokens=16, on_step=_checked)
    ids = [engine.submit(p, max_new_tokens=6, do_sample=False, eos_token_id=2) for p in prompts]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    steps = 0
    while engine.has_work():
        for event in engine.step():
            tokens[event.request_id].append(event.token)
        steps += 1
        if steps == 3:
            assert engine.abort(ids[1])
    assert tokens[ids[0]] == _reference("lfm2", tuple(prompts[0]), 6)
    assert tokens[ids[2]] == _reference("lfm2", tuple(prompts[2]), 6)
    assert engine.pool.stats().state_slots_in_use == 0 and engine.pool.stats().blocks_in_use == 0


def test_speculation_is_refused() -> None:
    """Drafts that the model rejects would have to be cropped: recurrent states cannot step back."""
    model = _model("qwen3_next")
    with pytest.raises(UnsupportedModelError, match="cropped.*draft_model"):
        hf_paged.Engine(model, draft_model=model)
    with pytest.raises(UnsupportedModelError, match="cropped.*prompt_lookup_num_tokens"):
        hf_paged.Engine(model).generate(_prompts([5]), max_new_tokens=4, prompt_lookup_num_tokens=2, progress=False)


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2"])
def test_prefix_hits_restore_states_in_the_engine(family: str) -> None:
    """A mix run again on one engine takes prefix hits (the recurrent states restored from the snapshots its first
    run left at block ends) and gives the same greedy tokens; jamba's prompts never hit (see test_hybrid_prefix)."""
    model = _model(family)
    base = _prompts([40, 40, 33], seed=3)
    prompts = base + [p + [7, 8, 9] for p in base]
    new_tokens = [6] * len(prompts)
    expected = _references(family, prompts, new_tokens)
    engine = hf_paged.Engine(model, hf_paged.KVPool(model.config, block_size=4), max_batch_tokens=16, max_seqs=4,
                             on_step=lambda e: e.pool.check())
    for run in range(2):
        outputs = engine.generate(prompts, generation_config=_configs(new_tokens)[0], progress=False)
        assert [list(o) for o in outputs] == expected, run
    stats = engine.stats()
    assert stats.prefix_hit_tokens > 0 and stats.pool.state_snapshots > 0
    engine.pool.check()
