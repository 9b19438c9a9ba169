"""Everything that differs between the transformers releases hf-paged supports, in one place.

Supported: transformers 5.20.0 up to the newest 5.x release we test (see `TESTED_RANGE`). Each
version branch below names the releases it serves; nothing else in hf-paged checks a version.
Every private transformers name hf-paged touches is listed in `PRIVATE_NAMES`; `check_private_names()`
reports the ones a release removed or changed (a test runs it on every supported release).

Facts per release (details: docs/transformers-versions.md):
- 5.20 - 5.23: `generate()` and model forwards take the cache as `past_key_values=`; outputs carry
  `.past_key_values`.
- 5.24 -: the keyword is `cache=` (`past_key_values=` still works, deprecated until 5.40); outputs carry
  `.cache`; `generate()` decides whether to slice a continued prompt by `not all(cache.is_linear)`,
  which walks `cache.layers`, so a cache must expose one layer object per layer.
- 5.25 -: recurrent layers call `cache.increase_count()` after stepping a convolution window in place, ask
  `cache.get_recurrent_states_to_keep()`, and `activate_past_recording()` takes `recurrent_states_to_keep=`;
  `Cache.get_seq_length` asks `layers[i]`. Assisted decoding no longer refuses stateful models up front, and
  recurrent layers record their past for a cache that asks (`RECURRENT_PAST`).
- 5.20 - 5.25: assisted decoding's first forward feeds the whole prompt, whatever the cache holds
  (`ASSISTED_REFEEDS_PROMPT`).
"""

from __future__ import annotations

import importlib
from typing import Any

import transformers
from packaging.version import Version
from transformers.utils import output_capturing as _output_capturing

TRANSFORMERS_VERSION = Version(transformers.__version__)

#: Lowest release whose Cache / AttentionInterface / masking APIs hf-paged works with, and the newest
#: release the suite has passed on.
TESTED_RANGE = ("5.20.0", "5.25.0")

# 5.24 renamed the cache keyword of generate() and every model forward (the old one is deprecated).
_CACHE_RENAMED = TRANSFORMERS_VERSION >= Version("5.24.0.dev0")

#: The keyword `generate()` and model forwards take the cache by, in the installed release.
CACHE_KWARG = "cache" if _CACHE_RENAMED else "past_key_values"

#: Releases whose recurrent layers record their past for a cache that asks (`is_recording_past`: no in-place step of
#: the convolution window, per-token states handed to `update_recurrent_state`), so that a hybrid model's
#: `PagedCache` can `crop()` (assisted decoding): 5.25 on.
RECURRENT_PAST = TRANSFORMERS_VERSION >= Version("5.25.0.dev0")

#: Releases on which the Engine takes requests with images (`engine/inputs.prompt_inputs`): checked on 5.23 to
#: 5.25; on 5.20 a request whose prefix hit its text beside another request's chunked image prefill got tokens other
#: than generate()'s (tests/test_engine_multimodal.py), so it is refused there.
ENGINE_IMAGES = TRANSFORMERS_VERSION >= Version("5.23.0")

#: Releases on which a prompt holding image placeholders may take a prefix hit (`cache/prefix_hits.load_prompt`):
#: on 5.20, Qwen2-VL continued a hit on the text before its image with other tokens than a cold run
#: (tests/test_vlm.py), so there such a prompt misses; checked on 5.23 to 5.25.
IMAGE_PROMPT_HITS = TRANSFORMERS_VERSION >= Version("5.23.0")


def _chunked_prefill_skips_cached_columns() -> bool:
    """Whether generate()'s chunked prefill (`prefill_chunk_size`) starts after the columns the cache holds
    (5.23 and later) rather than at the first column whatever the cache holds (5.20). Read from the
    prefill's source, since the change is not in a release note."""
    import inspect  # noqa: PLC0415

    from transformers.generation.utils import GenerationMixin  # noqa: PLC0415

    try:
        return "input_ids[:, -next_sequence_length:]" in inspect.getsource(GenerationMixin._prefill)
    except (OSError, TypeError):
        return True


#: False on releases whose chunked prefill feeds a pre-filled cache the whole prompt again, in chunks.
CHUNKED_PREFILL_SKIPS_CACHED_COLUMNS = _chunked_prefill_skips_cached_columns()


def _assisted_decoding_refeeds_prompt() -> bool:
    """Whether generate()'s assisted (and prompt-lookup) decoding feeds its first forward the whole prompt, whatever
    the cache holds (5.20 to 5.25): it slices its inputs by the cache only from its second forward on. Read from its
    source, as a fix would not be in a release note."""
    import inspect  # noqa: PLC0415

    from transformers.generation.utils import GenerationMixin  # noqa: PLC0415

    try:
        return "if not is_first_iteration else None" in inspect.getsource(GenerationMixin._assisted_decoding)
    except (OSError, TypeError, AttributeError):
        return False


#: True on releases whose assisted decoding feeds a cache that holds tokens the whole prompt again on its first
#: forward (after `cache.activate_past_recording()`), which transformers' own cache then stores twice.
ASSISTED_REFEEDS_PROMPT = _assisted_decoding_refeeds_prompt()


def forget_previous_positions(model: Any) -> None:
    """Drops the rotary position offset (`rope_deltas`) that a multimodal-rotary model (Qwen2-VL and its kind)
    keeps from its previous call. generate() positions a prompt that continues a cache by that offset, which is
    right only for the conversation that call ran; without one, it positions the whole prompt from its tokens."""
    for module in (model, getattr(model, "model", None)):
        if module is not None and getattr(module, "rope_deltas", None) is not None:
            module.rope_deltas = None


def cache_kwargs(cache: object) -> dict[str, Any]:
    """`{CACHE_KWARG: cache}`: pass a cache to `generate()` / a forward without a deprecation warning.

    >>> model.generate(**inputs, **hf_paged.cache_kwargs(hf_paged.PagedCache()), max_new_tokens=8)
    """
    return {CACHE_KWARG: cache}


def output_cache(outputs: Any) -> Any:
    """The cache a model forward returned (`.cache` from 5.24, `.past_key_values` before)."""
    return getattr(outputs, CACHE_KWARG)


#: Private (underscore) or internal transformers names hf-paged relies on: module, attribute path, and why.
PRIVATE_NAMES: tuple[tuple[str, str, str], ...] = (
    ("transformers", "AttentionInterface._global_mapping", "is_registered(): our function is the registered one"),
    (
        "transformers.masking_utils",
        "AttentionMaskInterface._global_mapping",
        "is_registered(): our mask function is the registered one",
    ),
    ("transformers.cache_utils", "get_layer_types_and_kwargs", "which layers are sliding / dummy / linear"),
    ("transformers.cache_utils", "CacheLayerMixin", "PagedCache.layers are real layer objects"),
    ("transformers.cache_utils", "Cache.is_linear", "generate() slices continued prompts through it (5.24)"),
    (
        "transformers.models.auto.modeling_auto",
        "MODEL_FOR_CAUSAL_LM_MAPPING",
        "a model class that keeps its own recurrent state is refused",
    ),
    (
        "transformers.generation.utils",
        "GenerationMixin._supports_default_dynamic_cache",
        "a model class that keeps its own recurrent state is refused",
    ),
    (
        "transformers.generation.utils",
        "GenerationMixin._prepare_cache_for_generation",
        "the transformers-suite plugin makes generate() build a PagedCache there",
    ),
    (
        "transformers.generation.utils",
        "GenerationMixin._prefill",
        "CHUNKED_PREFILL_SKIPS_CACHED_COLUMNS is read from its source",
    ),
    (
        "transformers.generation.utils",
        "GenerationMixin._assisted_decoding",
        "ASSISTED_REFEEDS_PROMPT is read from its source",
    ),
    (
        "transformers.generation.utils",
        "GenerationMixin._get_logits_processor",
        "Engine builds each request's processors (penalties, min_new_tokens, temperature/top-k/top-p) as generate() does",
    ),
    *(
        ("transformers.generation.utils", f"GenerationMixin.{name}", "Engine prepares each request's config as generate() does")
        for name in (
            "_prepare_generation_config", "_prepare_special_tokens", "_prepare_generated_length",
            "_validate_generated_length", "_get_stopping_criteria",
        )
    ),
    (
        "transformers.utils.output_capturing",
        "_active_collector",
        "'paged' returns attention weights when the forward records them (compat.attentions_recorded)",
    ),
    (
        "transformers.modeling_utils",
        "PreTrainedModel.get_correct_attn_implementation",
        "loading a model with attention code of its own under 'paged' raises UnsupportedModelError there (support.py)",
    ),
    (
        "transformers.modeling_utils",
        "PreTrainedModel._can_set_attn_implementation",
        "transformers' own finding that a model class runs attention modules of its own (support.runs_own_attention)",
    ),
    (
        "transformers.modeling_utils",
        "PreTrainedModel._check_and_adjust_attn_implementation",
        "the transformers-suite plugin forces attn_implementation='paged' there",
    ),
)


def attentions_recorded() -> bool:
    """Whether the model forward in progress records attention weights: transformers' output capturing
    (`capture_outputs`, 5.20 -) collects `attentions` from hooks on the attention modules. A model whose
    attention module takes `output_attentions` as a parameter of its own (OPT, GPT-2, ...) does not pass it on
    to the attention function, so this is how `"paged"` learns that its weights are wanted, as eager's always are."""
    collected = _output_capturing._active_collector.get()
    return collected is not None and "attentions" in collected


def attn_implementation(config: Any) -> str | None:
    """`config._attn_implementation`, read once per forward. Releases 5.20 - 5.25 keep it in the instance's
    `_attn_implementation_internal`: read from the instance's `__dict__`, not through the property and
    transformers' config attribute machinery (several times slower). A release that stops keeping it there is read
    the slow way."""
    found = object.__getattribute__(config, "__dict__").get("_attn_implementation_internal", _ABSENT)
    return getattr(config, "_attn_implementation", None) if found is _ABSENT else found


_ABSENT = object()


def check_private_names() -> list[str]:
    """The entries of `PRIVATE_NAMES` missing from the installed transformers, as readable messages."""
    missing = []
    for module_name, path, why in PRIVATE_NAMES:
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError as exc:
            missing.append(f"{module_name} (cannot import: {exc}; needed for: {why})")
            continue
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                missing.append(
                    f"{module_name}.{path} is gone in transformers {transformers.__version__} (needed for: {why})"
                )
                break
    return missing
