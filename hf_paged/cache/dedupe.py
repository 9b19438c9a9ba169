"""Identical rows of one forward, stored once (parallel samples, beams, repeated prompts)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import agree
from .rows import Rows


def identical_rows(
    rows: Rows,
    key: torch.Tensor,
    value: torch.Tensor,
    query_lens: list[int],
    q_len: int,
    group: dist.ProcessGroup | None = None,
) -> list[int] | None:
    """For each row, the first row it is identical to in this forward (itself when unique).

    Only rows with equal tables, lengths and new-token counts are candidates; their new tokens must be
    equal as known token ids, or (no tokens known) their first-layer K and V must be bitwise equal.
    Only forwards of 2+ columns are examined (prefills: generate repeats prompt rows for
    `num_return_sequences` / `num_beams`); a cheap fingerprint screens pairs before the exact compare.

    Args:
        key, value: `[batch, num_kv_heads, q_len, head_dim]` first-layer K/V of this forward.
        query_lens: per row, real new tokens (right-aligned).
        group: under tensor parallelism, the ranks that must decide alike: a decision read from this
            rank's K/V shard is agreed with theirs (`distributed.agree`).

    Returns:
        Per row, the index of the first identical row (itself when unique); None when all differ.
    """
    if key.shape[0] < 2 or q_len < 2:
        return None
    signature = [rows.signature(b, query_lens[b]) for b in range(key.shape[0])]
    if len(set(signature)) == len(signature):
        return None
    need_compare = [b for b in range(key.shape[0]) if signature[b][-1] is None]
    fingerprints: dict[int, float] = {}
    if need_compare:
        flat = torch.cat([key.reshape(key.shape[0], -1), value.reshape(value.shape[0], -1)], dim=1).float()
        sums = (flat.sum(1) + flat.abs().sum(1) * 1.6180339).tolist()
        fingerprints = {b: sums[b] for b in need_compare}
    identity = list(range(key.shape[0]))
    for b in range(1, key.shape[0]):
        for a in range(b):
            if identity[a] != a or signature[a] != signature[b]:
                continue
            if signature[b][-1] is None:
                if fingerprints[a] != fingerprints[b]:
                    continue
                cols = slice(q_len - query_lens[b], q_len)
                same = torch.equal(key[a, :, cols], key[b, :, cols]) and torch.equal(value[a, :, cols], value[b, :, cols])
                if not same:
                    continue
            identity[b] = a
            break
    if need_compare and group is not None:  # every rank of the group reaches this line in the same forward
        identity = agree(identity, group, key.device)
    return identity
