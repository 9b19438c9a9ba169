"""What the launchers share: one kernel launch as data, and the device it runs on."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


def device_context(tensor: torch.Tensor):
    """Launch on the tensor's device, not on whichever CUDA device is current."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


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
