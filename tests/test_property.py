"""Property-based tests: random sequences of cache operations on a small KVPool keep every invariant.

A hypothesis state machine drives `PagedCache` objects of one small fixed-size `KVPool` through the
same entry points `generate()` uses (`attend()` per layer, `reorder_cache`, `batch_select_indices`,
`batch_repeat_interleave`, `crop`, `fork`, `release`, `commit_tokens`, `pool.new_cache` prefix lookups),
mixed with interrupted forwards (only some layers run) and pool exhaustion. No model is needed: the K/V
of a token is a deterministic function of (salt, every token up to it, layer), which is what a real
model computes, so a prefix hit *must* serve exactly the vectors the shadow model expects.

After every step:
- `pool.check()` passes (states, refcounts vs. live tables and index, table lengths vs. token counts);
- for every live cache, every row, every layer: K/V read back through the block tables from
  `pool.key_caches[layer]` / `pool.value_caches[layer]` equal the K/V written for those tokens;
- a forward's attention output equals a float32 reference over the shadow K/V;
- a forward that raises `OutOfBlocksError` leaves the allocator exactly as it was and keeps none of
  the rows it added.
At the end every cache is released and the pool is whole again (no reference, every block free or cached).
"""

from __future__ import annotations

import gc
import hashlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from transformers import LlamaConfig, Qwen2Config

import hf_paged
from hf_paged.attention.plan import AttentionFeatures
from hf_paged.cache import rows as rows_module

NUM_KV_HEADS, NUM_HEADS, HEAD_DIM, NUM_LAYERS = 2, 4, 4, 2
WINDOW = 5
MAX_CACHES = 4
MAX_ROWS = 6
VOCAB = 4  # tiny vocabulary: prompts collide often, so prefix hits and dedupe happen
DOCS = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 1, 1], [1, 2, 3, 1, 4, 4, 2, 2, 1, 3, 3, 4], [2, 2, 2, 2, 1, 1, 1, 1, 3, 3, 3, 3]]

_KV_MEMO: dict[tuple, torch.Tensor] = {}


def token_kv(salt: str | None, prefix: tuple[int, ...], what: str = "kv") -> torch.Tensor:
    """`[layers, 2 (k/v), heads, head_dim]` K/V of the last token of `prefix`, as a model would compute
    (with `what="q"`: its queries, `[layers, num_heads, head_dim]`)."""
    key = (salt, prefix, what)
    kv = _KV_MEMO.get(key)
    if kv is None:
        seed = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 1
        gen = torch.Generator().manual_seed(seed)
        shape = (NUM_LAYERS, 2, NUM_KV_HEADS, HEAD_DIM) if what == "kv" else (NUM_LAYERS, NUM_HEADS, HEAD_DIM)
        kv = torch.randn(*shape, generator=gen)
        _KV_MEMO[key] = kv
    return kv


class FakeAttention(torch.nn.Module):
    def __init__(self, layer_idx: int, config) -> None:
        super().__init__()
        self.layer_idx, self.config = layer_idx, config


class Shadow:
    """What a cache should hold: per row the real tokens stored, plus the columns and the padding mask."""

    def __init__(self, cache: hf_paged.PagedCache, salt: str | None) -> None:
        self.cache = cache
        self.salt = salt
        self.tokens: list[list[int]] = []
        self.columns = 0
        self.mask: torch.Tensor | None = None  # [rows, columns] padding mask of everything fed so far
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # a prompt not yet fed
        self.interrupted = False  # a forward stopped after some layers; the cache rolls it back later

    @property
    def batch(self) -> int:
        return len(self.tokens)

    def copy(self, cache: hf_paged.PagedCache) -> Shadow:
        other = Shadow(cache, self.salt)
        other.tokens = [list(t) for t in self.tokens]
        other.columns = self.columns
        other.mask = None if self.mask is None else self.mask.clone()
        other.pending = self.pending
        return other


def allocator_snapshot(pool: hf_paged.KVPool) -> list:
    return [
        ([b.ref_count for b in a.blocks], list(a.free_ids), list(a.evictable), dict(a.index))
        for a in pool.allocators or []
    ]


#: Each machine's seed, pinned: with only `derandomize`, Hypothesis seeds from a digest of the class's
#: source, so every edit of the class drew another run, and runs differ widely in what they reach (seeds
#: 0-3: 0 to 57 out-of-blocks forwards, 26 to 542 prefix-hit tokens). The test asserts what these reach.
RUN_SEED, HYBRID_RUN_SEED = 2, 3


@seed(RUN_SEED)
class PoolMachine(RuleBasedStateMachine):
    """Random operations on caches of one small fixed-size pool."""

    hybrid = False  # Qwen2 with layer 0 sliding (window 5), layer 1 full: two block groups

    def __init__(self) -> None:
        super().__init__()
        self.pool: hf_paged.KVPool | None = None
        self.shadows: list[Shadow] = []
        self.gen = torch.Generator().manual_seed(0)
        self.forwards = self.ooms = self.prefix_hits = 0

    # ------------------------------------------------------------------ setup
    @initialize(block_size=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(16, 96), seed=st.integers(0, 2**16))
    def make_pool(self, block_size: int, num_blocks: int, seed: int) -> None:
        if self.hybrid:
            config = Qwen2Config(
                num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
                hidden_size=NUM_HEADS * HEAD_DIM, layer_types=["sliding_attention", "full_attention"],
                sliding_window=WINDOW, use_sliding_window=True,
            )
        else:
            config = LlamaConfig(
                num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
                hidden_size=NUM_HEADS * HEAD_DIM,
            )
        self.config = config
        self.modules = [FakeAttention(i, config) for i in range(NUM_LAYERS)]
        self.windows = [WINDOW if self.hybrid and i == 0 else None for i in range(NUM_LAYERS)]
        self.pool = hf_paged.KVPool(config, block_size=block_size, num_blocks=num_blocks, prefix_caching=True)
        self.gen.manual_seed(seed)

    def rand(self, n: int) -> int:
        return int(torch.randint(n, (1,), generator=self.gen))

    # ------------------------------------------------------------------ helpers
    def random_prompts(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        prompts = []
        for _ in range(batch):
            doc = DOCS[self.rand(len(DOCS))]
            prompt = doc[: 1 + self.rand(len(doc))] + [1 + self.rand(VOCAB) for _ in range(self.rand(3))]
            prompts.append(prompt)
        width = max(map(len, prompts))
        ids = torch.zeros(batch, width, dtype=torch.long)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p) :] = torch.tensor(p)
            mask[b, width - len(p) :] = 1
        return ids, mask

    def forward(self, shadow: Shadow, layers: int, expand: int = 1) -> None:
        """Feeds the next columns (the pending prompt, else 1-3 decoded tokens per row) through `layers`
        layers. `layers < NUM_LAYERS` is a forward interrupted by an exception."""
        cache = shadow.cache
        if shadow.pending is not None:
            ids, mask = shadow.pending
            if expand > 1:
                ids, mask = ids.repeat_interleave(expand, 0), mask.repeat_interleave(expand, 0)
            new_ids, new_mask = ids[:, shadow.columns :], mask[:, shadow.columns :]
            full_mask = mask
            base_tokens = [[] for _ in range(ids.shape[0])]
            for b in range(ids.shape[0]):  # tokens already stored (a prefix hit) are the prompt's first ones
                prompt = ids[b][mask[b].bool()].tolist()
                stored = len(shadow.tokens[b // expand]) if shadow.tokens else 0
                base_tokens[b] = prompt[:stored]
        else:
            q_len = 1 + self.rand(3)
            new_ids = torch.randint(1, VOCAB + 1, (shadow.batch, q_len), generator=self.gen)
            new_mask = torch.ones_like(new_ids)
            full_mask = new_mask if shadow.mask is None else torch.cat([shadow.mask, new_mask], 1)
            base_tokens = shadow.tokens
        batch, q_len = new_ids.shape
        if q_len == 0:
            return
        # K/V per column: the model's value for real tokens, garbage (never stored) for padding.
        keys = torch.randn(NUM_LAYERS, batch, NUM_KV_HEADS, q_len, HEAD_DIM, generator=self.gen) * 100
        values = torch.randn(NUM_LAYERS, batch, NUM_KV_HEADS, q_len, HEAD_DIM, generator=self.gen) * 100
        queries = torch.randn(NUM_LAYERS, batch, NUM_HEADS, q_len, HEAD_DIM, generator=self.gen)
        new_tokens = []
        for b in range(batch):
            real = new_ids[b][new_mask[b].bool()].tolist()
            new_tokens.append(base_tokens[b] + real)
            for i in range(len(real)):
                kv = token_kv(shadow.salt, tuple(base_tokens[b] + real[: i + 1]))
                col = q_len - len(real) + i
                keys[:, b, :, col], values[:, b, :, col] = kv[:, 0], kv[:, 1]
                queries[:, b, :, col] = token_kv(shadow.salt, tuple(base_tokens[b] + real[: i + 1]), "q")
        padded = not bool(full_mask.all())
        attention_mask = full_mask.bool() if padded else None
        before = None
        if not shadow.interrupted:
            cache.finish_forward()  # closes the previous forward first, as the next forward would
            before = allocator_snapshot(self.pool)
        for layer in range(layers):
            try:
                out, _ = cache.attend(
                    self.modules[layer], queries[layer], keys[layer], values[layer], layer, attention_mask,
                    AttentionFeatures(HEAD_DIM**-0.5, self.windows[layer]),
                )
            except hf_paged.OutOfBlocksError:
                assert layer == 0, "blocks are allocated once per forward, on its first layer"
                self.ooms += 1
                # The failed forward keeps none of the rows it added (num_return_sequences expansion included).
                assert cache.num_rows in (0, shadow.batch), "a failed forward kept its row expansion"
                if before == []:  # the allocators were created by this forward: still pristine
                    before = [([0] * a.capacity, list(range(a.capacity)), [], {}) for a in self.pool.allocators]
                if before is not None:
                    assert allocator_snapshot(self.pool) == before, "OutOfBlocksError changed the pool"
                    assert cache.get_seq_length() == shadow.columns
                return
            for b in range(batch):
                n = len(new_tokens[b]) - len(base_tokens[b])
                expected = reference_attention(
                    queries[layer, b, :, q_len - n :], shadow.salt, new_tokens[b], layer, n, self.windows[layer]
                )
                torch.testing.assert_close(out[b, q_len - n :].transpose(0, 1), expected, rtol=1e-4, atol=1e-4)
        if layers < NUM_LAYERS:
            shadow.interrupted = True
            return
        self.forwards += 1
        shadow.interrupted = False
        shadow.tokens = new_tokens
        shadow.columns += q_len
        shadow.mask = full_mask
        shadow.pending = None

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: self.pool is not None and len(self.shadows) < MAX_CACHES)
    @rule(batch=st.integers(1, 3), salt=st.sampled_from([None, None, "tenant-b"]), lookup=st.sampled_from([True, True, False]))
    def new_cache(self, batch: int, salt: str | None, lookup: bool) -> None:
        ids, mask = self.random_prompts(batch)
        if lookup:
            cache = self.pool.new_cache(ids, mask, salt=salt)
            shadow = Shadow(cache, salt)
            shadow.columns = cache.get_seq_length()
            lens = cache.seq_lens
            for b in range(batch):
                prompt = ids[b][mask[b].bool()].tolist()
                assert lens[b] < len(prompt), "a prefix hit must leave at least one token to compute"
                assert lens[b] == max(0, shadow.columns - (ids.shape[1] - len(prompt)))
                shadow.tokens.append(prompt[: lens[b]])
            self.prefix_hits += sum(lens)
        else:
            shadow = Shadow(hf_paged.PagedCache(pool=self.pool, salt=salt), salt)
            shadow.tokens = []
        shadow.pending = (ids, mask)
        self.shadows.append(shadow)

    @precondition(lambda self: self.shadows)
    @rule(data=st.data(), expand=st.sampled_from([1, 1, 1, 2]))
    def step(self, data, expand: int) -> None:
        self._step(data, expand)

    @precondition(lambda self: self.shadows)
    @rule(data=st.data())
    def decode(self, data) -> None:  # a second rule: forwards are the most common operation
        self._step(data, 1)

    @precondition(lambda self: self.shadows)
    @rule(data=st.data())
    def decode_more(self, data) -> None:
        self._step(data, 1)

    def _step(self, data, expand: int) -> None:
        shadow = data.draw(st.sampled_from(self.shadows))
        if shadow.pending is None or shadow.pending[0].shape[0] * expand > MAX_ROWS:
            expand = 1  # num_return_sequences-style expansion only of a prepared, unfed prompt
        if shadow.pending is None and shadow.batch == 0:
            return
        self.forward(shadow, NUM_LAYERS, expand)

    @precondition(lambda self: self.shadows)
    @rule(data=st.data())
    def interrupted_step(self, data) -> None:
        """An exception inside the model after the first layer: the forward never completes."""
        shadow = data.draw(st.sampled_from(self.shadows))
        if shadow.pending is None and shadow.batch == 0:
            return
        self.forward(shadow, 1)

    @precondition(lambda self: self.shadows and len(self.shadows) < MAX_CACHES)
    @rule(data=st.data())
    def fork(self, data) -> None:
        shadow = data.draw(st.sampled_from(self.shadows))
        other = shadow.cache.fork()
        shadow.interrupted = False
        self.shadows.append(shadow.copy(other))

    def fed(self) -> list[Shadow]:
        return [s for s in self.shadows if s.pending is None and s.batch]

    @precondition(lambda self: self.fed())
    @rule(data=st.data())
    def reorder(self, data) -> None:
        shadow = data.draw(st.sampled_from(self.fed()))
        beam_idx = data.draw(st.lists(st.integers(0, shadow.batch - 1), min_size=shadow.batch, max_size=shadow.batch))
        shadow.cache.reorder_cache(torch.tensor(beam_idx))
        self._select(shadow, beam_idx)

    @precondition(lambda self: self.fed())
    @rule(data=st.data())
    def batch_select(self, data) -> None:
        shadow = data.draw(st.sampled_from(self.fed()))
        indices = data.draw(st.lists(st.integers(0, shadow.batch - 1), min_size=1, max_size=shadow.batch, unique=True))
        shadow.cache.batch_select_indices(torch.tensor(sorted(indices)))
        self._select(shadow, sorted(indices))

    @precondition(lambda self: [s for s in self.fed() if s.batch * 2 <= MAX_ROWS])
    @rule(data=st.data())
    def repeat_interleave(self, data) -> None:
        shadow = data.draw(st.sampled_from([s for s in self.fed() if s.batch * 2 <= MAX_ROWS]))
        shadow.cache.batch_repeat_interleave(2)
        self._select(shadow, [i for i in range(shadow.batch) for _ in range(2)])

    def _select(self, shadow: Shadow, indices: list[int]) -> None:
        shadow.interrupted = False
        shadow.tokens = [list(shadow.tokens[i]) for i in indices]
        shadow.mask = shadow.mask[indices] if shadow.mask is not None else None

    @precondition(lambda self: [s for s in self.fed() if s.columns])
    @rule(data=st.data())
    def crop(self, data) -> None:
        shadow = data.draw(st.sampled_from([s for s in self.fed() if s.columns]))
        drop = data.draw(st.integers(1, min(shadow.columns, 4)))
        try:
            shadow.cache.crop(-drop)
        except ValueError as err:  # sliding groups: the blocks needed after the crop were freed
            assert self.hybrid and "sliding window" in str(err), err
            shadow.interrupted = False
            return
        shadow.interrupted = False
        shadow.tokens = [t[: max(0, len(t) - drop)] for t in shadow.tokens]
        shadow.columns -= drop
        shadow.mask = shadow.mask[:, : shadow.columns] if shadow.mask is not None else None

    @precondition(lambda self: [s for s in self.fed() if any(s.tokens)])
    @rule(data=st.data())
    def commit_tokens(self, data) -> None:
        """Index the decoded tokens' full blocks (what a chat loop does with `generate(...).sequences`)."""
        shadow = data.draw(st.sampled_from([s for s in self.fed() if any(s.tokens)]))
        seq = torch.zeros(shadow.batch, shadow.columns, dtype=torch.long)
        for b, tokens in enumerate(shadow.tokens):
            if tokens:
                seq[b, shadow.columns - len(tokens) :] = torch.tensor(tokens)
        shadow.cache.commit_tokens(seq)
        shadow.interrupted = False

    @precondition(lambda self: self.shadows)
    @rule(data=st.data(), how=st.sampled_from(["release", "with", "drop", "reset"]))
    def release(self, data, how: str) -> None:
        shadow = data.draw(st.sampled_from(self.shadows))
        self.shadows.remove(shadow)
        cache = shadow.cache
        shadow.cache = None
        if how == "release":
            cache.release()
        elif how == "with":
            with cache:
                pass
        elif how == "reset":
            cache.reset()
            assert cache.get_seq_length() == 0 and not any(cache.block_tables())
        del cache, shadow  # "drop": the finalizer returns the blocks (refcounting, no gc needed)

    @precondition(lambda self: self.pool is not None)
    @rule()
    def clear_prefix_cache(self) -> None:
        self.pool.clear_prefix_cache()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def pool_consistent(self) -> None:
        STEPS[0] += 1
        if self.pool is None:
            return
        self.pool.check()
        if self.pool.allocators is not None:
            for allocator in self.pool.allocators:
                assert len(allocator.free_ids) + len(allocator.evictable) + sum(
                    b.ref_count > 0 for b in allocator.blocks
                ) == allocator.capacity
        for shadow in self.shadows:
            assert_readback(self.pool, shadow)

    def teardown(self) -> None:
        if self.pool is None:
            return
        for shadow in self.shadows:
            shadow.cache.release()
        self.shadows.clear()
        if any(b.ref_count for a in self.pool.allocators or [] for b in a.blocks):
            gc.collect()  # only if a dropped cache sits in a reference cycle (its finalizer then runs here)
        self.pool.check()
        assert_pool_whole(self.pool)
        TOTALS["forwards"] += self.forwards
        TOTALS["ooms"] += self.ooms
        TOTALS["prefix_hit_tokens"] += self.prefix_hits
        TOTALS["moves"] += sum(a.num_moves for a in self.pool.allocators or [])


def assert_pool_whole(pool: hf_paged.KVPool) -> None:
    """No block is referenced; every block is free or cached; clearing the index frees them all."""
    for allocator in pool.allocators or []:
        assert all(b.ref_count == 0 for b in allocator.blocks), "a block is still referenced"
        assert len(allocator.free_ids) + len(allocator.evictable) == allocator.capacity
    stats = pool.stats()
    assert stats.blocks_in_use == 0 and stats.tokens_stored == 0
    pool.clear_prefix_cache()
    for allocator in pool.allocators or []:
        assert sorted(allocator.free_ids) == list(range(allocator.capacity)) and not allocator.index


def assert_readback(pool: hf_paged.KVPool, shadow: Shadow) -> None:
    """K/V gathered through the cache's block tables equal the K/V of the shadow's tokens."""
    cache = shadow.cache
    if not shadow.interrupted:
        assert cache.get_seq_length() == shadow.columns
        seq_lens = cache.seq_lens
        if any(seq_lens) or any(shadow.tokens):  # rows holding no token may be forgotten
            assert seq_lens == [len(t) for t in shadow.tokens]
    if not any(shadow.tokens):  # nothing to read back (a rollback to zero tokens may forget the rows)
        return
    if not pool.key_caches:
        return
    bs = pool.block_size
    for layer in range(NUM_LAYERS):
        slots, expected = [], []
        for b, tokens in enumerate(shadow.tokens):
            table = cache.block_table(b, layer)  # a missing row raises, a missing block fails the lookup
            for p in range(len(tokens)):
                block_id = table[p // bs]
                if block_id < 0:  # freed: outside a sliding window
                    continue
                slots.append(block_id * bs + p % bs)
                expected.append(token_kv(shadow.salt, tuple(tokens[: p + 1]))[layer])
        if not slots:
            continue
        key_cache = pool.key_caches[layer].view(-1, NUM_KV_HEADS, HEAD_DIM)
        value_cache = pool.value_caches[layer].view(-1, NUM_KV_HEADS, HEAD_DIM)
        index = torch.tensor(slots)
        expected_kv = torch.stack(expected)
        assert torch.equal(key_cache[index], expected_kv[:, 0]), f"layer {layer}: keys read back differ"
        assert torch.equal(value_cache[index], expected_kv[:, 1]), f"layer {layer}: values read back differ"


def reference_attention(
    query: torch.Tensor, salt: str | None, tokens: list[int], layer: int, n: int, window: int | None
) -> torch.Tensor:
    """`[heads, n, head_dim]` causal attention of the last `n` tokens over all `tokens`' K/V (float32)."""
    kv = torch.stack([token_kv(salt, tuple(tokens[: p + 1]))[layer] for p in range(len(tokens))])
    keys = kv[:, 0].repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1).transpose(0, 1)  # [heads, L, D]
    values = kv[:, 1].repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1).transpose(0, 1)
    scores = query.float() @ keys.transpose(1, 2) * HEAD_DIM**-0.5  # [heads, n, L]
    q_pos = torch.arange(len(tokens) - n, len(tokens))[:, None]
    k_pos = torch.arange(len(tokens))[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.softmax(scores, -1) @ values


@seed(HYBRID_RUN_SEED)  # another operation sequence than PoolMachine's
class HybridPoolMachine(PoolMachine):
    hybrid = True


STEPS = [0]
TOTALS = {"forwards": 0, "ooms": 0, "prefix_hit_tokens": 0, "moves": 0}

#: Deterministic in CI: fixed seeds (`RUN_SEED`, `HYBRID_RUN_SEED`), no example database. About 1,900 +
#: 2,100 steps (each followed by `pool.check()` and a full K/V read-back) in ~10 s; the test asserts how
#: many really ran. `HF_PAGED_PROPERTY_EXAMPLES=1000` runs longer (about 100 s for ~100,000 steps).
SETTINGS = settings(
    max_examples=int(os.environ.get("HF_PAGED_PROPERTY_EXAMPLES", "40")),
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)


@pytest.fixture()
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("machine", [PoolMachine, HybridPoolMachine], ids=["full-attention", "hybrid-sliding"])
def test_random_operations_keep_invariants(machine, one_thread, monkeypatch):
    if machine.hybrid:  # free out-of-window blocks early, so sliding groups really free and crop can fail
        monkeypatch.setattr(rows_module, "SLIDING_MARGIN", 2)
    STEPS[0] = 0
    for key in TOTALS:
        TOTALS[key] = 0
    run_state_machine_as_test(machine, settings=SETTINGS)
    print(f"{machine.__name__}: {STEPS[0]} steps, {TOTALS}")
    assert STEPS[0] >= 1000, f"only {STEPS[0]} state-machine steps ran"
    # The runs really exercised forwards, exhaustion, prefix hits and cached blocks moved out of a lone row's way
    # (not only trivial operations).
    assert TOTALS["forwards"] >= 50 and TOTALS["ooms"] >= 5 and TOTALS["prefix_hit_tokens"] >= 20, TOTALS
    assert TOTALS["moves"] >= 5, TOTALS
