"""`Forwards`: the forward in flight of one cache — planned on its first layer, committed when its last
layer is done, rolled back when it did not finish — and what the model's inputs said about it.

A forward's inputs tell the cache more than its K/V: the 2D padding mask says which columns are real
(right padding and holes reorder them, `ForwardPlan.column_order`), whether padding ever followed a real
token (`gapped`, which limits `crop()` and sliding windows), and a cache prepared by `load_prompt()`
expects the prompt's remaining columns (in one forward or in chunks). All of that is decided here, once
per forward, before `Rows.plan_forward` changes anything.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from ..compat import ASSISTED_REFEEDS_PROMPT, CHUNKED_PREFILL_SKIPS_CACHED_COLUMNS
from .dedupe import identical_rows
from ..distributed import tensor_parallel_group
from ..attention.plan import ForwardPlan
from .rows import Rows

if TYPE_CHECKING:
    from ..memory.pool import BlockPool


class Forwards:
    """Owns one cache's forward in flight and the facts its inputs established.

    Attributes:
        plan: the forward in flight, or None between forwards.
        learned_layers: layers a forward wrote, for a cache whose model config is unknown (None before).
        gapped: some row has had padding after a real token (right padding, a hole).
        real_tail: with `gapped`, the fewest real columns any row has at its end.
    """

    def __init__(self, rows: Rows, pool: BlockPool, dedupe_rows: bool) -> None:
        self.rows, self.pool, self.dedupe_rows = rows, pool, dedupe_rows
        self.plan: ForwardPlan | None = None
        self.learned_layers: int | None = None
        self.gapped = False
        self.real_tail = 0
        self._expected_columns: int | None = None
        self._first_prompt_forward = False  # the next forward is the first since load_prompt()
        self._refeed_from: int | None = None  # assisted decoding begins: the columns the rows held then
        self._committed: ForwardPlan | None = None  # the last forward, committed; None once another began

    def copy_facts(self, other: Forwards) -> None:
        """Takes another cache's facts (a fork between forwards)."""
        self.learned_layers, self.gapped, self.real_tail = other.learned_layers, other.gapped, other.real_tail

    def reset(self) -> None:
        """Forgets everything (the rows were released)."""
        self.plan, self._expected_columns, self._first_prompt_forward = None, None, False
        self._refeed_from = None
        self.gapped, self.real_tail, self._committed = False, 0, None

    @property
    def columns_before(self) -> int:
        """Columns processed by completed forwards: during a forward, what was there before it."""
        if self.plan is not None and self.plan.complete is False:
            return self.plan.undo.num_columns
        return self.rows.num_columns

    def expect_prompt(self, columns: int) -> None:
        """`load_prompt()` recorded a prompt of `columns` columns; the rows hold its cached prefix."""
        self._expected_columns = columns - self.rows.num_columns
        self._first_prompt_forward = True

    def expect_refeed(self) -> None:
        """generate() begins assisted (or prompt-lookup) decoding on this cache: it calls `activate_past_recording()`
        right before its first forward, which on the releases we test feeds the whole prompt whatever the cache
        holds (`compat.ASSISTED_REFEEDS_PROMPT`). So a next forward of more columns than the rows hold now is that
        prompt again, from its first token (`take_refeed`). (transformers' other caller, the deferred stop check,
        calls it after the prefill, before one-token decode steps; a crop or stopping the recording forgets it.)"""
        held = self.rows.num_columns
        self._refeed_from = held if ASSISTED_REFEEDS_PROMPT and held else None

    def cancel_refeed(self) -> None:
        """The rows changed between `expect_refeed` and the next forward (a crop, recording stopped)."""
        self._refeed_from = None

    def take_refeed(self, q_len: int) -> bool:
        """Whether the forward beginning now, of `q_len` columns, feeds the whole prompt again after
        `expect_refeed`: more columns than the rows held then, and still hold. Asked once, by the forward's first
        call that knows its width; the caller then has the rows drop what they hold (`drop_for_refeed`)."""
        held, self._refeed_from = self._refeed_from, None
        return held is not None and held == self.rows.num_columns and q_len > held

    def drop_for_refeed(self) -> None:
        """The forward beginning now feeds the whole prompt again (`take_refeed`): the rows let go of what they
        hold. A prefix hit that no forward has read yet (`load_prompt`) is no longer reported as served."""
        self.rows.drop_stored(unserve_hit=self._first_prompt_forward and self._expected_columns is not None)

    # ------------------------------------------------------------------ one forward
    def open(
        self,
        layer_idx: int,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        mode: str,
        module: torch.nn.Module | None = None,
    ) -> ForwardPlan:
        """The current forward's plan, planning it on the first layer of a new forward (under tensor
        parallelism, alike on every rank of `module`'s group, see `distributed.py`).

        Args:
            key, value: `[batch, num_kv_heads, q_len, head_dim]` the layer's new K/V.
            attention_mask: bool `[batch, kv_len]` padding mask or None.
            mode: `"paged"` or `"gather"` (see `ForwardPlan.mode`).
        """
        if self.plan is not None and not self.plan.has_written(layer_idx):
            return self.plan
        self.close()
        batch, _, q_len, _ = key.shape
        # (identical_rows examines only prefills of 2+ rows: the group is looked up for those alone)
        dedupe = self.dedupe_rows and batch > 1 and q_len > 1
        group = tensor_parallel_group(module) if module is not None and dedupe else None
        query_lens, order, count = real_columns(attention_mask, batch, q_len)
        gapped, real_tail = self._padding_facts(attention_mask, q_len)
        if order is not None:
            key, value = take_columns(key, order), take_columns(value, order)
        self._check_expected_columns(q_len)
        rows = self.rows
        with self.pool.lock:
            if self.pool.allocators is None:  # (a max_memory pool's size is agreed over the tensor-parallel group)
                tp_group = tensor_parallel_group(module) if module is not None else None
                self.pool.ensure_allocators(key, value.shape[-1], tp_group)
            rows_before = rows.batch
            rows.ensure_batch(batch)
            expanded = rows_before not in (0, batch)
            try:
                identity = identical_rows(rows, key, value, query_lens, q_len, group) if dedupe else None
                plan = rows.plan_forward(query_lens, q_len, identity, self.pool.layout.num_layers or self.learned_layers)
            except BaseException:
                if expanded:
                    self._collapse_rows(rows_before)
                raise
        if expanded:
            plan.rows_before = rows_before  # a rollback also undoes the row expansion
        if mode == "paged" and self.pool.layout.readers:  # layers reusing another's K/V attend before the commit
            plan.num_layers = self.pool.layout.attending_layers
        if order is not None:
            plan.column_order, plan.column_restore, plan.column_count = order, order.argsort(dim=1), count
        return self._begin(plan, gapped, real_tail, mode)

    def open_for_graph(self, tokens_per_row: int) -> ForwardPlan:
        """Plans a forward of `tokens_per_row` real new tokens per row whose layers all write through one graph
        (`attention/graph_step.py`) rather than through this cache: allocations and slots are decided here,
        before the model runs. `graph_written()` then marks every layer written, and `close()` commits.

        Raises:
            OutOfBlocksError: the pool cannot hold the step; nothing was changed.
        """
        self.close()
        num_layers = self.pool.layout.num_layers or self.learned_layers
        if num_layers is None or self.pool.allocators is None or not self.rows.batch:
            raise RuntimeError("a graph forward continues rows that an earlier forward of this cache stored")
        with self.pool.lock:
            plan = self.rows.plan_forward([tokens_per_row] * self.rows.batch, tokens_per_row, None, num_layers)
        return self._begin(plan, self.gapped, tokens_per_row, "paged")

    def graph_written(self) -> None:
        """The graph forward planned by `open_for_graph` ran: every layer wrote."""
        plan = self.plan
        plan.written_mask, plan.num_written = (1 << plan.num_layers) - 1, plan.num_layers

    def _begin(self, plan: ForwardPlan, gapped: bool, real_tail: int, mode: str) -> ForwardPlan:
        """Makes a planned forward the one in flight, with what its inputs said."""
        plan.gapped, plan.real_tail, plan.mode = gapped, real_tail, mode
        plan.previous, self._committed = self._committed, None
        self.plan = plan
        return plan

    def layer_done(self, layer_idx: int) -> None:
        """A layer wrote its K/V (or attended over another layer's, `LayerLayout.readers`); the forward commits when
        it was the last one."""
        plan = self.plan
        plan.mark_written(layer_idx)
        if plan.num_layers is not None and plan.num_written >= plan.num_layers:
            self.close()

    def close(self) -> bool | None:
        """Ends the forward in flight, between forwards: commits it when every layer wrote (or the number
        of layers is unknown), rolls it back when some layer did not (a layer raised).

        Returns:
            True when a forward was committed here, False when one was rolled back, None when none was open.
        """
        plan, self.plan = self.plan, None
        if plan is None:
            return None
        plan.kv_for_readers.clear()
        if plan.complete is False:
            self.rows.rollback(plan)
            if plan.rows_before:
                self._collapse_rows(plan.rows_before)
            return False
        if plan.num_layers is None:
            self.learned_layers = plan.num_written
        self.gapped = plan.gapped
        self.real_tail = self.real_tail + plan.q_len if plan.real_tail == plan.q_len else plan.real_tail
        self.rows.commit(plan, free_window=plan.mode == "paged")
        plan.previous, self._committed = None, plan
        return True

    def check_crop(self, drop: int) -> None:
        """Refuses a crop that reaches back over padding following real tokens (it cannot know how many
        tokens each row should lose), before anything changes."""
        if self.gapped and drop > self.real_tail:
            raise ValueError(
                f"crop(-{drop}) reaches back over padding that follows real tokens (right padding or a hole in "
                f"attention_mask): only the last {self.real_tail} columns are known to be real tokens of every "
                "row, and a paged cache stores no padding. Crop at most that many, or left-pad the batch."
            )

    def cropped(self, drop: int) -> None:
        """The rows lost their last `drop` columns."""
        self.real_tail = max(0, self.real_tail - drop)

    # ------------------------------------------------------------------ what the inputs say
    def _padding_facts(self, attention_mask: torch.Tensor | None, q_len: int) -> tuple[bool, int]:
        """`(gapped, real_tail)` of the forward about to be planned (see `ForwardPlan`), refusing, before
        anything is stored, one whose sliding windows would differ from transformers'.

        transformers measures a sliding window in columns, padding included; a paged cache stores real tokens
        only. The two agree while padding only precedes a row's tokens (left padding). Once a row has padding
        after a real token, they differ as soon as a window is shorter than the columns seen.
        """
        if attention_mask is None:
            return self.gapped, q_len
        columns = attention_mask[:, -(self.rows.num_columns + q_len) :].to(torch.bool)
        seen = columns.cumsum(dim=1) > 0  # a real token at or before this column
        gapped = self.gapped or bool((seen & ~columns).any())
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

    def _check_expected_columns(self, q_len: int) -> None:
        """After `load_prompt`, the first forward (or the first forwards, in chunks) must bring exactly the
        prompt's remaining columns.

        A forward of the whole prompt or more (the chunked prefill of releases before 5.23 feeds it in chunks;
        assisted decoding's first forward, which feeds it with the first drafts, let go of the hit when it began,
        `drop_for_refeed`) recomputes the prefix: a prefix hit is released before anything is planned, so the
        tokens are stored once, at their positions, and the recorded prompt is still what the forward's first
        columns are. Any other width means the recorded tokens are not what is being fed: they are dropped (never
        indexed), with a warning."""
        expected, self._expected_columns = self._expected_columns, None
        first, self._first_prompt_forward = self._first_prompt_forward, False
        if expected is None or q_len == expected:
            return
        held = self.rows.num_columns
        if held and self.pool.layout.is_hybrid and (q_len >= expected + held or not CHUNKED_PREFILL_SKIPS_CACHED_COLUMNS):
            raise ValueError(
                f"This cache holds {held} prompt columns of a hybrid model (with their recurrent states) and was fed "
                f"{q_len} columns again from the prompt's start, after its recurrent layers read those states: feed "
                f"only the remaining {expected} (generate() does), or use a cache made without the prompt "
                "(pool.new_cache() without input_ids, or a plain PagedCache)."
            )
        if first and held and not CHUNKED_PREFILL_SKIPS_CACHED_COLUMNS and q_len < expected + held:
            # this release's chunked prefill starts at the prompt's first column whatever the cache holds
            self.rows.drop_stored()
            expected, held = expected + held, 0
        if q_len < expected:  # a chunk of the remaining columns (generate's prefill_chunk_size)
            self._expected_columns = expected - q_len
            return
        if q_len >= expected + held:  # the whole prompt (and more) from its first column
            if held:
                self.rows.drop_stored()
            return
        warnings.warn(
            f"This cache was prepared for prompts of {expected} more columns but got {q_len}; it will not "
            "index its blocks for prefix reuse. Pass the same input_ids to new_cache() and generate().",
            stacklevel=5,
        )
        self.rows.forget_tokens()

    def _collapse_rows(self, rows_before: int) -> None:
        """Undoes `ensure_batch`'s expansion of each row into `batch / rows_before` copies."""
        self.rows.select(list(range(0, self.rows.batch, self.rows.batch // rows_before)))


def real_columns(
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


def take_columns(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`tensor[b, :, order[b], :]` for `[batch, heads, q_len, head_dim]` tensors."""
    index = order.to(tensor.device)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
    return tensor.gather(2, index)
