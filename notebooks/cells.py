"""The cells of the four notebooks, as (kind, source) pairs; `build.py` turns them into .ipynb files."""

from __future__ import annotations


def quickstart(setup: str) -> list[tuple[str, str]]:
    return [
        (
            "md",
            '# hf-paged quick start\n\n`import hf_paged` registers `attn_implementation="paged"`; pass '
            "`**hf_paged.cache_kwargs(hf_paged.PagedCache())` (`cache=` from transformers 5.24, `past_key_values=` before) to the stock `generate()`. Below: load the model, generate, and "
            "compare tokens, memory and time with transformers' default `DynamicCache` (+ sdpa).",
        ),
        ("code", setup),
        ("md", "## Generate\n\nA left-padded batch of prompts of different lengths, greedy decoding."),
        (
            "code",
            """\
prompts = ["def fibonacci(n):", "import os\\nimport sys\\n\\nclass Config:\\n    def __init__(self, path):",
           "for i in range(10):"]
input_ids, attention_mask = encode(prompts)
cache = hf_paged.PagedCache()
out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **hf_paged.cache_kwargs(cache),
                     max_new_tokens=40, do_sample=False)
for row in out:
    print(repr(decode(row)), "\\n---")""",
        ),
        ("md", "## Same tokens as the default cache\n\nThe same prompts through `DynamicCache` with sdpa attention."),
        (
            "code",
            """\
ref_cache = DynamicCache(config=ref_model.config)
ref = ref_model.generate(input_ids=input_ids, attention_mask=attention_mask, **hf_paged.cache_kwargs(ref_cache),
                         max_new_tokens=40, do_sample=False)
print("identical tokens:", torch.equal(out, ref))""",
        ),
        (
            "md",
            "## Memory\n\n`cache.stats()` counts the blocks the cache holds. The `DynamicCache` stores every column, "
            "left padding included; the paged cache never stores padding and wastes at most one partial block per row.",
        ),
        (
            "code",
            """\
stats = cache.stats()
dynamic_bytes = hf_paged.contiguous_cache_bytes(ref_cache)
print(f"PagedCache:   {stats.bytes_in_use / 1024:8.1f} KiB in {stats.blocks_in_use} blocks, "
      f"{stats.tokens_stored} tokens, waste {stats.waste:.1%}")
print(f"DynamicCache: {dynamic_bytes / 1024:8.1f} KiB  ({ref_cache.layers[0].keys.shape[0]} rows x "
      f"{ref_cache.layers[0].keys.shape[2]} columns)")
stats.as_dict()""",
        ),
        ("md", "## Time, side by side\n\nAlternating the two, a few times each (CPU, small model: expect noise)."),
        (
            "code",
            """\
import time
times = {"paged": [], "dynamic": []}
for _ in range(3):
    for name in times:
        start = time.perf_counter()
        if name == "paged":
            model.generate(input_ids=input_ids, attention_mask=attention_mask, **hf_paged.cache_kwargs(hf_paged.PagedCache()),
                           max_new_tokens=16, min_new_tokens=16, do_sample=False)
        else:
            ref_model.generate(input_ids=input_ids, attention_mask=attention_mask,
                               **hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)),
                               max_new_tokens=16, min_new_tokens=16, do_sample=False)
        times[name].append(time.perf_counter() - start)
for name, values in times.items():
    print(f"{name:8s} median {sorted(values)[1]:.2f} s  ({', '.join(f'{v:.2f}' for v in values)})")""",
        ),
        (
            "md",
            "## A shared pool with prefix caching\n\nA `KVPool` keeps the full blocks of finished prompts; "
            "`pool.new_cache(input_ids)` returns a cache that already holds the longest cached prefix, and `generate()` "
            "computes only the rest.",
        ),
        (
            "code",
            """\
pool = hf_paged.KVPool(model.config, block_size=16)
system = encode(["# A small library of helpers for reading files and parsing configs.\\n" * 6])[0]
for turn, question in enumerate(["def read_file(path):", "def parse_config(text):"]):
    ids = torch.cat([system, encode([question])[0]], dim=1)
    with pool.new_cache(ids) as c:
        reused = c.get_seq_length()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **hf_paged.cache_kwargs(c), max_new_tokens=8)
    print(f"call {turn}: prompt {ids.shape[1]} tokens, {reused} served from the pool")
print(pool.stats())""",
        ),
    ]


def paging(setup: str, draw: str) -> list[tuple[str, str]]:
    return [
        (
            "md",
            "# How paging works\n\nEach sequence (row) owns a *block table*: a list of block ids in the pool. "
            "A block holds `block_size` tokens of K and V for every layer. Blocks are taken as tokens arrive, so a "
            "row wastes at most one partial block; padding is never stored.",
        ),
        ("code", setup),
        ("code", draw),
        (
            "md",
            "## A real batch after the prompt\n\nFour prompts of different lengths, left-padded to one width, "
            "`block_size=8` so the pictures stay small. Blue: slots holding tokens; light: empty slots.",
        ),
        (
            "code",
            """\
lengths = [5, 19, 34, 50]
width = max(lengths)
input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
attention_mask = torch.zeros_like(input_ids)
for row, n in enumerate(lengths):
    input_ids[row, -n:] = torch.randint(1, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(row))
    attention_mask[row, -n:] = 1
cache = hf_paged.PagedCache(block_size=8)
with torch.no_grad():
    model(input_ids=input_ids, attention_mask=attention_mask, **hf_paged.cache_kwargs(cache), use_cache=True)
draw_tables(cache, "block tables after the prefill (padding is not stored)")
print("seq_lens:", cache.seq_lens, " tables:", cache.block_tables())""",
        ),
        (
            "md",
            "## Blocks allocated as tokens arrive\n\nDecoding one token per step: a row takes a new block only when "
            "its last block is full.",
        ),
        (
            "code",
            """\
mask = attention_mask
next_ids = input_ids[:, -1:]
blocks_per_step, tables_at = [], {}
with torch.no_grad():
    for step in range(24):
        mask = torch.cat([mask, torch.ones(len(lengths), 1, dtype=torch.long)], dim=1)
        logits = model(input_ids=next_ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), use_cache=True).logits
        next_ids = logits[:, -1:].argmax(-1)
        blocks_per_step.append([len(t) for t in cache.block_tables()])
        if step in (3, 11, 23):
            tables_at[step + 1] = cache.block_tables()
fig, ax = plt.subplots(figsize=(7, 3))
for row in range(len(lengths)):
    ax.step(range(1, 25), [b[row] for b in blocks_per_step], where="post", label=f"row {row} (prompt {lengths[row]})")
ax.set_xlabel("decode step"); ax.set_ylabel("blocks in the row's table"); ax.legend(fontsize=8); ax.grid(alpha=0.3)
for step, tables in tables_at.items():
    print(f"after {step:2d} new tokens:", tables)""",
        ),
        ("code", """draw_tables(cache, "after 24 new tokens per row");"""),
        (
            "md",
            "## Waste per sequence\n\nEmpty slots are only in each row's last block (fewer than `block_size`). "
            "A contiguous left-padded cache of the same batch stores `rows x columns` slots.",
        ),
        (
            "code",
            """\
bs = cache.pool.block_size
unused = [len(t) * bs - n for t, n in zip(cache.block_tables(), cache.seq_lens)]
contiguous_unused = [mask.shape[1] - n for n in cache.seq_lens]
fig, ax = plt.subplots(figsize=(7, 3))
x = torch.arange(len(lengths)).float()
ax.bar(x - 0.2, unused, 0.4, label=f"paged (block_size={bs})")
ax.bar(x + 0.2, contiguous_unused, 0.4, label="contiguous, left-padded")
ax.set_xticks(x, [f"row {i}" for i in range(len(lengths))]); ax.set_ylabel("unused token slots"); ax.legend()
stats = cache.stats()
print(f"paged: {stats.blocks_in_use * bs - stats.tokens_stored} unused slots (< {len(lengths)} x {bs}), "
      f"waste {stats.waste:.1%}; contiguous: {sum(contiguous_unused)} unused slots")""",
        ),
        ("md", "## Block size: waste vs bookkeeping\n\nSmaller blocks waste less but make longer tables."),
        (
            "code",
            """\
sizes = [1, 4, 8, 16, 32, 64]
waste, entries = [], []
for bs in sizes:
    c = hf_paged.PagedCache(block_size=bs)
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=attention_mask, **hf_paged.cache_kwargs(c), use_cache=True)
    s = c.stats()
    waste.append(100 * s.waste)
    entries.append(sum(len(t) for t in c.block_tables()))
    c.release()
fig, ax = plt.subplots(figsize=(7, 3))
ax.plot(sizes, waste, "o-", label="waste % (left)"); ax.set_xscale("log", base=2); ax.set_xlabel("block_size")
ax.set_ylabel("waste %"); ax2 = ax.twinx(); ax2.plot(sizes, entries, "s--", color="tab:orange", label="table entries")
ax2.set_ylabel("block-table entries"); fig.legend(loc="upper center", fontsize=8)""",
        ),
    ]


def sharing(setup: str, draw: str) -> list[tuple[str, str]]:
    return [
        (
            "md",
            "# Sharing blocks\n\nRows that start alike share blocks through reference counts; a row writing into "
            "a shared partial block first copies it (copy-on-write). Parallel samples store their prompt once; beams "
            "share their common history; a multi-turn chat reuses its earlier turns from a `KVPool`.",
        ),
        ("code", setup),
        ("code", draw),
        (
            "md",
            "## Parallel sampling\n\n`num_return_sequences=4`: generate repeats the prompt 4 times; the paged cache "
            "stores it once (red outlines: shared blocks).",
        ),
        (
            "code",
            """\
prompt = torch.randint(1, model.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(0))
cache = hf_paged.PagedCache(block_size=16)
torch.manual_seed(0)
out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **hf_paged.cache_kwargs(cache),
                     do_sample=True, num_return_sequences=4, max_new_tokens=20, min_new_tokens=20)
draw_tables(cache, "4 samples of one prompt")
s = cache.stats()
ref_cache = DynamicCache(config=ref_model.config)
torch.manual_seed(0)
ref_model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **hf_paged.cache_kwargs(ref_cache),
                   do_sample=True, num_return_sequences=4, max_new_tokens=20, min_new_tokens=20)
dyn = hf_paged.contiguous_cache_bytes(ref_cache)
print(f"paged: {s.bytes_in_use / 1024:.0f} KiB ({s.blocks_shared} shared blocks); DynamicCache: {dyn / 1024:.0f} KiB")""",
        ),
        ("md", "## Memory vs number of samples"),
        (
            "code",
            """\
ns, paged_kib, dynamic_kib = [1, 2, 4, 8], [], []
for n in ns:
    c, rc = hf_paged.PagedCache(), DynamicCache(config=ref_model.config)
    for m, cc in ((model, c), (ref_model, rc)):
        torch.manual_seed(0)
        m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **hf_paged.cache_kwargs(cc), do_sample=True,
                   num_return_sequences=n, max_new_tokens=16, min_new_tokens=16)
    paged_kib.append(c.stats().bytes_in_use / 1024)
    dynamic_kib.append(hf_paged.contiguous_cache_bytes(rc) / 1024)
    c.release()
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(ns, dynamic_kib, "o-", label="DynamicCache"); ax.plot(ns, paged_kib, "o-", label="PagedCache")
ax.set_xlabel("num_return_sequences"); ax.set_ylabel("KV KiB"); ax.legend(); ax.grid(alpha=0.3)""",
        ),
        (
            "md",
            "## Beam search\n\nBeams that descend from one beam share its blocks; a reorder moves table entries "
            "instead of copying K/V. Copies are counted by wrapping this pool's `copy_blocks`.",
        ),
        (
            "code",
            """\
cache = hf_paged.PagedCache(block_size=16)
copied = {"blocks": 0}
original = cache.pool.copy_blocks
def counting_copy_blocks(group_id, src, dst):
    copied["blocks"] += len(src)
    original(group_id, src, dst)
cache.pool.copy_blocks = counting_copy_blocks
snapshots = []
def snapshot(input_ids, scores):  # a logits processor: records the beams' tables at every step
    snapshots.append((cache.block_tables(), cache.seq_lens))  # both are copies
    return scores
out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **hf_paged.cache_kwargs(cache),
                     num_beams=3, num_return_sequences=1, do_sample=False, max_new_tokens=20, min_new_tokens=20,
                     logits_processor=[snapshot])
step = max(range(len(snapshots)), key=lambda i: len({b for t in snapshots[i][0] for b in t}))
draw_tables(cache, f"3 beams at step {step} (the step with the most distinct blocks)", snapshot=snapshots[step])
for i in (1, step, len(snapshots) - 1):
    print(f"step {i:2d}:", snapshots[i][0])
print(f"blocks copied (copy-on-write of partial blocks): {copied['blocks']}; "
      f"in use: {cache.stats().blocks_in_use}, shared: {cache.stats().blocks_shared}")""",
        ),
        ("md", "## `fork()`\n\nA second cache holding the same rows; blocks are shared until one of them writes."),
        (
            "code",
            """\
base = hf_paged.PagedCache(block_size=16)
with torch.no_grad():
    model(input_ids=prompt, **hf_paged.cache_kwargs(base), use_cache=True)
child = base.fork()
print("before:", base.pool.stats().blocks_shared, "shared blocks")
with torch.no_grad():
    model(input_ids=prompt[:, :1], **hf_paged.cache_kwargs(child), use_cache=True)
print("after the child writes one token:", base.block_tables(), child.block_tables())""",
        ),
        (
            "md",
            "## A multi-turn chat reusing its prefix\n\nEach turn runs on a new cache of one `KVPool`; "
            "`commit_tokens()` indexes the turn's tokens, so the next turn's `pool.new_cache(history)` starts with "
            "everything but the new message.",
        ),
        (
            "code",
            """\
import time
pool = hf_paged.KVPool(model.config, block_size=16)
history = torch.randint(1, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1))
rows = []
for turn in range(4):
    message = torch.randint(1, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(10 + turn))
    ids = torch.cat([history, message], dim=1)
    start = time.perf_counter()
    with pool.new_cache(ids) as cache:
        reused = cache.get_seq_length()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **hf_paged.cache_kwargs(cache),
                             max_new_tokens=24, min_new_tokens=24, do_sample=False)
        cache.commit_tokens(out)
        in_use = cache.stats().bytes_in_use
    elapsed = time.perf_counter() - start
    rows.append((turn, ids.shape[1], reused, elapsed, in_use / 1024, pool.stats().bytes_reserved / 1024))
    history = out
print("turn  prompt  reused  seconds   KiB in use  KiB reserved")
for r in rows:
    print(f"{r[0]:4d}  {r[1]:6d}  {r[2]:6d}  {r[3]:7.2f}  {r[4]:10.0f}  {r[5]:12.0f}")
fig, ax = plt.subplots(figsize=(6, 3))
ax.bar([r[0] - 0.2 for r in rows], [r[1] for r in rows], 0.4, label="prompt tokens")
ax.bar([r[0] + 0.2 for r in rows], [r[2] for r in rows], 0.4, label="served from the pool")
ax.set_xlabel("turn"); ax.set_ylabel("tokens"); ax.legend()
print(pool.stats())""",
        ),
    ]


def engine(setup: str) -> list[tuple[str, str]]:
    return [
        (
            "md",
            "# The engine: continuous batching on a `KVPool`\n\n`hf_paged.Engine(model)` serves many prompts at once. "
            "Each step is **one forward over a packed, unpadded set of tokens**: one token of every running request "
            "plus prefill chunks of new ones, up to `max_batch_tokens`. A finished request leaves at once and a "
            "waiting one takes its place; when the pool is full, the latest request is preempted (its blocks freed, "
            "recomputed later) instead of raising.",
        ),
        ("code", setup),
        (
            "md",
            "## A mixed request set\n\nPrompt and output lengths drawn from a lognormal (long tail, like chat traces); "
            "each request generates exactly its own number of tokens.",
        ),
        (
            "code",
            """\
from transformers import GenerationConfig
torch.set_num_threads(1)  # as the benchmarks: small ops on a small shared machine run best on one thread
gen = torch.Generator().manual_seed(0)
num_requests = 32
prompt_lens = torch.empty(num_requests).log_normal_(4.0, 0.8, generator=gen).clamp(4, 400).long().tolist()
output_lens = torch.empty(num_requests).log_normal_(3.3, 0.8, generator=gen).clamp(2, 200).long().tolist()
prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
configs = [GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)
           for n in output_lens]
print(f"{num_requests} requests, prompts {sum(prompt_lens)} tokens, outputs {sum(output_lens)} tokens")""",
        ),
        (
            "md",
            "## Streaming\n\n`engine.stream()` yields `(request_index, token_id, finished)` as tokens come; we record "
            "when each request produced its tokens.",
        ),
        (
            "code",
            """\
import time
engine = hf_paged.Engine(model, hf_paged.KVPool(model.config), max_batch_tokens=256, max_seqs=16)
start = time.perf_counter()
first, last, outputs = {}, {}, {i: [] for i in range(num_requests)}
for index, token, finished in engine.stream(prompts, configs):
    now = time.perf_counter() - start
    first.setdefault(index, now)
    outputs[index].append(token)
    if finished:
        last[index] = now
engine_s = time.perf_counter() - start
print(f"engine: {engine_s:.1f} s, {sum(output_lens) / engine_s:.0f} output tokens/s")
engine.stats()""",
        ),
        (
            "md",
            "Every request from its first to its last token (bars), in arrival order: short requests leave early "
            "and waiting ones start at once; at most `max_seqs=16` are in flight.",
        ),
        (
            "code",
            """\
fig, ax = plt.subplots(figsize=(8, 4))
for i in range(num_requests):
    ax.barh(i, last[i] - first[i], left=first[i], color="tab:blue", height=0.7)
ax.set_xlabel("time since submission (s)"); ax.set_ylabel("request (arrival order)")
ax.yaxis.get_major_locator().set_params(integer=True)
ax.invert_yaxis(); ax.grid(axis="x", alpha=0.3)
ax.set_title(f"{num_requests} requests through hf_paged.Engine (max_seqs=16), demo model on CPU", fontsize=10)""",
        ),
        (
            "md",
            "## Same tokens as `generate()`, one request at a time\n\nGreedy output of each request equals a "
            "single-request `model.generate()` (up to float near-ties; exact here).",
        ),
        (
            "code",
            """\
same = 0
for i in range(0, num_requests, 8):
    ids = torch.tensor([prompts[i]])
    ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **hf_paged.cache_kwargs(hf_paged.PagedCache()),
                         generation_config=configs[i])[0, ids.shape[1]:].tolist()
    same += ref == outputs[i]
print(f"{same} of {len(range(0, num_requests, 8))} checked requests identical to generate()")""",
        ),
        (
            "md",
            "## Against `generate()` in padded batches of 8\n\nThe stock way: left-pad 8 prompts and run them until "
            "the longest output ends (the shorter rows keep computing).",
        ),
        (
            "code",
            """\
start = time.perf_counter()
for b in range(0, num_requests, 8):
    batch = prompts[b:b + 8]
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    longest = max(output_lens[b:b + 8])
    ref_model.generate(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)),
                       max_new_tokens=longest, min_new_tokens=longest, do_sample=False)
padded_s = time.perf_counter() - start
print(f"generate(), batches of 8: {padded_s:.1f} s, {sum(output_lens) / padded_s:.0f} useful output tokens/s")
print(f"engine speed-up: {padded_s / engine_s:.2f}x")""",
        ),
        (
            "md",
            "## A pool too small for everything at once\n\nWith room for only a few requests' K/V, the engine "
            "preempts the most recently admitted request and recomputes it later; outputs do not change.",
        ),
        (
            "code",
            """\
small = hf_paged.KVPool(model.config, block_size=16, num_blocks=48)
tight = hf_paged.Engine(model, small, max_batch_tokens=256, max_seqs=16)
tight_out = tight.generate(prompts[:12], configs[:12], progress=False)
print("outputs unchanged:", tight_out == [outputs[i] for i in range(12)])
print("preemptions:", tight.stats().preemptions, "| pool:", small.stats())""",
        ),
    ]
