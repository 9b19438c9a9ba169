"""generate() under torch.compile (issue 30 item 3): with a `PagedCache`, a compiled model runs the cache's update()
and the "paged" attention over it eagerly, in graph breaks, with one warning per process; `compile_config` with a
`PagedCache` is skipped by transformers (the cache is not compileable); a static cache compiles as transformers
compiles it. The tokens are always those of an uncompiled run.

Compiling on a CPU takes tens of seconds per model, so the tiny model runs few tokens, every test but one uses the
"eager" backend (dynamo traces, nothing is code-generated: what falls back is the same), and each test starts from
an empty compile cache.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

import hf_paged
from hf_paged.attention import outside_graph
from hf_paged.cache.forward import Forwards
from helpers import left_padded, load, saved_model
from matrix import HYBRIDS, passing, saved, saved_case
from matrix import load as load_family

NEW_TOKENS = 4


@pytest.fixture(autouse=True)
def fresh_compiler(monkeypatch):
    """An empty compile cache and counters, and a process that has not warned yet."""
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(outside_graph, "_warned", False)
    yield
    torch._dynamo.reset()


def _models():
    """(a model to compile, the same weights left uncompiled), both with "paged"."""
    path = saved_model("llama")
    return load(path, "paged"), load(path, "paged")


def _generate(model, lengths, seed=1, **kwargs):
    """Greedy generate() of left-padded prompts: with a new PagedCache unless `cache_implementation` is given."""
    ids, mask = left_padded(lengths, seed=seed)
    cache = {} if "cache_implementation" in kwargs else hf_paged.cache_kwargs(hf_paged.PagedCache())
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0) | kwargs
    return model.generate(input_ids=ids, attention_mask=mask, **cache, **settings)


def _fallback_warnings(caught) -> list[str]:
    return [
        str(w.message) for w in caught
        if issubclass(w.category, UserWarning) and str(w.message) == outside_graph.FALLBACK_WARNING
    ]


def _compiled_graphs() -> int:
    return counters["stats"].get("unique_graphs", 0)


def test_compiled_model_with_paged_cache_gives_eager_tokens_and_warns_once_per_process(monkeypatch):
    """`model.forward = torch.compile(model.forward)` + generate() with a PagedCache: a left-padded greedy batch
    gives the uncompiled tokens, the cache plans its forwards (`Forwards.open`) outside every compiled graph (the
    compiler never traces nor guards on its Python state), and the process is told once that it runs there."""
    model, reference = _models()
    model.forward = torch.compile(model.forward, backend="eager")
    traced: list[bool] = []
    original = Forwards.open

    def spy(self, *args, **kwargs):
        traced.append(torch.compiler.is_compiling())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Forwards, "open", spy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _generate(model, [5, 3, 7])
        again = _generate(model, [5, 3, 7])
    assert _compiled_graphs() > 0
    assert traced and not any(traced)
    expected = _generate(reference, [5, 3, 7])
    assert torch.equal(first, expected) and torch.equal(again, expected)
    assert _fallback_warnings(caught) == [outside_graph.FALLBACK_WARNING]
    assert "hf_paged.Engine(model, compile=True)" in outside_graph.FALLBACK_WARNING


def test_compiled_module_beam_search_with_paged_cache_gives_eager_tokens():
    """`model.compile()` + beam search (`reorder_cache` between compiled forwards, beams sharing blocks)."""
    model, reference = _models()
    model.compile(backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        beams = _generate(model, [5, 3], num_beams=3)
    assert _compiled_graphs() > 0
    assert torch.equal(beams, _generate(reference, [5, 3], num_beams=3))
    assert len(_fallback_warnings(caught)) == 1


@pytest.mark.slow
def test_compiled_hybrid_with_paged_cache_gives_eager_tokens():
    """A hybrid (gated DeltaNet beside attention): its recurrent-state calls run outside the graph too."""
    config = HYBRIDS["qwen3_next"][0]
    path = saved("qwen3_next", tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items())))
    model, reference = load_family(path, "paged"), load_family(path, "paged")
    model.forward = torch.compile(model.forward, backend="eager")
    ids, mask = left_padded([5, 11, 2], seed=1, low=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                  eos_token_id=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = model.generate(**kwargs, **hf_paged.cache_kwargs(hf_paged.PagedCache(model.config, block_size=4)))
    expected = reference.generate(**kwargs, **hf_paged.cache_kwargs(hf_paged.PagedCache(model.config, block_size=4)))
    assert _compiled_graphs() > 0
    assert torch.equal(tokens, expected)
    assert len(_fallback_warnings(caught)) == 1


@pytest.mark.slow
def test_compiled_model_with_layers_reusing_kv_gives_eager_tokens():
    """Gemma 4's layers that reuse an earlier layer's K/V: under a compiled model they attend over that layer's
    blocks outside the graph too (their K/V were staged and consumed by the earlier layer)."""
    case = next(c for c in passing() if c.id == "gemma4_text")
    path = saved_case(case)
    model, reference = load_family(path, "paged"), load_family(path, "paged")
    model.forward = torch.compile(model.forward, backend="eager")
    ids, mask = left_padded([5, 11, 2], seed=1, low=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                  eos_token_id=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokens = model.generate(**kwargs, **hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=4)))
    assert _compiled_graphs() > 0
    assert torch.equal(tokens, reference.generate(**kwargs, **hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=4))))


def test_torch_compile_wrapper_generate_runs_the_uncompiled_model():
    """`torch.compile(model).generate(...)` is the wrapped model's own generate(), which calls the model itself:
    nothing is compiled, and nothing falls back."""
    model, reference = _models()
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = _generate(compiled, [5, 3, 7])
    assert torch.equal(tokens, _generate(reference, [5, 3, 7]))
    assert _compiled_graphs() == 0
    assert _fallback_warnings(caught) == []


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_compile_config_with_paged_cache_is_skipped_by_transformers_with_its_warning():
    """generate(compile_config=...) with a PagedCache: transformers compiles only compileable caches, so it runs the
    model uncompiled and logs its own warning once; hf-paged adds none."""
    model, reference = _models()
    config = transformers.CompileConfig(backend="eager", fullgraph=True)
    config._compile_all_devices = True  # (transformers compiles on a CPU only when asked to)
    logger = logging.getLogger("transformers.generation.utils")
    handler, verbosity = _Messages(), transformers.logging.get_verbosity()
    transformers.utils.logging.warning_once.cache_clear()
    transformers.logging.set_verbosity_warning()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = _generate(model, [5, 3, 7], compile_config=config)
            second = _generate(model, [6], seed=2, compile_config=config)
    finally:
        logger.removeHandler(handler)
        transformers.logging.set_verbosity(verbosity)
    assert torch.equal(first, _generate(reference, [5, 3, 7]))
    assert torch.equal(second, _generate(reference, [6], seed=2))
    assert _compiled_graphs() == 0
    assert len([m for m in handler.messages if "compile_config" in m]) == 1
    assert _fallback_warnings(caught) == []


def test_static_cache_compile_config_fullgraph_compiles_under_paged_attention():
    """generate(cache_implementation="static", compile_config=CompileConfig(fullgraph=True)) on a "paged" model is
    transformers' own compiled path (no paged memory): its decode step compiles as one graph, without a break, and
    gives the uncompiled tokens. (The "paged" mask builds a static cache's 4D mask without reading its tensor
    query offset back.)"""
    model, reference = _models()
    config = transformers.CompileConfig(backend="eager", fullgraph=True, mode=None)
    config._compile_all_devices = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = _generate(model, [5, 3, 7], cache_implementation="static", compile_config=config)
    assert torch.equal(tokens, _generate(reference, [5, 3, 7], cache_implementation="static"))
    assert torch.equal(tokens, _generate(reference, [5, 3, 7]))
    assert _compiled_graphs() >= 1
    assert sum(counters["graph_break"].values()) == 0
    assert _fallback_warnings(caught) == []


def test_engine_compiled_decode_step_stays_one_graph():
    """The Engine's compiled decode step (`paged_graph_step`, no cache) still traces without a graph break
    (`fullgraph=True`), and its tokens are the uncompiled Engine's."""
    model, _ = _models()
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9]]
    expected = hf_paged.Engine(model, max_seqs=4).generate(prompts, max_new_tokens=NEW_TOKENS)
    engine = hf_paged.Engine(model, hf_paged.KVPool(model.config, num_blocks=64), max_seqs=4, compile=True)
    engine.graphs._compiled = torch.compile(engine.graphs._forward, fullgraph=True, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine.generate(prompts, max_new_tokens=NEW_TOKENS) == expected
    assert _fallback_warnings(caught) == []
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.slow
def test_inductor_compiled_model_with_paged_cache_gives_eager_tokens():
    """The default backend (Inductor) around the eager islands: the same tokens, the same one warning."""
    model, reference = _models()
    model.forward = torch.compile(model.forward)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = _generate(model, [5, 3, 7], max_new_tokens=2)
    assert torch.equal(tokens, _generate(reference, [5, 3, 7], max_new_tokens=2))
    assert len(_fallback_warnings(caught)) == 1
