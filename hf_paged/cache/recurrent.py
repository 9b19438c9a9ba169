"""`RecurrentStateMixin`: transformers' linear-attention cache API on a `PagedCache` (hybrid models).

Recurrent layers (Mamba, gated DeltaNet, short convolutions, ...) call `get_conv_state`, `get_recurrent_state`,
`update_conv_state`, `update_recurrent_state`, `has_previous_state` and `is_recording_past` on the cache; they
behave here as on transformers' `DynamicCache` with `LinearAttentionLayer`s, their states kept in the pool's
state slots through the cache's `RowStates` (`row_states.py`). A call on a lower layer than the forward in
flight reached begins a new forward, which first ends the previous one (`finish_forward`). Under a compiled model
each call runs eagerly, in a graph break (`attention/outside_graph.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..attention.outside_graph import run_outside_graph
from ..compat import RECURRENT_PAST
from ..errors import UnsupportedModelError

if TYPE_CHECKING:
    from ..memory.pool import BlockPool
    from ..memory.state_slots import StateKey
    from .forward import Forwards
    from .modes import AttentionMode
    from .row_states import RowStates
    from .rows import Rows

#: transformers' message when assisted decoding meets a cache it cannot crop (`generate()`, 5.24 on).
NOT_CROPPABLE = (
    "Assisted decoding requires a cache that can be cropped to restore the states after draft verification"
)


class RecurrentStateMixin:
    """The recurrent-state methods of `PagedCache` (see the module docstring)."""

    pool: BlockPool
    states: RowStates
    modes: AttentionMode
    rows: Rows
    forwards: Forwards

    def finish_forward(self) -> None: ...  # PagedCache's

    def _flush_pending(self) -> None: ...  # PagedCache's

    def _restart_if_refed(self, q_len: int) -> None: ...  # PagedCache's

    # ------------------------------------------------------------------ transformers.Cache API
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """`[batch, channels, conv_kernel_size]` convolution window of a recurrent layer, or None before its first
        forward. The model may update it in place (one-token decode)."""
        if torch.compiler.is_compiling():
            return run_outside_graph(RecurrentStateMixin.get_conv_state, self, layer_idx, state_idx)
        self._state_call(layer_idx, read=(layer_idx, "conv", state_idx))
        return self.states.get((layer_idx, "conv", state_idx))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """`[batch, ...]` recurrent (SSM / linear-attention) state of a layer, or None before its first forward."""
        if torch.compiler.is_compiling():
            return run_outside_graph(RecurrentStateMixin.get_recurrent_state, self, layer_idx, state_idx)
        self._state_call(layer_idx, read=(layer_idx, "recurrent", state_idx))
        return self.states.get((layer_idx, "recurrent", state_idx))

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size: int | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        """Keeps the last `conv_kernel_size` columns of `[batch, channels, q_len]` inputs; returns the previous
        window followed by them (transformers' `LinearAttentionLayer.update_conv_state`)."""
        if torch.compiler.is_compiling():
            return run_outside_graph(
                RecurrentStateMixin.update_conv_state, self, conv_states, layer_idx, state_idx, conv_kernel_size
            )
        self._state_call(layer_idx)
        self._restart_if_refed(conv_states.shape[-1])
        self.states.stored((layer_idx, "conv", state_idx))
        return self.states.update_conv(conv_states, layer_idx, state_idx, conv_kernel_size)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor | list[torch.Tensor], layer_idx: int, state_idx: int = 0,
        **kwargs: object,
    ) -> torch.Tensor:
        """Keeps a layer's new `[batch, ...]` recurrent state; returns the kept copy. A list (transformers 5.25 on:
        the states after each of the forward's last tokens, for a cache recording its past) keeps its last, and
        the others while recording (`RowStates.update_recurrent`)."""
        if torch.compiler.is_compiling():
            return run_outside_graph(
                RecurrentStateMixin.update_recurrent_state, self, recurrent_states, layer_idx, state_idx
            )
        self._state_call(layer_idx)
        self.states.stored((layer_idx, "recurrent", state_idx))
        return self.states.update_recurrent(recurrent_states, layer_idx, state_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether a recurrent layer (default: the last one) has a state from an earlier forward or from this
        forward's `update_conv_state`."""
        if torch.compiler.is_compiling():
            return run_outside_graph(RecurrentStateMixin.has_previous_state, self, layer_idx, state_idx)
        state_layers = self.pool.layout.state_layers
        if layer_idx is None:
            known = state_layers or sorted({i for i, _ in self.states.previous | self.states.written})
            if not known:
                raise ValueError(
                    "`has_previous_state` can only be called on LinearAttention layers, and this model's cache has "
                    "none."
                )
            layer_idx = known[-1]
        else:
            self._check_state_layer(layer_idx, "has_previous_state")
        return self.states.has_previous(layer_idx, 0 if state_idx is None else state_idx)

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """A recurrent layer stepped the convolution window `get_conv_state` returned in place (one-token decode;
        transformers 5.25 on). Nothing to count: each row's length is its attention columns, and the window is
        the forward's own (`RowStates.get`). While recording the past, such a step would go unrecorded."""
        if self.states.recording:
            raise RuntimeError(
                f"Layer {layer_idx} stepped its convolution state in place while this cache records its past "
                "(is_recording_past() is True), so crop() could not step it back."
            )

    def is_recording_past(self, layer_idx: int) -> bool:
        """Whether the recurrent layers record their past for `crop()` (after `activate_past_recording`)."""
        return self.states.recording

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """While recording (else 0). Asked by a layer (`layer_idx` given): how many of a forward's last per-token
        recurrent states it hands to `update_recurrent_state`, one more than the tokens a crop may remove
        (`activate_past_recording`), so that the state right before them is among those a forward of them plus
        one (assisted decoding's verify step) hands over. Asked without a layer (`generate()`): those tokens."""
        if not self.states.recording:
            return 0
        return self.states.keep + (layer_idx is not None)

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs: object) -> None:
        """transformers asks for it before assisted decoding, which then `crop()`s the rejected drafts. A hybrid
        model's cache records its recurrent states from here on (`RowStates.record`), `recurrent_states_to_keep`
        per-token states per forward (at least as many as the tokens a crop removes); on releases whose layers
        do not record (before 5.25) it refuses, before anything is stored.

        Assisted decoding's first forward feeds the whole prompt, whatever the cache holds (`Forwards.expect_refeed`):
        a cache that holds tokens (a conversation continued, a prefix hit) stores them anew in that forward, and a
        hybrid model's layers start it from no state, so the tokens are those of a cache that held nothing."""
        if not self.pool.layout.is_hybrid:
            self.forwards.expect_refeed()
            return
        if not RECURRENT_PAST:
            raise ValueError(
                f"{NOT_CROPPABLE}: this model's recurrent layers keep one state per sequence, which a PagedCache "
                "steps back only with transformers 5.25 or later. Use greedy or sampling decoding, or the default "
                "DynamicCache."
            )
        self.states.record(recurrent_states_to_keep or 0)
        self.forwards.expect_refeed()

    def stop_recording_past(self) -> None:
        """Stops recording the recurrent states' past and drops what was recorded (the cache can no longer crop
        a hybrid model's rows)."""
        self.finish_forward()
        self.states.stop_recording()
        self.forwards.cancel_refeed()

    # ------------------------------------------------------------------ internals
    def _state_call(self, layer_idx: int, read: StateKey | None = None) -> None:
        """A recurrent layer called the cache (`read`: the state a `get_*_state` reads): a call that begins a new
        forward (`RowStates.begins_forward`) first ends the previous one."""
        begins = self.states.in_flight and self.states.begins_forward(layer_idx, read)
        if self.modes.holding:  # the first forward of a cache made without config, read by another attention
            if begins:
                raise UnsupportedModelError(
                    "This hybrid model's attention reads its K/V gathered (an attn_implementation other than "
                    "'paged', or multi-latent attention, which expands what the cache returns), and its PagedCache "
                    "was made without config=, so the cache learned it only after generate() had read its length. "
                    "Pass PagedCache(config=model.config), or use the model's default cache."
                )
            self._flush_pending()  # the attention that ran before this layer left the held K/V: store them
        if begins:
            if not self.rows.batch and self.forwards.plan is None:  # a whole forward ran without attention
                self.states.release_all()
                raise UnsupportedModelError(
                    "This model ran a forward through recurrent (state-space) layers only: PagedCache pages "
                    "softmax-attention K/V and serves hybrid models, not pure state-space models. Use the model's "
                    "default cache (omit past_key_values) for it."
                )
            self.finish_forward()
        self._check_state_layer(layer_idx, "a recurrent-state method")
        self.states.touch(layer_idx)

    def _check_state_layer(self, layer_idx: int, what: str) -> None:
        layout = self.pool.layout
        if layout.num_layers is not None and layout.num_model_layers and layer_idx not in layout.state_layers:
            raise ValueError(
                f"You called {what} on layer index {layer_idx}, but this layer keeps no recurrent state in this "
                "model's config."
            )
