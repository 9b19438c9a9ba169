"""`PagedCache`: the `transformers.Cache` adapter over a pool's blocks.

It holds one cache's parts — rows (`rows.py`), forward in flight (`forward.py`), attention mode
(`modes.py`) — and hands K/V to the `"paged"` attention (`handoff.py`). A forward: `update()` -> `"paged"`
attention -> `attend()`: plan on the first layer (`Forwards.open` -> `Rows.plan_forward`), write and
attend (`dispatch.py`), commit after the last (`Forwards.layer_done`). See `docs/architecture.md`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from ..attention import fast_decode, handoff
from ..attention.outside_graph import run_outside_graph
from . import readback
from .layer_views import paged_layers
from .recurrent import NOT_CROPPABLE, RecurrentStateMixin
from ..attention.dispatch import attend_stored, write_and_attend, write_gathered
from .forward import Forwards, take_columns
from .modes import AttentionMode
from .pool_choice import pool_for_cache
from ..memory.pool import BlockPool
from ..memory.rotation import as_stored
from .prefix_hits import load_prompt
from .row_states import RowStates
from .rows import Rows
from .state_snapshots import snapshot_block_ends
from ..memory.stats import PoolStats
from ..errors import UnsupportedModelError
from ..support import UnsupportedStateMixin, encoder_decoder_error

if TYPE_CHECKING:
    from ..attention.plan import AttentionFeatures, ForwardPlan


#: `generate()` inputs of a prompt's text (any other tensor input is non-text: `uncached_inputs`).
_TEXT_INPUTS = frozenset({
    "input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "position_ids", "decoder_input_ids",
    "decoder_attention_mask", "inputs_embeds",
})


class PagedCache(RecurrentStateMixin, UnsupportedStateMixin, Cache):
    """A KV cache stored in fixed-size blocks addressed through per-sequence block tables.

    Blocks are allocated as tokens arrive (waste stays below one block per sequence and layer group),
    left-padding tokens are never stored, and sequences share blocks with reference counts and
    copy-on-write: `fork()`, beam search (`reorder_cache`), parallel samples (rows of one prefill with
    identical prompts are stored once) and prefix hits from a `KVPool`.

    With `attn_implementation="paged"`, `update()` returns this step's K/V (staged for it in `handoff.py`) and the
    attention function writes them into their slots and reads history through the block tables (no
    concatenation). With any other attention implementation, `update()` writes and returns the gathered
    contiguous K/V, so every model still works (slower; padding is then stored, since only `"paged"`
    receives the padding mask before storing).

    Hybrid models (recurrent layers beside attention): each row's recurrent states live in a state slot of the
    pool (`row_states.py`, `recurrent.py`), shared by forks, beams and samples until they diverge.

    Args:
        config: the model config; optional (the `"paged"` attention learns it from the model).
        block_size: tokens per block (default 16; must match `pool`'s if both are given).
        pool: a shared `KVPool`; by default the cache gets a private, growing pool.
        num_blocks: fixed capacity of the private pool, in blocks per layer group.
        max_memory: fixed capacity of the private pool, in bytes.
        salt: tenant key for the pool's prefix index.
        kv_dtype: storage of the private pool's K/V: None (the model's dtype), `"int8"`, `"fp8_e4m3"` or
            `"fp8_e5m2"` (see `KVPool`); a shared pool has its own (pass it to the `KVPool`).
        dedupe_rows: store identical rows of a prefill once (num_return_sequences, num_beams, repeated
            prompts). Rows are identical when their known prompt tokens match or, without tokens, when the
            first layer's new K and V are bitwise equal.

    Example:
        >>> import hf_paged
        >>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged")
        >>> out = model.generate(**inputs, past_key_values=hf_paged.PagedCache(), max_new_tokens=32)
    """

    #: Whether only causal self-attention writes this cache, whatever the attention module's `is_causal` says (the
    #: self-attention half of an `EncoderDecoderPagedCache`): otherwise a non-causal module's K/V are refused.
    causal_writers_only = False

    def __init__(
        self,
        config: PretrainedConfig | None = None,
        *,
        block_size: int | None = None,
        pool: BlockPool | None = None,
        num_blocks: int | None = None,
        max_memory: int | None = None,
        salt: str | bytes | None = None,
        dedupe_rows: bool = True,
        kv_dtype: str | None = None,
    ) -> None:
        super().__init__(layers=[])
        self._check_encoder_decoder(config)
        self.pool = pool = pool_for_cache(pool, config, block_size, num_blocks, max_memory, kv_dtype)
        self.salt = salt
        self.dedupe_rows = dedupe_rows
        self.non_text_names: frozenset[str] = frozenset()  # the non-text inputs load_prompt was given
        self.modes = AttentionMode(config)  # which attention reads this cache (a pool's config may be a sibling's)
        self.rows = Rows(pool)
        self.states = RowStates(pool)
        self.forwards = Forwards(self.rows, pool, dedupe_rows)
        self._finalizer = weakref.finalize(self, Rows.release_all, self.rows)
        self._state_finalizer = weakref.finalize(self, RowStates.release_all, self.states)
        self._sync_layers()

    # ------------------------------------------------------------------ transformers.Cache API
    def __repr__(self) -> str:
        return (
            f"PagedCache(rows={self.rows.batch}, seq_length={self.get_seq_length()}, "
            f"block_size={self.pool.block_size}, mode={self.mode})"
        )

    @property
    def batch_size(self) -> int:
        return self.rows.batch if self.rows.batch else -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_linear(self) -> list[bool]:
        """Per layer, whether it keeps only a recurrent state (transformers' `LinearAttentionLayer`s). A cache made
        without a config learns its number of layers when a forward after its first one begins; until then it has
        no layer objects and answers [False], as it holds attention K/V: `generate()` of 5.24 slices a continued
        prompt by the cache's length only when not every layer is linear, and `all([])` is True."""
        return Cache.is_linear.fget(self) or [False]

    @property
    def is_croppable(self) -> bool:
        """For hybrid models, only while recording the past (`activate_past_recording`): a recurrent state
        steps back through the states recorded."""
        return not self.pool.layout.is_hybrid or self.states.recording

    @property
    def is_initialized(self) -> bool:
        """Whether the cache holds tokens (what transformers' models read as "not the first forward": a cache that
        `KVPool.new_cache` made for a prompt holds none until its first forward, unless a prefix hit)."""
        return self.rows.batch > 0 and self.get_seq_length() > 0

    # ------------------------------------------------------------------ read accessors
    @property
    def mode(self) -> str | None:
        """`"paged"` (the `"paged"` attention reads the blocks), `"gather"` (`update()` returns gathered K/V), or
        None before the first forward of a cache made without a config (see `modes.py`)."""
        return self.modes.mode

    @property
    def model_config(self) -> PretrainedConfig | None:
        """The config whose attention implementation decides the mode (given, or learned from the model)."""
        return self.modes.model_config

    @property
    def num_rows(self) -> int:
        """Rows (sequences) this cache holds; 0 before the first forward."""
        return self.rows.batch

    @property
    def seq_lens(self) -> list[int]:
        """Tokens stored per row (padding is never stored), a copy."""
        return list(self.rows.seq_lens)

    def block_table(self, row: int, layer_idx: int = 0) -> list[int]:
        """The block ids of one row in the group of `layer_idx`, in position order (a copy). Sliding-window
        groups hold -1 for blocks that fell out of the window and were freed."""
        if not 0 <= row < self.rows.batch:
            raise IndexError(f"row {row} out of range for a cache of {self.rows.batch} rows.")
        tables = self.rows.group_tables(self.pool.layout.group_of(layer_idx))
        return list(tables[row]) if tables else []

    def block_tables(self, layer_idx: int = 0) -> list[list[int]]:
        """`block_table(row, layer_idx)` of every row."""
        return [self.block_table(b, layer_idx) for b in range(self.rows.batch)]

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens this cache took from its pool's prefix index instead of computing them."""
        return self.rows.prefix_hit_tokens

    @property
    def prefix_query_tokens(self) -> int:
        """Prompt tokens this cache looked up in its pool's prefix index."""
        return self.rows.prefix_query_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns already processed (padding included): what `generate()` slices its inputs by. During a
        forward: the columns before it."""
        return self.forwards.columns_before

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """`(kv_length, kv_offset)` of the next forward's mask: its keys end at its queries."""
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores this step's K/V of a layer.

        Args:
            key_states, value_states: `[batch, num_kv_heads, q_len, head_dim]`.
            layer_idx: the layer.

        Returns:
            Under `"paged"`: the same tensors, staged for the attention function (`handoff.py`), which writes
            them and reads the blocks. Otherwise: `[batch, num_kv_heads, seq_length + q_len, head_dim]`
            gathered K/V, right-aligned like a left-padded contiguous cache.

        Under a compiled model it runs eagerly, in a graph break (`attention/outside_graph.py`).
        """
        if torch.compiler.is_compiling():
            return run_outside_graph(PagedCache.update, self, key_states, value_states, layer_idx)
        if self.states.in_flight or self.pool.layout.state_layers:  # a hybrid model: follow its forwards
            if self.states.in_flight and self.states.begins_forward(layer_idx):
                self.finish_forward()
            self.states.reached(layer_idx)
        plan = self.forwards.plan
        if plan is not None and not plan.has_written(layer_idx):
            mode = plan.mode  # a later layer of an open forward: decided on its first layer
        else:
            self._restart_if_refed(key_states.shape[2])
            mode = self.modes.for_update(self.rows.num_columns)
        if mode == "paged":
            handoff.stage(self, layer_idx, key_states, value_states)
            return key_states, value_states
        if mode is None and self.modes.must_hold(plan is not None):
            # First forward, attention unknown: hold the K/V back (see modes.py) and hand over history + new, the
            # new as the pool will give them back (a quantized pool's reader sees what a later forward would)
            self.modes.hold(layer_idx, key_states, value_states)
            key_states, value_states = as_stored(self.pool.kv_format, key_states, value_states)
            if self.rows.num_columns:
                key_states, value_states = readback.with_history(self.pool, self.rows, key_states, value_states, layer_idx)
            handoff.stage(self, layer_idx, key_states, value_states)
            return key_states, value_states
        self._flush_pending()
        return self._write_gather(key_states, value_states, layer_idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i takes the blocks of row `beam_idx[i]` (shared, copy-on-write); no K/V copy."""
        self.finish_forward()
        self._select(_row_indices(beam_idx, self.rows.batch, "reorder_cache", takes_mask=False))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes `repeats` rows sharing its blocks."""
        if repeats < 1:
            raise ValueError(f"batch_repeat_interleave needs repeats >= 1, got {repeats}.")
        self.finish_forward()
        self._select([i for i in range(self.rows.batch) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps only the given rows (1-D row indices, or a boolean mask of one entry per row, as a tensor index
        takes them); the others' blocks are released."""
        self.finish_forward()
        self._select(_row_indices(indices, self.rows.batch, "batch_select_indices", takes_mask=True))

    def crop(self, max_length: int) -> None:
        """Removes `-max_length` tokens from the end of every row (`max_length <= 0`); a non-negative value
        is the length (in columns) to keep, as in older transformers."""
        self.finish_forward()
        self.forwards.cancel_refeed()
        drop = -max_length if max_length <= 0 else max(self.rows.num_columns - max_length, 0)
        hybrid = self.pool.layout.is_hybrid
        if hybrid and (drop or self.states.recording):
            try:
                self.states.check_crop(drop)
            except ValueError as error:
                raise ValueError(f"{NOT_CROPPABLE}: {error}") from None
        if drop > self.rows.num_columns:
            raise ValueError(f"crop({max_length}) removes more than the {self.rows.num_columns} columns cached.")
        self.forwards.check_crop(drop)
        self.rows.crop(drop)
        self.forwards.cropped(drop)
        if hybrid and self.states.recording:
            self.states.crop(drop)

    def crop_rows(self, drops: list[int]) -> None:
        """Removes the last `drops[b]` tokens of row b, each at most what the row stores (the Engine's
        speculative decoding rolls back each row's rejected drafts); blocks no longer needed are released."""
        self.finish_forward()
        if len(drops) != self.rows.batch or any(d < 0 or d > s for d, s in zip(drops, self.rows.seq_lens, strict=True)):
            raise ValueError(f"crop_rows({drops}): one count per row, each within its stored {self.rows.seq_lens}.")
        self.forwards.check_crop(max(drops, default=0))
        self.rows.crop_rows(drops)
        self.forwards.cropped(max(drops, default=0))

    def reset(self) -> None:
        """Releases every block and forgets the rows (the cache can be reused)."""
        self.finish_forward()
        self.rows.release_all()
        self.states.release_all()
        self.modes.reset()
        self.forwards.reset()

    # ------------------------------------------------------------------ our API
    def release(self) -> None:
        """Returns this cache's blocks to its pool (full prompt blocks stay indexed for prefix hits)."""
        self.reset()

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def fork(self) -> PagedCache:
        """A new cache holding the same rows, sharing every block (copy-on-write)."""
        self.finish_forward()
        other = type(self)(pool=self.pool, salt=self.salt, dedupe_rows=self.dedupe_rows)
        other.modes.model_config, other.modes.mode = self.modes.model_config, self.modes.mode
        other.forwards.copy_facts(self.forwards)
        other._sync_layers()
        other.rows.copy_from(self.rows)
        other.states.copy_from(self.states)
        other.non_text_names = self.non_text_names
        return other

    def __copy__(self) -> PagedCache:
        """`copy.copy` / `copy.deepcopy` (transformers' prompt-cache reuse): a `fork()`, a copy-on-write full copy."""
        return self.fork()

    def __iter__(self) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None, None]]:
        """`(keys, values, None)` per layer, as iterating a `DynamicCache` yields them (`layers[i].keys` and
        `.values`: read back right-aligned, `[batch, num_kv_heads, seq_length, head_dim]`; None for a layer that stores
        none); the third entry, a sliding layer's window tensor in a `DynamicCache`, is None."""
        for layer in self.layers:
            yield layer.keys, layer.values, None

    def __deepcopy__(self, memo: dict) -> PagedCache:
        return self.fork()

    def __reduce__(self) -> tuple:
        """Refuses pickling (`pickle`, `torch.save`) with what to do instead."""
        raise TypeError(
            "A PagedCache cannot be pickled: its K/V live in blocks of a KVPool shared with other caches. In one "
            "process, copy.deepcopy(cache) (or cache.fork()) copies it, sharing blocks copy-on-write; to resume a "
            "conversation elsewhere, keep its token ids and let that process's KVPool.new_cache() reuse what it "
            "has cached."
        )

    def finish_forward(self) -> None:
        """Ends the forward in flight, if any: a first layer's held K/V are stored, a complete forward commits,
        an incomplete one (a layer raised) rolls back. Every operation between forwards starts with it; callers
        driving the model forward by forward (the engine) call it after each one."""
        self._flush_pending()
        if self.forwards.close():
            self.states.attention_committed()
        if self.states.close(self.pool.layout.state_layers) and not self.forwards.gapped:
            # (a hole in a row's columns feeds its recurrent layers padding: their states are not the tokens')
            snapshot_block_ends(self.pool, self.rows, self.states)
        self._sync_layers()  # a cache without a config learns its number of layers from its first forward

    def plan_graph_forward(self, tokens_per_row: int = 1) -> ForwardPlan:
        """Plans a forward that a compiled graph runs (`attention/graph_step.py`): every row gets
        `tokens_per_row` new tokens; the returned plan's groups give each row's block table (after this forward's
        allocations) and the new tokens' slots. Finish with `finish_graph_forward(ran)`.

        Raises:
            OutOfBlocksError: the pool cannot hold the step; nothing was changed.
        """
        self.finish_forward()
        return self.forwards.open_for_graph(tokens_per_row)

    def finish_graph_forward(self, ran: bool) -> None:
        """Commits the planned graph forward when it `ran` (every layer wrote), rolls it back otherwise."""
        if ran:
            self.forwards.graph_written()
        self.finish_forward()

    def append_row_of(self, other: PagedCache, row: int = 0) -> None:
        """Appends `other`'s row `row` to this cache's rows, sharing its blocks; `other` keeps its own
        reference until it releases or drops the row. Both caches must be on one pool and between forwards."""
        self.finish_forward()
        other.finish_forward()
        if not 0 <= row < other.rows.batch:
            raise IndexError(f"append_row_of(): row {row} out of range for a cache of {other.rows.batch} rows.")
        self.rows.append_row(other.rows, row)
        self.states.append_row(other.states, row)

    def stats(self) -> PoolStats:
        """Statistics of the blocks this cache references (`blocks_total`/`bytes_reserved`: its pool's)."""
        usage = [self.rows.usage(g) for g in range(len(self.pool.layout.groups))]
        slots = len(set(self.states.slots))
        return self.pool.usage_stats(usage, self.rows.prefix_hit_tokens, self.rows.prefix_query_tokens, slots)

    def load_prompt(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
        non_text: Mapping[str, torch.Tensor] | None = None, config: PretrainedConfig | None = None,
    ) -> None:
        """Records the prompts this cache will be fed and takes the longest cached prefix of each row
        from the pool's prefix index (used by `KVPool.new_cache`); for a hybrid model, the longest whose end has a
        snapshot of the recurrent states (`prefix_hits.py`). The remaining columns may come in one
        forward or in several, in order (chunked prefill).

        Args:
            input_ids: `[batch, seq_len]` left-padded prompts.
            attention_mask: `[batch, seq_len]` with 0 on padding, or None. Bad ids or masks raise first.
            non_text: the prompts' non-text inputs as the processor returned them (`pixel_values`
                `[num_images, channels, height, width]`, `image_sizes`, ...): the prefix index keys each row's
                blocks from its first placeholder token on by them. Without them, no hit reaches a placeholder.
            config: the model's config (names its placeholder token ids); None for the pool's.
        """
        self.finish_forward()
        if self.rows.batch:
            raise ValueError("load_prompt() needs an empty cache; call reset() first.")
        snapshots = load_prompt(self.rows, input_ids, attention_mask, self.salt, non_text, config)
        self.non_text_names = frozenset(non_text or ())
        if snapshots is not None:  # a hybrid's hit: its rows start from the recurrent states at the hit's end
            self.states.adopt(snapshots)
        self.forwards.expect_prompt(input_ids.shape[1])

    def uncached_inputs(self, inputs: Mapping[str, object]) -> dict[str, object]:
        """`inputs` for `generate()` on this cache: without the non-text inputs given to `load_prompt` when the
        cache holds every placeholder token of its prompts (the model then must not encode them again; generate()
        feeds only the uncached columns), else all of them.

        Args:
            inputs: what the processor returned (`input_ids`, `attention_mask`, `pixel_values`, ...).

        Example:
            >>> with pool.new_cache(**inputs, model=model) as cache:
            ...     out = model.generate(**cache.uncached_inputs(inputs), cache=cache, max_new_tokens=32)
        """
        self.finish_forward()
        unknown = sorted(
            name for name, value in inputs.items()
            if isinstance(value, torch.Tensor) and name not in _TEXT_INPUTS and name not in self.non_text_names
        )
        if unknown and not self.rows.placeholder_ids():
            raise ValueError(
                f"These inputs carry {unknown}, which this cache was not given, and its pool knows no placeholder "
                "token ids (a KVPool made without the model's config learns only its language model's config, which "
                "names none): its rows and prefix hits would be keyed by token ids alone, and two images under one "
                "text would look the same. Pass them to the cache, `pool.new_cache(**inputs, model=model)`, or make "
                "the pool with the model's config, `KVPool(model.config)`."
            )
        if not self.non_text_names or not self.rows.placeholders_stored():
            return dict(inputs)
        return {k: v for k, v in inputs.items() if k not in self.non_text_names}

    def adopt_rows(self, parts: list[PagedCache], columns: int) -> None:
        """Becomes the rows of `parts` (one-row caches of this pool, each holding all but the last token of one
        left-padded prompt row of `columns` columns), sharing their blocks and state slots, and expects the last
        column (`KVPool.new_cache` prepares a hybrid's batch row by row this way; see `state_snapshots.py`).

        Args:
            parts: one cache per row, in row order; each keeps its own references until released.
            columns: the prompts' width, padding included.
        """
        self.finish_forward()
        if self.rows.batch:
            raise ValueError("adopt_rows() needs an empty cache; call reset() first.")
        for part in parts:
            self.append_row_of(part, 0)
            self.rows.note_prefix(part.prefix_query_tokens, part.prefix_hit_tokens)
        self.rows.stand_for(columns - 1)
        self.forwards.expect_prompt(columns)

    def commit_tokens(self, sequences: torch.Tensor) -> None:
        """Tells the cache which tokens it holds (e.g. `generate(...).sequences`), so its full blocks enter
        the pool's prefix index and a later `pool.new_cache()` of the conversation reuses them.

        Args:
            sequences: `[batch, columns]` with columns >= `get_seq_length()`; the first
                `get_seq_length()` columns are the ones this cache processed.
        """
        self.finish_forward()
        if sequences.shape[0] != self.rows.batch or sequences.shape[1] < self.rows.num_columns:
            raise ValueError(
                f"commit_tokens() expects [{self.rows.batch}, >= {self.rows.num_columns}] token ids, "
                f"got {list(sequences.shape)}."
            )
        self.rows.commit_tokens(sequences[:, : self.rows.num_columns].tolist(), self.salt)

    # ------------------------------------------------------------------ used by the attention function
    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        attention_mask: torch.Tensor | None,
        features: AttentionFeatures,
        want_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Writes this step's K/V of a layer and attends over the row's blocks (the `"paged"` path).

        Args:
            query: `[batch, num_heads, q_len, head_dim]`.
            key, value: `[batch, num_kv_heads, q_len, head_dim]` this step's K/V.
            attention_mask: bool `[batch, kv_len]` padding mask (True = real token) or None.
            features: the layer's scale, window, soft-capping and sinks.
            want_weights: also return the attention probabilities (`output_attentions=True`).

        Returns:
            `(out [batch, q_len, num_heads, head_dim], probabilities [batch, num_heads, q_len, columns] or None)`.
        """
        plan, key, value = self._open_paged(module, layer_idx, key, value, attention_mask)
        if not want_weights:
            out = fast_decode.attend(self.pool, plan, layer_idx, query, key, value, features)
            if out is not None:
                self._layer_done(layer_idx)
                return out, None
        return self._attend_columns(plan, layer_idx, layer_idx, query, key, value, attention_mask, features, want_weights)

    def write_and_read(
        self,
        module: torch.nn.Module | None,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        kv_layer: int,
        attention_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes this forward's K/V of a layer (`kv_layer == layer_idx`; a layer reusing `kv_layer`'s K/V writes
        nothing) and returns every row's K/V after the write, right-aligned over the last `width` columns like a
        left-padded `DynamicCache`'s: for a forward that transformers' own 4D mask, applied as given, must decide
        (some tokens attend later ones, `attention/paged.py`: Gemma 3's images; a caller's custom mask).

        Args:
            module: the attention module of a layer that writes (read for its config on a forward's first layer);
                None for a layer reusing `kv_layer`'s K/V.
            key, value: `[batch, num_kv_heads, q_len, head_dim]` and `[..., head_dim_v]` this forward's K/V (of
                `kv_layer`).
            attention_mask: transformers' `[batch, 1, q_len, width]` mask (bool, or float: blocked at its minimum) over
                every column fed so far, padding included (`get_mask_sizes`). A forward's first layer learns its
                padding from it: a real token sees itself, a padding column does not (a caller's own mask must not
                let a padding column see itself either: that column would be stored as a token).

        Returns:
            `[batch, num_kv_heads, width, head_dim]` and `[..., head_dim_v]` in the key's dtype.

        Raises:
            UnsupportedModelError: a row's real columns are not its last ones in this forward (right padding,
                holes), which the right-aligned read would misplace under the mask.
        """
        allowed = attention_mask if attention_mask.dtype == torch.bool else (
            attention_mask > torch.finfo(attention_mask.dtype).min / 2
        )
        batch, q_len, width = key.shape[0], attention_mask.shape[2], attention_mask.shape[-1]
        if kv_layer == layer_idx:
            # [batch, q_len]: a real token sees itself, a padding column nothing
            real = allowed[:, 0, :, -q_len:].diagonal(dim1=-2, dim2=-1).expand(batch, q_len)
            plan, key, value = self._open_paged(module, layer_idx, key, value, real)
        else:
            plan = self.forwards.plan
            if plan is None or plan.has_written(layer_idx) or kv_layer not in plan.kv_for_readers:
                raise RuntimeError(f"layer {layer_idx} reuses the K/V of layer {kv_layer}, which did not write in the "
                                   "forward in flight")
        if plan.column_order is not None:
            raise UnsupportedModelError(
                "attn_implementation='paged' applies transformers' 4D mask to rows whose padding precedes their "
                "tokens; this forward has padding after a real token (right padding). Pad on the left "
                "(tokenizer.padding_side = 'left'), or load the model with attn_implementation='sdpa'."
            )
        if kv_layer == layer_idx:
            write_gathered(self.pool, plan, layer_idx, key, value)
        out = readback.planned_kv(self.pool, plan, kv_layer, width, key.device, key.dtype)
        self._layer_done(layer_idx)
        return out

    def _open_paged(
        self,
        module: torch.nn.Module,
        layer_idx: int,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> tuple[ForwardPlan, torch.Tensor, torch.Tensor]:
        """The forward's plan, opened on its first layer under `"paged"`, and the layer's K/V to write (a first
        layer's held K/V where the mode was learned late); keeps them for the layers that reuse them."""
        plan = self.forwards.plan
        if plan is None or plan.has_written(layer_idx):  # a forward's first layer
            self._adopt_config(getattr(module, "config", None))
            self.modes.mode = "paged"
            if (pending := self.modes.take(layer_idx)) is not None:
                key, value = pending.key, pending.value  # consumed here (not the history view)
            plan = self.forwards.open(layer_idx, key, value, attention_mask, "paged", module)
        readers = self.pool.layout.readers
        if readers and layer_idx in readers.values():  # later layers attend over these K/V too
            plan.kv_for_readers[layer_idx] = key, value
        return plan, key, value

    def attend_reused(
        self,
        query: torch.Tensor,
        source_layer: int,
        layer_idx: int,
        attention_mask: torch.Tensor | None,
        features: AttentionFeatures,
        want_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attends a layer that reuses the K/V of an earlier layer of this forward (`LayerLayout.readers`: Gemma 3n,
        Gemma 4) over that layer's blocks, writing nothing.

        Args:
            query: `[batch, num_heads, q_len', head_dim]`: the forward's queries, or only its last `q_len'` per row
                (Gemma 4 keeps only the queries whose logits are asked for in these layers).
            source_layer: the layer whose K/V it reuses, which attended through `attend()` in this forward.
            attention_mask: bool `[batch, kv_len]` padding mask or None.

        Returns:
            `(out [batch, q_len', num_heads, head_dim], probabilities [batch, num_heads, q_len', columns] or None)`.
        """
        plan = self.forwards.plan
        written = None if plan is None or plan.has_written(layer_idx) else plan.kv_for_readers.get(source_layer)
        if written is None:
            raise RuntimeError(
                f"layer {layer_idx} reuses the K/V of layer {source_layer}, which did not attend through this cache "
                "in the forward in flight"
            )
        kept = query.shape[2]
        if kept > plan.q_len:
            raise ValueError(f"layer {layer_idx} has {kept} queries per row; the forward has {plan.q_len} columns.")
        if kept < plan.q_len and plan.column_order is None and not want_weights:
            # only the last columns' queries: attended alone, over the rows' whole stored history
            key, value = (t[:, :, -kept:] for t in written)
            out = attend_stored(self.pool, plan.last_columns(kept), source_layer, query, key, value, features)
            self._layer_done(layer_idx)
            return out, None
        if kept < plan.q_len:  # attend as the full forward, then keep the last columns' output
            front = query.new_zeros(*query.shape[:2], plan.q_len - kept, query.shape[3])
            query = torch.cat([front, query], dim=2)
        out, weights = self._attend_columns(
            plan, layer_idx, source_layer, query, *written, attention_mask, features, want_weights
        )
        if kept < plan.q_len:
            out, weights = out[:, -kept:], None if weights is None else weights[:, :, -kept:]
        return out, weights

    def _attend_columns(
        self,
        plan: ForwardPlan,
        layer_idx: int,
        kv_layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        features: AttentionFeatures,
        want_weights: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`attend()` (`kv_layer == layer_idx`: writes the K/V) or `attend_reused()` (reads `kv_layer`'s) of a
        forward's columns, in the plan's column order; marks `layer_idx` done."""
        order, given_query = plan.column_order, query
        if order is not None:  # right padding / holes: real columns of each row moved to the right, in order
            query, key, value = (take_columns(t, order) for t in (query, key, value))
        if kv_layer == layer_idx:
            out = write_and_attend(self.pool, plan, layer_idx, query, key, value, features)
        else:
            out = attend_stored(self.pool, plan, kv_layer, query, key, value, features)
        weights = None if not want_weights else readback.attention_weights(  # before the commit frees blocks
            self.pool, self.rows, kv_layer, given_query, attention_mask, features
        )
        self._layer_done(layer_idx)
        if order is not None:
            out = out.gather(1, plan.column_restore[:, :, None, None].expand_as(out))
        return out, weights

    def attention_still_open(self, layer_idx: int) -> bool:
        """Whether this layer's K/V were handed over as history + new before the mode was known (`modes.py`)."""
        return self.modes.still_open(layer_idx)

    def layer_kv(self, layer_idx: int, which: int) -> torch.Tensor | None:
        """A layer's stored keys (`which=0`) or values (`1`), gathered `[batch, num_kv_heads, seq_length,
        head_dim]` and right-aligned like a left-padded contiguous cache; None before anything is stored."""
        if not self.rows.batch or not self.pool.has_layer(layer_idx):
            return None
        return readback.stored_kv(self.pool, self.rows, layer_idx)[which]

    # ------------------------------------------------------------------ internals
    def _select(self, indices: list[int]) -> None:
        """Row i becomes old row `indices[i]`: its blocks and its state slot, shared."""
        self.rows.select(indices)
        self.states.select(indices)

    def _check_encoder_decoder(self, config: PretrainedConfig | None) -> None:
        """Refuses an encoder-decoder model's config unless this cache is the self-attention half of an
        `EncoderDecoderPagedCache` (only then does nothing else reach it)."""
        if getattr(config, "is_encoder_decoder", False) and not self.causal_writers_only:
            raise encoder_decoder_error(config)

    def _sync_layers(self) -> None:
        """Creates `self.layers` (one `PagedLayer` per model layer) once the number of layers is known."""
        self.layers = paged_layers(self, self.layers, self.pool.layout, self.forwards.learned_layers)

    def _adopt_config(self, config: PretrainedConfig | None) -> None:
        """Learns the model's config from its attention module (a cache made without one), and has the pool
        check that this model's layers are the ones its blocks were made for."""
        if config is None or (config is self.pool.config and config is self.modes.model_config):
            return  # (every forward's first layer: nothing new to learn once the pool and the modes have it)
        self._check_encoder_decoder(config)
        if config is not self.pool.config:
            self.pool.bind_config(config)
        self.modes.learn(config)
        self._sync_layers()

    def _flush_pending(self) -> None:
        """The first layer's held K/V were not read by the paged attention: store them the plain way."""
        pending = self.modes.release()
        if pending is not None:
            self._write_gather(pending.key, pending.value, pending.layer_idx)

    def _write_gather(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain-attention path: store every column, return right-aligned contiguous K/V."""
        self.modes.mode = "gather"
        plan = self.forwards.open(layer_idx, key, value, None, "gather")
        if not self.layers and self.forwards.learned_layers:  # the first forward, committed here, counted the layers
            self._sync_layers()
        write_gathered(self.pool, plan, layer_idx, key, value)
        out = readback.planned_kv(self.pool, plan, layer_idx, self.rows.num_columns, key.device, key.dtype)
        self._layer_done(layer_idx)
        return out

    def _restart_if_refed(self, q_len: int) -> None:
        """The first call that knows the width of a forward after `activate_past_recording()` on a cache that held
        tokens: when the forward feeds the whole prompt again (`Forwards.take_refeed`: assisted decoding's first
        forward, wider than what the rows hold), the rows drop what they hold and store it anew, and a hybrid model's
        layers start from no state. Under an attention that reads this cache gathered, transformers' mask for that
        forward spans the held tokens too, so the cache refuses, before anything changes."""
        if not self.forwards.take_refeed(q_len):
            return
        if self.modes.for_update(self.rows.num_columns) == "gather":
            raise ValueError(
                f"generate()'s assisted and prompt-lookup decoding feed their first forward the whole prompt "
                f"({q_len} tokens with the first drafts) although this cache holds {self.rows.num_columns} of them, "
                "and transformers builds that forward's mask over both: an attention that reads the cache gathered "
                "(attn_implementation other than 'paged') would attend to the prompt twice. Load the model with "
                "attn_implementation='paged', or pass a new cache to assisted decoding."
            )
        self.forwards.drop_for_refeed()
        if self.pool.layout.is_hybrid:
            self.states.restart()

    def _layer_done(self, layer_idx: int) -> None:
        """A layer stored its K/V; the forward commits after its last one (which a hybrid's states learn)."""
        self.forwards.layer_done(layer_idx)
        if self.forwards.plan is None and self.pool.layout.state_layers:
            self.states.attention_committed()


def _row_indices(indices: object, batch: int, name: str, takes_mask: bool) -> list[int]:
    """The row numbers of `indices` (a sequence or tensor of row indices; with `takes_mask`, also a boolean mask with
    one entry per row), or a `ValueError` naming `name` for any other form."""
    index = torch.as_tensor(indices, device="cpu")  # (read back as Python ints)
    if index.dtype == torch.bool:
        if not takes_mask or index.dim() != 1 or index.shape[0] != batch:
            what = "row indices" if not takes_mask else f"row indices or a boolean mask of {batch} entries"
            raise ValueError(f"{name} takes {what}, got a boolean tensor of shape {list(index.shape)}.")
        return index.nonzero().flatten().tolist()
    if index.dim() > 1 or index.is_floating_point() or index.is_complex():
        raise ValueError(f"{name} takes a 1-D sequence of row indices, got {index.dtype} of shape {list(index.shape)}.")
    return index.reshape(-1).tolist()


__all__ = ["PagedCache"]
