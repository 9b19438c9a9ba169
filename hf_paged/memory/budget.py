"""How many blocks a fixed pool holds: `num_blocks`, a byte budget (`max_memory=2**30`), or a share of the
memory free on the devices that hold the layers (`max_memory="90%"`), sized once, up front, as serving
engines size their KV cache instead of growing it by doubling."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch


def validate_block_size(block_size: int) -> int:
    """`block_size` (tokens per block) if it is a positive int; a clear error otherwise."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int (tokens per block), got {block_size!r}; 16 is typical.")
    return block_size


def parse_max_memory(max_memory: int | str | None) -> int | float | None:
    """`max_memory` as bytes (int) or as a fraction of free memory (float in (0, 1]); None when not given.

    Raises:
        ValueError: neither a positive int nor a percentage string such as `"90%"`.
    """
    if max_memory is None:
        return None
    if isinstance(max_memory, str) and max_memory.strip().endswith("%"):
        try:
            percent = float(max_memory.strip()[:-1])
        except ValueError:
            percent = -1.0
        if not 0 < percent <= 100:
            raise ValueError(f"max_memory={max_memory!r}: a percentage must be in (0%, 100%], e.g. '90%'.")
        return percent / 100
    if isinstance(max_memory, bool) or not isinstance(max_memory, int) or max_memory < 1:
        raise ValueError(
            f"max_memory must be a positive number of bytes or a share of free memory such as '90%', got {max_memory!r}."
        )
    return max_memory


def free_memory(device: torch.device) -> int:
    """Bytes free on a device now: the CUDA driver's figure for a GPU, the available physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    raise ValueError(f"max_memory as a percentage needs the free memory of {device}, which is unknown; pass bytes.")


def total_memory(device: torch.device) -> int | None:
    """Bytes of memory a device has in all (a GPU's, or the machine's physical memory for the CPU); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def blocks_in_budget(
    max_memory: int | float,
    block_bytes: int,
    layers: Iterable[int],
    layer_devices: dict[int, torch.device],
    default_device: torch.device,
) -> int:
    """The blocks per layer group a pool can hold within its budget.

    Args:
        max_memory: bytes for all layers, or a fraction of the free memory of each device holding layers.
        block_bytes: bytes one block takes in one layer (K and V, scales included).
        layers: the layers that store K/V.
        layer_devices: layer -> its device, where known; the others are on `default_device`.

    Raises:
        ValueError: the budget cannot hold one block of every layer, or is more bytes than the devices have.
    """
    per_device: dict[torch.device, int] = {}
    for layer_idx in layers:
        device = layer_devices.get(layer_idx, default_device)
        per_device[device] = per_device.get(device, 0) + block_bytes
    if isinstance(max_memory, int):  # one budget for all layers, wherever they are
        totals = [total_memory(torch.device(d)) for d in per_device or [default_device]]
        if None not in totals and max_memory > sum(totals):
            raise ValueError(
                f"max_memory={max_memory} bytes is more than the {sum(totals)} bytes the devices holding the layers "
                f"({sorted(map(str, per_device or [default_device]))}) have; pass a budget they can hold, or a share of "
                "the free memory such as max_memory='90%'."
            )
        per_device = {default_device: sum(per_device.values())}
    counts = []
    for device, per_block in per_device.items():
        budget = max_memory if isinstance(max_memory, int) else int(max_memory * free_memory(device))
        counts.append((budget // per_block, budget, per_block, device))
    blocks, budget, per_block, device = min(counts, key=lambda c: c[0])
    if blocks < 1:
        where = "" if isinstance(max_memory, int) else f" ({max_memory:.0%} of the memory free on {device})"
        raise ValueError(
            f"max_memory={budget} bytes{where} cannot hold one block of every layer ({per_block} bytes); raise it "
            "or lower block_size."
        )
    return blocks
