"""`RowStates`: the recurrent states of one cache's rows — each row's state slot, and the states of the
forward in flight — and their only writer.

transformers' recurrent layers (`LinearAttentionLayer`) call, per forward and layer, `get_conv_state` /
`get_recurrent_state` (None before the first forward), then `update_conv_state` / `update_recurrent_state`,
or, on a one-token decode step, mutate the tensor `get_conv_state` returned in place
(`causal_conv1d_update`). So the states of a forward are kept apart from the committed slots:

    committed slots (pool, `StateSlots`)       working states of the forward in flight
    row b -> slot s_b  ── get_*_state() ──>     key -> [batch, ...] (a copy; the model may write it)
                       <── commit ────────      update_*_state() replaces it

The forward's states enter the slots when it ends (`close`): the next forward's first call on a lower layer,
or any cache operation between forwards; only if its attention committed (`attention_committed`) and every
recurrent layer ran. A forward that did not finish (a layer raised) leaves the slots as they were. A slot shared with another row or cache is never written: the row takes
a fresh slot (copy-on-write), so forks, beams and samples share states until they diverge.

Recording the past (assisted decoding, transformers 5.25 on): between `record()` and `stop_recording()`, the states
each committed forward went through are kept (`past`), so that `crop(tokens)` can put the rows' states back as they
were `tokens` tokens earlier: each convolution window followed by every input since the last crop, and each
recurrent state before each token since then (the model hands the per-token states over as a list).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from ..memory.state_slots import StateKey

if TYPE_CHECKING:
    from ..memory.pool import BlockPool


class RowStates:
    """The state slots of one cache's rows and the states of its forward in flight.

    Attributes:
        slots: per row, its committed slot (empty before the first forward with recurrent layers).
        previous: `(layer_idx, state_idx)` pairs whose state the committed slots hold (`has_previous_state`).
        working: state key -> `[batch, ...]` states of the forward in flight.
        written: `(layer_idx, state_idx)` pairs whose conv state the forward in flight updated.
        broken: why the states are unusable (a forward raised after its attention committed), or None.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.slots: list[int] = []
        self.previous: set[tuple[int, int]] = set()
        self.working: dict[StateKey, torch.Tensor] = {}
        self.written: set[tuple[int, int]] = set()
        self.broken: str | None = None
        self._touched: set[int] = set()  # recurrent layers the forward in flight called
        self._stored: set[StateKey] = set()  # the states they stored
        self._last_layer = -1  # the highest layer (recurrent or attention) the forward in flight reached
        self._attention_committed = False  # the forward in flight's attention layers all stored their K/V
        self.keep: int | None = None  # recording: the per-token recurrent states a forward hands over; None: off
        # recording (see the module docstring): per convolution state, the window at the last crop followed by
        # every input since and how many tokens those are; per recurrent state, the state before each token since
        # (None where the forward did not hand it over)
        self.past: dict[StateKey, tuple[torch.Tensor, int] | list[torch.Tensor | None]] = {}
        self._forward_past: dict[StateKey, tuple[torch.Tensor, int] | list[torch.Tensor | None]] = {}  # the forward's
        self._forward_tokens: int | None = None  # recording: the forward's tokens (its convolution inputs' width)
        pool.register_states(self)

    # ------------------------------------------------------------------ the forward in flight
    @property
    def in_flight(self) -> bool:
        return bool(self._touched)

    def begins_forward(self, layer_idx: int, read: StateKey | None = None) -> bool:
        """Whether a call on `layer_idx` belongs to a new forward: a forward visits layers in increasing order,
        so a lower layer than one already reached starts the next; so does a read (`get_*_state`) of a state
        the forward in flight already stored (a layer reads each state before it stores it, though it may store
        one before reading another, as Jamba stores its convolution window before reading its SSM state; this
        tells the forwards of one-layer models apart)."""
        if layer_idx < self._last_layer:
            return True
        return read is not None and read in self._stored

    def stored(self, key: StateKey) -> None:
        """A recurrent layer of the forward in flight stored the state `key` (`update_*_state`)."""
        self._stored.add(key)

    def reached(self, layer_idx: int) -> None:
        """An attention layer of the forward in flight called `update()` (after `close()` if it began a forward)."""
        if layer_idx < self._last_layer:  # a new forward, and the last one had no recurrent-state call to close
            self._last_layer, self._attention_committed = -1, False
        self._last_layer = max(self._last_layer, layer_idx)

    def attention_committed(self) -> None:
        """The forward in flight's attention committed (its last attention layer stored its K/V)."""
        self._attention_committed = True

    def touch(self, layer_idx: int) -> None:
        """A recurrent layer of the forward in flight called the cache."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        self._touched.add(layer_idx)
        self._last_layer = max(self._last_layer, layer_idx)

    def has_previous(self, layer_idx: int, state_idx: int) -> bool:
        return (layer_idx, state_idx) in self.written or (layer_idx, state_idx) in self.previous

    def get(self, key: StateKey) -> torch.Tensor | None:
        """The state `key` of every row, `[batch, ...]`, as the forward in flight sees it: what it updated, else a
        copy of the committed slots (which the model may write in place); None without a previous state."""
        if key in self.working:
            return self.working[key]
        if not self.has_previous(key[0], key[2]) or not self.slots:
            return None
        with self.pool.lock:
            states = self.pool.state_slots.read(key, self.slots)
        if states is not None:
            self.working[key] = states
        return states

    def current(self, key: StateKey) -> torch.Tensor | None:
        """The latest state `key` of every row, `[batch, ...]`: the forward in flight's, else a copy of the committed
        slots; None without one (read only)."""
        if key in self.working:
            return self.working[key]
        if not self.slots or (key[0], key[2]) not in self.previous:
            return None
        with self.pool.lock:
            return self.pool.state_slots.read(key, self.slots)

    def update_conv(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int, kernel: int | None) -> torch.Tensor:
        """transformers' `LinearAttentionLayer.update_conv_state`: keeps the last `kernel` columns.

        Args:
            conv_states: `[batch, channels, q_len]` this forward's inputs to the layer's causal convolution.
            kernel: the convolution's width (None: the width of the stored state, else `q_len`).

        Returns:
            `[batch, channels, width]`: the previous window followed by `conv_states` (a first forward: the
            inputs, left-padded with zeros to `kernel`).
        """
        key = (layer_idx, "conv", state_idx)
        previous = self.get(key) if self.has_previous(layer_idx, state_idx) else None
        if previous is not None and previous.shape[0] != conv_states.shape[0]:
            rows, batch = previous.shape[0], conv_states.shape[0]
            raise ValueError(
                f"This cache holds recurrent states of {rows} rows but the model was called with {batch}: a hybrid "
                "model's layers read their states before the cache sees the batch, so it cannot repeat its rows for "
                "num_beams / num_return_sequences itself. Repeat them first: on a returned cache, "
                f"cache.batch_repeat_interleave({batch // rows if batch % rows == 0 else 'n'}) before generate(); for "
                "a cache from KVPool.new_cache(), give new_cache the prompts repeated as generate() repeats them "
                "(input_ids.repeat_interleave(n, dim=0), and the mask alike)."
            )
        if kernel is None:
            kernel = previous.shape[-1] if previous is not None else self._stored_width(key, conv_states.shape[-1])
        if previous is None:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([previous.to(conv_states.dtype), conv_states], dim=-1)
        self.working[key] = full[..., -kernel:].clone()
        self.written.add((layer_idx, state_idx))
        if self.recording:
            self._forward_past[key] = (full.detach().clone(), conv_states.shape[-1])
            self._forward_tokens = conv_states.shape[-1]
        return full

    def update_recurrent(
        self, recurrent_states: torch.Tensor | list[torch.Tensor], layer_idx: int, state_idx: int
    ) -> torch.Tensor:
        """transformers' `LinearAttentionLayer.update_recurrent_state`: keeps a copy of the last state, returns it.
        `recurrent_states` may be the states after each of the forward's last tokens (`[batch, ...]` each, the
        last being the forward's final state), which a recording cache keeps for `crop`: the state before each of
        those tokens. The state before the first of them is the one before the forward only when they are all of
        its tokens; otherwise it was not handed over, and is recorded as None (a crop that needs it is refused)."""
        states = [recurrent_states] if isinstance(recurrent_states, torch.Tensor) else list(recurrent_states)
        key = (layer_idx, "recurrent", state_idx)
        if self.recording:
            before = None
            if self._forward_tokens == len(states):
                before = self.working.get(key)
                if before is None:
                    before = self.current(key)
                before = torch.zeros_like(states[-1]) if before is None else before.detach().clone()
            self._forward_past[key] = [before, *(s.detach().clone() for s in states[:-1])]
        kept = states[-1].detach().clone()
        self.working[key] = kept
        return kept

    def _stored_width(self, key: StateKey, default: int) -> int:
        tensor = self.pool.state_slots.tensors.get(key)
        return default if tensor is None else tensor.shape[-1]

    def close(self, state_layers: tuple[int, ...]) -> bool:
        """Ends the forward in flight: its states enter the slots when it finished (its attention committed and
        every recurrent layer of `state_layers` ran); otherwise (a layer raised) they are dropped. A forward
        whose attention committed but whose later recurrent layers did not all run leaves the cache `broken`.

        Returns:
            True when a forward's states entered the slots here."""
        complete = all(i in self._touched for i in state_layers)
        committed = False
        try:
            if not self._touched:
                pass
            elif complete and self._attention_committed:
                self._commit()
                committed = bool(self.slots)
            elif self._attention_committed:
                self.broken = (
                    "A forward of this hybrid model raised after its attention layers stored their K/V but before "
                    "every recurrent layer updated its state, so this cache's rows are inconsistent; call "
                    "cache.reset() (or use a new cache)."
                )
        finally:
            self.working, self.written, self._touched, self._stored = {}, set(), set(), set()
            self._last_layer, self._attention_committed = -1, False
            self._forward_past, self._forward_tokens = {}, None
        return committed

    def restart(self) -> None:
        """The forward in flight feeds every row again from its first token (assisted decoding's first forward on a
        cache that holds tokens, `Forwards.take_refeed`): the rows let go of their slots and of what the forward
        read from them, so its layers start from no state, as on new rows, and its states enter fresh slots when it
        commits. A state a layer read before the forward's width was known (a layer that reads its recurrent state
        before its convolution, as OLMo-hybrid's) is zeroed where the layer holds it: a zero state is no state. What
        was recorded for `crop` goes too: it is the past of the tokens fed again."""
        for states in self.working.values():  # (copies of the slots, handed to the layers: `get`)
            states.zero_()
        with self.pool.lock:
            self.pool.state_slots.decref(self.slots)
        self.slots, self.previous, self.working, self.written, self.past = [], set(), {}, set(), {}
        self._forward_past, self._forward_tokens = {}, None

    # ------------------------------------------------------------------ recording the past (crop)
    @property
    def recording(self) -> bool:
        return self.keep is not None

    def record(self, keep: int) -> None:
        """Starts (or goes on) recording the past; `keep`: per-token recurrent states a forward hands over."""
        self.keep = max(keep, self.keep or 0)

    def stop_recording(self) -> None:
        self.keep, self.past, self._forward_past, self._forward_tokens = None, {}, {}, None

    def check_crop(self, tokens: int) -> None:
        """Raises ValueError unless `crop(tokens)` can put the states back: recording, with a past that reaches
        `tokens` tokens back."""
        if not self.recording:
            raise ValueError(
                f"crop(-{tokens}) would step this hybrid model's recurrent states back, which needs their past: call "
                "cache.activate_past_recording() before the forwards to crop (transformers 5.25 on)."
            )
        if not tokens:
            return
        kept = set(self.pool.state_slots.keys())
        keys = [(layer_idx, kind, state_idx) for layer_idx, state_idx in self.previous for kind in ("conv", "recurrent")
                if (layer_idx, kind, state_idx) in kept]
        for key in keys:
            past = self.past.get(key, [])
            if isinstance(past, tuple):
                recorded = past[1]
            else:  # the states recorded back from the last, up to the first one not handed over
                recorded = next((n for n, state in enumerate(reversed(past)) if state is None), len(past))
            if tokens > recorded:
                raise ValueError(
                    f"crop(-{tokens}) on a hybrid model's cache: the states recorded since the last crop (or since "
                    f"activate_past_recording()) reach {recorded} tokens back. Crop at most that many; a model whose "
                    "recurrent layers hand over fewer per-token states than get_recurrent_states_to_keep() asks "
                    "cannot be cropped further: decode it without assistant_model / prompt_lookup_num_tokens."
                )

    def crop(self, tokens: int) -> None:
        """Puts every row's states back as they were `tokens` tokens ago (0: as they are) and starts a new past
        there. Call between forwards, after `check_crop(tokens)`."""
        if tokens:
            restored: dict[StateKey, torch.Tensor] = {}
            for key, past in self.past.items():
                if isinstance(past, list):
                    restored[key] = past[-tokens]
                    continue
                window = past[0][..., : past[0].shape[-1] - tokens]
                kernel = self._stored_width(key, window.shape[-1])
                if window.shape[-1] < kernel:  # a first forward shorter than the kernel: zeros before it
                    window = torch.nn.functional.pad(window, (kernel - window.shape[-1], 0), value=0)
                restored[key] = window[..., -kernel:]
            if restored:
                self.working = restored
                self._commit()
                self.working = {}
        self.past = {}

    def adopt(self, slots: list[int | None]) -> None:
        """Rows of a prefix hit start from the snapshots the hit took (`slots[b]`, a reference the caller took for
        this cache; copied on the row's first write); a row given None starts from no previous state, in a fresh
        zeroed slot. Call on a cache without slots, between forwards, with at least one snapshot given."""
        with self.pool.lock:
            state_slots = self.pool.state_slots
            empty = [b for b, slot in enumerate(slots) if slot is None]
            fresh = state_slots.allocate(len(empty))
            state_slots.clear(fresh)
            taken = list(slots)
            for b, slot in zip(empty, fresh, strict=True):
                taken[b] = slot
            self.slots = taken
            self.previous = {(layer_idx, state_idx) for layer_idx, _, state_idx in state_slots.keys()}

    def _commit(self) -> None:
        """Writes the working states into the rows' slots: in place where a row holds the only reference to its
        slot, else into a fresh slot (the shared one keeps the old states)."""
        if not self.working:
            return
        batch = next(iter(self.working.values())).shape[0]
        slots = self.pool.state_slots
        with self.pool.lock:
            if self.slots and len(self.slots) != batch:
                self._expand(batch)
            counts = Counter(self.slots)
            fresh_rows = [b for b, s in enumerate(self.slots) if slots.ref_count(s) > 1 or counts[s] > 1]
            if not self.slots:
                fresh_rows = list(range(batch))
            fresh = slots.allocate(len(fresh_rows))
            targets = list(self.slots) or [0] * batch
            old = [targets[b] for b in fresh_rows] if self.slots else []
            for b, slot in zip(fresh_rows, fresh, strict=True):
                targets[b] = slot
            if old:  # states this forward did not touch travel with the row
                slots.copy(old, fresh)
                slots.decref(old)
            for key, states in self.working.items():
                slots.write(key, targets, states)
            self.slots = targets
        self.previous |= self.written
        for key, forward_past in self._forward_past.items():
            self._extend_past(key, forward_past)

    def _extend_past(self, key: StateKey, forward_past: tuple[torch.Tensor, int] | list[torch.Tensor]) -> None:
        """Adds a committed forward's past of the state `key` to what was recorded since the last crop."""
        if isinstance(forward_past, list):
            recorded = self.past.get(key)
            self.past[key] = [*(recorded if isinstance(recorded, list) else []), *forward_past]
            return
        full, new_columns = forward_past
        recorded = self.past.get(key)
        if isinstance(recorded, tuple):
            self.past[key] = (torch.cat([recorded[0], full[..., full.shape[-1] - new_columns :]], dim=-1),
                              recorded[1] + new_columns)
        else:
            self.past[key] = (full, new_columns)

    def _expand(self, batch: int) -> None:
        """Each row becomes `batch / rows` rows sharing its slot (the attention rows were expanded alike)."""
        if batch % len(self.slots):
            raise ValueError(f"This cache holds states of {len(self.slots)} rows but the model was called with {batch}.")
        self.select([i for i in range(len(self.slots)) for _ in range(batch // len(self.slots))])

    # ------------------------------------------------------------------ whole-row operations (between forwards)
    def select(self, indices: list[int]) -> None:
        """Row i takes old row `indices[i]`'s slot, shared (beam reorder, repeat, select)."""
        if not self.slots or indices == list(range(len(self.slots))):
            return
        for key, past in self.past.items():  # (recording only)
            rows = torch.as_tensor(indices, device="cpu")
            if isinstance(past, list):
                self.past[key] = [p[rows.to(p.device)] for p in past]
            else:
                self.past[key] = (past[0][rows.to(past[0].device)], past[1])
        with self.pool.lock:
            new = [self.slots[i] for i in indices]
            self.pool.state_slots.incref(new)
            self.pool.state_slots.decref(self.slots)
            self.slots = new

    def copy_from(self, other: RowStates) -> None:
        """Becomes a copy of `other`'s rows, sharing their slots (fork)."""
        with self.pool.lock:
            self.release_all()
            self.pool.state_slots.incref(other.slots)
            self.slots, self.previous, self.broken = list(other.slots), set(other.previous), other.broken
            self.keep, self.past = other.keep, {k: list(p) if isinstance(p, list) else p for k, p in other.past.items()}

    def append_row(self, other: RowStates, row: int) -> None:
        """Appends `other`'s row `row`, sharing its slot."""
        if not other.slots:
            return
        with self.pool.lock:
            self.pool.state_slots.incref([other.slots[row]])
            self.slots.append(other.slots[row])
            self.previous |= other.previous
        self.past = {}  # the row's past is not recorded here: a crop can step back no further than this

    def release_all(self) -> None:
        """Drops every slot reference and the forward in flight."""
        with self.pool.lock:
            self.pool.state_slots.decref(self.slots)
        self.slots, self.previous, self.broken = [], set(), None
        self.working, self.written, self._touched, self._stored = {}, set(), set(), set()
        self._last_layer, self._attention_committed = -1, False
        self.stop_recording()

    # ------------------------------------------------------------------ reading
    def slot_refs(self) -> Counter[int]:
        """Slot id -> references this cache's rows hold."""
        return Counter(self.slots)
