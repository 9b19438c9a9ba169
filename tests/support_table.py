"""Writes the README's supported-models table from the test matrix (`tests/matrix.py`).

    python tests/support_table.py          # rewrite the table between the README markers
    python tests/support_table.py --check  # exit 1 if the committed table is stale

Every row is a matrix cell that `tests/test_matrix_models.py` / `tests/test_matrix_features.py` run in CI:
"yes" rows pass against DynamicCache + sdpa/eager, "clear error" rows raise the quoted error.
`tests/test_support_table.py` fails when the committed table and the matrix disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from matrix import FEATURES, MODELS, PASS, Case  # noqa: E402
from vlm_matrix import VLMS, VlmCase, tiny_vlm_config  # noqa: E402
from encdec_matrix import ENCODER_DECODERS, EncDecCase  # noqa: E402

from hf_paged.engine.rows_step import is_hybrid  # noqa: E402
from hf_paged.support import attends_prefix_bidirectionally, hits_over_placeholders  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- support-table:start -->", "<!-- support-table:end -->"

def _model_row(case: Case) -> str:
    config = ", ".join(f"`{k}={v!r}`" for k, v in sorted(case.config.items()) if v is not None)
    if case.expect == PASS:
        path = case.path or ("paged attention" if case.mode == "paged" else "own attention; K/V paged, read gathered")
        return f"| `{case.model_type}` | yes | {path} | {case.features} | {config} | {case.ref} |"
    where = " and ".join(f"`{via}`" for via in case.via)
    return f"| `{case.model_type}` | clear error | — | {case.features} | {config} | raised at {where} |"


def _vlm_row(case: VlmCase) -> str:
    towers = f"`{case.text['model_type']}` + `{case.vision['model_type']}`"
    config = tiny_vlm_config(case)
    hits = "over the image" if hits_over_placeholders(config) else "text before the image"
    if attends_prefix_bidirectionally(config):
        hits = "none (every prompt token sees the later ones)"
    elif is_hybrid(config) and not hits_over_placeholders(config):
        hits = "text before the image, where a forward ended there (a hit restores recurrent states)"
    engine = "no Engine (a clear error at construction)" if case.engine_error else "yes"
    return f"| `{case.model_type}` | yes | {towers} | {case.features} | {hits} | {engine} |"


def _encdec_row(case: EncDecCase) -> str:
    if case.expect == PASS:
        path = "paged attention" if case.self_path == "paged" else "K/V paged, read gathered (position bias)"
        return f"| `{case.model_type}` | yes | {path} | shared, once per request | {case.features} |"
    return f"| `{case.model_type}` | clear error at load | — | — | {case.features} |"


def render() -> str:
    passing = [c for c in MODELS if c.expect == PASS]
    lines = [
        "(generated from the test matrix by `python tests/support_table.py`; every row is a CI test cell)",
        "",
        f"**{len(passing)} model types** give the same tokens and per-step logits (fp32, left-padded batch, greedy "
        "and seeded sampling, block size 4) with `PagedCache` + `\"paged\"` as with `DynamicCache` + the reference "
        "attention; the others raise `hf_paged.UnsupportedModelError` naming the model type and what to use "
        "instead — never wrong output. Other decoder-only models whose attention goes through "
        "`AttentionInterface` work without code changes "
        "(`HF_PAGED_EXTRA_MODELS=<model_type> pytest tests/test_matrix_models.py -k extra` checks one). "
        "`make test-hf` runs transformers' own generate() tests on every served model type that the suite's transformers release (5.23) has (the model's own test "
        "module where the suite has one, transformers' generic causal-LM tests otherwise) with and without "
        "hf-paged: a test that passes with plain transformers must pass with hf-paged. Loading a model with "
        "attention code of its own with `attn_implementation=\"paged\"` raises the error at load.",
        "",
        "| model type | supported | attention path | exercises | tiny-config overrides | reference / note |",
        "|---|---|---|---|---|---|",
    ]
    lines += [_model_row(c) for c in MODELS]
    lines += [
        "",
        "`generate()` features, each compared with `DynamicCache` + sdpa (Llama; Mistral for sliding windows):",
        "",
        "| feature | supported |",
        "|---|---|",
    ]
    lines += [f"| {description} | yes |" for description in FEATURES.values()]
    lines += [
        "",
        "Hybrid models (rows above with recurrent states in state slots; `tests/test_hybrid.py` on `qwen3_next`, "
        "`jamba` and `falcon_h1`, each compared with `DynamicCache` + sdpa):",
        "",
        "| feature | hybrids |",
        "|---|---|",
        "| greedy and sampling over left-padded batches, beam search, `num_return_sequences`, chunked prefill, "
        "continuing a returned cache, `fork()` | yes (chunked prefill on `jamba`: the same logits as `DynamicCache`, "
        "whose Mamba layers, transformers' own code, restart each multi-token input from a zero state) |",
        "| assisted / prompt-lookup decoding, `crop()` | yes with transformers ≥ 5.25 (the cache records its recurrent "
        "states' past once `generate()` asks, and steps them back on `crop()`; greedy decoding's tokens on "
        "every hybrid family of the matrix, `tests/test_matrix_models.py::test_prompt_lookup_on_hybrids`; `zamba`, "
        "which transformers' own cache cannot crop either: a clear error; on a cache that holds tokens (a `KVPool` "
        "prefix hit, an earlier `generate()`), the first step feeds the whole prompt again and the recurrent layers "
        "start it from no state); before 5.25 transformers' own error, before anything is stored |",
        "| `KVPool` prefix reuse | hits restore the recurrent states at the hit's end (a snapshot kept with the "
        "indexed block where a forward ended; `new_cache(..., model=model)` ends one at each prompt's last block "
        "end), `tests/test_hybrid_prefix.py` on `qwen3_next`, `falcon_h1`, `lfm2`; `jamba` (its Mamba scan "
        "restarts every forward from zero states) always misses; never K/V without their states |",
        "| `hf_paged.Engine` | yes: batched steps, a request per row with its own state slot (`tests/test_engine_hybrid.py`, "
        "every hybrid family); prefix hits restore the states as above; no speculation (a clear error: its rows do not "
        "record their states' past); "
        "Jamba prefills each prompt in one forward |",
        "",
        "Vision-language models (`tests/test_vlm.py`, tiny configs with tiny vision towers: `generate()` with an image, "
        "loaded with `attn_implementation=\"paged\"` on a `PagedCache`: the same tokens and per-step logits as "
        "`DynamicCache` + sdpa). `KVPool` prefix digests cover each row's images; a second question about "
        "one image gives a cold run's tokens and logits, its hit covering the image where the family takes it (see "
        "above). `hf_paged.Engine` takes requests with images (`tests/test_engine_multimodal.py`: each request's "
        "tokens and top log-probabilities those of single-request `generate()`, beside text-only requests, an image "
        "split across prefill chunks, two images, preemption, the prefix hits above):",
        "",
        "| model type | supported | language model + vision tower | exercises | prefix hits | `Engine` |",
        "|---|---|---|---|---|---|",
    ]
    lines += [_vlm_row(c) for c in VLMS]
    lines += [
        "",
        "Encoder-decoder models (`tests/test_encoder_decoder.py`, tiny configs, `attn_implementation=\"paged\"` with "
        "`hf_paged.EncoderDecoderPagedCache(model.config)`: greedy, beam search and seeded sampling with "
        "`num_return_sequences`, the same tokens and scores as transformers' `EncoderDecoderCache` + sdpa/eager). The "
        "decoder's self-attention is paged; each request's cross-attention K/V are stored once and shared by its beams "
        "and samples (reference counted, beam reorders copy nothing). A `PagedCache` alone is refused for them:",
        "",
        "| model type | supported | decoder self-attention | cross-attention K/V | exercises |",
        "|---|---|---|---|---|",
    ]
    lines += [_encdec_row(c) for c in ENCODER_DECODERS]
    return "\n".join(lines)


def current() -> str | None:
    text = README.read_text()
    if START not in text or END not in text:
        return None
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n")


def write() -> Path:
    text = README.read_text()
    if START in text and END in text:
        head, rest = text.split(START, 1)
        _, tail = rest.split(END, 1)
        README.write_text(f"{head}{START}\n{render()}\n{END}{tail}")
        return README
    out = README.parent / "docs" / "support_table.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(f"# Supported models\n\n{render()}\n")
    return out


if __name__ == "__main__":
    if "--check" in sys.argv[1:]:
        sys.exit(0 if current() == render() else 1)
    print(f"wrote {write()}")
