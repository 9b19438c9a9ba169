"""OpenAI's sampling fields that transformers has no processor for: `logit_bias` and the additive
`presence_penalty` / `frequency_penalty`. Both run on the raw logits, before the config's own processors
(`Engine.submit(logits_processor=...)`), as OpenAI describes them:

    logits[j] += logit_bias[j]
    logits[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty

where `count[j]` is how often token `j` occurs in the output so far (the prompt does not count).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class LogitBiasProcessor(LogitsProcessor):
    """Adds a fixed bias per token id.

    Args:
        bias: token id -> bias (OpenAI allows -100..100; -100 bans a token, 100 all but forces it).
        vocab_size: the logits width; ids outside it are refused.
    """

    def __init__(self, bias: dict[int, float], vocab_size: int) -> None:
        bad = [i for i in bias if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"logit_bias names token ids {bad[:5]} outside the vocabulary [0, {vocab_size}).")
        self.ids = torch.tensor(list(bias), dtype=torch.long, device="cpu")  # (moved to the scores' device per call)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32, device="cpu")

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """`scores [batch, vocab]` -> the same with the biases added."""
        scores = scores.clone()
        scores[:, self.ids.to(scores.device)] += self.values.to(scores.device, scores.dtype)
        return scores


class AdditivePenaltyProcessor(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the output tokens (after `prompt_len`).

    Args:
        presence_penalty, frequency_penalty: as OpenAI's API (-2..2).
        prompt_len: tokens of the prompt in `input_ids`.
    """

    def __init__(self, presence_penalty: float, frequency_penalty: float, prompt_len: int) -> None:
        self.presence = presence_penalty
        self.frequency = frequency_penalty
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """`input_ids [batch, seq]`, `scores [batch, vocab]` -> penalised scores."""
        output = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, output.to(scores.device), torch.ones_like(output, dtype=scores.dtype, device=scores.device))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence
