"""One request of the engine: its tokens, its cache while it prefills, and its own sampling state.

Each request carries the logits processors and stopping criteria `generate()` would build for its
`GenerationConfig` (`config.py`) and a `torch.Generator` seeded from the request's own seed, so what a
request samples depends on its prompt, config and seed only, never on which other requests share its steps.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..cache.paged_cache import PagedCache
from .outputs import TokenLogprobs, token_logprobs

if TYPE_CHECKING:
    from .media import Media
    from .speculation import NgramIndex, Speculation


class State(enum.Enum):
    WAITING = "waiting"  # not admitted (or preempted: its blocks were freed, it will be recomputed)
    PREFILL = "prefill"  # admitted, feeding its prompt (and, after a preemption, its earlier output) in chunks
    DECODE = "decode"  # one token per step, a row of the engine's decoding cache
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A prompt and what the engine knows about it.

    Attributes:
        index: position in the `generate()` / `stream()` input.
        prompt: prompt token ids.
        config: the prepared generation config (as `generate()` prepares it, `config.py`).
        max_new_tokens: tokens to generate at most (`config.max_length` less the prompt).
        output: generated token ids so far.
        state: where it is in the scheduler.
        cache: its own one-row `PagedCache` while it prefills, None otherwise.
        fed: tokens of `prompt + output` whose K/V are stored (cached prefix included).
        admitted_at: admission counter (the latest admitted is preempted first).
        processors, generator: how its next token is chosen from the logits.
        stopping: `generate()`'s stopping criteria for it (max length, EOS, stop strings, max time).
        first_token_s, finished_s: times (`time.perf_counter()`) of its first and last token, for stats.
        group, sample: the `Engine.submit()` id of the request and which of its samples this is.
        top_logprobs: None (no log-probabilities), else how many top alternatives to record per token.
        logprobs: per output token, its `TokenLogprobs` (when `top_logprobs` is not None).
        followers: the request's other samples while it prefills their shared prompt (see `samples.py`).
        cached_tokens: prompt tokens its first admission took from the prefix index (None before).
        speculation: how it drafts (`speculation.py`), None when it does not speculate.
        draft: while it decodes with speculation, the `k` tokens its row feeds after its next token this step.
        num_drafted: how many of `draft` were drafted (the rest pad it).
        ngrams: its prompt-lookup index (built on its first draft).
        draft_cache, draft_tokens: its rows in the draft model's pool and the tokens they hold (`drafter.py`).
        media: its non-text inputs and their features (`media.py`), None for a text-only request.
        dropped: aborted while its prompt's prefill carries its other samples (`followers`): it keeps prefilling
            for them, yields no token, and finishes when the prefill ends (`Scheduler.abort`).
    """

    index: int
    prompt: list[int]
    config: GenerationConfig
    max_new_tokens: int
    processors: LogitsProcessorList
    generator: torch.Generator | None
    stopping: StoppingCriteriaList
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
    speculation: Speculation | None = None
    draft: list[int] = field(default_factory=list)
    num_drafted: int = 0
    ngrams: NgramIndex | None = None
    draft_cache: PagedCache | None = None
    draft_tokens: list[int] = field(default_factory=list)
    media: Media | None = None
    dropped: bool = False
    #: `prompt + output` as int64 `[1, capacity]`, its first `_ids_filled` entries written (`ids()` keeps it).
    _ids: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _ids_filled: int = field(default=0, init=False, repr=False, compare=False)

    @property
    def width(self) -> int:
        """Tokens its decoding row feeds per step: 1, plus `k` drafts when it speculates."""
        return 1 + (self.speculation.num_tokens if self.speculation is not None else 0)

    @property
    def tokens(self) -> list[int]:
        """Prompt followed by the output so far: what the model must have seen to produce the next token."""
        return self.prompt + self.output

    def token_at(self, position: int) -> int:
        """The token at `position` of `prompt + output` (without building that list)."""
        prompt_len = len(self.prompt)
        return self.prompt[position] if position < prompt_len else self.output[position - prompt_len]

    def ids(self) -> torch.Tensor:
        """`prompt + output` as int64 `[1, n]`: what logits processors and stopping criteria read. A view of a buffer
        the request keeps and extends, so a step copies its new tokens only; read it, do not keep it."""
        n = len(self.prompt) + len(self.output)
        if self._ids is None or self._ids.shape[1] < n:
            self._ids = torch.zeros((1, max(2 * n, 64)), dtype=torch.long, device="cpu")
            self._ids[0, :n] = torch.tensor(self.tokens, dtype=torch.long, device="cpu")
        elif self._ids_filled < n:
            start = self._ids_filled - len(self.prompt)
            self._ids[0, self._ids_filled : n] = torch.tensor(self.output[start:], dtype=torch.long, device="cpu")
        self._ids_filled = n
        return self._ids[:, :n]

    def position(self, index: int) -> int:
        """The position id of its token at `index` (outside images: multimodal rotary positions agree there)."""
        return index if self.media is None else self.media.position(index)

    @property
    def one_position_after_prompt(self) -> bool:
        """Whether each token after its prompt has one position id, the same in every multimodal rotary dimension
        (`Media.rows_agree_after_prompt`), so that `position()` is all a decoding row needs."""
        return self.media is None or self.media.rows_agree_after_prompt

    @property
    def remaining(self) -> int:
        """Tokens still to feed before this request's next token can be produced."""
        return len(self.prompt) + len(self.output) - self.fed

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from this request's logits `[vocab]` (float32), applying its processors to a copy (one may
        edit its scores in place, and the logits are also the raw log-probabilities' and the other samples')."""
        scores = logits[None]
        if len(self.processors):
            scores = self.processors(self.ids(), scores.clone())
        if self.generator is None:
            token = int(scores.argmax(dim=-1))
        else:
            probs = torch.softmax(scores.float(), dim=-1)
            token = int(torch.multinomial(probs[0], 1, generator=self.generator))
        if self.top_logprobs is not None:
            self.logprobs.append(token_logprobs(logits, scores[0], token, self.top_logprobs))
        return token

    def release_draft(self) -> None:
        """Gives its draft cache back to the draft model's pool (nothing when it has none)."""
        if self.draft_cache is not None:
            self.draft_cache.release()
            self.draft_cache = None
        self.draft_tokens = []

    def add_token(self, token: int) -> bool:
        """Appends a generated token; returns whether the request is finished (as `generate()` decides it:
        its stopping criteria on the prompt and the output so far)."""
        self.output.append(token)
        if len(self.output) >= self.max_new_tokens:
            return True
        return bool(self.stopping(self.ids(), None)[0])

    @property
    def finish_reason(self) -> str:
        """`"stop"` when its last token is one of its EOS tokens or its stopping criteria ended it early (a stop
        string), `"length"` when it produced `max_new_tokens`."""
        if self.output and self.output[-1] in eos_ids(self.config):
            return "stop"
        return "length" if len(self.output) >= self.max_new_tokens else "stop"


def eos_ids(config: GenerationConfig) -> frozenset[int]:
    """The EOS token ids of a prepared config (`eos_token_id`: an int, a list, or None)."""
    eos = config.eos_token_id
    if eos is None:
        return frozenset()
    if isinstance(eos, torch.Tensor):
        return frozenset(int(e) for e in eos.view(-1).tolist())
    return frozenset([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
