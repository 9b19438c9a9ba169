"""`PagedCache`: a `transformers.Cache` whose K/V live in refcounted blocks of a `KVPool`."""

from __future__ import annotations

import warnings
import weakref
from collections import Counter
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from . import handoff
from .cache_layers import PagedLayer
from .compat import CHUNKED_PREFILL_SKIPS_CACHED_COLUMNS
from .plan import ForwardPlan, GroupPlan
from .pool import KVPool
from .quant import dequantize
from .dedupe import identical_rows
from .distributed import tensor_parallel_group
from .prefix_hits import load_prompt
from .rows import Rows
from .stats import PoolStats
from .torch_backend import attention_probs, torch_paged_attention, torch_write
from .support import UnsupportedStateMixin


@dataclass(slots=True)
class _Pending:
    """New K/V of the first layer of a first forward, before we know which attention will read them."""

    layer_idx: int
    key: torch.Tensor
    value: torch.Tensor


class PagedCache(UnsupportedStateMixin, Cache):
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

    def __init__(
        self,
        config: PretrainedConfig | None = None,
        *,
        block_size: int | None = None,
        pool: KVPool | None = None,
        num_blocks: int | None = None,
        max_memory: int | None = None,
        salt: str | bytes | None = None,
        dedupe_rows: bool = True,
        kv_dtype: str | None = None,
    ) -> None:
        super().__init__(layers=[])
        if pool is None:
            pool = KVPool(
                config, block_size=16 if block_size is None else block_size, num_blocks=num_blocks,
                max_memory=max_memory, prefix_caching=False, kv_dtype=kv_dtype,
            )
        else:
            if num_blocks is not None or max_memory is not None:
                raise ValueError("num_blocks/max_memory size a private pool; set them on the KVPool you pass.")
            if kv_dtype is not None and kv_dtype != pool.kv_dtype:
                raise ValueError(
                    f"kv_dtype={kv_dtype!r} differs from the pool's kv_dtype={pool.kv_dtype!r}; the pool owns the "
                    "storage format: create it with KVPool(config, kv_dtype=...)."
                )
            if block_size is not None and block_size != pool.block_size:
                raise ValueError(f"block_size={block_size} differs from the pool's block_size={pool.block_size}.")
            if config is not None:
                pool.bind_config(config)
        self.pool = pool
        # The config whose `_attn_implementation` tells which attention reads this cache: given here, or
        # learned from the model by the "paged" attention (a pool's config may belong to a sibling model).
        self.model_config: PretrainedConfig | None = config
        self.salt = salt
        self.dedupe_rows = dedupe_rows
        self.mode: str | None = None  # "paged" | "gather" once known
        self.rows = Rows(pool)
        self.plan: ForwardPlan | None = None
        self._pending: _Pending | None = None
        self._expected_columns: int | None = None
        self._first_prompt_forward = False  # the next forward is the first since load_prompt()
        self._learned_layers: int | None = None
        # Padding after a real token (right padding, holes) in some row, and, once so, the fewest real columns
        # any row has at its end: a crop of more columns than that cannot know how many tokens to drop.
        self._gapped = False
        self._real_tail = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        pool.register_cache(self)
        self._finalizer = weakref.finalize(self, Rows.release_all, self.rows)
        self._sync_layers()

    # ------------------------------------------------------------------ transformers.Cache API
    def __repr__(self) -> str:
        return (
            f"PagedCache(rows={self.rows.batch}, seq_length={self.get_seq_length()}, "
            f"block_size={self.pool.block_size}, mode={self.mode})"
        )

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def batch_size(self) -> int:
        return self.rows.batch if self.rows.batch else -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return self.rows.batch > 0

    # ------------------------------------------------------------------ read accessors
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
        group = self.pool.layout.group_of(layer_idx)
        return list(self.rows.tables[group][row]) if group < len(self.rows.tables) else []

    def block_tables(self, layer_idx: int = 0) -> list[list[int]]:
        """`block_table(row, layer_idx)` of every row."""
        return [self.block_table(b, layer_idx) for b in range(self.rows.batch)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns already processed (padding included): what `generate()` slices its inputs by."""
        self._settle(final=False)
        if self.plan is not None and self.plan.complete is False:
            return self.plan.undo.num_columns  # mid-forward: what was there before it
        return self.rows.num_columns

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
        """
        mode = self._resolve_mode()
        if mode == "paged":
            handoff.stage(self, layer_idx, key_states, value_states)
            return key_states, value_states
        if mode is None and self._pending is None and self.plan is None:
            # First forward, attention unknown: defer the write. The paged attention function consumes the
            # pending K/V; any other attention reads the returned history + new K/V, and the next call
            # stores the pending K/V the plain way.
            self._pending = _Pending(layer_idx, key_states, value_states)
            if self.rows.num_columns:
                key_states, value_states = self._with_history(key_states, value_states, layer_idx)
            handoff.stage(self, layer_idx, key_states, value_states)
            return key_states, value_states
        self._flush_pending()
        return self._write_gather(key_states, value_states, layer_idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i takes the blocks of row `beam_idx[i]` (shared, copy-on-write); no K/V copy."""
        self._settle(final=True)
        self.rows.select(self._indices(beam_idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes `repeats` rows sharing its blocks."""
        if repeats < 1:
            raise ValueError(f"batch_repeat_interleave needs repeats >= 1, got {repeats}.")
        self._settle(final=True)
        self.rows.select([i for i in range(self.rows.batch) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps only the given rows; the others' blocks are released."""
        self._settle(final=True)
        self.rows.select(self._indices(indices))

    def crop(self, max_length: int) -> None:
        """Removes `-max_length` tokens from the end of every row (`max_length <= 0`); a non-negative value
        is the length (in columns) to keep, as in older transformers."""
        self._settle(final=True)
        drop = -max_length if max_length <= 0 else max(self.rows.num_columns - max_length, 0)
        if drop > self.rows.num_columns:
            raise ValueError(f"crop({max_length}) removes more than the {self.rows.num_columns} columns cached.")
        if self._gapped and drop > self._real_tail:
            raise ValueError(
                f"crop({max_length}) reaches back over padding that follows real tokens (right padding or a hole "
                f"in attention_mask): only the last {self._real_tail} columns are known to be real tokens of every "
                "row, and a paged cache stores no padding. Crop at most that many, or left-pad the batch."
            )
        self.rows.crop(drop)
        self._real_tail = max(0, self._real_tail - drop)

    def reset(self) -> None:
        """Releases every block and forgets the rows (the cache can be reused)."""
        self._settle(final=True)
        self._pending = None
        self.rows.release_all()
        self.mode = None
        self._expected_columns, self._first_prompt_forward = None, False
        self._gapped, self._real_tail = False, 0

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
        self._settle(final=True)
        other = PagedCache(pool=self.pool, salt=self.salt, dedupe_rows=self.dedupe_rows)
        other.model_config, other.mode, other._learned_layers = self.model_config, self.mode, self._learned_layers
        other._gapped, other._real_tail = self._gapped, self._real_tail
        other._sync_layers()
        other.rows.copy_from(self.rows)
        return other

    def finish_forward(self) -> None:
        """Closes the last forward now: commits it when every layer wrote, rolls it back otherwise (a forward
        that raised). Callers driving the model forward by forward (the engine) call it after each one."""
        self._settle(final=True)

    def append_row_of(self, other: PagedCache, row: int = 0) -> None:
        """Appends `other`'s row `row` to this cache's rows, sharing its blocks; `other` keeps its own
        reference until it releases or drops the row. Both caches must be on one pool and between forwards."""
        self._settle(final=True)
        other._settle(final=True)
        if not 0 <= row < other.rows.batch:
            raise IndexError(f"append_row_of(): row {row} out of range for a cache of {other.rows.batch} rows.")
        self.rows.append_row(other.rows, row)

    def stats(self) -> PoolStats:
        """Statistics of the blocks this cache references (`blocks_total`/`bytes_reserved`: its pool's)."""
        self._settle(final=False)
        with self.pool.lock:
            return self.pool._stats(self)

    def load_prompt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Records the prompts this cache will be fed and takes the longest cached prefix of each row
        from the pool's prefix index (used by `KVPool.new_cache`). The remaining columns may come in one
        forward or in several, in order (chunked prefill).

        Args:
            input_ids: `[batch, seq_len]` left-padded prompts.
            attention_mask: `[batch, seq_len]` with 0 on padding, or None.
        """
        self._settle(final=True)
        if self.rows.batch:
            raise ValueError("load_prompt() needs an empty cache; call reset() first.")
        hits = load_prompt(self.rows, input_ids, attention_mask, self.salt)
        self.prefix_query_tokens += hits[0]
        self.prefix_hit_tokens += hits[1]
        with self.pool.lock:
            self.pool.prefix_query_tokens += hits[0]
            self.pool.prefix_hit_tokens += hits[1]
        self._expected_columns = input_ids.shape[1] - self.rows.num_columns
        self._first_prompt_forward = True

    def commit_tokens(self, sequences: torch.Tensor) -> None:
        """Tells the cache which tokens it holds (e.g. `generate(...).sequences`), so its full blocks enter
        the pool's prefix index and a later `pool.new_cache()` of the conversation reuses them.

        Args:
            sequences: `[batch, columns]` with columns >= `get_seq_length()`; the first
                `get_seq_length()` columns are the ones this cache processed.
        """
        self._settle(final=True)
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
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Writes this step's K/V of a layer and attends over the row's blocks (the `"paged"` path).

        Args:
            query: `[batch, num_heads, q_len, head_dim]`.
            key, value: `[batch, num_kv_heads, q_len, head_dim]` this step's K/V.
            attention_mask: bool `[batch, kv_len]` padding mask (True = real token) or None.

        Returns:
            `[batch, q_len, num_heads, head_dim]`.
        """
        from .backend import attention_backend  # noqa: PLC0415

        if self.mode != "paged":  # only K/V staged for "paged" reach here: the mode was unknown until now
            self._adopt_config(getattr(module, "config", None))
            self.mode = "paged"
        config = getattr(module, "config", None)
        if config is not None and config is not self.pool.config:  # another model: its layers must match
            self.pool.bind_config(config)
        if self._pending is not None and self._pending.layer_idx == layer_idx:
            key, value = self._pending.key, self._pending.value  # consumed here (not the history view)
            self._pending = None
        plan = self._plan_for(layer_idx, key, value, attention_mask, module)
        order = plan.column_order
        if order is not None:  # right padding / holes: real columns of each row moved to the right, in order
            query, key, value = (_take_columns(t, order) for t in (query, key, value))
        group_id = self.pool.layout.group_of(layer_idx)
        with self.pool.lock:  # a concurrent growth of this layer's tensors must not lose the write
            key_cache, value_cache = self.pool.storage(layer_idx, key)
            scales = self.pool.scales(layer_idx)
            # Reordered columns: only the PyTorch path gives padding queries what transformers' masks show them.
            use_triton = order is None and (
                attention_backend(
                    query, key_cache, value_cache, sliding_window=sliding_window, softcap=softcap, sinks=sinks
                )
                == "triton"
            )
            if use_triton:
                from .triton_path import triton_write  # noqa: PLC0415

                triton_write(plan, group_id, key, value, key_cache, value_cache, scales)
            else:
                torch_write(key_cache, value_cache, key, value, *plan.write_index(group_id, key.device), scales)
        if use_triton:
            from .triton_path import triton_attention  # noqa: PLC0415

            out = triton_attention(
                plan, group_id, query, key_cache, value_cache, scale, sliding_window, softcap, sinks, scales=scales
            )
        else:
            meta = plan.torch_meta(group_id, sliding_window, query.device)
            out = torch_paged_attention(query, key, value, key_cache, value_cache, meta, scale, softcap, sinks, scales)
        plan.layers_written.add(layer_idx)
        if order is not None:
            out = out.gather(1, plan.column_restore[:, :, None, None].expand_as(out))
        return out

    def attention_weights(
        self,
        layer_idx: int,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """The attention probabilities of a layer's forward, laid out like `DynamicCache`'s (one column per
        column fed, padding included, zero there; sliding layers: the last `window - 1 + q_len` columns), for
        `output_attentions=True`. Call after `attend()`.

        Args:
            query: `[batch, num_heads, q_len, head_dim]`.
            attention_mask: bool `[batch, columns]` padding mask or None.

        Returns:
            `[batch, num_heads, q_len, columns]` in the query's dtype.
        """
        keys = self._stored_kv(layer_idx)[0]  # right-aligned: [batch, num_kv_heads, columns, head_dim]
        batch, _, width, _ = keys.shape
        q_len = query.shape[2]
        real = torch.ones(batch, width, dtype=torch.bool) if attention_mask is None else attention_mask[:, -width:].cpu()
        counts = real.sum(dim=1)
        if not bool((real == (torch.arange(width)[None, :] >= (width - counts)[:, None])).all()):
            placed = torch.zeros_like(keys)  # a row's i-th stored token sits at its i-th real column
            for b in range(batch):
                n = int(counts[b])
                placed[b, :, real[b].nonzero().squeeze(1).to(keys.device)] = keys[b, :, width - n :]
            keys = placed
        q_pos = torch.arange(width - q_len, width)[:, None]
        k_pos = torch.arange(width)[None, :]
        allowed = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window if sliding_window is not None else True)
        allowed = real[:, None, None, :] & allowed[None, None]
        allowed = (allowed | ~allowed.any(dim=-1, keepdim=True)).to(query.device)
        probs = attention_probs(query, keys.to(query.dtype), allowed, False, scale, softcap, sinks)
        probs = probs.masked_fill(~real[:, None, None, :].to(query.device), 0.0).to(query.dtype)
        if sliding_window is not None:  # a sliding layer of DynamicCache keeps window - 1 past columns
            probs = probs[..., -min(width, sliding_window - 1 + q_len) :]
        return probs

    def attention_still_open(self, layer_idx: int) -> bool:
        """Whether this layer's K/V were handed over before the cache knew which attention reads them (the
        first forward of a cache without a config): history + new K/V, not yet stored."""
        return self.mode is None and self._pending is not None and self._pending.layer_idx == layer_idx

    def layer_kv(self, layer_idx: int, which: int) -> torch.Tensor | None:
        """A layer's stored keys (`which=0`) or values (`1`), gathered `[batch, num_kv_heads, seq_length,
        head_dim]` and right-aligned like a left-padded contiguous cache; None before anything is stored."""
        self._settle(final=False)
        if not self.rows.batch or layer_idx not in self.pool.key_caches:
            return None
        return self._stored_kv(layer_idx)[which]

    # ------------------------------------------------------------------ internals
    def _sync_layers(self) -> None:
        """Creates `self.layers` (one `PagedLayer` per model layer) once the number of layers is known."""
        layout = self.pool.layout
        if layout.num_layers is not None:
            count = max(layout.layer_to_group, default=-1) + 1
        else:
            count = self._learned_layers or 0
        if len(self.layers) == count:
            return
        windows = [g.sliding_window for g in layout.groups]
        self.layers = [
            PagedLayer(self, i, windows[layout.layer_to_group[i]] if i in layout.layer_to_group else None)
            for i in range(count)
        ]

    def _adopt_config(self, config: PretrainedConfig | None) -> None:
        if config is None or self.model_config is config:
            return
        if self.model_config is None:
            self.model_config = config
        if self.pool.config is None:
            self.pool.bind_config(config)
        self._sync_layers()

    def _resolve_mode(self) -> str | None:
        impl = getattr(self.model_config, "_attn_implementation", None) if self.model_config else None
        if impl is None:
            return self.mode
        if impl == "paged":
            if self.mode == "gather" and self.rows.num_columns:
                return "gather"  # padding was stored: keep the plain path (paged attention reads it gathered)
            return "paged"
        if self.mode == "paged" or self.mode is None:
            self.mode = "gather"
        return "gather"

    def _flush_pending(self) -> None:
        """The first layer's deferred K/V were not read by the paged attention: store them the plain way."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.mode = "gather"
            self._write_gather(pending.key, pending.value, pending.layer_idx)

    def _settle(self, final: bool) -> None:
        """Closes the last forward: commits it when every layer wrote; rolls it back when some layer did
        not and `final` (the caller is between forwards: a layer raised)."""
        if self._pending is not None and (final or self.plan is None):
            self._flush_pending()
        plan = self.plan
        if plan is None:
            return
        complete = plan.complete
        if complete is False and not final:
            return
        self.plan = None
        if complete is False:
            self.rows.rollback(plan)
            if plan.rows_before:
                self._collapse_rows(plan.rows_before)
            return
        if plan.num_layers is None:
            self._learned_layers = len(plan.layers_written)
            self._sync_layers()
        self._gapped = plan.gapped
        self._real_tail = self._real_tail + plan.q_len if plan.real_tail == plan.q_len else plan.real_tail
        self.rows.commit(plan, self.salt, free_window=self.mode == "paged")

    def _plan_for(
        self,
        layer_idx: int,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        module: torch.nn.Module | None = None,
    ) -> ForwardPlan:
        """The current forward's plan, building it on the first layer of a new forward (under tensor
        parallelism, alike on every rank of `module`'s group, see `distributed.py`)."""
        if self.plan is not None and layer_idx not in self.plan.layers_written:
            return self.plan
        self._settle(final=True)
        group = tensor_parallel_group(module) if module is not None and self.dedupe_rows else None
        batch, _, q_len, _ = key.shape
        query_lens, order, count = _real_columns(attention_mask, batch, q_len)
        gapped, real_tail = self._padding_facts(attention_mask, q_len)
        if order is not None:
            key, value = _take_columns(key, order), _take_columns(value, order)
        self._check_expected_columns(q_len)
        with self.pool.lock:
            self.pool.ensure_allocators(key)
            rows_before = self.rows.batch
            self.rows.ensure_batch(batch)
            expanded = rows_before not in (0, batch)
            try:
                self.plan = self.rows.plan_forward(
                    query_lens,
                    q_len,
                    identical_rows(self.rows, key, value, query_lens, q_len, group) if self.dedupe_rows else None,
                    self.pool.layout.num_layers or self._learned_layers,
                )
            except BaseException:
                if expanded:
                    self._collapse_rows(rows_before)
                raise
            if expanded:
                self.plan.rows_before = rows_before  # a rollback also undoes the row expansion
            if order is not None:
                self.plan.column_order, self.plan.column_restore = order, order.argsort(dim=1)
                self.plan.column_count = count
            self.plan.gapped, self.plan.real_tail = gapped, real_tail
        return self.plan

    def _padding_facts(self, attention_mask: torch.Tensor | None, q_len: int) -> tuple[bool, int]:
        """`(gapped, real_tail)` of the forward about to be planned (see `ForwardPlan`), refusing, before
        anything is stored, one whose sliding windows would differ from transformers'.

        transformers measures a sliding window in columns, padding included; a paged cache stores real tokens
        only. The two agree while padding only precedes a row's tokens (left padding). Once a row has padding
        after a real token, they differ as soon as a window is shorter than the columns seen.
        """
        if attention_mask is None:
            return self._gapped, q_len
        columns = attention_mask[:, -(self.rows.num_columns + q_len) :].to(torch.bool)
        seen = columns.cumsum(dim=1) > 0  # a real token at or before this column
        gapped = self._gapped or bool((seen & ~columns).any())
        real_tail = int(columns[:, -q_len:].flip(1).to(torch.int64).cumprod(dim=1).sum(dim=1).min())
        windows = [g.sliding_window for g in self.pool.layout.groups if g.sliding_window is not None]
        if gapped and windows and self.rows.num_columns + q_len > min(windows):
            raise ValueError(
                f"This model has sliding-window layers (window {min(windows)}) and a row of this batch has padding "
                "after its first real token (right padding or a hole in attention_mask). transformers measures "
                "windows in columns, padding included, and a paged cache stores real tokens only, so the results "
                "would differ. Left-pad the batch (tokenizer.padding_side = 'left') or drop the padding columns."
            )
        return gapped, real_tail

    def _collapse_rows(self, rows_before: int) -> None:
        """Undoes `ensure_batch`'s expansion of each row into `batch / rows_before` copies."""
        self.rows.select(list(range(0, self.rows.batch, self.rows.batch // rows_before)))

    def _write_gather(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain-attention path: store every column, return right-aligned contiguous K/V."""
        self.mode = "gather"
        batch, _, q_len, _ = key.shape
        plan = self._plan_for(layer_idx, key, value, None)
        group_id = self.pool.layout.group_of(layer_idx)
        with self.pool.lock:
            key_cache, value_cache = self.pool.storage(layer_idx, key)
            scales = self.pool.scales(layer_idx)
            torch_write(key_cache, value_cache, key, value, *plan.write_index(group_id, key.device), scales)
        plan.layers_written.add(layer_idx)
        width = self.rows.num_columns
        index, valid = self.rows.gather_slots(plan, group_id, width, key.device)
        out_k, out_v = self._read_slots(layer_idx, index, key.dtype)
        out_k, out_v = (t.view(batch, width, *t.shape[1:]) for t in (out_k, out_v))
        if valid is not None:
            out_k, out_v = out_k * valid, out_v * valid
        return out_k.transpose(1, 2), out_v.transpose(1, 2)

    def _read_slots(self, layer_idx: int, index: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V at slots `index` (int64 `[n]`), `[n, num_kv_heads, head_dim]` each in `dtype`
        (dequantized from a quantized pool)."""
        scales = self.pool.scales(layer_idx) or (None, None)
        out = []
        for cache, scale in zip((self.pool.key_caches[layer_idx], self.pool.value_caches[layer_idx]), scales, strict=True):
            rows = cache.view(-1, *cache.shape[2:]).index_select(0, index)
            if scale is not None:
                rows = dequantize(rows, scale.view(-1, scale.shape[2]).index_select(0, index), dtype)
            out.append(rows)
        return out[0], out[1]

    def _stored_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a layer stores now (outside any forward), `[rows, num_kv_heads, seq_length, head_dim]` each,
        right-aligned (columns left of a shorter row are zeros), in the model's dtype."""
        key_cache = self.pool.key_caches[layer_idx]
        stored, width = self.rows.batch, self.rows.num_columns
        index, valid = self.rows.stored_slots(self.pool.layout.group_of(layer_idx), width, key_cache.device)
        out = []
        for rows in self._read_slots(layer_idx, index, self.pool.model_dtypes[layer_idx]):
            rows = rows.view(stored, width, *rows.shape[1:])
            rows = rows * valid.to(rows.dtype) if valid is not None else rows
            out.append(rows.transpose(1, 2))
        return out[0], out[1]

    def _with_history(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored history (right-aligned, `[batch, num_kv_heads, seq_length, head_dim]`) followed by the new
        K/V, without writing anything (first forward of a cache that already holds a prefix)."""
        past = []
        for rows in self._stored_kv(layer_idx):
            if key.shape[0] != rows.shape[0]:  # generate repeated the prompt rows (num_return_sequences / num_beams)
                rows = rows.repeat_interleave(key.shape[0] // rows.shape[0], dim=0)
            past.append(rows.to(key.dtype))
        return torch.cat([past[0], key], dim=2), torch.cat([past[1], value], dim=2)

    def _check_expected_columns(self, q_len: int) -> None:
        """After `load_prompt`, the first forward (or the first forwards, in chunks) must bring exactly the
        prompt's remaining columns.

        A forward of the whole prompt or more (transformers' assisted and prompt-lookup decoding feed the
        prompt and their first candidates in one forward, whatever the cache holds; so does the chunked
        prefill of releases before 5.23, in chunks) recomputes the prefix:
        a prefix hit is released before anything is planned, so the tokens are stored once, at their
        positions, and the recorded prompt is still what the forward's first columns are.
        Any other width means the recorded tokens are not what is being fed: they are dropped (never
        indexed), with a warning."""
        expected, self._expected_columns = self._expected_columns, None
        first, self._first_prompt_forward = self._first_prompt_forward, False
        if expected is None or q_len == expected:
            return
        held = self.rows.num_columns
        if first and held and not CHUNKED_PREFILL_SKIPS_CACHED_COLUMNS and q_len < expected + held:
            # this release's chunked prefill starts at the prompt's first column whatever the cache holds
            self._release_prefix_hit()
            expected, held = expected + held, 0
        if q_len < expected:  # a chunk of the remaining columns (generate's prefill_chunk_size)
            self._expected_columns = expected - q_len
            return
        if q_len >= expected + held:  # the whole prompt (and more) from its first column
            if held:
                self._release_prefix_hit()
            return
        warnings.warn(
            f"This cache was prepared for prompts of {expected} more columns but got {q_len}; it will not "
            "index its blocks for prefix reuse. Pass the same input_ids to new_cache() and generate().",
            stacklevel=4,
        )
        self.rows.forget_tokens()

    def _release_prefix_hit(self) -> None:
        """Releases what `load_prompt` took from the prefix index (the prompt is fed again from its first
        column) and stops reporting it as served."""
        released = self.rows.drop_stored()
        self.prefix_hit_tokens -= released
        with self.pool.lock:
            self.pool.prefix_hit_tokens -= released

    @staticmethod
    def _indices(indices: torch.Tensor | list[int]) -> list[int]:
        return indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)

    # ------------------------------------------------------------------ for the pool
    def block_refs(self) -> list[Counter[int]]:
        """Per group, block id -> references from this cache's tables."""
        return self.rows.block_refs()

    def filled_slots(self, group_id: int) -> dict[int, int]:
        """Per block id of a group, the largest number of token slots any of this cache's rows fills."""
        return self.rows.filled_slots(group_id)

    def check_rows(self) -> None:
        """Raises AssertionError if a row's table does not hold exactly the blocks its length needs."""
        self.rows.check()


def _real_columns(
    attention_mask: torch.Tensor | None, batch: int, q_len: int
) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
    """Real new tokens per row and, when some row's real columns are not its last ones, the column order
    that moves them there.

    Args:
        attention_mask: bool `[batch, kv_len]` padding mask (its last `q_len` columns are this forward's) or None.

    Returns:
        `(query_lens, order, count)`: `order` is int64 `[batch, q_len]` (padding columns first, then the real
        ones in their order) and `count` the real columns up to and including each column, in that order; both
        None when every row's real columns are already right-aligned.
    """
    if attention_mask is None:
        return [q_len] * batch, None, None
    real = attention_mask[:, -q_len:].to(torch.bool)
    counts = real.sum(dim=1)
    right_aligned = torch.arange(q_len, device=real.device)[None, :] >= (q_len - counts)[:, None]
    if bool((real == right_aligned).all()):
        return counts.tolist(), None, None
    order = real.to(torch.int8).argsort(dim=1, stable=True)
    return counts.tolist(), order, real.to(torch.int64).cumsum(dim=1).gather(1, order)


def _take_columns(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`tensor[b, :, order[b], :]` for `[batch, heads, q_len, head_dim]` tensors."""
    index = order.to(tensor.device)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
    return tensor.gather(2, index)


__all__ = ["PagedCache", "GroupPlan"]
