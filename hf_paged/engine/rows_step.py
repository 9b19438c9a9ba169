"""One engine step of a hybrid model: a forward with a batch dimension, one request per row.

transformers' recurrent layers (Mamba, gated DeltaNet, short convolutions) run along each row of their
`[batch, seq]` input with that row's state, so the packed step (`packed.py`: all requests in one row) would carry
one request's state into the next. A hybrid model's step is instead one forward over one `PagedCache` whose rows
are the step's requests, each row's K/V in its block table and its recurrent states in its state slot
(`RowStates`, `StateSlots`)::

    decode step:   input_ids [num_rows, 1]           the scheduler's decoding cache, a row per decoding request
    prefill step:  input_ids [num_rows, chunk_len]   a chunk of the same length per prefilling request

No position is padded (a padded position would advance a row's recurrent state); rows differ in length only in
what their caches already hold, which the paged attention reads per row (`seq_lens`). A prefill step whose chunks
hold an image's placeholders feeds `inputs_embeds` `[num_rows, chunk_len, hidden]` instead of the ids: each row's
text embeddings with its placeholders' rows replaced by their features (`media.py`), as the packed step does.
`scheduler.py` chooses the rows (`Scheduler._fill_rows`): in a prefill step, all of them first chunks or all
continuing chunks, so the model's `has_previous_state` is true of every row or of none.

A prefilling request keeps its own one-row cache between steps. For a prefill step of several rows, the rows move
into one cache (`append_row_of`, then the request's cache lets go: the step's cache holds each block and slot
alone and writes in place) and move back into one-row caches after the forward, committed or rolled back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..cache.paged_cache import PagedCache
from ..cache.recurrent import NOT_CROPPABLE
from ..compat import cache_kwargs
from ..errors import OutOfBlocksError, UnsupportedModelError
from ..memory.layers import layout_from_config
from ..support import model_type_of
from .media import spliced_inputs
from .request import Request
from .scheduler import Scheduler, StepPlan


def is_hybrid(config: object) -> bool:
    """Whether the model has recurrent layers (a layout the pool refuses raises later, from the pool)."""
    try:
        return layout_from_config(config).is_hybrid
    except UnsupportedModelError:
        return False


def no_speculation(config: object, what_to_do: str) -> UnsupportedModelError:
    """The error for speculation (a draft model, prompt lookup) on a hybrid model: rejected drafts would have to be
    cropped, and recurrent states cannot step back (transformers' own message first, as `generate()` raises it)."""
    return UnsupportedModelError(
        f"{NOT_CROPPABLE}: model type {model_type_of(config)} keeps recurrent (state-space / linear-attention) "
        f"states, which cannot step back over rejected drafts, so the Engine does not speculate with it; {what_to_do}."
    )


def run_rows_step(
    model: torch.nn.Module, device: torch.device, sched: Scheduler, plan: StepPlan
) -> tuple[torch.Tensor | None, list[tuple[Request, int]]]:
    """One batched forward of a hybrid model (see the module docstring); as `packed.run_step`:
    `(logits [num_kept, vocab] float32, (request, 1) per kept row in order)`, or `(None, [])` when the pool ran
    short (a request was preempted; the step is retried)."""
    last_position = (getattr(sched.config, "max_position_embeddings", None) or 2**62) - 1
    if plan.decodes:
        ((cache, reqs),) = plan.decodes  # hybrids decode every row through one cache (`Scheduler._key`)
        ids = [[req.token_at(req.fed)] for req in reqs]
        positions = [[min(req.fed, last_position)] for req in reqs]
        keep = list(range(len(reqs)))
        keep_rows = [(req, 1) for req in reqs]
        try:
            logits = forward_rows(model, device, cache, ids, positions, keep)
        except OutOfBlocksError as error:
            sched.on_out_of_blocks(error)
            return None, []
        return logits, keep_rows
    reqs = [req for req, _, _ in plan.chunks]
    n = plan.chunks[0][1]
    ids = [req.tokens[req.fed : req.fed + n] for req in reqs]
    positions = [list(range(req.fed, req.fed + n)) for req in reqs]
    keep = [i for i, (_, _, last) in enumerate(plan.chunks) if last]
    keep_rows = [(reqs[i], 1) for i in keep]
    if any(req.media is not None and req.media.positions is not None for req in reqs):
        raise UnsupportedModelError(
            f"Model type {model_type_of(sched.config)}: its images take multimodal rotary positions, which the batched "
            "steps of a hybrid model do not feed. Run such a request with model.generate(**inputs, "
            "**hf_paged.cache_kwargs(pool.new_cache(**inputs, model=model)))."
        )
    media = [(row, req.media.rows(req.fed, req.fed + n)) for row, req in enumerate(reqs) if req.media is not None]
    media = [(row, rows) for row, rows in media if rows is not None]
    try:
        with _rows_of(sched, reqs) as cache:
            logits = forward_rows(model, device, cache, ids, positions, keep, media)
    except OutOfBlocksError as error:
        sched.on_out_of_blocks(error)  # (after the rows are back in their requests' caches)
        return None, []
    return logits, keep_rows


@contextmanager
def _rows_of(sched: Scheduler, reqs: list[Request]) -> Iterator[PagedCache]:
    """One cache holding the prefilling requests' rows (row i: `reqs[i]`) for a forward; afterwards each request
    has a one-row cache of its row again. A single request's own cache serves as is. First chunks (nothing stored
    yet, `fed == 0`) bring no row: the forward makes the step cache's rows."""
    if len(reqs) == 1:
        yield reqs[0].cache
        return
    step = sched.new_cache()
    moved = 0
    try:
        for req in reqs:
            if req.fed:
                step.append_row_of(req.cache, 0)
            req.cache.release()
            moved += 1
        yield step
    finally:
        for row, req in enumerate(reqs[:moved]):
            req.cache = sched.new_cache()
            if row < step.num_rows:  # (a first forward that raised before planning made no rows)
                req.cache.append_row_of(step, row)
        step.release()


def forward_rows(
    model: torch.nn.Module,
    device: torch.device,
    cache: PagedCache,
    ids: list[list[int]],
    positions: list[list[int]],
    keep: list[int],
    media: list[tuple[int, tuple[torch.Tensor, torch.Tensor]]] = (),
) -> torch.Tensor:
    """One forward of `ids` at `positions` (`[num_rows, seq_len]` each, row i a row of `cache`); returns the last
    position's logits of the rows `keep`, `[len(keep), vocab]` float32 on the CPU. The cache commits the forward,
    or rolls it back when it raised (`OutOfBlocksError` and the model's errors propagate).

    Args:
        media: `(row, (offsets [k], features [k, hidden]))` of the rows whose tokens hold placeholders
            (`Media.rows`): the forward is fed the ids' embeddings with those rows replaced.
    """
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)
    inputs: dict[str, torch.Tensor] = {"input_ids": input_ids}
    if media:
        inputs = spliced_inputs(model, input_ids, [(row, 0, rows) for row, rows in media])
    try:
        with torch.no_grad():
            out = model(
                **inputs,
                position_ids=torch.tensor(positions, dtype=torch.long, device=device),
                use_cache=True,
                logits_to_keep=1,
                **cache_kwargs(cache),
            )
    finally:
        cache.finish_forward()  # commits a complete forward, rolls back one that raised
    # (sampling runs per request on the host, as in `packed.py`: one copy of the kept rows' logits per step)
    return out.logits[keep, -1].float().cpu()
