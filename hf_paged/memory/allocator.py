"""Block allocator of one layer group: reference counts, free queue, LRU of cached blocks, prefix index.

A block id names `block_size` token slots in *every* layer of its group, so one block table per sequence
serves all of them. Every block is in exactly one of three states::

    free        ref_count == 0, no digest          -> in `free_ids` (FIFO, any one taken out in O(1))
    cached      ref_count == 0, digest registered  -> in `evictable` (LRU order, oldest first)
    in use      ref_count >= 1                     -> referenced by live block tables

A block in use may also carry a digest (it is full and indexed): when its last reference goes away it
becomes *cached*, not free, and a later prompt with the same prefix can take it back. Cached blocks are
evicted (digest dropped) only when no free block is left. `check()` verifies these invariants.

Placement: a row that grows may ask for the blocks right after its last one (`allocate(n, after=...)`), and the
fresh rows of one forward may ask for runs spread over the free ids at the end of the pool with room after each
(`allocate_runs`). Rows that stay one run of ids each, at one stride from row to row, are read in place by the
PyTorch path (`torch_meta.py`) instead of gathered; the Triton path reads through the block tables either way.
A growing row, or the fresh rows of a batch, may also ask that cached blocks in their way be moved
(`allocate(n, after=..., relocate=True)`, `allocate_runs(counts, relocate=True)`): the allocator copies each one to
another id through `on_move` (the pool copies the K/V) and the block keeps its digest, tokens and place in the LRU
order there (`LruIds.rename`). The cached prefixes that survive are the ones a plain allocation leaves; only their
ids change. (A row that takes cached prefix blocks and then grows would otherwise find the blocks after them
cached: a previous request's continuation of the same prompt; and once a pool's ids all hold cached blocks, a new
batch would take the least recently used ones, scattered.)

Hybrid models: an indexed block may also hold a *snapshot*, the id of a state slot (`state_slots.py`) with the
recurrent states at the block's end, i.e. after every token its digest names. The allocator only records which
block holds which slot, in LRU order (`snapshots`); the slot's reference is the pool's. A snapshot goes when its
block loses its digest (eviction, `clear_index`) or is dropped as the least recently used (`drop_oldest_snapshot`);
either way `on_snapshot_drop(slot)` is called, so the pool releases the slot.

The allocator also keeps the counters `stats()` reads in O(1): blocks in use, blocks shared (more than one
reference) and token slots filled in blocks in use. Block tables live above it (`rows.py`); it knows
nothing of caches, layers or tensors.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..errors import OutOfBlocksError


class LruIds:
    """Block ids in least recently used order, oldest first: the subset of `OrderedDict[int, None]` the allocator
    uses (`ids[i] = None` appends an id not yet in it, `del`, `pop`, `popitem(last=False)`, `move_to_end`, `in`,
    `len`, iteration oldest first), plus `rename`, which gives ids new names in place, each keeping its position,
    in time proportional to the renamed ids (a block moved to another id keeps its place in the LRU order).

    Each id holds a ticket; the tickets are kept in order, and a renamed id's ticket changes hands.
    """

    __slots__ = ("_order", "_ticket", "_next")

    def __init__(self) -> None:
        self._order: OrderedDict[int, int] = OrderedDict()  # ticket -> id, oldest first
        self._ticket: dict[int, int] = {}  # id -> ticket
        self._next = 0

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._ticket

    def __len__(self) -> int:
        return len(self._ticket)

    def __iter__(self) -> Iterator[int]:
        return iter(self._order.values())

    def __setitem__(self, block_id: int, _value: None) -> None:
        if block_id not in self._ticket:
            self._ticket[block_id], self._order[self._next] = self._next, block_id
            self._next += 1

    def __delitem__(self, block_id: int) -> None:
        del self._order[self._ticket.pop(block_id)]

    def pop(self, block_id: int, default: None = None) -> None:
        if block_id in self._ticket:
            del self[block_id]
        return default

    def popitem(self, last: bool = True) -> tuple[int, None]:
        _, block_id = self._order.popitem(last=last)
        del self._ticket[block_id]
        return block_id, None

    def move_to_end(self, block_id: int) -> None:
        del self[block_id]
        self[block_id] = None

    def clear(self) -> None:
        self._order.clear()
        self._ticket.clear()

    def rename(self, renamed: dict[int, int]) -> None:
        """Id `src` becomes `renamed[src]` where it stands, for each `src` in it; the new ids are not in it."""
        tickets = [(self._ticket.pop(src), dst) for src, dst in renamed.items() if src in self._ticket]
        for ticket, dst in tickets:
            self._ticket[dst], self._order[ticket] = ticket, dst


@dataclass(slots=True)
class Block:
    """Book-keeping for one block id."""

    block_id: int
    #: Number of block-table entries of live caches that point at this block.
    ref_count: int = 0
    #: Chained prefix digest (see `prefix.py`) when the block is full and indexed, else None.
    digest: bytes | None = None
    #: The token ids the block holds, compared on every index hit so a digest collision can never
    #: serve another prompt's K/V.
    token_ids: tuple[int, ...] | None = None
    #: Token slots of the block that hold K/V (set by the rows that write it; 0 once free).
    filled: int = 0
    #: A state slot holding the recurrent states after the block's last token (hybrids; indexed blocks only).
    snapshot: int | None = None


class BlockAllocator:
    """Allocates block ids of one layer group.

    Args:
        block_size: tokens per block.
        num_blocks: initial number of blocks.
        max_blocks: fixed capacity; None lets the allocator grow (doubling) when it runs out.
        prefix_caching: keep full blocks indexed by digest after their last reference is dropped.
        on_snapshot_drop: called with the state slot of a snapshot the allocator lets go of (hybrids).
        on_move: copies the contents of blocks `src[i]` to `dst[i]` (`on_move(src, dst)`); without it, cached
            blocks are never moved (`allocate(..., relocate=True)` then allocates as without).
    """

    def __init__(
        self, block_size: int, num_blocks: int = 0, max_blocks: int | None = None, prefix_caching: bool = True,
        on_snapshot_drop: Callable[[int], None] | None = None,
        on_move: Callable[[list[int], list[int]], None] | None = None,
    ) -> None:
        self.block_size = block_size
        self.on_snapshot_drop = on_snapshot_drop
        self.on_move = on_move
        #: Cached blocks moved out of a growing row's way (`allocate(..., relocate=True)`).
        self.num_moves = 0
        #: Blocks holding a snapshot, least recently used first.
        self.snapshots = LruIds()
        self.max_blocks = max_blocks
        self.prefix_caching = prefix_caching
        self.blocks: list[Block] = []
        self.free_ids: OrderedDict[int, None] = OrderedDict()
        self.evictable = LruIds()
        self.index: dict[bytes, int] = {}
        self.num_evictions = 0
        #: Blocks with ref_count >= 1, with ref_count >= 2, and the filled slots of the blocks in use.
        self.num_in_use = 0
        self.num_shared = 0
        self.tokens_in_use = 0
        self._grow_to(num_blocks if max_blocks is None else max_blocks)

    # ------------------------------------------------------------------ capacity
    @property
    def capacity(self) -> int:
        """Number of block ids that exist (the first dimension of every layer tensor of the group)."""
        return len(self.blocks)

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out without growing: free plus evictable."""
        return len(self.free_ids) + len(self.evictable)

    def ref_count(self, block_id: int) -> int:
        """References to a block from live block tables."""
        return self.blocks[block_id].ref_count

    def filled(self, block_id: int) -> int:
        """Token slots of a block that hold K/V."""
        return self.blocks[block_id].filled

    def is_indexed(self, block_id: int) -> bool:
        """Whether a block is in the prefix index (full and shared with later prompts: never written again)."""
        return self.blocks[block_id].digest is not None

    def can_allocate(self, num_blocks: int) -> bool:
        return self.max_blocks is None or num_blocks <= self.num_available

    def _grow_for(self, needed: int) -> None:
        """Grows an unbounded pool to at least `needed` blocks and to twice the blocks it holds (in use or cached),
        at least 16: geometric growth of what is stored. (Twice the capacity would double the free room that rows
        placed by `allocate_runs` keep after them as well.)"""
        self._grow_to(max(2 * (self.capacity - len(self.free_ids)), needed, 16))

    def _grow_to(self, capacity: int) -> None:
        start = len(self.blocks)
        self.blocks.extend(Block(block_id) for block_id in range(start, capacity))
        self.free_ids.update(dict.fromkeys(range(start, capacity)))

    # ------------------------------------------------------------------ allocation
    def allocate(self, num_blocks: int, after: int | None = None, relocate: bool = False) -> list[int]:
        """Hands out `num_blocks` fresh blocks with ref_count 1.

        With `after` (a block id): the blocks `after + 1 .. after + num_blocks` when all are free, so that a row
        growing into the blocks after its own stays one run of ids (a row at the end of a pool that `reserve` just
        grew finds the new ids there). With `relocate` too, and an `on_move`, also when some of them are cached:
        those are moved to other ids first (`_clear`). Otherwise takes free blocks first, then evicts cached blocks
        in LRU order, then (unbounded pools only) grows, and hands them out in increasing order (blocks freed
        together, such as the blocks of a finished row, then come back as one run). Raises `OutOfBlocksError`
        without changing anything when a fixed pool cannot serve it.
        """
        if num_blocks <= 0:
            return []
        if after is not None and self._all_free(after + 1, num_blocks):
            return self._take(range(after + 1, after + 1 + num_blocks))
        if after is not None and after >= 0 and relocate and self._clear(range(after + 1, after + 1 + num_blocks)):
            return self._take(range(after + 1, after + 1 + num_blocks), from_free=False)
        if not self.can_allocate(num_blocks):
            raise OutOfBlocksError(num_blocks, self.num_available, self.capacity, self.block_size)
        shortfall = num_blocks - self.num_available
        if shortfall > 0:  # unbounded: grow instead of failing
            self._grow_for(self.capacity + shortfall)
        ids: list[int] = []
        for _ in range(num_blocks):
            ids.append(self.free_ids.popitem(last=False)[0] if self.free_ids else self._evict_oldest())
        return self._take(sorted(ids), from_free=False)

    def reserve(self, num_blocks: int) -> None:
        """Grows an unbounded pool once so that `num_blocks` more can be handed out without growing again (a
        forward's blocks, before its rows take them one by one); a fixed pool is left as it is."""
        if self.max_blocks is None and num_blocks > self.num_available:
            self._grow_for(self.capacity + num_blocks - self.num_available)

    def allocate_runs(self, counts: list[int], relocate: bool = False) -> list[list[int]] | None:
        """Hands out one run of consecutive ids per entry of `counts` (blocks with ref_count 1), spread over the
        last free ids of the pool (at most twice the total) so that free room follows each run: one stride from
        run to run when every run fits in `room / len(counts)`, else room in proportion to each run. An unbounded
        pool that must grow anyway (fewer blocks available than the total) grows so that at least twice the total
        is free at its end (and to twice what it holds, as `allocate` grows) and spreads the runs over all of that;
        it never grows only to make room. With `relocate` and an `on_move`, the runs are spread over the ids at the
        end that no row holds (free or cached) where those give more room than the free ones, the cached ones among
        the runs' ids moved out of their way as `allocate(..., relocate=True)` moves them: the digests dropped
        are the ones a plain allocation of the total would drop. None, with nothing changed, when the runs cannot
        be placed with any room (the caller then allocates as usual).

        The fresh rows of one forward take their blocks this way: each grows into the room after its run
        (`allocate(n, after=...)`), so every row stays one run of ids.
        """
        total = sum(counts)
        if total <= 0 or min(counts) <= 0:
            return None
        room = self._free_tail(2 * total)
        start = self.capacity - room
        if self.max_blocks is None and room < 2 * total and self.num_available < total:  # growing anyway
            self._grow_for(start + 2 * total)
            room = self.capacity - start  # the whole free run at the end: from the old free ids to the new end
        if relocate and self.on_move is not None and self.num_available >= total:
            idle = self._idle_tail(2 * total)  # free or cached: more room than the free ids where cached blocks lie
            runs = self._spread(counts, self.capacity - idle, idle) if idle > max(room, total) else None
            if runs is not None and self._clear([i for run in runs for i in run]):
                return [self._take(run, from_free=False) for run in runs]
        if room <= total:
            return None
        return [self._take(run) for run in self._spread(counts, start, room)]

    @staticmethod
    def _spread(counts: list[int], start: int, room: int) -> list[range]:
        """The ids of each run of `counts` blocks spread over `room` ids from `start` (`allocate_runs`)."""
        runs = []
        stride = room // len(counts)  # one stride when every run fits in it, else room in proportion to each run
        total = sum(counts)
        for count in counts:
            runs.append(range(start, start + count))
            start += stride if max(counts) <= stride else count * room // total
        return runs

    def _free_tail(self, limit: int) -> int:
        """How many ids at the end of the pool are free (one run of free ids up to the capacity), up to `limit`."""
        count = 0
        while count < min(limit, self.capacity) and (self.capacity - 1 - count) in self.free_ids:
            count += 1
        return count

    def _idle_tail(self, limit: int) -> int:
        """How many ids at the end of the pool no row holds (free or cached), up to `limit`."""
        count = 0
        while count < min(limit, self.capacity) and not self.blocks[self.capacity - 1 - count].ref_count:
            count += 1
        return count

    def _all_free(self, first: int, count: int) -> bool:
        if first <= 0 or first + count > self.capacity:
            return False
        return all(i in self.free_ids for i in range(first, first + count))

    def _clear(self, targets: range | list[int]) -> bool:
        """Makes the ids `targets` free (out of the free ids, for `_take(from_free=False)`), moving the cached ones
        among them to other ids; False, with nothing changed, without an `on_move`, when one is in use or past the
        capacity, or when a fixed pool has too few blocks.

        It drops the digests a plain `allocate(len(targets))` would drop: the least recently used cached blocks
        (wherever they are), as many as the free ids fall short. A cached block among the ids that keeps its
        digest is copied (`on_move`) to an id outside them, one of those just evicted or else a free one, and keeps
        its place in the LRU order.
        """
        count = len(targets)
        if self.on_move is None or any(i >= self.capacity or self.blocks[i].ref_count for i in targets):
            return False
        if not self.can_allocate(count):
            return False
        if count > self.num_available:  # unbounded: grow as a plain allocation would (new ids are free ids)
            self._grow_for(self.capacity + count - self.num_available)
        evicted = [self._evict_oldest() for _ in range(count - len(self.free_ids))]
        targeted = set(targets)
        spare = [i for i in evicted if i not in targeted]  # evicted outside the targets: free now
        cached = [i for i in targets if i in self.evictable]
        free = (i for i in self.free_ids if i not in targeted)
        moves = [(src, spare.pop() if spare else next(free)) for src in cached]
        for block_id in spare:
            self.free_ids[block_id] = None
        for block_id in targets:
            self.free_ids.pop(block_id, None)
        if moves:
            for _, dst in moves:
                self.free_ids.pop(dst, None)
            self.on_move([src for src, _ in moves], [dst for _, dst in moves])
            renamed = dict(moves)
            self.evictable.rename(renamed)
            self.snapshots.rename(renamed)
            for src, dst in moves:
                old, new = self.blocks[src], self.blocks[dst]
                new.digest, new.token_ids, new.filled, new.snapshot = old.digest, old.token_ids, old.filled, old.snapshot
                old.digest = old.token_ids = old.snapshot = None
                old.filled = 0
                self.index[new.digest] = dst
            self.num_moves += len(moves)
        return True

    def _evict_oldest(self) -> int:
        """Takes the least recently used cached block out of the LRU, its digest dropped; returns its id."""
        block_id, _ = self.evictable.popitem(last=False)
        self._drop_digest(self.blocks[block_id])
        self.blocks[block_id].filled = 0
        self.num_evictions += 1
        return block_id

    def _take(self, ids: Iterable[int], from_free: bool = True) -> list[int]:
        """Marks `ids` in use with one reference each (taking them out of the free ids first with `from_free`)."""
        taken = list(ids)
        for block_id in taken:
            if from_free:
                del self.free_ids[block_id]
            block = self.blocks[block_id]
            block.ref_count, block.filled = 1, 0
        self.num_in_use += len(taken)
        return taken

    def incref(self, block_ids: Iterable[int]) -> None:
        """Adds one reference to each block (a fork or a beam taking a copy of a block table)."""
        for block_id in block_ids:
            if block_id < 0:
                continue
            block = self.blocks[block_id]
            if block.ref_count == 0:  # a cached block taken back by a prefix hit
                del self.evictable[block_id]
                self.num_in_use += 1
                self.tokens_in_use += block.filled
            elif block.ref_count == 1:
                self.num_shared += 1
            block.ref_count += 1

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drops one reference from each block; blocks reaching zero become cached or free, last given first: given
        a row's table, its last cached blocks are evicted first and its leading ones, which every prefix hit on
        the row needs, last."""
        for block_id in reversed(list(block_ids)):
            if block_id < 0:
                continue
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} released more often than it was referenced")
            block.ref_count -= 1
            if block.ref_count == 1:
                self.num_shared -= 1
            if block.ref_count == 0:
                self.num_in_use -= 1
                self.tokens_in_use -= block.filled
                if block.digest is not None and self.prefix_caching:
                    self.evictable[block_id] = None  # most recently used goes last
                else:
                    self._drop_digest(block)
                    block.filled = 0
                    self.free_ids[block_id] = None

    def note_filled(self, block_id: int, filled: int, exact: bool = False) -> None:
        """Records that `filled` leading slots of a block in use hold K/V (a row wrote or reads that far).
        The count only grows, except with `exact` (the block's sole holder cropped it)."""
        block = self.blocks[block_id]
        new = filled if exact else max(block.filled, filled)
        if block.ref_count > 0:
            self.tokens_in_use += new - block.filled
        block.filled = new

    # ------------------------------------------------------------------ prefix index
    def peek(self, digest: bytes, token_ids: tuple[int, ...]) -> bool:
        """Whether `lookup(digest, token_ids)` would hit, without taking a reference."""
        block_id = self.index.get(digest)
        return block_id is not None and self.blocks[block_id].token_ids == token_ids

    def lookup(self, digest: bytes, token_ids: tuple[int, ...]) -> int | None:
        """Returns the indexed block holding exactly `token_ids` after the prefix `digest` names, with a
        reference taken, or None. The tokens are compared, so a digest collision is a miss."""
        block_id = self.index.get(digest)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        self.incref((block_id,))
        if block_id in self.snapshots:
            self.snapshots.move_to_end(block_id)
        return block_id

    def snapshot(self, digest: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The state slot of the snapshot at the end of the indexed block `peek(digest, token_ids)` finds, or None."""
        block_id = self.index.get(digest)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return self.blocks[block_id].snapshot

    def attach_snapshot(self, block_id: int, slot: int) -> bool:
        """Records that state slot `slot` holds the states at the end of an indexed block. Returns False (nothing
        recorded) when the block is not indexed or already has a snapshot."""
        block = self.blocks[block_id]
        if block.digest is None or block.snapshot is not None:
            return False
        block.snapshot = slot
        self.snapshots[block_id] = None
        return True

    def drop_oldest_snapshot(self) -> bool:
        """Lets go of the least recently used snapshot (its block stays indexed); False when there is none."""
        if not self.snapshots:
            return False
        block_id, _ = self.snapshots.popitem(last=False)
        self._release_snapshot(self.blocks[block_id])
        return True

    def snapshot_refs(self) -> Counter[int]:
        """State slot -> snapshots holding it."""
        return Counter(self.blocks[b].snapshot for b in self.snapshots)

    def _release_snapshot(self, block: Block) -> None:
        slot, block.snapshot = block.snapshot, None
        self.snapshots.pop(block.block_id, None)
        if slot is not None and self.on_snapshot_drop is not None:
            self.on_snapshot_drop(slot)

    def register(self, block_id: int, digest: bytes, token_ids: tuple[int, ...]) -> None:
        """Indexes a full block in use under `digest`. A digest already indexed keeps its first block."""
        if not self.prefix_caching or digest in self.index:
            return
        block = self.blocks[block_id]
        if block.digest is not None:
            return
        block.digest, block.token_ids = digest, token_ids
        self.index[digest] = block_id

    def _drop_digest(self, block: Block) -> None:
        if block.snapshot is not None:
            self._release_snapshot(block)
        if block.digest is not None:
            if self.index.get(block.digest) == block.block_id:
                del self.index[block.digest]
            block.digest = block.token_ids = None

    def clear_index(self) -> None:
        """Forgets every cached prefix: cached blocks become free."""
        for block_id in list(self.evictable):
            self._drop_digest(self.blocks[block_id])
            self.blocks[block_id].filled = 0
            self.free_ids[block_id] = None
        self.evictable.clear()
        for block in self.blocks:
            self._drop_digest(block)

    # ------------------------------------------------------------------ invariants
    def check(self, expected_refs: dict[int, int], expected_filled: dict[int, int] | None = None) -> None:
        """Raises AssertionError unless every invariant holds.

        Args:
            expected_refs: block id -> number of live block-table entries pointing at it.
            expected_filled: block id -> the most slots any live row holds in it; a block's `filled` is at
                least that (more only after a crop of a block others still share).
        """
        free, cached = set(self.free_ids), set(self.evictable)
        assert all(0 <= block_id < self.capacity for block_id in free), "a free id outside the pool"
        assert not free & cached, "a block is both free and cached"
        for block in self.blocks:
            refs = expected_refs.get(block.block_id, 0)
            assert block.ref_count == refs, (
                f"block {block.block_id}: ref_count {block.ref_count} but {refs} live references"
            )
            states = (block.block_id in free) + (block.block_id in cached) + (block.ref_count > 0)
            assert states == 1, f"block {block.block_id} is in {states} states (free/cached/in use)"
            if block.block_id in free:
                assert block.digest is None, f"free block {block.block_id} still has a digest"
            if block.block_id in cached:
                assert block.digest is not None, f"cached block {block.block_id} has no digest"
            if block.digest is not None:
                assert self.index.get(block.digest) == block.block_id, f"block {block.block_id} not indexed"
        in_use = [b for b in self.blocks if b.ref_count > 0]
        assert self.num_in_use == len(in_use), f"num_in_use {self.num_in_use} but {len(in_use)} blocks in use"
        shared = sum(b.ref_count > 1 for b in in_use)
        assert self.num_shared == shared, f"num_shared {self.num_shared} but {shared} blocks shared"
        tokens = sum(b.filled for b in in_use)
        assert self.tokens_in_use == tokens, f"tokens_in_use {self.tokens_in_use} but {tokens} filled slots"
        for block_id, filled in (expected_filled or {}).items():
            block = self.blocks[block_id]
            assert filled <= block.filled <= self.block_size, (
                f"block {block_id}: {block.filled} slots recorded filled, but a row holds {filled}"
            )
        for digest, block_id in self.index.items():
            assert self.blocks[block_id].digest == digest, f"index entry points at block {block_id} wrongly"
        holding = {b.block_id for b in self.blocks if b.snapshot is not None}
        assert holding == set(self.snapshots), "the snapshot LRU differs from the blocks holding snapshots"
        assert all(self.blocks[b].digest is not None for b in holding), "a block holds a snapshot but is not indexed"
        for block_id in expected_refs:
            assert 0 <= block_id < self.capacity, f"block table entry {block_id} outside the pool"
