"""Measuring the demo model: held-out loss, and the greedy samples written into the training report."""

from __future__ import annotations

import statistics
from typing import Sequence

import torch

#: Prompts of the greedy samples written into the training report.
SAMPLE_PROMPTS: tuple[str, ...] = ("def ", "import os\n", "class ")


@torch.no_grad()
def evaluate(
    model, stream: torch.Tensor, seq_len: int, batch_size: int, max_tokens: int | None = None
) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) over non-overlapping windows of ``stream``.

    Returns ``(mean_loss, n_predicted_tokens)``; the tail shorter than 2 tokens is dropped.
    """
    was_training = model.training
    model.eval()
    data = stream if max_tokens is None else stream[:max_tokens]
    total, count = 0.0, 0
    chunks = [data[i : i + seq_len] for i in range(0, data.numel(), seq_len)]
    chunks = [c for c in chunks if c.numel() >= 2]
    for i in range(0, len(chunks), batch_size):
        group = chunks[i : i + batch_size]
        same = [c for c in group if c.numel() == seq_len]
        rest = [c for c in group if c.numel() != seq_len]
        for batch in ([torch.stack(same)] if same else []) + [c[None] for c in rest]:
            logits = model(input_ids=batch).logits[:, :-1].float()
            targets = batch[:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum"
            )
            total += float(loss)
            count += targets.numel()
    model.train(was_training)
    return total / max(1, count), count


@torch.no_grad()
def greedy_samples(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 64) -> list[dict]:
    """Greedy continuations of ``prompts`` with statistics of the top-1 vs top-2 logit margin."""
    model.eval()
    out = []
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt")
        res = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id,
        )
        new = res.sequences[0, enc["input_ids"].shape[1] :]
        margins = []
        for logits in res.logits:
            top2 = torch.topk(logits[0].float(), 2).values
            margins.append(float(top2[0] - top2[1]))
        out.append(
            {
                "prompt": prompt,
                "completion": tokenizer.decode(new, skip_special_tokens=False),
                "new_tokens": int(new.numel()),
                "min_top1_margin": min(margins) if margins else None,
                "median_top1_margin": statistics.median(margins) if margins else None,
            }
        )
    return out
