"""pytest plugin: run transformers' own generation tests with hf-paged swapped in.

Loaded with `-p` into a pytest run of transformers' test suite (see `tests/hf_suite/run.py`, which puts this
folder on PYTHONPATH). In `pytest_configure` it patches two choke points of transformers (DESIGN §2.12):

* `PreTrainedModel._check_and_adjust_attn_implementation`: every attention choice goes through it. Where the
  model would get `None`/"sdpa"/"eager"/"paged" and can run `"paged"` (it dispatches through
  `AttentionInterface` by `hf_paged.support.runs_own_attention` and is a decoder), the result is
  `"paged"`. An explicit request for anything else (flash attention, flex attention, a hub kernel) is kept.
* `GenerationMixin._prepare_cache_for_generation`: where generate() builds its default `DynamicCache`
  (`cache_implementation` None or "dynamic", a decoder-only model whose layers are all full or sliding
  softmax attention), it gets a `hf_paged.PagedCache` instead. Static, quantized, offloaded and
  encoder-decoder caches and every cache the test passes itself are kept.

It counts what went through hf-paged (`COUNTS`) and fails the session if the paged attention never read a
`PagedCache` (`PagedCache.attend`), so a run that silently kept the stock path cannot look green. Set
`HF_PAGED_SUITE_COUNTS=FILE` to get the counts (and the ids of the tests that took the paged path) as JSON.
`patched()` applies the same patches as a context manager, for tests of the plugin itself.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch

import hf_paged
from hf_paged.attention import paged as _attention
from hf_paged.support import runs_own_attention

NAME = "paged"
#: Requested implementations that the plugin turns into "paged" (None = the model's default choice).
SWAPPABLE = frozenset({None, "sdpa", "eager", NAME})
#: Results of the stock check that "paged" may replace ("sdpa" may fall back to "eager").
_REPLACEABLE = frozenset({"sdpa", "eager", NAME})
#: DynamicCache layer classes that a PagedCache serves (full and sliding-window softmax attention; a layer that
#: stores nothing, e.g. one reusing an earlier layer's K/V).
_PAGEABLE_LAYERS = frozenset({"DynamicLayer", "DynamicSlidingWindowLayer", "DummyLayer"})
#: `cache_implementation` values for which generate() builds its default DynamicCache.
_DEFAULT_CACHE_IMPLEMENTATIONS = frozenset({None, "dynamic"})
#: generate()'s name for the cache in model_kwargs: "cache" from transformers 5.24, "past_key_values" before.
_CACHE_KEYS = ("cache", "past_key_values")

#: What went through hf-paged since the patches were applied:
#:   attn_forced       attention choices turned into "paged"
#:   caches_swapped    default DynamicCaches replaced by a PagedCache
#:   paged_attention   calls of the "paged" attention function
#:   paged_attend      PagedCache.attend() calls: the paged attention reading a PagedCache through its block
#:                     tables (the rest of paged_attention ran over contiguous K/V: another cache, or none)
#:   cache_updates     PagedCache.update() calls (any attention implementation)
COUNTS: Counter[str] = Counter()
_INHERITED = object()  # a patched attribute that the class did not define itself


def model_can_run_paged(model: object) -> bool:
    """Whether `model` can honestly be given `attn_implementation="paged"`."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    if runs_own_attention(type(model), config):
        return False
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None:
        try:
            return bool(can_set())
        except Exception:  # noqa: BLE001 - custom models without the classmethod's assumptions
            return False
    return bool(getattr(model, "_supports_attention_backend", False))


def _pageable(cache: object) -> bool:
    layers = getattr(cache, "layers", None) or []
    return all(type(layer).__name__ in _PAGEABLE_LAYERS for layer in layers)


def _patch_check(original: Callable) -> Callable:
    @functools.wraps(original)
    def check(self, attn_implementation=None, *args, **kwargs):
        chosen = original(self, attn_implementation, *args, **kwargs)
        if (
            (attn_implementation is None or isinstance(attn_implementation, str))
            and attn_implementation in SWAPPABLE
            and chosen in _REPLACEABLE
            and model_can_run_paged(self)
        ):
            if chosen != NAME:
                COUNTS["attn_forced"] += 1
            return NAME
        return chosen

    return check


def _patch_prepare_cache(original: Callable) -> Callable:
    from transformers import DynamicCache  # noqa: PLC0415

    @functools.wraps(original)
    def prepare(self, generation_config, model_kwargs, *args, **kwargs):
        before = {key: model_kwargs.get(key) for key in _CACHE_KEYS}
        result = original(self, generation_config, model_kwargs, *args, **kwargs)
        for key in _CACHE_KEYS:
            cache = model_kwargs.get(key)
            if (
                cache is not None
                and cache is not before[key]
                and type(cache) is DynamicCache
                and generation_config.cache_implementation in _DEFAULT_CACHE_IMPLEMENTATIONS
                and not self.config.is_encoder_decoder
                and _pageable(cache)
            ):
                paged = hf_paged.PagedCache(config=self.config.get_text_config(decoder=True))
                if getattr(generation_config, "is_assistant", False) and hasattr(paged, "activate_past_recording"):
                    paged.activate_past_recording()
                model_kwargs[key] = paged
                COUNTS["caches_swapped"] += 1
        return result

    return prepare


def _count(counter: str) -> None:
    # Not while torch.compile traces: dynamo would guard on the counter's value and recompile every call.
    if not torch.compiler.is_compiling():
        COUNTS[counter] += 1


def _counting_attention(original: Callable) -> Callable:
    @functools.wraps(original)
    def paged_attention(module, query, key, value, *args, **kwargs):
        _count("paged_attention")
        return original(module, query, key, value, *args, **kwargs)

    return paged_attention


def _counting_method(original: Callable, counter: str) -> Callable:
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        _count(counter)
        return original(self, *args, **kwargs)

    return method


def install() -> Callable[[], None]:
    """Applies the patches; returns the function that undoes them."""
    from transformers import AttentionInterface, PreTrainedModel  # noqa: PLC0415
    from transformers.generation.utils import GenerationMixin  # noqa: PLC0415

    hf_paged.register()
    saved = [
        (PreTrainedModel, "_check_and_adjust_attn_implementation"),
        (GenerationMixin, "_prepare_cache_for_generation"),
        (hf_paged.PagedCache, "attend"),
        (hf_paged.PagedCache, "update"),
    ]
    originals = [(owner, name, owner.__dict__.get(name, _INHERITED)) for owner, name in saved]
    PreTrainedModel._check_and_adjust_attn_implementation = _patch_check(
        PreTrainedModel._check_and_adjust_attn_implementation
    )
    GenerationMixin._prepare_cache_for_generation = _patch_prepare_cache(
        GenerationMixin._prepare_cache_for_generation
    )
    hf_paged.PagedCache.attend = _counting_method(hf_paged.PagedCache.attend, "paged_attend")
    hf_paged.PagedCache.update = _counting_method(hf_paged.PagedCache.update, "cache_updates")
    AttentionInterface.register(NAME, _counting_attention(_attention.paged_attention_forward))

    def undo() -> None:
        for owner, name, value in originals:
            if value is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        hf_paged.register()  # the uncounted attention function again

    return undo


@contextlib.contextmanager
def patched() -> Iterator[Counter[str]]:
    """The plugin's patches for the duration of a `with` block; yields `COUNTS` (cleared first)."""
    COUNTS.clear()
    undo = install()
    try:
        yield COUNTS
    finally:
        undo()


# ---------------------------------------------------------------------------------------------- pytest hooks
_state: dict[str, object] = {}


def pytest_configure(config) -> None:
    COUNTS.clear()
    _state["undo"] = install()
    _state["tests"] = []  # ids of tests during which the paged attention read a PagedCache


def pytest_unconfigure(config) -> None:
    undo = _state.pop("undo", None)
    if undo is not None:
        undo()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item) -> Iterator[None]:
    before = COUNTS["paged_attend"]
    yield
    if COUNTS["paged_attend"] > before:
        _state["tests"].append(item.nodeid)


def _summary() -> str:
    keys = ("attn_forced", "caches_swapped", "paged_attention", "paged_attend", "cache_updates")
    tests = len(_state.get("tests", []))
    return "hf-paged: " + ", ".join(f"{key}={COUNTS[key]}" for key in keys) + f", tests_on_paged_path={tests}"


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get("HF_PAGED_SUITE_COUNTS")
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"counts": dict(COUNTS), "tests_on_paged_path": _state.get("tests", [])}, fh, indent=1)
    if COUNTS["paged_attend"] == 0 and session.testscollected:
        session.exitstatus = 1  # the patches did not take: nothing ran through a PagedCache


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    terminalreporter.write_sep("=", "hf-paged plugin")
    terminalreporter.write_line(_summary())
    if COUNTS["paged_attend"] == 0:
        terminalreporter.write_line(
            "hf-paged: FAILED - the paged attention never read a PagedCache: the patches did not take effect."
        )
