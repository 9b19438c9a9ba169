"""The encoder-decoder matrix: which encoder-decoder model types `hf_paged.EncoderDecoderPagedCache` serves under
`attn_implementation="paged"`, and the clear errors for the others.

One line per model type: `EncDecCase(model_type, {config overrides}, ...)`. `tests/test_encoder_decoder.py` runs each
(greedy, beam search with `num_return_sequences`, seeded sampling with `num_return_sequences`, against transformers'
own `EncoderDecoderCache` and sdpa or eager) and the README table (`support_table.py`) lists them.
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

PASS = "pass"
UNSUPPORTED = "unsupported"

#: Tiny sizes applied to every config that has the attribute.
TINY = dict(
    vocab_size=96,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=128,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=1,
    num_mel_bins=8,
    max_source_positions=16,
    max_target_positions=64,
    encoder_hidden_size=32,
    num_key_value_heads=4,
    head_dim=8,
)

_OWN_ATTENTION = r"attention code of its own"

#: T5Gemma's encoder and decoder are Gemma 2 stacks configured apart (sub-configs), alternate layers windowed.
_GEMMA_MODULE = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
    layer_types=["sliding_attention", "full_attention"], sliding_window=4,
)


@dataclass(frozen=True)
class EncDecCase:
    """One encoder-decoder model type.

    Attributes:
        model_type: transformers model type.
        config: overrides on top of `TINY`.
        features: what it exercises (shown in the README).
        expect: `PASS` or `UNSUPPORTED` (raises `UnsupportedModelError` matching `error` when loaded with "paged").
        self_path: how the decoder's self-attention reads its blocks: "paged", or "gather" (T5's relative position
            bias is sized by the keys `update()` returns: `support.CHANGES_RETURNED_KV`).
    """

    model_type: str
    config: dict = field(default_factory=dict)
    features: str = ""
    expect: str = PASS
    error: str = ""
    self_path: str = "paged"

    @property
    def id(self) -> str:
        return self.model_type


ENCODER_DECODERS: tuple[EncDecCase, ...] = (
    EncDecCase("whisper", features="speech: conv front end, learned positions, scaled queries"),
    EncDecCase("bart", features="text: learned positions, padded encoder batch"),
    EncDecCase("t5", features="relative position bias (self-attention read gathered)", self_path="gather"),
    EncDecCase("mt5", features="T5 v1.1 (gated FFN)", self_path="gather"),
    EncDecCase("umt5", features="per-layer relative position bias", self_path="gather"),
    EncDecCase("longt5", features="local attention encoder", self_path="gather"),
    EncDecCase("switch_transformers", features="T5 + sparse MoE", self_path="gather"),
    EncDecCase("mbart", features="pre-norm BART"),
    EncDecCase("marian", features="sinusoidal positions"),
    EncDecCase("pegasus", features="sinusoidal positions, pre-norm"),
    EncDecCase("pegasus_x", features="global-local encoder; decoder self-attention marked non-causal, causal by mask"),
    EncDecCase("blenderbot", features="pre-norm"),
    EncDecCase("blenderbot-small", features="post-norm"),
    EncDecCase("m2m_100", features="sinusoidal positions"),
    EncDecCase("nllb-moe", features="sparse MoE; decoder self-attention marked non-causal, causal by mask"),
    EncDecCase("plbart", features="BART for code"),
    EncDecCase("speech_to_text", features="speech: conv subsampler, sinusoidal positions"),
    EncDecCase("moonshine", features="speech: raw audio, rotary positions"),
    EncDecCase(
        "t5gemma",
        config=dict(encoder=_GEMMA_MODULE, decoder=_GEMMA_MODULE),
        features="Gemma 2 encoder and decoder, a window of 4 on alternate decoder layers; generate() rebuilds the "
        "cross-attention cache with its class",
    ),
    EncDecCase("mvp", features="BART + prompts", expect=UNSUPPORTED, error=_OWN_ATTENTION),
    EncDecCase("led", features="Longformer encoder", expect=UNSUPPORTED, error=_OWN_ATTENTION),
    EncDecCase("fsmt", features="separate source / target vocabularies", expect=UNSUPPORTED, error=_OWN_ATTENTION),
    EncDecCase(
        "bigbird_pegasus",
        features="block-sparse / full encoder attention with its own mask handling",
        expect=UNSUPPORTED,
        error=_OWN_ATTENTION,
    ),
)

#: The cells `make test` runs; the others are marked `models`.
MAKE_TEST = frozenset({"whisper", "bart", "t5", "t5gemma", "bigbird_pegasus"})


def tiny_config(case: EncDecCase):
    default = AutoConfig.for_model(case.model_type)
    kwargs = {k: v for k, v in TINY.items() if hasattr(default, k)}
    kwargs.update(case.config)
    return AutoConfig.for_model(case.model_type, **kwargs)


def model_class(model_type: str):
    return (
        AutoModelForSeq2SeqLM
        if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
        else AutoModelForSpeechSeq2Seq
    )


@functools.cache
def _save_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="hf_paged_encdec_"))


def saved(case: EncDecCase) -> Path:
    """Builds the tiny model, scales its weights by 3 (peaked logits), saves it (safetensors); returns its folder."""
    return _saved(case.model_type)


@functools.cache
def _saved(model_type: str) -> Path:
    case = next(c for c in ENCODER_DECODERS if c.model_type == model_type)
    config = tiny_config(case)
    torch.manual_seed(0)
    model = model_class(case.model_type).from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3.0)
    path = _save_root() / case.model_type
    model.save_pretrained(path)
    return path


def load(case: EncDecCase, attn_implementation: str):
    return model_class(case.model_type).from_pretrained(saved(case), attn_implementation=attn_implementation).eval()


def reference_attention(model) -> str:
    return "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"


def inputs_for(model, batch: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """Encoder inputs of `batch` requests: token ids with a padded row, mel features, or raw audio."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    if model.main_input_name == "input_features":
        if config.model_type == "whisper":
            return dict(
                input_features=torch.randn(
                    batch, config.num_mel_bins, 2 * config.max_source_positions, generator=generator
                )
            )
        width = config.input_feat_per_channel * config.input_channels
        features = torch.randn(batch, 24, width, generator=generator)
        mask = torch.ones(batch, 24, dtype=torch.long)
        mask[-1, -4:] = 0
        return dict(input_features=features, attention_mask=mask)
    if model.main_input_name == "input_values":
        return dict(input_values=torch.randn(batch, 2000, generator=generator))
    ids = torch.randint(3, config.vocab_size, (batch, 7), generator=generator)
    mask = torch.ones_like(ids)
    mask[-1, -2:] = 0  # a shorter request: the cross-attention mask matters
    return dict(input_ids=ids, attention_mask=mask)


def generate_kwargs(model) -> dict:
    """What generate() needs beyond the inputs for a tiny config (T5 has no decoder start token in its config)."""
    if getattr(model.generation_config, "decoder_start_token_id", None) is None:
        return dict(decoder_start_token_id=0)
    return {}


def passing() -> list[EncDecCase]:
    return [c for c in ENCODER_DECODERS if c.expect == PASS]


def failing() -> list[EncDecCase]:
    return [c for c in ENCODER_DECODERS if c.expect == UNSUPPORTED]
