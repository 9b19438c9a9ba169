"""Multi-latent attention: K and V of different widths (`head_dim` vs `head_dim_v`).

Two ways such K/V reach a `PagedCache`:
  * DeepSeek V2/V3 in transformers cache compressed latents (`kv_lora_rank` wide "keys", `qk_rope_head_dim`
    wide "values", one head) and expand them after `update()`; the blocks store the latents and the model reads
    them gathered (`hf_paged.support.reads_gathered`). Compared with the default cache + sdpa/eager.
  * A module that hands `update()` per-head K and V of their own widths (K 192 / V 128) and attends what it
    returns: the zero-copy `"paged"` path, on the PyTorch and the Triton backend (interpreted on CPU).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

import hf_paged
from hf_paged.memory import rotation
from hf_paged.attention.paged import paged_attention_forward, paged_mask
from hf_paged.errors import CacheMismatchError
from helpers import left_padded
from matrix import MLA_DIMS, load, saved

KV_LORA_RANK, ROPE_DIM = MLA_DIMS["kv_lora_rank"], MLA_DIMS["qk_rope_head_dim"]
NEW_TOKENS = 7


@pytest.fixture(scope="module")
def deepseek():
    """The matrix's tiny DeepSeek V3 (K 24 / V 16 per head; latents 16 / 8), paged and sdpa/eager references."""
    path = saved("deepseek_v3", tuple(sorted(MLA_DIMS.items())))
    return load(path, "paged"), load(path, "sdpa"), load(path, "eager")


def _generate(model, cache, ids, mask, seed=0, **kwargs):
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=None,
              return_dict_in_generate=True, output_logits=True, do_sample=False)
    kw.update(kwargs)
    torch.manual_seed(seed)
    return model.generate(**hf_paged.cache_kwargs(cache), **kw)


def _assert_same(paged, reference, atol=1e-4):
    assert torch.equal(paged.sequences, reference.sequences)
    for a, b in zip(paged.logits, reference.logits, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("ref", ["sdpa", "eager"])
@pytest.mark.parametrize("with_config", [False, True], ids=["PagedCache()", "PagedCache(config)"])
def test_deepseek_matches_default_cache(deepseek, ref, with_config):
    paged_model, sdpa_model, eager_model = deepseek
    ref_model = sdpa_model if ref == "sdpa" else eager_model
    ids, mask = left_padded([5, 11, 2], seed=3, low=3)
    cache = hf_paged.PagedCache(paged_model.config if with_config else None, block_size=4)
    paged = _generate(paged_model, cache, ids, mask)
    reference = _generate(ref_model, DynamicCache(config=ref_model.config), ids, mask)
    _assert_same(paged, reference)
    assert cache.mode == "gather"
    # the blocks hold the latents: "K" kv_lora_rank wide, "V" qk_rope_head_dim wide, one head
    key_cache, value_cache = cache.pool.layer_storage(0)
    assert key_cache.shape[2:] == (1, KV_LORA_RANK) and value_cache.shape[2:] == (1, ROPE_DIM)
    stats = cache.stats()
    data = sum(t.nbytes for t in (*cache.pool.key_caches.values(), *cache.pool.value_caches.values()))
    assert stats.bytes_reserved == data
    per_block = 2 * 4 * (KV_LORA_RANK + ROPE_DIM) * 4  # 2 layers x block_size x (K + V widths) x fp32
    assert stats.bytes_in_use == stats.blocks_in_use * per_block
    cache.pool.check()


def test_deepseek_sampling_and_beams(deepseek):
    paged_model, sdpa_model, _ = deepseek
    ids, mask = left_padded([6, 9], seed=4, low=3)
    for kwargs in (dict(do_sample=True, top_k=0, seed=7), dict(num_beams=3, num_return_sequences=2)):
        cache = hf_paged.PagedCache(block_size=4)
        paged = _generate(paged_model, cache, ids, mask, **kwargs)
        reference = _generate(sdpa_model, DynamicCache(config=sdpa_model.config), ids, mask, **kwargs)
        _assert_same(paged, reference)
        cache.pool.check()


def test_deepseek_kvpool_prefix_hit(deepseek):
    paged_model, sdpa_model, _ = deepseek
    pool = hf_paged.KVPool(paged_model.config, block_size=4)
    ids, mask = left_padded([13], seed=5, low=3)
    reference = _generate(sdpa_model, DynamicCache(config=sdpa_model.config), ids, mask)
    with pool.new_cache(ids, mask) as first:
        _assert_same(_generate(paged_model, first, ids, mask), reference)
    with pool.new_cache(ids, mask) as second:  # 12 of the 13 prompt tokens come from the blocks
        assert second.get_seq_length() == 12
        _assert_same(_generate(paged_model, second, ids, mask), reference)
    assert pool.stats().prefix_hit_tokens == 12
    pool.check()


def test_deepseek_int8_latents(deepseek):
    paged_model, _, _ = deepseek
    ids, mask = left_padded([5, 11], seed=6, low=3)
    plain = hf_paged.PagedCache(block_size=4)
    quantized = hf_paged.PagedCache(block_size=4, kv_dtype="int8")
    a = _generate(paged_model, plain, ids, mask)
    b = _generate(paged_model, quantized, ids, mask)
    assert quantized.pool.layer_storage(0)[1].dtype == torch.int8
    assert quantized.pool.layer_storage(0)[1].shape[-1] == ROPE_DIM
    for which in (0, 1):  # what the model reads back of the prompt's first-layer latents: within int8's rounding
        want, got = plain.layer_kv(0, which), quantized.layer_kv(0, which)
        assert got.shape == want.shape
        want, got = want[:, :, : ids.shape[1]], got[:, :, : ids.shape[1]]
        bound = want.abs().amax(-1, keepdim=True) / 254 + 1e-6
        assert bool(((got - want).abs() <= bound * 1.01).all())
        assert not torch.equal(got, want)
    spread = max(float(x.abs().max()) for x in a.logits)
    assert max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits, strict=True)) < 0.05 * spread
    quantized.pool.check()


def test_kvpool_max_memory_counts_both_widths(deepseek):
    paged_model, _, _ = deepseek
    per_block_all_layers = 2 * 4 * (KV_LORA_RANK + ROPE_DIM) * 4  # layers x block_size x widths x fp32
    pool = hf_paged.KVPool(paged_model.config, block_size=4, max_memory=10 * per_block_all_layers + 5)
    ids, mask = left_padded([6], seed=7, low=3)
    with pool.new_cache() as cache:
        _generate(paged_model, cache, ids, mask)
    assert pool.stats().blocks_total == 10
    assert pool.stats().bytes_reserved == 10 * per_block_all_layers


def test_value_width_is_checked_on_later_writes():
    pool = hf_paged.KVPool(block_size=4, num_blocks=4)
    key = torch.zeros(1, 2, 1, 24)
    pool.ensure_allocators(key, 16)
    key_cache, value_cache = pool.storage_for_write(0, key, 16)
    assert key_cache.shape == (4, 4, 2, 24) and value_cache.shape == (4, 4, 2, 16)
    assert pool.storage_for_write(0, key, 16)[1] is value_cache
    with pytest.raises(CacheMismatchError, match="head_dim_v"):
        pool.storage_for_write(0, key, 24)


# ------------------------------------------------------------------ the zero-copy "paged" path, synthetic module
class _Attention(torch.nn.Module):
    """What transformers' attention modules offer the attention function."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True


def _run_steps(cache, config, steps, scale, reference: bool):
    """Feeds `steps` (per forward, per layer `(q, k, v)`) through `cache`, the way a model's layers do.

    `reference`: attend the K/V a `DynamicCache` returns with sdpa instead of the paged attention.
    Returns per forward the per-layer outputs `[batch, q_len, num_heads, head_dim_v]`.
    """
    modules = [_Attention(config, i) for i in range(config.num_hidden_layers)]
    outs = []
    for step in steps:
        q_len = step[0][0].shape[2]
        past = cache.get_seq_length()
        if not reference:
            paged_mask(batch_size=step[0][0].shape[0], q_length=q_len, kv_length=past + q_len, q_offset=past)
        layer_outs = []
        for module, (q, k, v) in zip(modules, step, strict=True):
            k, v = cache.update(k, v, module.layer_idx)
            if reference:
                groups = q.shape[1] // k.shape[1]
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=q_len > 1, scale=scale
                ).transpose(1, 2)
            else:
                o, _ = paged_attention_forward(module, q, k, v, None, scaling=scale)
            layer_outs.append(o)
        outs.append(layer_outs)
        if not reference:
            cache.finish_forward()
    return outs


@pytest.mark.filterwarnings("error:hf_paged. using the PyTorch path:RuntimeWarning")  # the Triton path must take it
@pytest.mark.parametrize(
    ("backend", "kv_dtype"),
    [pytest.param(backend, kv_dtype, id=f"{kv_dtype}-{backend}",
                  marks=pytest.mark.kernels if (backend, kv_dtype) == ("triton", "fp8_e4m3") else ())
     for kv_dtype in (None, "int8", "fp8_e4m3") for backend in ("torch", "triton")],
)
@pytest.mark.parametrize(
    "head_dim,head_dim_v,num_heads,num_kv_heads", [(24, 16, 4, 2), (192, 128, 2, 2)], ids=["d24v16-gqa", "d192v128-mha"]
)
def test_paged_path_value_head_dim_of_its_own(monkeypatch, backend, kv_dtype, head_dim, head_dim_v, num_heads,
                                              num_kv_heads):
    """Prefill then decode through `update()` + the `"paged"` attention with K/V of their own widths: output of
    V's width, equal to sdpa over a DynamicCache (quantized: over the K/V the pool gives back). float8 on the Triton
    path is marked `kernels` (`make test-kernels`: the float8 write is slow under the interpreter)."""
    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         head_dim=head_dim, hidden_size=num_heads * head_dim)
    config._attn_implementation = "paged"
    gen = torch.Generator().manual_seed(head_dim)
    steps = []
    for q_len in (9, 1, 1, 1):  # prefill crossing blocks, then decode
        steps.append([
            (torch.randn(2, num_heads, q_len, head_dim, generator=gen),
             torch.randn(2, num_kv_heads, q_len, head_dim, generator=gen),
             torch.randn(2, num_kv_heads, q_len, head_dim_v, generator=gen))
            for _ in range(config.num_hidden_layers)
        ])
    cache = hf_paged.PagedCache(config, block_size=4, kv_dtype=kv_dtype)
    got = _run_steps(cache, config, steps, 0.3, reference=False)
    assert cache.mode == "paged"
    assert cache.pool.layer_storage(0)[1].shape[-1] == head_dim_v
    if kv_dtype is not None:  # the reference attends what the pool gives back: fake-quantized K/V (float8: rotated
        fmt = hf_paged.memory.quant.kv_format(kv_dtype)  # by one matrix per width, quantized, rotated back)

        def fq(x):
            if not fmt.rotate:
                return hf_paged.memory.quant.fake_quantize(x, fmt.storage_dtype)
            return rotation.from_storage(hf_paged.memory.quant.fake_quantize(rotation.to_storage(x), fmt.storage_dtype))

        steps = [[(q, fq(k), fq(v)) for q, k, v in step] for step in steps]
    want = _run_steps(DynamicCache(), config, steps, 0.3, reference=True)
    for step_got, step_want in zip(got, want, strict=True):
        for a, b in zip(step_got, step_want, strict=True):
            assert a.shape == b.shape == (2, b.shape[1], num_heads, head_dim_v)
            torch.testing.assert_close(a, b, atol=2e-4 if backend == "triton" else 2e-5, rtol=1e-4)
    cache.pool.check()
