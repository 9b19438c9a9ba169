"""A `PagedCache` forward under a compiled model: its Python runs outside the compiled graph.

A `PagedCache` forward decides in Python, layer by layer, what to allocate and where to write (`Forwards.open`
on the first layer, the thread's hand-off slots between `update()` and the attention). Under a model compiled by
the user (`model.compile()`, `model.forward = torch.compile(model.forward)`), those calls run eagerly in graph
breaks: `PagedCache.update()`, the recurrent-state calls of hybrid models and the
`"paged"` attention over a `PagedCache` each enter `run_outside_graph` while torch.compile traces them, so the
compiler never traces (nor guards on) the cache's bookkeeping, and the tokens are those of an uncompiled run.
The rest of each layer (projections, rotary embedding, MLP) stays in the compiled graphs between the breaks, as
far as torch's recompile limit lets it (past the limit, torch runs a function's frame eagerly).

The first such call of the process warns once (`FALLBACK_WARNING`). The compiled decode step of
`hf_paged.Engine(model, compile=True)` does not come here: it runs the model without a cache, and its attention
writes and reads the pool through the custom ops (`graph_step.py`, `ops.py`) inside one graph.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

FALLBACK_WARNING = (
    "hf_paged.PagedCache under torch.compile: the cache's update() and the 'paged' attention over it run eagerly, "
    "in graph breaks around each layer's cache write and attention, so the compiled model gains little (torch may "
    "also report hitting its recompile limit and run more of it eagerly); the tokens are those of an uncompiled "
    "run. For a compiled paged decode step, use hf_paged.Engine(model, compile=True)."
)

_warned = False


@torch.compiler.disable
def run_outside_graph(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """`fn(*args, **kwargs)`, run eagerly: called from code that torch.compile traces, it is a graph break, and
    `fn` (and all it calls) runs uncompiled, with `torch.compiler.is_compiling()` False. The first call of the
    process warns (`FALLBACK_WARNING`).

    Callers call it only while compiling, from the top of the function it runs again:

        >>> def update(self, key, value, layer_idx):
        ...     if torch.compiler.is_compiling():
        ...         return run_outside_graph(PagedCache.update, self, key, value, layer_idx)
        ...     ...  # the eager body
    """
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(FALLBACK_WARNING, UserWarning, stacklevel=3)
    return fn(*args, **kwargs)


__all__ = ["FALLBACK_WARNING", "run_outside_graph"]
