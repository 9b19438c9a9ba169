"""The small Llama model that ships with hf-paged (for tests, examples and benchmarks that must run offline).

The weights in :data:`DEMO_MODEL_PATH` were produced by :mod:`hf_paged.demo_model.train` (see
``weights/training_report.json`` for the exact command, held-out loss and samples): a ~2.8M
parameter ``LlamaForCausalLM`` (4 layers, hidden 256, 4 query heads sharing 2 KV heads of
``head_dim`` 64, RoPE, 4096 positions, tied embeddings) trained on CPU on the Python standard
library's source, with a 4096-token byte-level BPE tokenizer.

Tokenizer notes: ``<|endoftext|>`` (id 0) is bos, eos *and* pad - ``pad_token_id == eos_token_id``,
so always pass the ``attention_mask`` returned by the tokenizer when batching; padding is on the
left; no special token is inserted when encoding.

This module deliberately imports nothing else from :mod:`hf_paged`.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["DEMO_MODEL_PATH", "load_demo_model"]

#: Directory of the shipped demo model (``config.json``, ``model.safetensors``, tokenizer files, ...).
DEMO_MODEL_PATH: Path = Path(__file__).resolve().parent / "weights"


def load_demo_model(dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
    """Load the shipped demo model and its tokenizer, offline.

    Args:
        dtype: parameter dtype of the returned model (the weights are stored in float32).
        attn_implementation: forwarded to ``from_pretrained`` (e.g. ``"sdpa"``, ``"eager"`` or a
            registered custom attention); ``None`` keeps transformers' default.

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` in eval mode on CPU and its
        ``PreTrainedTokenizerFast`` (left padding, pad == eos).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (DEMO_MODEL_PATH / "config.json").is_file():
        raise FileNotFoundError(
            f"demo model weights missing under {DEMO_MODEL_PATH}; regenerate them with "
            "`python -m hf_paged.demo_model.train --out <that dir>`"
        )
    kwargs = {"dtype": dtype, "local_files_only": True}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_PATH, **kwargs)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_PATH, local_files_only=True)
    return model, tokenizer
