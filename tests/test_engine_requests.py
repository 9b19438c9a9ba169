"""The Engine's incremental API and per-request features (issue 27 items 4-5): `submit` / `step` / `abort`,
`num_return_sequences` samples sharing the prompt's blocks, per-token log-probabilities equal to what
`generate(output_scores=True, output_logits=True)` gives, and extra per-request logits processors."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

import hf_paged
from hf_paged.demo_model import load_demo_model
from hf_paged.engine.samples import SAMPLE_SEED_STRIDE

pytestmark = pytest.mark.xdist_group("engine_requests")

PROMPT = "import os\n\n\ndef walk(top):\n"


@pytest.fixture(scope="module")
def demo():
    torch.set_num_threads(1)
    return load_demo_model(attn_implementation="paged")


def _paged() -> dict:
    return hf_paged.cache_kwargs(hf_paged.PagedCache())


def _run(engine: hf_paged.Engine) -> tuple[list, int]:
    """Steps until idle; returns the events and the most pool blocks in use after any step."""
    events, peak = [], 0
    while engine.has_work():
        events.extend(engine.step())
        peak = max(peak, engine.pool.stats().blocks_in_use)
        engine.pool.check()
    return events, peak


def _outputs(events, request_id: int, n: int) -> list[list[int]]:
    out = [[] for _ in range(n)]
    for e in events:
        if e.request_id == request_id:
            out[e.sample].append(e.token)
    return out


def test_n_samples_store_the_prompt_once(demo):
    """8 samples of a 1k-token prompt hold the prompt's 64 blocks once (shared by all 8 rows); 8 separate
    requests hold them 8 times. Counted from pool stats, not timed."""
    model, tok = demo
    ids = (tok.encode(PROMPT * 60) * 4)[:1024]
    gen = dict(max_new_tokens=4, do_sample=True, temperature=1.0)
    shared = hf_paged.Engine(model, hf_paged.KVPool(model.config, prefix_caching=False), max_batch_tokens=1024)
    shared.submit(ids, seed=1, num_return_sequences=8, **gen)
    shared.step()  # the prompt's one prefill, then every sample joins the decoding rows
    stats = shared.pool.stats()
    assert stats.blocks_in_use == 64 and stats.blocks_shared == 64
    events, peak_shared = _run(shared)
    assert len(events) == 8 * 4 - 8
    separate = hf_paged.Engine(model, hf_paged.KVPool(model.config, prefix_caching=False), max_batch_tokens=8192)
    for seed in range(8):
        separate.submit(ids, seed=seed, **gen)
    _, peak_separate = _run(separate)
    assert peak_shared <= 0.25 * peak_separate, (peak_shared, peak_separate)
    assert shared.pool.stats().blocks_in_use == separate.pool.stats().blocks_in_use == 0


def test_n_samples_are_seeded_independently_and_reproducibly(demo):
    model, tok = demo
    ids = tok.encode(PROMPT)
    engine = hf_paged.Engine(model)
    first = engine.submit(ids, seed=5, num_return_sequences=4, max_new_tokens=12, do_sample=True)
    again = engine.submit(ids, seed=5, num_return_sequences=4, max_new_tokens=12, do_sample=True)
    alone = engine.submit(ids, seed=5, max_new_tokens=12, do_sample=True)
    events, _ = _run(engine)
    samples = _outputs(events, first, 4)
    assert samples == _outputs(events, again, 4)  # same seed, same samples
    assert len({tuple(s) for s in samples}) == 4  # each sample its own stream
    assert samples[0] == _outputs(events, alone, 1)[0]  # sample 0 is the request's own seed
    assert engine.pool.stats().blocks_in_use == 0
    assert SAMPLE_SEED_STRIDE % 2 == 1


def test_generate_returns_n_rows_per_prompt(demo):
    model, tok = demo
    prompts = [tok.encode(PROMPT), tok.encode("class Stack:\n")]
    engine = hf_paged.Engine(model)
    outs = engine.generate(prompts, num_return_sequences=3, do_sample=True, max_new_tokens=5, seed=0, progress=False)
    assert len(outs) == 6 and all(len(o) == 5 for o in outs)
    single = engine.generate(prompts, do_sample=True, max_new_tokens=5, seed=0, progress=False)
    assert outs[0] == single[0] and outs[3] == single[1]  # sample 0 of each prompt keeps the prompt's seed


@pytest.mark.parametrize("gen", [
    dict(do_sample=False, repetition_penalty=1.3),
    dict(do_sample=True, temperature=0.7, top_k=20),
])
def test_logprobs_equal_generate_scores_and_logits(demo, gen):
    model, tok = demo
    ids = tok.encode(PROMPT)
    engine = hf_paged.Engine(model)
    rid = engine.submit(ids, seed=3, top_logprobs=5, max_new_tokens=8, **gen)
    events, _ = _run(engine)
    mine = [e for e in events if e.request_id == rid]
    if gen["do_sample"]:  # generate() samples with the global generator: replay the engine's tokens instead
        forced = [e.token for e in mine]
        out = _generate_forced(model, ids, forced, **gen)
    else:
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, output_scores=True, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, **_paged(), **gen)
        assert out.sequences[0, len(ids):].tolist() == [e.token for e in mine]
    for event, scores, logits in zip(mine, out.scores, out.logits, strict=True):
        lp, raw = torch.log_softmax(scores[0].float(), -1), torch.log_softmax(logits[0].float(), -1)
        got = event.logprobs
        assert got.token == event.token
        torch.testing.assert_close(got.logprob, float(lp[event.token]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.raw_logprob, float(raw[event.token]), atol=1e-4, rtol=1e-4)
        assert [t for t, _ in got.raw_top] == torch.topk(raw, 5).indices.tolist()
        torch.testing.assert_close([v for _, v in got.top], torch.topk(lp, 5).values.tolist(), atol=1e-4, rtol=1e-4)
    assert any(abs(e.logprobs.logprob - e.logprobs.raw_logprob) > 1e-3 for e in mine)  # processed != raw here


def test_generate_returns_logprobs_on_request(demo):
    """`Engine.generate(..., top_logprobs=k)`: each output's tokens with the log-probabilities the incremental API
    gives the same requests (checked against generate()'s scores above), samples included, text prompts too."""
    model, tok = demo
    prompts = [tok.encode(PROMPT), tok.encode("class Config:\n")]
    gen = dict(max_new_tokens=6, do_sample=True, temperature=0.8, num_return_sequences=2)
    outputs = hf_paged.Engine(model).generate(prompts, seed=[11, 12], top_logprobs=3, progress=False, **gen)
    live = hf_paged.Engine(model)
    ids = [live.submit(p, seed=s, top_logprobs=3, **gen) for p, s in zip(prompts, (11, 12))]
    events, _ = _run(live)
    assert len(outputs) == 4
    for n, out in enumerate(outputs):
        mine = [e for e in events if e.request_id == ids[n // 2] and e.sample == n % 2]
        assert out.token_ids == [e.token for e in mine] and out.text is None
        assert [lp.token for lp in out.logprobs] == out.token_ids
        assert out.logprobs == [e.logprobs for e in mine]
        assert all(len(lp.top) == len(lp.raw_top) == 3 for lp in out.logprobs)
    texts = hf_paged.Engine(model, tokenizer=tok).generate([PROMPT], top_logprobs=0, max_new_tokens=4, progress=False)
    assert texts[0].text == tok.decode(texts[0].token_ids, skip_special_tokens=True)
    assert all(lp.top == [] for lp in texts[0].logprobs)
    with pytest.raises(ValueError, match="top_logprobs"):
        hf_paged.Engine(model).generate(prompts, top_logprobs=-1)


def _generate_forced(model, ids, forced, **gen):
    """generate()'s scores and logits along `forced`: feed prompt + forced tokens one step at a time."""
    scores, logits = [], []
    for step in range(len(forced)):
        prefix = torch.tensor([ids + forced[:step]])
        out = model.generate(prefix, max_new_tokens=1, output_scores=True, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, **_paged(), **gen)
        scores.append(out.scores[0])
        logits.append(out.logits[0])
    return type("Out", (), {"scores": scores, "logits": logits})


class _Ban(LogitsProcessor):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.token] = float("-inf")
        return scores


def test_extra_logits_processor_changes_tokens_like_generate(demo):
    model, tok = demo
    ids = tok.encode(PROMPT)
    engine = hf_paged.Engine(model)
    plain = engine.generate([ids], max_new_tokens=6, do_sample=False, progress=False)[0]
    ban = _Ban(plain[0])
    rid = engine.submit(ids, max_new_tokens=6, do_sample=False, logits_processor=[ban])
    events, _ = _run(engine)
    banned = _outputs(events, rid, 1)[0]
    ref = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=0, **_paged(),
                         logits_processor=LogitsProcessorList([_Ban(plain[0])]))[0, len(ids):].tolist()
    assert banned[0] != plain[0] and banned == ref


def test_abort_frees_blocks_at_once_and_spares_the_others(demo):
    model, tok = demo
    ids, other = tok.encode(PROMPT * 4), tok.encode("class Stack:\n    def __init__(self):\n")
    engine = hf_paged.Engine(model, hf_paged.KVPool(model.config, prefix_caching=False))
    victim = engine.submit(ids, max_new_tokens=30, do_sample=False)
    keeper = engine.submit(other, max_new_tokens=10, do_sample=False)
    for _ in range(3):
        engine.step()
    before = engine.pool.stats().blocks_in_use
    assert engine.abort(victim) and not engine.abort(victim)
    after = engine.pool.stats().blocks_in_use
    assert after < before
    engine.pool.check()
    events, _ = _run(engine)
    mine = [e.token for e in events if e.request_id == keeper]
    assert all(e.request_id == keeper for e in events)
    ref = engine.generate([other], max_new_tokens=10, do_sample=False, progress=False)[0]
    assert len(mine) + 3 == 10 and ref[3:] == mine
    assert engine.pool.stats().blocks_in_use == 0


def test_submit_refuses_bad_requests_before_queueing(demo):
    model, tok = demo
    engine = hf_paged.Engine(model)
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], max_new_tokens=4)
    with pytest.raises(ValueError, match="top_logprobs"):
        engine.submit(tok.encode(PROMPT), top_logprobs=-1)
    assert not engine.has_work() and engine.step() == []


def test_finish_reason(demo):
    model, tok = demo
    engine = hf_paged.Engine(model)
    rid = engine.submit(tok.encode(PROMPT), max_new_tokens=3, do_sample=False)
    events, _ = _run(engine)
    assert [e.finish_reason for e in events if e.request_id == rid] == [None, None, "length"]
    eos = engine.submit(tok.encode(PROMPT), max_new_tokens=50, do_sample=False, logits_processor=[_OnlyEos()])
    events, _ = _run(engine)
    assert [(e.token, e.finish_reason) for e in events if e.request_id == eos] == [(0, "stop")]


class _OnlyEos(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores = torch.full_like(scores, float("-inf"))
        scores[:, 0] = 0.0
        return scores


def test_a_submitted_request_that_runs_out_of_blocks_alone_is_reported(demo):
    """A submitted request that cannot get blocks while other holders of a fixed pool keep them fails alone:
    `take_failures()` gives its id and error (saying who holds the blocks), `step()` reports nothing more of it,
    and its blocks are back in the pool."""
    model, tokenizer = demo
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=12)
    hog = pool.new_cache()
    with torch.no_grad():  # another cache on the pool holds 7 of its 12 blocks
        model(input_ids=torch.tensor([tokenizer.encode(PROMPT * 4)[:28]]), **hf_paged.cache_kwargs(hog))
    assert pool.stats().blocks_in_use == 7
    engine = hf_paged.Engine(model, pool)
    ids = tokenizer.encode(PROMPT)
    rid = engine.submit(ids, max_new_tokens=30, min_new_tokens=30, do_sample=False)  # 11 blocks: fits the pool
    events, _ = _run(engine)
    failures = engine.take_failures()
    assert [r for r, _ in failures] == [rid] and engine.take_failures() == []
    assert "other caches, engines or threads on this KVPool hold" in "".join(failures[0][1].__notes__)
    assert not any(e.finished for e in events) and not engine.has_work()
    assert pool.stats().blocks_in_use == 7
    pool.check()
    hog.release()


class _Raises(LogitsProcessor):
    """A processor that raises at the request's `at`-th token."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("this processor fails")
        return scores


def test_a_request_whose_token_cannot_be_chosen_fails_alone(demo):
    """A request whose processors or sampling raise (a temperature so small that its probabilities are not
    finite: `generate()` raises torch's error; a processor of its own that raises) fails alone: `generate()`
    raises that error after the others finished, with every request's tokens in its `outputs`; a submitted one is
    in `take_failures()`, its samples dropped and its blocks back, and the others' tokens are those of a run
    without it."""
    model, tokenizer = demo
    ids = tokenizer.encode(PROMPT)
    lengths = dict(max_new_tokens=8, min_new_tokens=8)
    greedy = dict(lengths, do_sample=False)
    want = hf_paged.Engine(model).generate([ids, ids[:-3]], **greedy)
    engine = hf_paged.Engine(model, hf_paged.KVPool(model.config, block_size=4))
    tiny = GenerationConfig(**lengths, do_sample=True, temperature=1e-40)
    configs = [GenerationConfig(**greedy), tiny, GenerationConfig(**greedy)]
    with pytest.raises(RuntimeError, match="probability tensor") as info:
        engine.generate([ids, ids, ids[:-3]], generation_config=configs)
    assert "failed choosing its next token" in "".join(info.value.__notes__)
    outputs = info.value.outputs
    assert [outputs[0], outputs[2]] == want and outputs[1] == []
    assert engine.pool.stats().blocks_in_use == 0
    rid = engine.submit(ids, logits_processor=[_Raises(at=3)], num_return_sequences=2, do_sample=True, seed=1, **lengths)
    other = engine.submit(ids[:-3], **greedy)
    events, _ = _run(engine)
    failures = engine.take_failures()
    assert [r for r, _ in failures] == [rid] and "this processor fails" in str(failures[0][1])
    assert _outputs(events, other, 1) == [want[1]]
    assert all(not e.finished for e in events if e.request_id == rid)
    assert engine.pool.stats().blocks_in_use == 0 and not engine.has_work()
    engine.pool.check()


class _BoostInPlace(LogitsProcessor):
    """Adds 3 to one token's score in place (a common pattern of users' processors)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores):
        scores[:, self.token] += 3.0
        return scores


def test_a_processor_editing_scores_in_place_sees_each_sample_its_own_logits(demo):
    """Samples draw from one row's logits: a processor editing its scores in place must not add to the next
    sample's scores, nor to the raw log-probabilities. Every sample's first step sees the boost once, as
    `generate()` gives each row a copy (whose `output_logits` the in-place edit aliases, so the model's own forward
    is the reference here)."""
    model, tok = demo
    ids = tok.encode(PROMPT)
    engine = hf_paged.Engine(model)
    plain = dict(max_new_tokens=1, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    rid = engine.submit(ids, seed=0, num_return_sequences=3, top_logprobs=2, logits_processor=[_BoostInPlace(7)],
                        **plain)
    events, _ = _run(engine)
    firsts = [e.logprobs for e in events if e.request_id == rid]
    assert len(firsts) == 3
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    boosted = logits.clone()
    boosted[7] += 3.0
    for logprobs in firsts:
        raw, processed = torch.log_softmax(logits, -1), torch.log_softmax(boosted, -1)
        assert logprobs.raw_logprob == pytest.approx(float(raw[logprobs.token]), abs=1e-4)
        assert logprobs.logprob == pytest.approx(float(processed[logprobs.token]), abs=1e-4)
        assert [v for _, v in logprobs.top] == pytest.approx(processed.topk(2).values.tolist(), abs=1e-4)


def test_samples_on_a_pool_that_holds_one_request_at_a_time_finish(demo):
    """`num_return_sequences` samples on a fixed pool too small for the run: a prompt's samples are admitted after
    it, so the latest sample is preempted first (freeing its own blocks), and the step after an out-of-blocks
    preemption admits nobody, so the request preempted does not come straight back to take the blocks again (it
    did, step after step, without end). Every sample finishes with the tokens of a run on a pool that holds them
    all."""
    model, tok = demo
    prompts = [tok.encode("def read_config(path):\n    with open(path) as f:\n"), tok.encode("import os\nimport sys\n")]
    gen = dict(max_new_tokens=16, do_sample=True, num_return_sequences=2, seed=0)
    want = hf_paged.Engine(model).generate(prompts, **gen)
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=8)
    steps = [0]

    def bounded(engine: hf_paged.Engine) -> None:
        engine.pool.check()
        steps[0] += 1
        assert steps[0] < 200, f"no end after 200 steps ({engine.stats().preemptions} preemptions)"

    engine = hf_paged.Engine(model, pool, on_step=bounded)
    assert engine.generate(prompts, **gen) == want
    assert engine.stats().preemptions > 0 and pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("aborted", [0, 1])
def test_abort_of_one_sample_before_its_prompt_is_prefilled(demo, aborted):
    """`abort(request_id, sample=k)` while the prompt is still queued: sample k (the one that prefills the prompt
    for all, or one riding along) yields nothing; the others get every token they draw without the abort, and the
    request is done when they are."""
    model, tok = demo
    ids = tok.encode(PROMPT)
    gen = dict(max_new_tokens=6, min_new_tokens=6, do_sample=True, num_return_sequences=3)
    want = hf_paged.Engine(model).generate([ids], seed=5, **gen)
    engine = hf_paged.Engine(model, hf_paged.KVPool(model.config, block_size=4))
    rid = engine.submit(ids, seed=5, **gen)
    assert engine.abort(rid, sample=aborted)
    events, _ = _run(engine)
    outputs = _outputs(events, rid, 3)
    assert outputs[aborted] == []
    assert [outputs[k] for k in range(3) if k != aborted] == [want[k] for k in range(3) if k != aborted]
    assert sorted(e.sample for e in events if e.finished) == [k for k in range(3) if k != aborted]
    assert engine.pool.stats().blocks_in_use == 0 and not engine.has_work() and not engine.abort(rid)


def test_abort_of_one_sample_frees_it_and_spares_its_siblings(demo):
    """`abort(request_id, sample=k)` (a server's client saw sample k's text reach a stop string): that sample
    reports nothing more and its own blocks go back at once; the other samples finish with the tokens they draw
    without the abort (their generators are their own)."""
    model, tok = demo
    ids = tok.encode(PROMPT)
    gen = dict(max_new_tokens=12, min_new_tokens=12, do_sample=True, num_return_sequences=3)
    want = hf_paged.Engine(model).generate([ids], seed=5, **gen)
    engine = hf_paged.Engine(model, hf_paged.KVPool(model.config, block_size=4))
    rid = engine.submit(ids, seed=5, **gen)
    events = engine.step() + engine.step() + engine.step()
    before = engine.pool.stats().blocks_in_use
    assert engine.abort(rid, sample=1) and not engine.abort(rid, sample=1)
    assert engine.pool.stats().blocks_in_use < before  # its own (copied-on-write) blocks went back
    with pytest.raises(IndexError, match="no sample 3"):
        engine.abort(rid, sample=3)
    rest, _ = _run(engine)
    outputs = _outputs(events + rest, rid, 3)
    assert outputs[0] == want[0] and outputs[2] == want[2]
    assert len(outputs[1]) < len(want[1]) and outputs[1] == want[1][: len(outputs[1])]
    assert sorted(e.sample for e in rest if e.finished) == [0, 2]
    assert engine.pool.stats().blocks_in_use == 0 and not engine.has_work() and not engine.abort(rid)
    engine.pool.check()
