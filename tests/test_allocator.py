"""Unit tests of `BlockAllocator`: exact block ids, reference counts, LRU eviction order, invariants."""

from __future__ import annotations

import pytest

from hf_paged import OutOfBlocksError
from hf_paged.memory.allocator import BlockAllocator, LruIds


def digest(i: int) -> bytes:
    return i.to_bytes(16, "little")


def state(a: BlockAllocator) -> tuple:
    return ([b.ref_count for b in a.blocks], list(a.free_ids), list(a.evictable), dict(a.index), a.num_evictions)


def refs_of(a: BlockAllocator) -> dict[int, int]:
    return {b.block_id: b.ref_count for b in a.blocks if b.ref_count}


def test_allocates_lowest_free_ids_first_in_fifo_order():
    a = BlockAllocator(block_size=4, max_blocks=6)
    assert a.allocate(2) == [0, 1]
    assert a.allocate(1) == [2]
    a.decref([0, 1])
    assert list(a.free_ids) == [3, 4, 5, 1, 0]  # released blocks queue behind never-used ones, last given first
    assert a.allocate(4) == [1, 3, 4, 5]  # (handed out in increasing order)
    assert [b.ref_count for b in a.blocks] == [0, 1, 1, 1, 1, 1]
    a.check(refs_of(a))


def test_blocks_released_together_come_back_as_a_run():
    """A finished row's blocks, released together, are handed out again in increasing order: the next row that
    takes them is one run of ids (read in place on the PyTorch path) rather than the row's table reversed."""
    a = BlockAllocator(block_size=4, max_blocks=8)
    first = a.allocate(5)
    a.allocate(3)
    a.decref(first)
    assert a.allocate(5) == [0, 1, 2, 3, 4]
    a.check(refs_of(a))


def test_a_growing_row_takes_the_blocks_after_its_own_when_they_are_free():
    a = BlockAllocator(block_size=4, max_blocks=8)
    assert a.allocate(2) == [0, 1]
    assert a.allocate(2, after=5) == [6, 7]  # free: taken out of the FIFO order
    assert a.allocate(1, after=1) == [2]
    assert a.allocate(2, after=6) == [3, 4]  # 7 is in use: the first free ids instead
    a.decref([3])
    assert a.allocate(1, after=-1) == [5] and a.allocate(1, after=2) == [3]  # (-1: a freed window block)
    a.check(refs_of(a))


def test_a_row_at_the_end_of_a_grown_pool_stays_one_run():
    a = BlockAllocator(block_size=4)
    assert a.allocate(3) == list(range(3))
    a.allocate(13)  # capacity 16, every block in use
    a.reserve(1)
    assert a.capacity == 32 and a.allocate(1, after=15) == [16]
    b = BlockAllocator(block_size=4)
    b.allocate(16)
    b.decref([15])
    b.reserve(2)
    assert b.allocate(2, after=14) == [15, 16] and b.capacity == 30  # the free end and past it
    b.check(refs_of(b))


def _cached_blocks(a: BlockAllocator, ids: list[int]) -> None:
    """Registers `ids` (blocks in use) under digests of their ids, filled halfway, then releases them in order."""
    for i in ids:
        a.register(i, digest(i), (i, i))
        a.note_filled(i, 1)
    for i in ids:
        a.decref([i])


def test_a_lone_row_moves_cached_blocks_out_of_its_way():
    """`relocate=True`: cached blocks after the row are copied (`on_move`) to free ids and keep their digest, tokens,
    filled slots and place in the LRU order there; the row takes the ids after its own; nothing is evicted."""
    moved = []
    a = BlockAllocator(block_size=2, max_blocks=10, on_move=lambda src, dst: moved.append((src, dst)))
    row = a.allocate(2)  # [0, 1]
    _cached_blocks(a, a.allocate(4))  # 2..5 cached, LRU order 2, 3, 4, 5; 6..9 free
    assert a.allocate(2, after=row[-1]) == [6, 7]  # without relocate: the next free ids
    a.decref([6, 7])
    assert a.allocate(3, after=row[-1], relocate=True) == [2, 3, 4]
    assert moved == [([2, 3, 4], [8, 9, 7])]  # free ids outside the row's, in the free ids' order
    assert list(a.evictable) == [8, 9, 7, 5] and a.num_evictions == 0 and a.num_moves == 3
    for src, dst in zip([2, 3, 4], [8, 9, 7]):
        assert a.blocks[dst].digest == digest(src) and a.blocks[dst].token_ids == (src, src)
        assert a.blocks[dst].filled == 1 and a.blocks[src].digest is None
    assert a.lookup(digest(3), (3, 3)) == 9
    a.check({0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 9: 1})


def test_moving_cached_blocks_drops_the_digests_a_plain_allocation_drops():
    """With no free block left, the blocks evicted are the least recently used, wherever they are: here two of the
    row's next ids, evicted in place, and one elsewhere, whose id then holds the row's third, moved."""
    def pool(on_move=None) -> BlockAllocator:
        a = BlockAllocator(block_size=2, max_blocks=8, on_move=on_move)
        a.allocate(2)  # the row: [0, 1]
        a.allocate(6)  # 2..7
        _cached_blocks(a, [5, 3, 2, 4, 6, 7])  # LRU order
        return a

    moved = []
    plain, moving = pool(), pool(lambda src, dst: moved.append((src, dst)))
    assert plain.allocate(3, after=1, relocate=True) == [2, 3, 5]  # (no on_move: a plain allocation)
    assert moving.allocate(3, after=1, relocate=True) == [2, 3, 4]
    assert set(moving.index) == set(plain.index) == {digest(i) for i in (4, 6, 7)}
    assert moving.num_evictions == plain.num_evictions == 3
    assert moved == [([4], [5])]
    assert [moving.blocks[i].digest for i in moving.evictable] == [digest(i) for i in (4, 6, 7)]  # LRU order kept
    assert list(moving.evictable) == [5, 6, 7] and not moving.free_ids
    moving.check({i: 1 for i in range(5)})


def test_a_moved_block_keeps_its_recurrent_state_snapshot():
    dropped = []
    a = BlockAllocator(block_size=2, max_blocks=6, on_snapshot_drop=dropped.append, on_move=lambda src, dst: None)
    a.allocate(2)
    (block,) = a.allocate(1)  # 2
    a.register(block, digest(2), (2, 2))
    assert a.attach_snapshot(block, slot=7)
    a.decref([block])
    assert a.allocate(1, after=1, relocate=True) == [2]
    (moved_to,) = a.evictable
    assert a.blocks[moved_to].snapshot == 7 and list(a.snapshots) == [moved_to] and a.blocks[2].snapshot is None
    assert a.snapshot(digest(2), (2, 2)) == 7 and not dropped
    a.check({0: 1, 1: 1, 2: 1})


def test_a_block_in_use_or_past_the_end_is_never_moved():
    moved = []
    a = BlockAllocator(block_size=2, max_blocks=6, on_move=lambda src, dst: moved.append((src, dst)))
    a.allocate(2)
    _cached_blocks(a, a.allocate(1))  # block 2 cached
    assert a.allocate(1, after=3) == [4]  # in use
    assert a.allocate(3, after=1, relocate=True) == [2, 3, 5]  # 2..4 not clear (4 in use): a plain allocation
    assert a.num_evictions == 1
    b = BlockAllocator(block_size=2, max_blocks=4, on_move=lambda src, dst: moved.append((src, dst)))
    b.allocate(2)
    _cached_blocks(b, b.allocate(2))  # 2, 3 cached
    assert b.allocate(1, after=3, relocate=True) == [2]  # 4 is past the end: the least recently used instead
    assert not moved
    a.check({i: 1 for i in range(6)})
    b.check({0: 1, 1: 1, 2: 1})


def test_fresh_rows_take_runs_spread_with_room_to_grow():
    a = BlockAllocator(block_size=4)
    runs = a.allocate_runs([3, 3, 3, 3])
    assert a.capacity == 24 and runs == [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]]  # one stride: 6
    assert [a.allocate(3, after=run[-1]) for run in runs] == [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 22, 23]]
    a.check(refs_of(a))
    uneven = BlockAllocator(block_size=4)
    assert uneven.allocate_runs([2, 4]) == [[0, 1], [8, 9, 10, 11]]  # grown: spread over all of it, one stride
    assert uneven.capacity == 16
    reused = BlockAllocator(block_size=4, max_blocks=16)
    assert reused.allocate_runs([2, 2]) == [[8, 9], [12, 13]]  # no growth: twice the total at the end
    fixed = BlockAllocator(block_size=4, max_blocks=10)
    fixed.allocate(2)
    assert fixed.allocate_runs([1, 5]) == [[2], [3, 4, 5, 6, 7]]  # 8 free at the end: room in proportion to each run
    fixed.check(refs_of(fixed))


def test_fresh_rows_move_cached_blocks_out_of_their_runs():
    """`allocate_runs(relocate=True)` on a pool whose end holds cached blocks: the runs are spread over the ids no
    row holds, as over free ones; the digests dropped are the ones a plain allocation of the total drops (the
    least recently used), and the cached blocks that keep theirs are moved to ids outside the runs, keeping their
    place in the LRU order. Without `relocate` (or without an `on_move`) there is no room: None, nothing changed."""
    moved = []

    def pool(on_move=None) -> BlockAllocator:
        a = BlockAllocator(block_size=2, max_blocks=12, on_move=on_move)
        a.allocate(12)
        a.decref([0, 1])  # free
        _cached_blocks(a, [9, 2, 3, 4, 5, 6, 7, 8, 10, 11])  # LRU order
        return a

    plain, moving = pool(), pool(lambda src, dst: moved.append((src, dst)))
    before = state(moving)
    assert moving.allocate_runs([2, 2]) is None and plain.allocate_runs([2, 2], relocate=True) is None
    assert state(moving) == before
    runs = moving.allocate_runs([2, 2], relocate=True)
    assert runs == [[4, 5], [8, 9]]  # over the last 8 ids (twice the total), one stride
    assert plain.allocate(4) == [0, 1, 2, 9]  # what a plain allocation takes: the 2 free, then the 2 oldest
    assert set(moving.index) == set(plain.index) and moving.num_evictions == plain.num_evictions == 2
    assert moved == [([4, 5, 8], [2, 1, 0])]  # (9 was evicted: nothing to move)
    assert [moving.blocks[i].digest for i in moving.evictable] == [digest(i) for i in (3, 4, 5, 6, 7, 8, 10, 11)]
    moving.check({i: 1 for i in (4, 5, 8, 9)})


def test_the_lru_order_renames_ids_in_place():
    lru = LruIds()
    for i in (5, 3, 8, 1):
        lru[i] = None
    lru[3] = None  # already in: keeps its place, as an OrderedDict
    lru.rename({3: 30, 1: 10, 7: 70})  # (7 is not in it)
    assert list(lru) == [5, 30, 8, 10] and 3 not in lru and 30 in lru and len(lru) == 4
    lru.move_to_end(5)
    del lru[8]
    assert lru.popitem(last=False) == (30, None) and list(lru) == [10, 5]
    lru.pop(99)
    lru.clear()
    assert not lru and list(lru) == []


def test_no_room_for_runs_changes_nothing():
    a = BlockAllocator(block_size=4, max_blocks=4)
    a.allocate(1)
    before = state(a)
    assert a.allocate_runs([2, 2]) is None and a.allocate_runs([0, 1]) is None
    assert state(a) == before


def test_zero_or_negative_request_allocates_nothing():
    a = BlockAllocator(block_size=4, max_blocks=2)
    assert a.allocate(0) == [] and a.allocate(-3) == []
    assert list(a.free_ids) == [0, 1]


def test_refcounts_follow_incref_and_decref():
    a = BlockAllocator(block_size=2, max_blocks=4)
    ids = a.allocate(2)
    a.incref(ids)  # a fork
    a.incref([ids[1], -1])  # -1 (freed sliding-window entry) is ignored
    assert [a.blocks[i].ref_count for i in ids] == [2, 3]
    a.check({0: 2, 1: 3})
    a.decref(ids)
    a.decref([1, 1, -1])
    assert [b.ref_count for b in a.blocks] == [1, 0, 0, 0]
    assert list(a.free_ids) == [2, 3, 1]
    a.check({0: 1})


def test_double_free_raises_and_changes_nothing_more():
    a = BlockAllocator(block_size=2, max_blocks=3)
    (block,) = a.allocate(1)
    a.decref([block])
    with pytest.raises(RuntimeError, match="released more often"):
        a.decref([block])
    assert list(a.free_ids).count(block) == 1
    a.check({})


def test_out_of_blocks_leaves_everything_unchanged_and_says_what_to_do():
    a = BlockAllocator(block_size=16, max_blocks=4)
    a.allocate(2)
    a.register(1, digest(1), (1,) * 16)
    a.decref([1])  # cached, evictable
    before = state(a)
    with pytest.raises(OutOfBlocksError) as info:
        a.allocate(4)  # 2 free + 1 evictable < 4
    err = info.value
    assert isinstance(err, RuntimeError)
    assert (err.blocks_needed, err.blocks_free, err.blocks_total) == (4, 3, 4)
    assert "needs 4 new block(s) of 16 tokens" in str(err) and "num_blocks" in str(err) and "release" in str(err)
    assert state(a) == before
    a.check({0: 1})


def test_unbounded_allocator_grows_to_twice_what_it_holds():
    a = BlockAllocator(block_size=4, num_blocks=0, max_blocks=None)
    assert a.capacity == 0
    assert a.allocate(3) == [0, 1, 2]
    assert a.capacity == 16  # at least 16
    assert a.allocate(14) == list(range(3, 17))
    assert a.capacity == 17  # what it needs: more than twice the 3 blocks it held
    assert a.allocate(1) == [17] and a.capacity == 34  # full: twice the 17 it holds
    a.check({i: 1 for i in range(18)})


def test_a_forward_reserves_once_for_all_its_rows():
    a = BlockAllocator(block_size=4)
    a.allocate(10)
    a.decref([4, 5, 6, 7])  # 6 held, 10 free of 16
    a.reserve(20)
    assert a.capacity == 26 and a.num_available == 20  # one growth, to the need (more than twice the 6 held)
    before = a.capacity
    a.reserve(3)
    assert a.capacity == before  # enough already
    fixed = BlockAllocator(block_size=4, max_blocks=4)
    fixed.reserve(10)
    assert fixed.capacity == 4


def test_a_released_rows_last_blocks_are_evicted_first():
    """A row's table released at once is cached last block first: eviction takes its tail before its head, and a
    prefix hit on what is left still finds the leading blocks."""
    a = BlockAllocator(block_size=2, max_blocks=4)
    ids = a.allocate(3)
    for i in ids:
        a.register(i, digest(i), (i, i))
    a.decref(ids)
    assert list(a.evictable) == [2, 1, 0]
    assert a.allocate(2) == [2, 3]  # the free block, then the row's last
    assert a.lookup(digest(0), (0, 0)) == 0 and a.lookup(digest(1), (1, 1)) == 1
    a.check(refs_of(a))


def test_cached_blocks_are_evicted_last_in_lru_order():
    a = BlockAllocator(block_size=2, max_blocks=5)
    ids = a.allocate(4)  # [0, 1, 2, 3]; block 4 stays free
    for i in ids:
        a.register(i, digest(i), (i, i))
    a.decref([2])
    a.decref([0])
    a.decref([3])  # LRU order now 2, 0, 3; block 1 still in use
    assert list(a.evictable) == [2, 0, 3]
    # A prefix hit on block 0 takes it back and, once released again, makes it most recent.
    assert a.lookup(digest(0), (0, 0)) == 0
    a.decref([0])
    assert list(a.evictable) == [2, 3, 0]
    a.check({1: 1})
    # The free block goes first, then the least recently used cached blocks, dropping their digests.
    assert a.allocate(1) == [4]
    assert a.num_evictions == 0
    assert a.allocate(2) == [2, 3]
    assert a.num_evictions == 2
    assert digest(2) not in a.index and digest(3) not in a.index and a.blocks[2].digest is None
    assert a.lookup(digest(2), (2, 2)) is None
    assert list(a.evictable) == [0]
    a.check({1: 1, 2: 1, 3: 1, 4: 1})


def test_lookup_compares_tokens_so_a_digest_collision_misses():
    a = BlockAllocator(block_size=2, max_blocks=2)
    (block,) = a.allocate(1)
    a.register(block, digest(7), (5, 6))
    a.decref([block])
    assert a.lookup(digest(7), (5, 9)) is None  # same digest, other tokens: never served
    assert a.blocks[block].ref_count == 0 and list(a.evictable) == [block]
    assert a.lookup(digest(7), (5, 6)) == block
    assert a.blocks[block].ref_count == 1 and not a.evictable
    a.check({block: 1})


def test_register_keeps_first_block_of_a_digest():
    a = BlockAllocator(block_size=2, max_blocks=3)
    x, y = a.allocate(2)
    a.register(x, digest(1), (1, 1))
    a.register(y, digest(1), (1, 1))  # same prefix computed twice: the index keeps x
    assert a.index == {digest(1): x} and a.blocks[y].digest is None
    a.decref([x, y])
    assert list(a.evictable) == [x] and list(a.free_ids) == [2, y]
    a.check({})


def test_without_prefix_caching_released_blocks_are_free():
    a = BlockAllocator(block_size=2, max_blocks=2, prefix_caching=False)
    (x,) = a.allocate(1)
    a.register(x, digest(1), (1, 1))
    assert not a.index
    a.decref([x])
    assert list(a.free_ids) == [1, x] and not a.evictable


def test_clear_index_frees_cached_blocks_and_forgets_digests_of_blocks_in_use():
    a = BlockAllocator(block_size=2, max_blocks=3)
    x, y = a.allocate(2)
    a.register(x, digest(1), (1, 1))
    a.register(y, digest(2), (2, 2))
    a.decref([x])
    a.clear_index()
    assert not a.index and not a.evictable and a.blocks[y].digest is None
    assert list(a.free_ids) == [2, x]
    a.decref([y])
    assert list(a.free_ids) == [2, x, y]
    a.check({})


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda a: a.free_ids.__setitem__(7, None), "a free id outside the pool"),
        (lambda a: a.free_ids.__setitem__(1, None), "in 2 states"),  # referenced block in the free queue
        (lambda a: setattr(a.blocks[1], "ref_count", 2), "ref_count 2 but 1"),  # leak
        (lambda a: setattr(a.blocks[1], "ref_count", 0), "ref_count 0 but 1"),  # lost reference
        (lambda a: a.evictable.__setitem__(0, None), "both free and cached"),
        (lambda a: a.free_ids.pop(3), "in 0 states"),  # leaked: neither free, cached nor used
        (lambda a: setattr(a.blocks[2], "digest", None), "cached block 2 has no digest"),
        (lambda a: a.index.__setitem__(digest(9), 1), "index entry points at block 1 wrongly"),
    ],
)
def test_check_detects_every_kind_of_corruption(corrupt, message):
    a = BlockAllocator(block_size=2, max_blocks=4)
    a.allocate(3)  # 0, 1, 2 in use; 3 free
    a.register(2, digest(2), (2, 2))
    a.decref([0, 2])  # 0 free, 2 cached, 1 in use
    a.check({1: 1})
    corrupt(a)
    with pytest.raises(AssertionError, match=message):
        a.check({1: 1})


def test_check_detects_table_entries_outside_the_pool():
    a = BlockAllocator(block_size=2, max_blocks=2)
    with pytest.raises(AssertionError, match="outside the pool"):
        a.check({5: 1})


def test_state_snapshots_follow_their_blocks_in_lru_order():
    """A snapshot (a state slot id) is held only by an indexed block; it goes with the block's digest (eviction,
    clear_index) or as the least recently used one, each time through `on_snapshot_drop`."""
    dropped: list[int] = []
    a = BlockAllocator(block_size=2, max_blocks=4, on_snapshot_drop=dropped.append)
    ids = a.allocate(3)
    assert not a.attach_snapshot(ids[0], 10)  # not indexed
    for i, block_id in enumerate(ids):
        a.register(block_id, digest(i), (i, i))
        assert a.attach_snapshot(block_id, 10 + i)
    assert not a.attach_snapshot(ids[0], 99)  # one snapshot per block
    assert a.snapshot(digest(1), (1, 1)) == 11 and a.snapshot(digest(1), (9, 9)) is None
    assert a.snapshot_refs() == {10: 1, 11: 1, 12: 1}
    a.decref(ids)  # all three cached, snapshots kept
    assert a.lookup(digest(0), (0, 0)) == ids[0]  # a hit makes block 0's snapshot the most recently used
    a.decref([ids[0]])
    assert list(a.snapshots) == [ids[1], ids[2], ids[0]]
    assert a.drop_oldest_snapshot() and dropped == [11]
    assert a.is_indexed(ids[1]) and a.snapshot(digest(1), (1, 1)) is None  # the block stays indexed
    a.allocate(3)  # the free block, then cached blocks 1 (its snapshot already gone) and 2 with its snapshot
    assert dropped == [11, 12]
    a.check(refs_of(a))
    a.clear_index()
    assert dropped == [11, 12, 10] and not a.snapshots
    a.check(refs_of(a))


def test_a_growing_pool_never_grows_only_to_keep_rows_in_runs():
    """A row at the end of a growing pool whose other blocks are free (a sliding window freed them) takes a free
    block elsewhere, and fresh rows without room at the end take the first free ids: the pool stays its size."""
    a = BlockAllocator(block_size=4)
    a.allocate(16)
    a.decref(range(8))  # (queued 7, 6, ..., 0)
    assert a.allocate(1, after=15) == [7] and a.capacity == 16
    assert a.allocate_runs([2, 2]) is None and a.capacity == 16
    assert a.allocate(2) == [5, 6]
    a.check(refs_of(a))
