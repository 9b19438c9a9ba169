"""The per-forward plan: slot mapping, block tables and lengths, computed once and used by every layer.

Built on the first layer of a forward (FlashInfer's plan/run split); every later layer only writes its
K/V through `slot_mapping` and attends through `block_tables`. Token positions of one row::

    block_table:  [ 7 | 2 | 9 ]          block_size = 4
    positions:     0123 4567 89..        seq_len = 10 (6 before this forward, 4 new)
    slots:         28..31 8..11 36 37    slot = block_id * block_size + position % block_size

Padding columns (left padding) get slot -1 and are never stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .torch_backend import TorchMeta, build_torch_meta


@dataclass(slots=True)
class GroupPlan:
    """What one layer group needs to write and attend in this forward.

    Attributes:
        tables: per row, the block ids after this forward's allocations (host copy).
        write_rows: flattened `batch * q_len` indices of the tokens this group writes.
        write_slots: their slots, same length.
        sliding_window: the group's window, or None.
    """

    tables: list[list[int]]
    write_rows: list[int]
    write_slots: list[int]
    sliding_window: int | None
    _device: dict[torch.device, dict[str, object]] = field(default_factory=dict)


@dataclass(slots=True)
class ForwardPlan:
    """Everything a layer needs, computed once per forward.

    Attributes:
        q_len: columns of this forward (new tokens per row, padding included).
        query_lens: per row, real new tokens (right-aligned in the columns).
        seq_lens: per row, tokens stored including this forward's.
        groups: per layer group.
        block_size: tokens per block.
        num_layers: layers that must write for the forward to be complete (None: unknown).
        layers_written: layers written so far.
        undo: how to roll the cache back if the forward does not complete.
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
    """

    q_len: int
    query_lens: list[int]
    seq_lens: list[int]
    groups: list[GroupPlan]
    block_size: int
    num_layers: int | None
    layers_written: set[int] = field(default_factory=set)
    undo: object = None
    identity: list[int] | None = None
    rows_before: int | None = None
    column_order: torch.Tensor | None = None
    column_restore: torch.Tensor | None = None
    column_count: torch.Tensor | None = None
    gapped: bool = False
    real_tail: int = 0

    @property
    def complete(self) -> bool | None:
        """Whether every layer wrote; None when the number of layers is not known yet."""
        if self.num_layers is None:
            return None
        return len(self.layers_written) >= self.num_layers

    def write_index(self, group_id: int, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
        """`(write_index, write_slots)` int64 tensors on `device` for `torch_write`; index None = all tokens."""
        cached = self.groups[group_id]._device.setdefault(device, {})
        if "write" not in cached:
            group = self.groups[group_id]
            rows = group.write_rows
            all_rows = len(rows) == len(self.seq_lens) * self.q_len and rows == list(range(len(rows)))
            index = None if all_rows else torch.tensor(rows, dtype=torch.int64, device=device)
            cached["write"] = (index, torch.tensor(group.write_slots, dtype=torch.int64, device=device))
        return cached["write"]  # type: ignore[return-value]

    def slot_mapping(self, group_id: int, device: torch.device) -> torch.Tensor:
        """int64 `[batch, q_len]` slots for the Triton cache-write kernel, -1 where nothing is written."""
        cached = self.groups[group_id]._device.setdefault(device, {})
        if "slot_mapping" not in cached:
            flat = torch.full((len(self.seq_lens) * self.q_len,), -1, dtype=torch.int64)
            group = self.groups[group_id]
            if group.write_rows:
                flat[torch.tensor(group.write_rows)] = torch.tensor(group.write_slots, dtype=torch.int64)
            cached["slot_mapping"] = flat.view(len(self.seq_lens), self.q_len).to(device)
        return cached["slot_mapping"]  # type: ignore[return-value]

    def kernel_inputs(self, group_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(block_tables int32 [batch, max_blocks], seq_lens int32 [batch], query_lens int32 [batch])`."""
        cached = self.groups[group_id]._device.setdefault(device, {})
        if "kernel" not in cached:
            tables = self.groups[group_id].tables
            width = max(1, max(len(t) for t in tables))
            padded = [t + [-1] * (width - len(t)) for t in tables]
            cached["kernel"] = (
                torch.tensor(padded, dtype=torch.int32, device=device),
                torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
                torch.tensor(self.query_lens, dtype=torch.int32, device=device),
            )
        return cached["kernel"]  # type: ignore[return-value]

    def torch_meta(self, group_id: int, sliding_window: int | None, device: torch.device) -> TorchMeta:
        """Gather index and mask for the PyTorch path (per group, window and device)."""
        cached = self.groups[group_id]._device.setdefault(device, {})
        key = ("torch", sliding_window)
        if key not in cached:
            cached[key] = build_torch_meta(
                self.groups[group_id].tables,
                self.seq_lens,
                self.query_lens,
                self.q_len,
                self.block_size,
                sliding_window,
                device,
                self.identity,
                self.column_count,
            )
        return cached[key]  # type: ignore[return-value]
