"""What the training loop visits and when: the seeded order of token windows and the (re)planned LR schedule.

The data order depends only on the seed; the learning rate only on the schedule plan, a list of
``(from_step, total_steps)`` pairs that the training report records (``--plan``) so that a run can be
replayed without timing.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch


def batch_iterator(stream: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Yield ``(batch_size, seq_len)`` windows of the packed stream in a seeded order, forever.

    Each epoch draws a random start offset in ``[0, seq_len)`` (so window boundaries move between
    epochs) and a random permutation of the windows, both from a generator seeded with ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    n = stream.numel()
    if n < seq_len * batch_size + seq_len:
        raise ValueError(f"token stream ({n} tokens) too short for batch {batch_size} x {seq_len}")
    while True:
        offset = int(torch.randint(0, seq_len, (1,), generator=gen, device="cpu"))
        n_windows = (n - offset) // seq_len
        windows = stream[offset : offset + n_windows * seq_len].view(n_windows, seq_len)
        order = torch.randperm(n_windows, generator=gen, device="cpu")
        for i in range(0, n_windows - batch_size + 1, batch_size):
            yield windows[order[i : i + batch_size]]


def parse_plan(text: str) -> list[tuple[int, int]]:
    """Parse a schedule plan ``"S0:T0,S1:T1,..."`` (or a bare total ``"T"``) into ``[(S, T), ...]``."""
    plan: list[tuple[int, int]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        start, _, total = part.rpartition(":")
        plan.append((int(start) if start else 0, int(total)))
    if not plan or any(b[0] < a[0] for a, b in zip(plan, plan[1:])):
        raise ValueError(f"bad plan {text!r}: want increasing 'step:total' pairs")
    return plan


def format_plan(plan: Sequence[tuple[int, int]]) -> str:
    """Inverse of :func:`parse_plan`."""
    return ",".join(f"{s}:{t}" for s, t in plan)


def decay_progress(step: int, warmup_steps: int, plan: Sequence[tuple[int, int]]) -> float:
    """Fraction in ``[0, 1]`` of the cosine decay done at ``step`` under a (re)planned schedule.

    ``plan`` is a list of ``(from_step, total_steps)`` entries: from ``from_step`` on, the remaining
    decay is spread linearly over the steps left until ``total_steps``. Re-planning therefore keeps
    the learning rate continuous, and the schedule is a pure function of the plan, which the
    training report records so that a run can be replayed exactly with ``--plan``.
    """
    if step < warmup_steps or not plan:
        return 0.0
    anchor, done = warmup_steps, 0.0
    total = plan[0][1]
    for start, new_total in plan:
        if start > step:
            break
        if start > anchor:
            done += (1.0 - done) * min(1.0, (start - anchor) / max(1, total - anchor))
            anchor = start
        total = new_total
    return min(1.0, done + (1.0 - done) * (step - anchor) / max(1, total - anchor))


def lr_at(step: int, plan: Sequence[tuple[int, int]], warmup_steps: int, peak_lr: float, min_ratio: float = 0.1) -> float:
    """Linear warmup over ``warmup_steps`` then cosine decay to ``min_ratio * peak_lr`` at the planned end."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = decay_progress(step, warmup_steps, plan)
    return peak_lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
