"""What the engine hands back: per token through the incremental API (`Engine.submit` / `Engine.step`), and its
counters (`Engine.stats()`).

Log-probabilities come in two kinds, as `generate()` gives them: `raw` from the model's logits
(`generate(output_logits=True)`), and `processed` from the scores after the request's logits processors and
warpers (`generate(output_scores=True)`: temperature, top-k/top-p masking, penalties, extra processors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory.stats import PoolStats


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities of one generated token.

    Attributes:
        token: the chosen token id.
        logprob, raw_logprob: its log-probability under the processed scores / the raw logits.
        top, raw_top: the `k` most likely `(token_id, logprob)` pairs, most likely first (empty for `k=0`).
            Processed values may be `-inf` (a token the processors masked out).
    """

    token: int
    logprob: float
    raw_logprob: float
    top: list[tuple[int, float]]
    raw_top: list[tuple[int, float]]


@dataclass(slots=True)
class Generated:
    """One output of `Engine.generate(..., top_logprobs=k)`.

    Attributes:
        token_ids: the generated token ids.
        logprobs: per generated token, its `TokenLogprobs` (`len(logprobs) == len(token_ids)`).
        text: the generated text for text prompts (decoded as `generate()` decodes them), else None.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    text: str | None = None


@dataclass(slots=True)
class TokenEvent:
    """One token of one request, as `Engine.step()` returns it.

    Attributes:
        request_id: what `Engine.submit()` returned.
        sample: which of the request's `num_return_sequences` samples (0-based).
        token: the token id.
        finished: the sample ended with this token.
        finish_reason: `"stop"` (EOS or a stop string), `"length"` (max_new_tokens) when finished, else None.
        logprobs: the token's log-probabilities when the request asked for them, else None.
        cached_tokens: prompt tokens the request took from the prefix index when it was first admitted.
    """

    request_id: int
    sample: int
    token: int
    finished: bool
    finish_reason: str | None
    logprobs: TokenLogprobs | None
    cached_tokens: int = 0


def check_top_logprobs(top_logprobs: int | None) -> None:
    """Raises `ValueError` unless `top_logprobs` is None or an int >= 0 (how many alternatives to record)."""
    if top_logprobs is not None and (
        isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0
    ):
        raise ValueError(f"top_logprobs must be None or an int >= 0, got {top_logprobs!r}.")


def token_logprobs(raw: torch.Tensor, scores: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """Log-probabilities of `token` and the top `k` under `raw` logits and processed `scores`, both `[vocab]`."""
    raw_lp = torch.log_softmax(raw.float(), dim=-1)
    lp = torch.log_softmax(scores.float(), dim=-1)

    def top(values: torch.Tensor) -> list[tuple[int, float]]:
        if k <= 0:
            return []
        best = torch.topk(values, min(k, values.numel()))
        return [(int(i), float(v)) for v, i in zip(best.values, best.indices, strict=True)]

    return TokenLogprobs(token, float(lp[token]), float(raw_lp[token]), top(lp), top(raw_lp))


@dataclass(slots=True)
class EngineStats:
    """What `Engine.stats()` reports (counts since the engine was created, queues of the runs in progress).

    Attributes:
        waiting, running, finished: requests in each state, summed over the runs in progress (or of the last
            run when none is).
        steps: forwards run.
        generated_tokens: output tokens produced.
        prompt_tokens_computed: prompt (and recomputed) tokens fed to the model, prefix hits excluded.
        busy_s: seconds spent in steps.
        tokens_per_s: `generated_tokens / busy_s`.
        preemptions: requests preempted for memory (each recomputed later).
        runs: `generate()` / `stream()` calls in progress (the queues above are summed over them).
        prefix_hit_tokens, prefix_query_tokens: prompt tokens served from / looked up in the prefix index.
        pool: the pool's `PoolStats`.
        drafted_tokens, accepted_tokens: speculative decoding's drafted tokens (pads excluded) and those the
            model confirmed.
        acceptance_rate: `accepted_tokens / drafted_tokens` (0.0 before any draft).
    """

    waiting: int
    running: int
    finished: int
    steps: int
    generated_tokens: int
    prompt_tokens_computed: int
    busy_s: float
    tokens_per_s: float
    preemptions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    pool: PoolStats
    runs: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
