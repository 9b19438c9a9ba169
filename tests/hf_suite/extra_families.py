"""transformers' generic causal-LM tests (`CausalLMModelTest`, which includes `GenerationTesterMixin`) on
model families that `../shared/hf-tests` has no test module for.

Not a test module of this repository (pytest never collects it here): `run.py` copies it into the prepared
suite as `tests/models/hf_paged_extra/test_modeling_extra_families.py`, where the suite's tester modules
are importable, and runs it in both the baseline and the paged run. Each family gets the tester's default
tiny config; a test that fails in the baseline (a family needing settings of its own) is not compared.
"""

from __future__ import annotations

import unittest

import transformers
from transformers.testing_utils import require_torch

from ...causal_lm_tester import CausalLMModelTest, CausalLMModelTester

#: model type -> base model class name in transformers (families with their own attention code paths:
#: q/k norm, partial rotary, sliding windows, parallel blocks, NoPE layers, MoE).
FAMILIES = {
    "qwen3": "Qwen3Model",
    "phi3": "Phi3Model",
    "gemma": "GemmaModel",
    "starcoder2": "Starcoder2Model",
    "olmo2": "Olmo2Model",
    "granite": "GraniteModel",
    "cohere": "CohereModel",
    "smollm3": "SmolLM3Model",
    "glm4": "Glm4Model",
    "qwen3_moe": "Qwen3MoeModel",
}


def _skip_pipeline_tests(self, *args, **kwargs) -> bool:
    return True


def _test_case(model_type: str, class_name: str) -> type:
    prefix = class_name.removesuffix("Model")
    tester = type(f"{prefix}ExtraModelTester", (CausalLMModelTester,), {"base_model_class": getattr(transformers, class_name)})
    attrs = {"model_tester_class": tester, "is_pipeline_test_to_skip": _skip_pipeline_tests, "__module__": __name__}
    return require_torch(type(f"{prefix}ExtraModelTest", (CausalLMModelTest, unittest.TestCase), attrs))


for _model_type, _class_name in FAMILIES.items():
    _case = _test_case(_model_type, _class_name)
    globals()[_case.__name__] = _case
del _model_type, _class_name, _case
