"""Speculative decoding in the Engine: what a request drafts before a step, and what it keeps after.

A speculating request asks for `k` drafted tokens per step (`prompt_lookup_num_tokens=k` in its config, or the
engine's draft model, `drafter.py`). Its decoding row feeds `1 + k` tokens into the packed step: its next token
and `k` drafts (padded with the last one when fewer were found), at consecutive positions::

    row of a request at length L (tokens 0 .. L-1 known, L-1 not yet fed):
        fed:     t[L-1]  d1   d2   d3        (k = 3)
        logits:  -> c1   -> c2 -> c3 -> c4   the target's choices, one per fed position

`accept()` takes `c1`, then `c2` only if `d1 == c1`, and so on, applying the request's logits processors and
stopping criteria token by token exactly as a step without speculation would: each processor call has the
history of the token it yields (no call for a position that is then discarded), and a stop (EOS, stop string,
`max_new_tokens`) inside the run ends it there. Greedy output is therefore the output without speculation. The
K/V of the rejected drafts are rolled back afterwards (`Scheduler.after_step` -> `PagedCache.crop_rows`).

Prompt lookup follows `generate()`'s `PromptLookupCandidateGenerator`: the last `n` tokens (`n` from
`max_matching_ngram_size` down to 1) are looked up in the request's prompt and output, the earliest earlier
occurrence gives up to `k` following tokens, cut before the first EOS. (`generate()` also skips candidates its
processors forbid; here they are drafted and rejected, which changes no output.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request, eos_ids


@dataclass(slots=True)
class Speculation:
    """How a request drafts.

    Attributes:
        num_tokens: tokens drafted per step (`k`); the request's row feeds `1 + k` tokens.
        max_ngram: prompt lookup's longest n-gram; None when the engine's draft model drafts.
    """

    num_tokens: int
    max_ngram: int | None


class NgramIndex:
    """The first occurrence of every n-gram (`n = 1 .. max_ngram`) of a request's tokens, extended as they grow.

    Args:
        max_ngram: the longest n-gram indexed.
    """

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.first: dict[tuple[int, ...], int] = {}  # n-gram -> start of its first occurrence
        self.indexed = 0  # tokens whose n-grams ending there are indexed

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens following the earliest earlier occurrence of the longest matching tail n-gram of
        `tokens` (a prefix of the tokens this index saw before, extended)."""
        for end in range(self.indexed, len(tokens)):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.first.setdefault(tuple(tokens[end - n + 1 : end + 1]), end - n + 1)
        self.indexed = len(tokens)
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            start = self.first.get(tuple(tokens[length - n :]))
            if start is not None and start + n < length:  # (not the tail itself)
                return tokens[start + n : min(start + n + k, length)]
        return []


def prompt_lookup_draft(req: Request) -> list[int]:
    """The request's prompt-lookup draft for its next step (possibly empty), cut before its first EOS token."""
    spec = req.speculation
    if req.ngrams is None:
        req.ngrams = NgramIndex(spec.max_ngram)
    draft = req.ngrams.lookup(req.tokens, spec.num_tokens)
    eos = eos_ids(req.config)
    for i, token in enumerate(draft):
        if token in eos:
            return draft[:i]
    return draft


def set_draft(req: Request, draft: list[int]) -> None:
    """Makes `draft` the tokens the request's row feeds after its next token this step: at most what could still
    be kept (`max_new_tokens - 1` beyond the output so far), padded to the row's `k` with the last token."""
    k = req.speculation.num_tokens
    draft = draft[: max(0, req.max_new_tokens - len(req.output) - 1)][:k]
    req.num_drafted = len(draft)
    pad = draft[-1] if draft else req.tokens[-1]
    req.draft = draft + [pad] * (k - len(draft))


def accept(req: Request, logits: torch.Tensor) -> list[tuple[int, bool]]:
    """The tokens a speculating request keeps from its row's logits, as `(token, finished)`, appended to it.

    Args:
        logits: `[1 + k, vocab]` float32, the target's logits at the row's fed positions.

    Returns:
        1 to `1 + k` tokens: every accepted draft and the target's own next token after them; the last one says
        whether the request finished.
    """
    kept: list[tuple[int, bool]] = []
    for i in range(logits.shape[0]):
        token = req.choose(logits[i])
        done = req.add_token(token)
        kept.append((token, done))
        if done or i == len(req.draft) or token != req.draft[i]:
            break
    return kept
