"""`Slab`: the K and V tensors of a layer group's layers, each one tensor with a leading layer dimension.

A `BlockPool` keeps each layer's K/V in its own tensor until a group's layers have proven alike (same heads,
widths, dtype, device and capacity); `BlockPool.consolidate` then stacks them into a slab, and each layer's
tensors become views of it (`key[position]`), still contiguous `[num_blocks, block_size, num_kv_heads,
head_dim]`, so nothing that reads a layer's tensors changes. What a slab adds is that one `as_strided` +
`unbind` makes a view for every layer of the group at once, which is how the short way of a batch-1 decode
step (`dispatch.OneRowDecode`) makes its four views per layer and step: two ops per kind of view for all layers
instead of one op per layer and kind (~6.2k instructions per view instead of ~10.9k per `as_strided`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .slots import slots_strided


@dataclass(frozen=True, slots=True)
class Slab:
    """K and V of some layers of one group.

    Attributes:
        layers: the layer indices, in the slab's order (`position`).
        key: `[len(layers), num_blocks, block_size, num_kv_heads, head_dim]`, contiguous.
        value: `[len(layers), num_blocks, block_size, num_kv_heads, head_dim_v]`, contiguous.
    """

    layers: tuple[int, ...]
    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def stack(cls, layers: tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor]) -> Slab:
        """A slab holding copies of per-layer tensors (`keys[i]`, `values[i]` of `layers[i]`, all one shape)."""
        return cls(layers, torch.stack(keys), torch.stack(values))

    def grown(self, num_blocks: int) -> Slab:
        """A slab of the same layers with `num_blocks` blocks each, the blocks of this one copied in."""
        key = self.key.new_zeros((self.key.shape[0], num_blocks, *self.key.shape[2:]))
        value = self.value.new_zeros((self.value.shape[0], num_blocks, *self.value.shape[2:]))
        key[:, : self.key.shape[1]].copy_(self.key)
        value[:, : self.value.shape[1]].copy_(self.value)
        return Slab(self.layers, key, value)

    def position(self, layer_idx: int) -> int:
        """Where a layer of the slab lies along its first dimension."""
        return self.layers.index(layer_idx)

    def slot_views(self, first: int, count: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Per layer (by position), `[1, num_kv_heads, count, head_dim]` views of the consecutive slots `first ..
        first + count - 1` of its K, and `[..., head_dim_v]` views of its V: two ops for all layers."""
        return self._views(self.key, first, count), self._views(self.value, first, count)

    @staticmethod
    def _views(slab: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, ...]:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim = slab.shape
        size, stride, offset = slots_strided(num_kv_heads, head_dim, first, count, slab.storage_offset())
        layer_stride = num_blocks * block_size * num_kv_heads * head_dim
        return slab.as_strided((num_layers, *size), (layer_stride, *stride), offset).unbind(0)
