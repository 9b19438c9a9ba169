"""The per-forward plan: slot mapping, block tables and lengths, computed once and used by every layer.

Built by `Rows.plan_forward` on the first layer of a forward (FlashInfer's plan/run split); every later
layer only writes its K/V through the slots and attends through the block tables. The plan is host data; the
device tensors each backend builds from it live in typed per-group, per-device records (`GroupInputs`), built by
the first layer that needs them and read by the later ones. Token positions of one row::

    block_table:  [ 7 | 2 | 9 ]          block_size = 4
    positions:     0123 4567 89..        seq_len = 10 (6 before this forward, 4 new)
    slots:         28..31 8..11 36 37    slot = block_id * block_size + position % block_size

Padding columns (left padding) get slot -1 and are never stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .fast_decode import FastDecode
    from .torch_meta import TorchInputs, TorchMeta


class AttentionFeatures(NamedTuple):
    """What a layer's attention call asks beyond its tensors, built once per call by the attention function and
    passed whole to the paths (immutable; a named tuple, the cheapest typed value to build once per layer call).

    Attributes:
        scale: multiplier of `q·k`.
        sliding_window: keys at positions `p - sliding_window < k <= p` are visible; None for all.
        softcap: logit soft-capping `softcap * tanh(s / softcap)`, or None.
        sinks: `[num_heads]` per-head sink logits that join the softmax denominator, or None.
    """

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None


class CallSignature(NamedTuple):
    """Everything of a layer's call that the choice of its path depends on: layers of one group that share it
    share the path chosen for the first of them."""

    query_shape: torch.Size
    query_contiguous_heads: bool
    query_dtype: torch.dtype
    kv_dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    sliding_window: int | None
    softcap: float | None
    num_sinks: int | None


@dataclass(slots=True)
class GroupInputs:
    """A layer group's device inputs for one forward on one device: what the group's first layer decided or built,
    read by every later layer (each backend fills its own fields).

    Attributes:
        routes: per call signature, the PyTorch path's inputs, or None where the Triton path takes the call.
        fast: the group's `FastDecode` step (one row's decode step over consecutive blocks), None when the forward
            does not qualify; decided once (`fast_decided`).
        torch_meta: the PyTorch path's gather index and mask per sliding window.
        torch_write: the PyTorch path's write index.
        slot_mapping: int64 `[batch, q_len]` slots for the cache-write kernel.
        kernel: the attention kernel's `(block_tables, seq_lens, query_lens)`, int32.
        launches: the kernels' laid-out launches (`kernels.launch.Repeatable`), handed on to the next forward.
        gathered: per width, the read-back slots and validity of the plain-attention path (`cache/readback.py`).
    """

    routes: dict[CallSignature, TorchInputs | None] = field(default_factory=dict)
    fast: FastDecode | None = None
    fast_decided: bool = False
    torch_meta: dict[int | None, TorchMeta] = field(default_factory=dict)
    torch_write: tuple[torch.Tensor | None, torch.Tensor | None, int | None] | None = None
    slot_mapping: torch.Tensor | None = None
    kernel: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    launches: dict | None = None
    gathered: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)


@dataclass(slots=True)
class GroupPlan:
    """What one layer group needs to write and attend in this forward.

    Attributes:
        tables: per row, the block ids after this forward's allocations: the rows' own lists, read only and
            unchanged while the forward is open (the next change of a table is the next forward's plan).
        write_rows: flattened `batch * q_len` indices of the tokens this group writes.
        write_slots: their slots, same length.
        sliding_window: the group's window, or None.
        inputs: per device, the backends' inputs built from this plan (`inputs_on`).
    """

    tables: list[list[int]]
    write_rows: list[int]
    write_slots: list[int]
    sliding_window: int | None
    inputs: dict[torch.device, GroupInputs] = field(default_factory=dict)

    def inputs_on(self, device: torch.device) -> GroupInputs:
        """The group's inputs record on `device`, empty until a layer builds them."""
        found = self.inputs.get(device)
        if found is None:
            found = self.inputs[device] = GroupInputs()
        return found


@dataclass(slots=True)
class ForwardPlan:
    """Everything a layer needs, computed once per forward.

    Attributes:
        q_len: columns of this forward (new tokens per row, padding included).
        query_lens: per row, real new tokens (right-aligned in the columns).
        seq_lens: per row, tokens stored including this forward's.
        groups: per layer group.
        block_size: tokens per block.
        num_layers: layers that must write for the forward to be complete (None: unknown); under `"paged"`, with
            the layers that attend over another layer's K/V (`LayerLayout.readers`), which mark themselves written.
        written_mask: bit `i` set once layer `i` wrote in this forward (`has_written`, `mark_written`).
        num_written: layers written so far.
        undo: how to roll the cache back if the forward does not complete (owned by `Rows`).
        identity: per row, the earlier row it duplicates (itself if unique), or None: duplicates share
            blocks and their attention is computed once.
        rows_before: the cache's row count before this forward expanded it (repeated prompt rows), or None.
        column_order: int64 `[batch, q_len]` when some row's real columns are not its last ones (right
            padding, holes): each layer reorders its columns by it so they are, and `column_restore` undoes
            that on the output. None otherwise.
        column_count: with `column_order`, int64 `[batch, q_len]` real columns up to and including each
            (reordered) column, so padding queries see what transformers' masks show them.
        gapped: some row has padding after a real token (right padding, a hole), in any column so far.
        real_tail: the fewest real columns any row has at the end of this forward (`q_len` when all are real).
        mode: `"paged"` (the `"paged"` attention writes and reads the blocks) or `"gather"` (`update()` writes
            and returns gathered K/V) for every layer of this forward.
        previous: the cache's previous forward, committed just before this one began (None otherwise, and None
            once this forward is committed, so plans never chain): the Triton path hands its laid-out launches on.
        kv_for_readers: per layer whose K/V later layers reuse (`LayerLayout.readers`), the new K/V it wrote
            (`[batch, num_kv_heads, q_len, head_dim]` and `[..., head_dim_v]`), for those layers' attention;
            emptied when the forward ends.
        tails: per width, the plan of this forward's last columns (`last_columns`), made once.
    """

    q_len: int
    query_lens: list[int]
    seq_lens: list[int]
    groups: list[GroupPlan]
    block_size: int
    num_layers: int | None
    written_mask: int = 0
    num_written: int = 0
    undo: object = None
    identity: list[int] | None = None
    rows_before: int | None = None
    column_order: torch.Tensor | None = None
    column_restore: torch.Tensor | None = None
    column_count: torch.Tensor | None = None
    gapped: bool = False
    real_tail: int = 0
    mode: str | None = None
    previous: ForwardPlan | None = None
    kv_for_readers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    tails: dict[int, ForwardPlan] = field(default_factory=dict)

    @property
    def complete(self) -> bool | None:
        """Whether every layer wrote; None when the number of layers is not known yet."""
        if self.num_layers is None:
            return None
        return self.num_written >= self.num_layers

    def last_columns(self, width: int) -> ForwardPlan:
        """The plan that attends only this forward's last `width` columns, writing nothing: a layer that reuses
        an earlier layer's K/V and keeps only the queries whose logits are asked for (Gemma 4 in a prefill). The
        same rows, tables and lengths; each row's real new tokens are its last `min(query_len, width)`. Only for a
        plan without reordered columns (`column_order`), whose real columns end every row."""
        if self.column_order is not None or not 0 < width <= self.q_len:
            raise ValueError(f"no plan of the last {width} columns of this forward ({self.q_len} columns)")
        found = self.tails.get(width)
        if found is None:
            found = self.tails[width] = ForwardPlan(
                q_len=width,
                query_lens=[min(n, width) for n in self.query_lens],
                seq_lens=self.seq_lens,
                groups=[GroupPlan(g.tables, [], [], g.sliding_window) for g in self.groups],
                block_size=self.block_size,
                num_layers=None,
                identity=self.identity,
                gapped=self.gapped,
                real_tail=min(self.real_tail, width),
                mode=self.mode,
            )
        return found

    def previous_inputs(self, group_id: int, device: torch.device) -> GroupInputs | None:
        """A group's inputs on `device` in the cache's previous forward (`previous`), or None: what a decode step
        may take over from the step before it (the Triton path's launches, the fast path's step)."""
        if self.previous is None or group_id >= len(self.previous.groups):
            return None
        return self.previous.groups[group_id].inputs.get(device)

    def has_written(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` wrote in this forward (so a call for it starts the next forward)."""
        return (self.written_mask >> layer_idx) & 1 == 1

    def mark_written(self, layer_idx: int) -> None:
        """Layer `layer_idx` wrote its K/V. (A bit mask, not a set: no allocation as layers accumulate.)"""
        bit = 1 << layer_idx
        if not self.written_mask & bit:
            self.written_mask |= bit
            self.num_written += 1
