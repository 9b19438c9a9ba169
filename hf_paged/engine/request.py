"""One request of the engine: its tokens, its cache while it prefills, and its own sampling state.

Each request carries the logits processors transformers would build for its `GenerationConfig`
(repetition penalty, `min_new_tokens`, temperature / top-k / top-p, ...) and a `torch.Generator` seeded
from the request's own seed, so what a request samples depends on its prompt, config and seed only,
never on which other requests share its steps.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessorList, StopStringCriteria

from ..cache import PagedCache
from .outputs import TokenLogprobs, token_logprobs

#: Generation options the engine serves one request at a time; any other non-default value is refused.
_REFUSED = {
    "num_beams": (1, "beam search keeps several rows per request: use model.generate(num_beams=...) with a PagedCache"),
    "assistant_model": (None, "speculative decoding is not served by the engine: use model.generate()"),
    "prompt_lookup_num_tokens": (None, "speculative decoding is not served by the engine: use model.generate()"),
}


class State(enum.Enum):
    WAITING = "waiting"  # not admitted (or preempted: its blocks were freed, it will be recomputed)
    PREFILL = "prefill"  # admitted, feeding its prompt (and, after a preemption, its earlier output) in chunks
    DECODE = "decode"  # one token per step, a row of the engine's decoding cache
    FINISHED = "finished"


def resolve_config(
    base: GenerationConfig, config: GenerationConfig | None, kwargs: dict[str, object]
) -> GenerationConfig:
    """`config` (or the model's `base`) updated with `kwargs`; unknown fields and options the engine does not
    serve raise ValueError saying what to use instead."""
    resolved = copy.deepcopy(config if config is not None else base)
    unused = resolved.update(**kwargs)
    if unused:
        raise ValueError(
            f"Unknown generation options {sorted(unused)}: the engine takes GenerationConfig fields "
            "(max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty, min_new_tokens, "
            "eos_token_id, stop_strings, ...) and seed=."
        )
    for name, (default, instead) in _REFUSED.items():
        value = getattr(resolved, name, default)
        if value is not None and value != default:
            raise ValueError(f"Engine: {name}={value!r} is not supported; {instead}.")
    resolved.validate()
    return resolved


@dataclass(eq=False)
class Request:
    """A prompt and what the engine knows about it.

    Attributes:
        index: position in the `generate()` / `stream()` input.
        prompt: prompt token ids.
        config: the resolved generation config.
        max_new_tokens: tokens to generate at most.
        output: generated token ids so far.
        state: where it is in the scheduler.
        cache: its own one-row `PagedCache` while it prefills, None otherwise.
        fed: tokens of `prompt + output` whose K/V are stored (cached prefix included).
        admitted_at: admission counter (the latest admitted is preempted first).
        processors, generator, stop: its sampling state (see `Sampler`).
        first_token_s, finished_s: times (`time.perf_counter()`) of its first and last token, for stats.
        group, sample: the `Engine.submit()` id of the request and which of its samples this is.
        top_logprobs: None (no log-probabilities), else how many top alternatives to record per token.
        logprobs: per output token, its `TokenLogprobs` (when `top_logprobs` is not None).
        followers: the request's other samples while it prefills their shared prompt (see `samples.py`).
        cached_tokens: prompt tokens its first admission took from the prefix index (None before).
    """

    index: int
    prompt: list[int]
    config: GenerationConfig
    max_new_tokens: int
    processors: LogitsProcessorList
    generator: torch.Generator | None
    eos: frozenset[int]
    stop: StopStringCriteria | None = None
    output: list[int] = field(default_factory=list)
    state: State = State.WAITING
    cache: PagedCache | None = None
    fed: int = 0
    admitted_at: int = -1
    arrival_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None
    group: int = -1
    sample: int = 0
    top_logprobs: int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    followers: list[Request] = field(default_factory=list)
    cached_tokens: int | None = None

    @property
    def tokens(self) -> list[int]:
        """Prompt followed by the output so far: what the model must have seen to produce the next token."""
        return self.prompt + self.output

    @property
    def remaining(self) -> int:
        """Tokens still to feed before this request's next token can be produced."""
        return len(self.prompt) + len(self.output) - self.fed

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from this request's logits `[vocab]` (float32), applying its processors."""
        scores = logits[None]
        if len(self.processors):
            ids = torch.tensor([self.tokens], dtype=torch.long)
            scores = self.processors(ids, scores)
        if self.generator is None:
            token = int(scores.argmax(dim=-1))
        else:
            probs = torch.softmax(scores.float(), dim=-1)
            token = int(torch.multinomial(probs[0], 1, generator=self.generator))
        if self.top_logprobs is not None:
            self.logprobs.append(token_logprobs(logits, scores[0], token, self.top_logprobs))
        return token

    def add_token(self, token: int) -> bool:
        """Appends a generated token; returns whether the request is finished."""
        self.output.append(token)
        if len(self.output) >= self.max_new_tokens or token in self.eos:
            return True
        if self.stop is not None:
            return bool(self.stop(torch.tensor([self.tokens], dtype=torch.long), None)[0])
        return False

    @property
    def finish_reason(self) -> str:
        """`"length"` when it produced `max_new_tokens`, else `"stop"` (EOS or a stop string)."""
        if self.output and self.output[-1] in self.eos:
            return "stop"
        return "length" if len(self.output) >= self.max_new_tokens else "stop"


def eos_ids(config: GenerationConfig) -> frozenset[int]:
    eos = config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else [int(e) for e in eos])
