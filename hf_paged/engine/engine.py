"""`Engine`: continuous batching over a `KVPool` for any `"paged"` transformers model.

>>> engine = hf_paged.Engine(model, max_batch_tokens=512, max_seqs=64)
>>> outputs = engine.generate([tokenizer.encode(p) for p in prompts], max_new_tokens=64)
>>> texts = hf_paged.Engine(model, tokenizer=tokenizer).generate(["def f(x):\n"], max_new_tokens=8)
"""

from __future__ import annotations

import inspect
import operator
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from ..distributed import tensor_parallel_group
from ..errors import OutOfBlocksError, UnsupportedModelError
from ..cache.kvpool import KVPool
from ..support import (
    attends_images_bidirectionally,
    attends_prefix_bidirectionally,
    model_type_of,
    placeholder_token_ids,
    reads_gathered,
)
from . import text
from .config import prepare_request
from .inputs import arrival_times, prompt_inputs
from .media import Media
from .outputs import EngineStats, Generated, TokenEvent, check_top_logprobs
from .graph import DEFAULT_MAX_POSITIONS, DecodeGraphs, check_compilable
from .packed import run_step
from .rows_step import is_hybrid, no_speculation, run_rows_step
from .request import Request, State
from .samples import attach_samples
from .scheduler import Scheduler, refuse_oversized
from .drafter import Drafter
from .speculation import Speculation, accept, prompt_lookup_draft, set_draft


@dataclass(slots=True, eq=False)
class _Run:
    """One `generate()` / `stream()` call: its scheduler and how many of its requests finished."""

    scheduler: Scheduler
    finished: int = 0


class Engine:
    """Serves many prompts with one model: each step is one forward over a packed, unpadded set of tokens
    (one decode token of every running request, then prefill chunks of new ones, up to `max_batch_tokens`);
    finished requests are replaced at once, and a full pool preempts the latest request instead of failing.

    Greedy output of each request equals single-request `model.generate()` up to near-ties: the packed
    forward sums in a different order (a prefill chunk, a decode row), so two logits within float rounding
    of each other may be ordered differently.

    Vision-language models: a prompt may be the processor's output for it (`{"input_ids": ..., "pixel_values": ...,
    "image_sizes" / "image_grid_thw" / ...: ...}`). When a prefill chunk first reaches its images, the model's own
    vision path runs on them (a forward stopped at its language model, `media.py`); each chunk then feeds the text
    embeddings with the placeholders' rows replaced by the features (a chunk may split an image), and multimodal
    rotary positions (Qwen2-VL's mrope) where the model computes them. Where an image's tokens attend each other both
    ways (Gemma 3, Gemma 4), a chunk never splits an image and attends under the mask the model builds for it. The
    prefix index keys a request's blocks by its images as `KVPool.new_cache(**inputs)` does, so a request about a
    cached image skips its vision path and the image's prefill (families of `support.HITS_OVER_PLACEHOLDERS`), another
    image never hits. A hybrid model's batched steps splice the features row by row (`rows_step.py`). Refused before
    anything runs: images with a draft model, and on a hybrid model whose image tokens attend each other both ways
    (PaliGemma, whose prompts attend both ways whole, gets no Engine); a vision path the steps cannot reproduce is
    refused when it first runs.

    Hybrid models (recurrent layers beside attention: Mamba, gated DeltaNet, short convolutions) run each step as
    one forward with a batch dimension instead, a request per row with its recurrent states in a state slot of the
    pool: a decode step of every decoding request, or a prefill step of chunks of one length, alternating
    (`rows_step.py`, `scheduler.py`). They do not speculate (recurrent states cannot step back over drafts).

    Args:
        model: a decoder-only transformers model loaded with `attn_implementation="paged"` (for a vision-language
            model, at least its language model: `{"text_config": "paged", "": "sdpa", ...}`), whose forward takes
            `position_ids` (each packed token carries its own position).
        pool: the `KVPool` to use (fixed size: preemption keeps requests within it); default a growing pool
            with prefix caching.
        max_batch_tokens: tokens per forward at most (decode tokens plus prefill chunks).
        max_seqs: requests in flight at most.
        tokenizer: needed for text prompts (see `generate()`) and `stop_strings`.
        salt: prefix-index tenant key of this engine's requests (as `KVPool.new_cache(salt=...)`). The index is
            also keyed by the model's current weights (`weights.py`): after an optimizer step, `load_state_dict`
            or another model on the same pool, no K/V of other weights is served.
        on_step: called with the engine after every step (also a step retried after a preemption), between
            forwards, e.g. `lambda engine: engine.pool.check()`.
        draft_model: a smaller model with the same tokenizer, loaded with `attn_implementation="paged"`: every
            greedy request without `prompt_lookup_num_tokens` then speculates with `num_draft_tokens` drafts of it
            per step (`drafter.py`; its K/V live in a pool of its own, `engine.drafter.pool`). Requests that sample
            are refused on such an engine (speculation is greedy only).
        num_draft_tokens: drafts per step of the draft model.
        compile: run decode steps as a compiled graph (`graph.py`): `True` compiles with Inductor
            (`torch.compile(fullgraph=True)`), a mode string picks the `torch.compile` mode, e.g.
            `"reduce-overhead"` to replay CUDA graphs on a GPU. Each step's decoding rows are padded to a batch
            bucket (1, 2, 4, 8, 16, 24, ... up to `max_seqs`); every bucket is compiled before the first decode
            step (`warm_up()`, a progress bar), and then only replayed. Prefill chunks and speculating rows run
            eagerly in the same step. Attention-only models (not hybrids); a fixed-size `pool` keeps the
            compiled step's tensors where they are.

    Speculative decoding: a request asking `prompt_lookup_num_tokens=k` (as `generate()` asks it), or any greedy
    request on an engine with a draft model, feeds its next token and `k` drafts into each step and keeps the
    drafts the model confirms, plus the model's own next token (`speculation.py`); its greedy output is the
    output without speculation. `stats()` counts drafted and accepted tokens.

    Example:
        >>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged")
        >>> engine = hf_paged.Engine(model, hf_paged.KVPool(model.config, max_memory=2**30))
        >>> for index, token, finished in engine.stream(prompts, max_new_tokens=32):
        ...     print(index, token, finished)
        >>> inputs = processor(images=image, text=text, return_tensors="pt")   # one prompt with its image
        >>> (tokens,) = engine.generate([inputs], max_new_tokens=32)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool | None = None,
        *,
        max_batch_tokens: int = 512,
        max_seqs: int = 64,
        tokenizer=None,
        salt: str | bytes | None = None,
        on_step: Callable[[Engine], None] | None = None,
        draft_model: torch.nn.Module | None = None,
        num_draft_tokens: int = 4,
        compile: bool | str = False,
    ) -> None:
        config = model.config
        if getattr(config, "is_encoder_decoder", False):
            raise UnsupportedModelError(
                f"Model type {model_type_of(config)} is an encoder-decoder model; the Engine packs decoder-only "
                "requests. Use model.generate(**inputs, **hf_paged.cache_kwargs(hf_paged.EncoderDecoderPagedCache("
                "model.config))) for it."
            )
        if getattr(config.get_text_config(decoder=True), "_attn_implementation", None) != "paged":
            raise ValueError(
                "Engine needs a model loaded with attn_implementation='paged' (it packs many requests into one "
                "forward and only the paged attention keeps them apart): "
                "AutoModelForCausalLM.from_pretrained(path, attn_implementation='paged'); for a vision-language model "
                "its language model's, e.g. attn_implementation={'text_config': 'paged', 'vision_config': 'sdpa', "
                "'': 'sdpa'}."
            )
        if reads_gathered(config):
            raise UnsupportedModelError(
                f"Model type {model_type_of(config)}: its attention changes the K/V the cache returns before attending "
                "them (multi-latent attention expands its latents), so a PagedCache hands it each row's gathered "
                "history, and the Engine, which packs many requests into one forward through the paged attention, "
                "cannot serve it. Use model.generate() with a hf_paged.PagedCache (or a KVPool's new_cache()) for it."
            )
        if attends_prefix_bidirectionally(config):
            raise UnsupportedModelError(
                f"Model type {model_type_of(config)} attends each prompt bidirectionally (one block), which the "
                "Engine's packed steps, causal by positions, do not reproduce. Use model.generate() with a "
                "hf_paged.PagedCache for it."
            )
        self.hybrid = is_hybrid(config)  # recurrent layers: batched steps, one request per row (rows_step.py)
        if self.hybrid and draft_model is not None:
            raise no_speculation(config, "create the Engine without draft_model")
        if "position_ids" not in inspect.signature(model.forward).parameters:
            raise UnsupportedModelError(
                f"Model type {model_type_of(config)}: its forward takes no position_ids, so tokens of several requests "
                "cannot be packed into one forward. Use model.generate() with a hf_paged.PagedCache (or a KVPool's "
                "new_cache()) for this model."
            )
        for name, value in (("max_batch_tokens", max_batch_tokens), ("max_seqs", max_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        self.model = model
        self.device = model.get_input_embeddings().weight.device  # where each step's ids and positions go
        self.pool = pool if pool is not None else KVPool(config)
        self.pool.bind_config(config)
        self.max_batch_tokens, self.max_seqs = max_batch_tokens, max_seqs
        self.tokenizer = tokenizer
        self.salt = salt
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.on_step = on_step
        self.vocab_size = getattr(config.get_text_config(decoder=True), "vocab_size", None)  # a VLM's: its text model's
        self.drafter = Drafter(draft_model, self.vocab_size, num_draft_tokens) if draft_model is not None else None
        self.graphs: DecodeGraphs | None = None
        if compile:
            check_compilable(model, self.pool, self.hybrid)
            mode = "default" if compile is True else compile
            self.graphs = DecodeGraphs(model, self.pool, max_seqs, mode, self.max_positions or DEFAULT_MAX_POSITIONS)
        self._lock = threading.Lock()  # guards the runs list and the counters (runs may overlap)
        self._runs: list[_Run] = []  # generate() / stream() calls in progress
        self._last_run: _Run | None = None
        self._live: _Run | None = None  # the incremental API's (submit/step/abort) scheduler
        self._submitted: dict[int, list[Request]] = {}  # request id -> its samples, until all finished
        self._failures: list[tuple[int, Exception]] = []  # submitted requests failed alone, not yet taken
        self._next_id = 0
        self._steps = self._generated = self._computed = self._preemptions = 0
        self._drafted = self._accepted = 0
        self._busy_s = 0.0

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int] | torch.Tensor | Mapping[str, torch.Tensor]],
        generation_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
        *,
        seed: int | Sequence[int] | None = None,
        progress: bool = True,
        top_logprobs: int | None = None,
        **kwargs: object,
    ) -> list[list[int]] | list[str] | list[Generated]:
        """Generates for every prompt; returns each request's generated token ids, or its generated text for
        text prompts, in input order (a prompt whose config asks `num_return_sequences=n` gives `n`
        consecutive outputs, as `generate()` does); with `top_logprobs`, a `Generated` per output instead.

        Args:
            prompts: token-id lists or 1-D tensors, or a multimodal model's processor output for one prompt
                (`{"input_ids": [1, prompt_len], "pixel_values": ..., ...}`, see the class docstring); or strings,
                with the engine's `tokenizer` (encoded as `tokenizer(text)` encodes them; the outputs are decoded,
                special tokens skipped). Strings are not mixed with the others.
            generation_config: one `GenerationConfig` for all, or one per prompt; default the model's.
            seed: sampling seed: an int (request i uses `seed + i`) or one per prompt; default 0.
            progress: show a tqdm bar of finished requests.
            top_logprobs: None for plain outputs; `k >= 0` gives each output's tokens with their log-probabilities
                and the `k` most likely alternatives, processed and raw, as `generate(output_scores=True,
                output_logits=True)` gives the scores (`TokenLogprobs`).
            kwargs: `GenerationConfig` fields applied to every request (`max_new_tokens=`, `do_sample=`...).

        Raises:
            ValueError, TypeError: bad ids, arrival times, or a config `generate()` would refuse or the Engine
                cannot honour; raised before any request runs.
            OutOfBlocksError: a request can never fit the fixed pool (before any request runs), or ran out of
                blocks alone; in the latter case the error's `outputs` holds every request's tokens.
            Exception: what a request's logits processors, sampling or stopping criteria raised (e.g. torch's
                error on probabilities that are not finite, as `generate()` raises it): that request failed alone,
                after the others finished; the error's `outputs` holds every request's tokens.
        """
        check_top_logprobs(top_logprobs)
        as_text = text.is_text(prompts)
        ids = text.encode(prompts, self.tokenizer) if as_text else prompts
        requests = self._prepare(ids, generation_config, seed, kwargs, top_logprobs)
        samples = {r.index: r for req in requests for r in (req, *req.followers)}  # output index -> request
        outputs: list[list[int]] = [[] for _ in samples]
        try:
            for index, token, _ in self._run(requests, None, progress):
                outputs[index].append(token)
        except Exception as error:  # (a request that failed alone: out of blocks, or its processors raised)
            error.outputs = outputs  # the other requests' output is not lost (token ids)
            raise
        texts = text.decode(outputs, self.tokenizer) if as_text else None
        if top_logprobs is None:
            return texts if as_text else outputs
        return [
            Generated(tokens, samples[index].logprobs, texts[index] if as_text else None)
            for index, tokens in enumerate(outputs)
        ]

    def stream(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int] | torch.Tensor | Mapping[str, torch.Tensor]],
        generation_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
        *,
        seed: int | Sequence[int] | None = None,
        progress: bool = False,
        arrival_s: Sequence[float] | None = None,
        **kwargs: object,
    ) -> Iterator[tuple[int, int, bool]] | Iterator[tuple[int, str, bool]]:
        """Like `generate()`, yielding `(output_index, token_id, finished)` as tokens are produced (the output
        index is the prompt's index unless some prompt asks for several `num_return_sequences`); for text
        prompts `(output_index, text_delta, finished)`, a delta being the text a token completed (may be empty).

        Every request is checked before the first step (ids, config, whether it can ever fit a fixed pool);
        a request that still runs out of blocks when it runs alone (e.g. other holders of a shared pool took
        them) fails alone: the others go on, and `OutOfBlocksError` is raised after the last of them.

        Args:
            arrival_s: per prompt, seconds (finite, >= 0) after the call at which it arrives (a request is not
                admitted before); default all at once. For latency measurements under an arrival process.
        """
        as_text = text.is_text(prompts)
        ids = text.encode(prompts, self.tokenizer) if as_text else prompts
        events = self._run(self._prepare(ids, generation_config, seed, kwargs), arrival_s, progress)
        return text.stream_text(events, self.tokenizer) if as_text else events

    def _prepare(self, prompts, generation_config, seed, kwargs, top_logprobs: int | None = None) -> list[Request]:
        """One request per prompt, with output row indices, its log-probability request and its samples attached."""
        requests = self._requests(prompts, generation_config, seed, kwargs)
        row = 0
        for req in requests:
            req.index, req.group, req.top_logprobs = row, row, top_logprobs
            row += len(attach_samples(req, req.config.num_return_sequences or 1))
        return requests

    def _run(
        self, requests: list[Request], arrival_s: Sequence[float] | None, progress: bool
    ) -> Iterator[tuple[int, int, bool]]:
        """Runs prepared requests to the end (see `stream()`), yielding `(output_index, token_id, finished)`."""
        if arrival_s is not None:
            arrival_s = arrival_times(arrival_s, len(requests))
            if tensor_parallel_group(self.model) is not None:
                raise ValueError(
                    "arrival_s admits requests by this process's clock, and the ranks of a tensor-parallel model "
                    "would admit them at other steps (their forwards must match). Under tensor parallelism, give "
                    "every rank its requests at once (no arrival_s)."
                )
        refuse_oversized(self.pool, requests)
        arrivals = sorted(range(len(requests)), key=lambda i: arrival_s[i]) if arrival_s is not None else []
        salt = self.pool.weights_salt(self.model, self.salt)  # prefixes of other weights are never served
        sched = Scheduler(self.pool, self.model.config, self.max_batch_tokens, self.max_seqs, salt)
        run = _Run(sched)
        with self._lock:
            self._runs.append(run)
        start = time.perf_counter()
        if arrival_s is None:
            sched.waiting.extend(requests)
            for req in requests:
                req.arrival_s = start
        bar = tqdm(total=sum(1 + len(r.followers) for r in requests), disable=not progress, unit="req", desc="hf_paged.Engine")
        try:
            while sched.has_work() or arrivals:
                now = time.perf_counter()
                while arrivals and start + arrival_s[arrivals[0]] <= now:
                    position = arrivals.pop(0)
                    req = requests[position]
                    req.arrival_s = start + arrival_s[position]
                    sched.waiting.append(req)
                if not sched.has_work():
                    time.sleep(max(0.0, start + arrival_s[arrivals[0]] - now))
                    continue
                events = self._step(sched)
                if self.on_step is not None:
                    self.on_step(self)
                for req, token, finished in events:
                    if finished:
                        run.finished += 1
                        bar.update(1)
                    yield req.index, token, finished
        finally:
            bar.close()
            sched.release_all()  # also when the consumer stopped early: every block goes back to the pool
            with self._lock:
                self._runs.remove(run)
                self._last_run = run
        failed = sched.take_failed()
        if failed:
            req, error = failed[0]
            why = "ran out of blocks" if all(isinstance(e, OutOfBlocksError) for _, e in failed) else "failed alone"
            error.add_note(
                f"Engine: requests {[r.index for r, _ in failed]} {why} (this error is the first's); the other "
                "requests of the run finished (Engine.generate() puts every request's tokens in its `outputs`)."
            )
            raise error

    # ------------------------------------------------------------------ incremental API (a server's loop)
    def submit(
        self,
        prompt: str | Sequence[int] | torch.Tensor | Mapping[str, torch.Tensor],
        generation_config: GenerationConfig | None = None,
        *,
        seed: int = 0,
        top_logprobs: int | None = None,
        logits_processor: Sequence[LogitsProcessor] = (),
        **kwargs: object,
    ) -> int:
        """Queues one request for `step()`; returns its id. Validates it first (the same errors as `generate()`).
        The incremental API has its own scheduler: do not run `generate()` / `stream()` on this engine meanwhile.

        Args:
            prompt: token ids `[prompt_len]`, a processor's output for one prompt with its images (as `generate()`
                takes it), or a string with the engine's `tokenizer` (`step()`'s events
                carry token ids: `tokenizer.decode()` them, or feed them to `engine.text.Detokenizer`).
            generation_config, kwargs: as `generate()`; `num_return_sequences=n` gives `n` samples sharing
                the prompt's blocks (see `samples.py`).
            seed: the request's sampling seed (sample `k` derives its own).
            top_logprobs: None for no log-probabilities; `k >= 0` records each token's log-probability and
                the `k` most likely alternatives (`TokenEvent.logprobs`).
            logits_processor: extra processors `(input_ids [1, seq], scores [1, vocab]) -> scores`, run on the
                raw logits before the config's own processors and warpers; each sample gets its own copy.
        """
        check_top_logprobs(top_logprobs)
        if isinstance(prompt, str):
            (prompt,) = text.encode([prompt], self.tokenizer)
        (req,) = self._requests([prompt], generation_config, [seed], kwargs)
        refuse_oversized(self.pool, [req])
        sched = self._live_scheduler()
        req.processors = LogitsProcessorList([*logits_processor, *req.processors])
        req.index = req.group = self._next_id
        req.top_logprobs = top_logprobs
        samples = attach_samples(req, req.config.num_return_sequences or 1)
        self._next_id += len(samples)
        req.arrival_s = time.perf_counter()
        sched.waiting.append(req)
        self._submitted[req.group] = samples
        return req.group

    def step(self) -> list[TokenEvent]:
        """Runs one step of the submitted requests (nothing when none is in flight); returns its tokens.
        Finished and aborted requests are forgotten (their blocks are already back in the pool)."""
        events = []
        if self._live is not None and self._live.scheduler.has_work():
            produced = self._step(self._live.scheduler)
            later = Counter(req for req, _, _ in produced)  # a speculating request may keep several tokens a step
            for req, token, finished in produced:
                later[req] -= 1
                logprobs = req.logprobs[-1 - later[req]] if req.top_logprobs is not None else None
                reason = req.finish_reason if finished else None
                cached = req.cached_tokens or 0
                events.append(TokenEvent(req.group, req.sample, token, finished, reason, logprobs, cached))
                self._live.finished += finished
            for req, error in self._live.scheduler.take_failed():  # ran out of blocks alone: see take_failures()
                self._submitted.pop(req.group, None)
                self._failures.append((req.group, error))
            if self.on_step is not None:
                self.on_step(self)
        for group in [g for g, samples in self._submitted.items() if all(r.state is State.FINISHED for r in samples)]:
            del self._submitted[group]
        return events

    def take_failures(self) -> list[tuple[int, Exception]]:
        """Submitted requests that failed alone since the last call, with their errors: out of blocks (other caches,
        engines or threads on the pool held them: `OutOfBlocksError`), or their logits processors, sampling or
        stopping criteria raised (e.g. probabilities that are not finite). The others went on. Their blocks are back
        in the pool and `step()` reports nothing more of them."""
        failures, self._failures = self._failures, []
        return failures

    def abort(self, request_id: int, sample: int | None = None) -> bool:
        """Drops a submitted request (all its samples, or only `sample` of them: a client that saw that sample's
        text reach a stop string) and frees its blocks at once; False if it is unknown or already finished. The
        samples it drops report nothing more (no finished event)."""
        samples = self._submitted.get(request_id)
        if samples is None:
            return False
        if sample is None:
            del self._submitted[request_id]
            self._live.scheduler.abort(samples)
            return True
        if not 0 <= sample < len(samples):
            raise IndexError(f"request {request_id} has {len(samples)} samples; there is no sample {sample}")
        if samples[sample].state is State.FINISHED:
            return False
        self._live.scheduler.abort([samples[sample]])
        if all(r.state is State.FINISHED for r in samples):
            del self._submitted[request_id]
        return True

    def has_work(self) -> bool:
        """Whether submitted requests are queued or running."""
        return self._live is not None and self._live.scheduler.has_work()

    def _live_scheduler(self) -> Scheduler:
        """The incremental API's scheduler, keyed by the model's current weights: made anew when they changed
        while it was idle; a change while requests are in flight is refused (their K/V are the old weights')."""
        salt = self.pool.weights_salt(self.model, self.salt)
        if self._live is not None and self._live.scheduler.salt != salt:
            if self._live.scheduler.has_work():
                raise ValueError(
                    "The model's weights changed while submitted requests were in flight; let them finish (step()) "
                    "or abort() them before submitting requests for the new weights."
                )
            self._live = None
        if self._live is None:
            sched = Scheduler(self.pool, self.model.config, self.max_batch_tokens, self.max_seqs, salt)
            with self._lock:
                self._live = _Run(sched)
        return self._live.scheduler

    def stats(self) -> EngineStats:
        """Queues of the runs in progress (summed: each `generate()` / `stream()` call is a run; when none is in
        progress, those of the last one; the incremental API's requests are one more), counters since creation,
        and the pool's statistics."""
        with self._lock:
            runs = list(self._runs) or ([self._last_run] if self._last_run is not None else [])
            if self._live is not None:  # the incremental API's requests count as a run of their own
                runs.append(self._live)
            pool_stats = self.pool.stats()
            return EngineStats(
                waiting=sum(len(r.scheduler.waiting) for r in runs),
                running=sum(len(r.scheduler.running) for r in runs),
                finished=sum(r.finished for r in runs),
                steps=self._steps,
                generated_tokens=self._generated,
                prompt_tokens_computed=self._computed,
                busy_s=self._busy_s,
                tokens_per_s=self._generated / self._busy_s if self._busy_s else 0.0,
                preemptions=self._preemptions,
                prefix_hit_tokens=pool_stats.prefix_hit_tokens,
                prefix_query_tokens=pool_stats.prefix_query_tokens,
                pool=pool_stats,
                runs=len(self._runs),
                drafted_tokens=self._drafted,
                accepted_tokens=self._accepted,
                acceptance_rate=self._accepted / self._drafted if self._drafted else 0.0,
            )

    # ------------------------------------------------------------------ internals
    def _requests(self, prompts, generation_config, seed, kwargs) -> list[Request]:
        if isinstance(prompts, torch.Tensor) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("Engine takes a list of prompts (token-id lists or 1-D tensors), not a single prompt.")
        configs = generation_config if isinstance(generation_config, Sequence) else [generation_config] * len(prompts)
        if len(configs) != len(prompts):
            raise ValueError(f"{len(configs)} generation configs for {len(prompts)} prompts; pass one, or one per prompt.")
        seeds = [(0 if seed is None else seed) + i for i in range(len(prompts))] if not isinstance(seed, Sequence) else list(seed)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts; pass an int, or one per prompt.")
        try:
            seeds = [operator.index(s) for s in seeds]
        except TypeError:
            seeds = []
        if len(seeds) != len(prompts) or not all(-(2**63) <= s < 2**64 for s in seeds):
            raise ValueError(f"seeds are whole numbers from -2**63 to 2**64 - 1 (torch.Generator's), got {seed!r}.")
        vocab, placeholders = self.vocab_size, placeholder_token_ids(self.model.config)
        requests = []
        for i, (prompt, config) in enumerate(zip(prompts, configs, strict=True)):
            ids, non_text = prompt_inputs(i, prompt, vocab, placeholders)
            if non_text:
                self._check_multimodal(i)
            setup = prepare_request(self.model, config, dict(kwargs), ids, self.tokenizer)
            if self.max_positions is not None and len(ids) + setup.max_new_tokens > self.max_positions:
                raise ValueError(
                    f"Prompt {i} has {len(ids)} tokens; with max_new_tokens={setup.max_new_tokens} it would reach past "
                    f"the model's {self.max_positions} positions (max_position_embeddings). Shorten the prompt or "
                    "max_new_tokens."
                )
            generator = torch.Generator().manual_seed(int(seeds[i])) if setup.config.do_sample else None
            req = Request(i, ids, setup.config, setup.max_new_tokens, setup.processors, generator, setup.stopping)
            req.speculation = setup.speculation
            if non_text:
                req.media = Media(
                    non_text, [p for p, t in enumerate(ids) if t in placeholders],
                    bidirectional=attends_images_bidirectionally(self.model.config),
                )
            if self.hybrid and req.speculation is not None:
                raise no_speculation(self.model.config, f"prompt {i} asks prompt_lookup_num_tokens: drop it")
            if self.drafter is not None and req.speculation is None:
                if setup.config.do_sample:
                    raise ValueError(
                        f"Prompt {i} samples (do_sample=True) but this Engine has a draft model, and speculation is "
                        "greedy only; serve sampling requests with an Engine without draft_model."
                    )
                req.speculation = Speculation(self.drafter.num_tokens, None)
            requests.append(req)
        return requests

    def _check_multimodal(self, i: int) -> None:
        """Refuses prompt `i`'s non-text inputs on an engine that cannot serve them, before anything runs."""
        why = None
        if self.hybrid and attends_images_bidirectionally(self.model.config):
            why = "the chunks of a hybrid model's batched steps may split an image whose tokens attend each other"
        elif self.drafter is not None:
            why = "its draft model would see the placeholders without the images"
        if why is not None:
            raise UnsupportedModelError(
                f"Prompt {i} comes with non-text inputs, which this Engine cannot serve: {why}. Run it with "
                "model.generate(**inputs, **hf_paged.cache_kwargs(pool.new_cache(**inputs, model=model)))."
            )

    def _step(self, sched: Scheduler) -> list[tuple[Request, int, bool]]:
        """Schedules and runs one forward; returns the tokens produced (none if it had to be retried)."""
        begin = time.perf_counter()
        preempted_before = sched.num_preemptions
        plan = sched.schedule()
        for req, n, _ in plan.chunks:  # the vision path of the chunks that reach images not encoded yet (media.py)
            if req.media is not None and req.media.needs_features(req.fed, req.fed + n):
                req.media.encode(self.model, req.prompt)
        speculating = [r for r in plan.decoding if r.width > 1]
        by_model = [r for r in speculating if r.speculation.max_ngram is None]
        drafts = self.drafter.draft(by_model) if by_model else {}
        for req in speculating:
            set_draft(req, drafts[req] if req in drafts else prompt_lookup_draft(req))
        if self.hybrid:
            logits, keep_rows = run_rows_step(self.model, self.device, sched, plan)
        else:
            logits, keep_rows = run_step(self.model, self.device, sched, plan, self.graphs)
        if logits is None:
            with self._lock:
                self._preemptions += sched.num_preemptions - preempted_before
            return []
        events: list[tuple[Request, int, bool]] = []
        finished: set[Request] = set()
        kept: dict[Request, int] = {}
        drafted = accepted = row = 0
        now = time.perf_counter()
        failed: list[tuple[Request, Exception]] = []
        for leader, width in keep_rows:
            rows, row = logits[row : row + width], row + width
            try:
                if width > 1:  # a speculating row: its accepted drafts and the model's next token
                    tokens = accept(leader, rows)
                    kept[leader] = len(tokens)
                    drafted += leader.num_drafted
                    accepted += sum(t == d for (t, _), d in zip(tokens, leader.draft[: leader.num_drafted]))
                    produced = [(leader, token, done) for token, done in tokens]
                else:  # a prompt's samples draw from the same logits (samples.py)
                    produced = []
                    for req in (leader, *leader.followers):
                        if req.dropped:  # aborted; its prefill carried the other samples
                            continue
                        token = req.choose(rows[0])
                        produced.append((req, token, req.add_token(token)))
                    kept[leader] = 1
            except Exception as error:  # its logits processors, sampling or stopping criteria raised: it fails alone
                kept.setdefault(leader, 1)
                finished.update((leader, *leader.followers))
                failed.append((leader, error))
                continue
            for req, token, done in produced:
                if req.first_token_s is None:
                    req.first_token_s = now
                if done:
                    req.finished_s = now
                    finished.add(req)
                events.append((req, token, done))
        sched.after_step(plan, finished, kept)
        for req, error in failed:
            sched.fail(req, error)
        with self._lock:  # counters are the engine's, summed over runs that may overlap
            self._steps += 1
            self._generated += len(events)
            self._computed += sum(n for _, n, _ in plan.chunks)
            self._preemptions += sched.num_preemptions - preempted_before
            self._drafted += drafted
            self._accepted += accepted
            self._busy_s += time.perf_counter() - begin
        return events
