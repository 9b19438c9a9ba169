"""What the launchers share: one kernel launch as data, and the device it runs on."""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch


def device_context(tensor: torch.Tensor):
    """Launch on the tensor's device, not on whichever CUDA device is current."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def tensor_layout(tensor: torch.Tensor | None) -> tuple | None:
    """What a launch depends on of a tensor besides its memory: shape, strides, dtype, device (None for None; for
    anything else that is not a tensor, its type, which matches no kept launch, so the input checks name it)."""
    if tensor is None:
        return None
    if not isinstance(tensor, torch.Tensor):
        return (type(tensor),)
    return tensor.shape, tensor.stride(), tensor.dtype, tensor.device


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the JIT function, its grid and keyword arguments (incl. num_warps).

    Launchers build these from their inputs; `aot.py` builds them from representative tensors on the
    meta device and compiles them through Triton's binder, i.e. with the JIT's specializations."""

    kernel: object
    grid: tuple[int, ...]
    kwargs: dict

    def __call__(self) -> None:
        self.kernel[self.grid](**self.kwargs)


class Repeatable:
    """The launches of one kernel call, kept to be repeated by later calls whose inputs have the same layouts
    (the layers of a forward, and later forwards while their tables keep their shape).

    Built from the first call's launches and its tensors: each argument that is one of those tensors (found by
    identity) is rebound to the later call's tensor of the same position; everything else (grids, compile-time
    constants, strides, dummies, scratch buffers) is reused as it is. A later call asks `matches` first: the
    same scalars and, input by input, the same layout (`tensor_layout`) mean the same launches but for the
    tensors. An input that is a tensor this position already matched with (the same object: a pool tensor of
    another layer, the step's tables) is taken at the layout it had then: callers do not change a tensor's
    shape or strides in place (`resize_`, `set_`) between calls.

    Attributes:
        complete: every tensor was found among the launches' arguments, and none twice over (a launcher that
            copies an input, or one tensor passed for two inputs, cannot be rebound): only then may it be kept.
    """

    #: Tensors remembered per input position before the memory of them starts over.
    MAX_KNOWN = 64

    def __init__(
        self,
        inputs: tuple[torch.Tensor | None, ...],
        scalars: tuple,
        launches: list[Launch],
        tensors: tuple[torch.Tensor | None, ...],
    ) -> None:
        """`inputs`: the call's tensor inputs as given (what `matches` compares); `scalars`: every other value
        the launches depend on; `tensors`: what the launches take, by position (`run`): the inputs, plus what
        the call made for itself (e.g. the output it allocated)."""
        self._layouts = tuple(tensor_layout(t) for t in inputs)
        self._scalars = scalars
        self._known: list[dict[int, weakref.ref]] = [
            {id(t): weakref.ref(t)} if isinstance(t, torch.Tensor) else {} for t in inputs
        ]
        positions = {id(t): j for j, t in enumerate(tensors) if t is not None}
        found: set[int] = set()
        self._launches = []
        for launch in launches:
            rebound = {name: positions[id(value)] for name, value in launch.kwargs.items() if id(value) in positions}
            fixed = {name: value for name, value in launch.kwargs.items() if name not in rebound}
            found.update(rebound.values())
            self._launches.append((launch.kernel, launch.grid, fixed, rebound))
        present = [id(t) for t in tensors if t is not None]
        self.complete = len(set(present)) == len(present) == len(found) or not launches

    def matches(self, inputs: tuple[torch.Tensor | None, ...], scalars: tuple) -> bool:
        """Whether a call with these inputs (in the positions `__init__` had) and scalars may repeat the launches."""
        if scalars != self._scalars:
            return False
        for tensor, layout, known in zip(inputs, self._layouts, self._known):  # noqa: B905 - same positions
            if tensor is None:
                if layout is not None:
                    return False
                continue
            ref = known.get(id(tensor))
            if ref is not None and ref() is tensor:
                continue
            if tensor_layout(tensor) != layout:
                return False
            if len(known) >= self.MAX_KNOWN:
                known.clear()
            known[id(tensor)] = weakref.ref(tensor)
        return True

    def run(self, tensors: tuple[torch.Tensor | None, ...]) -> None:
        """Launches again with `tensors` in place of the first call's (same positions)."""
        for kernel, grid, fixed, rebound in self._launches:
            Launch(kernel, grid, {**fixed, **{name: tensors[j] for name, j in rebound.items()}})()
