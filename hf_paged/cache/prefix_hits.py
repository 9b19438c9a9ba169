"""Prefix hits: a new cache takes the longest cached prefix of each prompt from its pool's index.

generate() sees one cached length for the whole batch (it slices its inputs by `get_seq_length()`), so
with left padding every row keeps `columns - pad` tokens, where `columns` is the smallest `pad + hit`
over the rows; a row may then hold part of a cached block (it is copied on its first write). Sliding
groups need the blocks of the last window to be present, and take up to `SLIDING_MARGIN` tokens more
where the index still has them, as a cache that computed the prompt keeps them (so `crop()` can step
back as far).

Hybrid models: a row's hit must end where the index holds a snapshot of the recurrent states (at the end of an
indexed block, `BlockPool.hold_snapshot`), and reusing blocks without it would be wrong. The batch takes the most
columns at which every row keeps either nothing or exactly a snapshot's tokens; each row of the hit then starts from
its snapshot's slot (shared, copied on its first write), a row keeping nothing from zeroed states.

Non-text inputs (vision-language models): a row's digests cover its images from the block holding its first
placeholder token on (`prefix.py`), and stop there when the cache was not told the content. A batch keeps either
none of its placeholders (every row's hit ends before the block holding its first one) or, for the models of
`support.HITS_OVER_PLACEHOLDERS`, all of them (generate() then runs without the non-text inputs:
`PagedCache.uncached_inputs`); never part of an image, whose features the model computes whole.

This module only reads the index (`BlockAllocator.peek`); `Rows.adopt_prompt` takes the blocks it found and
`BlockPool.take_snapshot` the snapshots.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from transformers import PretrainedConfig

from ..compat import IMAGE_PROMPT_HITS
from ..memory.prefix import content_keys
from ..support import attends_prefix_bidirectionally, hits_over_placeholders, placeholder_token_ids
from .rows import SLIDING_MARGIN, Rows


def check_prompt(input_ids: object, attention_mask: object, vocab_size: int | None) -> None:
    """Raises a clear error unless `input_ids` is a `[batch, seq_len]` integer tensor whose real tokens lie in
    `[0, vocab_size)` and `attention_mask` (if given) a 0/1 tensor of the same shape leaving each row a token.

    Args:
        input_ids: `[batch, seq_len]` token ids (padding positions may hold any id).
        attention_mask: `[batch, seq_len]`, 0 on padding, or None.
        vocab_size: the model's vocabulary size, or None when unknown.
    """
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor [batch, seq_len], got {type(input_ids).__name__}.")
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be [batch, seq_len], got shape {list(input_ids.shape)}; for one prompt pass "
            "input_ids[None] (or the tokenizer's return_tensors='pt' output)."
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids (torch.long), got {input_ids.dtype}; floats are not truncated.")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            shape = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
            raise ValueError(
                f"attention_mask must be a tensor of input_ids' shape {list(input_ids.shape)}, got {shape}: pass the "
                "mask the tokenizer returned with these input_ids."
            )
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (token).")
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if input_ids.shape[1] == 0 or not bool(real.any(dim=1).all()):
        raise ValueError("Every prompt row needs at least one token (attention_mask 1), e.g. the BOS token.")
    if vocab_size is not None and bool((((input_ids < 0) | (input_ids >= vocab_size)) & real).any()):
        raise ValueError(f"input_ids hold token ids outside the model's vocabulary [0, {vocab_size}).")


def load_prompt(
    rows: Rows, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, salt: str | bytes | None,
    non_text: Mapping[str, torch.Tensor] | None = None, config: PretrainedConfig | None = None,
) -> list[int | None] | None:
    """Records the prompts in `rows` (empty) and has them take each row's longest cached prefix.

    Args:
        input_ids: `[batch, seq_len]` left-padded prompts.
        attention_mask: `[batch, seq_len]`, 0 on padding, or None.
        salt: tenant key of the prefix index.
        non_text: the prompts' non-text inputs (`pixel_values` ...), keyed into the digests of their rows;
            None or empty when there are none or they are unknown (then no hit reaches a placeholder).
        config: the model's config, which names its placeholder ids; None for the pool's.

    Returns:
        For a hybrid model's hit, per row the state slot of its snapshot (a reference taken for the cache's
        `RowStates.adopt`) or None for a row that keeps no token; None when nothing was hit or the model has no
        recurrent layers.

    Raises:
        TypeError, ValueError: see `check_prompt`; raised before anything is stored.
    """
    check_prompt(input_ids, attention_mask, getattr(rows.pool.config, "vocab_size", None))
    ids = input_ids.tolist()
    mask = attention_mask.tolist() if attention_mask is not None else [[1] * len(r) for r in ids]
    pads, prompts = [], []
    for row, row_mask in zip(ids, mask, strict=True):
        pad = next((i for i, m in enumerate(row_mask) if m), len(row_mask))
        if not all(row_mask[pad:]):
            raise ValueError("new_cache() expects left-padded prompts (attention_mask zeros only on the left).")
        pads.append(pad)
        prompts.append(row[pad:])
    bs = rows.block_size
    if config is not None:
        rows.use_placeholders(placeholder_token_ids(config))
        rows.pool.learn_placeholders(config)
    placeholders = rows.placeholder_ids()
    contents: list[bytes | None] = [None] * len(prompts)
    if non_text:
        contents = list(content_keys(non_text, [sum(t in placeholders for t in p) for p in prompts]))
    digests = [rows.prompt_digests(p, salt, c) for p, c in zip(prompts, contents, strict=True)]
    starts = [rows.content_start(p, c) for p, c in zip(prompts, contents, strict=True)]
    over = bool(placeholders) and (
        hits_over_placeholders(config) if config is not None else rows.pool.hits_over_placeholders
    )
    with rows.pool.lock:
        if rows.pool.allocators is None:
            rows.adopt_prompt(prompts, digests, [0] * len(ids), [[] for _ in ids], 0, contents, pads)
            return None
        if rows.pool.layout.is_hybrid:
            return _load_hybrid(rows, prompts, digests, pads, starts, contents)
        # whole blocks only, and at least the last token left to compute: a hit then never writes into a cached
        # block, so it needs no copy-on-write block a miss would not
        limits = [min(_hit_blocks(rows, d, p), (len(p) - 1) // bs) * bs for d, p in zip(digests, prompts, strict=True)]
        if config is None and placeholders and not over:
            # generate() positions a continued prompt of such a VLM (Qwen2-VL's kind) by an offset its model keeps
            # from its previous call, which new_cache clears only when given the model: without it, a row with no
            # placeholder misses (one with them is positioned anew, its uncached columns holding them)
            limits = [0 if start is None else limit for start, limit in zip(starts, limits, strict=True)]
        columns = max(0, min(pad + limit for pad, limit in zip(pads, limits, strict=True)))
        if not IMAGE_PROMPT_HITS and any(t in placeholders for p in prompts for t in p):
            columns = 0  # (an older transformers release: see compat.IMAGE_PROMPT_HITS)
        if attends_prefix_bidirectionally(config if config is not None else rows.pool.config):
            columns = 0  # its prompt tokens' K/V depend on the tokens after them
        keep_images = _placeholder_columns(prompts, pads, starts, placeholders, bs, over)
        while columns > 0:  # placeholders all or none; sliding groups must also hold each row's last window
            start = lowest = keep_images(columns)
            for b, pad in enumerate(pads):
                kept = max(0, start - pad)
                ok = _window_ok(rows, digests[b], prompts[b], kept)
                if ok < kept:
                    lowest = min(lowest, pad + ok)
            if lowest == columns:
                break
            columns = lowest
        kept = [max(0, columns - pad) for pad in pads]
        first = [_first_blocks(rows, digests[b], prompts[b], k) for b, k in enumerate(kept)]
        rows.adopt_prompt(prompts, digests, kept, first, columns, contents, pads)
        return None


def _placeholder_columns(
    prompts: list[list[int]], pads: list[int], starts: list[int | None], placeholders: frozenset[int], bs: int,
    over: bool,
) -> Callable[[int], int]:
    """The rule that a batch's hit keeps no placeholder (each row's hit ends at or before the start of the block
    holding its first one) or, when `over`, every placeholder of every row: a function from candidate columns to
    the most columns at or below them that follow it."""
    rows = [b for b, start in enumerate(starts) if start is not None]
    floors = {b: starts[b] // bs * bs for b in rows}
    lasts = {b: max((i for i, t in enumerate(prompts[b]) if t in placeholders), default=starts[b]) for b in rows}
    below = min((pads[b] + floors[b] for b in rows), default=None)

    def allowed(columns: int) -> int:
        kept = {b: max(0, columns - pads[b]) for b in rows}
        if all(kept[b] <= floors[b] for b in rows) or (over and all(kept[b] > lasts[b] for b in rows)):
            return columns
        return min(columns, below)

    return allowed


def _load_hybrid(
    rows: Rows, prompts: list[list[int]], digests: list[list[bytes]], pads: list[int], starts: list[int | None],
    contents: list[bytes | None],
) -> list[int | None] | None:
    """A hybrid model's prompts take the most columns at which every row keeps nothing or a snapshot's tokens,
    none of them a placeholder (call under the pool lock). Returns the rows' snapshot slots (see `load_prompt`)."""
    bs, pool = rows.block_size, rows.pool
    points = [
        {k for k in _snapshot_points(rows, d, p) if start is None or k <= start // bs * bs}
        for d, p, start in zip(digests, prompts, starts, strict=True)
    ]
    for columns in sorted({pad + k for pad, ks in zip(pads, points, strict=True) for k in ks}, reverse=True):
        kept = [max(0, columns - pad) for pad in pads]
        if not all(k == 0 or k in ks for k, ks in zip(kept, points, strict=True)):
            continue
        if any(_window_ok(rows, digests[b], prompts[b], k) < k for b, k in enumerate(kept)):
            continue
        first = [_first_blocks(rows, digests[b], prompts[b], k) for b, k in enumerate(kept)]
        rows.adopt_prompt(prompts, digests, kept, first, columns, contents, pads)
        return [
            None if k == 0 else pool.take_snapshot(digests[b][k // bs - 1], tuple(prompts[b][k - bs : k]))
            for b, k in enumerate(kept)
        ]
    rows.adopt_prompt(
        prompts, digests, [0] * len(prompts), [[0] * len(pool.allocators) for _ in prompts], 0, contents, pads
    )
    return None


def _snapshot_points(rows: Rows, digests: list[bytes], tokens: list[int]) -> list[int]:
    """Token counts (whole blocks, the last token left to compute) after which the index holds every block of a
    row and a snapshot of its recurrent states."""
    bs = rows.block_size
    blocks = min(_hit_blocks(rows, digests, tokens), (len(tokens) - 1) // bs)
    return [(j + 1) * bs for j in range(blocks) if rows.pool.has_snapshot(digests[j], tuple(tokens[j * bs : (j + 1) * bs]))]


def _hit_blocks(rows: Rows, digests: list[bytes], tokens: list[int]) -> int:
    """Leading blocks found in the full-attention groups' indexes."""
    bs = rows.block_size
    full = [a for g, a in zip(rows.pool.layout.groups, rows.pool.allocators, strict=True) if g.sliding_window is None]
    count = 0
    for j, digest in enumerate(digests):
        chunk = tuple(tokens[j * bs : (j + 1) * bs])
        if not all(a.peek(digest, chunk) for a in full):
            break
        count += 1
    return count

def _window_ok(rows: Rows, digests: list[bytes], tokens: list[int], kept: int) -> int:
    """`kept` if sliding groups hold the blocks a row of `kept` tokens still attends, else a smaller
    candidate (in columns of that row) below the missing block."""
    bs = rows.block_size
    for group, allocator in zip(rows.pool.layout.groups, rows.pool.allocators, strict=True):
        if group.sliding_window is None or kept == 0:
            continue
        for j in range(max(0, kept - group.sliding_window) // bs, math.ceil(kept / bs)):
            if j >= len(digests) or not allocator.peek(digests[j], tuple(tokens[j * bs : (j + 1) * bs])):
                return j * bs
    return kept

def _first_blocks(rows: Rows, digests: list[bytes], tokens: list[int], kept: int) -> list[int]:
    """Per group, the leading blocks a row of `kept` tokens does not take: none for full attention; for a
    sliding window, those before the window less the margin blocks the index still has."""
    bs = rows.block_size
    out = []
    for group, allocator in zip(rows.pool.layout.groups, rows.pool.allocators, strict=True):
        first = 0
        if group.sliding_window is not None:
            first = max(0, kept - group.sliding_window) // bs
            margin_start = max(0, kept - group.sliding_window - SLIDING_MARGIN) // bs
            while first > margin_start and allocator.peek(digests[first - 1], tuple(tokens[(first - 1) * bs : first * bs])):
                first -= 1
        out.append(first)
    return out
