"""Which models a paged KV cache can serve, and the clear errors for those it cannot.

A model is served when its decoder layers keep softmax-attention K/V through `Cache.update()` (full or
sliding-window attention; K and V may have widths of their own, as in multi-latent attention), beside, in
hybrid models, recurrent layers whose states go through transformers' linear-attention cache API (state
slots, `cache/recurrent.py`), and causal masks with bidirectional blocks (Gemma 3's images: the model's own mask,
applied as given). Models that keep a state of their own outside the `Cache` (RWKV, xLSTM, ...), pure state-space
models, non-causal (encoder) attention, and an encoder-decoder model given a plain `PagedCache` (it takes an
`EncoderDecoderPagedCache`) get an `UnsupportedModelError` that names the model type and what to use instead.

Multi-latent attention (DeepSeek V2/V3 and relatives, `reads_gathered`): transformers' modules hand
`update()` the compressed latents (`kv_lora_rank` wide, and the `qk_rope_head_dim` wide rotary key: one
"KV head" each, unequal widths) and expand them into per-head K (`qk_nope_head_dim + qk_rope_head_dim`) and
V (`v_head_dim`) after the cache returns them. The blocks store the latents; the model reads them
gathered and `"paged"` attends the expanded K/V it is given (output `[batch, q_len, num_heads, v_head_dim]`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from .errors import UnsupportedModelError

#: The attention implementation's name (registered by `attention.register`).
PAGED = "paged"
ALTERNATIVE = "Use the model's default cache (omit past_key_values) and attn_implementation='sdpa' for it."


#: Hybrid model types whose recurrent layers start every forward of more than one token from zero states (Mamba's
#: full-sequence scan in transformers takes no initial state; with transformers' own `DynamicCache` too), so a
#: forward after a prefix computed in another one differs from computing the prompt at once: their prompts are never
#: split for state snapshots nor served from them, and the Engine prefills each in one forward.
RESTARTS_STATES_PER_FORWARD = frozenset({"jamba", "zamba"})


def resumes_recurrent_states(config: PretrainedConfig | None) -> bool:
    """Whether a hybrid model's multi-token forward continues from the recurrent states a cache holds (what a
    prefix hit restored); False for `RESTARTS_STATES_PER_FORWARD` and unknown configs."""
    return config is not None and getattr(config, "model_type", None) not in RESTARTS_STATES_PER_FORWARD


def model_type_of(config: PretrainedConfig | None) -> str:
    return repr(getattr(config, "model_type", None) or "unknown")


def check_model_class(config: PretrainedConfig) -> None:
    """Raises for model types whose causal-LM class keeps a state of its own instead of a `Cache`
    (RWKV, xLSTM, MiniMax lightning attention, Reformer, XLNet, ...)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING  # noqa: PLC0415

        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:  # noqa: BLE001 - unknown/custom configs are judged by their layers
        return
    supports = getattr(model_class, "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        raise UnsupportedModelError(
            f"Model type {model_type_of(config)} ({model_class.__name__}) keeps a recurrent or custom state of its "
            f"own instead of a KV cache, so PagedCache cannot serve it. {ALTERNATIVE}"
        )


#: Model types whose attention does not go through transformers' AttentionInterface, so that
#: `attn_implementation="paged"` cannot run it (found by the coverage matrix and transformers' own generate
#: tests): they pick attention classes from a table of their own (gpt_neo, falcon, git: a `KeyError: 'paged'`
#: in their `__init__` without this check) or apply the mask themselves (bigbird_pegasus: its encoder's block-sparse
#: and full attention; doge: its dynamic mask indexes the mask it is given as 4D). Model classes that transformers itself
#: finds running attention modules of their own are refused too (`runs_own_attention`). A PagedCache still
#: serves the listed ones under "sdpa"/"eager" (gathering).
OWN_ATTENTION = frozenset({"bigbird_pegasus", "bloom", "codegen", "doge", "falcon", "git", "gpt_neo", "gptj", "xglm"})


def runs_own_attention(model_class: type, config: PretrainedConfig | None) -> bool:
    """Whether `model_class` (with `config`) runs attention code of its own instead of the function registered
    under its attention implementation: its model type is one of `OWN_ATTENTION`, or transformers' own check
    (`_can_set_attn_implementation`: an `nn.Module` attention class that never asks `AttentionInterface`) says
    so of a class that does not declare attention-backend support."""
    if getattr(config, "model_type", None) in OWN_ATTENTION:
        return True
    can_set = getattr(model_class, "_can_set_attn_implementation", None)
    try:
        dispatches = bool(can_set()) if can_set is not None else True
    except Exception:  # noqa: BLE001 - a custom class whose source cannot be read: judged by its flag alone
        dispatches = False
    return not dispatches and not getattr(model_class, "_supports_attention_backend", False)


def own_attention_error(
    model_type: object, class_name: str | None = None, takes_cache: bool = True
) -> UnsupportedModelError:
    """The error for a model that `runs_own_attention`; `takes_cache` False for a model whose forward takes no
    KV cache at all (a paged cache has nothing to offer it)."""
    who = f"Model type {model_type!r}" + (f" ({class_name})" if class_name else "")
    if not takes_cache:
        return UnsupportedModelError(
            f"{who} runs attention code of its own and takes no transformers Cache (its forward has no "
            "past_key_values), so neither attn_implementation='paged' nor a hf_paged.PagedCache can serve it. "
            "Load it without attn_implementation='paged'."
        )
    return UnsupportedModelError(
        f"{who} runs attention code of its own instead of transformers' AttentionInterface, so "
        "attn_implementation='paged' cannot serve it. Load it with attn_implementation='eager' (or 'sdpa' where the "
        "model supports it): a hf_paged.PagedCache() still stores its K/V in blocks and returns them gathered, or "
        "use the default cache."
    )


def _takes_cache(model_class: type) -> bool:
    """Whether `model_class.forward` names a KV cache argument (`past_key_values` or `cache`)."""
    try:
        parameters = inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError):  # a forward whose signature cannot be read: assumed to take one
        return True
    return bool({"past_key_values", "cache"} & set(parameters))


def shared_kv_layers(config: PretrainedConfig | None) -> int:
    """How many layers attend over the K/V of an earlier layer instead of their own (Gemma 3n's and Gemma 4's
    `num_kv_shared_layers`: the model hands them what the earlier layer's `cache.update()` returned)."""
    count = getattr(config, "num_kv_shared_layers", None)
    return count if isinstance(count, int) and count > 0 else 0


def shares_kv(config: PretrainedConfig | None) -> bool:
    """Whether some layers of the model reuse an earlier layer's K/V (`shared_kv_layers`)."""
    return shared_kv_layers(config) > 0


def check_attention_interface(config: PretrainedConfig | None) -> None:
    """Raises for model types whose own attention code cannot run `"paged"` (see `OWN_ATTENTION`): the first
    forward's check, for a model whose config was switched to `"paged"` without the load-time check
    (`refuse_own_attention`)."""
    model_type = getattr(config, "model_type", None)
    if model_type in OWN_ATTENTION:
        raise own_attention_error(model_type)


def refuse_own_attention(get_correct: Callable[..., str]) -> Callable[..., str]:
    """Wraps `PreTrainedModel.get_correct_attn_implementation` (every model's `__init__` and
    `set_attn_implementation` pass it) so that choosing `"paged"` for a model that `runs_own_attention` raises
    `UnsupportedModelError` there, at `from_pretrained` / `from_config`, before the model's own `__init__` looks
    `"paged"` up in a table of its own. Every other choice is transformers' own."""

    @functools.wraps(get_correct)
    def get_correct_attn_implementation(self, requested_attention: str | None, *args: object, **kwargs: object) -> str:
        chosen = get_correct(self, requested_attention, *args, **kwargs)
        config = getattr(self, "config", None)
        if chosen == PAGED and runs_own_attention(type(self), config):
            raise own_attention_error(
                getattr(self.config, "model_type", None) or "unknown", type(self).__name__, _takes_cache(type(self))
            )
        return chosen

    get_correct_attn_implementation.__hf_paged_wraps__ = get_correct
    return get_correct_attn_implementation


def install_load_check() -> None:
    """Installs `refuse_own_attention` on `PreTrainedModel` once (idempotent)."""
    from transformers import PreTrainedModel  # noqa: PLC0415

    current = PreTrainedModel.__dict__["get_correct_attn_implementation"]
    if not hasattr(current, "__hf_paged_wraps__"):
        PreTrainedModel.get_correct_attn_implementation = refuse_own_attention(current)


@dataclass(frozen=True, slots=True)
class LayerFacts:
    """What the `"paged"` attention needs to know of an attention module beyond its call arguments: read once per
    module and config (`layer_facts`), so that a call reads fields rather than the module's and config's attributes
    (transformers' configs resolve every attribute through their own machinery, and a module's missing attribute
    costs an exception). transformers sets all of them when it builds the module.

    Attributes:
        config: the config the facts were read from (a module given another config is read again).
        layer_idx: the module's `layer_idx`, or None.
        window: the layer's sliding window according to the config's layer types (what the model's own mask
            applies), or None. Used when a model applies its window only through the mask.
        has_sinks: the module has a `sinks` attribute (per-head attention-sink logits).
        causal: the module is causal (`is_causal` is not False).
        reuses_kv: the layer attends over an earlier layer's K/V (`is_kv_shared_layer`: Gemma 3n, Gemma 4).
        keeps_kv_for_readers: later layers reuse this layer's K/V (`store_full_length_kv` in a model that shares).
        shares_kv: some layers of the model reuse an earlier layer's K/V (`shares_kv`).
        reads_gathered: the model transforms what its cache returns before attending it (`reads_gathered`).
        cross_attention_follows: the model's decoder layers have a cross-attention after their self-attention.
        plain_self_attention: causal, and none of the above that changes how its staged K/V are attended (no K/V
            reused or kept for reusing layers, no gathered read, no cross-attention after it): such a layer's call
            with no sinks, soft-capping, weights or 4D mask goes straight to the cache (`paged_attention_forward`).
    """

    config: object
    layer_idx: int | None
    window: int | None
    has_sinks: bool
    causal: bool
    reuses_kv: bool
    keeps_kv_for_readers: bool
    shares_kv: bool
    reads_gathered: bool
    cross_attention_follows: bool
    plain_self_attention: bool


def layer_facts(module: torch.nn.Module) -> LayerFacts:
    """The `LayerFacts` of an attention module, cached on the module."""
    config = getattr(module, "config", None)
    facts = module.__dict__.get("_hf_paged_facts")
    if facts is not None and facts.config is config:
        return facts
    window = None
    layer_idx = getattr(module, "layer_idx", None)
    if config is not None and layer_idx is not None:
        try:
            text_config = config.get_text_config(decoder=True)
            layer_types, _ = get_layer_types_and_kwargs(text_config)
            size = getattr(text_config, "sliding_window", None)
        except Exception:  # noqa: BLE001 - configs without layer information: no window
            layer_types, size = [], None
        if 0 <= layer_idx < len(layer_types) and layer_types[layer_idx] in ("sliding_attention", "hybrid_sliding"):
            window = size
    sharing = shares_kv(config)
    causal = getattr(module, "is_causal", True) is not False
    reuses_kv = bool(getattr(module, "is_kv_shared_layer", False))
    keeps_kv_for_readers = bool(getattr(module, "store_full_length_kv", False)) and sharing
    gathered = reads_gathered(config)
    cross_attention_follows = bool(
        getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False)
    )
    facts = LayerFacts(
        config=config,
        layer_idx=layer_idx,
        window=window,
        has_sinks=hasattr(module, "sinks"),
        causal=causal,
        reuses_kv=reuses_kv,
        keeps_kv_for_readers=keeps_kv_for_readers,
        shares_kv=sharing,
        reads_gathered=gathered,
        cross_attention_follows=cross_attention_follows,
        plain_self_attention=causal and not (reuses_kv or keeps_kv_for_readers or gathered or cross_attention_follows),
    )
    module.__dict__["_hf_paged_facts"] = facts
    return facts


#: Model types whose attention modules change the K/V that `Cache.update()` returns before attending them, other
#: than multi-latent attention (recognised by its config): JetMoE repeats them once per selected expert; T5 and its
#: relatives size their relative position bias by the length of the keys `update()` returns (all of them).
CHANGES_RETURNED_KV = frozenset({"jetmoe", "t5", "mt5", "umt5", "longt5", "switch_transformers", "pop2piano", "udop"})


def reads_gathered(config: PretrainedConfig | None) -> bool:
    """Whether the model's attention transforms what `Cache.update()` returns before attending it, so that
    a `PagedCache` must hand it the gathered history (the "gather" path) even under `"paged"`.

    True for multi-latent attention configs (a `kv_lora_rank`): their modules cache compressed latents and
    expand them into K/V after `update()`; and for `CHANGES_RETURNED_KV`. Choosing the gather path for a model that would not need it is
    only slower, never wrong; a model that needs it and is not named here is recognised on the first
    forward of a `PagedCache()` made without `config=` (see `attention.paged_attention_forward`).
    """
    if config is None:
        return False
    try:
        text_config = config.get_text_config(decoder=True)
    except Exception:  # noqa: BLE001 - configs without sub-configs
        text_config = config
    return getattr(text_config, "kv_lora_rank", None) is not None or text_config.model_type in CHANGES_RETURNED_KV


def encoder_decoder_error(config: PretrainedConfig | None) -> UnsupportedModelError:
    """A `PagedCache` alone given to an encoder-decoder model (generate() would hand it the cross-attention K/V)."""
    return UnsupportedModelError(
        f"Model type {model_type_of(config)} is an encoder-decoder model: a PagedCache alone would receive its "
        "cross-attention K/V too. Pass hf_paged.EncoderDecoderPagedCache(model.config) as the cache (decoder "
        "self-attention paged, cross-attention K/V stored once per request), or use the default cache."
    )


def not_causal_error(module: torch.nn.Module) -> UnsupportedModelError:
    config = getattr(module, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return encoder_decoder_error(config)
    if getattr(config, "use_bidirectional_attention", False):  # a language model whose prompt is one block
        return UnsupportedModelError(
            f"Model type {model_type_of(config)} runs {type(module).__name__} without causality, and its mask does "
            "not say which tokens its prompt shows each token. For PaliGemma, pass the processor's token_type_ids "
            f"(they mark the prompt as one bidirectional block), or {ALTERNATIVE[0].lower()}{ALTERNATIVE[1:]}"
        )
    return UnsupportedModelError(
        f"Model type {model_type_of(getattr(module, 'config', None))} runs {type(module).__name__} with bidirectional "
        "(non-causal) attention, which a KV cache of earlier tokens cannot reproduce. Load it as a decoder "
        f"(is_decoder=True) if it has one, or {ALTERNATIVE[0].lower()}{ALTERNATIVE[1:]}"
    )


def future_mask_error(config: PretrainedConfig | None) -> UnsupportedModelError:
    """The Engine's error for a packed forward in which the model builds a mask that lets some tokens attend later ones:
    its packed steps attend causally by positions, apart from the images' runs it masks itself (`engine/media.py`)."""
    return UnsupportedModelError(
        f"Model type {model_type_of(config)} builds a mask inside the Engine's packed step that lets tokens attend to "
        "later ones, which the packed steps, causal by positions apart from an image's tokens, do not reproduce. "
        "Run such prompts with model.generate(**inputs, **hf_paged.cache_kwargs(pool.new_cache(**inputs, "
        "model=model))), which applies the model's own mask."
    )


class UnsupportedStateMixin:
    """`Cache.update_indexer` (indexer layers, e.g. DeepSeek V3.2's sparse attention): a paged cache has no
    indexer cache, so a model calling it gets a clear error instead of an IndexError deep in transformers.
    (Recurrent / linear-attention states are served: `cache/recurrent.py`.)"""

    model_config: PretrainedConfig | None

    def update_indexer(self, *args: object, **kwargs: object) -> torch.Tensor:
        who = f"Model type {model_type_of(self.model_config)}" if self.model_config is not None else "This model"
        raise UnsupportedModelError(
            f"{who} asked the cache for an indexer cache: it has indexer layers, which PagedCache cannot serve "
            f"(full and sliding-window softmax attention are paged, recurrent layers get state slots). {ALTERNATIVE} "
            "(PagedCache(config=model.config) names the model type and raises this at construction.)"
        )


#: Config attributes naming the token ids that stand for non-text input (an image, a video frame, audio) in a
#: vision-language or audio-language model's prompts; the model replaces their embeddings with the encoder's output.
PLACEHOLDER_ATTRIBUTES = (
    "image_token_id", "image_token_index", "video_token_id", "video_token_index", "audio_token_id",
    "audio_token_index",
)

#: Model types whose generate() takes a prefix hit that covers every placeholder of a prompt when the non-text
#: inputs are left out of that call (`PagedCache.uncached_inputs`), with the tokens of a cold run
#: (tests/test_vlm.py). Other models' prompts hit only up to the block holding their first placeholder: e.g.
#: qwen2_vl, whose generate() positions the tokens after a cached image by `rope_deltas` kept on the model from
#: its previous call, which may have been another request's.
HITS_OVER_PLACEHOLDERS = frozenset({"llava", "llava_next", "mistral3", "idefics3", "smolvlm"})


#: Model types whose masks let an image's tokens (or PaliGemma's prefix) attend to later ones: served by `generate()`
#: (the `"paged"` attention applies their own mask), refused by the Engine when a request brings images.
BIDIRECTIONAL_IMAGES = frozenset({"gemma3", "paligemma"})


def attends_images_bidirectionally(config: PretrainedConfig | None) -> bool:
    """Whether the model attends bidirectionally over its images' tokens: `BIDIRECTIONAL_IMAGES`, or a language
    model configured so (Gemma 4's `use_bidirectional_attention="vision"`)."""
    if getattr(config, "model_type", None) in BIDIRECTIONAL_IMAGES:
        return True
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    return getattr(text, "use_bidirectional_attention", None) == "vision"


def placeholder_token_ids(config: PretrainedConfig | None) -> frozenset[int]:
    """The token ids `config` names as placeholders of non-text input (`PLACEHOLDER_ATTRIBUTES`); empty for a
    text-only config, or None."""
    ids = (getattr(config, name, None) for name in PLACEHOLDER_ATTRIBUTES) if config is not None else ()
    return frozenset(i for i in ids if isinstance(i, int) and i >= 0)


#: Model types whose prompt tokens all attend each other (PaliGemma's prefix: image and text): no token's K/V can be
#: reused under another continuation of the prompt, so their prompts take no prefix hit.
BIDIRECTIONAL_PREFIX = frozenset({"paligemma"})


def attends_prefix_bidirectionally(config: PretrainedConfig | None) -> bool:
    """Whether every token of the model's prompts attends later prompt tokens (`BIDIRECTIONAL_PREFIX`)."""
    return getattr(config, "model_type", None) in BIDIRECTIONAL_PREFIX


def hits_over_placeholders(config: PretrainedConfig | None) -> bool:
    """Whether a prefix hit may cover a prompt's placeholders (`HITS_OVER_PLACEHOLDERS`)."""
    return getattr(config, "model_type", None) in HITS_OVER_PLACEHOLDERS
