"""Which layers of a model store K/V in which block group, read from its config.

Layers of the same attention type share block ids: one block table per sequence serves all of them.
Each distinct window (None for full attention) forms a group, numbered in order of first appearance;
sliding-window groups free blocks that fall out of the window.

Hybrid models (transformers' layer types `linear_attention`, `conv`, `hybrid`, `hybrid_sliding`) also have
recurrent layers: their state (convolution window, SSM / linear-attention state) lives in a state slot per
sequence (`memory/state_slots.py`), not in blocks. A `hybrid` / `hybrid_sliding` layer has both: a state and K/V in
the full / sliding group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from ..errors import UnsupportedModelError
from ..support import check_model_class, shared_kv_layers

#: Layer types whose attention goes through `AttentionInterface` with a plain causal (optionally
#: windowed) pattern over the whole sequence.
_SUPPORTED = {"full_attention", "sliding_attention"}
#: Recurrent layers (transformers' `LinearAttentionLayer`): a state slot per sequence, no K/V.
_STATE_ONLY = {"linear_attention", "conv"}
#: Layers with a recurrent state and softmax attention (transformers' `LinearAttentionAnd...Layer`), and the
#: attention type of their K/V.
_STATE_AND_ATTENTION = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
#: Layers that keep no cache of their own (KV shared from another layer, MLP/MoE-only layers).
_NO_STORAGE = {"dummy"}


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers sharing block ids.

    Attributes:
        group_id: index of the group.
        sliding_window: window of the group's layers, None for full attention.
    """

    group_id: int
    sliding_window: int | None


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """Maps layer indices to groups.

    Attributes:
        groups: every group, indexed by group id.
        layer_to_group: layer index -> group id; layers missing here keep no cache.
        num_layers: number of layers that store K/V (None when learned lazily, without a config).
        state_layers: layers with a recurrent state (a state slot per sequence), in order; empty for
            attention-only models and for layouts learned without a config.
        num_model_layers: all decoder layers of the config (0 without a config).
        readers: layers that keep no K/V and attend over an earlier layer's (Gemma 3n's and Gemma 4's
            `num_kv_shared_layers`): reading layer -> the layer whose K/V it reads.
    """

    groups: tuple[LayerGroup, ...]
    layer_to_group: dict[int, int]
    num_layers: int | None
    state_layers: tuple[int, ...] = ()
    num_model_layers: int = 0
    readers: dict[int, int] = field(default_factory=dict)

    @property
    def attending_layers(self) -> int | None:
        """Layers whose `"paged"` attention goes through the cache in a forward: those that store K/V and those that
        read another layer's (`readers`); None when learned lazily."""
        return None if self.num_layers is None else self.num_layers + len(self.readers)

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer keeps a recurrent state."""
        return bool(self.state_layers)

    def group_of(self, layer_idx: int) -> int:
        if self.num_layers is None:  # no config: every layer is full attention
            return 0
        try:
            return self.layer_to_group[layer_idx]
        except KeyError:
            what = (
                "keeps a recurrent state, not K/V"
                if layer_idx in self.state_layers
                else ("does not keep a KV cache of its own (it reuses another layer's K/V)")
            )
            raise UnsupportedModelError(
                f"Layer {layer_idx} {what} in this model's config, yet it called `update()`."
            ) from None


DEFAULT_LAYOUT = LayerLayout(groups=(LayerGroup(0, None),), layer_to_group={}, num_layers=None)


def text_config_of(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config of a (possibly multimodal) model config. An encoder-decoder config with flat
    attributes (BART, Whisper, T5, ...) is its own: transformers' decoder view of it is a new copy per call, which
    would not follow the model's attention implementation."""
    if getattr(config, "is_encoder_decoder", False) and not _has_sub_config(config):
        return config
    return config.get_text_config(decoder=True)


def _has_sub_config(config: PretrainedConfig) -> bool:
    return any(getattr(config, name, None) is not None for name in ("decoder", "generator", "text_config"))


def decoder_layer_types(config: PretrainedConfig) -> list[str]:
    """The layer types of the layers that keep a self-attention cache: an encoder-decoder's decoder layers
    (`decoder_layers` / `num_decoder_layers`, all full attention: cross-attention K/V are not paged), every layer of a
    decoder-only model."""
    if getattr(config, "is_encoder_decoder", False) and not _has_sub_config(config):
        for name in ("decoder_layers", "num_decoder_layers"):
            count = getattr(config, name, None)
            if isinstance(count, int):
                return ["full_attention"] * count
        return ["full_attention"] * config.get_text_config(decoder=True).num_hidden_layers
    layer_types, _ = get_layer_types_and_kwargs(config)
    return list(layer_types)


def layout_from_config(config: PretrainedConfig) -> LayerLayout:
    """Reads the layer layout of a model config: a decoder-only model's layers, or an encoder-decoder model's
    decoder self-attention layers (the cross-attention K/V live in `cache/cross.py`'s `CrossAttentionCache`).

    Raises:
        UnsupportedModelError: for layer types a paged cache cannot serve (linear attention / SSM, chunked
            attention, compressed attention, ...).
    """
    text_config = text_config_of(config)
    check_model_class(text_config)
    layer_types = decoder_layer_types(text_config)
    known = _SUPPORTED | _NO_STORAGE | _STATE_ONLY | set(_STATE_AND_ATTENTION)
    unsupported = sorted({t for t in layer_types if t not in known})
    if unsupported:
        raise UnsupportedModelError(
            f"Model type {text_config.model_type!r} has layers of type {unsupported}, which a paged KV cache "
            "cannot serve (full and sliding-window softmax attention are paged, recurrent layers get state "
            "slots). Use the default DynamicCache and attn_implementation='sdpa' for this model."
        )
    state_layers = tuple(i for i, t in enumerate(layer_types) if t in _STATE_ONLY or t in _STATE_AND_ATTENTION)
    windows: list[int | None] = []
    layer_to_group: dict[int, int] = {}
    for layer_idx, layer_type in enumerate(layer_types):
        layer_type = _STATE_AND_ATTENTION.get(layer_type, layer_type)
        if layer_type in _NO_STORAGE or layer_type in _STATE_ONLY:
            continue
        window = None
        if layer_type == "sliding_attention":
            window = getattr(text_config, "sliding_window", None)
        if window not in windows:
            windows.append(window)
        layer_to_group[layer_idx] = windows.index(window)
    if not windows:
        what = (
            "only recurrent (state-space / linear-attention) layers"
            if state_layers
            else "no layer that keeps a KV cache"
        )
        raise UnsupportedModelError(
            f"Model type {text_config.model_type!r} has {what}: PagedCache pages softmax-attention K/V and serves "
            "hybrid models (attention + recurrent layers), not pure state-space models. Use the model's default "
            "cache (omit past_key_values) for it."
        )
    groups = tuple(LayerGroup(i, w) for i, w in enumerate(windows))
    return LayerLayout(
        groups=groups,
        layer_to_group=layer_to_group,
        num_layers=len(layer_to_group),
        state_layers=state_layers,
        num_model_layers=len(layer_types),
        readers=kv_readers(text_config),
    )


def kv_readers(config: PretrainedConfig) -> dict[int, int]:
    """Layers that reuse an earlier layer's K/V, each with that layer: as the config's `kv_sharing_modes` says (a
    "reuse" layer reads the "store" layer of its own type), or, on releases without them, the last
    `num_kv_shared_layers` layers each read the last earlier layer of their type (what Gemma 3n and Gemma 4 hand
    them). Empty for every other model.

    Raises:
        UnsupportedModelError: a sharing mode other than "reuse" / "store", or a reusing layer with no layer to read.
    """
    num_layers = getattr(config, "num_hidden_layers", 0)
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
    modes = getattr(config, "kv_sharing_modes", None)
    shared = shared_kv_layers(config)
    if modes is None:
        if not shared or shared >= num_layers:
            return {}
        first = num_layers - shared
        modes = [None] * first + ["reuse"] * shared
        for layer_type in set(layer_types[first:]):
            earlier = [i for i in range(first) if layer_types[i] == layer_type]
            if earlier:
                modes[earlier[-1]] = "store"
    unknown = sorted({m for m in modes if m not in (None, "reuse", "store")})
    readers: dict[int, int] = {}
    for layer_idx, mode in enumerate(modes):
        sources = [i for i, m in enumerate(modes[:layer_idx]) if m == "store" and layer_types[i] == layer_types[layer_idx]]
        if unknown or (mode == "reuse" and not sources):
            raise UnsupportedModelError(
                f"Model type {config.model_type!r}: layer {layer_idx} shares K/V in a way a paged cache does not "
                f"serve (sharing modes {sorted({str(m) for m in modes})}). Use the default cache for this model."
            )
        if mode == "reuse":
            readers[layer_idx] = sources[-1]
    return readers
