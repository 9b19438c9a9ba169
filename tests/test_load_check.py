"""Loading a model whose attention code is its own with attn_implementation="paged" fails at load with
`UnsupportedModelError` naming the model type (`hf_paged.support.refuse_own_attention`), never with a
`KeyError: 'paged'` inside transformers; every other model and attention choice loads as before."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BarkSemanticConfig,
    FalconConfig,
    GitConfig,
    GPTNeoConfig,
    LlamaConfig,
    OpenAIGPTConfig,
    PreTrainedModel,
)
from transformers.models.bark.modeling_bark import BarkSemanticModel

import hf_paged
from hf_paged import UnsupportedModelError
from hf_paged.support import runs_own_attention

TINY = dict(vocab_size=64, hidden_size=32, num_attention_heads=4)


def _configs() -> dict[str, object]:
    return {
        "gpt_neo": GPTNeoConfig(**TINY, num_layers=2, attention_types=[[["global", "local"], 1]], window_size=8),
        "falcon": FalconConfig(**TINY, num_hidden_layers=2),
        "git": GitConfig(**TINY, num_hidden_layers=2, intermediate_size=64,
                         vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                            intermediate_size=64, image_size=32, patch_size=16)),
    }


@pytest.mark.parametrize("model_type", ["gpt_neo", "falcon", "git"])
def test_own_attention_tables_refuse_paged_at_from_config(model_type: str) -> None:
    config = _configs()[model_type]
    with pytest.raises(UnsupportedModelError) as info:
        AutoModelForCausalLM.from_config(config, attn_implementation="paged")
    message = str(info.value)
    assert repr(model_type) in message and "attn_implementation='eager'" in message


def test_a_model_taking_no_cache_is_not_sent_to_a_paged_cache() -> None:
    """openai-gpt runs its own attention and its forward takes no cache: the error does not suggest one."""
    config = OpenAIGPTConfig(vocab_size=64, n_embd=32, n_head=4, n_layer=2, n_positions=32)
    with pytest.raises(UnsupportedModelError) as info:
        AutoModelForCausalLM.from_config(config, attn_implementation="paged")
    message = str(info.value)
    assert "'openai-gpt'" in message and "takes no transformers Cache" in message and "PagedCache()" not in message


def test_bark_sub_model_refuses_paged() -> None:
    config = BarkSemanticConfig(hidden_size=32, num_layers=1, num_heads=4, input_vocab_size=64, output_vocab_size=64)
    with pytest.raises(UnsupportedModelError, match="'semantic'"):
        BarkSemanticModel._from_config(config, attn_implementation="paged")


def test_refused_at_from_pretrained_and_other_choices_load(tmp_path) -> None:
    config = _configs()["falcon"]
    AutoModelForCausalLM.from_config(config, attn_implementation="eager").save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="'falcon'"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="paged")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"


def test_set_attn_implementation_refuses_paged_for_a_table_model() -> None:
    """codegen applies its mask itself (`OWN_ATTENTION`): switching a loaded model to "paged" is refused the same
    way (transformers 5.20, which finds codegen's attention its own, keeps the old choice with a warning)."""
    from transformers import CodeGenConfig  # noqa: PLC0415

    model = AutoModelForCausalLM.from_config(CodeGenConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=4, rotary_dim=4))
    refused = None
    try:
        model.set_attn_implementation("paged")
    except UnsupportedModelError as err:
        refused = err
    assert model.config._attn_implementation != "paged"
    if type(model)._can_set_attn_implementation():
        assert refused is not None and "'codegen'" in str(refused)


def test_served_model_loads_and_generates_with_paged() -> None:
    config = LlamaConfig(**TINY, num_hidden_layers=1, num_key_value_heads=2, intermediate_size=64)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="paged")
    assert model.config._attn_implementation == "paged"
    assert not runs_own_attention(type(model), model.config)
    ids = torch.randint(3, 64, (1, 5))
    out = model.generate(ids, max_new_tokens=3, do_sample=False, **hf_paged.cache_kwargs(hf_paged.PagedCache()))
    assert out.shape == (1, 8)


def test_register_installs_the_check_once() -> None:
    hf_paged.register()
    hf_paged.register()
    wrapper = PreTrainedModel.__dict__["get_correct_attn_implementation"]
    inner = wrapper.__hf_paged_wraps__
    assert not hasattr(inner, "__hf_paged_wraps__")  # one layer of wrapping, whatever the number of calls
