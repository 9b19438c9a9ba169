"""`Rows`: the rows of one cache — block tables, lengths, known tokens and digests — and their only writer.

Every change of a table goes through a method here: a forward's plan (steps decided in `growth.py`), commit
or rollback, beam reorders, forks, crops, prefix hits (`adopt_prompt`; `prefix_hits.py` finds them). Ref
counts change only through the pool's allocators, under its lock; the pool's `check()` recounts them.

Invariants (checked by `check()` and the pool's `check()`):
- `tables[g][b]` holds exactly `ceil(seq_lens[b] / block_size)` entries; sliding-window groups may hold
  -1 for blocks entirely outside the window (freed), never inside it, and only as a prefix of the table.
- Block tables are append-only within a forward, except copy-on-write of the last partial block.
- A block is written only by a row that holds the sole reference to it and that has not indexed it.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

from ..errors import OutOfBlocksError
from .growth import Undo, decide_growth, grow_group, undo_growth
from ..attention.plan import ForwardPlan, GroupPlan
from ..memory.prefix import block_digests

if TYPE_CHECKING:
    from ..memory.pool import BlockPool

#: Fewest tokens kept beyond a sliding window before its blocks are freed. A forward of n columns also
#: keeps n: assisted and prompt-lookup decoding verify n - 1 candidates in one forward and then `crop()`
#: at most that many, so any draft length can step back without needing freed blocks.
SLIDING_MARGIN = 64

#: A row's known token at a column it stores without knowing the token: left padding a gathered forward stored.
UNKNOWN_TOKEN = -1


class Rows:
    """The rows (sequences) of one cache and their blocks in the pool."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.tables: list[list[list[int]]] = []  # [group][row] -> block ids
        self.seq_lens: list[int] = []  # tokens stored per row
        self.tokens: list[list[int]] = []  # known token ids per row (prompt, committed tokens)
        self.digests: list[list[bytes]] = []  # digests of the known tokens' full blocks
        self.contents: list[bytes | None] = []  # per row, the key of its non-text content (prefix.content_keys)
        # per row, between `adopt_prompt` and the first commit: the padding columns ahead of its prompt that a
        # gathered forward stores (the `"paged"` attention stores none); the commit settles them (`_settle_pads`)
        self.pending_pads: list[int] = []
        self.placeholders: frozenset[int] | None = None  # placeholder ids (None: those the pool learned)
        self.num_columns = 0  # columns processed, padding included
        self.inflight: Undo | None = None  # undo of the planned, not yet committed forward
        self.prefix_query_tokens = 0  # prompt tokens looked up in the pool's prefix index
        self.prefix_hit_tokens = 0  # and served from it
        pool.register_tables(self)

    @property
    def batch(self) -> int:
        return len(self.seq_lens)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def init_rows(self, batch: int) -> None:
        self.tables = [[[] for _ in range(batch)] for _ in self.pool.layout.groups]
        self.seq_lens, self.tokens, self.digests = [0] * batch, [[] for _ in range(batch)], [[] for _ in range(batch)]
        self.contents = [None] * batch
        self.pending_pads = []

    def ensure_batch(self, batch: int) -> None:
        """Creates the rows on a first forward, or expands each row into `batch / rows` rows sharing its
        blocks when a forward brings a multiple of the rows (generate repeats the prompt rows for
        `num_return_sequences` / `num_beams` after a cache was prepared for the prompts)."""
        if not self.batch:
            if len(self.tables) != len(self.pool.layout.groups) or not self.tokens:
                self.init_rows(batch)
            return
        if batch == self.batch:
            return
        if batch % self.batch:
            raise ValueError(
                f"This cache holds {self.batch} rows but the model was called with {batch}; use a new "
                "PagedCache for a different batch (or cache.reset())."
            )
        self.select([i for i in range(self.batch) for _ in range(batch // self.batch)])

    # ------------------------------------------------------------------ a forward
    def signature(self, row: int, query_len: int) -> tuple:
        """Rows with equal signatures hold the same blocks and get the same number of new tokens; the
        last element is the known new tokens (None when unknown: also for placeholders standing for images the
        cache was not told, which equal ids do not make equal)."""
        old = self.seq_lens[row]
        tokens = self.tokens[row]
        known = tuple(tokens[old : old + query_len]) if len(tokens) >= old + query_len else None
        content = self.contents[row] if row < len(self.contents) else None
        if known is not None and content is None and not self.placeholder_ids().isdisjoint(known):
            known = None
        return (tuple(tuple(t[row]) for t in self.tables), old, query_len, content, known)

    def plan_forward(
        self, query_lens: list[int], q_len: int, identity: list[int] | None, num_layers: int | None
    ) -> ForwardPlan:
        """Allocates blocks for this forward's tokens and computes the slots (call under the pool lock).

        Args:
            query_lens: per row, real new tokens (right-aligned in the `q_len` columns).
            q_len: columns of this forward.
            identity: per row, an earlier identical row whose blocks it shares (itself if none), or None.
            num_layers: layers that must write for the forward to be complete.

        Raises:
            OutOfBlocksError: the pool cannot hold the step; nothing was changed.
        """
        if len(self.tables) != len(self.pool.layout.groups):  # layout learned after the rows were made (new_cache
            # before the first forward): rows that hold no block yet simply take the new layout.
            if any(table for tables in self.tables for table in tables):
                raise RuntimeError("the pool's layer layout changed after this cache stored K/V")
            self.tables = [[[] for _ in range(self.batch)] for _ in self.pool.layout.groups]
        bs = self.block_size
        undo = Undo.before(self.tables, self.seq_lens, self.num_columns)
        if q_len == 1 and identity is None and min(query_lens, default=0) == 1 and self._within_last_blocks():
            groups = self._write_within_last_blocks(undo)
        else:
            groups = self._grow(query_lens, q_len, identity, undo)
        self.seq_lens = [s + n for s, n in zip(self.seq_lens, query_lens, strict=True)]
        self.num_columns += q_len
        self.inflight = undo
        return ForwardPlan(
            q_len, list(query_lens), list(self.seq_lens), groups, bs, num_layers, undo=undo, identity=identity
        )

    def _within_last_blocks(self) -> bool:
        """Whether each row's next token goes into its partial last block in place in every group: the row holds
        the block's sole reference and has not indexed it. A decode step of one token per row (`query_lens` all 1)
        then changes no table: `decide_growth` would decide nothing but these writes."""
        bs = self.block_size
        if not self.seq_lens or not all(s % bs for s in self.seq_lens):
            return False
        for group, tables in zip(self.pool.layout.groups, self.tables, strict=True):
            allocator = self.pool.allocators[group.group_id]
            for s, table in zip(self.seq_lens, tables, strict=True):
                block = table[s // bs]
                if allocator.ref_count(block) != 1 or allocator.is_indexed(block):
                    return False
        return True

    def _write_within_last_blocks(self, undo: Undo) -> list[GroupPlan]:
        """Every group's plan of a one-token step that `_within_last_blocks` allows: each row's token goes to the
        slot after its last one, in the same block (whose filled count `undo` records)."""
        bs, groups = self.block_size, []
        for group, tables in zip(self.pool.layout.groups, self.tables, strict=True):
            allocator = self.pool.allocators[group.group_id]
            slots = []
            for s, table in zip(self.seq_lens, tables, strict=True):
                block = table[s // bs]
                undo.filled.append((group.group_id, block, allocator.filled(block)))
                allocator.note_filled(block, s % bs + 1)
                slots.append(block * bs + s % bs)
            groups.append(GroupPlan(tables, list(range(len(tables))), slots, group.sliding_window))
        return groups

    def _grow(self, query_lens: list[int], q_len: int, identity: list[int] | None, undo: Undo) -> list[GroupPlan]:
        """Every group's growth for a forward (`decide_growth`, then `grow_group`), undone if anything fails."""
        bs, decided = self.block_size, []
        try:
            for group, tables in zip(self.pool.layout.groups, self.tables, strict=True):  # fail before any change
                allocator = self.pool.allocators[group.group_id]
                steps, need = decide_growth(allocator, tables, self.seq_lens, query_lens, identity, bs)
                if not allocator.can_allocate(need):
                    raise OutOfBlocksError(need, allocator.num_available, allocator.capacity, bs)
                decided.append(steps)
            return [
                grow_group(self.pool, group, tables, self.seq_lens, steps, query_lens, q_len, undo)
                for group, tables, steps in zip(self.pool.layout.groups, self.tables, decided, strict=True)
            ]
        except BaseException:
            self._restore(undo)
            raise

    def commit(self, plan: ForwardPlan, free_window: bool) -> None:
        """A forward completed: index newly full blocks of known tokens, free blocks out of the window."""
        with self.pool.lock:
            self._drop_held(plan.undo)
            self._settle_pads(plan.mode)
            self._index_known_blocks(plan.undo.seq_lens)
            if free_window:
                self._free_out_of_window(max(SLIDING_MARGIN, plan.q_len))

    def rollback(self, plan: ForwardPlan) -> None:
        """A forward did not complete: return to the state before it."""
        with self.pool.lock:
            self._restore(plan.undo)

    def _restore(self, undo: Undo) -> None:
        undo_growth(self.pool, self.tables, undo)
        self._drop_held(undo)
        self.seq_lens, self.num_columns = undo.seq_lens, undo.num_columns
        if not any(self.seq_lens) and not self.num_columns and not any(self.tokens):
            self.tables, self.seq_lens, self.tokens, self.digests, self.contents = [], [], [], [], []
            self.pending_pads = []

    def _drop_held(self, undo: Undo) -> None:
        for allocator, held in zip(self.pool.allocators or [], undo.held, strict=False):
            allocator.decref(held)
        undo.held = []
        if self.inflight is undo:
            self.inflight = None

    def _settle_pads(self, mode: str | None) -> None:
        """After the first forward since `adopt_prompt`: a gathered one stored every column, so a row's padding
        columns come first, unknown tokens that no block of the row is indexed under (its digests chain from its
        first column); the `"paged"` attention stored only the prompts' tokens."""
        pads, self.pending_pads = self.pending_pads, []
        if mode != "gather":
            return
        for b, pad in enumerate(pads):
            if pad:
                self.tokens[b] = [UNKNOWN_TOKEN] * pad + self.tokens[b]
                self.digests[b] = []

    def _index_known_blocks(self, old_lens: list[int]) -> None:
        if not self.pool.prefix_caching:
            return
        bs = self.block_size
        for b, (old, new) in enumerate(zip(old_lens, self.seq_lens, strict=True)):
            digests, tokens = self.digests[b], self.tokens[b]
            for j in range(old // bs, min(new // bs, len(digests))):
                for group, tables in zip(self.pool.layout.groups, self.tables, strict=True):
                    block_id = tables[b][j]
                    if block_id >= 0:
                        self.pool.allocators[group.group_id].register(
                            block_id, digests[j], tuple(tokens[j * bs : (j + 1) * bs])
                        )

    def _free_out_of_window(self, margin: int) -> None:
        bs = self.block_size
        for group, tables in zip(self.pool.layout.groups, self.tables, strict=True):
            if group.sliding_window is None:
                continue
            allocator = self.pool.allocators[group.group_id]
            for b, table in enumerate(tables):
                keep_from = max(0, self.seq_lens[b] - group.sliding_window - margin) // bs
                start = keep_from  # freed blocks are a prefix: only those since the last free are looked at
                while start > 0 and table[start - 1] >= 0:
                    start -= 1
                for j in range(start, keep_from):
                    allocator.decref((table[j],))
                    table[j] = -1

    # ------------------------------------------------------------------ whole-row operations
    def select(self, indices: list[int]) -> None:
        """Row i becomes old row `indices[i]`, sharing its blocks (beam reorder, repeat, select)."""
        if not self.batch or indices == list(range(self.batch)):
            return
        if any(i < 0 or i >= self.batch for i in indices):
            raise IndexError(f"row indices {indices} out of range for a cache of {self.batch} rows")
        with self.pool.lock:
            new_tables = [[list(g[i]) for i in indices] for g in self.tables]
            for allocator, old, new in zip(self.pool.allocators, self.tables, new_tables, strict=True):
                for table in new:
                    allocator.incref(table)
                for table in old:
                    allocator.decref(table)
            self.tables = new_tables
            self.seq_lens = [self.seq_lens[i] for i in indices]
            self.tokens = [list(self.tokens[i]) for i in indices]
            self.digests = [list(self.digests[i]) for i in indices]
            self.contents = [self.contents[i] for i in indices]
            self.pending_pads = [self.pending_pads[i] for i in indices] if self.pending_pads else []

    def copy_from(self, other: Rows) -> None:
        """Becomes a copy of `other`'s rows, sharing every block (fork)."""
        with self.pool.lock:
            self.release_all()
            for allocator, tables in zip(self.pool.allocators or [], other.tables, strict=False):
                for table in tables:
                    allocator.incref(table)
            self.tables = [[list(t) for t in g] for g in other.tables]
            self.seq_lens, self.num_columns = list(other.seq_lens), other.num_columns
            self.tokens = [list(t) for t in other.tokens]
            self.digests = [list(d) for d in other.digests]
            self.contents, self.placeholders = list(other.contents), other.placeholders
            self.pending_pads = list(other.pending_pads)

    def append_row(self, other: Rows, row: int) -> None:
        """Appends `other`'s row `row` as this cache's last row, sharing its blocks (a request moving from its
        own prefill cache into the engine's batch of decoding rows). Both must be between forwards."""
        if other.pool is not self.pool:
            raise ValueError("append_row() moves a row between caches of one KVPool.")
        if self.inflight is not None or other.inflight is not None:
            raise RuntimeError("append_row() runs between forwards; a forward of one of the caches is open.")
        if any(self.pending_pads) or any(other.pending_pads):
            raise RuntimeError("append_row() moves rows whose prompt a forward has fed; a padded prompt is not fed yet.")
        with self.pool.lock:
            if len(self.tables) != len(other.tables):
                if any(table for tables in self.tables for table in tables):
                    raise RuntimeError("the pool's layer layout changed after this cache stored K/V")
                self.tables = [[] for _ in other.tables]
            for allocator, mine, theirs in zip(self.pool.allocators or [], self.tables, other.tables, strict=True):
                allocator.incref(theirs[row])
                mine.append(list(theirs[row]))
            self.seq_lens.append(other.seq_lens[row])
            self.tokens.append(list(other.tokens[row]))
            self.digests.append(list(other.digests[row]))
            self.contents.append(other.contents[row])
            self.pending_pads = []
            if other.placeholders is not None:
                self.placeholders = other.placeholders | (self.placeholders or frozenset())
            self.num_columns = max(self.num_columns, other.seq_lens[row])

    def note_prefix(self, looked_up: int, served: int) -> None:
        """Adds prompt tokens looked up in the pool's index and served from it to this cache's counters (rows that
        took their prefix in another cache of the pool, which counted them in the pool's)."""
        self.prefix_query_tokens += looked_up
        self.prefix_hit_tokens += served

    def stand_for(self, columns: int) -> None:
        """The rows stand for `columns` columns, left padding included (rows joined from caches of their own)."""
        if columns < max(self.seq_lens, default=0):
            raise ValueError(f"{columns} columns cannot hold rows of {max(self.seq_lens)} tokens.")
        self.num_columns = columns

    def crop(self, drop: int) -> None:
        """Removes the last `drop` columns (tokens) of every row and releases blocks no longer needed."""
        self.crop_rows([drop] * self.batch)

    def crop_rows(self, drops: list[int]) -> None:
        """Removes the last `drops[b]` tokens of row b (at most what it stores; speculative decoding rolls back
        each row's rejected drafts) and releases blocks no longer needed; the columns shrink by the fewest dropped."""
        if not any(drops) or not self.batch:
            return
        bs = self.block_size
        new_lens = [max(0, s - d) for s, d in zip(self.seq_lens, drops, strict=True)]
        with self.pool.lock:
            for group, tables in zip(self.pool.layout.groups, self.tables, strict=True):  # refuse before any change
                if group.sliding_window is None:
                    continue
                for b, table in enumerate(tables):
                    first_needed = max(0, new_lens[b] - group.sliding_window) // bs
                    if any(x < 0 for x in table[first_needed : math.ceil(new_lens[b] / bs)]):
                        raise ValueError(
                            f"crop(-{drops[b]}) steps back further than the tokens kept beyond the sliding window "
                            f"(at least {SLIDING_MARGIN}, and the length of the last forward); those blocks were "
                            "freed. Crop at most what the last forward added, or use a new cache."
                        )
            for group, tables in zip(self.pool.layout.groups, self.tables, strict=True):
                allocator = self.pool.allocators[group.group_id]
                for b, table in enumerate(tables):
                    new_len = new_lens[b]
                    allocator.decref(table[math.ceil(new_len / bs) :])
                    del table[math.ceil(new_len / bs) :]
                    last = table[-1] if new_len % bs else -1
                    # (an indexed block keeps all its slots: the index serves them, and a write copies it first)
                    if last >= 0 and allocator.ref_count(last) == 1 and not allocator.is_indexed(last):
                        allocator.note_filled(last, new_len % bs, exact=True)
            self.seq_lens = new_lens
            self.tokens = [t[:s] for t, s in zip(self.tokens, self.seq_lens, strict=True)]
            self.digests = [d[: s // bs] for d, s in zip(self.digests, self.seq_lens, strict=True)]
            self.num_columns = max(0, self.num_columns - min(drops))

    def drop_stored(self, unserve_hit: bool = True) -> None:
        """Releases every stored token but keeps the rows and their known tokens (the caller is about to
        feed the whole prompt again from position 0). `unserve_hit`: the rows hold only what a prefix hit took,
        and no forward has read it, so the hit is no longer reported as served."""
        with self.pool.lock:
            released = sum(self.seq_lens)
            for allocator, tables in zip(self.pool.allocators or [], self.tables, strict=False):
                for table in tables:
                    allocator.decref(table)
            self.tables = [[[] for _ in range(self.batch)] for _ in self.tables]
            self.seq_lens, self.num_columns = [0] * self.batch, 0
            if unserve_hit:
                self.prefix_hit_tokens -= released
                self.pool.note_prefix_lookup(0, -released)

    def adopt_prompt(
        self, prompts: list[list[int]], digests: list[list[bytes]], kept: list[int], first_blocks: list[list[int]],
        columns: int, contents: list[bytes | None] | None = None, pads: list[int] | None = None,
    ) -> None:
        """Becomes the rows of `prompts` (empty rows before), each holding its first `kept[b]` tokens from
        the pool's prefix index (call under the pool lock, right after `prefix_hits` found them).

        Args:
            prompts: per row, the prompt's token ids (padding removed).
            digests: per row, the chained digests of its full blocks.
            kept: per row, the tokens taken from the index.
            first_blocks: per row and group, the leading blocks not taken (sliding windows: -1 entries).
            columns: the columns those tokens stand for (padding included): `generate()` slices by them.
            contents: per row, the key its digests cover from its first placeholder on (`prompt_digests`).
            pads: per row, the left padding columns of its prompt (none when None).
        """
        bs = self.block_size
        self.init_rows(len(prompts))
        self.tokens, self.digests = [list(p) for p in prompts], digests
        self.contents = list(contents) if contents is not None else [None] * len(prompts)
        self.pending_pads = [max(0, pad - columns) for pad in pads] if pads is not None else []
        for group_id, allocator in enumerate(self.pool.allocators or []):
            for b, k in enumerate(kept):
                table = [-1] * first_blocks[b][group_id]
                for j in range(len(table), math.ceil(k / bs)):
                    block_id = allocator.lookup(digests[b][j], tuple(prompts[b][j * bs : (j + 1) * bs]))
                    if block_id is None:
                        raise RuntimeError("a prefix block left the index between its lookup and its take")
                    table.append(block_id)
                self.tables[group_id][b] = table
        self.seq_lens, self.num_columns = list(kept), columns
        looked_up = sum(map(len, prompts))
        self.prefix_query_tokens += looked_up
        self.prefix_hit_tokens += sum(kept)
        self.pool.note_prefix_lookup(looked_up, sum(kept))

    def release_all(self) -> None:
        """Drops every reference this cache holds (also run by the finalizer of a dropped cache)."""
        with self.pool.lock:
            if self.inflight is not None:
                self._drop_held(self.inflight)
            for allocator, tables in zip(self.pool.allocators or [], self.tables, strict=False):
                for table in tables:
                    allocator.decref(table)
            self.tables, self.seq_lens, self.tokens, self.digests, self.contents = [], [], [], [], []
            self.num_columns, self.pending_pads = 0, []

    # ------------------------------------------------------------------ prompts and tokens
    def commit_tokens(self, sequences: list[list[int]], salt: str | bytes | None) -> None:
        """Records the tokens of every row (columns of `generate` output) and indexes full blocks."""
        with self.pool.lock:
            for b, row in enumerate(sequences):
                tokens = row[len(row) - self.seq_lens[b] :] if self.seq_lens[b] else []
                unknown = next((i for i, t in enumerate(self.tokens[b]) if t != UNKNOWN_TOKEN), len(self.tokens[b]))
                tokens[:unknown] = [UNKNOWN_TOKEN] * min(unknown, len(tokens))  # stored padding stays unknown
                if self.tokens[b][: len(tokens)] != tokens[: len(self.tokens[b])]:
                    raise ValueError(f"commit_tokens(): row {b} does not start with the tokens this cache was fed.")
                self.tokens[b] = tokens
                self.digests[b] = self.prompt_digests(tokens, salt, self.contents[b])
            self._index_known_blocks([0] * self.batch)

    def use_placeholders(self, ids: frozenset[int]) -> None:
        """The placeholder token ids of the model's config (rows made before; `load_prompt` given the model)."""
        self.placeholders = frozenset(ids)

    def placeholder_ids(self) -> frozenset[int]:
        """Token ids standing for non-text input: those of the model config given to `load_prompt`, else those
        the pool learned (`BlockPool.placeholder_ids`)."""
        return self.placeholders if self.placeholders is not None else self.pool.placeholder_ids

    def content_start(self, tokens: list[int], content: bytes | None) -> int | None:
        """Index of a row's first placeholder token (0 when content is given but the config names no placeholder
        ids: the whole row then depends on it), or None for a text-only row."""
        placeholders = self.placeholder_ids()
        if content is not None and not placeholders:
            return 0
        return next((i for i, t in enumerate(tokens) if t in placeholders), None)

    def prompt_digests(self, tokens: list[int], salt: str | bytes | None, content: bytes | None) -> list[bytes]:
        """The digests of a row's full blocks (`prefix.block_digests`), covering its non-text `content` from its
        first placeholder on; with placeholders and no content, none from the block holding the first one."""
        if not self.pool.prefix_caching:
            return []
        if UNKNOWN_TOKEN in tokens:  # (stored padding comes first: no block of the row is indexed)
            tokens = tokens[: tokens.index(UNKNOWN_TOKEN)]
        start = self.content_start(tokens, content)
        return block_digests(tokens, self.block_size, salt, content_from=start, content=content)

    def placeholders_stored(self) -> bool:
        """Whether every row that has placeholders among its known tokens stores them all (so the model need not
        see the non-text inputs again); False when no placeholder id is known (nothing tells where they are)."""
        placeholders = self.placeholder_ids()
        if not placeholders:
            return False
        for tokens, seq_len in zip(self.tokens, self.seq_lens, strict=True):
            last = max((i for i, t in enumerate(tokens) if t in placeholders), default=-1)
            if last >= seq_len:
                return False
        return True

    def forget_tokens(self) -> None:
        """Drops known tokens beyond what is stored (they are not what the model is being fed)."""
        bs = self.block_size
        self.tokens = [t[:s] for t, s in zip(self.tokens, self.seq_lens, strict=True)]
        self.digests = [d[: s // bs] for d, s in zip(self.digests, self.seq_lens, strict=True)]

    # ------------------------------------------------------------------ reading
    def group_tables(self, group_id: int) -> list[list[int]]:
        """The rows' block tables of a group (read only; empty before the rows exist)."""
        return self.tables[group_id] if group_id < len(self.tables) else []

    def block_refs(self, group_id: int) -> Counter[int]:
        """Block id -> references in a group: table entries and copy-on-write sources held until commit."""
        refs = Counter(b for t in self.group_tables(group_id) for b in t if b >= 0)
        if self.inflight is not None and group_id < len(self.inflight.held):
            refs.update(self.inflight.held[group_id])
        return refs

    def usage(self, group_id: int) -> dict[int, int]:
        """Block id -> the most token slots any row fills in it, in a group."""
        filled: dict[int, int] = {}
        bs = self.block_size
        for table, seq_len in zip(self.group_tables(group_id), self.seq_lens, strict=False):
            for j, block_id in enumerate(table):
                if block_id >= 0:
                    filled[block_id] = max(filled.get(block_id, 0), min(bs, seq_len - j * bs))
        return filled

    def check(self) -> None:
        if not self.tables:
            assert not self.seq_lens, "rows without tables"
            return
        bs = self.block_size
        assert len(self.tokens) == len(self.digests) == len(self.contents) == self.batch, "row lists out of step"
        for group, tables in zip(self.pool.layout.groups, self.tables, strict=True):
            assert len(tables) == self.batch, "a group's table count differs from the row count"
            for b, table in enumerate(tables):
                need = math.ceil(self.seq_lens[b] / bs)
                assert len(table) == need, f"row {b}: {len(table)} blocks for {self.seq_lens[b]} tokens"
                window = group.sliding_window
                first_needed = 0 if window is None else max(0, self.seq_lens[b] - window) // bs
                assert all(x >= 0 for x in table[first_needed:]), f"row {b}: a needed block was freed"
                freed = table.count(-1)
                assert table[:freed] == [-1] * freed, f"row {b}: freed blocks are not a prefix of its table"
            assert all(s <= self.num_columns for s in self.seq_lens), "a row stores more tokens than columns"

