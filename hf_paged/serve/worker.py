"""The engine's own thread: requests come in through a queue, tokens go back to each request's asyncio queue.

Only this thread touches the `Engine` (and so the pool); the HTTP side talks to it through `submit()` and
`abort()`, which only enqueue. Each accepted request is one `Ticket`; the thread answers it with, in order,
`accepted` or `error` (what `Engine.submit` raised: a ValueError, or `OutOfBlocksError` for a request that
can never fit a fixed pool), then `token` (a TokenEvent) per token, and forgets it once all its samples
finished (or it was aborted or stopped early). A request that fails alone while it runs (out of blocks, or its
logits processors, sampling or stopping criteria raised: `Engine.take_failures()`) gets `error` with that
exception. Admission is bounded: at most `max_pending` requests accepted and not finished; beyond that
`submit()` raises `QueueFull` at once (the server answers 429).

Nothing the engine raises ends the thread quietly: an unexpected exception fails the requests in flight (each
gets `error`) and the loop goes on; only after `MAX_CONSECUTIVE_CRASHES` in a row does the thread give up, and
then every request it still holds or that is still queued gets `error` `EngineDead`, `submit()` raises
`EngineDead` and `alive` is False (`GET /health` answers 503).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from transformers import LogitsProcessor

from ..engine import Engine, TokenEvent
from ..errors import OutOfBlocksError
from .metrics import ServerMetrics

log = logging.getLogger("hf_paged.serve")

#: Unexpected exceptions in a row (each failing the requests in flight) after which the engine thread gives up.
MAX_CONSECUTIVE_CRASHES = 3


class QueueFull(RuntimeError):
    """Too many requests are queued or running; retry later."""


class ShuttingDown(RuntimeError):
    """The server is stopping and takes no new requests."""


class EngineDead(RuntimeError):
    """The engine thread is not running (it stopped after repeated unexpected errors); the server needs a restart."""


class EngineCrashed(RuntimeError):
    """The engine thread hit an unexpected error while this request was in flight (it is logged with its
    traceback); the thread goes on with the next requests."""


@dataclass(eq=False)
class Ticket:
    """One request as the engine thread sees it.

    Attributes:
        prompt: token ids.
        generation: `GenerationConfig` fields (`max_new_tokens`, `do_sample`, `num_return_sequences`, ...).
        seed: sampling seed.
        top_logprobs: as `Engine.submit`.
        processors: extra logits processors (`Engine.submit(logits_processor=...)`).
        loop, events: the asyncio loop of the HTTP side and its queue of replies `(kind, ticket, payload)`
            (several tickets of one HTTP request may share a queue).
        arrived_s: `time.perf_counter()` when the HTTP request arrived (for TTFT).
    """

    prompt: list[int]
    generation: dict[str, object]
    seed: int
    top_logprobs: int | None
    processors: list[LogitsProcessor]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived_s: float = field(default_factory=time.perf_counter)
    request_id: int | None = None
    samples_left: int = 0
    last_token_s: dict[int, float] = field(default_factory=dict)
    first_token: bool = False  # TTFT observed (once per request, whatever its samples)
    finished_samples: set[int] = field(default_factory=set)  # by the engine or a stop string (engine thread only)

    def reply(self, kind: str, payload: object) -> None:
        """Hands a reply to the HTTP side (thread-safe; nothing once that loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, self, payload))
        except RuntimeError:  # the event loop is closed: nobody is left to hear it
            pass


class EngineWorker:
    """Runs `engine` in a daemon thread.

    Args:
        engine: the `Engine` this thread owns from `start()` on.
        metrics: where to record latencies and engine statistics.
        max_pending: requests accepted and not finished at most (queued + running).
    """

    def __init__(self, engine: Engine, metrics: ServerMetrics, max_pending: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_pending = max_pending
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0  # accepted and not finished; guarded by _lock
        self._closing = False  # set once, by drain() or stop(); submit() reads it
        self._thread = threading.Thread(target=self._run, name="hf-paged-engine", daemon=True)
        self._tickets: dict[int, Ticket] = {}  # engine thread only
        self._started = False
        self._stopped = False  # stop() asked for the end (a thread that ended otherwise died)
        self.death: BaseException | None = None  # why the thread gave up, once it did

    # ------------------------------------------------------------------ HTTP side
    def start(self) -> None:
        self._started = True
        self._thread.start()

    @property
    def alive(self) -> bool:
        """False once the engine thread gave up (or before `start()`); True while it serves or is being stopped."""
        return self._started and (self._thread.is_alive() or self._stopped) and self.death is None

    def submit(self, ticket: Ticket) -> None:
        """Queues a request; raises `QueueFull`, `ShuttingDown` or `EngineDead` at once instead of waiting."""
        with self._lock:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            if self._started and not self.alive:
                raise EngineDead(f"the engine thread stopped after an unexpected error ({self.death!r}); restart the server")
            if self._pending >= self.max_pending:
                raise QueueFull(f"{self._pending} requests are queued or running (the limit is {self.max_pending})")
            self._pending += 1
        self._inbox.put(("submit", ticket))

    def abort(self, ticket: Ticket) -> None:
        """Cancels a request (a client went away): its blocks are freed on the engine thread's next turn."""
        self._inbox.put(("abort", ticket))

    def finish_sample(self, ticket: Ticket, sample: int) -> None:
        """Ends one sample of a request that the HTTP side saw finish (its text reached a stop string): the
        engine drops it and frees its blocks on the thread's next turn; the request counts as finished with reason
        "stop" (not as aborted) once every sample finished."""
        self._inbox.put(("finish", (ticket, sample)))

    def drain(self, timeout_s: float) -> None:
        """Refuses new requests from now on and gives those in flight `timeout_s` seconds to finish; then they
        are cancelled (their clients get `error` ShuttingDown). Safe to call from a signal handler: it takes
        no lock (a plain flag and `SimpleQueue.put`, which is reentrant)."""
        self._closing = True
        self._inbox.put(("drain", time.perf_counter() + timeout_s))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Refuses new requests, cancels the ones in flight (their clients get `("error", ShuttingDown)`),
        and waits for the thread to end."""
        with self._lock:
            self._closing = True
        self._stopped = True
        self._inbox.put(("stop", None))
        if self._started:
            self._thread.join(timeout_s)

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        deadline = None  # set by drain(): when the requests in flight get cancelled
        crashes = 0
        try:
            while True:
                try:
                    deadline, done = self._turn(deadline)
                    crashes = 0
                except Exception as error:  # noqa: BLE001 - a bug must not end the thread silently (see module doc)
                    crashes += 1
                    log.exception("hf-paged serve: the engine thread hit an unexpected error (%d in a row)", crashes)
                    self._fail_all(EngineCrashed(f"the engine failed: {type(error).__name__}: {error}"))
                    if crashes >= MAX_CONSECUTIVE_CRASHES:
                        self.death = error
                        return
                    continue
                if done:
                    return
        except BaseException as error:
            self.death = error
            raise
        finally:
            if self.death is not None:  # nobody waits forever on a dead thread
                self._fail_all(EngineDead(f"the engine thread stopped: {type(self.death).__name__}: {self.death}"))
                self._fail_queued(EngineDead("the engine thread stopped; restart the server"))

    def _turn(self, deadline: float | None) -> tuple[float | None, bool]:
        """One turn of the loop: a message from the HTTP side or a step; returns `(deadline, whether to end)`."""
        try:
            kind, ticket = self._inbox.get(timeout=None if not self.engine.has_work() else 0.0)
        except queue.Empty:
            kind, ticket = "", None
        if kind == "drain":
            deadline, ticket = ticket, None
        if kind == "stop" or (deadline is not None and time.perf_counter() >= deadline):
            self._cancel_all()
            return deadline, kind == "stop"
        if kind == "submit":
            self._accept(ticket)
        elif kind == "abort":
            self._cancel(ticket)
        elif kind == "finish":
            self._finish_sample(*ticket)
        if kind and not self._inbox.empty():
            return deadline, False  # take every queued request before the next step
        if self.engine.has_work():
            self._step()
        return deadline, False

    def _fail_all(self, error: Exception) -> None:
        """Every request in flight gets `error` (its blocks freed as far as the engine still can)."""
        for ticket in list(self._tickets.values()):
            try:
                self.engine.abort(ticket.request_id)
            except Exception:  # noqa: BLE001 - the client must hear of it whatever the engine's state
                log.exception("hf-paged serve: aborting request %s failed", ticket.request_id)
            self._finish(ticket, ("error", error))
        try:
            self._record_engine()
        except Exception:  # noqa: BLE001
            log.exception("hf-paged serve: reading the engine's statistics failed")

    def _fail_queued(self, error: Exception) -> None:
        """Requests still in the inbox (never accepted) get `error`."""
        while True:
            try:
                kind, ticket = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._release_slot()
                ticket.reply("error", error)

    def _cancel_all(self) -> None:
        for ticket in list(self._tickets.values()):
            self.engine.abort(ticket.request_id)
            self._finish(ticket, ("error", ShuttingDown("the server is shutting down")))
        self._record_engine()

    def _accept(self, ticket: Ticket) -> None:
        try:
            ticket.request_id = self.engine.submit(
                ticket.prompt, seed=ticket.seed, top_logprobs=ticket.top_logprobs,
                logits_processor=ticket.processors, **ticket.generation,
            )
        except Exception as error:  # noqa: BLE001 - a ValueError (refused), OutOfBlocksError (can never fit), or a bug:
            self._release_slot()    # whichever, this request is refused alone and the thread goes on
            if not isinstance(error, (ValueError, TypeError, OutOfBlocksError)):
                log.exception("hf-paged serve: Engine.submit failed unexpectedly")
            ticket.reply("error", error)
            return
        ticket.samples_left = int(ticket.generation.get("num_return_sequences", 1))
        self._tickets[ticket.request_id] = ticket
        ticket.reply("accepted", None)

    def _cancel(self, ticket: Ticket) -> None:
        if ticket.request_id is not None and self._tickets.pop(ticket.request_id, None) is not None:
            self.engine.abort(ticket.request_id)
            self.metrics.aborted.inc()
            self._release_slot()
            self._record_engine()

    def _finish_sample(self, ticket: Ticket, sample: int) -> None:
        if ticket.request_id is None or self._tickets.get(ticket.request_id) is not ticket:
            return
        if sample not in ticket.finished_samples:  # (else the engine finished it in the meantime)
            self.engine.abort(ticket.request_id, sample=sample)
            self._sample_finished(ticket, sample, "stop", time.perf_counter())
        self._record_engine()

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as error:  # noqa: BLE001 - every client in flight must hear of it, then the loop goes on
            log.exception("hf-paged serve: an engine step failed; the requests in flight fail")
            self._fail_all(EngineCrashed(f"the engine step failed: {type(error).__name__}: {error}"))
            return
        now = time.perf_counter()
        for event in events:
            self._deliver(event, now)
        for request_id, error in self.engine.take_failures():  # failed alone (out of blocks, processors, sampling)
            ticket = self._tickets.get(request_id)
            if ticket is not None:
                log.warning("hf-paged serve: request %d failed alone: %s: %s", request_id, type(error).__name__, error)
                self._finish(ticket, ("error", error))
        self._record_engine()

    def _deliver(self, event: TokenEvent, now: float) -> None:
        ticket = self._tickets.get(event.request_id)
        if ticket is None:
            return
        if not ticket.first_token:  # once per request: its first token, whichever sample drew it
            ticket.first_token = True
            self.metrics.ttft.observe(now - ticket.arrived_s)
        previous = ticket.last_token_s.get(event.sample)
        if previous is not None:
            self.metrics.itl.observe(now - previous)
        ticket.last_token_s[event.sample] = now
        self.metrics.generated.inc()
        ticket.reply("token", event)
        if event.finished:
            self._sample_finished(ticket, event.sample, event.finish_reason or "stop", now)

    def _sample_finished(self, ticket: Ticket, sample: int, reason: str, now: float) -> None:
        """One sample of a request finished (the engine's last token, or a stop string the HTTP side saw); the
        request is done once all have."""
        if sample in ticket.finished_samples:
            return
        ticket.finished_samples.add(sample)
        ticket.samples_left -= 1
        if ticket.samples_left == 0:
            self.metrics.finished.labels(reason).inc()
            self.metrics.e2e.observe(now - ticket.arrived_s)
            self._finish(ticket, None)

    def _finish(self, ticket: Ticket, reply: tuple[str, object] | None) -> None:
        self._tickets.pop(ticket.request_id, None)
        self._release_slot()
        if reply is not None:
            ticket.reply(*reply)

    def _release_slot(self) -> None:
        with self._lock:
            self._pending -= 1

    def _record_engine(self) -> None:
        self.metrics.record_engine(self.engine.stats())
