"""Integer tensors of a forward's plan (block tables, slots, lengths), built from host lists once per step.

`torch.tensor(list)` converts element by element (about 65 ns each for nested lists); packing the
integers into an `array` and viewing its buffer costs about half as much, and a one-element tensor a
third. On a GPU the host tensor is copied through pinned memory without blocking, so planning a step
never waits for the device to drain its queue.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import torch

#: `array` type codes of the dtypes the plan's tensors use.
_CODES = {torch.int64: "q", torch.int32: "i"}


def host_ints(values: Iterable[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D CPU tensor of `values` (int64 or int32)."""
    packed = array(_CODES[dtype], values)
    if not packed:  # (`torch.frombuffer` refuses an empty buffer)
        return torch.empty(0, dtype=dtype, device="cpu")
    return torch.frombuffer(packed, dtype=dtype)  # shares the array's memory and keeps it alive


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor just built) on `device`: itself on the CPU, else copied through pinned memory
    without blocking the host."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def device_ints(values: Iterable[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`to_device(host_ints(values, dtype), device)`: a 1-D integer tensor on `device`."""
    return to_device(host_ints(values, dtype), device)
