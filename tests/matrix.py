"""The model coverage matrix: which decoder-only models hf-paged serves, and the clear errors for the others.

One line per model: `Case(model_type, {config overrides}, features=..., ...)`. Tests
(`test_matrix_models.py`) and the README table (`support_table.py`) both read `MODELS`; adding a model is
adding a line. Any other model type can be tried without editing this file:
`HF_PAGED_EXTRA_MODELS=qwen3,olmo3 pytest tests/test_matrix_models.py -k extra`.
"""

from __future__ import annotations

import functools
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

#: Tiny sizes applied to every config that has the attribute (checked on the model type's default config,
#: so e.g. GPT-2 gets `n_embd` through its attribute map and models without MoE get no expert fields).
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    head_dim=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_intermediate_size=32,
    num_experts_per_tok=2,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    ffn_hidden_size=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
#: Window of every sliding-window model in the matrix: shorter than prompt + output, so it matters.
WINDOW = 8

PASS = "pass"
UNSUPPORTED = "unsupported"

#: How an unsupported case is exercised.
VIA_CONFIG = "PagedCache(config=...)"  # the error comes at cache construction
VIA_GENERATE = "generate(cache=PagedCache())"  # the error comes from the first forward
VIA_LOAD = 'from_pretrained(attn_implementation="paged")'  # the error comes when the model is loaded


@dataclass(frozen=True)
class Case:
    """One model of the matrix.

    Attributes:
        model_type: transformers model type (`AutoConfig.for_model`).
        config: overrides on top of `TINY`.
        features: what this model exercises (shown in the README).
        expect: `PASS` (same results as DynamicCache + `ref`) or `UNSUPPORTED` (raises `error`).
        ref: reference attention implementation (`eager` where the model has no sdpa, e.g. softcap).
        mode: `"paged"` (attention through AttentionInterface, reads blocks) or `"gather"` (the model runs
            its own attention; PagedCache stores K/V in blocks and returns them gathered).
        error: regex the `UnsupportedModelError` message must match (expect == UNSUPPORTED).
        via: `VIA_CONFIG` and/or `VIA_GENERATE` for unsupported cases.
        label: id when a model type appears twice.
        path: how the README names the attention path, when `mode` alone does not say it.
        scale: the weight scale of the saved tiny model (`saved`); lower where the model's own sdpa and eager
            results differ by more than the tests' tolerance at the default.
    """

    model_type: str
    config: dict = field(default_factory=dict)
    features: str = ""
    expect: str = PASS
    ref: str = "sdpa"
    mode: str = "paged"
    error: str = ""
    via: tuple[str, ...] = (VIA_CONFIG,)
    label: str = ""
    path: str = ""
    scale: float = 3.0

    @property
    def id(self) -> str:
        return self.label or self.model_type

    def __hash__(self) -> int:
        return hash(self.id)


def unsupported(model_type: str, error: str, features: str, via=(VIA_CONFIG,), label: str = "", **config) -> Case:
    return Case(model_type, config, features, UNSUPPORTED, error=error, via=tuple(via), label=label)


SLIDING = dict(sliding_window=WINDOW)
MLA_DIMS = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=None,
                num_key_value_heads=4)  # MLA expands the latents into every query head: no GQA
_BIDIRECTIONAL = r"bidirectional \(non-causal\) attention"
_RECURRENT = r"(linear_attention|hybrid|recurrent|own instead of a KV cache)"
_OWN_ATTENTION = r"attention code of its own"
_MLA_PATH = "latents paged (K/V of own widths), read gathered; expanded K/V through \"paged\""

_HYBRID_PATH = "attention paged; recurrent states in state slots (transformers' own code)"
_MAMBA2_DIMS = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16)
_MLA_HYBRID = dict(layer_types=["linear_attention", "full_attention"], linear_num_heads=2, linear_head_dim=16,
                   num_key_value_heads=4)
_LINEAR_DIMS = dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
#: Hybrid families (recurrent layers beside attention): model type -> (config overrides, features). Each tiny config
#: has a recurrent layer before an attention layer, so every forward crosses both kinds.
HYBRIDS: dict[str, tuple[dict, str]] = {
    "qwen3_next": (dict(layer_types=["linear_attention", "full_attention"], **_LINEAR_DIMS),
                   "gated DeltaNet linear attention + attention, MoE"),
    "qwen3_5_text": (dict(layer_types=["linear_attention", "full_attention"], **_LINEAR_DIMS),
                     "gated DeltaNet linear attention + attention"),
    "jamba": (dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_period=2, expert_layer_offset=1,
                   mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False), "Mamba + attention, MoE"),
    "falcon_h1": (dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                       mamba_chunk_size=16), "Mamba2 and attention in parallel in every layer"),
    "bamba": (dict(attn_layer_indices=[1], **_MAMBA2_DIMS), "Mamba2 + attention"),
    "granitemoehybrid": (dict(layer_types=["mamba", "attention"], **_MAMBA2_DIMS), "Mamba2 + attention, MoE"),
    "nemotron_h": (dict(hybrid_override_pattern="M*", layers_block_type=None, mamba_num_heads=4, mamba_head_dim=16,
                        ssm_state_size=8, chunk_size=16, n_groups=1), "Mamba2 + attention"),
    "zamba2": (dict(num_hidden_layers=3, layer_types=["mamba", "hybrid", "mamba"], hybrid_layer_ids=[1],
                    mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, chunk_size=16),
               "Mamba2 + a shared attention block (layer_idx -1)"),
    "olmo_hybrid": (dict(layer_types=["linear_attention", "full_attention"]), "gated DeltaNet + attention"),
    "lfm2": (dict(layer_types=["conv", "full_attention"]), "short convolutions + attention"),
    "lfm3": (dict(num_hidden_layers=3, layer_types=["conv", "sliding_attention", "full_attention"],
                  sliding_window=WINDOW), "short convolutions + sliding/global attention"),
    "qwen3_5_moe_text": (dict(layer_types=["linear_attention", "full_attention"], **_LINEAR_DIMS),
                         "gated DeltaNet linear attention + attention, MoE"),
    "zamba": (dict(num_hidden_layers=3, layer_types=["linear_attention", "hybrid", "linear_attention"], mamba_d_state=8,
                   n_mamba_heads=2, mamba_dt_rank=8, use_mamba_kernels=False), "Mamba + a shared attention block"),
    "lfm2_moe": (dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
                 "short convolutions + attention, MoE"),
}

MODELS: tuple[Case, ...] = (
    # --- the list
    Case("llama", features="GQA, RoPE"),
    Case("mistral", SLIDING, features="sliding window (every layer)"),
    Case("qwen2", features="q/k/v bias"),
    Case("gemma2", SLIDING, features="logit softcap, alternating sliding/global layers", ref="eager"),
    Case("gemma3_text", SLIDING, features="hybrid sliding/global layers, q/k norm"),
    Case("phi3", features="fused qkv"),
    Case("gpt_neox", dict(rotary_pct=0.25), features="partial rotary"),
    Case("opt", features="learned positions"),
    Case("gpt2", features="MHA, Conv1D"),
    # --- more decoder-only families through AttentionInterface
    Case("gemma", features="GeGLU, MQA default"),
    Case("qwen3", features="q/k norm"),
    Case("qwen2_moe", features="MoE + shared expert"),
    Case("qwen3_moe", features="MoE, q/k norm"),
    Case("mixtral", SLIDING, features="MoE, sliding window"),
    Case("phimoe", SLIDING, features="MoE, window applied only via the mask"),
    Case("gpt_oss", SLIDING, features="attention sinks, sliding/global layers, MoE", ref="eager"),
    Case("granite", features="scaled residual/attention multipliers"),
    Case("granitemoe", features="MoE"),
    Case("olmo", features="non-parametric layer norm"),
    Case("olmo2", features="q/k norm after projection"),
    Case("olmoe", features="MoE, q/k norm"),
    Case("cohere", features="parallel block, logit scale"),
    Case("cohere2", SLIDING, features="sliding/global layers, no RoPE on global layers"),
    Case("starcoder2", SLIDING, features="sliding window, bias"),
    Case("phi", features="partial rotary, parallel block"),
    Case("stablelm", features="partial rotary"),
    Case("smollm3", features="NoPE layers"),
    Case("gpt_bigcode", features="multi-query attention"),
    Case("glm", features="partial rotary"),
    Case("glm4", features="sandwich norms"),
    Case("helium"),
    Case("nemotron", features="partial rotary, squared ReLU"),
    Case("persimmon", features="q/k layer norm"),
    Case("exaone4", SLIDING, features="sliding/global layers, q/k norm"),
    Case("ernie4_5"),
    Case("hunyuan_v1_dense", features="q/k norm"),
    Case("seed_oss"),
    Case("ministral", SLIDING, features="sliding window"),
    Case("apertus", features="xIELU"),
    Case("arcee"),
    Case("bitnet", features="ternary weights"),
    Case("vaultgemma", ref="eager", features="softcap"),
    Case("jetmoe", mode="gather", features="mixture of attention heads (own attention)"),
    Case("minimax_m2", features="MoE"),
    Case("biogpt", features="learned positions"),
    Case("bert", dict(is_decoder=True), features="BERT as a decoder (is_decoder=True)", label="bert-decoder"),
    Case("roberta", dict(is_decoder=True), features="as a decoder (is_decoder=True)", label="roberta-decoder"),
    Case("ctrl", features="MHA, sinusoidal positions"),
    # families new in transformers 5.25
    Case("ergo", dict(sliding_window=WINDOW, global_attention_every_n_layers=2, global_attention_scale=1.5),
         features="sliding/global layers, no RoPE and scaled logits on global layers, MoE + shared expert"),
    Case("minicpm5_moe", features="MoE + shared expert"),
    Case("param2moe", features="grouped expert routing, shared experts"),
    # layers that reuse an earlier layer's K/V (num_kv_shared_layers): they attend over that layer's blocks
    *(
        Case(
            t, dict(num_hidden_layers=4, layer_types=("sliding_attention", "full_attention") * 2,
                    sliding_window=WINDOW, num_kv_shared_layers=2, vocab_size_per_layer_input=128,
                    hidden_size_per_layer_input=8, **extra),
            features=f"last 2 layers reuse earlier layers' K/V (num_kv_shared_layers), per-layer inputs{more}",
            scale=scale,
        )
        for t, extra, more, scale in (
            # (Gemma 4 at the default scale: its own sdpa and eager logits differ by 3.5e-4)
            ("gemma4_text", dict(global_head_dim=32), ", sliding/global layers", 2.0),
            ("gemma3n_text", dict(laurel_rank=4, altup_num_inputs=2, activation_sparsity_pattern=(0.0,) * 4,
                                  intermediate_size=(128,) * 4), ", AltUp, LAuReL", 3.0),
        )
    ),
    # multi-latent attention: blocks store the compressed latents (K 16 / V 8 wide), the model expands them
    # into K 24 / V 16 per head after update(), "paged" attends those (`hf_paged.support.reads_gathered`)
    Case("deepseek_v3", MLA_DIMS, mode="gather", path=_MLA_PATH, features="multi-latent attention (K dim != V dim), MoE"),
    Case("deepseek_v2", MLA_DIMS, mode="gather", path=_MLA_PATH, features="multi-latent attention (K dim != V dim), MoE"),
    # --- hybrids: attention layers paged, each recurrent layer's states in a state slot per sequence
    *(Case(model_type, config, features=features, path=_HYBRID_PATH) for model_type, (config, features) in HYBRIDS.items()),
    # --- models a paged cache cannot serve: a clear error, never wrong output
    # Multi-latent attention beside recurrent layers: PagedCache(config=model.config) serves them
    # (tests/test_hybrid.py); a PagedCache() without config learns too late that the model reads its K/V gathered.
    *(
        unsupported(
            t, r"made without config=", "Kimi delta attention + multi-latent attention (served with "
            "`PagedCache(config=model.config)`)", via=(VIA_GENERATE,), **_MLA_HYBRID,
        )
        for t in ("kimi_linear", "bailing_hybrid")
    ),
    unsupported("minimax", _RECURRENT, "lightning (linear) attention + attention in a cache class of its own"),
    unsupported("mamba", _RECURRENT, "SSM (no attention)", via=(VIA_CONFIG, VIA_GENERATE)),
    unsupported("mamba2", _RECURRENT, "SSM (no attention)", n_groups=1, num_heads=8, head_dim=16, expand=2),
    unsupported("falcon_mamba", _RECURRENT, "SSM (no attention)"),
    unsupported("rwkv", _RECURRENT, "recurrent state of its own"),
    unsupported("llama4_text", r"chunked_attention", "chunked attention", via=(VIA_CONFIG, VIA_GENERATE)),
    unsupported("kolibri1_1", r"indexed_attention", "indexed (top-k sparse) attention over keys shared across layers",
                num_hidden_layers=3, layer_types=("sliding_attention", "indexed_attention", "indexed_attention"),
                index_layers=(1,), kv_source_layers=(0, 1, 1), index_num_heads=1, sliding_window=WINDOW),
    unsupported("bert", _BIDIRECTIONAL, "bidirectional encoder (is_decoder=False)", via=(VIA_GENERATE,)),
    # encoder-decoder models are served by EncoderDecoderPagedCache (tests/encdec_matrix.py); a PagedCache alone is refused
    unsupported("bart", r"EncoderDecoderPagedCache", "encoder-decoder (PagedCache alone)", via=(VIA_CONFIG, VIA_GENERATE)),
    unsupported("t5", r"EncoderDecoderPagedCache", "encoder-decoder (PagedCache alone)"),
    # attention code of their own (`hf_paged.support.runs_own_attention`): refused when loaded with "paged"
    unsupported("bloom", _OWN_ATTENTION, "own attention code (ALiBi, own masking)", via=(VIA_LOAD,)),
    unsupported("codegen", _OWN_ATTENTION, "own attention code", via=(VIA_LOAD,)),
    unsupported("doge", _OWN_ATTENTION, "dynamic mask of its own (indexes its mask as 4D)", via=(VIA_LOAD,)),
    unsupported("xglm", _OWN_ATTENTION, "own attention code", via=(VIA_LOAD,)),
    unsupported("gptj", _OWN_ATTENTION, "own attention code", via=(VIA_LOAD,)),
    unsupported("falcon", _OWN_ATTENTION, "own attention-class table", via=(VIA_LOAD,), head_dim=None),
    unsupported("gpt_neo", _OWN_ATTENTION, "own attention-class table, local attention", via=(VIA_LOAD,),
                attention_types=((("global", "local"), 1),), window_size=WINDOW),
)

#: The cells of `MODELS` that `make test` runs: one model for each attention path (GQA + RoPE; a sliding window;
#: softcap and alternating layers against eager; MHA with Conv1D and learned positions; multi-latent attention read
#: gathered; recurrent layers beside attention) and one for each kind of clear error. The others are marked
#: `models` (`tests/helpers.py` `tiered`): `make test-models` runs them, and CI runs both.
MAKE_TEST = frozenset({
    "llama", "mistral", "gemma2", "gpt2", "deepseek_v3", "qwen3_next",  # served
    "mamba", "llama4_text", "bert", "bart", "bloom", "kimi_linear",  # clear errors
})

#: generate() features, each compared with DynamicCache + sdpa (`test_matrix_features.py` has one check each).
FEATURES: dict[str, str] = {
    "greedy": "greedy decoding, left-padded batch (per-step logits)",
    "sampling": "multinomial sampling (seeded)",
    "top_k_top_p": "top-k / top-p / temperature",
    "beam_search": "beam search (+ num_return_sequences, sequences_scores)",
    "beam_sampling": "beam sampling",
    "num_return_sequences": "num_return_sequences (parallel samples)",
    "assisted_decoding": "assisted decoding with a draft model (crop)",
    "prompt_lookup": "prompt-lookup decoding",
    "streamers": "TextStreamer / TextIteratorStreamer",
    "stopping": "custom stopping criteria",
    "stop_strings": "stop_strings (the shipped model's BPE tokenizer)",
    "logits_processors": "logits processors, repetition penalty, no_repeat_ngram_size",
    "scores_and_logits": "return_dict_in_generate with output_scores / output_logits",
    "chunked_prefill": "prefill_chunk_size (chunked prefill)",
    "inputs_embeds": "inputs_embeds",
    "continue_from_cache": "continuing from a returned cache (multi-turn)",
    "max_new_tokens_at_block_boundary": "max_new_tokens reached exactly at a block boundary",
    "max_new_tokens_mid_block": "max_new_tokens reached mid-block",
    "sliding_window_bounded_memory": "sliding window: blocks out of the window are freed (4x window, Mistral)",
    "bf16": "bfloat16 on CPU",
    "dtype_auto": 'dtype="auto" (pool follows each layer\'s dtype and device)',
    "gemma2_softcap_bf16": "Gemma 2 softcap + sliding layers in bfloat16",
}

@functools.cache
def _save_root() -> Path:
    """The folder the tiny models are saved in, made on first use (importing the matrix makes no folder)."""
    return Path(tempfile.mkdtemp(prefix="hf_paged_matrix_"))


def tiny_config(model_type: str, overrides: dict | None = None):
    """A tiny config of `model_type`: `TINY` for the attributes its default config has, then `overrides`."""
    default = AutoConfig.for_model(model_type)
    kwargs = {}
    for key, value in TINY.items():
        try:
            present = hasattr(default, key)
        except Exception:  # noqa: BLE001 - per-layer attributes refuse global access
            present = False
        if present:
            kwargs[key] = value
    # (list values, such as layer_types, travel as tuples so that `saved` can cache on them)
    kwargs.update({k: list(v) if isinstance(v, tuple) else v for k, v in (overrides or {}).items() if v is not None})
    for key, value in (overrides or {}).items():
        if value is None:
            kwargs.pop(key, None)
    return AutoConfig.for_model(model_type, **kwargs)


def model_class(config):
    return AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM


@functools.lru_cache(maxsize=None)
def saved(model_type: str, overrides: tuple = (), scale: float = 3.0) -> Path:
    """Builds the tiny model, scales its weights (peaked logits, so tokens compare exactly), saves it
    (safetensors) and returns the directory."""
    config = tiny_config(model_type, dict(overrides))
    torch.manual_seed(0)
    model = model_class(config).from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(scale)
    if "dtype" in dict(overrides):
        model.to(getattr(torch, dict(overrides)["dtype"]))
    root = _save_root()
    path = root / re.sub(r"[^\w.-]", "_", f"{model_type}-{len(list(root.iterdir()))}")
    model.save_pretrained(path)
    return path


def saved_case(case: Case) -> Path:
    items = ((k, tuple(v) if isinstance(v, list) else v) for k, v in case.config.items())
    return saved(case.model_type, tuple(sorted(items, key=lambda kv: kv[0])), scale=case.scale)


def load(path: Path, attn_implementation: str, dtype: torch.dtype | str = torch.float32):
    config = AutoConfig.from_pretrained(path)
    return model_class(config).from_pretrained(path, attn_implementation=attn_implementation, dtype=dtype).eval()


def reference_attention(config) -> str:
    """sdpa where the model supports it, else eager."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING  # noqa: PLC0415

    return "sdpa" if getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], "_supports_sdpa", False) else "eager"


def passing() -> list[Case]:
    return [c for c in MODELS if c.expect == PASS]


def failing() -> list[Case]:
    return [c for c in MODELS if c.expect == UNSUPPORTED]
