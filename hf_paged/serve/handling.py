"""One HTTP request through the engine: its prompts become tickets, the engine's tokens become choices.

`Generation` checks what only the server can check (model name, lengths, field combinations), turns the
OpenAI fields into `GenerationConfig` fields and extra logits processors, submits one ticket per prompt to
the `EngineWorker`, and then either collects every choice or yields SSE chunks as tokens come.
A client that goes away aborts every ticket of its request at once (their blocks go back to the pool).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..engine import TokenEvent
from .json_mode import JsonObjectProcessor, JsonVocabulary
from .protocol import ChatRequest, CompletionRequest, OpenAIError
from .responses import ChoiceState, chat_chunk, chat_response, completion_chunk, completion_response, usage
from .sampling import AdditivePenaltyProcessor, LogitBiasProcessor
from .text import TextStream
from .worker import EngineWorker, QueueFull, ShuttingDown, Ticket

DISCONNECT_POLL_S = 0.25


@dataclass
class ServerState:
    """What every request handler reads (set once when the server starts).

    Attributes:
        worker: the engine thread.
        tokenizer: the model's tokenizer.
        model_name: the one name `model` may take (`--served-model-name`).
        max_positions: the model's context length (prompt + output).
        vocab_size: the logits width.
        eos_ids: the ids that end generation.
        api_key: required `Authorization: Bearer` key, or None.
        chat_template: `--chat-template` text, or None (the tokenizer's, else the default).
    """

    worker: EngineWorker
    tokenizer: object
    model_name: str
    max_positions: int
    vocab_size: int
    eos_ids: frozenset[int]
    api_key: str | None = None
    chat_template: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _json_vocab: JsonVocabulary | None = None

    def json_vocab(self) -> JsonVocabulary:
        """The token texts for `response_format=json_object`, built on first use."""
        if self._json_vocab is None:
            self._json_vocab = JsonVocabulary(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._json_vocab


class Generation:
    """One `/v1/completions` or `/v1/chat/completions` request.

    Args:
        state: the server's state.
        body: the parsed request.
        prompts: token ids per prompt (chat: one).
        max_new_tokens: tokens to generate at most per choice.
        top_logprobs: None, or alternatives per token (`k >= 0`).
        echo: completion texts start with their prompt's text.
    """

    def __init__(self, state: ServerState, body: CompletionRequest | ChatRequest, prompts: list[list[int]],
                 max_new_tokens: int, top_logprobs: int | None, echo: bool = False) -> None:
        if body.model != state.model_name:
            raise OpenAIError(400, f"The model {body.model!r} does not exist; this server serves {state.model_name!r}.",
                              param="model", code="model_not_found")
        if max_new_tokens < 1:
            raise OpenAIError(400, f"max_tokens must be at least 1, got {max_new_tokens}.", param="max_tokens")
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise OpenAIError(400, f"Prompt {i} is empty; send at least one token.", param="prompt")
            if len(prompt) + max_new_tokens > state.max_positions:
                raise OpenAIError(
                    400, f"Prompt {i} has {len(prompt)} tokens; with max_tokens={max_new_tokens} it exceeds the model's "
                    f"context of {state.max_positions} tokens. Shorten the prompt or lower max_tokens.",
                    param="max_tokens", code="context_length_exceeded")
            if any(not 0 <= t < state.vocab_size for t in prompt):
                raise OpenAIError(400, f"Prompt {i} has token ids outside [0, {state.vocab_size}).", param="prompt")
        self.state, self.body, self.prompts, self.echo = state, body, prompts, echo
        self.top_logprobs = top_logprobs
        self.max_new_tokens = max_new_tokens
        self.id = f"{'chatcmpl' if isinstance(body, ChatRequest) else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.events: asyncio.Queue = asyncio.Queue()
        self.tickets: list[Ticket] = []
        self.choices: list[ChoiceState] = []

    # ------------------------------------------------------------------ building the tickets
    def _generation_fields(self) -> dict[str, object]:
        body = self.body
        fields: dict[str, object] = {"max_new_tokens": self.max_new_tokens, "num_return_sequences": body.n}
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature == 0.0:
            # greedy; n > 1 greedy samples are drawn from the top token alone (generate() refuses greedy n > 1)
            fields.update(do_sample=body.n > 1, **({"top_k": 1} if body.n > 1 else {}))
        else:
            fields.update(do_sample=True, temperature=temperature)
            if body.top_p is not None and body.top_p < 1.0:
                fields["top_p"] = body.top_p
            if body.top_k:
                fields["top_k"] = body.top_k
            if body.min_p:
                fields["min_p"] = body.min_p
        if body.repetition_penalty is not None and body.repetition_penalty != 1.0:
            fields["repetition_penalty"] = body.repetition_penalty
        if body.stops():
            fields["stop_strings"] = body.stops()
        return fields

    def _processors(self, prompt_len: int) -> list:
        body, processors = self.body, []
        if body.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in body.logit_bias.items()}
            except ValueError:
                raise OpenAIError(400, "logit_bias keys must be token ids (integers as strings).", param="logit_bias") from None
            if any(not -100.0 <= v <= 100.0 for v in bias.values()):
                raise OpenAIError(400, "logit_bias values must lie in [-100, 100].", param="logit_bias")
            try:
                processors.append(LogitBiasProcessor(bias, self.state.vocab_size))
            except ValueError as error:
                raise OpenAIError(400, str(error), param="logit_bias") from None
        if body.presence_penalty or body.frequency_penalty:
            processors.append(AdditivePenaltyProcessor(body.presence_penalty, body.frequency_penalty, prompt_len))
        if body.response_format is not None and body.response_format.type == "json_object":
            processors.append(JsonObjectProcessor(self.state.json_vocab(), prompt_len))
        return processors

    async def submit(self) -> None:
        """Submits every prompt; raises `OpenAIError` (400 for a request the engine refuses, 429 when the
        queue is full, 503 when shutting down) after aborting whatever it already submitted."""
        loop = asyncio.get_running_loop()
        seed = self.body.seed % 2**32 if self.body.seed is not None else secrets.randbits(31)
        fields = self._generation_fields()
        processors = [self._processors(len(prompt)) for prompt in self.prompts]  # may refuse: before any submit
        for i, prompt in enumerate(self.prompts):
            ticket = Ticket(prompt, fields, seed + i, self.top_logprobs, processors[i], loop, self.events)
            try:
                self.state.worker.submit(ticket)
            except (QueueFull, ShuttingDown) as error:
                self.abort()
                full = isinstance(error, QueueFull)
                self.state.worker.metrics.rejected.labels("queue_full" if full else "shutting_down").inc()
                raise OpenAIError(429 if full else 503, f"{error}; retry later.", code="queue_full" if full else None) from None
            self.tickets.append(ticket)
            self.state.worker.metrics.prompt_tokens.inc(len(prompt))
            for k in range(self.body.n):
                self.choices.append(ChoiceState(i * self.body.n + k, TextStream(self.state.tokenizer, self.body.stops())))
        answered = 0
        while answered < len(self.tickets):
            kind, ticket, payload = await self.events.get()
            if kind == "error":
                self.abort()
                raise OpenAIError(400, str(payload))
            answered += kind == "accepted"

    def abort(self) -> None:
        """Cancels every ticket of this request that may still run."""
        for ticket in self.tickets:
            self.state.worker.abort(ticket)

    # ------------------------------------------------------------------ results
    async def _events(self, is_disconnected) -> AsyncIterator[tuple[ChoiceState, TokenEvent]]:
        """`(choice, event)` per token until every choice finished; aborts if the client goes away."""
        left = len(self.choices)
        index_of = {id(t): i for i, t in enumerate(self.tickets)}
        while left:
            try:
                kind, ticket, payload = await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await is_disconnected():
                    self.abort()
                    return
                continue
            if kind == "error":
                self.abort()
                code = 503 if isinstance(payload, ShuttingDown) else 500
                raise OpenAIError(code, f"generation failed: {payload}")
            if kind != "token":
                continue
            choice = self.choices[index_of[id(ticket)] * self.body.n + payload.sample]
            left -= payload.finished
            yield choice, payload

    def _usage(self) -> dict[str, object]:
        return usage(sum(map(len, self.prompts)), sum(len(c.tokens) for c in self.choices),
                     sum(c.cached_tokens for c in self.choices[:: self.body.n]))

    async def collect(self, is_disconnected) -> dict[str, object]:
        """The whole response object (non-streaming)."""
        try:
            async for choice, event in self._events(is_disconnected):
                choice.add(event, self.state.tokenizer)
        except asyncio.CancelledError:
            self.abort()
            raise
        for choice in self.choices:
            choice.finish()
        if isinstance(self.body, ChatRequest):
            return chat_response(self, self._usage())
        prompt_texts = [self.state.tokenizer.decode(p) for p in self.prompts] if self.echo else None
        return completion_response(self, self._usage(), prompt_texts)

    async def stream(self, is_disconnected) -> AsyncIterator[str]:
        """SSE lines: `data: {chunk}` per delta, then the usage chunk if asked, then `data: [DONE]`."""
        chat = isinstance(self.body, ChatRequest)
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        finished = False
        try:
            if chat:
                for choice in self.choices:  # the first chunk of each choice carries the role
                    yield _sse(chat_chunk(self, choice.index, {"role": "assistant", "content": ""}, None, None, include_usage))
            elif self.echo:
                for choice in self.choices:
                    text = self.state.tokenizer.decode(self.prompts[choice.index // self.body.n])
                    yield _sse(completion_chunk(self, choice.index, text, None, None, include_usage))
            async for choice, event in self._events(is_disconnected):
                delta, logprobs = choice.add(event, self.state.tokenizer)
                if event.finished:
                    delta += choice.finish()
                reason = choice.finish_reason if event.finished else None
                if chat:
                    if delta or logprobs:
                        yield _sse(chat_chunk(self, choice.index, {"content": delta}, logprobs, None, include_usage))
                    if event.finished:
                        yield _sse(chat_chunk(self, choice.index, {}, None, reason, include_usage))
                elif delta or logprobs or event.finished:
                    yield _sse(completion_chunk(self, choice.index, delta, logprobs, reason, include_usage))
            finished = all(c.finish_reason is not None for c in self.choices)
            if finished and include_usage:
                chunk = chat_chunk if chat else completion_chunk
                yield _sse({**chunk(self, 0, {} if chat else "", None, None, True), "choices": [], "usage": self._usage()})
            if finished:
                yield "data: [DONE]\n\n"
        except OpenAIError as error:
            yield _sse(error.body)
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the stream failed): free the blocks now
                self.abort()


def _sse(obj: dict[str, object]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
