"""Block size sweep: KV waste vs bookkeeping overhead.

For each block size, the ShareGPT-like request mix is written into one `KVPool` (one cache per request,
as in `bench_memory`): waste is `stats().waste` (empty slots of blocks in use) and the bookkeeping is the
number of block-table entries. Decode throughput of a `generate()` batch is alternated over the block
sizes on the same prompts (small blocks mean more table entries and slots to gather per step).
"""

from __future__ import annotations

import hf_paged

from .bench_decode import _generate
from .bench_memory import fill_one
from .common import Suite, alternate, random_prompts, sample_trace

NAME = "block_size"


def run(suite: Suite, progress) -> None:
    vocab = suite.config.vocab_size
    sizes = suite.pick([1, 4, 8, 16, 32, 64, 128], [4, 16])
    trace = sample_trace("sharegpt", suite.pick(8, 3), seed=1, max_total=suite.pick(2048, 96))
    for block_size in progress(sizes, desc="block size: memory"):
        pool = hf_paged.KVPool(suite.config, block_size=block_size, prefix_caching=False)
        caches = [pool.new_cache() for _ in trace]
        for i, ((a, b), cache) in enumerate(zip(trace, caches, strict=True)):
            fill_one(suite.paged_model, cache, a + b, vocab, seed=i)
        s = pool.stats()
        entries = sum(len(t) for c in caches for group in c.rows.tables for t in group)
        suite.add(NAME, "waste", "paged", "block_size", block_size, 100 * s.waste, "%")
        suite.add(NAME, "bytes_in_use", "paged", "block_size", block_size, s.bytes_in_use / 2**20, "MiB")
        suite.add(NAME, "table_entries", "paged", "block_size", block_size, entries, "entries")
        for cache in caches:
            cache.release()

    batch, context, new = suite.pick((4, 512, 32), (2, 32, 4))
    ids, mask = random_prompts([context - i * context // (2 * batch) for i in range(batch)], vocab, seed=5)  # ragged
    variants = {
        f"block_{bs}": (
            lambda bs=bs: _generate(suite.paged_model, hf_paged.PagedCache(block_size=bs), ids, mask, new)
        )
        for bs in sizes
    }
    results = alternate(variants, repeats=suite.pick(2, 1))
    for name, values in progress(results.items(), desc="block size: decode"):
        bs = int(name.split("_")[1])
        suite.add(NAME, "decode_tokens_per_s", "paged", "block_size", bs, [v["decode_tokens_per_s"] for v in values], "tokens/s")
