"""Which layers of a model store K/V in which block group, read from its config.

Layers of the same attention type share block ids: one block table per sequence serves all of them.
Each distinct window (None for full attention) forms a group, numbered in order of first appearance;
sliding-window groups free blocks that fall out of the window.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from ..errors import UnsupportedModelError
from ..support import check_model_class

#: Layer types whose attention goes through `AttentionInterface` with a plain causal (optionally
#: windowed) pattern over the whole sequence.
_SUPPORTED = {"full_attention", "sliding_attention"}
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
    """

    groups: tuple[LayerGroup, ...]
    layer_to_group: dict[int, int]
    num_layers: int | None

    def group_of(self, layer_idx: int) -> int:
        if self.num_layers is None:  # no config: every layer is full attention
            return 0
        try:
            return self.layer_to_group[layer_idx]
        except KeyError:
            raise UnsupportedModelError(
                f"Layer {layer_idx} does not keep a KV cache of its own in this model's config "
                "(it reuses another layer's K/V), yet it called `update()`."
            ) from None


DEFAULT_LAYOUT = LayerLayout(groups=(LayerGroup(0, None),), layer_to_group={}, num_layers=None)


def text_config_of(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config of a (possibly multimodal) model config."""
    return config.get_text_config(decoder=True)


def layout_from_config(config: PretrainedConfig) -> LayerLayout:
    """Reads the layer layout of a decoder-only model config.

    Raises:
        UnsupportedModelError: for encoder-decoder models and layer types a paged cache cannot serve
            (linear attention / SSM, chunked attention, compressed attention, ...).
    """
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"Model type {config.model_type!r} is an encoder-decoder model; PagedCache serves decoder-only "
            "models. Use the default cache (EncoderDecoderCache) for it."
        )
    text_config = text_config_of(config)
    check_model_class(text_config)
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    unsupported = sorted({t for t in layer_types if t not in _SUPPORTED | _NO_STORAGE})
    if unsupported:
        raise UnsupportedModelError(
            f"Model type {text_config.model_type!r} has layers of type {unsupported}, which a paged KV cache "
            "cannot serve (only full and sliding-window softmax attention are paged). Use the default "
            "DynamicCache and attn_implementation='sdpa' for this model."
        )
    windows: list[int | None] = []
    layer_to_group: dict[int, int] = {}
    for layer_idx, layer_type in enumerate(layer_types):
        if layer_type in _NO_STORAGE:
            continue
        window = None
        if layer_type == "sliding_attention":
            window = getattr(text_config, "sliding_window", None)
        if window not in windows:
            windows.append(window)
        layer_to_group[layer_idx] = windows.index(window)
    if not windows:
        raise UnsupportedModelError(f"Model type {text_config.model_type!r} has no layer that keeps a KV cache.")
    groups = tuple(LayerGroup(i, w) for i, w in enumerate(windows))
    return LayerLayout(groups=groups, layer_to_group=layer_to_group, num_layers=len(layer_to_group))
