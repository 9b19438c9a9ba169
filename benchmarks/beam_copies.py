"""Bytes copied per beam-search reorder step vs context length (issue 4): they must not grow with context.

`python -m benchmarks.beam_copies` runs 4 beams x 32 new tokens on the shipped demo model at several
prompt lengths and prints KiB copied per reorder step (copy-on-write of partial blocks, counted at
`BlockPool.copy_blocks`). A `DynamicCache` rebuilds the whole cache at every reorder instead.
"""

from __future__ import annotations

import sys

import torch

import hf_paged
from hf_paged.memory.pool import BlockPool
from hf_paged.demo_model import load_demo_model


def copied_per_reorder(model: torch.nn.Module, context: int, num_beams: int = 4, new_tokens: int = 32) -> float:
    """KiB copied by copy-on-write per reorder step for one beam-search `generate()`."""
    copied = {"bytes": 0, "reorders": 0}
    original_copy = BlockPool.copy_blocks

    def counting_copy(pool: hf_paged.KVPool, group_id: int, src: list[int], dst: list[int]) -> None:
        per_block = sum(pool.key_caches[i][0].nbytes * 2 for i in pool.layers_of_group(group_id))
        copied["bytes"] += per_block * len(src)
        original_copy(pool, group_id, src, dst)

    cache = hf_paged.PagedCache()
    original_reorder = cache.reorder_cache

    def counting_reorder(beam_idx: torch.Tensor) -> None:
        copied["reorders"] += 1
        original_reorder(beam_idx)

    cache.reorder_cache = counting_reorder
    BlockPool.copy_blocks = counting_copy
    try:
        ids = torch.randint(1, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(context))
        with torch.inference_mode():
            model.generate(ids, **hf_paged.cache_kwargs(cache), num_beams=num_beams, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    finally:
        BlockPool.copy_blocks = original_copy
    return copied["bytes"] / max(copied["reorders"], 1) / 1024


def main(argv: list[str] | None = None) -> int:
    contexts = [int(x) for x in (argv if argv is not None else sys.argv[1:])] or [250, 1000, 2000, 4000]
    torch.set_num_threads(1)
    model, _ = load_demo_model(attn_implementation="paged")
    for context in contexts:
        print(f"context {context:5d}: {copied_per_reorder(model, context):6.1f} KiB copied per reorder step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
