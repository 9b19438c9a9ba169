"""Bad input gets a clear error and corrupts nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

import hf_paged
from hf_paged.attention.plan import AttentionFeatures
from helpers import left_padded, load, paged_llama_one_thread, saved_model


model = pytest.fixture(scope="module")(paged_llama_one_thread)


def greedy(model, ids, mask, cache, max_new_tokens=4):
    return model.generate(
        input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=0,
    )


IDS, MASK = left_padded([6, 3], seed=5)


@pytest.mark.parametrize(
    "overrides, dtype",
    [
        (dict(num_key_value_heads=4), torch.float32),
        (dict(head_dim=8), torch.float32),
        (dict(num_hidden_layers=3), torch.float32),
        (dict(num_hidden_layers=1), torch.float32),  # fewer layers: forwards would never complete
        ({}, torch.bfloat16),
    ],
    ids=["heads", "head_dim", "more-layers", "fewer-layers", "dtype"],
)
@pytest.mark.parametrize("reuse", ["cache", "pool"])
def test_other_model_shape_is_refused_and_nothing_is_corrupted(model, overrides, dtype, reuse):
    other = load(saved_model("llama", **overrides), "paged", dtype=dtype)
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=64)
    cache = pool.new_cache()
    first = greedy(model, IDS, MASK, cache, max_new_tokens=2)
    next_mask = torch.cat([MASK, torch.ones_like(first[:, IDS.shape[1] :])], 1)
    with pytest.raises(hf_paged.CacheMismatchError, match="one model"):
        if reuse == "cache":  # continue the conversation with another model
            greedy(other, first, next_mask, cache)
        else:
            greedy(other, IDS, MASK, pool.new_cache())
    pool.check()
    # The first model's cache still continues correctly.
    out = greedy(model, first, next_mask, cache, max_new_tokens=2)
    assert torch.equal(out, greedy(model, IDS, MASK, hf_paged.PagedCache()))
    cache.release()
    pool.check()
    assert pool.stats().blocks_in_use == 0


def test_wrong_device_is_refused(model):
    """K/V arriving on another device than the pool's tensors (meta stands in for a GPU here)."""
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=64)
    cache = pool.new_cache()
    greedy(model, IDS, MASK, cache, max_new_tokens=1)
    attn = model.model.layers[0].self_attn
    q = torch.empty(2, 4, 1, 16, device="meta")
    kv = torch.empty(2, 2, 1, 16, device="meta")
    with pytest.raises(hf_paged.CacheMismatchError, match="device"):
        cache.attend(attn, q, kv, kv, 0, None, AttentionFeatures(0.25))
    pool.check()
    length = cache.get_seq_length()
    cache.reorder_cache(torch.tensor([0, 1]))  # between forwards: the partial forward is rolled back
    assert cache.get_seq_length() == length - 1 or cache.get_seq_length() == length
    pool.check()
    cache.release()
    assert pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("block_size", [0, -4, 1.5, True, "16", None])
def test_invalid_block_size(block_size):
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        hf_paged.KVPool(block_size=block_size)
    if block_size is not None:  # PagedCache(block_size=None) means the default
        with pytest.raises(ValueError, match="block_size must be a positive int"):
            hf_paged.PagedCache(block_size=block_size)


def test_invalid_pool_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        hf_paged.KVPool(num_blocks=0)
    with pytest.raises(ValueError, match="max_memory"):
        hf_paged.KVPool(max_memory=-1)
    with pytest.raises(ValueError, match="not both"):
        hf_paged.KVPool(num_blocks=4, max_memory=1 << 20)
    with pytest.raises(ValueError, match="differs from the pool"):
        hf_paged.PagedCache(pool=hf_paged.KVPool(block_size=8), block_size=16)


def test_out_of_range_row_operations_and_crop(model):
    pool = hf_paged.KVPool(model.config, block_size=4, num_blocks=64)
    cache = pool.new_cache()
    greedy(model, IDS, MASK, cache, max_new_tokens=2)
    length = cache.get_seq_length()
    refs = cache.block_tables()
    bad = [
        (lambda: cache.crop(-(length + 1)), ValueError, "removes more than"),
        (lambda: cache.reorder_cache(torch.tensor([0, 2])), IndexError, "out of range"),
        (lambda: cache.reorder_cache(torch.tensor([-1, 0])), IndexError, "out of range"),
        (lambda: cache.batch_select_indices(torch.tensor([5])), IndexError, "out of range"),
        (lambda: cache.reorder_cache(torch.tensor([True, False])), ValueError, "row indices, got a boolean"),
        (lambda: cache.batch_select_indices(torch.tensor([True, False, True])), ValueError, "mask of 2 entries"),
        (lambda: cache.batch_select_indices(torch.tensor([[0, 1]])), ValueError, "1-D sequence of row indices"),
    ]
    for op, exc, message in bad:
        with pytest.raises(exc, match=message):
            op()
        pool.check()
        assert cache.get_seq_length() == length and cache.block_tables() == refs
    cache.crop(length + 10)  # a length to keep beyond what is cached: nothing to remove (as DynamicCache)
    assert cache.get_seq_length() == length
    cache.batch_select_indices(torch.tensor([False, True]))  # a boolean mask keeps the rows it selects
    assert cache.block_tables() == refs[1:]
    cache.release()
    pool.check()


def test_encoder_decoder_model_is_refused_under_paged():
    config = AutoConfig.for_model(
        "t5", vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0
    )
    t5 = AutoModelForSeq2SeqLM.from_config(config).eval()
    t5.set_attn_implementation("paged")
    with pytest.raises(hf_paged.UnsupportedModelError, match="encoder-decoder.*EncoderDecoderPagedCache"):
        t5.generate(input_ids=torch.tensor([[1, 2, 3]]), **hf_paged.cache_kwargs(hf_paged.PagedCache()), max_new_tokens=2)


def test_model_with_its_own_attention_code_is_refused_under_paged():
    config = AutoConfig.for_model("bloom", vocab_size=64, hidden_size=16, n_layer=1, n_head=2)
    with pytest.raises(hf_paged.UnsupportedModelError, match="attention code of its own"):  # at load, nothing built
        AutoModelForCausalLM.from_config(config, attn_implementation="paged")


def test_model_without_a_kv_cache_rejects_the_cache():
    config = AutoConfig.for_model("mamba", vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4)
    mamba = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="past_key_values"):  # transformers' own check
        mamba.generate(input_ids=torch.tensor([[1, 2, 3]]), **hf_paged.cache_kwargs(hf_paged.PagedCache()), max_new_tokens=2)


def test_paged_requested_before_import_fails_clearly_and_works_after():
    make = (
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "c = AutoConfig.for_model('llama', vocab_size=64, hidden_size=16, intermediate_size=32, "
        "num_hidden_layers=1, num_attention_heads=2)\n"
        "m = AutoModelForCausalLM.from_config(c, attn_implementation='paged')\n"
        "print(m.config._attn_implementation)\n"
    )
    before = subprocess.run([sys.executable, "-c", make], capture_output=True, text=True, timeout=120)
    assert before.returncode != 0
    assert 'attn_implementation="paged"' in before.stderr and "not supported" in before.stderr
    after = subprocess.run([sys.executable, "-c", "import hf_paged\n" + make], capture_output=True, text=True, timeout=120)
    assert after.returncode == 0, after.stderr[-2000:]
    assert after.stdout.strip().endswith("paged")
