"""`DecodeGraphs`: the engine's decode steps as a compiled graph (`Engine(compile=True)`).

A decode step of `n` requests is padded to the smallest batch bucket `B >= n` (`buckets()`); the step's block
tables, slots, lengths, token ids and positions are decided on the host first (`PagedCache.plan_graph_forward`,
allocations included) and copied into that bucket's static buffers, and then the forward runs as one graph
over them (`attention/graph_step.py`)::

    host (Python):  schedule -> plan_graph_forward per decoding cache -> fill bucket B's buffers in place
    graph:          model(input_ids [B, 1], position_ids [B, 1], paged_graph_step=GraphStep)  -> logits [B, vocab]
                    every layer: on CUDA, hf_paged::write_and_attend (the Triton kernels; a padding row's slot
                    is -1: it writes nowhere); on a CPU over an unquantized pool, the traced write and
                    attention of `graph_attention.py` over the step's (row, block) pairs (a padding row
                    repeats a real row's write); padding rows read nothing; a layer reusing an earlier
                    layer's K/V (Gemma 3n, Gemma 4) attends over that layer's pool tensors, writing nothing
    host (Python):  commit each cache's forward, sample

The graph is compiled with `fullgraph=True` (a graph break is an error, not a slow path), with the batch
dimension dynamic: on a CPU one graph serves every bucket above 1 and one the bucket of 1. On a CUDA device with
`mode="reduce-overhead"`, PyTorch records a CUDA graph per bucket and replays it. `warm_up()` runs every bucket
once with padding rows only, so that nothing compiles or records while requests are served.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from ..attention.graph_attention import StepBlocks
from ..attention.graph_step import GRAPH_STEP_KWARG, GraphStep
from ..errors import OutOfBlocksError, UnsupportedModelError
from ..memory.rotation import rotates
from ..support import model_type_of

if TYPE_CHECKING:
    from ..attention.plan import ForwardPlan
    from ..cache.kvpool import KVPool
    from ..cache.paged_cache import PagedCache
    from .request import Request

#: Positions a row may reach in a compiled step when the config names no `max_position_embeddings`.
DEFAULT_MAX_POSITIONS = 8192
#: Compile modes `Engine(compile=...)` takes: `True` is "default" (Inductor); "reduce-overhead" adds CUDA graphs.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
#: Operations past which Inductor computes an elementwise result into a buffer rather than inside its consumers
#: (`torch._inductor.config.realize_opcount_threshold`) in a CPU step whose attention is traced.
REALIZE_OPCOUNT_THRESHOLD = 10


def buckets(max_seqs: int) -> list[int]:
    """The batch sizes a decode step is padded to: 1, 2, 4, 8, then every multiple of 8, up to `max_seqs`."""
    sizes = [b for b in (1, 2, 4) if b < max_seqs] + list(range(8, max_seqs + 8, 8))
    return [b for b in sizes if b < max_seqs] + [max_seqs]


def check_compilable(model: torch.nn.Module, pool: KVPool, hybrid: bool) -> None:
    """Raises `UnsupportedModelError` / `ValueError` for what the compiled decode step cannot serve."""
    config = model.config
    if hybrid:
        raise UnsupportedModelError(
            f"Model type {model_type_of(config)}: Engine(compile=True) compiles the decode step of attention-only "
            "models; a hybrid model's recurrent layers keep their states in the pool's state slots, which the "
            "compiled step does not feed. Create the Engine without compile=True for this model."
        )
    if pool.layout.num_layers is None:
        raise ValueError("Engine(compile=True) needs a pool that knows the model's layers: KVPool(model.config, ...).")


class DecodeGraphs:
    """The compiled decode step of one engine and its buckets' static buffers.

    Args:
        model: the engine's model (`attn_implementation="paged"`).
        pool: the engine's pool (its layers' storage must exist before the first step: a prefill made it).
        max_seqs: the largest bucket.
        mode: `torch.compile` mode (`COMPILE_MODES`).
        max_positions: positions a row may reach (the block tables' width is `max_positions / block_size`).
    """

    def __init__(self, model: torch.nn.Module, pool: KVPool, max_seqs: int, mode: str, max_positions: int) -> None:
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}.")
        self.model, self.pool, self.mode = model, pool, mode
        self.device = model.get_input_embeddings().weight.device
        self.buckets = buckets(max_seqs)
        # per attending layer, the layer whose pool tensors it attends over: its own, or for a layer reusing an
        # earlier layer's K/V (`LayerLayout.readers`) that layer's
        self.kv_layers = [pool.layout.readers.get(i, i) for i in range(pool.layout.attending_layers)]
        self.max_blocks = -(-max_positions // pool.block_size)
        # On a CPU the layers' write and attention over an unquantized pool are traced into the graph
        # (`graph_attention.py`), which the compiler fuses; the op's PyTorch path would run eagerly in the graph.
        self.traces_attention = self.device.type != "cuda" and pool.kv_format is None
        self.warmed_up = False
        self._lock = threading.Lock()  # one step at a time uses the static buffers
        self._steps: dict[int, tuple[torch.Tensor, torch.Tensor, GraphStep]] = {}
        options = dict(torch._inductor.list_mode_options(mode))
        if self.traces_attention:
            # Inductor recomputes a cheap elementwise producer inside each consumer's loop unless it holds more
            # than this many operations. The rotated query (cos, sin, rotate-half) is read once per block slot of
            # every block its row reads: computed once into a buffer instead (by default only past 50 on a CPU).
            options["realize_opcount_threshold"] = REALIZE_OPCOUNT_THRESHOLD
        self._compiled = torch.compile(self._forward, fullgraph=True, options=options)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, step: GraphStep) -> torch.Tensor:
        """`[B, 1]` ids and positions -> float32 logits `[B, vocab]` (the compiled function)."""
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **{GRAPH_STEP_KWARG: step})
        return out.logits[:, -1].float()

    # ------------------------------------------------------------------ buffers
    def _buffers(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, GraphStep]:
        """The static input buffers of a bucket, made once (all rows padding)."""
        found = self._steps.get(bucket)
        if found is not None:
            return found
        layout, pool, device = self.pool.layout, self.pool, self.device
        storage = [pool.layer_storage(i) for i in self.kv_layers]
        if any(s is None for s in storage):
            raise RuntimeError("the compiled decode step runs after a prefill stored every layer's K/V")
        scales = [pool.scales(i) for i in self.kv_layers]
        ints = dict(dtype=torch.int32, device=device)
        step = GraphStep(
            key_caches=[s[0] for s in storage],
            value_caches=[s[1] for s in storage],
            key_scales=[None if s is None else s[0] for s in scales],
            value_scales=[None if s is None else s[1] for s in scales],
            layer_groups=[layout.group_of(i) for i in self.kv_layers],
            slot_mappings=[torch.full((bucket, 1), -1, dtype=torch.int64, device=device) for _ in layout.groups],
            block_tables=[torch.full((bucket, self.max_blocks), -1, **ints) for _ in layout.groups],
            seq_lens=torch.zeros(bucket, **ints),
            windows=[group.sliding_window for group in layout.groups],
            blocks=self._warm_up_blocks(bucket) if self.traces_attention else None,
            rotate=rotates(pool.kv_format),
            readers=frozenset(layout.readers),
        )
        ids = torch.zeros((bucket, 1), dtype=torch.long, device=device)
        positions = torch.zeros((bucket, 1), dtype=torch.long, device=device)
        if bucket > 1:  # one graph for every bucket above 1 (a size-1 dimension is specialized by the compiler)
            for tensor in (ids, positions, step.seq_lens, *step.slot_mappings, *step.block_tables):
                torch._dynamo.mark_dynamic(tensor, 0)
        for tensor in (*step.key_caches, *step.value_caches, *(s for s in step.key_scales + step.value_scales if s is not None)):
            if device.type == "cuda":  # CUDA graphs write the pool in place: its tensors must keep their address
                torch._dynamo.mark_static_address(tensor)
            else:  # (a growing pool's tensors grow: no recompile when they do)
                torch._dynamo.mark_dynamic(tensor, 0)
        self._steps[bucket] = ids, positions, step
        return ids, positions, step

    def _warm_up_blocks(self, bucket: int) -> list[StepBlocks]:
        """Placeholder pairs of a bucket's first (warm-up) call: one pair of padding row 0, which reads nothing
        (its length is 0)."""
        def pairs() -> StepBlocks:
            zeros = torch.zeros(1, dtype=torch.int64, device=self.device)
            blocks = StepBlocks(zeros, zeros.clone(), zeros.clone(), torch.zeros(bucket, dtype=torch.int64, device=self.device))
            blocks.mark_dynamic()
            if bucket > 1:  # (the batch dimension, as the bucket's other inputs')
                torch._dynamo.mark_dynamic(blocks.write_rows, 0)
            return blocks

        return [pairs() for _ in self.pool.layout.groups]

    def fits(self, cache: PagedCache) -> bool:
        """Whether every row of `cache` can take its next token within the compiled step's block tables."""
        return max(cache.seq_lens, default=0) < self.max_blocks * self.pool.block_size

    def bucket_for(self, num_rows: int) -> int:
        """The smallest bucket holding `num_rows` rows."""
        return next(b for b in self.buckets if b >= num_rows)

    # ------------------------------------------------------------------ running
    def warm_up(self, plans: list[ForwardPlan]) -> None:
        """Compiles (and on CUDA with "reduce-overhead", records) every bucket with padding rows only, before the
        step of `plans` runs. A bucket whose layers attend as traced operations writes its padding rows into the
        slot that this step's first writing row then overwrites (a traced write has no slot -1 to skip)."""
        if self.warmed_up:
            return
        # The compiler's recompile limits count the graphs of one code object, which every engine's `_forward`
        # shares: an engine's graphs would count against the next engine's. Warm-up calls each bucket a fixed
        # number of times, so it cannot recompile without end; after it, nothing compiles.
        limits = dict(recompile_limit=sys.maxsize, accumulated_recompile_limit=sys.maxsize)
        with self._lock, torch.no_grad(), torch._dynamo.config.patch(**limits):
            for bucket in tqdm(self.buckets, desc="hf_paged.Engine: compiling decode buckets", unit="bucket"):
                ids, positions, step = self._buffers(bucket)
                if step.blocks is not None:
                    for g, slot_mapping in enumerate(step.slot_mappings):
                        slot_mapping.fill_(next(s for s in _slots(plans, g) if s >= 0))
                for _ in range(3 if self.mode == "reduce-overhead" else 1):  # (CUDA graphs record on a later call)
                    self._compiled(ids, positions, step)
        self.warmed_up = True

    def plan(self, decodes: Sequence[tuple[PagedCache, list[Request]]]) -> list[ForwardPlan]:
        """Plans the decode step of every cache of `decodes` (one token per row): allocations, tables, slots.
        A cache that cannot get its blocks rolls every plan back and raises `OutOfBlocksError`."""
        plans: list[ForwardPlan] = []
        try:
            for cache, _ in decodes:
                plans.append(cache.plan_graph_forward(1))
        except OutOfBlocksError:
            self.abandon(decodes[: len(plans)])
            raise
        return plans

    @staticmethod
    def abandon(decodes: Sequence[tuple[PagedCache, list[Request]]]) -> None:
        """Rolls back the planned forwards of `decodes` (the step did not run)."""
        for cache, _ in decodes:
            cache.finish_graph_forward(False)

    def run(self, decodes: Sequence[tuple[PagedCache, list[Request]]], plans: list[ForwardPlan]) -> torch.Tensor:
        """Runs the planned decode step of `decodes` (each request's next token, in order) and commits every
        cache's forward (rolls them back if it raised): float32 logits `[n, vocab]` on the CPU."""
        self.warm_up(plans)
        ran = False
        try:
            with self._lock:
                logits = self._run_planned(decodes, plans)
            ran = True
        finally:
            for cache, _ in decodes:
                cache.finish_graph_forward(ran)
        return logits

    def _run_planned(self, decodes: Sequence[tuple[PagedCache, list[Request]]], plans: list[ForwardPlan]) -> torch.Tensor:
        ids_host: list[int] = []
        positions_host: list[int] = []
        for _, reqs in decodes:
            for req in reqs:
                ids_host.append(req.token_at(req.fed))
                positions_host.append(req.position(req.fed))
        num_rows = len(ids_host)
        bucket = self.bucket_for(num_rows)
        ids, positions, step = self._buffers(bucket)
        self._follow_storage(step)
        num_groups = len(step.block_tables)
        seq_lens = [n for plan in plans for n in plan.seq_lens]
        tables = [[t for plan in plans for t in plan.groups[g].tables] for g in range(num_groups)]
        width = max(len(t) for group in tables for t in group)
        if width > self.max_blocks:
            raise ValueError(f"a row holds {width} blocks, more than the compiled step's {self.max_blocks}.")
        pad = bucket - num_rows
        ids.copy_(_column(ids_host + [0] * pad))
        positions.copy_(_column(positions_host + [0] * pad))
        host = dict(device="cpu")  # (host tensors, copied into the step's buffers)
        step.seq_lens.copy_(torch.tensor(seq_lens + [0] * pad, dtype=torch.int32, **host))
        lens = torch.tensor(seq_lens, dtype=torch.int64, **host)
        for g in range(num_groups):
            slots = _slots(plans, g) + [-1] * pad
            padded = [t + [-1] * (width - len(t)) for t in tables[g]]
            if step.blocks is None:
                step.slot_mappings[g].copy_(_column(slots))
                step.block_tables[g][:num_rows, :width].copy_(torch.tensor(padded, dtype=torch.int32, **host))
                continue
            writer = next(row for row, slot in enumerate(slots) if slot >= 0)
            sources = [row if slot >= 0 else writer for row, slot in enumerate(slots)]
            step.slot_mappings[g].copy_(_column([slots[row] for row in sources]))
            blocks = StepBlocks.from_tables(
                torch.tensor(padded, dtype=torch.int64, **host), lens, self.pool.block_size, step.windows[g],
                torch.tensor(sources, dtype=torch.int64, **host),
            )
            blocks.mark_dynamic()
            step.blocks[g] = blocks
        # After warm-up every call finds its graph; like vLLM, the step does not re-check the compiler's guards
        # on each call, only those that tell its graphs apart (the bucket of 1 from the others).
        with torch.no_grad(), torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            logits = self._compiled(ids, positions, step)
        return logits[:num_rows].cpu()

    def _follow_storage(self, step: GraphStep) -> None:
        """Points the step at the pool's current tensors, grown to hold every allocated block (a growing pool
        replaces its tensors when it grows)."""
        self.pool.grow_storage()
        for layer, kv_layer in enumerate(self.kv_layers):
            key_cache, value_cache = self.pool.layer_storage(kv_layer)
            if key_cache is not step.key_caches[layer]:
                step.key_caches[layer], step.value_caches[layer] = key_cache, value_cache
                scales = self.pool.scales(kv_layer)
                if scales is not None:
                    step.key_scales[layer], step.value_scales[layer] = scales


def _slots(plans: list[ForwardPlan], group: int) -> list[int]:
    """The new tokens' slots of a group, one per row of every plan in order (-1 where a row writes nothing)."""
    slots: list[int] = []
    for plan in plans:
        row_slots = [-1] * len(plan.seq_lens)
        for row, slot in zip(plan.groups[group].write_rows, plan.groups[group].write_slots, strict=True):
            row_slots[row] = slot
        slots.extend(row_slots)
    return slots


def _column(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device="cpu").view(-1, 1)
