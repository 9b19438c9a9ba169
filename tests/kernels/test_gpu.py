"""GPU-only checks (`pytest -m gpu`, run by `make gpu-check`): the compiled kernels on the device against
the float32 reference, the split-KV heuristic on a long context, launches on the tensors' own device, and
generate() through the Triton path. Skipped without CUDA; a failure under the interpreter (`TRITON_INTERPRET=1`,
the CPU sessions' default), which would check the interpreter instead of the compiled kernels."""

from __future__ import annotations

import os

import pytest
import torch

from tests.reference import make_paged_inputs, reference_paged_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def compiled_kernels():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("the GPU tests check the compiled kernels: run them with TRITON_INTERPRET=0, as `make gpu-check` "
                    "does")


TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize(
    "head_dim,heads,kv_heads,block_size,dtype,seq_lens,query_lens,q_len",
    [
        (128, 32, 8, 16, torch.bfloat16, [4100, 77], [1, 1], 1),  # GQA 4 decode, long: split-KV heuristic
        (64, 16, 16, 16, torch.float16, [3000, 5], [1, 1], 1),  # MHA decode: 1-row tiles
        (72, 8, 2, 32, torch.float16, [300, 129], [129, 17], 129),  # odd head dim prefill over a prefix
        (256, 8, 4, 1, torch.bfloat16, [97, 54], [5, 5], 5),  # d256, block size 1
        (24, 4, 1, 12, torch.float32, [200, 33], [3, 1], 3),  # generic block size, fp32
    ],
)
def test_kernels_on_gpu_match_reference(head_dim, heads, kv_heads, block_size, dtype, seq_lens, query_lens, q_len):
    from hf_paged.kernels import paged_attention

    inp = make_paged_inputs(seq_lens=seq_lens, query_lens=query_lens, q_len=q_len, num_heads=heads,
                            num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                            device="cuda")
    out = paged_attention(query=inp.query, key_cache=inp.key_cache, value_cache=inp.value_cache,
                          block_tables=inp.block_tables, seq_lens=inp.seq_lens, query_lens=inp.query_lens,
                          scale=head_dim**-0.5, softcap=30.0 if head_dim == 256 else None)
    ref = reference_paged_attention(inp.query, inp.key_cache, inp.value_cache, inp.block_tables, inp.seq_lens,
                                    inp.query_lens, scale=head_dim**-0.5,
                                    softcap=30.0 if head_dim == 256 else None)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_launch_follows_the_tensors_device():
    """Kernels launch on their tensors' device even when another device is current."""
    from hf_paged.kernels import paged_attention, write_kv_cache

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    inp = make_paged_inputs(seq_lens=[40], query_lens=[1], num_heads=4, num_kv_heads=2, head_dim=64,
                            block_size=16, dtype=torch.float16, device=device)
    ref = reference_paged_attention(inp.query, inp.key_cache, inp.value_cache, inp.block_tables, inp.seq_lens,
                                    inp.query_lens, scale=0.125)
    with torch.cuda.device(0):
        out = paged_attention(query=inp.query, key_cache=inp.key_cache, value_cache=inp.value_cache,
                              block_tables=inp.block_tables, seq_lens=inp.seq_lens, query_lens=inp.query_lens,
                              scale=0.125)
        key = torch.randn(1, 1, 2, 64, dtype=torch.float16, device=device)
        write_kv_cache(key=key, value=key, key_cache=inp.key_cache, value_cache=inp.value_cache,
                       slot_mapping=torch.tensor([[3]], device=device))
    assert out.device == device
    torch.testing.assert_close(out.float(), ref, atol=3e-3, rtol=3e-3)
    assert torch.equal(inp.key_cache.view(-1, 2, 64)[3], key[0, 0])


def test_generate_on_gpu_with_paged_cache_matches_dynamic_cache(tmp_path):
    """generate() through the Triton path (PagedCache + "paged") gives DynamicCache + sdpa's tokens (fp32)."""
    import hf_paged
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).cuda().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # peaked logits: greedy tokens are stable under float reordering
    ids = torch.randint(1, 128, (3, 21), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    want = model.generate(**kwargs, **hf_paged.cache_kwargs(DynamicCache()))
    model.set_attn_implementation("paged")
    got = model.generate(**kwargs, **hf_paged.cache_kwargs(hf_paged.PagedCache()))
    assert torch.equal(got, want)


def _peaked_llama(num_layers: int = 2):
    """A tiny float32 Llama on the GPU with peaked logits (greedy tokens stable under float reordering)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).cuda().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model


def _prompts(num: int, seed: int, shared: int = 0) -> list[list[int]]:
    """`num` prompts of 2-60 tokens; with `shared`, each starts with the same `shared` tokens (prefix hits)."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 128, (shared,), generator=gen, device="cpu").tolist()
    return [head + torch.randint(3, 128, (int(n),), generator=gen, device="cpu").tolist()
            for n in torch.randint(2, 60, (num,), generator=gen, device="cpu")]


def test_engine_on_gpu_gives_generates_tokens():
    """The Engine's packed steps (prefill chunks and decodes of several rows in one forward, Triton on the GPU) give
    each request what `generate()` with DynamicCache + sdpa gives it alone; the later prompts hit the earlier ones'
    cached prefix blocks."""
    import hf_paged
    from transformers import DynamicCache

    model = _peaked_llama()
    prompts = _prompts(6, seed=1) + _prompts(4, seed=2, shared=40)
    model.set_attn_implementation("sdpa")
    want = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             pad_token_id=0, **hf_paged.cache_kwargs(DynamicCache()))
        want.append(out[0, len(prompt):].tolist())
    model.set_attn_implementation("paged")
    pool = hf_paged.KVPool(model.config, num_blocks=256, block_size=16)
    engine = hf_paged.Engine(model, pool, max_seqs=4, max_batch_tokens=64, on_step=lambda e: e.pool.check())
    got = engine.generate(prompts, max_new_tokens=16, do_sample=False, eos_token_id=None, progress=False)
    assert got == want
    assert engine.stats().prefix_hit_tokens > 0


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8_e4m3"])
def test_cuda_graph_engine_gives_the_eager_engines_tokens(kv_dtype):
    """`Engine(compile="reduce-overhead")`: the decode step recorded as CUDA graphs per batch bucket and replayed,
    the Triton kernels inside them, on plain and quantized pools: the eager engine's tokens."""
    import hf_paged

    model = _peaked_llama()
    model.set_attn_implementation("paged")
    prompts = _prompts(12, seed=3)

    def engine(**kwargs) -> hf_paged.Engine:
        pool = hf_paged.KVPool(model.config, num_blocks=256, block_size=16, kv_dtype=kv_dtype)
        return hf_paged.Engine(model, pool, max_seqs=8, on_step=lambda e: e.pool.check(), **kwargs)

    options = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, progress=False)
    want = engine().generate(prompts, **options)
    compiled = engine(compile="reduce-overhead")
    assert compiled.generate(prompts, **options) == want
    assert compiled.graphs.warmed_up and not compiled.graphs.traces_attention


def test_a_cuda_default_device_changes_nothing():
    """`torch.set_default_device("cuda")`, as GPU notebooks set it: `generate()` with a `PagedCache` and the Engine
    give the tokens they give with the default device left alone (`tests/test_default_device.py` checks every
    host-side tensor's device on a CPU, with `meta` as the default)."""
    import hf_paged

    model = _peaked_llama()
    model.set_attn_implementation("paged")
    ids = torch.randint(1, 128, (3, 21), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    prompts = _prompts(5, seed=4, shared=20)
    options = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, progress=False)

    def run():
        engine = hf_paged.Engine(model, hf_paged.KVPool(model.config, num_blocks=128, block_size=16), max_seqs=4)
        return model.generate(**kwargs, **hf_paged.cache_kwargs(hf_paged.PagedCache())), engine.generate(prompts, **options)

    want_tokens, want_outputs = run()
    previous = torch.get_default_device()
    torch.set_default_device("cuda")
    try:
        got_tokens, got_outputs = run()
    finally:
        torch.set_default_device(previous)
    assert torch.equal(got_tokens, want_tokens) and got_outputs == want_outputs


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_device_map_over_two_gpus_keeps_each_layers_blocks_on_its_device(tmp_path):
    """Layers split over cuda:0 and cuda:1 (`device_map`): each layer's blocks live on its layer's device,
    every launch runs there, and generate() gives DynamicCache + sdpa's tokens."""
    import hf_paged
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(tmp_path)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    model = LlamaForCausalLM.from_pretrained(tmp_path, device_map=device_map, dtype=torch.float32).eval()
    ids = torch.randint(1, 128, (2, 19), device="cuda:0")
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                  pad_token_id=0)
    model.set_attn_implementation("sdpa")
    want = model.generate(**kwargs, **hf_paged.cache_kwargs(DynamicCache()))
    model.set_attn_implementation("paged")
    cache = hf_paged.PagedCache(block_size=16)
    got = model.generate(**kwargs, **hf_paged.cache_kwargs(cache))
    assert torch.equal(got.cpu(), want.cpu())
    assert [layer.keys.device.index for layer in cache.layers] == [0, 0, 1, 1]
    cache.pool.check()
