"""The hf-suite plugin's patches (tests/hf_suite/plugin.py) work on their own, without transformers' test suite."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_paged
from hf_paged.compat import cache_kwargs, output_cache
from hf_suite import plugin
from helpers import TINY, left_padded


def tiny_llama(**kwargs):
    config = AutoConfig.for_model("llama", **TINY)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, **kwargs).eval()


@pytest.mark.filterwarnings("ignore::UserWarning")  # "paged" over the caller's DynamicCache warns, on purpose
def test_generate_without_cache_runs_paged_cache_and_paged_attention():
    ids, mask = left_padded([5, 3])
    common = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    reference = tiny_llama()
    assert reference.config._attn_implementation == "sdpa"
    expected = reference.generate(ids, **common)
    assert type(output_cache(expected)) is DynamicCache

    with plugin.patched() as counts:
        model = tiny_llama()
        assert model.config._attn_implementation == "paged"
        out = model.generate(ids, **common)
        assert isinstance(output_cache(out), hf_paged.PagedCache)
        assert counts["caches_swapped"] == 1
        assert counts["paged_attend"] > 0 and counts["paged_attention"] >= counts["paged_attend"]
        assert counts["cache_updates"] > 0
        torch.testing.assert_close(out.sequences, expected.sequences)

        # a cache the caller passes, and use_cache=False, are left alone
        mine = DynamicCache(config=model.config)
        model.generate(ids, **cache_kwargs(mine), **common)
        model.generate(ids, use_cache=False, **common)
        assert counts["caches_swapped"] == 1

        # "eager" is turned into "paged"; an explicit other implementation is kept
        assert tiny_llama(attn_implementation="eager").config._attn_implementation == "paged"
        AttentionInterface.register("hf_paged_test_other", sdpa_attention_forward)
        try:
            other = tiny_llama(attn_implementation="hf_paged_test_other")
            assert other.config._attn_implementation == "hf_paged_test_other"
        finally:
            AttentionInterface._global_mapping.pop("hf_paged_test_other", None)

    # undone on exit
    assert hf_paged.is_registered()
    after = tiny_llama()
    assert after.config._attn_implementation == "sdpa"
    assert type(output_cache(after.generate(ids, **common))) is DynamicCache


def test_session_fails_when_the_paged_path_was_never_taken(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_PAGED_SUITE_COUNTS", str(tmp_path / "counts.json"))
    monkeypatch.setitem(plugin._state, "tests", [])
    monkeypatch.setattr(plugin, "COUNTS", type(plugin.COUNTS)())
    session = types.SimpleNamespace(testscollected=3, exitstatus=0)
    plugin.pytest_sessionfinish(session, 0)
    assert session.exitstatus == 1
    plugin.COUNTS["paged_attend"] = 7
    session.exitstatus = 0
    plugin.pytest_sessionfinish(session, 0)
    assert session.exitstatus == 0
    assert '"paged_attend": 7' in (tmp_path / "counts.json").read_text()


@pytest.mark.parametrize("requested", sorted(plugin.SWAPPABLE - {None}))
def test_swappable_requests_become_paged(requested):
    with plugin.patched():
        assert tiny_llama(attn_implementation=requested).config._attn_implementation == "paged"
