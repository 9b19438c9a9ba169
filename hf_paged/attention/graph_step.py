"""`GraphStep`: the inputs of a forward whose every layer writes and attends through the custom ops alone
(`ops.py`), so that the whole forward can be compiled into one graph and replayed.

Everything a `PagedCache` forward decides in Python on its first layer (which blocks, which slots) is decided
before the forward by whoever builds the `GraphStep` (the engine's `DecodeGraphs`), and reaches the model as
tensors in one keyword argument, `paged_graph_step`, which transformers passes down to the attention function::

    model(input_ids=[B, q], position_ids=[B, q], use_cache=False, paged_graph_step=GraphStep(...))
        -> each layer: "paged" attention -> GraphStep.attend -> hf_paged::write_and_attend
                                                             or, given the step's blocks, graph_attention.py

No `Cache` takes part: the model runs without one (`use_cache=False`), and the `"paged"` mask function builds
no mask for it (keys end at the queries). The tensors are the caller's static buffers, refilled in place
between steps, so a captured graph reads the next step's values from the same addresses.

A decode step on a CPU is given its blocks as `(row, block)` pairs (`blocks`): its layers then write and attend as
plain tensor operations that the compiler fuses (`graph_attention.py`) instead of calling the op, whose PyTorch
path would run eagerly inside the graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import ops  # noqa: F401 - registers torch.ops.hf_paged.*
from ..memory.rotation import from_storage, to_storage
from .graph_attention import StepBlocks, write_and_attend_blocks

#: The keyword argument of the model's forward that carries a `GraphStep` to every layer's attention.
GRAPH_STEP_KWARG = "paged_graph_step"


@dataclass(slots=True)
class GraphStep:
    """One compiled forward's paged inputs: `batch` rows of `q_len` new tokens each.

    Attributes:
        key_caches, value_caches: per layer index, the pool tensors the layer attends over `[num_blocks,
            block_size, num_kv_heads, head_dim]` and `[..., head_dim_v]`: its own, or for a layer of `readers`
            those of the layer whose K/V it reuses.
        key_scales, value_scales: per layer index, a quantized pool's float16 scales of those tensors, or None.
        layer_groups: per layer index, the layer group of those tensors.
        slot_mappings: per group, int64 `[batch, q_len]` slots of the new tokens (-1: padding row; with `blocks`,
            every entry is a real slot: see `StepBlocks.write_rows`).
        block_tables: per group, int32 `[batch, max_blocks]` (read by the op only).
        seq_lens: int32 `[batch]` tokens per row including the new ones (0: padding row).
        windows: per group, its sliding window or None.
        blocks: per group, the step's `(row, block)` pairs and write sources (`graph_attention.py`), or None: the
            layers call the op. Given for a decode step on a CPU over unquantized pools (`DecodeGraphs`).
        rotate: the pools store rotated K/V (`memory/rotation.py`): each layer rotates its query and new K/V into
            that space and its output back, as an uncompiled forward does (`dispatch.py`).
        readers: layers that reuse an earlier layer's K/V (`LayerLayout.readers`: Gemma 3n, Gemma 4). The model
            hands them that layer's new K/V, which that layer wrote: they attend and write nothing.
    """

    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    key_scales: list[torch.Tensor | None]
    value_scales: list[torch.Tensor | None]
    layer_groups: list[int]
    slot_mappings: list[torch.Tensor]
    block_tables: list[torch.Tensor]
    seq_lens: torch.Tensor
    windows: list[int | None]
    blocks: list[StepBlocks] | None = None
    rotate: bool = False
    readers: frozenset[int] = frozenset()

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, None]:
        """Writes a layer's new K/V (a layer of `readers` writes nothing) and attends over each row's blocks.

        Args:
            module: the attention module (`layer_idx`).
            query: `[batch, num_heads, q_len, head_dim]`; key, value: `[batch, num_kv_heads, q_len, head_dim]`
                and `[..., head_dim_v]`.
            scaling: multiplier of `q·k` (None: `head_dim ** -0.5`); softcap, sinks: the layer's.

        Returns:
            `([batch, q_len, num_heads, head_dim_v], None)`.
        """
        layer = module.layer_idx
        group = self.layer_groups[layer]
        key_cache, value_cache = self.key_caches[layer], self.value_caches[layer]
        key_scale, value_scale = self.key_scales[layer], self.value_scales[layer]
        scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        write = layer not in self.readers
        if self.rotate:
            query, key, value = to_storage(query), to_storage(key), to_storage(value)
        if self.blocks is not None:
            out = write_and_attend_blocks(
                query, key, value, key_cache, value_cache, self.slot_mappings[group], self.seq_lens,
                self.blocks[group], scale, self.windows[group], softcap, sinks, write=write,
            )
        elif not write:
            out = torch.ops.hf_paged.paged_attention(
                query.transpose(1, 2), key_cache, value_cache, self.block_tables[group], self.seq_lens, scale,
                self.windows[group], softcap, sinks, key_scale, value_scale,
            )
        else:
            out = torch.ops.hf_paged.write_and_attend(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), key_cache, value_cache,
                self.slot_mappings[group], self.block_tables[group], self.seq_lens, scale, self.windows[group],
                softcap, sinks, key_scale, value_scale,
            )
        return (from_storage(out) if self.rotate else out), None
