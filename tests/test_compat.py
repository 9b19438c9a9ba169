"""The transformers-version layer: private names still there, the cache keyword, `cache.layers`, continuing a cache."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache

import hf_paged
from hf_paged import compat
from hf_paged.cache.layer_views import PagedLayer

from helpers import load, left_padded, saved_model


def test_every_private_transformers_name_is_still_there() -> None:
    missing = compat.check_private_names()
    assert not missing, "transformers changed names hf-paged relies on:\n" + "\n".join(missing)


def test_installed_release_is_in_the_tested_range() -> None:
    low, _ = compat.TESTED_RANGE
    assert Version(transformers.__version__) >= Version(low)


def test_cache_keyword_is_the_one_generate_takes_without_a_warning() -> None:
    model = load(saved_model("llama"), "paged")
    ids, mask = left_padded([4, 6])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, **hf_paged.cache_kwargs(hf_paged.PagedCache()))
    assert isinstance(hf_paged.output_cache(out), hf_paged.PagedCache)


@pytest.mark.parametrize("keyword", sorted({compat.CACHE_KWARG, "past_key_values"}))
def test_second_turn_matches_dynamic_cache_under_each_keyword(keyword: str) -> None:
    """Continuing from a returned cache (a chat's second turn) gives DynamicCache's tokens, under the current
    keyword and the deprecated one."""
    path = saved_model("llama")
    paged_model, ref_model = load(path, "paged"), load(path, "sdpa")
    ids, mask = left_padded([5, 9, 3])
    common = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    caches = hf_paged.PagedCache(), DynamicCache(config=ref_model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        first = [m.generate(input_ids=ids, attention_mask=mask, **{keyword: c}, **common) for m, c in zip((paged_model, ref_model), caches)]
        assert torch.equal(first[0], first[1])
        more = torch.randint(3, 100, (3, 4), generator=torch.Generator().manual_seed(1))
        mask2 = torch.cat([mask, torch.ones(3, first[0].shape[1] - mask.shape[1] + 4, dtype=mask.dtype)], dim=1)
        second = [
            m.generate(input_ids=torch.cat([f, more], dim=1), attention_mask=mask2, **{keyword: c}, **common)
            for m, c, f in zip((paged_model, ref_model), caches, first)
        ]
    assert torch.equal(second[0], second[1])
    caches[0].pool.check()


def test_layers_are_real_views_of_the_blocks() -> None:
    """`cache.layers` has one PagedLayer per model layer whose keys/values equal DynamicCache's."""
    path = saved_model("llama")
    paged_model, ref_model = load(path, "paged"), load(path, "sdpa")
    ids, mask = left_padded([5, 9, 3])
    cache, ref = hf_paged.PagedCache(), DynamicCache(config=ref_model.config)
    assert len(cache.layers) == 0  # no config: the layers are learned from the first forward
    paged_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache))
    ref_model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(ref))
    assert len(cache) == len(cache.layers) == paged_model.config.num_hidden_layers
    assert all(isinstance(layer, PagedLayer) for layer in cache.layers)
    assert not any(cache.is_linear) and cache.is_sliding == [False] * len(cache)
    real = mask.bool()[:, None, :, None]
    for ours, theirs in zip(cache.layers, ref.layers, strict=True):
        assert ours.get_seq_length() == theirs.get_seq_length()
        torch.testing.assert_close(ours.keys * real, theirs.keys * real)
        torch.testing.assert_close(ours.values * real, theirs.values * real)
    with pytest.raises(NotImplementedError, match="call crop"):
        cache.layers[0].crop(-1)
    with pytest.raises(AttributeError, match="read-only"):
        cache.layers[0].keys = None
    with_config = hf_paged.PagedCache(config=paged_model.config)
    assert len(with_config.layers) == paged_model.config.num_hidden_layers


def test_attn_implementation_reads_what_the_config_property_says():
    """The fast read of `config._attn_implementation` agrees with the property, set or not, and after
    `set_attn_implementation`-style assignment; a config without the internal field is read the slow way."""
    from transformers import LlamaConfig

    from hf_paged.compat import attn_implementation

    config = LlamaConfig()
    assert attn_implementation(config) == config._attn_implementation
    for value in ("paged", "sdpa", "eager"):
        config._attn_implementation = value
        assert attn_implementation(config) == config._attn_implementation == value

    class Plain:  # (no transformers machinery: the property's fallback)
        _attn_implementation = "paged"

    assert attn_implementation(Plain()) == "paged"
