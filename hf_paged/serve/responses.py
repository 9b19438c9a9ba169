"""OpenAI response objects: a choice's state while it is generated, and the JSON shapes of full responses
and of streamed chunks (`text_completion`, `chat.completion`, `chat.completion.chunk`).

Log-probabilities are the model's raw ones (`TokenLogprobs.raw_logprob` / `raw_top`: log-softmax of the
logits, before temperature, top-p and penalties), as vLLM reports them by default; they are never `-inf`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..engine import TokenEvent
from .text import TextStream, TokenPieces

if TYPE_CHECKING:
    from .handling import Generation


@dataclass
class ChoiceState:
    """One choice (one sample of one prompt) while it is generated.

    Attributes:
        index: its `choices[].index` (prompt `i`, sample `k` -> `i * n + k`).
        text: its detokenizer (stop strings are matched there, on the generated text only, and cut it).
        offset_base: characters before the generated text in `text_offset` (the prompt's text with `echo`).
        tokens: its token ids (up to the one that completed a stop string: later ones are not taken).
        chat_logprobs: per token, a chat `logprobs.content` entry.
        completion_logprobs: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset` lists.
        finish_reason: `"stop"` / `"length"` once finished (`"stop"` as soon as its text reached a stop string,
            even while the engine still runs its request).
        cached_tokens: prompt tokens its request took from the prefix cache.
    """

    index: int
    text: TextStream
    offset_base: int = 0
    tokens: list[int] = field(default_factory=list)
    chat_logprobs: list[dict[str, object]] = field(default_factory=list)
    completion_logprobs: dict[str, list] = field(
        default_factory=lambda: {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    )
    finish_reason: str | None = None
    cached_tokens: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: TokenEvent, pieces: TokenPieces) -> tuple[str, dict[str, object] | None]:
        """Takes one token (not after the choice is done); returns `(new text, this token's logprobs in the
        endpoint's two shapes)` — the second is `{"chat": entry, "completion": lists}` or None when no logprobs
        were asked."""
        offset = self.offset_base + self.text.decoded_len  # where this token's text starts in the full text
        delta = self.text.add(event.token)
        self.tokens.append(event.token)
        self.cached_tokens = event.cached_tokens
        if self.text.stopped:
            self.finish_reason = "stop"
        elif event.finished:
            self.finish_reason = event.finish_reason
        if event.logprobs is None:
            return delta, None
        lp = event.logprobs
        text = pieces.text(event.token)
        chat = {
            "token": text, "logprob": lp.raw_logprob, "bytes": list(pieces.bytes(event.token)),
            "top_logprobs": [{"token": pieces.text(t), "logprob": v, "bytes": list(pieces.bytes(t))} for t, v in lp.raw_top],
        }
        completion = {"tokens": [text], "token_logprobs": [lp.raw_logprob],
                      "top_logprobs": [completion_top(pieces, event.token, lp.raw_top)], "text_offset": [offset]}
        self.chat_logprobs.append(chat)
        for key, values in completion.items():
            self.completion_logprobs[key].extend(values)
        return delta, {"chat": chat, "completion": completion}

    def finish(self) -> str:
        """The text held back until the end (see `TextStream.finish`)."""
        return self.text.finish()


def completion_top(pieces: TokenPieces, chosen: int, top: list[tuple[int, float]]) -> dict[str, float]:
    """A completions `top_logprobs` entry: token text -> log-probability, for each of the `k` alternatives.

    OpenAI's shape is a dict, so alternatives whose texts are equal (e.g. tokens holding parts of a UTF-8 character
    all decode to U+FFFD) would merge: the chosen token always keeps its own text as its key (the one in `tokens`),
    another token with a text already taken (or the chosen token's) is written as OpenAI writes byte tokens,
    `bytes:\\xNN...` (with `#id` appended should even that repeat), so that all `k` entries stay.
    """
    chosen_text = pieces.text(chosen)
    keys: dict[int, str] = {}
    for token, _ in sorted(top, key=lambda item: item[0] != chosen):  # the chosen token (if among them) first
        key = pieces.text(token)
        if key in keys.values() or (key == chosen_text and token != chosen):
            key = pieces.key(token)
            if key in keys.values():
                key = f"{key}#{token}"
        keys[token] = key
    return {keys[token]: value for token, value in top}  # most likely first, as the engine ranked them


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, object]:
    """OpenAI's `usage`, with `prompt_tokens_details.cached_tokens` from prefix-cache hits."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_response(gen: Generation, usage_: dict[str, object], prompt_texts: list[str] | None) -> dict[str, object]:
    """A `text_completion` object; `prompt_texts` (echo) prefix each choice's text."""
    n = gen.body.n
    choices = []
    for c in gen.choices:
        prefix = prompt_texts[c.index // n] if prompt_texts is not None else ""
        logprobs = c.completion_logprobs if gen.top_logprobs is not None else None
        choices.append({"index": c.index, "text": prefix + c.text.text, "logprobs": logprobs, "finish_reason": c.finish_reason})
    return {"id": gen.id, "object": "text_completion", "created": gen.created, "model": gen.state.model_name,
            "choices": choices, "usage": usage_}


def chat_response(gen: Generation, usage_: dict[str, object]) -> dict[str, object]:
    """A `chat.completion` object."""
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text.text},
            "logprobs": {"content": c.chat_logprobs} if gen.top_logprobs is not None else None,
            "finish_reason": c.finish_reason,
        }
        for c in gen.choices
    ]
    return {"id": gen.id, "object": "chat.completion", "created": gen.created, "model": gen.state.model_name,
            "choices": choices, "usage": usage_}


def completion_chunk(gen: Generation, index: int, text: str, logprobs: dict | None, reason: str | None,
                     with_usage: bool) -> dict[str, object]:
    """One streamed `text_completion` chunk."""
    chunk = {"id": gen.id, "object": "text_completion", "created": gen.created, "model": gen.state.model_name,
             "choices": [{"index": index, "text": text, "logprobs": logprobs["completion"] if logprobs else None,
                          "finish_reason": reason}]}
    return {**chunk, "usage": None} if with_usage else chunk


def chat_chunk(gen: Generation, index: int, delta: dict[str, object], logprobs: dict | None, reason: str | None,
               with_usage: bool) -> dict[str, object]:
    """One streamed `chat.completion.chunk`."""
    chunk = {"id": gen.id, "object": "chat.completion.chunk", "created": gen.created, "model": gen.state.model_name,
             "choices": [{"index": index, "delta": delta,
                          "logprobs": {"content": [logprobs["chat"]]} if logprobs else None, "finish_reason": reason}]}
    return {**chunk, "usage": None} if with_usage else chunk
