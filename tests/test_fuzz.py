"""Differential fuzzer: random `generate()` calls, PagedCache + "paged" vs DynamicCache + the reference attention.

Each example draws a model family of the matrix (Llama, Mistral with a small sliding window, Qwen2, Gemma 2
with softcap + sliding layers against eager, GPT-2, Phi-3), a batch of 1-4 prompts (left padding, right
padding, holes in the attention mask, no mask; some rows copies of others, so they are stored once), a block
size (1, 4, 16), a cache (a bare `PagedCache` with or without row dedupe, or a `KVPool` cache: empty, holding
its prompt, or after an earlier request that shares a prefix so `new_cache()` hits it) and a `generate()`
configuration: greedy, seeded sampling (top-k / top-p / temperature), beam search and beam sampling (with
`num_return_sequences`), parallel samples, prompt-lookup and assisted decoding (a one-layer draft of the same
family), chunked prefill (any chunk size, 1 included), EOS tokens, and `max_new_tokens` across block
boundaries. Some examples continue from the returned cache with a second `generate()` call (prompt lookup
included): on the same cache, after `crop()`, on a cropped `fork()` (then the original continues too), or through
the pool's prefix index (`commit_tokens`, then `new_cache()` of a prefix of the conversation plus new tokens). Sliding-window
examples also generate past the window plus the kept margin and crop back.

Both runs start from the same torch seed; the tokens must be equal and every step's logits within `ATOL`
(fp32), and `pool.check()` must pass after every paged `generate()`. A continuation is compared with the
reference computing the whole continued prompt from scratch; after right padding or holes, with the reference's
own cache continued the same way (cropped, copied), because there transformers itself differs between the two:
generate() numbers a right-padded row's new tokens from the position of its last column, a pad. Three refusals are documented behaviour and
accepted only where documented, after which the cache must be intact: a sliding-window `crop()` further
back than the tokens kept beyond the window, a `crop()` over padding that follows real tokens, and
sliding-window layers over a batch with padding after a real token once the columns exceed the window.

Weights are scaled up (x3, `matrix.saved`) so logits are peaked and argmax ties are rare. Torch runs one
thread (deterministic). Deterministic in CI (derandomized, no example database); set
`HF_PAGED_FUZZ_SEED=<int>` to explore other examples and `HF_PAGED_FUZZ_SCALE=<float>` to run more or fewer.
A failure prints the falsifying `Scenario` (everything needed to rerun it: `run_scenario(scenario)`) and a
`@reproduce_failure` blob.
"""

from __future__ import annotations

import copy

import functools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import DynamicCache

import hf_paged
from hf_paged.cache.rows import SLIDING_MARGIN

from helpers import fuzz
from matrix import MODELS, load, saved

#: Per-step logits tolerance (fp32), as in the other generate() comparisons.
ATOL = 1e-3
RTOL = 1e-4
VOCAB = 128
PAD = 0
WINDOW = 8  # the matrix's sliding window: far shorter than prompt + output

FAMILIES = ("llama", "mistral", "qwen2", "gemma2", "gpt2", "phi3")
SLIDING_FAMILIES = ("mistral", "gemma2")
CASES = {c.id: c for c in MODELS}
assert all(CASES[f].expect == "pass" for f in FAMILIES)


# ---------------------------------------------------------------------------------------------- models
def _overrides(family: str, **extra) -> tuple:
    return tuple(sorted({**CASES[family].config, **extra}.items()))


@functools.lru_cache(maxsize=None)
def model(family: str, attn: str, draft: bool = False):
    """The family's tiny model of the matrix (weights x3), loaded once per process; `draft=True`: its
    one-layer sibling (same vocabulary), the assistant of assisted decoding."""
    extra = {"num_hidden_layers": 1} if draft else {}
    return load(saved(family, _overrides(family, **extra), scale=3.0), attn)


def reference_attention(family: str) -> str:
    return CASES[family].ref


# ---------------------------------------------------------------------------------------------- scenarios
@dataclass
class Call:
    """One generate() call's configuration (kwargs beyond inputs and cache)."""

    mode: str  # greedy | sample | beam | beam_sample | samples | lookup | assisted | assisted_sample
    max_new_tokens: int
    prefill_chunk_size: int | None = None
    num_beams: int = 1
    num_return_sequences: int = 1
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    prompt_lookup_num_tokens: int | None = None
    eos_token_id: int | list[int] | None = None
    seed: int = 0

    def kwargs(self) -> dict:
        kw = dict(max_new_tokens=self.max_new_tokens, pad_token_id=PAD, eos_token_id=self.eos_token_id,
                  return_dict_in_generate=True, output_logits=True, output_scores=self.num_beams > 1)
        sampling = self.mode in ("sample", "beam_sample", "samples", "assisted_sample")
        kw["do_sample"] = sampling
        if sampling:
            kw.update(top_k=self.top_k if self.top_k is not None else 0, top_p=self.top_p or 1.0,
                      temperature=self.temperature or 1.0)
        if self.num_beams > 1:
            kw["num_beams"] = self.num_beams
        if self.num_return_sequences > 1:
            kw["num_return_sequences"] = self.num_return_sequences
        if self.prompt_lookup_num_tokens:
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
        if self.prefill_chunk_size is not None:
            kw["prefill_chunk_size"] = self.prefill_chunk_size
        return kw


@dataclass
class Continue:
    """A second generate() on the first call's sequences (less the last `crop` columns the cache holds)
    plus new tokens, with the returned cache: `same` cache, `crop` then the same cache, a `fork` (the
    cropped fork and then the original continue, with different new tokens) or `pool` (commit_tokens,
    release, then `pool.new_cache()` of the continued prompt, which holds the cached prefix)."""

    how: str  # same | crop | fork | pool
    crop: int  # columns dropped from the cache (crop / fork), clamped to what it holds
    new_tokens: list[list[int]]  # per row of the first output (cycled when it has more rows)
    call: Call


@dataclass
class Scenario:
    family: str
    block_size: int
    #: bare (PagedCache) | bare_nodedupe (dedupe_rows=False) | pool (KVPool.new_cache()) | pool_prompt
    #: (KVPool.new_cache(input_ids, attention_mask)) | pool_warm (the same, after a request sharing a prefix)
    cache: str
    input_ids: list[list[int]]
    attention_mask: list[list[int]] | None
    call: Call
    cont: Continue | None = None
    warm: list[list[int]] | None = None  # pool_warm: the earlier request's (left-padded) prompts


def _tokens(n: int, alphabet: int, draw) -> list[int]:
    return draw(st.lists(st.integers(3, 3 + alphabet - 1), min_size=n, max_size=n))


@st.composite
def prompts(draw, batch: int, padding: str | None = None, max_len: int = 20):
    """(input_ids, attention_mask) rows; padding: none | left | right | holes | mixed | nomask."""
    padding = padding or draw(st.sampled_from(["left", "left", "left", "none", "nomask", "right", "holes", "mixed"]))
    alphabet = draw(st.sampled_from([4, 12, VOCAB - 3]))  # small alphabets repeat (prompt lookup, dedupe)
    lengths = [draw(st.integers(1, max_len)) for _ in range(batch)]
    # identical rows are stored once (dedupe): all rows alike, or some rows copies of earlier ones
    duplicates = draw(st.sampled_from(["no", "no", "all", "some"])) if batch > 1 else "no"
    if padding in ("none", "nomask"):
        lengths = [lengths[0]] * batch
    width = max(lengths)
    rows_ids, rows_mask = [], []
    for n in lengths:
        toks = _tokens(n, alphabet, draw)
        pad = width - n
        if padding in ("left", "none", "nomask"):
            ids, mask = [PAD] * pad + toks, [0] * pad + [1] * n
        elif padding == "right":
            ids, mask = toks + [PAD] * pad, [1] * n + [0] * pad
        else:  # holes (inside the real tokens) and, for mixed, padding on both sides as well
            left = draw(st.integers(0, pad)) if padding == "mixed" else pad
            ids = [PAD] * left + toks + [PAD] * (pad - left)
            mask = [0] * left + [1] * n + [0] * (pad - left)
            if n > 1:
                holes = draw(st.sets(st.integers(left + 1, left + n - 1), max_size=max(1, n // 3)))
                for k in holes:
                    mask[k] = 0
        rows_ids.append(ids)
        rows_mask.append(mask)
    for b in range(1, batch):
        if duplicates == "all" or (duplicates == "some" and draw(st.booleans())):
            source = 0 if duplicates == "all" else draw(st.integers(0, b - 1))
            rows_ids[b], rows_mask[b] = list(rows_ids[source]), list(rows_mask[source])
    return rows_ids, (None if padding == "nomask" else rows_mask)


@st.composite
def calls(draw, modes: list[str], width: int, max_new: int = 20, chunked: bool | None = None, min_new: int = 1):
    mode = draw(st.sampled_from(modes))
    call = Call(mode=mode, max_new_tokens=draw(st.integers(min_new, max_new)), seed=draw(st.integers(0, 2**16)))
    if chunked is None:
        chunked = draw(st.integers(0, 3)) == 0
    if chunked:
        call.prefill_chunk_size = draw(st.one_of(st.just(1), st.integers(1, width + 2)))
    if mode in ("sample", "beam_sample", "samples", "assisted_sample"):
        call.top_k = draw(st.sampled_from([None, 0, 5]))
        call.top_p = draw(st.sampled_from([None, 0.8]))
        call.temperature = draw(st.sampled_from([None, 0.7, 1.3]))
    if mode in ("beam", "beam_sample"):
        call.num_beams = draw(st.integers(2, 3))
        call.num_return_sequences = draw(st.integers(1, call.num_beams))
    if mode == "samples":
        call.num_return_sequences = draw(st.integers(2, 3))
    if mode == "lookup":
        call.prompt_lookup_num_tokens = draw(st.integers(1, 4))
    eos = draw(st.integers(0, 5))
    if eos == 0:
        call.eos_token_id = draw(st.integers(3, VOCAB - 1))
    elif eos == 1:  # many EOS tokens: rows finish at different steps
        call.eos_token_id = sorted(draw(st.sets(st.integers(3, VOCAB - 1), min_size=5, max_size=25)))
    return call


SINGLE_ROW_MODES = ("lookup", "assisted", "assisted_sample")  # transformers: batch size 1 only


@st.composite
def scenarios(draw, modes, families=FAMILIES, cont: bool | str = False, max_new: int = 20, max_len: int = 20,
              chunked: bool | None = None, padding: str | None = None, min_new: int = 1, max_crop: int = 40):
    family = draw(st.sampled_from(families))
    call_modes = list(modes)
    batch = draw(st.integers(1, 4))
    if any(m in SINGLE_ROW_MODES for m in call_modes) and batch > 1:
        call_modes = [m for m in call_modes if m not in SINGLE_ROW_MODES] or call_modes
        if set(call_modes) <= set(SINGLE_ROW_MODES):
            batch = 1
    ids, mask = draw(prompts(batch, padding=padding, max_len=max_len))
    call = draw(calls(call_modes, len(ids[0]), max_new=max_new, chunked=chunked, min_new=min_new))
    left_padded = mask is None or all(row[row.index(1):].count(0) == 0 for row in mask)
    kinds = ["bare", "bare_nodedupe", "pool"] + (["pool_prompt", "pool_warm"] if left_padded else [])
    cache = draw(st.sampled_from(kinds))
    scenario = Scenario(family, draw(st.sampled_from([1, 4, 16])), cache, ids, mask, call)
    if cache == "pool_warm":  # each row's prompt cut somewhere, then other tokens
        warm = []
        for row_ids, row_mask in zip(ids, mask or [[1] * len(ids[0])] * len(ids)):
            real = [t for t, m in zip(row_ids, row_mask) if m]
            warm.append(real[: draw(st.integers(1, len(real)))] + _tokens(draw(st.integers(0, 6)), VOCAB - 3, draw))
        width = max(map(len, warm))
        scenario.warm = [[PAD] * (width - len(w)) + w for w in warm]
    if cont and call.num_beams == 1:
        hows = ["same", "crop", "fork"] + (["pool"] if cache.startswith("pool") and left_padded else [])
        how = draw(st.sampled_from(hows)) if cont is True else cont
        rows = len(ids) * call.num_return_sequences
        n_new = draw(st.integers(1, 5))
        new = [_tokens(n_new, VOCAB - 3, draw) for _ in range(min(rows, 2))]
        # After right padding / holes the reference continues its own cache, and transformers cannot expand a
        # returned cache's rows for beams or samples: those continuations are compared after left padding only.
        modes2 = ["greedy", "sample", "beam", "samples"] if left_padded else ["greedy", "sample"]
        if left_padded and rows == 1:  # (its first forward feeds the whole prompt again: the cache stores it anew)
            modes2.append("lookup")
        call2 = draw(calls(modes2, n_new + 20, max_new=8))
        crop = draw(st.integers(0, max_crop)) if how in ("crop", "fork", "pool") else 0
        scenario.cont = Continue(how, crop, new, call2)
    return scenario


# ---------------------------------------------------------------------------------------------- runs
class Mismatch(AssertionError):
    pass


def _same(paged, ref, what: str) -> None:
    a, b = paged.sequences, ref.sequences
    if a.shape != b.shape or not torch.equal(a, b):
        raise Mismatch(f"{what}: tokens differ\npaged:\n{a}\nreference:\n{b}" + _logit_report(paged, ref))
    if len(paged.logits) != len(ref.logits):
        raise Mismatch(f"{what}: {len(paged.logits)} logit steps vs {len(ref.logits)}")
    for step, (x, y) in enumerate(zip(paged.logits, ref.logits, strict=True)):
        finite = torch.isfinite(y)
        if not torch.equal(finite, torch.isfinite(x)):
            raise Mismatch(f"{what}: step {step}: the -inf/nan pattern of the logits differs")
        if not torch.allclose(x[finite], y[finite], atol=ATOL, rtol=RTOL):
            diff = (x[finite] - y[finite]).abs().max().item()
            raise Mismatch(f"{what}: step {step}: logits differ by {diff:.3g}" + _logit_report(paged, ref))
    if getattr(ref, "sequences_scores", None) is not None:
        torch.testing.assert_close(paged.sequences_scores, ref.sequences_scores, atol=ATOL, rtol=RTOL)


def _logit_report(paged, ref) -> str:
    lines = []
    for step, (x, y) in enumerate(zip(paged.logits, ref.logits)):
        if x.shape != y.shape:
            lines.append(f"  step {step}: shapes {tuple(x.shape)} vs {tuple(y.shape)}")
            break
        finite = torch.isfinite(x) & torch.isfinite(y)
        per_row = torch.where(finite, (x - y).abs(), 0).amax(dim=-1)
        lines.append(f"  step {step}: max |logit diff| per row {[round(v, 5) for v in per_row.tolist()]}")
    return "\nper-step logits (paged vs reference):\n" + "\n".join(lines)


def _generate(m, inputs: dict, cache, call: Call, assistant=None):
    torch.manual_seed(call.seed)
    kw = call.kwargs()
    if call.mode in ("assisted", "assisted_sample"):
        kw["assistant_model"] = assistant
    return m.generate(**inputs, **hf_paged.cache_kwargs(cache), **kw)


def _inputs(ids, mask) -> dict:
    out = {"input_ids": torch.tensor(ids, dtype=torch.long)}
    if mask is not None:
        out["attention_mask"] = torch.tensor(mask, dtype=torch.long)
    return out


def _new_cache(s: Scenario, paged_model, ref_model, inputs: dict):
    if s.cache in ("bare", "bare_nodedupe"):
        return None, hf_paged.PagedCache(block_size=s.block_size, dedupe_rows=s.cache == "bare")
    pool = hf_paged.KVPool(paged_model.config, block_size=s.block_size)
    if s.cache == "pool_warm":  # an earlier request shares a prefix with these prompts: new_cache() hits it
        warm = {"input_ids": torch.tensor(s.warm, dtype=torch.long)}
        warm["attention_mask"] = (warm["input_ids"] != PAD).long()
        call = Call("greedy", max_new_tokens=3)
        with pool.new_cache(warm["input_ids"], warm["attention_mask"]) as cache:
            out = _generate(paged_model, warm, cache, call)
            cache.commit_tokens(out.sequences)
        pool.check()
        _same(out, _generate(ref_model, warm, DynamicCache(config=ref_model.config), call), "warm-up request")
    if s.cache in ("pool_prompt", "pool_warm"):
        return pool, pool.new_cache(inputs["input_ids"], inputs.get("attention_mask"))
    return pool, pool.new_cache()


def _crop(cache, drop: int, family: str, mask: torch.Tensor) -> int:
    """`cache.crop(-drop)`; returns the columns dropped (0 when refused). `mask`: the padding mask of the
    columns the cache holds. Two documented refusals, after which the cache must be exactly as before
    (checked by `pool.check()` and by continuing from it):
    - sliding-window layers stepping back further than the tokens they keep beyond the window (at least
      `SLIDING_MARGIN`, and the last forward);
    - a crop reaching back over padding that follows real tokens (right padding, holes): a paged cache
      stores no padding, so it crops only the trailing columns that are real tokens in every row."""
    try:
        cache.crop(-drop)
        return drop
    except ValueError as error:
        if "steps back further than the tokens kept beyond" in str(error) and family in SLIDING_FAMILIES:
            assert drop > SLIDING_MARGIN, f"crop(-{drop}) refused, though {SLIDING_MARGIN} tokens are kept: {error}"
        elif "reaches back over padding that follows real tokens" in str(error):
            real_tail = int(mask.flip(1).cumprod(dim=1).sum(dim=1).min())
            assert _gapped(mask) and drop > real_tail, f"crop(-{drop}) refused, {real_tail} real columns: {error}"
        else:
            raise
        cache.pool.check()
        return 0


def _crop_reference(ref_cache: DynamicCache, drop: int, mirrored: bool) -> None:
    """Crops the reference's cache as the paged one was cropped, where the continuation reads it."""
    if mirrored and drop:
        ref_cache.crop(-drop)


def _gapped(mask: torch.Tensor | None) -> bool:
    """A row has padding after its first real token (right padding or a hole)."""
    return mask is not None and bool(((mask.cumsum(dim=1) > 0) & (mask == 0)).any())


def _refused_gap(error: ValueError, family: str, mask: torch.Tensor | None, columns: int) -> bool:
    """hf-paged's documented refusal: sliding-window layers over a batch with padding after a real token
    (transformers counts a window in columns, a paged cache stores real tokens only), once the columns
    exceed the window. Anything else is a bug."""
    if "padding after its first real token" not in str(error):
        return False
    assert family in SLIDING_FAMILIES and _gapped(mask) and columns > WINDOW, f"refused without cause: {error}"
    return True


def run_scenario(s: Scenario) -> None:
    """Runs one scenario: raises `Mismatch` (or what hf-paged raised) on a difference."""
    paged_model, ref_model = model(s.family, "paged"), model(s.family, reference_attention(s.family))
    drafts = (model(s.family, "paged", draft=True), model(s.family, reference_attention(s.family), draft=True))
    inputs = _inputs(s.input_ids, s.attention_mask)
    pool, cache = _new_cache(s, paged_model, ref_model, inputs)
    try:
        paged = _generate(paged_model, inputs, cache, s.call, drafts[0])
    except ValueError as error:
        width = inputs["input_ids"].shape[1]
        if not _refused_gap(error, s.family, inputs.get("attention_mask"), width + s.call.max_new_tokens):
            raise
        cache.pool.check()
        return
    cache.pool.check()
    ref_cache = DynamicCache(config=ref_model.config)
    if s.cont is not None:  # sliding layers keep what a crop of the reference may need
        ref_cache.activate_past_recording()
    ref = _generate(ref_model, inputs, ref_cache, s.call, drafts[1])
    _same(paged, ref, "first generate()")
    if s.cont is None:
        return
    c = s.cont
    sequences = paged.sequences
    rows = sequences.shape[0]
    mask = inputs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(inputs["input_ids"])
    mask = mask.repeat_interleave(rows // mask.shape[0], dim=0)
    mask = torch.cat([mask, torch.ones(rows, sequences.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)

    def continued(new_tokens, kept: int):
        new = torch.tensor([new_tokens[r % len(new_tokens)] for r in range(rows)], dtype=torch.long)
        ids2 = torch.cat([sequences[:, :kept], new], dim=1)
        mask2 = torch.cat([mask[:, :kept], torch.ones_like(new)], dim=1)
        return {"input_ids": ids2, "attention_mask": mask2}

    mirrored = _gapped(inputs.get("attention_mask"))  # see the module docstring

    def check(cache2, inputs2, what, ref_cache2):
        try:
            out = _generate(paged_model, inputs2, cache2, c.call)
        except ValueError as error:
            columns = inputs2["input_ids"].shape[1] + c.call.max_new_tokens
            if not _refused_gap(error, s.family, inputs2["attention_mask"], columns):
                raise
            cache2.pool.check()
            return
        cache2.pool.check()
        reference = ref_cache2 if mirrored else DynamicCache(config=ref_model.config)
        _same(out, _generate(ref_model, inputs2, reference, c.call), what)

    held = cache.get_seq_length()
    if c.how == "same":
        check(cache, continued(c.new_tokens, held), "continued generate() on the same cache", ref_cache)
    elif c.how == "crop":
        drop = _crop(cache, min(c.crop, held), s.family, mask[:, :held])
        _crop_reference(ref_cache, drop, mirrored)
        check(cache, continued(c.new_tokens, held - drop), f"continued generate() after crop(-{drop})", ref_cache)
    elif c.how == "fork":
        fork, ref_fork = cache.fork(), copy.deepcopy(ref_cache)
        drop = _crop(fork, min(c.crop, held), s.family, mask[:, :held])
        _crop_reference(ref_fork, drop, mirrored)
        check(fork, continued(c.new_tokens, held - drop), f"continued generate() on a fork cropped by {drop}",
              ref_fork)
        other = [list(reversed(t)) for t in c.new_tokens]
        check(cache, continued(other, held), "continued generate() on the original after its fork continued",
              ref_cache)
    elif c.how == "pool":
        cache.commit_tokens(sequences)
        cache.release()
        inputs2 = continued(c.new_tokens, held - min(c.crop, held))  # a prefix of what it held, or all
        cache2 = pool.new_cache(inputs2["input_ids"], inputs2["attention_mask"])
        check(cache2, inputs2, f"continued generate() from pool.new_cache() (prefix hit {cache2.get_seq_length()})",
              None)
    pool_ = cache.pool
    pool_.check()


# ---------------------------------------------------------------------------------------------- settings
pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------- tests
@fuzz(110)
@given(scenarios(["greedy", "sample", "samples"]))
def test_fuzz_greedy_and_sampling(scenario: Scenario) -> None:
    run_scenario(scenario)


@fuzz(80)
@given(scenarios(["beam", "beam_sample"], max_new=12))
def test_fuzz_beams(scenario: Scenario) -> None:
    run_scenario(scenario)


@fuzz(80)
@given(scenarios(["lookup", "assisted", "assisted_sample"]))
def test_fuzz_speculative(scenario: Scenario) -> None:
    run_scenario(scenario)


@fuzz(80)
@given(scenarios(["greedy", "sample", "samples", "beam"], chunked=True, max_new=10))
def test_fuzz_chunked_prefill(scenario: Scenario) -> None:
    run_scenario(scenario)


@fuzz(110)
@given(scenarios(["greedy", "sample", "samples", "lookup", "assisted"], cont=True, max_new=12))
def test_fuzz_continue_crop_fork_pool(scenario: Scenario) -> None:
    run_scenario(scenario)


@fuzz(40)
@given(scenarios(["greedy", "sample", "assisted"], families=SLIDING_FAMILIES, cont="crop",
                 min_new=WINDOW + SLIDING_MARGIN - 8, max_new=WINDOW + SLIDING_MARGIN + 24, max_len=12, max_crop=120))
def test_fuzz_sliding_window_long(scenario: Scenario) -> None:
    """Long enough that sliding layers free out-of-window blocks; then crop() steps back (possibly past
    the kept margin) and generation continues."""
    run_scenario(scenario)
