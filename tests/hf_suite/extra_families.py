"""transformers' generic causal-LM tests (`CausalLMModelTest`, which includes `GenerationTesterMixin`) on every
model type of the support table that `../shared/hf-tests` has no test module of its own for.

Not a test module of this repository (pytest never collects it here): `run.py` copies it into the prepared
suite as `tests/models/hf_paged_extra/test_modeling_extra_families.py`, where the suite's tester modules
are importable, and writes beside it `families.json`: one entry per model type, `{"model_type", "label",
"config"}` (the config overrides of its `tests/matrix.py` row, e.g. a sliding window or multi-latent attention
dimensions). Each entry becomes one test class: the tester's default tiny config plus those overrides, the
model classes found through transformers' auto mappings. A test that fails in the baseline (a family needing
settings the generic tester does not give) is not compared.
"""

from __future__ import annotations

import json
import re
import unittest
from pathlib import Path

from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING
from transformers.testing_utils import require_torch

from ...causal_lm_tester import CausalLMModelTest, CausalLMModelTester

FAMILIES_FILE = Path(__file__).with_name("families.json")


def _skip_pipeline_tests(self, *args, **kwargs) -> bool:
    return True


def _class_prefix(model_type: str, label: str, base_model_class: type) -> str:
    """`GPT2` for gpt2, `BertDecoder` for the row labelled `bert-decoder`: the base model class's name without
    `Model`, plus what the row's label adds to its model type."""
    extra = label.removeprefix(model_type)
    return base_model_class.__name__.removesuffix("Model") + "".join(
        part[:1].upper() + part[1:] for part in re.split(r"[^0-9A-Za-z]+", extra) if part
    )


def _test_case(model_type: str, label: str, overrides: dict) -> type:
    config_class = type(AutoConfig.for_model(model_type))
    base_model_class = MODEL_MAPPING[config_class]
    prefix = _class_prefix(model_type, label, base_model_class)
    settings = {key: value for key, value in overrides.items() if value is not None}

    def __init__(self, parent, **kwargs) -> None:  # noqa: N807 - the tester's constructor, the row's settings first
        CausalLMModelTester.__init__(self, parent, **{**settings, **kwargs})

    tester_attrs = {
        "base_model_class": base_model_class,
        "config_class": config_class,
        "causal_lm_class": MODEL_FOR_CAUSAL_LM_MAPPING[config_class],
        "__init__": __init__,
    }
    tester = type(f"{prefix}ExtraModelTester", (CausalLMModelTester,), tester_attrs)
    attrs = {"model_tester_class": tester, "is_pipeline_test_to_skip": _skip_pipeline_tests, "__module__": __name__}
    return require_torch(type(f"{prefix}ExtraModelTest", (CausalLMModelTest, unittest.TestCase), attrs))


for _entry in json.loads(FAMILIES_FILE.read_text(encoding="utf-8")):
    _case = _test_case(_entry["model_type"], _entry["label"], _entry["config"])
    globals()[_case.__name__] = _case
del _entry, _case
