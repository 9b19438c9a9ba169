"""`StateSlots`: the recurrent states of a hybrid model's sequences, one slot per sequence, owned by the pool.

A hybrid model (Mamba / linear-attention / short-convolution layers beside softmax attention) keeps, per
sequence and recurrent layer, a state of fixed size: transformers' `LinearAttentionLayer` holds a convolution
window `conv_states[state_idx]` `[batch, channels, conv_kernel_size]` and a recurrent (SSM / linear-attention)
state `recurrent_states[state_idx]` of a layer-specific shape `[batch, ...]`. Here every such state is one
tensor `[num_slots, ...]` per `StateKey`, and a slot id indexes all of them: slot s holds one sequence's
states in every recurrent layer, as a block id indexes every layer of a group.

Slots are reference counted like blocks. A slot referenced more than once (forks, beams, parallel samples, a
snapshot the prefix index holds at the end of a block, `BlockPool.hold_snapshot`) is never written: the writer takes a fresh slot (copy-on-write, `RowStates.commit` in `row_states.py`). Each
slot is free or in use, never both; the free list holds no referenced slot (`check()`).

Callers hold the pool's lock.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..errors import OutOfBlocksError
from .slots import storage_zeros

#: (layer_idx, kind, state_idx); kind is `"conv"` or `"recurrent"`.
StateKey = tuple[int, str, int]


class StateSlots:
    """Slots of per-sequence recurrent states.

    Args:
        max_slots: fixed number of slots (None: the tensors grow as slots are needed).

    Attributes:
        tensors: state key -> `[capacity, *state_shape]` storage, made on the first write of that state.
        ref_counts: slot id -> references from live caches (0 for a free slot).
    """

    def __init__(self, max_slots: int | None = None) -> None:
        self.max_slots = max_slots
        self.tensors: dict[StateKey, torch.Tensor] = {}
        self.ref_counts: list[int] = []
        self.free_ids: list[int] = []  # a stack: the most recently freed slot is reused first

    # ------------------------------------------------------------------ reference counts
    @property
    def capacity(self) -> int:
        return len(self.ref_counts)

    @property
    def num_in_use(self) -> int:
        return self.capacity - len(self.free_ids)

    def can_allocate(self, count: int) -> bool:
        return self.max_slots is None or len(self.free_ids) + self.max_slots - self.capacity >= count

    def allocate(self, count: int) -> list[int]:
        """`count` free slots, each with one reference; raises `OutOfBlocksError` (nothing changed) when a fixed
        pool has too few."""
        if not self.can_allocate(count):
            raise OutOfBlocksError(
                f"This step needs {count} recurrent-state slots and only "
                f"{len(self.free_ids) + self.max_slots - self.capacity} of {self.max_slots} are free: release "
                "caches you no longer need, or give the KVPool more memory."
            )
        while len(self.free_ids) < count:
            self._grow()
        taken = [self.free_ids.pop() for _ in range(count)]
        for slot in taken:
            self.ref_counts[slot] = 1
        return taken

    def incref(self, slots: list[int]) -> None:
        for slot in slots:
            assert self.ref_counts[slot] > 0, f"incref of free state slot {slot}"
            self.ref_counts[slot] += 1

    def decref(self, slots: list[int]) -> None:
        for slot in slots:
            assert self.ref_counts[slot] > 0, f"decref of free state slot {slot}"
            self.ref_counts[slot] -= 1
            if self.ref_counts[slot] == 0:
                self.free_ids.append(slot)

    def ref_count(self, slot: int) -> int:
        return self.ref_counts[slot]

    def _grow(self) -> None:
        """Adds slots: doubles the capacity (up to `max_slots`), growing every state tensor."""
        old = self.capacity
        new = max(4, 2 * old) if self.max_slots is None else min(max(4, 2 * old), self.max_slots)
        self.ref_counts.extend([0] * (new - old))
        self.free_ids[:0] = reversed(range(old, new))  # below the stack: recently freed slots come first
        for key, tensor in self.tensors.items():
            grown = storage_zeros((new, *tensor.shape[1:]), tensor.dtype, tensor.device)
            grown[:old].copy_(tensor)
            self.tensors[key] = grown

    # ------------------------------------------------------------------ states
    def read(self, key: StateKey, slots: list[int]) -> torch.Tensor | None:
        """A copy of the states of `slots`, `[len(slots), *state_shape]`; None if that state was never written."""
        tensor = self.tensors.get(key)
        if tensor is None:
            return None
        return tensor.index_select(0, torch.tensor(slots, device=tensor.device))

    def write(self, key: StateKey, slots: list[int], states: torch.Tensor) -> None:
        """Stores `states[i]` (`[len(slots), *state_shape]`) in slot `slots[i]`; the first write of a key makes
        its tensor with the states' shape, dtype and device."""
        tensor = self.tensors.get(key)
        if tensor is None:
            tensor = storage_zeros((self.capacity, *states.shape[1:]), states.dtype, states.device)
            self.tensors[key] = tensor
        elif tensor.shape[1:] != states.shape[1:] or tensor.dtype != states.dtype:
            raise ValueError(
                f"Recurrent state {key} is stored as {tuple(tensor.shape[1:])} {tensor.dtype} per sequence, but "
                f"the model now gives {tuple(states.shape[1:])} {states.dtype}: a KVPool serves one model."
            )
        tensor.index_copy_(0, torch.tensor(slots, device=tensor.device), states.to(tensor.device).detach())

    def clear(self, slots: list[int]) -> None:
        """Zeroes every state of `slots` (a row starting from no previous state beside rows that have one)."""
        if not slots:
            return
        for tensor in self.tensors.values():
            tensor.index_fill_(0, torch.tensor(slots, device=tensor.device), 0)

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Copies every state of slot `src[i]` into slot `dst[i]`."""
        if not src:
            return
        for tensor in self.tensors.values():
            index = torch.tensor(src, device=tensor.device)
            tensor.index_copy_(0, torch.tensor(dst, device=tensor.device), tensor.index_select(0, index))

    def keys(self) -> list[StateKey]:
        return list(self.tensors)

    # ------------------------------------------------------------------ stats and invariants
    @property
    def bytes_per_slot(self) -> int:
        """Bytes one sequence's states take over every recurrent layer."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values()) if self.capacity else 0

    @property
    def bytes_reserved(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def check(self, refs: Counter[int]) -> None:
        """Raises AssertionError unless every slot's count equals its references from live caches and the free
        list holds exactly the unreferenced slots, once each."""
        assert len(set(self.free_ids)) == len(self.free_ids), "a state slot is on the free list twice"
        assert all(0 <= s < self.capacity for s in refs), "a row references a state slot outside the pool"
        for slot, count in enumerate(self.ref_counts):
            assert count == refs.get(slot, 0), f"state slot {slot}: ref count {count}, referenced {refs.get(slot, 0)}"
        assert sorted(self.free_ids) == [s for s, c in enumerate(self.ref_counts) if c == 0], "free state slots"
