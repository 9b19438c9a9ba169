"""Feature matrix: every `generate()` option of `matrix.FEATURES` gives the same results with
PagedCache + "paged" as with DynamicCache + sdpa (tiny Llama; Mistral for sliding windows)."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from transformers import (
    DynamicCache,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerFast,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    TextStreamer,
)

import hf_paged
from hf_paged.cache.rows import SLIDING_MARGIN

from helpers import left_padded
from matrix import FEATURES, Case, load, saved, saved_case

LLAMA = Case("llama")
BS = 4  # block size: short prompts still span several blocks
ATOL = 1e-4


def prompts(lengths=(5, 11, 2), seed: int = 1, vocab: int = 128):
    return left_padded(list(lengths), vocab=vocab, seed=seed, low=3)


def models(case: Case = LLAMA, dtype=torch.float32, ref: str = "sdpa"):
    path = saved_case(case)
    return load(path, "paged", dtype), load(path, ref, dtype)


def both(paged_model, ref_model, *, cache=None, seed: int = 0, **kwargs):
    """Same generate() call on both models; returns (paged output, reference output, paged cache)."""
    cache = cache if cache is not None else hf_paged.PagedCache(block_size=BS)
    common = dict(pad_token_id=0, eos_token_id=None, max_new_tokens=7)
    common.update(kwargs)
    torch.manual_seed(seed)
    paged = paged_model.generate(**hf_paged.cache_kwargs(cache), **common)
    torch.manual_seed(seed)
    ref = ref_model.generate(**hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)), **common)
    return paged, ref, cache


def same_sequences(paged, ref) -> None:
    a = paged if isinstance(paged, torch.Tensor) else paged.sequences
    b = ref if isinstance(ref, torch.Tensor) else ref.sequences
    assert torch.equal(a, b), f"\n{a}\n{b}"


def same_steps(a, b, atol: float = ATOL) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        finite = torch.isfinite(y)
        assert torch.equal(finite, torch.isfinite(x)), f"step {step}: -inf pattern differs"
        torch.testing.assert_close(x[finite], y[finite], atol=atol, rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


def batch(**extra):
    ids, mask = prompts()
    return dict(input_ids=ids, attention_mask=mask, **extra)


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocab: token i <-> "w{i}"."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers  # noqa: PLC0415

    vocab = {f"w{i}": i for i in range(128)}
    tok = Tokenizer(tok_models.WordLevel(vocab=vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", unk_token="w1", eos_token="w2")


# ---------------------------------------------------------------------------------------------- features
def check_greedy():
    paged, ref, cache = both(*models(), **batch(do_sample=False), return_dict_in_generate=True, output_logits=True)
    same_sequences(paged, ref)
    same_steps(paged.logits, ref.logits)
    cache.pool.check()


def check_sampling():
    paged, ref, _ = both(*models(), **batch(do_sample=True, top_k=0), seed=3, return_dict_in_generate=True,
                         output_logits=True)
    same_sequences(paged, ref)
    same_steps(paged.logits, ref.logits)


def check_top_k_top_p():
    paged, ref, _ = both(*models(), **batch(do_sample=True, top_k=5, top_p=0.8, temperature=0.7), seed=4)
    same_sequences(paged, ref)


def check_beam_search():
    paged, ref, cache = both(*models(), **batch(num_beams=3, num_return_sequences=2, do_sample=False),
                             return_dict_in_generate=True, output_scores=True)
    same_sequences(paged, ref)
    torch.testing.assert_close(paged.sequences_scores, ref.sequences_scores, atol=ATOL, rtol=1e-4)
    cache.pool.check()


def check_beam_sampling():
    paged, ref, _ = both(*models(), **batch(num_beams=2, do_sample=True), seed=5)
    same_sequences(paged, ref)


def check_num_return_sequences():
    paged, ref, cache = both(*models(), **batch(do_sample=True, num_return_sequences=3), seed=6)
    same_sequences(paged, ref)
    assert paged.shape[0] == 9
    cache.pool.check()


def check_assisted_decoding():
    paged_model, ref_model = models()
    draft = load(saved("llama", (("num_hidden_layers", 1),), scale=3.0), "paged")
    ids, mask = prompts((9,))
    plain, _, _ = both(paged_model, ref_model, input_ids=ids, attention_mask=mask, max_new_tokens=12)
    paged, ref, cache = both(paged_model, ref_model, input_ids=ids, attention_mask=mask, max_new_tokens=12,
                             assistant_model=draft)
    same_sequences(paged, ref)
    same_sequences(paged, plain)  # greedy assisted decoding equals greedy decoding
    assert cache.get_seq_length() == paged.shape[1] - 1  # crop() left exactly the accepted tokens
    cache.pool.check()


def check_prompt_lookup():
    paged_model, ref_model = models()
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    paged, ref, cache = both(paged_model, ref_model, input_ids=ids, attention_mask=torch.ones_like(ids),
                             prompt_lookup_num_tokens=3, max_new_tokens=10)
    plain, _, _ = both(paged_model, ref_model, input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10)
    same_sequences(paged, ref)
    same_sequences(paged, plain)
    cache.pool.check()


def check_streamers():
    paged_model, ref_model = models()
    tok = tokenizer()
    ids, mask = prompts((6,))
    texts = []
    for model, cache in ((paged_model, hf_paged.PagedCache(block_size=BS)), (ref_model, DynamicCache())):
        streamer = TextIteratorStreamer(tok, skip_prompt=True)
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, eos_token_id=None,
                      streamer=streamer, **hf_paged.cache_kwargs(cache))
        thread = threading.Thread(target=model.generate, kwargs=kwargs)
        thread.start()
        texts.append("".join(streamer))
        thread.join()
    assert texts[0] == texts[1] and texts[0].strip()
    printed = TextStreamer(tok, skip_prompt=True)
    out = paged_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0,
                               eos_token_id=None, streamer=printed, **hf_paged.cache_kwargs(hf_paged.PagedCache()))
    assert tok.decode(out[0, ids.shape[1]:]).strip() == texts[0].strip()


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def check_stopping():
    paged_model, ref_model = models()
    ids, mask = prompts((7,))
    free, _, _ = both(paged_model, ref_model, input_ids=ids, attention_mask=mask, max_new_tokens=10)
    target = int(free[0, ids.shape[1] + 4])  # the 5th generated token
    criteria = StoppingCriteriaList([StopAfterToken(target)])
    paged, ref, _ = both(paged_model, ref_model, input_ids=ids, attention_mask=mask, max_new_tokens=10,
                         stopping_criteria=criteria)
    same_sequences(paged, ref)
    assert paged.shape[1] <= ids.shape[1] + 5 and int(paged[0, -1]) == target


class BanOddTokens(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, 1::2] = -math.inf
        return scores


def check_stop_strings():
    from hf_paged.demo_model import load_demo_model

    model, tokenizer = load_demo_model()
    inputs = tokenizer(["def __init__(self"], return_tensors="pt")
    kw = dict(**inputs, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id,
              stop_strings=[":\n"], tokenizer=tokenizer)
    model.set_attn_implementation("sdpa")
    ref = model.generate(**hf_paged.cache_kwargs(DynamicCache()), **kw)
    model.set_attn_implementation("paged")
    got = model.generate(**hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=BS)), **kw)
    assert torch.equal(got, ref)
    assert got.shape[1] < inputs.input_ids.shape[1] + 40  # stopped at the string


def check_logits_processors():
    paged, ref, _ = both(*models(), **batch(logits_processor=LogitsProcessorList([BanOddTokens()]),
                                           repetition_penalty=1.3, no_repeat_ngram_size=2))
    same_sequences(paged, ref)
    assert (paged[:, -7:] % 2 == 0).all()


def check_scores_and_logits():
    paged, ref, _ = both(*models(), **batch(do_sample=True, top_k=8), seed=8, return_dict_in_generate=True,
                         output_scores=True, output_logits=True)
    same_sequences(paged, ref)
    same_steps(paged.logits, ref.logits)
    same_steps(paged.scores, ref.scores)


def check_chunked_prefill():
    paged_model, ref_model = models()
    ids, mask = prompts((13,))
    paged, ref, cache = both(paged_model, ref_model, input_ids=ids, attention_mask=mask, prefill_chunk_size=5,
                             return_dict_in_generate=True, output_logits=True)
    whole, _, _ = both(paged_model, ref_model, input_ids=ids, attention_mask=mask, return_dict_in_generate=True,
                       output_logits=True)
    same_sequences(paged, ref)
    same_sequences(paged, whole)
    same_steps(paged.logits, ref.logits)
    cache.pool.check()


def check_inputs_embeds():
    paged_model, ref_model = models()
    ids, mask = prompts()
    embeds = paged_model.get_input_embeddings()(ids)
    paged, ref, _ = both(paged_model, ref_model, inputs_embeds=embeds, attention_mask=mask,
                         return_dict_in_generate=True, output_logits=True)
    same_sequences(paged, ref)
    same_steps(paged.logits, ref.logits)


def check_continue_from_cache():
    paged_model, ref_model = models()
    ids, mask = prompts()
    cache, ref_cache = hf_paged.PagedCache(block_size=BS), DynamicCache(config=ref_model.config)
    kw = dict(pad_token_id=0, eos_token_id=None, max_new_tokens=5)
    first = paged_model.generate(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), **kw)
    first_ref = ref_model.generate(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(ref_cache), **kw)
    same_sequences(first, first_ref)
    more = torch.randint(3, 128, (ids.shape[0], 3), generator=torch.Generator().manual_seed(9))
    ids2 = torch.cat([first, more], dim=1)
    mask2 = torch.cat([mask, torch.ones(ids.shape[0], 5 + 3, dtype=mask.dtype)], dim=1)
    second = paged_model.generate(input_ids=ids2, attention_mask=mask2, **hf_paged.cache_kwargs(cache), **kw)
    second_ref = ref_model.generate(input_ids=ids2, attention_mask=mask2, **hf_paged.cache_kwargs(ref_cache), **kw)
    same_sequences(second, second_ref)
    cache.pool.check()


def _block_end(new_tokens: int):
    """Prompt 8 tokens, block size 4: the cache holds prompt + new - 1 tokens; 5 new tokens end exactly
    at a block boundary (12 = 3 blocks), 6 end mid-block (13 -> 4 blocks). Continuing from either works."""
    paged_model, ref_model = models()
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    paged, ref, cache = both(paged_model, ref_model, input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             return_dict_in_generate=True, output_logits=True)
    same_sequences(paged, ref)
    same_steps(paged.logits, ref.logits)
    stored = 8 + new_tokens - 1
    stats = cache.stats()
    assert stats.tokens_stored == 2 * stored  # rows differ: nothing shared
    assert stats.blocks_in_use == 2 * math.ceil(stored / BS)
    assert (stored % BS == 0) == (new_tokens == 5)
    # continuing appends into the partial block (mid-block) or opens a new one (boundary)
    nxt = torch.cat([paged.sequences, torch.full((2, 1), 7)], dim=1)
    out = paged_model.generate(input_ids=nxt, attention_mask=torch.ones_like(nxt), **hf_paged.cache_kwargs(cache),
                               max_new_tokens=3, pad_token_id=0, eos_token_id=None)
    ref_out = ref_model.generate(input_ids=nxt, attention_mask=torch.ones_like(nxt), max_new_tokens=3,
                                 pad_token_id=0, eos_token_id=None)
    same_sequences(out, ref_out)
    cache.pool.check()


def check_max_new_tokens_at_block_boundary():
    _block_end(5)


def check_max_new_tokens_mid_block():
    _block_end(6)


MISTRAL_WINDOW = 32
MISTRAL = Case("mistral", {"sliding_window": MISTRAL_WINDOW})


class RecordBlocks(StoppingCriteria):
    def __init__(self, cache) -> None:
        self.cache, self.blocks = cache, []

    def __call__(self, input_ids, scores, **kwargs):
        self.blocks.append(self.cache.stats().blocks_in_use)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def check_sliding_window_bounded_memory():
    """A Mistral-like model generating 4x its window: blocks in use stop growing at window + margin."""
    paged_model, ref_model = models(MISTRAL)
    ids, mask = prompts((6,))
    cache = hf_paged.PagedCache(block_size=BS)
    record = RecordBlocks(cache)
    new = 4 * (MISTRAL_WINDOW + SLIDING_MARGIN)
    paged, ref, _ = both(paged_model, ref_model, cache=cache, input_ids=ids, attention_mask=mask,
                         max_new_tokens=new, stopping_criteria=StoppingCriteriaList([record]),
                         return_dict_in_generate=True, output_logits=True)
    same_sequences(paged, ref)
    same_steps(paged.logits, ref.logits, atol=2e-4)
    bound = math.ceil((MISTRAL_WINDOW + SLIDING_MARGIN) / BS) + 2
    unbounded = math.ceil((6 + new) / BS)
    assert max(record.blocks) <= bound < unbounded / 3, (max(record.blocks), bound, unbounded)
    assert record.blocks[-1] >= bound - 3  # it did reach the window's size
    cache.pool.check()


def same_up_to_near_tie(paged, ref) -> None:
    """bf16 rounds differently in the paged and reference paths: logits agree within bf16 tolerance at every
    step up to and including the first step where a near-tie picks different tokens (after it, inputs differ)."""
    new_paged, new_ref = paged.sequences[:, -7:], ref.sequences[:, -7:]
    differs = (new_paged != new_ref).any(dim=0).nonzero()
    last = int(differs[0]) if len(differs) else 6
    assert last >= 3, "bf16 tokens diverged within 3 steps"
    same_steps(paged.logits[: last + 1], ref.logits[: last + 1], atol=0.15)


def check_bf16():
    paged_model, ref_model = models(dtype=torch.bfloat16)
    paged, ref, cache = both(paged_model, ref_model, **batch(), return_dict_in_generate=True, output_logits=True)
    same_up_to_near_tie(paged, ref)
    assert all(t.dtype == torch.bfloat16 for t in cache.pool.key_caches.values())


def check_dtype_auto():
    path = saved("llama", (("dtype", "bfloat16"),))
    paged_model, ref_model = load(path, "paged", "auto"), load(path, "sdpa", "auto")
    assert paged_model.dtype == torch.bfloat16
    paged, ref, cache = both(paged_model, ref_model, **batch(), return_dict_in_generate=True, output_logits=True)
    same_up_to_near_tie(paged, ref)
    for layer_idx, key_cache in cache.pool.key_caches.items():  # the pool follows each layer's dtype/device
        layer = paged_model.model.layers[layer_idx].self_attn.k_proj.weight
        assert key_cache.dtype == layer.dtype and key_cache.device == layer.device


def check_gemma2_softcap_bf16():
    case = Case("gemma2", {"sliding_window": 8})
    paged_model, ref_model = models(case, dtype=torch.bfloat16, ref="eager")
    paged, ref, _ = both(paged_model, ref_model, **batch(), return_dict_in_generate=True, output_logits=True)
    same_sequences(paged, ref)


CHECKS = {name.removeprefix("check_"): fn for name, fn in globals().items() if name.startswith("check_")}


def test_every_feature_has_a_check() -> None:
    assert set(CHECKS) == set(FEATURES), set(CHECKS) ^ set(FEATURES)


@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature(feature: str) -> None:
    CHECKS[feature]()
