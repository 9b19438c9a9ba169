"""Speculative decoding inside `hf_paged.Engine` (prompt lookup): greedy output identical to the Engine without
speculation and to single-request `generate()` (with and without `prompt_lookup_num_tokens`), mixed batches, stops
inside an accepted run, preemption under a tiny pool, rows cropped per row, the counters, and clear refusals.

Runs on the shipped demo model (peaked logits, so tokens are compared exactly); `pool.check()` after every step.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

import hf_paged
import hf_paged.engine.engine as engine_module
from hf_paged.demo_model import load_demo_model
from hf_paged.engine import speculation

pytestmark = [pytest.mark.xdist_group("engine"), pytest.mark.usefixtures("one_thread")]

#: Passages followed by their own beginning: the model continues them, prompt lookup drafts from them.
PASSAGES = [
    "def read_config(path):\n    with open(path) as f:\n        return f.read()\n",
    "import os\nimport sys\n\nclass Foo:\n    def __init__(self):\n        self.items = []\n",
    "for i in range(10):\n    print(i, i * i)\n    total += i\n",
]


@pytest.fixture(scope="module")
def demo():
    model, tokenizer = load_demo_model(attn_implementation="paged")
    model.generation_config.max_new_tokens = None  # the demo's own default would win over max_length
    prompts = [tokenizer.encode(p + "\n" + p[:30]) for p in PASSAGES]
    return model, tokenizer, prompts


def _generate(model, tokenizer, prompt: list[int], **kwargs) -> list[int]:
    """Single-request `generate()` with a PagedCache."""
    out = model.generate(
        torch.tensor([prompt]), tokenizer=tokenizer, **hf_paged.cache_kwargs(hf_paged.PagedCache()), **kwargs
    )
    return out[0, len(prompt) :].tolist()


def _plain(config: GenerationConfig) -> GenerationConfig:
    """The config without speculation: `generate()`'s prompt lookup checks stop strings only at the end of each
    accepted run (it misses one completed inside it), so stops are compared with plain greedy `generate()`."""
    return GenerationConfig(**{**config.to_diff_dict(), "prompt_lookup_num_tokens": None})


def _engine(model, tokenizer=None, pool=None, **kwargs) -> hf_paged.Engine:
    return hf_paged.Engine(model, pool, tokenizer=tokenizer, on_step=lambda e: e.pool.check(), **kwargs)


@pytest.fixture
def stops_in_runs(monkeypatch):
    """Counts requests that finished on an accepted draft (a stop inside a speculated run), via a spy on `accept`."""
    seen = {"inside": 0}

    def spy(req, logits):
        kept = speculation.accept(req, logits)
        token, done = kept[-1]
        if done and len(kept) <= req.num_drafted and token == req.draft[len(kept) - 1]:
            seen["inside"] += 1
        return kept

    monkeypatch.setattr(engine_module, "accept", spy)
    return seen


def _check_returned(engine: hf_paged.Engine) -> None:
    engine.pool.check()
    assert engine.pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("k", [1, 4, 10])
def test_greedy_identical_to_generate_and_to_no_speculation(demo, k):
    model, tokenizer, prompts = demo
    plain = _engine(model).generate(prompts, max_new_tokens=40, progress=False)
    engine = _engine(model, max_batch_tokens=64)
    spec = engine.generate(prompts, max_new_tokens=40, prompt_lookup_num_tokens=k, progress=False)
    assert spec == plain
    for prompt, out in zip(prompts, spec, strict=True):
        assert out == _generate(model, tokenizer, prompt, max_new_tokens=40, do_sample=False)
        assert out == _generate(model, tokenizer, prompt, max_new_tokens=40, prompt_lookup_num_tokens=k)
    stats = engine.stats()
    assert 0 < stats.accepted_tokens <= stats.drafted_tokens
    assert stats.acceptance_rate == stats.accepted_tokens / stats.drafted_tokens
    assert stats.steps < stats.generated_tokens  # some steps kept several tokens per request
    assert stats.generated_tokens == sum(map(len, spec))
    _check_returned(engine)


def test_mixed_batch_some_speculate_some_do_not(demo):
    """Requests with different k (rows of different widths), without speculation, and sampling, in one run."""
    model, tokenizer, prompts = demo
    prompts = prompts + prompts[:2]
    configs = [
        GenerationConfig(max_new_tokens=30, prompt_lookup_num_tokens=3),
        GenerationConfig(max_new_tokens=25),
        GenerationConfig(max_new_tokens=30, prompt_lookup_num_tokens=7, max_matching_ngram_size=3),
        GenerationConfig(max_new_tokens=20, do_sample=True, top_k=20),
        GenerationConfig(max_new_tokens=35, prompt_lookup_num_tokens=5, repetition_penalty=1.3),
    ]
    engine = _engine(model, max_batch_tokens=48, max_seqs=4)
    outputs = engine.generate(prompts, configs, seed=7, progress=False)
    for i, (prompt, config, out) in enumerate(zip(prompts, configs, outputs, strict=True)):
        if config.do_sample:  # its tokens depend on its seed only, not on its neighbours' speculation
            alone = _engine(model).generate([prompt], [config], seed=[7 + i], progress=False)[0]
            assert out == alone
        else:
            assert out == _generate(model, tokenizer, prompt, generation_config=config), f"request {i}"
    assert engine.stats().drafted_tokens > 0
    _check_returned(engine)


@pytest.mark.parametrize("cut", [3, 8, 14, 21, 29])
def test_stops_cut_inside_accepted_runs(demo, cut):
    """EOS ids, stop strings and max_new_tokens taken from the output itself, so they fall inside runs."""
    model, tokenizer, prompts = demo
    base = _engine(model).generate(prompts, max_new_tokens=40, progress=False)
    configs = []
    for out in base:
        text = tokenizer.decode(out[:cut])
        stop = text[-3:] if len(text.strip()) >= 3 else None
        configs.append(GenerationConfig(max_new_tokens=40, eos_token_id=[out[cut - 1]], prompt_lookup_num_tokens=6))
        configs.append(GenerationConfig(max_new_tokens=40, stop_strings=stop, prompt_lookup_num_tokens=6))
        configs.append(GenerationConfig(max_new_tokens=cut, prompt_lookup_num_tokens=6))
    many = [p for p in prompts for _ in range(3)]
    engine = _engine(model, tokenizer)
    outputs = engine.generate(many, configs, progress=False)
    for i, (prompt, config, out) in enumerate(zip(many, configs, outputs, strict=True)):
        assert out == _generate(model, tokenizer, prompt, generation_config=_plain(config)), f"request {i}"
    _check_returned(engine)


def test_some_stop_fell_inside_a_run(demo, stops_in_runs):
    """The stop test above is not vacuous: stop strings end requests on an accepted draft (EOS is never drafted
    and drafts stop short of max_new_tokens, as in `generate()`, so those end on the model's own token)."""
    model, tokenizer, prompts = demo
    (base,) = _engine(model).generate(prompts[:1], max_new_tokens=40, progress=False)
    stops = {tokenizer.decode(base[:cut])[-2:] for cut in range(2, 40)}
    configs = [GenerationConfig(max_new_tokens=40, stop_strings=s, prompt_lookup_num_tokens=8) for s in sorted(stops)]
    outputs = _engine(model, tokenizer).generate(prompts[:1] * len(configs), configs, progress=False)
    for config, out in zip(configs, outputs, strict=True):
        assert out == _generate(model, tokenizer, prompts[0], generation_config=_plain(config))
    assert stops_in_runs["inside"] > 0


def test_preemption_under_a_tiny_pool(demo):
    model, tokenizer, prompts = demo
    many = prompts * 2
    plain = _engine(model).generate(many, max_new_tokens=24, progress=False)
    longest = max(len(p) for p in many) + 24
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=(longest + 4 + 3) // 4 + 2)
    engine = _engine(model, pool=pool, max_batch_tokens=32)
    spec = engine.generate(many, max_new_tokens=24, prompt_lookup_num_tokens=4, progress=False)
    assert spec == plain
    assert engine.stats().preemptions > 0 and engine.stats().accepted_tokens > 0
    _check_returned(engine)


def test_request_alone_that_fits_only_without_drafts(demo):
    """A fixed pool sized for a request without speculation: its drafts do not fit, so it goes on without them."""
    model, tokenizer, prompts = demo
    prompt = prompts[0][:3]
    plain = _engine(model).generate([prompt], max_new_tokens=3, progress=False)
    pool = hf_paged.KVPool(model.config, block_size=1, num_blocks=len(prompt) + 3 - 1)
    engine = _engine(model, pool=pool)
    assert engine.generate([prompt], max_new_tokens=3, prompt_lookup_num_tokens=4, progress=False) == plain
    _check_returned(engine)


def test_incremental_api_logprobs_match(demo):
    """`submit()` with prompt lookup gives the same tokens and log-probabilities as without."""
    model, _, prompts = demo
    events = {}
    for k in (None, 5):
        engine = _engine(model)
        extra = {} if k is None else {"prompt_lookup_num_tokens": k}
        engine.submit(prompts[0], max_new_tokens=20, top_logprobs=2, **extra)
        got = []
        while engine.has_work():
            got.extend(engine.step())
        events[k] = got
        _check_returned(engine)
    assert [(e.token, e.finish_reason) for e in events[5]] == [(e.token, e.finish_reason) for e in events[None]]
    for spec, plain in zip(events[5], events[None], strict=True):  # (the rows' float sums differ in order)
        assert spec.logprobs.logprob == pytest.approx(plain.logprobs.logprob, abs=1e-3)
        assert [t for t, _ in spec.logprobs.top] == [t for t, _ in plain.logprobs.top]


def test_crop_rows_per_row(demo):
    model, _, prompts = demo
    pool = hf_paged.KVPool(model.config, block_size=4)
    cache = pool.new_cache()
    ids = torch.tensor([prompts[0][:10], prompts[1][:10]])
    with torch.no_grad():
        model(ids, **hf_paged.cache_kwargs(cache), use_cache=True)
    cache.crop_rows([0, 7])
    assert cache.seq_lens == [10, 3]
    assert len(cache.block_table(1)) == 1
    pool.check()
    with pytest.raises(ValueError, match="one count per row"):
        cache.crop_rows([11, 0])
    cache.release()
    pool.check()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt_lookup_num_tokens": 4, "do_sample": True}, "greedy search only"),
        ({"prompt_lookup_num_tokens": 0}, "positive int"),
        ({"prompt_lookup_num_tokens": 3, "max_matching_ngram_size": -1}, "positive int"),
        ({"assistant_model": object()}, "draft_model"),
        ({"use_mtp": True}, "use_mtp"),
        ({"prompt_lookup_num_tokens": 3, "num_beams": 2}, "num_beams"),
    ],
)
def test_refused_combinations(demo, kwargs, match):
    model, _, prompts = demo
    with pytest.raises(ValueError, match=match):
        _engine(model).generate(prompts[:1], max_new_tokens=4, progress=False, **kwargs)


def test_ngram_index_follows_generate_lookup():
    index = speculation.NgramIndex(2)
    tokens = [5, 6, 7, 8, 5, 6]
    assert index.lookup(tokens, 3) == [7, 8, 5]  # the 2-gram (5, 6) first seen at 0
    tokens += [9]
    assert index.lookup(tokens, 3) == []  # (6, 9) and 9 never seen before
    tokens += [7]
    assert index.lookup(tokens, 2) == [8, 5]  # falls back to the 1-gram 7, earliest occurrence
    assert speculation.NgramIndex(2).lookup([1, 1, 1], 5) == [1]  # continuations stop at the end of the tokens


def test_ngram_index_equals_generate_candidate_generator():
    """Grown token by token, the index drafts what `PromptLookupCandidateGenerator` proposes."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        tokens = torch.randint(0, 6, (40,), generator=gen).tolist()
        k, n = 1 + trial % 5, 1 + trial % 3
        index, reference = speculation.NgramIndex(n), PromptLookupCandidateGenerator(None, k, n, max_length=10**6)
        for length in range(1, len(tokens) + 1):
            candidates, _ = reference.get_candidates(torch.tensor([tokens[:length]]))
            assert index.lookup(tokens[:length], k) == candidates[0, length:].tolist()


# ---------------------------------------------------------------------------- a draft model
@pytest.fixture(scope="module")
def drafts(demo):
    """The demo model itself as a draft (acceptance 1.0), and a different tiny model of the same vocabulary."""
    same, _ = load_demo_model(attn_implementation="paged")
    torch.manual_seed(0)
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    config = LlamaConfig(vocab_size=demo[0].config.vocab_size, max_position_embeddings=4096, **sizes)
    other = AutoModelForCausalLM.from_config(config, attn_implementation="paged").eval()
    return {"same": same, "other": other}


def _check_both_pools(engine: hf_paged.Engine) -> None:
    engine.pool.check()
    engine.drafter.pool.check()


@pytest.mark.parametrize("which", ["same", "other"])
def test_draft_model_greedy_identical(demo, drafts, which):
    model, tokenizer, prompts = demo
    plain = _engine(model).generate(prompts, max_new_tokens=30, progress=False)
    engine = hf_paged.Engine(model, draft_model=drafts[which], num_draft_tokens=3, on_step=_check_both_pools)
    configs = [GenerationConfig(max_new_tokens=30)] * 2 + [GenerationConfig(max_new_tokens=30, prompt_lookup_num_tokens=5)]
    outputs = engine.generate(prompts, configs, progress=False)
    assert outputs == plain
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out == _generate(model, tokenizer, prompt, max_new_tokens=30, do_sample=False)
    stats = engine.stats()
    assert stats.drafted_tokens > 0
    if which == "same":  # the draft is the model: every draft of a draft-model row is confirmed
        assert stats.steps < stats.generated_tokens / 2
    _check_returned(engine)
    assert engine.drafter.pool.stats().blocks_in_use == 0  # every draft cache went back


def test_draft_model_with_preemption_and_stops(demo, drafts):
    model, tokenizer, prompts = demo
    many = prompts * 2
    configs = [GenerationConfig(max_new_tokens=24 - i, stop_strings=["):"] if i % 3 == 0 else None) for i in range(len(many))]
    plain = _engine(model, tokenizer).generate(many, configs, progress=False)
    longest = max(len(p) for p in many) + 24
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=(longest + 3 + 3) // 4 + 2)
    draft = {"draft_model": drafts["same"], "num_draft_tokens": 3}
    engine = hf_paged.Engine(model, pool, tokenizer=tokenizer, max_batch_tokens=32, on_step=_check_both_pools, **draft)
    assert engine.generate(many, configs, progress=False) == plain
    assert engine.stats().preemptions > 0
    _check_returned(engine)
    assert engine.drafter.pool.stats().blocks_in_use == 0


def test_draft_model_refusals(demo, drafts):
    model, _, prompts = demo
    engine = hf_paged.Engine(model, draft_model=drafts["other"])
    with pytest.raises(ValueError, match="greedy only"):
        engine.generate(prompts[:1], max_new_tokens=4, do_sample=True, progress=False)
    small_vocab = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2),
        attn_implementation="paged",
    )
    with pytest.raises(ValueError, match="vocabulary"):
        hf_paged.Engine(model, draft_model=small_vocab)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        hf_paged.Engine(model, draft_model=drafts["other"], num_draft_tokens=0)
