"""Which tokens of which requests go into the next step, admission, and preemption.

Per step (vLLM's order): every decoding request contributes its one token; then prefill chunks, first of
requests already admitted, then of newly admitted ones in arrival order (FCFS), up to `max_batch_tokens`
tokens and `max_seqs` requests in flight. Before a step runs, its blocks are counted against what the pool
can hand out; if they do not fit, the most recently admitted request is preempted: its blocks are freed
and it goes back to the front of the queue, to be recomputed later (its prompt blocks are then usually
prefix hits).

Decoding requests are rows of a few `PagedCache`s, one per length class (up to 64 tokens, 65-128, 129-256,
...) and row width (1 token per step, or `1 + k` for a request speculating with `k` drafts, `speculation.py`):
each is one segment of the packed step, so the attention of a decode row is padded to at most about twice its
length, never to the longest request in flight. A row moves to the next class (sharing its blocks, no copy)
when it grows past its class. The block count of a step includes every row's drafts; after the step, each
speculating row gives back the slots of its rejected drafts (`PagedCache.crop_rows`).

Hybrid models (recurrent layers beside attention, `pool.layout.is_hybrid`) run each step as a batch with one request
per row (`rows_step.py`), never two requests in one row, and never a padded position (it would advance a row's
recurrent state). A step is then either a decode step, every decoding request a row of one decoding cache
(`[num_rows, 1]`), or a prefill step, one chunk of the same length per prefilling request (`[num_rows, chunk_len]`),
all of them first chunks (no state yet) or all continuing chunks. The two kinds alternate while both have work.
A model whose recurrent layers cannot continue a multi-token chunk (`support.resumes_recurrent_states`) prefills
each request in one forward, longer than `max_batch_tokens` if its tokens are, beside requests of the same length.
A preempted request's state slot is released with its blocks; its state is recomputed from its tokens.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from ..cache.paged_cache import PagedCache
from ..errors import OutOfBlocksError
from ..support import resumes_recurrent_states
from ..cache.kvpool import KVPool
from .request import Request, State


@dataclass(slots=True)
class StepPlan:
    """What one step feeds.

    Attributes:
        decodes: per (length class, row width), its decoding cache and requests in row order (`width` tokens each).
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
        return sum(r.width for r in self.decoding) + sum(n for _, n, _ in self.chunks)


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
        # per (length class, row width): a cache whose row i is decoding[key][i]
        self.decode_caches: dict[tuple[int, int], PagedCache] = {}
        self.decoding: dict[tuple[int, int], list[Request]] = {}
        self.num_admitted = 0
        self.admit_next = True  # False right after a step ran out of blocks: the next one admits nobody
        self.num_preemptions = 0
        self.failed: list[tuple[Request, Exception]] = []  # requests that failed alone (blocks, or their processors)
        self.hybrid = pool.layout.is_hybrid  # one request per row of a batch, steps of one kind (module docstring)
        self.prefill_turn = True  # hybrids: the next step prefills when both kinds have work
        # hybrids whose recurrent layers cannot continue a multi-token chunk (`support.py`): whole prefills only
        self.whole_prefills = self.hybrid and not resumes_recurrent_states(config)

    @property
    def running(self) -> list[Request]:
        return self.prefilling + [r for reqs in self.decoding.values() for r in reqs]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ planning
    def schedule(self) -> StepPlan:
        """The next step's tokens, after admitting and (if the pool is short) preempting requests."""
        admit, self.admit_next = self.admit_next, True
        while True:
            plan = self._fill(admit)
            if self._fits(plan) or not self._preempt_latest():
                return plan
            admit = False  # a preempted request goes back to the queue's front: not re-admitted this step

    def _fill(self, admit: bool) -> StepPlan:
        if self.hybrid:
            return self._fill_rows(admit)
        plan = StepPlan(decodes=[(self.decode_caches[k], list(reqs)) for k, reqs in sorted(self.decoding.items()) if reqs])
        budget = self.max_batch_tokens - sum(r.width for r in plan.decoding)
        for req in self.prefilling:
            if budget <= 0:
                break
            budget -= self._add_chunk(plan, req, budget)
        while admit and budget > 0 and self.waiting and len(self.running) < self.max_seqs:
            req = self.waiting.popleft()
            self._admit(req)
            budget -= self._add_chunk(plan, req, budget)
        return plan

    @staticmethod
    def _add_chunk(plan: StepPlan, req: Request, budget: int) -> int:
        """Adds the request's next prefill chunk, of at most `budget` tokens unless an image's run of placeholders that
        its tokens attend both ways must stay whole (`Media.chunk_stop`: the chunk then ends before the run, or, when
        it begins there, after it); returns its length."""
        n = min(req.remaining, budget)
        if req.media is not None:
            n = req.media.chunk_stop(req.fed, req.fed + n) - req.fed
        plan.chunks.append((req, n, n == req.remaining))
        return n

    def _fill_rows(self, admit: bool) -> StepPlan:
        """A hybrid model's step: every decoding request, or prefill chunks of one length (see the module
        docstring); a prefill step takes first chunks or continuing chunks, whichever its oldest request needs."""
        room = min(self.max_seqs - len(self.running), self.max_batch_tokens - len(self.prefilling))
        for _ in range(room if admit else 0):
            if not self.waiting:
                break
            self._admit(self.waiting.popleft())
        decodes = [(self.decode_caches[k], list(reqs)) for k, reqs in sorted(self.decoding.items()) if reqs]
        if decodes and not (self.prefilling and self.prefill_turn):
            return StepPlan(decodes=decodes)
        if not self.prefilling:
            return StepPlan()
        if self.whole_prefills:  # requests of the oldest one's length, each prefilled in this one forward
            n = self.prefilling[0].remaining
            rows = [r for r in self.prefilling if r.remaining == n][: max(1, self.max_batch_tokens // n)]
            return StepPlan(chunks=[(r, n, True) for r in rows])
        first_chunks = self.prefilling[0].fed == 0
        rows = [r for r in self.prefilling if (r.fed == 0) == first_chunks][: self.max_batch_tokens]
        n = min(min(r.remaining for r in rows), max(1, self.max_batch_tokens // len(rows)))
        return StepPlan(chunks=[(r, n, n == r.remaining) for r in rows])

    def new_cache(self) -> PagedCache:
        """An empty cache of the pool for one request's rows (no row deduplication: rows are distinct requests)."""
        return PagedCache(self.config, pool=self.pool, salt=self.salt, dedupe_rows=False)

    def _admit(self, req: Request) -> None:
        """Gives a request its own cache, holding the longest cached prefix of its tokens (and images)."""
        cache = self.new_cache() if self.hybrid else PagedCache(pool=self.pool, salt=self.salt, dedupe_rows=False)
        # a request's images key its blocks from its first placeholder (an id the model's config names) on, as
        # `KVPool.new_cache(**inputs, model=model)` keys them
        non_text = req.media.inputs if req.media is not None else None
        ids = torch.tensor([req.tokens], dtype=torch.long, device="cpu")
        cache.load_prompt(ids, non_text=non_text, config=self.config)
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
        fed = [(r.fed, r.width) for r in plan.decoding] + [(r.fed, n) for r, n, _ in plan.chunks]
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
        """Takes a running request out of its queue and frees its blocks (its draft model's too)."""
        req.release_draft()
        if req.state is State.PREFILL:
            self.prefilling.remove(req)
            req.cache.release()
            req.cache = None
        else:
            self._drop_decoding([req])

    def on_out_of_blocks(self, error: OutOfBlocksError) -> None:
        """A step failed for blocks (the count was short, e.g. before the pool knew its size, or other holders of
        the pool took blocks): preempt the latest request, and admit none in the next step (the one preempted would
        come right back, and its blocks may be what the step lacks); when the one request in flight does not fit, it
        fails alone (`failed`, with a note saying who holds the pool's blocks) and the run goes on with the others."""
        if self._preempt_latest():
            self.admit_next = False
            return
        (req,) = self.running
        if req.state is State.DECODE and req.width > 1:  # alone, it fits without its drafts: it goes on without them
            self._stop_speculating(req)
            return
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

    def _stop_speculating(self, req: Request) -> None:
        """Moves a decoding request's row to the width-1 cache of its class; it drafts no more."""
        key = self._key(req)
        row = self.decoding[key].index(req)
        req.speculation = None
        req.release_draft()
        self._join(req, self.decode_caches[key], row)
        self._drop_decoding([req], only=key)

    def fail(self, req: Request, error: Exception) -> None:
        """A request whose token could not be chosen (its logits processors, sampling or stopping criteria raised)
        fails alone after its step: its samples still in flight are dropped too (`failed`: once per request)."""
        if any(r.group == req.group for r, _ in self.failed):
            return
        error.add_note(
            f"Engine: request {req.group} failed choosing its next token; the other requests went on."
        )
        group = [r for r in (*self.waiting, *self.running) if r.group == req.group and r.state is not State.FINISHED]
        self.abort([sample for r in group for sample in (r, *r.followers)])
        self.failed.append((req, error))

    def take_failed(self) -> list[tuple[Request, Exception]]:
        """The requests that failed alone since the last call (`on_out_of_blocks`, `fail`), with their errors."""
        failed, self.failed = self.failed, []
        return failed

    def after_step(self, plan: StepPlan, finished: set[Request], kept: dict[Request, int]) -> None:
        """Advances the requests of a completed step: fed counts, rejected drafts rolled back, prefill -> decode,
        finished ones out.

        Args:
            kept: per decoding request, the tokens it kept (1 without speculation; accepted drafts + 1 with).
        """
        self.prefill_turn = not plan.chunks
        for req in plan.decoding:
            req.fed += kept[req]  # the last kept token is not fed yet; accepted drafts were
        for req, n, _ in plan.chunks:
            req.fed += n
            if req.media is not None and req.media.all_stored(req.fed):
                req.media.release_features()  # every placeholder is in its blocks: a recompute after a preemption
                # takes them from the prefix index, or encodes again (media.py)
        self._drop_decoding([r for r in plan.decoding if r in finished])
        for key, reqs in self.decoding.items():  # the rejected drafts' slots go back (every row was in the step)
            if key[1] > 1 and reqs:
                self.decode_caches[key].crop_rows([r.width - kept.get(r, r.width) for r in reqs])
        for key, reqs in list(self.decoding.items()):  # rows that grew out of their class move up (no copy)
            grown = [r for r in reqs if self._key(r) != key]
            for req in grown:
                self._join(req, self.decode_caches[key], reqs.index(req))
            self._drop_decoding(grown, only=key)
        for req, _, last in plan.chunks:
            if not last:
                continue
            for sample in (req, *req.followers):  # a request's samples share the prompt's blocks (samples.py)
                sample.fed = req.fed
                if sample.dropped:  # aborted while its prefill carried the others: done now
                    sample.state = State.FINISHED
                elif sample not in finished:
                    # its prefill is done: it joins the decoding rows (sharing its blocks; its own cache lets go)
                    self._join(sample, req.cache, 0)
                    sample.state = State.DECODE
                    if sample is not req:  # admitted now, after the request itself: preempted before it
                        sample.admitted_at = self.num_admitted
                        self.num_admitted += 1
            req.followers = []
            self.prefilling.remove(req)
            req.cache.release()
            req.cache = None
        for req in finished:
            req.state = State.FINISHED
            req.release_draft()

    def _key(self, req: Request) -> tuple[int, int]:
        """The decoding cache a request's row belongs in: (length class after its next step, row width); for
        hybrid models one cache for all (a decode step is one forward over it, `_fill_rows`)."""
        if self.hybrid:
            return 0, 1
        return length_class(req.fed + req.width), req.width

    def _join(self, req: Request, source: PagedCache, row: int) -> None:
        """Appends `source`'s row `row` (the request's) to the decoding cache of its length class and width."""
        k = self._key(req)
        if k not in self.decode_caches:
            self.decode_caches[k] = self.new_cache()
            self.decoding[k] = []
        self.decode_caches[k].append_row_of(source, row)
        self.decoding[k].append(req)

    def _drop_decoding(self, reqs: list[Request], only: tuple[int, int] | None = None) -> None:
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
        """Removes requests wherever they are (queued, prefilling, decoding, riding along their prompt's prefill as
        another sample's `followers`) and frees their blocks at once; their state becomes FINISHED. A sample whose
        prefill carries other samples that are not aborted keeps prefilling for them, `dropped`: it yields nothing
        and finishes when the prefill ends."""
        aborting = set(reqs)
        for req in reqs:
            carrier = next((r for r in (*self.waiting, *self.prefilling) if req in r.followers), None)
            if carrier is not None:  # a sample riding along its prompt's prefill: it just leaves
                carrier.followers.remove(req)
                req.state = State.FINISHED
                if carrier.dropped and not carrier.followers:  # nobody left to prefill for
                    self._remove(carrier)
            elif req.state in (State.WAITING, State.PREFILL) and any(f not in aborting for f in req.followers):
                req.dropped = True
            else:
                self._remove(req)

    def _remove(self, req: Request) -> None:
        """Takes one request out wherever it is and frees its blocks; it becomes FINISHED."""
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.prefilling:
            self.prefilling.remove(req)
            req.cache.release()
            req.cache = None
        if req.state is State.DECODE:
            self._drop_decoding([req])
        req.followers = []
        req.state = State.FINISHED
        req.release_draft()

    def release_all(self) -> None:
        """Releases every request's blocks (end of a run, or a consumer that stopped early)."""
        for req in self.running:
            req.release_draft()
        for req in self.prefilling:
            req.cache.release()
            req.cache = None
        self.prefilling = []
        for k, cache in self.decode_caches.items():
            cache.release()
            self.decoding[k] = []


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
