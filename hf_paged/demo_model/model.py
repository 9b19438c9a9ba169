"""The demo model's architecture: the :class:`ModelSpec` sizes and the seeded ``LlamaForCausalLM`` built from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ModelSpec:
    """Architecture and tokenizer sizes of the model to train."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 320
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0


#: A very small spec for tests (``--tiny``): trains in seconds, does not meet the shipping spec.
TINY_SPEC = ModelSpec(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
)


def build_model(spec: ModelSpec, eos_id: int, seed: int):
    """Create a randomly initialised (seeded) float32 ``LlamaForCausalLM`` for ``spec``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        hidden_act="silu",
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attention_bias=False,
        mlp_bias=False,
        use_cache=True,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model.float()


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied tensors counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
