"""`AttentionMode`: which attention reads a cache, and the first layer's K/V held back until that is known.

`"paged"`: the `"paged"` attention function writes each layer's new K/V and reads history through the block
tables. `"gather"`: another attention implementation reads what `update()` returns, so `update()` writes and
returns gathered K/V. A cache made with a config knows from `config._attn_implementation`; one made without
learns it on its first forward: `update()` of the first layer holds its K/V back (`hold`) and hands over
history + new K/V; the `"paged"` attention takes them (`take`, and the cache is `"paged"` from then on), any
other attention leaves them and the cache stores them the plain way (`release`) on its next call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from ..compat import attn_implementation
from ..memory.layers import text_config_of
from ..support import reads_gathered


@dataclass(slots=True)
class Pending:
    """New K/V `[batch, num_kv_heads, q_len, head_dim]` of the first layer of a first forward, not stored yet."""

    layer_idx: int
    key: torch.Tensor
    value: torch.Tensor


class AttentionMode:
    """Owns a cache's mode, the config that decides it, and the held-back first-layer K/V.

    Attributes:
        model_config: the config whose `_attn_implementation` tells which attention reads the cache (given
            to the cache, or learned from the model by the `"paged"` attention); of a vision-language model,
            its language model's (`text_config`), which attends through the cache.
        mode: `"paged"`, `"gather"`, or None before it is known.
    """

    def __init__(self, config: PretrainedConfig | None) -> None:
        self.model_config = text_config_of(config) if config is not None else None
        self.mode: str | None = None
        self._pending: Pending | None = None
        self._gathered_of: tuple[PretrainedConfig, bool] | None = None

    def for_update(self, columns_stored: int) -> str | None:
        """The mode of a layer's `update()`: the config's attention decides; `"gather"` stays once padding
        was stored the plain way (`columns_stored` > 0); None while unknown."""
        config = self.model_config
        impl = attn_implementation(config) if config is not None else None
        if impl is None:
            return self.mode
        if impl == "paged":
            if self.mode == "gather" and columns_stored:
                return "gather"  # padding was stored: keep the plain path (paged attention reads it gathered)
            if self._reads_gathered(config):  # multi-latent attention: the model expands the latents update() returns
                self.mode = "gather"
                return "gather"
            return "paged"
        self.mode = "gather"
        return "gather"

    def _reads_gathered(self, config: PretrainedConfig) -> bool:
        """`support.reads_gathered(config)`, read once per config."""
        if self._gathered_of is None or self._gathered_of[0] is not config:
            self._gathered_of = (config, reads_gathered(config))
        return self._gathered_of[1]

    def learn(self, config: PretrainedConfig | None) -> bool:
        """Adopts the model's config if the cache had none; returns whether it did."""
        if config is None or self.model_config is not None:
            return False
        self.model_config = config
        return True

    def must_hold(self, forward_open: bool) -> bool:
        """Whether a first layer's K/V must be held back: the mode is unknown, nothing is held, and no
        forward is open."""
        return self.mode is None and self._pending is None and not forward_open

    @property
    def holding(self) -> bool:
        """Whether a first layer's K/V are held back (see `hold`)."""
        return self._pending is not None

    def hold(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self._pending = Pending(layer_idx, key, value)

    def take(self, layer_idx: int) -> Pending | None:
        """The `"paged"` attention consumes the held K/V of its layer (None if nothing is held for it)."""
        if self._pending is None or self._pending.layer_idx != layer_idx:
            return None
        pending, self._pending = self._pending, None
        return pending

    def release(self) -> Pending | None:
        """The held K/V were not taken by the `"paged"` attention: the cache is `"gather"` and stores them."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.mode = "gather"
        return pending

    def still_open(self, layer_idx: int) -> bool:
        """Whether this layer's K/V were handed over as history + new K/V before the mode was known."""
        return self.mode is None and self._pending is not None and self._pending.layer_idx == layer_idx

    def reset(self) -> None:
        self.mode, self._pending = None, None
