"""The demo model's optimisation loop: AdamW steps over the seeded windows, timed against a wall-clock budget.

Without ``--plan``/``--steps`` the loop times the warmup steps (whose LR does not depend on the
total) to plan the total number of steps, and every ``--replan-every`` steps revises the plan from
the recent step rate (the CPU is shared), in a way that keeps the LR continuous
(:func:`~hf_paged.demo_model.schedule.decay_progress`). The plan it followed is returned so that the
training report can replay the run exactly.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .evaluation import evaluate
from .schedule import batch_iterator, lr_at, parse_plan


@dataclass(slots=True)
class TrainingRun:
    """What :func:`run_training` did, as the training report records it.

    Attributes:
        steps: optimiser steps taken.
        plan: the schedule plan followed, ``[(from_step, total_steps), ...]``; empty if the run ended
            before a plan was made.
        tokens_seen: training tokens fed to the model (``steps * batch_size * seq_len``).
        stopped_early: the loop stopped because it ran well over its wall-clock budget.
        loss_ema: exponential moving average (0.98) of the training loss; None before the first step.
        quick_evals: the periodic held-out evaluations (``--eval-every``), one dict per evaluation.
        warmup_steps: the warmup length used (``--warmup``, at least 1).
        train_s: wall-clock seconds of the loop.
    """

    steps: int
    plan: list[tuple[int, int]]
    tokens_seen: int
    stopped_early: bool
    loss_ema: float | None
    quick_evals: list[dict]
    warmup_steps: int
    train_s: float


def run_training(
    model: torch.nn.Module,
    train_stream: torch.Tensor,
    val_stream: torch.Tensor,
    args: argparse.Namespace,
    log: Callable[[str], None],
) -> TrainingRun:
    """Train ``model`` in place on ``train_stream`` (1-D token ids) as the parsed command line says.

    Args:
        model: the causal LM to train (left in training mode).
        train_stream: the packed training tokens, ``[num_tokens]`` int64.
        val_stream: the packed held-out tokens, for the quick evaluations.
        args: the options of :func:`hf_paged.demo_model.train.parse_args` (``lr``, ``warmup``,
            ``weight_decay``, ``seq_len``, ``batch_size``, ``seed``, ``minutes``, ``steps``, ``plan``,
            ``replan_every``, ``eval_every``, ``no_progress``).
        log: where progress messages go.
    """
    from tqdm.auto import tqdm

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    batches = batch_iterator(train_stream, args.seq_len, args.batch_size, args.seed)
    budget_s = args.minutes * 60.0
    warmup = max(1, args.warmup)
    # The schedule plan: fixed by --plan/--steps, otherwise timed during warmup (whose LR does not
    # depend on the total) and re-planned every --replan-every steps from the recent step rate, so
    # that the decay ends on the wall-clock budget even when the shared CPU gets busier or quieter.
    plan: list[tuple[int, int]] | None = None
    if args.plan is not None:
        plan = parse_plan(args.plan)
    elif args.steps is not None:
        plan = [(0, args.steps)]
    fixed_plan = plan is not None
    stop_at = args.steps if args.steps is not None else None  # with --plan, --steps cuts the run short
    step_times: list[float] = []  # wall-clock time at the end of each step
    step, tokens_seen, stopped_early = 0, 0, False
    loss_ema: float | None = None
    quick_evals: list[dict] = []
    model.train()
    t_train = time.time()
    bar = tqdm(
        total=plan[-1][1] if plan else None,
        disable=args.no_progress,
        mininterval=5.0,
        desc="train",
        unit="step",
        dynamic_ncols=True,
    )
    while plan is None or step < (stop_at if stop_at is not None else plan[-1][1]):
        lr = lr_at(step, plan or [], warmup, args.lr)
        for group in optim.param_groups:
            group["lr"] = lr
        batch = next(batches)
        loss = model(input_ids=batch, labels=batch).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        step += 1
        tokens_seen += batch.numel()
        loss_val = loss.item()
        loss_ema = loss_val if loss_ema is None else 0.98 * loss_ema + 0.02 * loss_val
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{lr:.2e}", refresh=False)
        now = time.time()
        step_times.append(now)
        elapsed = now - t_train
        if not fixed_plan:
            if plan is None and step >= 3 and (step >= warmup or elapsed >= 0.2 * budget_s):
                per_step = (now - step_times[1]) / (step - 2)
                plan = [(0, max(step, int(budget_s / per_step)))]
                bar.total = plan[-1][1]
                log(f"timing: {per_step:.3f} s/step -> {plan[-1][1]} steps for {args.minutes:g} min")
            elif (
                plan is not None
                and args.replan_every
                and step % args.replan_every == 0
                and plan[-1][1] - step > args.replan_every
            ):
                window = min(len(step_times) - 1, 2 * args.replan_every)
                per_step = (now - step_times[-1 - window]) / window
                total = step + max(1, int((budget_s - elapsed) / per_step))
                if abs(total - plan[-1][1]) > 0.02 * plan[-1][1]:
                    plan.append((step, total))
                    bar.total = total
                    log(f"re-plan at step {step}: {per_step:.3f} s/step recently -> {total} steps in all")
        if args.eval_every and step % args.eval_every == 0 and plan is not None and step < plan[-1][1]:
            vl, _ = evaluate(model, val_stream, args.seq_len, args.batch_size, max_tokens=8 * args.seq_len)
            quick_evals.append({"step": step, "val_loss_quick": round(vl, 4), "train_loss_ema": round(loss_ema, 4)})
            log(f"step {step}/{plan[-1][1]}: train loss (ema) {loss_ema:.3f}, quick held-out loss {vl:.3f}, lr {lr:.2e}")
        if not fixed_plan and elapsed > 1.15 * budget_s + 30.0:
            stopped_early = True
            log(f"over budget at step {step}/{plan[-1][1] if plan else '?'}; stopping")
            break
    bar.close()
    train_s = time.time() - t_train
    return TrainingRun(
        steps=step,
        plan=plan or [],
        tokens_seen=tokens_seen,
        stopped_early=stopped_early,
        loss_ema=loss_ema,
        quick_evals=quick_evals,
        warmup_steps=warmup,
        train_s=train_s,
    )
