"""Tensor parallelism: the process group whose ranks run the same forward on their own head shards.

Under transformers' `tp_plan="auto"` (`torchrun`), every rank holds a slice of each layer's heads and runs
the same `generate()` on the same tokens, so each rank's `PagedCache` must allocate exactly as the others
do. Decisions taken from token ids and lengths agree by construction; a decision taken from K/V values
(identical rows, `dedupe.py`) or from a rank's own device (a pool's share of the free memory, `pool.py`) is agreed
over this group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tensor_parallel_group(module: torch.nn.Module) -> dist.ProcessGroup | None:
    """The process group that shards `module`'s weights (a DTensor's 1-D mesh of 2+ ranks), or None."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    for param in module.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None and mesh.ndim == 1 and mesh.size() > 1:
            return mesh.get_group()
    return None


def agree(identity: list[int], group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """Each row keeps its duplicate-of index only where every rank of `group` found the same; elsewhere
    the row counts as unique (always safe: it is stored on its own).

    Args:
        identity: per row, the first row it duplicates (itself when unique), as decided on this rank.
        device: where the collective's tensors live (the K/V device: gloo on CPU, NCCL on CUDA).
    """
    mine = torch.tensor(identity, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    same = torch.stack(everyone).eq(mine).all(dim=0).tolist()
    return [a if ok else b for b, (a, ok) in enumerate(zip(identity, same, strict=True))]


def agree_min(value: int, group: dist.ProcessGroup, device: torch.device) -> int:
    """The smallest `value` any rank of `group` holds (each rank decided its own, e.g. from its free memory).

    Args:
        device: where the collective's tensor lives (gloo on CPU, NCCL on CUDA).
    """
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=group)
    return int(mine.item())
