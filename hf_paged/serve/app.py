"""The FastAPI application: routes, API-key check, OpenAI-style errors, and the engine thread's lifetime.

Endpoints: `GET /health`, `GET /v1/models`, `GET /metrics` (Prometheus; neither needs the API key),
`POST /v1/completions`, `POST /v1/chat/completions`. A malformed body or an unknown field is a 400 whose
`error.param` names the field.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .handling import Generation, ServerState
from .protocol import ChatRequest, CompletionRequest, OpenAIError
from .text import chat_prompt


def build_app(state: ServerState) -> FastAPI:
    """The application serving `state`; its lifespan starts the engine thread and, on shutdown, cancels
    the requests still in flight and stops the thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.worker.start()
        try:
            yield
        finally:
            state.worker.stop()

    app = FastAPI(title="hf-paged", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body, status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error(error).body, status_code=400)

    async def check_key(request: Request) -> None:
        if state.api_key is not None and request.headers.get("authorization") != f"Bearer {state.api_key}":
            raise OpenAIError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key")

    @app.get("/health")
    async def health() -> Response:
        if not state.worker.alive:  # the engine thread gave up: nothing would ever answer
            death = state.worker.death
            return JSONResponse({"status": "unhealthy", "pending_requests": state.worker.pending,
                                 "error": f"the engine thread stopped: {type(death).__name__}: {death}" if death
                                 else "the engine thread is not running"}, status_code=503)
        return JSONResponse({"status": "ok", "pending_requests": state.worker.pending})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.worker.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models() -> dict[str, object]:
        model = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "hf-paged",
                 "max_model_len": state.context_tokens()}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if body.echo and body.logprobs is not None:
            raise OpenAIError(400, "echo with logprobs (prompt log-probabilities) is not supported; drop one.", param="echo")
        prompts = completion_prompts(state, body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        return await run(Generation(state, body, prompts, max_tokens, body.logprobs, echo=body.echo), request)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat(body: ChatRequest, request: Request) -> Response:
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise OpenAIError(400, "Send max_completion_tokens or max_tokens, not both.", param="max_tokens")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = chat_prompt(state.tokenizer, messages, state.chat_template)
        except Exception as error:  # noqa: BLE001 - a template that fails on these messages is the request's problem
            raise OpenAIError(400, f"The chat template failed on these messages: {error}", param="messages") from None
        # without a limit: the rest of the context, or of what the KV pool holds for one request (Generation)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        return await run(Generation(state, body, [prompt], max_tokens, top), request)

    return app


async def run(gen: Generation, request: Request) -> Response:
    """Submits `gen`, then answers with the whole response or an SSE stream."""
    await gen.submit()
    if gen.body.stream:
        return StreamingResponse(gen.stream(request.is_disconnected), media_type="text/event-stream")
    return JSONResponse(await gen.collect(request.is_disconnected))


def completion_prompts(state: ServerState, prompt: str | list) -> list[list[int]]:
    """`prompt` (a text, texts, token ids or lists of them) as token ids per prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt is empty; send a text or token ids.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [state.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p) for p in prompt]


def validation_error(error: RequestValidationError) -> OpenAIError:
    """The first problem of a body as an OpenAI error naming the field (`error.param`: its path, without the
    union member pydantic tried, e.g. `stop`, not `stop.str`; the messages of every member are joined)."""
    problems = error.errors()
    if not problems:
        return OpenAIError(400, "Invalid request body.")
    first = problems[0]
    loc = _field_path(first.get("loc", ()))
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return OpenAIError(400, f"Unsupported field {param!r}: hf-paged serve does not implement it; remove it.",
                           param=param, code="unsupported_field")
    if first.get("type") == "missing":
        return OpenAIError(400, f"Missing required field {param!r}.", param=param)
    messages = list(dict.fromkeys(str(p.get("msg")) for p in problems if _field_path(p.get("loc", ())) == loc))
    return OpenAIError(400, f"Invalid value for {param!r}: {'; or '.join(messages)}.", param=param)


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|bytes|[A-Z]\w*|[\w-]+\[.*\])$")


def _field_path(loc) -> list[str]:
    """A pydantic error location as field names and list indices: "body" and the tags pydantic adds for the
    member of a union it tried (`str`, `list[int]`, `TextPart`, `function-after[...]`) left out."""
    return [str(part) for part in loc if part != "body" and not (isinstance(part, str) and _UNION_TAG.match(part))]
