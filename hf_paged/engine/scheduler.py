"""Which tokens of which requests go into the next step, admission, and preemption.

Per step (vLLM's order): every decoding request contributes its one token; then prefill chunks, first of
requests already admitted, then of newly admitted ones in arrival order (FCFS), up to `max_batch_tokens`
tokens and `max_seqs` requests in flight. Before a step runs, its blocks are counted against what the pool
can hand out; if they do not fit, the most recently admitted request is preempted: its blocks are freed
and it goes back to the front of the queue, to be recomputed later (its prompt blocks are then usually
prefix hits).

Decoding requests are rows of a few `PagedCache`s, one per length class (up to 64 tokens, 65-128, 129-256,
...): each class is one segment of the packed step, so the attention of a decode row is padded to at most
about twice its length, never to the longest request in flight. A row moves to the next class (sharing its
blocks, no copy) when it grows past its class.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from ..cache.paged_cache import PagedCache
from ..errors import OutOfBlocksError
from ..cache.kvpool import KVPool
from .request import Request, State


@dataclass(slots=True)
class StepPlan:
    """What one step feeds.

    Attributes:
        decodes: per length class, its decoding cache and requests in row order (one token each).
        chunks: `(request, num_tokens, last)` prefill chunks, in packed order; `last`: the chunk ends the
            request's prefill, so its last token's logits give the request's next token.
    """

    decodes: list[tuple[PagedCache, list[Request]]] = field(default_factory=list)
    chunks: list[tuple[Request, int, bool]] = field(default_factory=list)

    @property
    def decoding(self) -> list[Request]:
        """Every decoding request of the step, in packed order."""
        return [r for _, reqs in self.decodes for r in reqs]

    @property
    def num_tokens(self) -> int:
        return len(self.decoding) + sum(n for _, n, _ in self.chunks)


def length_class(seq_len: int) -> int:
    """0 for up to 64 tokens, then one class per doubling (65-128 -> 1, 129-256 -> 2, ...)."""
    return max(0, (max(seq_len, 1) - 1).bit_length() - 6)


class Scheduler:
    """Owns the queues and the caches of the requests in flight.

    Args:
        pool: the `KVPool` every request's blocks live in.
        config: the model config (binds the decoding cache's layer layout).
        max_batch_tokens: tokens per step at most (decode tokens plus prefill chunks).
        max_seqs: requests in flight (prefilling or decoding) at most.
        salt: prefix-index tenant key of every request's cache.
    """

    def __init__(self, pool: KVPool, config, max_batch_tokens: int, max_seqs: int, salt: str | bytes | None) -> None:
        self.pool = pool
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.salt = salt
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.config = config
        # per length class: a cache whose row i is decoding[k][i]
        self.decode_caches: dict[int, PagedCache] = {}
        self.decoding: dict[int, list[Request]] = {}
        self.num_admitted = 0
        self.num_preemptions = 0
        self.failed: list[tuple[Request, OutOfBlocksError]] = []  # requests that could not fit, with their error

    @property
    def running(self) -> list[Request]:
        return self.prefilling + [r for reqs in self.decoding.values() for r in reqs]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ planning
    def schedule(self) -> StepPlan:
        """The next step's tokens, after admitting and (if the pool is short) preempting requests."""
        admit = True
        while True:
            plan = self._fill(admit)
            if self._fits(plan) or not self._preempt_latest():
                return plan
            admit = False  # a preempted request goes back to the queue's front: not re-admitted this step

    def _fill(self, admit: bool) -> StepPlan:
        plan = StepPlan(decodes=[(self.decode_caches[k], list(reqs)) for k, reqs in sorted(self.decoding.items()) if reqs])
        budget = self.max_batch_tokens - len(plan.decoding)
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.remaining, budget)
            plan.chunks.append((req, n, n == req.remaining))
            budget -= n
        while admit and budget > 0 and self.waiting and len(self.running) < self.max_seqs:
            req = self.waiting.popleft()
            self._admit(req)
            n = min(req.remaining, budget)
            plan.chunks.append((req, n, n == req.remaining))
            budget -= n
        return plan

    def _admit(self, req: Request) -> None:
        """Gives a request its own cache, holding the longest cached prefix of its tokens."""
        cache = PagedCache(pool=self.pool, salt=self.salt, dedupe_rows=False)
        cache.load_prompt(torch.tensor([req.tokens], dtype=torch.long))
        req.cache, req.fed, req.state = cache, cache.get_seq_length(), State.PREFILL
        if req.cached_tokens is None:
            req.cached_tokens = req.fed
        req.admitted_at = self.num_admitted
        self.num_admitted += 1
        self.prefilling.append(req)

    def _fits(self, plan: StepPlan) -> bool:
        """Whether every layer group can hand out the blocks the step needs (an upper bound: sliding groups
        may free some)."""
        allocators = self.pool.allocators
        if allocators is None or all(a.max_blocks is None for a in allocators):
            return True
        bs = self.pool.block_size
        fed = [(r.fed, 1) for r in plan.decoding] + [(r.fed, n) for r, n, _ in plan.chunks]
        need = sum(math.ceil((s + n) / bs) - math.ceil(s / bs) for s, n in fed)
        return all(a.max_blocks is None or a.can_allocate(need) for a in allocators)

    # ------------------------------------------------------------------ transitions
    def _preempt_latest(self) -> bool:
        """Preempts the most recently admitted request; False when fewer than two are in flight (nothing
        else could then make room)."""
        running = self.running
        if len(running) < 2:
            return False
        self.preempt(max(running, key=lambda r: r.admitted_at))
        return True

    def preempt(self, req: Request) -> None:
        """Frees a request's blocks and puts it back at the front of the queue (recomputed later)."""
        self._let_go(req)
        req.state, req.fed = State.WAITING, 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _let_go(self, req: Request) -> None:
        """Takes a running request out of its queue and frees its blocks."""
        if req.state is State.PREFILL:
            self.prefilling.remove(req)
            req.cache.release()
            req.cache = None
        else:
            self._drop_decoding([req])

    def on_out_of_blocks(self, error: OutOfBlocksError) -> None:
        """A step failed for blocks (the count was short, e.g. before the pool knew its size, or other holders of
        the pool took blocks): preempt the latest request; when the one request in flight does not fit, it fails
        alone (`failed`, with a note saying who holds the pool's blocks) and the run goes on with the others."""
        if self._preempt_latest():
            return
        (req,) = self.running
        self._let_go(req)
        req.state = State.FINISHED
        stats = self.pool.stats()  # this run holds no block now: every block in use is someone else's
        what = f"request {req.index} ({len(req.prompt)} prompt tokens, up to {req.max_new_tokens} new)"
        if stats.blocks_in_use:
            error.add_note(
                f"Engine: {what} did not fit: other caches, engines or threads on this KVPool hold "
                f"{stats.blocks_in_use} of its {stats.blocks_total} blocks (over all layer groups) while this run "
                "holds none. Give each engine its own KVPool, run them one after another, or release those caches."
            )
        else:
            error.add_note(
                f"Engine: the KVPool cannot hold even one request alone ({what}); give the pool more memory "
                "(max_memory / num_blocks) or lower max_new_tokens."
            )
        self.failed.append((req, error))

    def take_failed(self) -> list[tuple[Request, OutOfBlocksError]]:
        """The requests that failed alone since the last call (`on_out_of_blocks`), with their errors."""
        failed, self.failed = self.failed, []
        return failed

    def after_step(self, plan: StepPlan, finished: set[Request]) -> None:
        """Advances the requests of a completed step: fed counts, prefill -> decode, finished ones out."""
        for req in plan.decoding:
            req.fed += 1
        for req, n, _ in plan.chunks:
            req.fed += n
        self._drop_decoding([r for r in plan.decoding if r in finished])
        for k, reqs in list(self.decoding.items()):  # rows that grew out of their class move up (no copy)
            grown = [r for r in reqs if length_class(r.fed + 1) != k]
            for req in grown:
                self._join(req, self.decode_caches[k], reqs.index(req))
            self._drop_decoding(grown, only=k)
        for req, _, last in plan.chunks:
            if not last:
                continue
            for sample in (req, *req.followers):  # a request's samples share the prompt's blocks (samples.py)
                sample.fed = req.fed
                if sample not in finished:
                    # its prefill is done: it joins the decoding rows (sharing its blocks; its own cache lets go)
                    self._join(sample, req.cache, 0)
                    sample.state = State.DECODE
            req.followers = []
            self.prefilling.remove(req)
            req.cache.release()
            req.cache = None
        for req in finished:
            req.state = State.FINISHED

    def _join(self, req: Request, source: PagedCache, row: int) -> None:
        """Appends `source`'s row `row` (the request's) to the decoding cache of its length class."""
        k = length_class(req.fed + 1)
        if k not in self.decode_caches:
            self.decode_caches[k] = PagedCache(self.config, pool=self.pool, salt=self.salt, dedupe_rows=False)
            self.decoding[k] = []
        self.decode_caches[k].append_row_of(source, row)
        self.decoding[k].append(req)

    def _drop_decoding(self, reqs: list[Request], only: int | None = None) -> None:
        """Removes decoding requests' rows (their blocks are released unless another row holds them)."""
        if not reqs:
            return
        for k, current in self.decoding.items():
            if only is not None and k != only:
                continue
            keep = [i for i, r in enumerate(current) if r not in reqs]
            if len(keep) == len(current):
                continue
            self.decoding[k] = [current[i] for i in keep]
            if keep:
                self.decode_caches[k].batch_select_indices(keep)
            else:
                self.decode_caches[k].release()

    def abort(self, reqs: list[Request]) -> None:
        """Removes requests wherever they are (queued, prefilling, decoding) and frees their blocks at once;
        their state becomes FINISHED."""
        for req in reqs:
            if req in self.waiting:
                self.waiting.remove(req)
            elif req in self.prefilling:
                self.prefilling.remove(req)
                req.cache.release()
                req.cache = None
        self._drop_decoding([r for r in reqs if r.state is State.DECODE])
        for req in reqs:
            req.followers = []
            req.state = State.FINISHED

    def release_all(self) -> None:
        """Releases every request's blocks (end of a run, or a consumer that stopped early)."""
        for req in self.prefilling:
            req.cache.release()
            req.cache = None
        self.prefilling = []
        for k, cache in self.decode_caches.items():
            cache.release()
            self.decoding[k] = []

    def caches_of(self, plan: StepPlan) -> list[PagedCache]:
        """The caches a step writes: the decoding cache (when it has rows) and each prefill chunk's."""
        return [cache for cache, _ in plan.decodes] + [r.cache for r, _, _ in plan.chunks]


def refuse_oversized(pool: KVPool, requests: list[Request]) -> None:
    """Raises `OutOfBlocksError` before anything runs when a request can never fit a fixed pool alone: its
    prompt and all but its last new token need more blocks than a full-attention layer group holds."""
    capacity = pool.fixed_capacity()
    if capacity is None or all(g.sliding_window is not None for g in pool.layout.groups):
        return
    bs = pool.block_size
    for req in requests:
        need = math.ceil((len(req.prompt) + req.max_new_tokens - 1) / bs)
        if need > capacity:
            error = OutOfBlocksError(need, capacity, capacity, bs)
            error.add_note(
                f"Engine: the KVPool cannot hold even one request alone: request {req.index} ({len(req.prompt)} "
                f"prompt tokens, up to {req.max_new_tokens} new) needs {need} blocks of a pool of {capacity}; "
                "refused before any request ran. Give the pool more memory (max_memory / num_blocks), or lower "
                "max_new_tokens or the prompt."
            )
            raise error
