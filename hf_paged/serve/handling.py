"""One HTTP request through the engine: its prompts become tickets, the engine's tokens become choices.

`Generation` checks what only the server can check (model name, lengths, field combinations), turns the
OpenAI fields into `GenerationConfig` fields and extra logits processors, submits one ticket per prompt to
the `EngineWorker`, and then either collects every choice or yields SSE chunks as tokens come.
A client that goes away aborts every ticket of its request at once (their blocks go back to the pool): whether
it is still there is checked every `DISCONNECT_POLL_S` seconds, whether tokens flow or not.

Stop strings are matched here, on each choice's generated text only (as OpenAI and vLLM match them), not by
the engine (whose `stop_strings` look at the prompt and the output, as `generate()` does): a choice ends once
its text holds one, and the engine drops that choice's sample at once (`Engine.abort(request_id, sample=k)`): with
`n > 1` the other choices go on.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..errors import OutOfBlocksError
from .json_mode import JsonObjectProcessor, JsonVocabulary
from .protocol import ChatRequest, CompletionRequest, OpenAIError
from .responses import ChoiceState, chat_chunk, chat_response, completion_chunk, completion_response, usage
from .sampling import AdditivePenaltyProcessor, LogitBiasProcessor
from .text import TextStream, TokenPieces
from .worker import EngineCrashed, EngineDead, EngineWorker, QueueFull, ShuttingDown, Ticket

#: Seconds between checks whether the client is still connected (and the engine thread alive).
DISCONNECT_POLL_S = 0.25

#: A temperature below this is greedy (vLLM's `_SAMPLING_EPS`): dividing logits by a tinier one overflows them to
#: inf, and the sampling distribution is the argmax's anyway.
SAMPLING_EPS = 1e-5

#: OpenAI's bounds on `stop`: at most this many strings, each at most `MAX_STOP_CHARS` characters.
MAX_STOPS = 4
MAX_STOP_CHARS = 256

#: What torch says when sampling meets scores that are not finite (`torch.multinomial`: "probability tensor contains
#: either `inf`, `nan` or element < 0"): the request's own sampling parameters made them, so the client gets a 400.
_NON_FINITE = re.compile(r"\binf\b|\bnan\b|not finite|non-finite", re.IGNORECASE)


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
        kv_tokens: tokens (prompt + output) one request can hold alone in the engine's fixed KV pool, or None when
            that is unbounded (a growing pool, only sliding-window layers): `cli.request_kv_tokens`.
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
    kv_tokens: int | None = None
    _pieces: TokenPieces | None = None

    def json_vocab(self) -> JsonVocabulary:
        """The token texts for `response_format=json_object`, built on first use."""
        if self._json_vocab is None:
            self._json_vocab = JsonVocabulary(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._json_vocab

    def pieces(self) -> TokenPieces:
        """Each token's text and bytes for log-probabilities, built on first use."""
        if self._pieces is None:
            self._pieces = TokenPieces(self.tokenizer)
        return self._pieces

    def context_tokens(self) -> int:
        """Tokens (prompt + output) one request may have: the model's context, or less when the KV pool holds less."""
        return self.max_positions if self.kv_tokens is None else min(self.max_positions, self.kv_tokens)


class Generation:
    """One `/v1/completions` or `/v1/chat/completions` request.

    Args:
        state: the server's state.
        body: the parsed request.
        prompts: token ids per prompt (chat: one).
        max_new_tokens: tokens to generate at most per choice; None for the rest of the context (or of what the KV
            pool can hold for one request: `ServerState.context_tokens()`), chat's default.
        top_logprobs: None, or alternatives per token (`k >= 0`).
        echo: completion texts start with their prompt's text.
    """

    def __init__(self, state: ServerState, body: CompletionRequest | ChatRequest, prompts: list[list[int]],
                 max_new_tokens: int | None, top_logprobs: int | None, echo: bool = False) -> None:
        if body.model != state.model_name:
            raise OpenAIError(400, f"The model {body.model!r} does not exist; this server serves {state.model_name!r}.",
                              param="model", code="model_not_found")
        if body.stream_options is not None and not body.stream:
            raise OpenAIError(400, "stream_options is only allowed with stream=true.", param="stream_options")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise OpenAIError(400, f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters each.",
                              param="stop")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise OpenAIError(400, f"max_tokens must be at least 1, got {max_new_tokens}.", param="max_tokens")
        chat = isinstance(body, ChatRequest)
        prompt_param = "messages" if chat else "prompt"
        limit = state.context_tokens()
        what = (f"the model's context of {state.max_positions} tokens" if limit == state.max_positions else
                f"the {limit} tokens (prompt + max_tokens) one request can hold in this server's KV cache (--max-memory)")
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise OpenAIError(400, f"Prompt {i} is empty; send at least one token.", param="prompt")
            name = "The messages have" if chat else f"Prompt {i} has"
            if len(prompt) >= limit:
                raise OpenAIError(400, f"{name} {len(prompt)} tokens; {what} leaves no room for output. Shorten "
                                  f"{'them' if chat else 'the prompt'}.", param=prompt_param, code="context_length_exceeded")
            if max_new_tokens is not None and len(prompt) + max_new_tokens > limit:
                raise OpenAIError(400, f"{name} {len(prompt)} tokens; with max_tokens={max_new_tokens} it exceeds {what}. "
                                  "Shorten the prompt or lower max_tokens.", param="max_tokens", code="context_length_exceeded")
            if any(not 0 <= t < state.vocab_size for t in prompt):
                raise OpenAIError(400, f"Prompt {i} has token ids outside [0, {state.vocab_size}).", param="prompt")
        if max_new_tokens is None:  # the rest of the context (of what the KV pool can hold for it)
            max_new_tokens = limit - max(map(len, prompts))
        self.state, self.body, self.prompts, self.echo = state, body, prompts, echo
        self.top_logprobs = top_logprobs
        self.max_new_tokens = max_new_tokens
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.events: asyncio.Queue = asyncio.Queue()
        self.tickets: list[Ticket] = []
        self.choices: list[ChoiceState] = []
        self._early: list[tuple[str, Ticket, object]] = []  # events read while submitting, replayed by _updates

    # ------------------------------------------------------------------ building the tickets
    def _generation_fields(self) -> dict[str, object]:
        body = self.body
        fields: dict[str, object] = {"max_new_tokens": self.max_new_tokens, "num_return_sequences": body.n}
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature < SAMPLING_EPS:  # greedy (see SAMPLING_EPS)
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
        # `stop` is not the engine's `stop_strings` (matched over prompt + output): _updates matches the output
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
        queue is full, 503 when shutting down) after aborting whatever it already submitted. Token events that
        come before every ticket is accepted are kept for `_updates`."""
        loop = asyncio.get_running_loop()
        seed = self.body.seed % 2**32 if self.body.seed is not None else secrets.randbits(31)
        fields = self._generation_fields()
        processors = [self._processors(len(prompt)) for prompt in self.prompts]  # may refuse: before any submit
        stops = self.body.stops()
        for i, prompt in enumerate(self.prompts):
            ticket = Ticket(prompt, fields, seed + i, self.top_logprobs, processors[i], loop, self.events)
            try:
                self.state.worker.submit(ticket)
            except (QueueFull, ShuttingDown, EngineDead) as error:
                self.abort()
                full = isinstance(error, QueueFull)
                self.state.worker.metrics.rejected.labels(
                    "queue_full" if full else "shutting_down" if isinstance(error, ShuttingDown) else "engine_dead").inc()
                raise OpenAIError(429 if full else 503, f"{error}; retry later.", code="queue_full" if full else None) from None
            self.tickets.append(ticket)
            self.state.worker.metrics.prompt_tokens.inc(len(prompt))
            base = len(self.state.tokenizer.decode(prompt)) if self.echo else 0
            for k in range(self.body.n):
                self.choices.append(ChoiceState(i * self.body.n + k, TextStream(self.state.tokenizer, stops), base))
        accepted: set[int] = set()
        while len(accepted) < len(self.tickets):
            try:
                kind, ticket, payload = await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if not self.state.worker.alive:
                    self.abort()
                    raise OpenAIError(503, "The engine thread stopped; restart the server.") from None
                continue
            if kind == "accepted":
                accepted.add(id(ticket))
            elif kind == "error" and id(ticket) not in accepted:
                self.abort()
                raise self._refusal(ticket, payload)
            else:  # a token (or a failure) of a ticket accepted already: the engine may step it meanwhile
                self._early.append((kind, ticket, payload))

    def _refusal(self, ticket: Ticket, error: object) -> OpenAIError:
        """What the client hears when the engine refused `ticket` at submission."""
        if isinstance(error, OutOfBlocksError):
            i = next(i for i, t in enumerate(self.tickets) if t is ticket)
            return OpenAIError(
                400, f"Prompt {i} ({len(ticket.prompt)} tokens) with max_tokens={self.max_new_tokens} needs "
                f"{error.blocks_needed} KV blocks, but this server's KV cache holds {error.blocks_total}: lower max_tokens "
                "or shorten the prompt (or start the server with a larger --max-memory).",
                param="max_tokens", code="context_length_exceeded")
        if isinstance(error, (ShuttingDown, EngineDead)):
            return OpenAIError(503, f"{error}; retry later.")
        if isinstance(error, (ValueError, TypeError)):
            return OpenAIError(400, str(error))
        return OpenAIError(500, f"The engine could not take the request: {type(error).__name__}: {error}")

    def _failure(self, error: object) -> OpenAIError:
        """What the client hears when its request failed while it ran (`Engine.take_failures()`, or the engine thread)."""
        if isinstance(error, (ShuttingDown, EngineDead)):
            return OpenAIError(503, f"generation failed: {error}")
        if isinstance(error, OutOfBlocksError):  # the engine preempts others first: it cannot fit even alone
            return OpenAIError(
                400, f"generation failed: the request ran out of KV blocks ({error.blocks_total} in this server's KV "
                "cache) even alone; lower max_tokens or shorten the prompt.", param="max_tokens",
                code="context_length_exceeded")
        if isinstance(error, EngineCrashed):
            return OpenAIError(500, str(error))
        message = str(error)
        if isinstance(error, RuntimeError) and _NON_FINITE.search(message):
            return OpenAIError(
                400, f"Sampling failed for this request: {message}. Its sampling parameters (temperature, top_p, "
                "repetition_penalty, logit_bias, penalties) gave scores that are not finite; use less extreme values.",
                code="invalid_sampling_parameters")
        return OpenAIError(500, f"generation failed: {type(error).__name__}: {message}")

    def abort(self) -> None:
        """Cancels every ticket of this request that may still run."""
        for ticket in self.tickets:
            self.state.worker.abort(ticket)

    # ------------------------------------------------------------------ results
    async def _updates(self, is_disconnected) -> AsyncIterator[tuple[ChoiceState, str, dict | None, bool]]:
        """`(choice, new text, logprobs, done)` per token taken until every choice is done; aborts if the client
        goes away (checked every `DISCONNECT_POLL_S` seconds, however fast tokens come). A choice is done when the
        engine finished its sample or its text reached a stop string; tokens after that are dropped, and a sample
        whose text reached a stop string is dropped by the engine at once (`EngineWorker.finish_sample`)."""
        left = len(self.choices)
        n = self.body.n
        index_of = {id(t): i for i, t in enumerate(self.tickets)}
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_S
        while left:
            if self._early:
                kind, ticket, payload = self._early.pop(0)
            else:
                try:
                    kind, ticket, payload = await asyncio.wait_for(self.events.get(), max(0.0, next_check - loop.time()))
                except TimeoutError:
                    kind = ""
            if loop.time() >= next_check:
                next_check = loop.time() + DISCONNECT_POLL_S
                if await is_disconnected():
                    self.abort()
                    return
                if not self.state.worker.alive:
                    self.abort()
                    raise OpenAIError(503, "generation failed: the engine thread stopped; restart the server.")
            if kind == "error":
                self.abort()
                raise self._failure(payload)
            if kind != "token":
                continue
            choice = self.choices[index_of[id(ticket)] * n + payload.sample]
            if choice.done:  # its text already reached a stop string
                continue
            delta, logprobs = choice.add(payload, self.state.pieces())
            if choice.done:
                delta += choice.finish()
                left -= 1
                if not payload.finished:  # a stop string in its text: the engine drops the sample now
                    self.state.worker.finish_sample(ticket, payload.sample)
            yield choice, delta, logprobs, choice.done

    def _usage(self) -> dict[str, object]:
        return usage(sum(map(len, self.prompts)), sum(len(c.tokens) for c in self.choices),
                     sum(c.cached_tokens for c in self.choices[:: self.body.n]))

    async def collect(self, is_disconnected) -> dict[str, object]:
        """The whole response object (non-streaming)."""
        try:
            async for _ in self._updates(is_disconnected):
                pass
        except asyncio.CancelledError:
            self.abort()
            raise
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
            async for choice, delta, logprobs, done in self._updates(is_disconnected):
                reason = choice.finish_reason if done else None
                if chat:
                    if delta or logprobs:
                        yield _sse(chat_chunk(self, choice.index, {"content": delta}, logprobs, None, include_usage))
                    if done:
                        yield _sse(chat_chunk(self, choice.index, {}, None, reason, include_usage))
                elif delta or logprobs or done:
                    yield _sse(completion_chunk(self, choice.index, delta, logprobs, reason, include_usage))
            finished = all(c.done for c in self.choices)
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
