"""The Engine gives each request what generate() gives it, never serves K/V of other weights, and refuses bad
input before anything is stored (issue 27's table, case by case, on the shipped demo model)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import GenerationConfig

import hf_paged
from hf_paged.demo_model import load_demo_model
from hf_paged.engine.config import prepare_request

pytestmark = pytest.mark.xdist_group("engine")

TEXTS = ["def read_config(path):\n", "import os\n", "class Foo:\n"]


@pytest.fixture(scope="module")
def demo():
    torch.set_num_threads(1)
    model, tokenizer = load_demo_model(attn_implementation="paged")
    return model, tokenizer, [tokenizer.encode(t) for t in TEXTS]


def _reference(model, prompt: list[int], **kwargs) -> list[int]:
    """Single-request generate() with a PagedCache: the tokens it generates."""
    out = model.generate(torch.tensor([prompt]), **hf_paged.cache_kwargs(hf_paged.PagedCache()), **kwargs)
    return out[0, len(prompt) :].tolist()


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    return _reference(model, prompt, max_new_tokens=n, do_sample=False, eos_token_id=None)


# ---------------------------------------------------------------- 1. generate()'s semantics, field by field
def test_min_new_tokens_and_min_length_hold_back_eos(demo):
    model, _, prompts = demo
    eos = _greedy(model, prompts[0], 3)[1]  # the request's second greedy token
    engine = hf_paged.Engine(model)
    for lengths in (dict(min_new_tokens=6), dict(min_length=len(prompts[0]) + 6)):
        config = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=eos, **lengths)
        expected = _reference(model, prompts[0], generation_config=config)
        assert len(expected) >= 6
        assert engine.generate(prompts[:1], config, progress=False) == [expected]


def test_a_config_without_eos_stops_on_the_model_eos(demo):
    model, _, prompts = demo
    eos = _greedy(model, prompts[1], 4)[2]
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        config = GenerationConfig(max_new_tokens=10, do_sample=False)  # eos_token_id left unset
        expected = _reference(model, prompts[1], generation_config=config)
        assert expected[-1] == eos and len(expected) == 3
        assert hf_paged.Engine(model).generate(prompts[1:2], config, progress=False) == [expected]
    finally:
        model.generation_config.eos_token_id = saved


def test_a_keyword_set_to_none_wins_over_the_model_default(demo):
    """`eos_token_id=None` / `top_k=None` given as keywords turn the model's eos and default top-k off, in the Engine
    as in generate() (keywords win over `model.generation_config`, an explicit None included)."""
    model, _, prompts = demo
    eos = _greedy(model, prompts[1], 4)[2]
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        options = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
        expected = _reference(model, prompts[1], **options)
        assert len(expected) == 8 and expected[2] == eos
        assert hf_paged.Engine(model).generate(prompts[1:2], progress=False, **options) == [expected]
    finally:
        model.generation_config.eos_token_id = saved
    sampled = prepare_request(model, None, dict(max_new_tokens=8, do_sample=True, top_k=None), prompts[0], None)
    assert "TopKLogitsWarper" not in [type(p).__name__ for p in sampled.processors]


def test_max_length_shorter_than_the_prompt_raises_like_generate(demo):
    model, _, prompts = demo
    saved = model.generation_config.max_new_tokens
    model.generation_config.max_new_tokens = None  # else the model's max_new_tokens wins over max_length
    try:
        with pytest.raises(ValueError, match="max_length") as generate_error:
            model.generate(torch.tensor([prompts[0]]), max_length=4)
        with pytest.raises(ValueError, match="max_length") as engine_error:
            hf_paged.Engine(model).generate(prompts, max_length=4, progress=False)
    finally:
        model.generation_config.max_new_tokens = saved
    assert str(engine_error.value) == str(generate_error.value)


@pytest.mark.parametrize(
    "fields",
    [
        dict(forced_eos_token_id=7),
        dict(bad_words_ids=[[199], [707, 585]]),
        dict(exponential_decay_length_penalty=(2, 1.5)),
        dict(eos_token_id=[63, 268, 585], repetition_penalty=1.3),
        dict(no_repeat_ngram_size=2, suppress_tokens=[199]),
    ],
    ids=["forced_eos", "bad_words", "decay_penalty", "eos_list_penalty", "ngram_suppress"],
)
def test_logits_processors_match_generate(demo, fields):
    model, _, prompts = demo
    engine = hf_paged.Engine(model)
    expected = [_reference(model, p, max_new_tokens=9, do_sample=False, **fields) for p in prompts]
    assert engine.generate(prompts, max_new_tokens=9, do_sample=False, progress=False, **fields) == expected


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(num_beams=2), "num_beams"),
        (dict(penalty_alpha=0.6, top_k=4), "contrastive"),
        (dict(guidance_scale=1.5), "guidance_scale"),
        (dict(output_scores=True), "output_scores"),
        (dict(return_dict_in_generate=True), "return_dict_in_generate"),
        (dict(prompt_lookup_num_tokens=3, do_sample=True), "prompt_lookup_num_tokens with do_sample"),
        (dict(dola_layers="low"), "dola"),
    ],
)
def test_fields_the_engine_cannot_honour_are_refused(demo, fields, named):
    model, _, prompts = demo
    engine = hf_paged.Engine(model)
    with pytest.raises(ValueError, match=named):
        engine.generate(prompts, max_new_tokens=4, progress=False, **fields)
    assert engine.pool.stats().blocks_in_use == 0 and engine.stats().steps == 0


# ---------------------------------------------------------------- 2. weights and the prefix cache
def _changes(model):
    """In-place weight changes as an RL loop makes them: an optimizer step, load_state_dict, a no_grad edit."""

    def optimizer_step():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model.train()
        loss = model(input_ids=torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.eval()

    def load_state_dict():
        state = {k: v * 1.2 if v.is_floating_point() else v for k, v in model.state_dict().items()}
        model.load_state_dict(state)

    def in_place():
        with torch.no_grad():
            model.model.layers[0].self_attn.k_proj.weight.mul_(-1)

    def through_data():
        model.model.layers[1].self_attn.v_proj.weight.data.mul_(0.5)  # torch does not count .data writes

    return [optimizer_step, load_state_dict, in_place, through_data]


def test_changed_weights_are_never_served_stale_prefixes():
    """The RL pattern: train step -> engine.generate() on the same model object gives the new weights' tokens."""
    torch.set_num_threads(1)
    model, tokenizer = load_demo_model(attn_implementation="paged")
    prompt = tokenizer.encode("def read_config(path):\n    with open(path) as f:\n        return f.read()\n")
    pool = hf_paged.KVPool(model.config, block_size=4)
    engine = hf_paged.Engine(model, pool)
    engine.generate([prompt], max_new_tokens=6, do_sample=False, progress=False)
    for change in _changes(model):
        change()
        expected = _greedy(model, prompt, 6)
        hits = pool.stats().prefix_hit_tokens
        assert engine.generate([prompt], max_new_tokens=6, do_sample=False, eos_token_id=None, progress=False) == [expected]
        assert pool.stats().prefix_hit_tokens == hits  # nothing of the old weights was hit
        again = engine.generate([prompt], max_new_tokens=6, do_sample=False, eos_token_id=None, progress=False)
        assert again == [expected] and pool.stats().prefix_hit_tokens > hits  # the new weights' prefix is
        pool.check()


def test_two_models_on_one_pool_are_keyed_apart(demo):
    model, tokenizer, prompts = demo
    other, _ = load_demo_model(attn_implementation="paged")
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(1.1)
    pool = hf_paged.KVPool(model.config, block_size=4)
    first = hf_paged.Engine(model, pool).generate(prompts, max_new_tokens=6, do_sample=False, progress=False)
    second = hf_paged.Engine(other, pool).generate(prompts, max_new_tokens=6, do_sample=False, progress=False)
    assert first == [_reference(model, p, max_new_tokens=6, do_sample=False) for p in prompts]
    assert second == [_reference(other, p, max_new_tokens=6, do_sample=False) for p in prompts]
    # new_cache(model=...) shares the Engine's keys: the same model hits, the other does not
    ids = torch.tensor([prompts[0]])
    with pool.new_cache(ids, model=model) as cache:
        assert cache.get_seq_length() > 0
    with torch.no_grad():
        other.model.norm.weight.add_(1.0)
    with pool.new_cache(ids, model=other) as cache:
        assert cache.get_seq_length() == 0
    pool.check()


# ---------------------------------------------------------------- 3. bad input, shared pools, copies, stats
def test_new_cache_refuses_bad_ids_and_masks_before_storing(demo):
    model, _, prompts = demo
    pool = hf_paged.KVPool(model.config, block_size=4)
    with pool.new_cache(torch.tensor([prompts[0]])) as cache:
        model(input_ids=torch.tensor([prompts[0]]), **hf_paged.cache_kwargs(cache))
    before = pool.stats().as_dict()
    ids = torch.tensor([[5, 6, 7, 8]])
    bad = [
        ((ids, torch.ones(1, 6, dtype=torch.long)), ValueError, "shape"),
        ((ids[0],), ValueError, r"\[batch, seq_len\]"),
        ((ids.float(),), TypeError, "integer"),
        ((torch.tensor([[5, 9999]]),), ValueError, "vocabulary"),
        ((ids, torch.zeros(1, 4, dtype=torch.long)), ValueError, "at least one token"),
        ((ids, torch.full((1, 4), 2)), ValueError, "only 0"),
        ((torch.zeros(1, 0, dtype=torch.long),), ValueError, "at least one token"),
        (([[5, 6]],), TypeError, "torch.Tensor"),
    ]
    for args, kind, message in bad:
        with pytest.raises(kind, match=message):
            pool.new_cache(*args)
    assert pool.stats().as_dict() == before
    pool.check()


def test_engine_refuses_bad_ids_and_arrival_times(demo):
    model, _, prompts = demo
    engine = hf_paged.Engine(model)
    for prompt, kind, message in [
        (torch.tensor([5.0, 6.7]), TypeError, "integers"),
        ([5.0, 6.7], TypeError, "floats are not truncated"),
        ("def f():", TypeError, "token ids"),
        ([5, -1], ValueError, "vocabulary"),
        ([], ValueError, "empty"),
    ]:
        with pytest.raises(kind, match=message):
            engine.generate([prompts[0], prompt], max_new_tokens=2, progress=False)
    for seed in (2**70, [0, 1.5], 7.5):
        with pytest.raises(ValueError, match="seeds are whole numbers"):
            engine.generate(prompts[:2], max_new_tokens=2, do_sample=True, seed=seed, progress=False)
    for times in ([0.0, float("nan"), 0.0], [0.0, float("inf"), 0.0], [0.0, -1.0, 0.0], [0.0, 0.0]):
        with pytest.raises(ValueError, match="arrival_s"):
            list(engine.stream(prompts, max_new_tokens=2, arrival_s=times))
    assert engine.stats().steps == 0 and engine.pool.stats().blocks_in_use == 0


def test_kvpool_refuses_a_string_config_and_an_absurd_budget(demo):
    model, _, prompts = demo
    with pytest.raises(TypeError, match="model config"):
        hf_paged.KVPool("llama")
    pool = hf_paged.KVPool(model.config, max_memory=10**18)
    engine = hf_paged.Engine(model, pool)
    with pytest.raises(ValueError, match="max_memory=.* more than"):
        engine.generate(prompts, max_new_tokens=2, progress=False)
    pool.check()
    assert pool.stats().bytes_reserved == 0


def test_two_engines_on_one_fixed_pool_say_who_holds_the_blocks(demo):
    model, _, prompts = demo
    long_prompt = prompts[0] * 3  # 24 tokens: 7 blocks of 4 with 5 new tokens
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=10)
    first, second = hf_paged.Engine(model, pool), hf_paged.Engine(model, pool)
    running = first.stream([long_prompt], max_new_tokens=5, min_new_tokens=5, do_sample=False)
    next(running)  # the first engine now holds its request's blocks
    with pytest.raises(hf_paged.OutOfBlocksError) as info:
        second.generate([prompts[1] * 6], max_new_tokens=5, do_sample=False, progress=False)
    notes = "".join(info.value.__notes__)
    assert "other caches, engines or threads on this KVPool hold" in notes
    assert "cannot hold even one request alone" not in notes
    assert len(list(running)) == 4  # the first engine's request is unharmed
    pool.check()


def test_threads_sharing_a_fixed_pool(demo):
    model, _, prompts = demo
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=40)
    expected = [_reference(model, p, max_new_tokens=6, do_sample=False) for p in prompts]
    results: dict[int, list[list[int]]] = {}

    def work(k: int) -> None:
        results[k] = hf_paged.Engine(model, pool).generate(prompts, max_new_tokens=6, do_sample=False, progress=False)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {0: expected, 1: expected}
    pool.check()


def test_a_pool_for_exactly_one_request_serves_it_twice(demo):
    model, _, prompts = demo
    prompt = prompts[0]  # 8 tokens + 5 new: 12 stored tokens, 3 blocks of 4
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=3)
    engine = hf_paged.Engine(model, pool)
    first = engine.generate([prompt], max_new_tokens=5, min_new_tokens=5, do_sample=False, progress=False)
    second = engine.generate([prompt], max_new_tokens=5, min_new_tokens=5, do_sample=False, progress=False)
    assert first == second and pool.stats().prefix_hit_tokens == 4  # whole blocks, the last prompt token recomputed
    pool.check()


def test_a_request_that_can_never_fit_is_refused_before_any_runs(demo):
    model, _, prompts = demo
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=6)
    engine = hf_paged.Engine(model, pool)
    events = []
    with pytest.raises(hf_paged.OutOfBlocksError) as info:
        for event in engine.stream([prompts[1], prompts[0] * 4], max_new_tokens=4):
            events.append(event)
    assert events == [] and "refused before any request ran" in "".join(info.value.__notes__)
    assert engine.stats().steps == 0


def test_a_failed_request_keeps_the_others_output(demo):
    """A pool sized from `max_memory` on its first write: the oversized request fails alone, the others finish."""
    model, _, prompts = demo
    config = model.config
    block_bytes = 2 * 4 * config.num_key_value_heads * config.head_dim * 4 * config.num_hidden_layers  # K+V, float32
    pool = hf_paged.KVPool(config, block_size=4, max_memory=8 * block_bytes)  # 8 blocks of 4 tokens
    engine = hf_paged.Engine(model, pool, max_seqs=1)
    requests = [prompts[1], prompts[0] * 6, prompts[2]]
    with pytest.raises(hf_paged.OutOfBlocksError) as info:
        engine.generate(requests, max_new_tokens=4, do_sample=False, eos_token_id=None, progress=False)
    outputs = info.value.outputs
    assert outputs[0] == _greedy(model, requests[0], 4) and outputs[2] == _greedy(model, requests[2], 4)
    assert "requests [1] ran out of blocks" in "".join(info.value.__notes__)
    pool.check()
    assert pool.stats().blocks_in_use == 0


def test_deepcopy_of_a_prompt_cache_as_transformers_documents(demo):
    model, _, prompts = demo
    prefix = torch.tensor([prompts[0]])
    prompt_cache = hf_paged.PagedCache()
    with torch.no_grad():
        model(input_ids=prefix, **hf_paged.cache_kwargs(prompt_cache))
    outputs = []
    for tail in ([5, 6], [7, 8, 9]):
        ids = torch.cat([prefix, torch.tensor([tail])], dim=1)
        cache = copy.deepcopy(prompt_cache)
        out = model.generate(ids, **hf_paged.cache_kwargs(cache), max_new_tokens=5, do_sample=False)
        outputs.append(out[0, ids.shape[1] :].tolist())
        assert out[0, ids.shape[1] :].tolist() == _reference(model, ids[0].tolist(), max_new_tokens=5, do_sample=False)
        cache.release()
    assert prompt_cache.get_seq_length() == len(prompts[0])  # the original is untouched
    assert copy.copy(prompt_cache).get_seq_length() == len(prompts[0])
    prompt_cache.pool.check()


def test_stats_count_per_run_when_runs_overlap(demo):
    model, _, prompts = demo
    engine = hf_paged.Engine(model, max_seqs=1)
    first = engine.stream(prompts, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    finished = 0
    while finished < 1:
        finished += next(first)[2]
    engine.generate(prompts[:2], max_new_tokens=2, min_new_tokens=2, progress=False)  # while the first is open
    stats = engine.stats()
    assert (stats.runs, stats.finished, stats.waiting + stats.running) == (1, 1, 2)
    rest = list(first)
    stats = engine.stats()
    assert (stats.runs, stats.finished, stats.waiting + stats.running) == (0, 3, 0)
    assert stats.generated_tokens == 3 * 3 + 2 * 2 and len(rest) == 6
