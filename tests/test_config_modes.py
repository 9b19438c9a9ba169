"""`PagedCache(config=model.config)` knows from the config alone which models read their K/V gathered (the
matrix's "gather" rows: multi-latent attention, JetMoE's per-expert repeat; `hf_paged.support.reads_gathered`)
and gives the reference's tokens on them, as `PagedCache()` does by learning it on the first forward. Before
JetMoE was named there, a config-made cache raised "changes the K/V" on it (transformers' generate tests with
hf-paged's suite plugin, which builds caches with config=)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_paged

from matrix import Case, load, passing, saved_case

GATHER = [case for case in passing() if case.mode == "gather"]


def test_the_matrix_has_gather_rows() -> None:
    assert {"jetmoe", "deepseek_v3"} <= {case.model_type for case in GATHER}


@pytest.mark.parametrize("case", GATHER, ids=lambda c: c.id)
def test_config_made_cache_on_models_that_read_gathered(case: Case) -> None:
    path = saved_case(case)
    paged_model, ref_model = load(path, "paged"), load(path, case.ref)
    ids = torch.randint(3, 120, (2, 7), generator=torch.Generator().manual_seed(2))
    common = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                  pad_token_id=0, eos_token_id=None)
    cache = hf_paged.PagedCache(config=paged_model.config, block_size=4)
    ours = paged_model.generate(**hf_paged.cache_kwargs(cache), **common)
    assert cache.mode == "gather"
    theirs = ref_model.generate(**hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)), **common)
    assert torch.equal(ours, theirs)
    cache.pool.check()
