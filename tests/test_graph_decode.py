"""The compiled decode step: the custom ops (`opcheck`, numerics against plain attention, padding rows) and
`Engine(compile=True)` (tokens equal to the eager engine's, no graph break, no compile after warm-up)."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from transformers import GenerationConfig

import hf_paged
from hf_paged.attention import ops  # noqa: F401 - registers torch.ops.hf_paged.*
from hf_paged.engine.graph import buckets
from hf_paged.errors import UnsupportedModelError
from tests.helpers import load
from tests.matrix import MODELS, saved_case

pytestmark = pytest.mark.xdist_group("graph")

BLOCK_SIZE = 4


def _pool_and_tables(seq_lens: list[int], num_kv_heads: int = 2, head_dim: int = 8, seed: int = 0):
    """A random pool and per-row tables of shuffled blocks holding each row's `seq_lens[b]` tokens (-1 past them)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 3
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(1, max(-(-n // BLOCK_SIZE) for n in seq_lens))
    table = torch.full((len(seq_lens), width + 2), -1, dtype=torch.int32)
    for row, n in enumerate(seq_lens):
        for j in range(-(-n // BLOCK_SIZE)):
            table[row, j] = ids.pop()
    return key_cache, value_cache, table, torch.tensor(seq_lens, dtype=torch.int32)


def _reference(query, key_cache, value_cache, table, seq_lens, scale, window=None, softcap=None, sinks=None):
    """Row by row: gather the row's keys in order, causal (and windowed) softmax in float64."""
    batch, q_len, num_heads, _ = query.shape
    out = torch.zeros(batch, q_len, num_heads, value_cache.shape[3], dtype=torch.float64)
    groups = num_heads // key_cache.shape[2]
    for row in range(batch):
        n = int(seq_lens[row])
        if n == 0:
            continue
        slots = [int(table[row, k // BLOCK_SIZE]) * BLOCK_SIZE + k % BLOCK_SIZE for k in range(n)]
        keys = key_cache.view(-1, *key_cache.shape[2:])[slots].double()
        values = value_cache.view(-1, *value_cache.shape[2:])[slots].double()
        for t in range(q_len):
            pos = n - q_len + t
            for head in range(num_heads):
                scores = keys[:, head // groups] @ query[row, t, head].double() * scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                visible = torch.arange(n) <= pos
                if window is not None:
                    visible &= torch.arange(n) > pos - window
                scores = scores.masked_fill(~visible, -math.inf)
                if sinks is not None:
                    scores = torch.cat([scores, sinks[head : head + 1].double()])
                probs = torch.softmax(scores, 0)[:n]
                out[row, t, head] = probs @ values[:, head // groups]
    return out


@pytest.mark.parametrize(
    "seq_lens, q_len, features",
    [
        ([5, 17, 1, 9], 1, {}),  # rows of other lengths: one class of two blocks' power, masks
        ([8, 8, 8], 1, {}),  # equal rows: no mask
        ([12, 0, 30, 0], 1, {}),  # padding rows read nothing
        ([6, 21], 3, {}),  # several new tokens per row: causal among them
        ([13, 40], 1, {"window": 5}),
        ([13, 40], 2, {"softcap": 2.0, "sinks": True}),
    ],
)
def test_paged_attention_op_matches_plain_attention(seq_lens, q_len, features):
    key_cache, value_cache, table, lens = _pool_and_tables(seq_lens)
    query = torch.randn(len(seq_lens), q_len, 4, 8)
    sinks = torch.randn(4) if features.get("sinks") else None
    args = (query, key_cache, value_cache, table, lens, 0.3, features.get("window"), features.get("softcap"), sinks)
    out = torch.ops.hf_paged.paged_attention(*args)
    want = _reference(query, key_cache, value_cache, table, lens, 0.3, features.get("window"), features.get("softcap"), sinks)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    assert not out[lens == 0].any()  # padding rows: zeros


def test_write_kv_op_writes_its_slots_and_skips_padding():
    key_cache, value_cache, _, _ = _pool_and_tables([8, 8])
    before_k, before_v = key_cache.clone(), value_cache.clone()
    key, value = torch.randn(3, 1, 2, 8), torch.randn(3, 1, 2, 8)
    slots = torch.tensor([[5], [-1], [13]])
    torch.ops.hf_paged.write_kv(key, value, key_cache, value_cache, slots)
    flat_k, flat_v = key_cache.view(-1, 2, 8), value_cache.view(-1, 2, 8)
    torch.testing.assert_close(flat_k[5], key[0, 0])
    torch.testing.assert_close(flat_v[13], value[2, 0])
    untouched = [s for s in range(flat_k.shape[0]) if s not in (5, 13)]
    assert torch.equal(flat_k[untouched], before_k.view(-1, 2, 8)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, 2, 8)[untouched])


def test_ops_pass_opcheck():
    key_cache, value_cache, table, lens = _pool_and_tables([5, 0, 11])
    query = torch.randn(3, 1, 4, 8)
    torch.library.opcheck(torch.ops.hf_paged.paged_attention.default, (query, key_cache, value_cache, table, lens, 0.3))
    torch.library.opcheck(
        torch.ops.hf_paged.paged_attention.default,
        (query, key_cache, value_cache, table, lens, 0.3, 3, 5.0, torch.randn(4)),
    )
    key, value = torch.randn(3, 1, 2, 8), torch.randn(3, 1, 2, 8)
    slots = torch.tensor([[2], [-1], [30]])
    torch.library.opcheck(torch.ops.hf_paged.write_kv.default, (key, value, key_cache, value_cache, slots))
    torch.library.opcheck(
        torch.ops.hf_paged.write_and_attend.default,
        (query, key, value, key_cache, value_cache, slots, table, lens, 0.3, None, 5.0),
    )


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize(
    "seq_lens, features",
    [
        ([5, 17, 1, 9], {}),
        ([12, 0, 30, 0], {}),  # padding rows read nothing
        ([13, 40, 3], {"window": 5}),  # the first blocks of the long row are not listed
        ([13, 40], {"softcap": 2.0, "sinks": True}),
    ],
)
def test_traced_attention_writes_and_matches_plain_attention(seq_lens, features, head_major):
    """`graph_attention.write_and_attend_blocks` (a compiled CPU step's layers), compiled whole and run eagerly:
    every row's new K/V lands in its slot (padding rows repeat the first row's write), and each row's attention
    over its pairs equals plain attention over its blocks."""
    from hf_paged.attention.graph_attention import StepBlocks, write_and_attend_blocks  # noqa: PLC0415
    from hf_paged.memory.slots import new_pool_tensor  # noqa: PLC0415

    key_pool, value_pool, table, lens = _pool_and_tables(seq_lens, seed=5)
    gen = torch.Generator().manual_seed(6)
    query, key, value = torch.randn(len(seq_lens), 4, 1, 8, generator=gen), *torch.randn(2, len(seq_lens), 2, 1, 8, generator=gen)
    sinks = torch.randn(4, generator=gen) if features.get("sinks") else None
    window, softcap = features.get("window"), features.get("softcap")
    real = [row for row, n in enumerate(seq_lens) if n]
    slots = [int(table[row, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for row, n in enumerate(seq_lens) if n]
    sources = [row if n else real[0] for row, n in enumerate(seq_lens)]
    slot_mapping = torch.tensor([[slots[real.index(row)]] for row in sources])
    blocks = StepBlocks.from_tables(table.long(), lens.long(), BLOCK_SIZE, window, torch.tensor(sources))
    if window is not None:  # the 40-token row's blocks wholly before its window are not read
        assert (blocks.rows == 1).sum() == 2
    want_k, want_v = key_pool.clone(), value_pool.clone()
    want_k.view(-1, 2, 8)[slots] = key[real, :, 0]
    want_v.view(-1, 2, 8)[slots] = value[real, :, 0]
    want = _reference(query.transpose(1, 2), want_k, want_v, table, lens, 0.3, window, softcap, sinks)

    def run(fn):
        pools = [new_pool_tensor(key_pool.shape, torch.float32, torch.device("cpu"), head_major) for _ in "kv"]
        pools[0].copy_(key_pool)
        pools[1].copy_(value_pool)
        out = fn(query, key, value, *pools, slot_mapping, lens, blocks, 0.3, window, softcap, sinks)
        return out, pools

    for fn in (write_and_attend_blocks, torch.compile(write_and_attend_blocks, fullgraph=True, dynamic=True)):
        out, (key_cache, value_cache) = run(fn)
        assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
        assert not out[lens == 0].any()


def test_buckets():
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert buckets(5) == [1, 2, 4, 5]
    assert buckets(1) == [1]


# ---------------------------------------------------------------------- the compiled engine
def _case(model_type: str):
    return next(c for c in MODELS if c.model_type == model_type and not c.label)


def _requests(num: int, seed: int, vocab: int = 128) -> tuple[list[list[int]], list[GenerationConfig]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in torch.randint(2, 40, (num,), generator=gen)]
    configs = [
        GenerationConfig(max_new_tokens=int(n), do_sample=False, eos_token_id=None, pad_token_id=0)
        for n in torch.randint(1, 30, (num,), generator=gen)
    ]
    return prompts, configs


@pytest.fixture(scope="module")
def llama():
    torch.set_num_threads(1)
    return load(saved_case(_case("llama")), "paged")


@pytest.fixture(scope="module")
def compiled_llama(llama):
    """One compiled engine for the module's tests (compiling takes tens of seconds on a CPU)."""
    engine = _eager_engine(llama, compile=True)
    before = dict(dynamo_utils.counters["graph_break"])
    engine.generate([[5, 6, 7]], max_new_tokens=2, progress=False)  # warm-up: every bucket compiled here
    assert dict(dynamo_utils.counters["graph_break"]) == before
    return engine


def _eager_engine(model, **kwargs) -> hf_paged.Engine:
    return hf_paged.Engine(model, hf_paged.KVPool(model.config, num_blocks=400, block_size=BLOCK_SIZE), max_seqs=8,
                           on_step=lambda e: e.pool.check(), **kwargs)


def test_compiled_engine_gives_the_eager_engines_tokens(llama, compiled_llama):
    prompts, configs = _requests(20, seed=1)
    want = _eager_engine(llama).generate(prompts, generation_config=configs, progress=False)
    assert compiled_llama.generate(prompts, generation_config=configs, progress=False) == want


def test_samples_past_the_largest_bucket_decode_in_the_packed_forward(llama, compiled_llama):
    """Four requests of three samples each decode 12 rows at once on an engine of `max_seqs=8` (its largest
    compiled bucket): the rows that do not fit the graph decode in the packed forward, with the eager engine's tokens."""
    prompts, _ = _requests(4, seed=8)
    options = dict(max_new_tokens=6, do_sample=True, num_return_sequences=3, eos_token_id=None, seed=1, progress=False)
    want = _eager_engine(llama).generate(prompts, **options)
    assert compiled_llama.generate(prompts, **options) == want
    assert compiled_llama.graphs.warmed_up


def test_compiled_engine_streams_one_request(llama, monkeypatch):
    """One request at a time on a fresh pool: a prompt, another prompt (its blocks run up to the pool's last id, so
    its last block comes from elsewhere), then two that hit the first prompt's cached blocks. Every decode step
    runs in the graph with its layers' attention traced (the op is never called), and the tokens are the eager
    engine's."""
    gen = torch.Generator().manual_seed(11)
    first, other = (torch.randint(3, 128, (37,), generator=gen).tolist() for _ in range(2))
    prompts = [first, other, first + [9], first + [9, 4]]
    config = GenerationConfig(max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)
    eager = _eager_engine(llama)
    want = [eager.generate([p], generation_config=config, progress=False) for p in prompts]
    compiled = _eager_engine(llama, compile=True)
    assert compiled.graphs.traces_attention
    compiled.generate([[5, 6, 7]], max_new_tokens=2, progress=False)  # warm-up: every bucket compiled here
    steps = []
    real_compiled = compiled.graphs._compiled
    monkeypatch.setattr(compiled.graphs, "_compiled", lambda *a: steps.append(a[0].shape[0]) or real_compiled(*a))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for prompt, tokens in zip(prompts, want, strict=True):
            assert compiled.generate([prompt], generation_config=config, progress=False) == tokens
    assert steps.count(1) == len(prompts) * 8  # every decode step in the graph of the bucket of 1
    assert not [e for e in prof.key_averages() if e.key.startswith("hf_paged::")]  # traced, not the op


def test_compiled_engine_does_not_compile_after_warm_up(compiled_llama):
    """200 requests of every batch size up to max_seqs: each step replays a graph compiled at warm-up."""
    compiled_frames = dynamo_utils.counters["stats"]["unique_graphs"]
    prompts, configs = _requests(200, seed=2)
    out = compiled_llama.generate(prompts, generation_config=configs, progress=False)
    assert len(out) == 200 and all(out)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == compiled_frames


def test_compiled_engine_mixes_speculating_rows_and_preemption(llama, compiled_llama):
    """Prompt-lookup rows (several tokens per row) run eagerly beside the compiled rows; a pool too small for
    every request preempts, and the compiled step's plans are rolled back when the packed forward runs short."""
    prompts, configs = _requests(12, seed=3)
    repeat = [p + p for p in prompts[:4]]
    lookup = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                              prompt_lookup_num_tokens=3)
    all_prompts, all_configs = prompts + repeat, configs + [lookup] * 4
    want = _eager_engine(llama).generate(all_prompts, generation_config=all_configs, progress=False)
    assert compiled_llama.generate(all_prompts, generation_config=all_configs, progress=False) == want
    small = hf_paged.Engine(llama, hf_paged.KVPool(llama.config, num_blocks=40, block_size=BLOCK_SIZE), max_seqs=8,
                            compile=True, on_step=lambda e: e.pool.check())
    assert small.generate(prompts, generation_config=configs, progress=False) == want[:12]
    assert small.stats().preemptions > 0


def test_compiled_engine_refuses_hybrids():
    case = next(c for c in MODELS if c.model_type == "jamba")
    model = load(saved_case(case), "paged")
    with pytest.raises(UnsupportedModelError, match="compile=True"):
        hf_paged.Engine(model, compile=True)


@pytest.mark.models
@pytest.mark.parametrize("model_type", ["mistral", "gemma2", "qwen2", "opt"])
def test_compiled_engine_families(model_type):
    """Sliding windows, soft-capping with alternating layers, biases, learned positions."""
    torch.set_num_threads(1)
    model = load(saved_case(_case(model_type)), "paged")
    prompts, configs = _requests(10, seed=4, vocab=min(128, model.config.vocab_size))
    want = _eager_engine(model).generate(prompts, generation_config=configs, progress=False)
    engine = _eager_engine(model, compile=True)
    assert engine.generate(prompts, generation_config=configs, progress=False) == want


@pytest.mark.models
@pytest.mark.parametrize(
    ("model_type", "kv_dtype"), [("gemma4_text", None), ("gemma3n_text", None), ("gemma4_text", "fp8_e4m3")]
)
def test_compiled_engine_serves_layers_reusing_kv(model_type, kv_dtype):
    """Layers that reuse an earlier layer's K/V (Gemma 3n, Gemma 4: the last two of these four) attend in the graph
    over that layer's blocks and write nothing: traced on an unquantized pool, through the attention op on a
    float8 one (rotated). The eager engine's tokens."""
    torch.set_num_threads(1)
    model = load(saved_case(_case(model_type)), "paged")
    prompts, configs = _requests(10, seed=6, vocab=min(128, model.config.vocab_size))

    def engine(**kwargs) -> hf_paged.Engine:
        pool = hf_paged.KVPool(model.config, num_blocks=400, block_size=BLOCK_SIZE, kv_dtype=kv_dtype)
        return hf_paged.Engine(model, pool, max_seqs=8, on_step=lambda e: e.pool.check(), **kwargs)

    want = engine().generate(prompts, generation_config=configs, progress=False)
    compiled = engine(compile=True)
    assert compiled.pool.layout.readers == {2: 0, 3: 1}
    assert compiled.generate(prompts, generation_config=configs, progress=False) == want
    assert compiled.graphs.traces_attention is (kv_dtype is None)


@pytest.mark.models
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_compiled_engine_on_a_quantized_pool(llama, kv_dtype):
    """int8 and float8 K/V: the ops quantize on write and dequantize on read as the eager paths do, and a float8
    pool's rotation (`memory/rotation.py`) is applied to each layer's query, K/V and output in the graph too."""
    prompts, configs = _requests(10, seed=5)

    def engine(**kwargs) -> hf_paged.Engine:
        pool = hf_paged.KVPool(llama.config, num_blocks=400, block_size=BLOCK_SIZE, kv_dtype=kv_dtype)
        return hf_paged.Engine(llama, pool, max_seqs=8, on_step=lambda e: e.pool.check(), **kwargs)

    want = engine().generate(prompts, generation_config=configs, progress=False)
    assert engine(compile=True).generate(prompts, generation_config=configs, progress=False) == want


def test_paged_attention_op_reads_each_calls_own_tables():
    """Two calls with equal lengths and other block tables (the row classes of one step are reused by its later
    layers only when the tables are the same)."""
    key_cache, value_cache, table, lens = _pool_and_tables([9, 14, 3])
    query = torch.randn(3, 1, 4, 8)
    torch.ops.hf_paged.paged_attention(query, key_cache, value_cache, table, lens, 0.3)
    other = table.clone()
    other[:, :4] = table[:, :4].flip(0)
    other[other == -1] = 0
    out = torch.ops.hf_paged.paged_attention(query, key_cache, value_cache, other, lens, 0.3)
    torch.testing.assert_close(out.double(), _reference(query, key_cache, value_cache, other, lens, 0.3), rtol=1e-4, atol=1e-5)


def test_paged_attention_op_reads_a_consecutive_row_in_place(monkeypatch):
    """A row whose blocks are consecutive ids is read as one view of the pool (no gather), with the same result."""
    key_cache, value_cache, _, lens = _pool_and_tables([23])
    table = torch.tensor([[2, 3, 4, 5, 6, 7, -1]], dtype=torch.int32)
    (row_class,) = ops.row_classes(table, lens, 1, None, BLOCK_SIZE)
    assert row_class.meta.contiguous_start == 2 and row_class.meta.gather_table is None and row_class.every_row
    query = torch.randn(1, 1, 4, 8)
    gathers = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda self, *a: gathers.append(a) or real(self, *a))
    out = torch.ops.hf_paged.paged_attention(query, key_cache, value_cache, table, lens, 0.3)
    monkeypatch.undo()
    assert not gathers
    torch.testing.assert_close(out.double(), _reference(query, key_cache, value_cache, table, lens, 0.3), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_heads", [4, 8, 14])  # 2, 4 and 7 query heads per KV head
@pytest.mark.parametrize("seq_lens", [[9, 14, 11], [13, 13, 13]])  # rows of other lengths attend under a mask
@pytest.mark.parametrize("min_bytes", [None, 0])  # the default threshold (these keys are below it), or none
def test_paged_attention_op_folds_gqa_groups_of_a_decode(num_heads, seq_lens, min_bytes, monkeypatch):
    from hf_paged.attention import torch_backend  # noqa: PLC0415

    if min_bytes is not None:
        monkeypatch.setattr(torch_backend, "FOLD_GQA_MIN_BYTES", min_bytes)
    key_cache, value_cache, table, lens = _pool_and_tables(seq_lens)
    query = torch.randn(3, 1, num_heads, 8)
    calls = []
    real = torch_backend.F.scaled_dot_product_attention
    monkeypatch.setattr(
        torch_backend.F, "scaled_dot_product_attention", lambda q, *a, **kw: calls.append((q.shape, kw)) or real(q, *a, **kw)
    )
    out = torch.ops.hf_paged.paged_attention(query, key_cache, value_cache, table, lens, 0.3)
    monkeypatch.undo()
    # folded: each KV head's query heads as its queries, no enable_gqa (4+ per KV head always; 2 past the threshold)
    expected = (2, num_heads // 2) if num_heads >= 8 or min_bytes == 0 else (num_heads, 1)
    assert calls and all(shape[1:3] == expected and kw.get("enable_gqa", False) == (expected[1] == 1) for shape, kw in calls)
    torch.testing.assert_close(out.double(), _reference(query, key_cache, value_cache, table, lens, 0.3), rtol=1e-4, atol=1e-5)


