"""Tiny models built from configs and round-tripped through save_pretrained/from_pretrained (safetensors)."""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, seed, settings
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import hf_paged

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)

_SAVE_ROOT = Path(tempfile.mkdtemp(prefix="hf_paged_tests_"))


@functools.lru_cache(maxsize=None)
def saved_model(model_type: str, scale: float = 3.0, **overrides) -> Path:
    """Builds a tiny random model of `model_type`, scales its weights (peaked logits) and saves it.

    Returns the directory; loading it back runs the real safetensors path.
    """
    kwargs = {**TINY, **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(scale)
    path = _SAVE_ROOT / f"{model_type}-{abs(hash((scale, tuple(sorted(overrides.items())))))}"
    model.save_pretrained(path)
    return path


def tiered(cases: Iterable, make_test: Collection[str], id: Callable = lambda case: case.id) -> list:
    """The cells of a per-model-family matrix as pytest parameters, named by `id`: those named in `make_test` run in
    `make test`, the others are marked `models` (`make test` leaves them out, `make test-models` runs them)."""
    return [pytest.param(case, id=id(case), marks=() if id(case) in make_test else pytest.mark.models) for case in cases]


def load(path: Path, attn_implementation: str, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn_implementation, dtype=dtype).eval()


def left_padded(lengths: list[int], vocab: int = 128, pad_id: int = 0, seed: int = 0, low: int = 1):
    """`(input_ids, attention_mask)` of random prompts of the given lengths (tokens in `[low, vocab)`),
    left-padded with `pad_id`."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(lengths), width), dtype=torch.long, device="cpu")
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(low, vocab, (n,), generator=gen, device="cpu")
        mask[row, width - n :] = 1
    default = torch.get_default_device()  # (the GPU in a session that runs the kernel tests there)
    return ids.to(default), mask.to(default)


def generate_both(paged_model, ref_model, cache=None, seed: int = 0, **kwargs):
    """Runs generate() with PagedCache + "paged" and DynamicCache + "sdpa" from the same seed."""
    cache = cache if cache is not None else hf_paged.PagedCache()
    common = dict(return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    common.update(kwargs)
    torch.manual_seed(seed)
    paged = paged_model.generate(**hf_paged.cache_kwargs(cache), **common)
    torch.manual_seed(seed)
    ref = ref_model.generate(**hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)), **common)
    return paged, ref, cache


def max_logit_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits, strict=True))


def paged_llama_one_thread():
    """A tiny saved Llama loaded with "paged", run with one torch thread (a generator, for a fixture)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load(saved_model("llama"), "paged")
    torch.set_num_threads(threads)


#: `HF_PAGED_FUZZ_SCALE=<float>` runs more or fewer fuzzer examples; `HF_PAGED_FUZZ_SEED=<int>` explores others.
FUZZ_SCALE = float(os.environ.get("HF_PAGED_FUZZ_SCALE", "1"))
FUZZ_SEED = os.environ.get("HF_PAGED_FUZZ_SEED")


def fuzz(examples: int):
    """hypothesis settings of the fuzzers: `examples` (times `HF_PAGED_FUZZ_SCALE`), no deadline and no example
    database, derandomized (the same examples in every CI run) unless `HF_PAGED_FUZZ_SEED` picks others."""

    def decorate(test):
        test = settings(
            max_examples=max(1, round(examples * FUZZ_SCALE)), deadline=None, database=None, print_blob=True,
            derandomize=FUZZ_SEED is None, suppress_health_check=list(HealthCheck),
        )(test)
        return seed(int(FUZZ_SEED))(test) if FUZZ_SEED is not None else test

    return decorate
