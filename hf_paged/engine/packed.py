"""One engine step: a single forward over a packed, unpadded set of tokens from many requests.

The model sees `input_ids [1, N]` and `position_ids [1, N]` (each token's position in its own request)
and this `PackedCache`. Its `update()` stages the step's K/V for the `"paged"` attention function, which
hands them to `PackedCache.attend()`; that splits the N tokens into segments and attends each through the
`PagedCache` that owns its rows::

    tokens:  d0 d1 d2 | d3 d4 | p p p p p p p p | q q q       N = 16
             decode rows   decode rows  prefill chunk     prefill chunk
             <= 64 tokens  65-128       of request 7      of request 9
             (a cache,     (a cache,    (its own cache)   (its own cache)
              3 rows x 1)   2 rows x 1)

Decode tokens form one segment of `rows x 1` per length class (a `PagedCache` with one row per decoding
request of that class, see `scheduler.py`), each prefill chunk a segment of its own, so no padding is
computed outside a segment and no token ever sees another request's keys. The mask function gets
`(kv_length, kv_offset) = (N, 0)`, keys ending at the queries: the `"paged"` mask function then builds no mask at all (causality comes from each
segment's positions), and transformers' packed-sequence detection only runs without a cache. A prefill chunk whose
image's tokens attend each other both ways (Gemma 3, Gemma 4: `media.py`, `Media.chunk_mask`) holds whole images and
attends under its own mask instead, over its request's K/V read back from the blocks (`attend_under_mask`), as
`generate()` attends such a prompt under the model's mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache

from ..attention import handoff
from ..attention.paged import attend_under_mask
from ..cache.paged_cache import PagedCache
from ..compat import cache_kwargs
from ..errors import OutOfBlocksError, UnsupportedModelError
from ..support import future_mask_error
from .media import Media, spliced_inputs
from .request import Request
from .scheduler import Scheduler, StepPlan

if TYPE_CHECKING:
    from ..attention.plan import AttentionFeatures
    from .graph import DecodeGraphs


@dataclass(slots=True)
class Segment:
    """Consecutive packed tokens attended through one cache.

    Attributes:
        cache: the `PagedCache` holding the segment's rows.
        start: first packed token.
        rows: rows of `cache` the segment feeds (all of them), each `tokens_per_row` tokens, row-major.
        tokens_per_row: new tokens per row.
        media: a prefill chunk's request's non-text inputs (their runs of placeholders), or None.
        fed: a prefill chunk's first token in its request.
    """

    cache: PagedCache
    start: int
    rows: int
    tokens_per_row: int
    media: Media | None = None
    fed: int = 0
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    @property
    def stop(self) -> int:
        return self.start + self.rows * self.tokens_per_row

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """A prefill chunk's bool `[1, 1, tokens_per_row, fed + tokens_per_row]` mask for layers of sliding window
        `window` where its image's tokens attend each other both ways (`Media.chunk_mask`), else None (causal by
        positions); made once per window and forward."""
        if self.media is None:
            return None
        if window not in self._masks:
            mask = self.media.chunk_mask(self.fed, self.fed + self.tokens_per_row, window)
            self._masks[window] = None if mask is None else mask.to(device)
        return self._masks[window]


class PackedCache(Cache):
    """The cache object of one packed forward (see the module docstring); used once and dropped.

    Args:
        segments: in packed order, covering tokens `0 .. N` without gaps.
    """

    #: As `PagedCache.causal_writers_only`: a packed step serves decoder-only models, so a non-causal module's K/V
    #: are refused and no cross-attention follows a layer's attention.
    causal_writers_only = False

    def __init__(self, segments: list[Segment]) -> None:
        super().__init__(layers=[])
        self.segments = segments
        self.layers_attended: set[int] = set()
        # the packed K/V of layers whose K/V later layers reuse (`LayerLayout.readers`), kept for those layers' masked
        # segments: decided once per step, for a step with a prefill chunk of a request with images
        masked = any(seg.media is not None for seg in segments)
        self._keep_for = set(segments[0].cache.pool.layout.readers.values()) if masked else set()
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ what the model calls
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stages `[1, num_kv_heads, N, head_dim]` K/V of a layer for the `"paged"` attention; returns them."""
        handoff.stage(self, layer_idx, key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """Keys end at the queries, so the `"paged"` mask function builds no `[N, N]` mask."""
        return query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    # ------------------------------------------------------------------ what the attention function calls
    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        attention_mask: torch.Tensor | None,
        features: AttentionFeatures,
        want_weights: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """Writes and attends each segment through its cache.

        Args:
            query: `[1, num_heads, N, head_dim]`; key, value: `[1, num_kv_heads, N, head_dim]`.
            want_weights: must be False (the engine returns no attention weights).

        Returns:
            `([1, N, num_heads, head_dim], None)`.
        """

        if layer_idx in self._keep_for:
            self._kept[layer_idx] = key, value

        def attend(seg: Segment) -> torch.Tensor:
            q, k, v = (_rows_of(t, seg) for t in (query, key, value))
            mask = seg.mask(features.sliding_window, query.device)
            if mask is not None:
                return attend_under_mask(
                    seg.cache, module, q, k, v, (layer_idx, layer_idx), mask, features, True, False, None
                )[0]
            return seg.cache.attend(module, q, k, v, layer_idx, None, features)[0]

        return self._per_segment(query, layer_idx, want_weights, attend), None

    def write_and_read(
        self, module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kv_layer: int,
        attention_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Refuses a packed forward that transformers' own 4D mask must decide (`PagedCache.write_and_read`): its
        segments attend causally by positions, apart from the image runs it masks itself (`Segment.mask`)."""
        raise future_mask_error(getattr(module, "config", None))

    def attend_reused(
        self,
        query: torch.Tensor,
        source_layer: int,
        layer_idx: int,
        attention_mask: torch.Tensor | None,
        features: AttentionFeatures,
        want_weights: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """Attends a layer that reuses the K/V of `source_layer` (`LayerLayout.readers`) over each segment's blocks:
        `query` `[1, num_heads, N, head_dim]` -> `([1, N, num_heads, head_dim], None)`."""

        def attend(seg: Segment) -> torch.Tensor:
            q = _rows_of(query, seg)
            mask = seg.mask(features.sliding_window, query.device)
            if mask is not None:
                k, v = (_rows_of(t, seg) for t in self._kept[source_layer])
                return attend_under_mask(
                    seg.cache, None, q, k, v, (layer_idx, source_layer), mask, features, True, False, None
                )[0]
            return seg.cache.attend_reused(q, source_layer, layer_idx, None, features)[0]

        return self._per_segment(query, layer_idx, want_weights, attend), None

    def _per_segment(
        self, query: torch.Tensor, layer_idx: int, want_weights: bool, attend: Callable[[Segment], torch.Tensor]
    ) -> torch.Tensor:
        """`[1, N, num_heads, head_dim_v]`: each segment's output `attend(seg)` (`[rows, tokens_per_row, num_heads,
        head_dim_v]`), in packed order; records that `layer_idx` attended."""
        if want_weights:
            raise ValueError("The engine does not return attention weights; use model.generate(output_attentions=True).")
        if query.shape[0] != 1:
            raise RuntimeError("a packed engine step has batch 1; the model changed the batch dimension.")
        outs = []
        for seg in self.segments:
            out = attend(seg)
            outs.append(out.reshape(1, seg.rows * seg.tokens_per_row, *out.shape[2:]))
        self.layers_attended.add(layer_idx)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def attention_still_open(self, layer_idx: int) -> bool:
        return False

    def check_model_attended(self, expected_layers: int | None) -> None:
        """Raises `UnsupportedModelError` when some layer did not attend through `"paged"` (a model that
        computes attention itself cannot be packed: its layers would mix requests)."""
        if expected_layers is not None and len(self.layers_attended) != expected_layers:
            raise UnsupportedModelError(
                f"Only {len(self.layers_attended)} of {expected_layers} cached layers attended through "
                "attn_implementation='paged'; the engine packs many requests into one forward, which needs every "
                "layer's attention to go through it. Use model.generate() with a hf_paged.PagedCache for this model."
            )


def _rows_of(tensor: torch.Tensor, seg: Segment) -> torch.Tensor:
    """`[1, heads, N, head_dim]` -> the segment's `[rows, heads, tokens_per_row, head_dim]`."""
    part = tensor[0, :, seg.start : seg.stop]
    if seg.rows == 1:
        return part.unsqueeze(0)
    heads, _, head_dim = part.shape
    return part.reshape(heads, seg.rows, seg.tokens_per_row, head_dim).transpose(0, 1).contiguous()


def run_step(
    model: torch.nn.Module, device: torch.device, sched: Scheduler, plan: StepPlan, graphs: DecodeGraphs | None = None
) -> tuple[torch.Tensor | None, list[tuple[Request, int]]]:
    """One packed forward; `(logits [num_kept, vocab] float32, (request, its consecutive kept rows) in order)`,
    or `(None, [])` when the pool ran short (a request was preempted; the step is retried).

    A decoding row feeds the request's next token and its `draft` (`width` tokens, all kept); a prefill chunk
    keeps its last token when it ends the prefill. With `graphs` (`Engine(compile=True)`), the decoding rows of
    one token run first as the compiled decode step (`graph.py`), as many as its largest bucket holds, and the rest
    (prefill chunks, speculating rows, decoding rows past that bucket) as a packed forward after it; the graph's plans are made before either runs, and rolled back if the packed
    forward runs out of blocks.
    """
    graph_decodes: list[tuple[PagedCache, list[Request]]] = []
    if graphs is not None:
        room = graphs.buckets[-1]  # (a request's samples are rows of their own: rows may outnumber max_seqs)
        for c, r in plan.decodes:
            if r[0].width == 1 and len(r) <= room and graphs.fits(c) and all(q.one_position_after_prompt for q in r):
                graph_decodes.append((c, r))
                room -= len(r)
        if graph_decodes:
            in_graph = {id(c) for c, _ in graph_decodes}
            plan = StepPlan([(c, r) for c, r in plan.decodes if id(c) not in in_graph], plan.chunks)
    try:
        graph_plans = graphs.plan(graph_decodes) if graph_decodes else []
    except OutOfBlocksError as error:
        sched.on_out_of_blocks(error)
        return None, []
    ids: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    images: list[tuple[int, Request, int]] = []  # (first packed token, request, its first token) of chunks with media
    rotary: list[tuple[int, Request, int]] = []  # the same for decoding rows whose rotary dimensions differ
    keep: list[int] = []
    keep_rows: list[tuple[Request, int]] = [(req, 1) for _, reqs in graph_decodes for req in reqs]
    last_position = (getattr(sched.config, "max_position_embeddings", None) or 2**62) - 1
    for cache, reqs in plan.decodes:
        width = reqs[0].width
        segments.append(Segment(cache, len(ids), len(reqs), width))
        keep.extend(range(len(ids), len(ids) + len(reqs) * width))
        for req in reqs:
            keep_rows.append((req, width))
            if not req.one_position_after_prompt:
                rotary.append((len(ids), req, width))
            ids.append(req.token_at(req.fed))
            ids.extend(req.draft if width > 1 else ())
            # (only pads past max_new_tokens can reach beyond the model's positions; nothing reads them)
            positions.extend(min(req.position(p), last_position) for p in range(req.fed, req.fed + width))
    for req, n, last in plan.chunks:
        segments.append(Segment(req.cache, len(ids), 1, n, req.media, req.fed))
        if req.media is not None:
            images.append((len(ids), req, n))
        ids.extend(req.tokens[req.fed : req.fed + n])
        positions.extend(req.position(p) for p in range(req.fed, req.fed + n))
        if last:
            keep.append(len(ids) - 1)
            keep_rows.append((req, 1))
    packed_logits = None
    if segments:
        try:
            inputs = step_inputs(model, device, ids, positions, images, rotary)
            packed_logits = forward_packed(model, inputs, segments, keep, sched.pool.layout.attending_layers)
        except BaseException as error:
            if graph_decodes:
                graphs.abandon(graph_decodes)
            if isinstance(error, OutOfBlocksError):
                sched.on_out_of_blocks(error)
                return None, []
            raise
    if not graph_decodes:
        return packed_logits, keep_rows
    graph_logits = graphs.run(graph_decodes, graph_plans)
    return (graph_logits if packed_logits is None else torch.cat([graph_logits, packed_logits])), keep_rows


def step_inputs(
    model: torch.nn.Module,
    device: torch.device,
    ids: list[int],
    positions: list[int],
    images: list[tuple[int, Request, int]],
    rotary: list[tuple[int, Request, int]] = (),
) -> dict[str, torch.Tensor]:
    """The model inputs of a packed step of `N` tokens: `input_ids` `[1, N]` and `position_ids` `[1, N]`; when some
    prefill chunk holds placeholders, `inputs_embeds` `[1, N, hidden]` instead of the ids (the text embeddings, the
    placeholders' rows replaced by their features, `media.py`), with the ids' `per_layer_inputs` for a model that
    takes them (Gemma 4, `media.spliced_inputs`), and when a chunk's request has multimodal rotary positions, or a
    decoding row's rotary dimensions differ, `position_ids` `[3, 1, N]`.

    Args:
        ids, positions: the packed tokens and their positions (where the rotary dimensions agree).
        images: `(first packed token, request, num_tokens)` of the chunks of requests with media, fed from `req.fed`.
        rotary: the same for decoding rows whose positions differ between rotary dimensions
            (`Media.rows_agree_after_prompt` is False).
    """
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    spliced = [(start, req.media.rows(req.fed, req.fed + n)) for start, req, n in images]
    spliced = [(start, rows) for start, rows in spliced if rows is not None]
    inputs: dict[str, torch.Tensor] = {"input_ids": input_ids}
    if spliced:
        inputs = spliced_inputs(model, input_ids, [(0, start, rows) for start, rows in spliced])
    rope = [(start, req, n) for start, req, n in images if req.media.positions is not None] + list(rotary)
    if not rope:
        return {**inputs, "position_ids": torch.tensor([positions], dtype=torch.long, device=device)}
    position_ids = torch.tensor([positions], dtype=torch.long, device="cpu").expand(3, -1).clone()
    for start, req, n in rope:
        position_ids[:, start : start + n] = req.media.rope_positions(req.fed, req.fed + n)
    return {**inputs, "position_ids": position_ids[:, None].to(device)}


def forward_packed(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    segments: list[Segment],
    keep: list[int],
    num_layers: int | None,
) -> torch.Tensor:
    """One forward over the packed tokens of `inputs` (`step_inputs`: ids or embeddings, and positions, `N` each),
    attended per segment through its cache; returns the logits of the `keep` positions, `[len(keep), vocab]` float32
    on the CPU. Every segment's cache commits the forward, or rolls it back when it raised (`OutOfBlocksError` and the
    model's errors propagate)."""
    packed = PackedCache(segments)
    caches = [seg.cache for seg in segments]
    device = inputs["position_ids"].device
    try:
        with torch.no_grad():
            out = model(
                **inputs,
                use_cache=True,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
                **cache_kwargs(packed),
            )
        packed.check_model_attended(num_layers)
    except BaseException as error:
        for cache in caches:
            cache.finish_forward()  # rolls the incomplete forward back
        if isinstance(error, UnsupportedModelError):
            error.add_note(
                "hf_paged.Engine packs many requests into one forward, which needs every layer's attention to "
                "go through attn_implementation='paged' with the K/V the cache returned; serve this model with "
                "model.generate() and a hf_paged.PagedCache instead."
            )
        raise
    for cache in caches:
        cache.finish_forward()  # every layer wrote: commit
    # Sampling runs per request on the host (CPU processors and generators, so a seed gives the same
    # tokens on any device): one copy of the kept rows' logits per step.
    return out.logits[0].float().cpu()
