"""What a forward needs from each row's block table, decided before anything changes.

`decide_growth` reads the tables and the allocator's reference counts and returns, per row, one `Growth`
step (share an identical row's blocks, write nothing, or write — with or without copying its partial last
block first — into a number of fresh blocks) and the blocks the group must hand out. `Rows.plan_forward`
checks every group's need against its allocator and only then has `grow_group` carry the steps out on
the lists it hands over, so a step that cannot fit fails before any block is allocated or evicted, and
the decision is made in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..attention.plan import ForwardPlan, GroupPlan
from ..attention.torch_meta import row_runs

if TYPE_CHECKING:
    from ..memory.allocator import BlockAllocator
    from ..memory.layers import LayerGroup
    from ..memory.pool import BlockPool


@dataclass(slots=True)
class Growth:
    """One row's step in one layer group.

    Attributes:
        share_with: an earlier identical row whose (new) table this row takes; None otherwise.
        copy_last: copy the partial last block before writing (it is shared or indexed).
        new_blocks: fresh blocks appended to the table.
    """

    share_with: int | None = None
    copy_last: bool = False
    new_blocks: int = 0


@dataclass(slots=True)
class Undo:
    """What a forward's plan changed, to put it back if the forward does not complete (`undo_growth`).

    Within a forward a row's table only grows, except that the row may copy its partial last block
    (copy-on-write) or take an identical row's table, so the undo keeps each table's length and those few
    replacements, not a copy of the tables: planning a decode step costs the same at any context length.

    Attributes:
        lengths: per group and row, the table's length before the forward.
        seq_lens: per row, tokens stored before the forward.
        num_columns: columns processed before the forward.
        held: per group, copy-on-write sources the plan still references: dropped at commit, so that a rollback
            never puts back a block that was freed (and reused by another cache) in the meantime.
        filled: `(group_id, block_id, filled)` of partial blocks written in place, to restore their filled count.
        copied: `(group_id, row, index, block_id)`: the row's entry `index` was `block_id` before copy-on-write.
        replaced: `(group_id, row, table)`: the row's table before it took an identical row's.
    """

    lengths: list[list[int]]
    seq_lens: list[int]
    num_columns: int
    held: list[list[int]]
    filled: list[tuple[int, int, int]] = field(default_factory=list)
    copied: list[tuple[int, int, int, int]] = field(default_factory=list)
    replaced: list[tuple[int, int, list[int]]] = field(default_factory=list)

    @staticmethod
    def before(tables: list[list[list[int]]], seq_lens: list[int], num_columns: int) -> Undo:
        """The undo of a forward about to change rows with these tables (`[group][row]`) and lengths."""
        return Undo([[len(t) for t in g] for g in tables], list(seq_lens), num_columns, [[] for _ in tables])


def undo_growth(pool: BlockPool, tables: list[list[list[int]]], undo: Undo) -> None:
    """Puts the rows' tables (`[group][row]`, changed in place) back as they were before the forward and
    returns the blocks it took; call under the pool's lock. A restored copy-on-write source takes back the
    reference `undo.held` kept for it; the rest of `held` is for the caller to drop."""
    for group_id, row, old in reversed(undo.replaced):
        allocator = pool.allocators[group_id]
        allocator.incref(old)
        allocator.decref(tables[group_id][row])
        tables[group_id][row] = old
    for group_id, row, index, old in undo.copied:
        table = tables[group_id][row]
        pool.allocators[group_id].decref((table[index],))
        table[index] = old
        undo.held[group_id].remove(old)
    for allocator, group_tables, lengths in zip(pool.allocators or [], tables, undo.lengths, strict=False):
        for table, length in zip(group_tables, lengths, strict=True):
            if len(table) > length:
                allocator.decref(table[length:])
                del table[length:]
    undo.replaced, undo.copied = [], []
    for group_id, block_id, filled in undo.filled:
        pool.allocators[group_id].note_filled(block_id, filled, exact=True)


def decide_growth(
    allocator: BlockAllocator,
    tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    identity: list[int] | None,
    block_size: int,
) -> tuple[list[Growth], int]:
    """Each row's step in a group and the number of blocks they take from its allocator.

    A partial last block is written in place only by a row that holds its sole reference and has not
    indexed it; rows processed earlier that copied away from a shared partial block (or took an identical
    row's table) no longer count as its holders.

    Args:
        tables: per row, the group's block ids before the forward.
        seq_lens: per row, tokens stored before the forward.
        query_lens: per row, real new tokens.
        identity: per row, the earlier identical row (itself if unique), or None.
    """
    refs: dict[int, int] = {}  # partial last blocks: references left as earlier rows move away from them
    copied: set[int] = set()
    steps: list[Growth] = []
    need = 0
    for b, n in enumerate(query_lens):
        old, table = seq_lens[b], tables[b]
        partial = table[old // block_size] if old % block_size else None
        rep = identity[b] if identity else b
        if rep != b:
            if rep in copied:  # rep's new table replaces this row's: its reference to the old partial goes
                refs[partial] -= 1
            steps.append(Growth(share_with=rep))
            continue
        if n == 0:
            steps.append(Growth())
            continue
        copy_last = False
        if partial is not None:
            count = refs.get(partial, allocator.ref_count(partial))
            if count > 1 or allocator.is_indexed(partial):
                copy_last = True
                refs[partial] = count - 1
                copied.add(b)
        fresh = math.ceil((old + n) / block_size) - len(table)
        steps.append(Growth(copy_last=copy_last, new_blocks=fresh))
        need += fresh + copy_last
    return steps, need


def grow_group(
    pool: BlockPool,
    group: LayerGroup,
    tables: list[list[int]],
    seq_lens: list[int],
    steps: list[Growth],
    query_lens: list[int],
    q_len: int,
    undo: Undo,
) -> GroupPlan:
    """Carries out one group's decided steps (shares, copies-on-write, allocations) on the rows' `tables`,
    under the pool's lock, recording in `undo` what a rollback needs, and returns the group's plan.

    Args:
        tables: the group's per-row block ids, changed in place (the rows' own lists, handed over by `Rows`).
        seq_lens: per row, tokens stored before the forward.
        undo: the forward's undo: copy-on-write sources (kept referenced until commit), replaced tables and
            the filled counts of partial blocks written in place are added to it.
    """
    bs, group_id = pool.block_size, group.group_id
    allocator = pool.allocators[group_id]
    write_rows: list[int] = []
    write_slots: list[int] = []
    cow_src: list[int] = []
    cow_dst: list[int] = []
    # A lone row, or rows that are each one run of ids at one stride (what the PyTorch path reads as one view),
    # grow into the ids after their own even where those hold cached blocks: they are moved (`BlockAllocator._clear`).
    in_place = len(tables) == 1 or (
        any(s.new_blocks for s in steps) and all(tables) and row_runs(tables) is not None
    )
    runs = _fresh_runs(allocator, tables, steps)
    # the other rows' blocks: a growing pool grows once for all of them (not row by row, doubling past the need)
    allocator.reserve(sum(s.new_blocks + s.copy_last for b, s in enumerate(steps) if b not in runs))
    for b, (step, n) in enumerate(zip(steps, query_lens, strict=True)):
        table = tables[b]
        if step.share_with is not None:  # identical to an earlier row: share its blocks, write nothing
            allocator.incref(tables[step.share_with])
            allocator.decref(table)
            undo.replaced.append((group_id, b, table))
            tables[b] = list(tables[step.share_with])
            continue
        if not n:
            continue
        old = seq_lens[b]
        last = old // bs
        if step.copy_last:
            (fresh,) = allocator.allocate(1)
            cow_src.append(table[last])
            cow_dst.append(fresh)
            undo.held[group_id].append(table[last])  # reference kept until commit
            undo.copied.append((group_id, b, last, table[last]))
            table[last] = fresh
        elif old % bs:
            undo.filled.append((group_id, table[last], allocator.filled(table[last])))
        if b in runs:
            table.extend(runs[b])
        else:  # into the blocks after the row's last one where they are free: the row stays one run of ids
            # (rows read in place, `in_place`, also have cached blocks there moved away)
            after = table[-1] if table else None
            table.extend(allocator.allocate(step.new_blocks, after=after, relocate=in_place))
        first = b * q_len + q_len - n  # flattened index of the row's first real column
        write_rows.extend(range(first, first + n))
        pos, end = old, old + n
        while pos < end:  # one slot range per block, not a Python step per token
            j = pos // bs
            stop = min(end, (j + 1) * bs)
            offset = (table[j] - j) * bs
            write_slots.extend(range(offset + pos, offset + stop))
            allocator.note_filled(table[j], stop - j * bs)
            pos = stop
    pool.copy_blocks(group_id, cow_src, cow_dst)
    return GroupPlan(tables, write_rows, write_slots, group.sliding_window)


def _fresh_runs(allocator: BlockAllocator, tables: list[list[int]], steps: list[Growth]) -> dict[int, list[int]]:
    """The blocks of the rows that hold none yet (a prefill), one run of ids per row spread with room after each
    (`BlockAllocator.allocate_runs`), by row; empty when there is none or no room (blocks are then taken as usual).
    When every row is fresh (a batch's first forward), the runs may also take ids that hold cached blocks, which are
    moved (`allocate_runs(..., relocate=True)`)."""
    fresh = [b for b, step in enumerate(steps) if not tables[b] and step.share_with is None and step.new_blocks]
    relocate = len(fresh) == len(tables)
    runs = allocator.allocate_runs([steps[b].new_blocks for b in fresh], relocate=relocate) if fresh else None
    return dict(zip(fresh, runs, strict=True)) if runs is not None else {}
