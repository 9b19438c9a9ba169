"""`hf_paged.Engine`: per-request parity with single-request generate(), chunked prefill, preemption under a tiny
pool, streaming order, seeded sampling, prefix hits across requests, and clear errors on bad input."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import hf_paged
from hf_paged.errors import UnsupportedModelError
from tests.matrix import MODELS, saved_case
from tests.helpers import load

pytestmark = pytest.mark.xdist_group("engine")

FAMILIES = ("llama", "mistral", "gemma2", "qwen2", "opt")  # GQA+RoPE, sliding window, softcap+alternating, bias, learned positions


def _case(model_type: str):
    return next(c for c in MODELS if c.model_type == model_type and not c.label)


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return {t: load(saved_case(_case(t)), "paged") for t in FAMILIES}


def _prompts(lengths: list[int], vocab: int = 128, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _reference(model, prompt: list[int], **kwargs) -> list[int]:
    """Single-request generate() with a PagedCache."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, **hf_paged.cache_kwargs(hf_paged.PagedCache()), pad_token_id=0, **kwargs)
    return out[0, len(prompt) :].tolist()


LENGTHS = [5, 37, 3, 21, 12, 50]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_parity_per_request_with_chunked_prefill(models, model_type):
    model = models[model_type]
    prompts = _prompts(LENGTHS)
    # 16 tokens per step: the 37- and 50-token prompts are prefilled in chunks beside decode tokens
    engine = hf_paged.Engine(model, max_batch_tokens=16, max_seqs=4)
    outputs = engine.generate(prompts, max_new_tokens=12, do_sample=False, progress=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == _reference(model, prompt, max_new_tokens=12, do_sample=False)
    stats = engine.stats()
    assert stats.finished == len(prompts) and stats.waiting == stats.running == 0
    assert stats.generated_tokens == sum(map(len, outputs))
    engine.pool.check()
    assert engine.pool.stats().blocks_in_use == 0  # every request gave its blocks back


def test_steps_are_packed_and_unpadded(models):
    """Each step is one forward of [1, N] tokens: N = decode tokens + prefill chunk tokens <= max_batch_tokens."""
    model = models["llama"]
    seen: list[tuple[int, ...]] = []
    hook = model.model.register_forward_pre_hook(lambda m, args, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        engine = hf_paged.Engine(model, max_batch_tokens=16, max_seqs=4)
        engine.generate(_prompts(LENGTHS), max_new_tokens=6, progress=False)
    finally:
        hook.remove()
    assert all(shape[0] == 1 and shape[1] <= 16 for shape in seen)
    fed = sum(shape[1] for shape in seen)
    assert fed == sum(LENGTHS) + sum(6 - 1 for _ in LENGTHS)  # every prompt token once, every output token but the last
    assert engine.stats().steps == len(seen)


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_preemption_under_a_tiny_pool_keeps_outputs(models, model_type):
    model = models[model_type]
    prompts = _prompts([20, 30, 25, 18, 33, 27], seed=1)
    expected = [_reference(model, p, max_new_tokens=16, do_sample=False, min_new_tokens=16) for p in prompts]
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=30)  # about two requests' worth
    engine = hf_paged.Engine(model, pool, max_batch_tokens=32, max_seqs=6)
    outputs: list[list[int]] = [[] for _ in prompts]
    for index, token, _ in engine.stream(prompts, max_new_tokens=16, min_new_tokens=16, do_sample=False):
        outputs[index].append(token)
        pool.check()  # after every step (events come after the step is committed)
    assert outputs == expected
    assert engine.stats().preemptions > 0


def test_a_request_larger_than_the_pool_is_a_clear_error(models):
    model = models["llama"]
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=3)
    engine = hf_paged.Engine(model, pool)
    with pytest.raises(hf_paged.OutOfBlocksError, match="cannot hold even one request"):
        engine.generate(_prompts([30]), max_new_tokens=4, progress=False)
    pool.check()


def test_stream_order_and_finished_flags(models):
    model = models["llama"]
    prompts = _prompts([40, 4, 9], seed=2)
    lengths = [10, 3, 6]
    configs = [GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=2) for n in lengths]
    engine = hf_paged.Engine(model, max_batch_tokens=8, max_seqs=3)
    events = list(engine.stream(prompts, configs))
    per_request = {i: [t for j, t, _ in events if j == i] for i in range(3)}
    for i, prompt in enumerate(prompts):
        assert per_request[i] == _reference(model, prompt, generation_config=configs[i])
        flags = [f for j, _, f in events if j == i]
        assert flags == [False] * (lengths[i] - 1) + [True]
    # continuous batching: the short requests finish while the long prompt is still being served
    assert max(k for k, (j, _, f) in enumerate(events) if j == 1) < max(k for k, (j, _, _) in enumerate(events) if j == 0)


def test_seeded_sampling_does_not_depend_on_batch_composition(models):
    model = models["qwen2"]
    prompts = _prompts([7, 19, 11, 30], seed=3)
    sample = dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.9, max_new_tokens=10, min_new_tokens=10)
    engine = hf_paged.Engine(model, max_batch_tokens=24, max_seqs=4)
    together = engine.generate(prompts, seed=[11, 12, 13, 14], progress=False, **sample)
    alone = [engine.generate([p], seed=[s], progress=False, **sample)[0] for p, s in zip(prompts, [11, 12, 13, 14])]
    assert together == alone
    other_seed = engine.generate(prompts[:1], seed=[99], progress=False, **sample)[0]
    assert other_seed != together[0]  # the seed matters (a 128-token vocab at temperature 0.9)


def test_repetition_penalty_and_eos(models):
    model = models["gemma2"]
    prompts = _prompts([6, 14], seed=4)
    engine = hf_paged.Engine(model, max_batch_tokens=16)
    for kwargs in (dict(repetition_penalty=1.5), dict(eos_token_id=[5, 9, 17, 33, 40, 77])):
        outputs = engine.generate(prompts, max_new_tokens=12, do_sample=False, progress=False, **kwargs)
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output == _reference(model, prompt, max_new_tokens=12, do_sample=False, **kwargs)


def test_prefix_hits_across_requests_and_salts(models):
    model = models["llama"]
    shared = _prompts([48], seed=5)[0]
    prompts = [shared + tail for tail in _prompts([5, 7, 3], seed=6)]
    expected = [_reference(model, p, max_new_tokens=8, do_sample=False) for p in prompts]
    pool = hf_paged.KVPool(model.config, block_size=16)
    engine = hf_paged.Engine(model, pool, max_seqs=1)  # one at a time: each later request finds the prefix indexed
    assert engine.generate(prompts, max_new_tokens=8, do_sample=False, progress=False) == expected
    stats = engine.stats()
    assert stats.prefix_hit_tokens == 2 * 48
    assert stats.prompt_tokens_computed == sum(map(len, prompts)) - 2 * 48
    other = hf_paged.Engine(model, pool, max_seqs=1, salt="tenant-b")
    assert other.generate(prompts[:1], max_new_tokens=8, do_sample=False, progress=False) == expected[:1]
    assert pool.stats().prefix_hit_tokens == 2 * 48  # another salt never hits
    pool.check()


def test_stop_strings(models):
    from hf_paged.demo_model import load_demo_model

    model, tokenizer = load_demo_model(attn_implementation="paged")
    prompt = tokenizer.encode("def read_config(path):\n")
    full = hf_paged.Engine(model).generate([prompt], max_new_tokens=24, do_sample=False, progress=False)[0]
    text = tokenizer.decode(full)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    engine = hf_paged.Engine(model, tokenizer=tokenizer)
    out = engine.generate([prompt], max_new_tokens=24, do_sample=False, stop_strings=[stop], progress=False)[0]
    assert stop in tokenizer.decode(out) and len(out) < len(full) and out == full[: len(out)]
    with pytest.raises(ValueError, match="tokenizer"):
        hf_paged.Engine(model).generate([prompt], stop_strings=["x"], progress=False)


def test_bad_input_is_a_clear_error(models):
    model = models["llama"]
    engine = hf_paged.Engine(model)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[5, 6], []], progress=False)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([[5] * 600], max_new_tokens=4, progress=False)
    with pytest.raises(ValueError, match="Unknown generation options.*not_a_field"):
        engine.generate([[5, 6]], not_a_field=3, progress=False)
    with pytest.raises(ValueError, match="num_beams"):
        engine.generate([[5, 6]], num_beams=2, progress=False)
    with pytest.raises(ValueError, match="1-D"):
        engine.generate([torch.tensor([[5, 6]])], progress=False)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([[5, 1000]], progress=False)
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate([[5], [6]], [GenerationConfig()], progress=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[5, 6]], max_new_tokens=0, progress=False)
    assert [len(o) for o in engine.generate([torch.tensor([5, 6, 7])], max_new_tokens=3, min_new_tokens=3, progress=False)] == [3]


def test_models_that_cannot_be_packed_are_refused(models):
    sdpa = load(saved_case(_case("llama")), "sdpa")
    with pytest.raises(ValueError, match="attn_implementation='paged'"):
        hf_paged.Engine(sdpa)
    # every family "paged" serves takes position_ids; a forward without them (a wrapped or custom model) is refused
    wrapped = load(saved_case(_case("llama")), "paged")
    inner = wrapped.forward
    wrapped.forward = lambda input_ids=None, attention_mask=None, **kwargs: inner(input_ids, attention_mask, **kwargs)
    with pytest.raises(UnsupportedModelError, match="position_ids"):
        hf_paged.Engine(wrapped)


@pytest.mark.parametrize("model_type", ["jetmoe", "deepseek_v3"])
def test_a_model_computing_its_own_attention_is_refused(models, model_type):
    """Models whose attention changes the K/V the cache returns (jetmoe; multi-latent attention) read their cache
    gathered: the Engine refuses them when it is made, naming generate() with a PagedCache."""
    model = load(saved_case(next(c for c in MODELS if c.model_type == model_type)), "paged")
    with pytest.raises(UnsupportedModelError, match=r"changes the K/V.*model\.generate\(\) with a hf_paged\.PagedCache"):
        hf_paged.Engine(model)


def test_core_methods_the_engine_uses(models):
    """`load_prompt()` keeps the prompt's blocks indexable across chunked forwards, `append_row_of`
    shares a row's blocks (reference counts, no copy) and `finish_forward` commits a completed forward."""
    model = models["llama"]
    pool = hf_paged.KVPool(model.config, block_size=4)
    prompt = torch.tensor([_prompts([18], seed=7)[0]])
    cache = hf_paged.PagedCache(pool=pool, dedupe_rows=False)
    cache.load_prompt(prompt)
    for start in range(0, 18, 5):  # four chunks of at most 5 tokens
        chunk = prompt[:, start : start + 5]
        model(input_ids=chunk, position_ids=torch.arange(start, start + chunk.shape[1])[None], use_cache=True,
              **hf_paged.cache_kwargs(cache))
        cache.finish_forward()
    assert cache.get_seq_length() == 18
    rows = hf_paged.PagedCache(model.config, pool=pool, dedupe_rows=False)
    rows.append_row_of(cache)
    rows.append_row_of(cache)
    assert pool.stats().blocks_shared == 5 and pool.stats().blocks_in_use == 5  # 18 tokens: 5 blocks, held 3 times
    pool.check()
    cache.release()
    rows.batch_select_indices([1])
    pool.check()
    rows.release()
    again = pool.new_cache(prompt)
    assert again.get_seq_length() == 16  # the chunked prompt's 4 full blocks were indexed
    again.release()
    pool.check()
