"""`output_attentions=True` under "paged" returns the weights on models whose attention module takes
`output_attentions` as a parameter of its own and does not pass it to the attention function (OPT, GPT-2):
"paged" learns it from transformers' output capturing (`hf_paged.compat.attentions_recorded`). Without it those
models returned no attention weights at all, and prompt-lookup decoding with `output_attentions=True` raised
`IndexError` in transformers (`outputs.attentions[0]`)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_paged

from matrix import load, saved


@pytest.mark.parametrize("model_type", ["opt", "gpt2"])
def test_weights_of_models_that_keep_output_attentions_to_themselves(model_type: str) -> None:
    path = saved(model_type)
    paged_model, eager_model = load(path, "paged"), load(path, "eager")
    ids = torch.randint(3, 120, (2, 6), generator=torch.Generator().manual_seed(0))
    ours = paged_model(input_ids=ids, output_attentions=True, **hf_paged.cache_kwargs(hf_paged.PagedCache()))
    theirs = eager_model(input_ids=ids, output_attentions=True, **hf_paged.cache_kwargs(DynamicCache()))
    assert len(ours.attentions) == len(theirs.attentions) == paged_model.config.num_hidden_layers
    for a, b in zip(ours.attentions, theirs.attentions, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["opt", "gpt2"])
def test_prompt_lookup_with_output_attentions(model_type: str) -> None:
    path = saved(model_type)
    paged_model, eager_model = load(path, "paged"), load(path, "eager")
    ids = torch.randint(3, 12, (1, 24), generator=torch.Generator().manual_seed(1))  # repetitive: lookups hit
    common = dict(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None,
                  prompt_lookup_num_tokens=2, output_attentions=True, return_dict_in_generate=True)
    ours = paged_model.generate(**hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=4)), **common)
    theirs = eager_model.generate(**common)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert [len(step) for step in ours.attentions] == [len(step) for step in theirs.attentions]
