"""Run by `torchrun --nproc_per_node N` (tests/test_tensor_parallel.py): generate() with tensor parallelism.

Each rank loads the saved model with `tp_plan="auto"` and `attn_implementation="paged"` and runs the cases
of `CASES` with a `PagedCache`, twice: as is, then with rank 1 seeing no two K/V rows as equal (as if its
shard had differed in one bit), so the identical-row decision must be agreed over the group for the ranks
to allocate alike. Then an Engine on a `KVPool(max_memory="50%")` whose ranks see different free memory (as GPUs
with other loads do), small enough to preempt: the pool's size must be agreed too. Rank 0 writes every rank's
tokens and block tables to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hf_paged
import hf_paged.cache.forward
import hf_paged.cache.paged_cache
import hf_paged.memory.budget

#: name -> generate() keyword arguments; the prompts repeat rows so identical-row detection has work.
CASES = {
    "greedy": dict(do_sample=False),
    "beams": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "samples": dict(do_sample=True, num_return_sequences=3, top_k=5),
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 10, 11], [0, 0, 3, 4, 5, 6, 7]]


def run(path: str, out: str | None = None) -> dict:
    """`{"agreeing" | "one-rank-differs": {case: {"tokens", "tables", "blocks_in_use"}}}` of this rank; with
    `out`, rank 0 writes the list of every rank's result there."""
    warnings.filterwarnings("ignore")
    parallel = int(os.environ.get("WORLD_SIZE", "1")) > 1
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="paged",
                                                 **({"tp_plan": "auto"} if parallel else {})).eval()
    rank = dist.get_rank() if parallel else 0
    result = {"agreeing": _cases(model), "budget": _budget(model, rank, parallel)}
    if parallel:
        decide = hf_paged.cache.forward.identical_rows  # what a forward's plan asks which rows are identical
        calls = []

        def differing(rows, key, value, *args):
            calls.append(rank)
            if rank == 1:
                key = key + torch.arange(key.shape[0]).view(-1, 1, 1, 1) * 1e-3
            return decide(rows, key, value, *args)

        hf_paged.cache.forward.identical_rows = differing
        result["one-rank-differs"] = _cases(model)
        hf_paged.cache.forward.identical_rows = decide
        if not calls:
            raise RuntimeError("the replaced identical_rows was never called: the test would prove nothing")
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, result)
    else:
        everyone = [result]
    if out is not None and rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)
    return result


def _cases(model) -> dict:
    ids = torch.tensor(PROMPTS)
    mask = (ids != 0).long()
    result = {}
    for name, kwargs in CASES.items():
        cache = hf_paged.PagedCache(block_size=4)
        torch.manual_seed(0)
        tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0,
                                **kwargs, **hf_paged.cache_kwargs(cache))
        tables = cache.block_tables()
        cache.pool.check()
        result[name] = {"tokens": tokens.tolist(), "tables": tables, "blocks_in_use": cache.stats().blocks_in_use}
    return result


def _budget(model, rank: int, parallel: bool) -> dict:
    """An Engine on a pool of half the free memory, which rank `r` sees as `(2 + r) * 12` KiB (a rank stores half
    the KV heads: one process sees twice rank 0's), preempting: its pool's blocks, its tokens and its preemptions."""
    free = hf_paged.memory.budget.free_memory
    kib = (2 + rank) * 12 if parallel else 48
    hf_paged.memory.budget.free_memory = lambda device: kib * 1024
    try:
        pool = hf_paged.KVPool(model.config, block_size=4, max_memory="50%")
        engine = hf_paged.Engine(model, pool, max_seqs=4)
        prompts = [[5 + i] * (6 + 3 * i) for i in range(4)]
        tokens = engine.generate(prompts, max_new_tokens=12, do_sample=False, eos_token_id=None, progress=False)
        pool.check()
        try:  # admitted by each rank's clock: refused under tensor parallelism
            list(engine.stream(prompts[:1], max_new_tokens=2, arrival_s=[0.0]))
            arrival = "served"
        except ValueError as error:
            arrival = str(error)
        return {"tokens": tokens, "blocks_total": pool.stats().blocks_total,
                "preemptions": engine.stats().preemptions, "arrival_s": arrival}
    finally:
        hf_paged.memory.budget.free_memory = free


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--out")
    args = parser.parse_args()
    run(args.model, args.out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
