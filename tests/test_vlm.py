"""Vision-language models: a prefix cache that sees the image (issue 32), and VLM families through generate()."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.engine.rows_step import is_hybrid
from hf_paged.compat import IMAGE_PROMPT_HITS
from helpers import tiered
from hf_paged.memory.prefix import block_digests, content_keys
from vlm_matrix import IMAGE_TOKEN, MAKE_TEST, VLMS, load_vlm, prompt, saved_vlm

LLAVA = next(c for c in VLMS if c.model_type == "llava")
BEFORE, AFTER = [1, 5, 6, 7, 8, 9, 10, 11, 12], [7, 8, 9, 10, 11]  # 9 text tokens: 2 whole blocks before the image
BS = 4
NEW = 6


@pytest.fixture(scope="module")
def llava():
    return load_vlm(saved_vlm(LLAVA), "paged")


@pytest.fixture(scope="module")
def llava_ref():
    return load_vlm(saved_vlm(LLAVA), "sdpa")


def _generate(model, inputs: dict, cache) -> torch.Tensor:
    return model.generate(**inputs, **hf_paged.cache_kwargs(cache), max_new_tokens=NEW, do_sample=False)[:, -NEW:]


def _cold(ref, inputs: dict) -> torch.Tensor:
    """The reference: DynamicCache + sdpa, the whole prompt computed."""
    return _generate(ref, inputs, DynamicCache(config=ref.config))


def _hits(tokens: int) -> int:
    """The hit of a prompt with images: `tokens`, or none on a release where such prompts miss
    (`compat.IMAGE_PROMPT_HITS`)."""
    return tokens if IMAGE_PROMPT_HITS else 0


def _fill(pool, model, inputs: dict, model_given: bool = True) -> None:
    """One request on the pool whose whole sequence is then indexed (as a conversation's first turn); keyed by the
    model's weights unless not `model_given`."""
    with pool.new_cache(**inputs, **({"model": model} if model_given else {})) as cache:
        out = model.generate(
            **cache.uncached_inputs(inputs), **hf_paged.cache_kwargs(cache), max_new_tokens=NEW, do_sample=False
        )
        cache.commit_tokens(out)
    pool.check()


def test_same_image_hits_over_the_image_with_cold_tokens(llava, llava_ref):
    pool = hf_paged.KVPool(llava.config, block_size=BS)
    inputs = prompt(LLAVA, BEFORE, AFTER, seed=1)
    _fill(pool, llava, inputs)
    with pool.new_cache(**inputs, model=llava) as cache:
        length = inputs["input_ids"].shape[1]
        assert cache.stats().prefix_hit_tokens == _hits((length - 1) // BS * BS)  # text, image and text after it
        assert ("pixel_values" not in cache.uncached_inputs(inputs)) == IMAGE_PROMPT_HITS
        assert torch.equal(_generate(llava, cache.uncached_inputs(inputs), cache), _cold(llava_ref, inputs))
    pool.check()


def test_prompts_with_images_miss_on_releases_not_checked_for_their_hits(llava, llava_ref, monkeypatch):
    from hf_paged.cache import prefix_hits  # noqa: PLC0415

    pool = hf_paged.KVPool(llava.config, block_size=BS)
    inputs = prompt(LLAVA, BEFORE, AFTER, seed=1)
    _fill(pool, llava, inputs)
    monkeypatch.setattr(prefix_hits, "IMAGE_PROMPT_HITS", False)
    with pool.new_cache(**inputs, model=llava) as cache:
        assert cache.stats().prefix_hit_tokens == 0 and "pixel_values" in cache.uncached_inputs(inputs)
        assert torch.equal(_generate(llava, cache.uncached_inputs(inputs), cache), _cold(llava_ref, inputs))
    pool.check()


def test_other_image_never_hits_the_image_blocks(llava, llava_ref):
    pool = hf_paged.KVPool(llava.config, block_size=BS)
    first, second = prompt(LLAVA, BEFORE, AFTER, seed=1), prompt(LLAVA, BEFORE, AFTER, seed=2)
    assert torch.equal(first["input_ids"], second["input_ids"])
    _fill(pool, llava, first)
    with pool.new_cache(**second, model=llava) as cache:
        assert cache.stats().prefix_hit_tokens == _hits(len(BEFORE) // BS * BS)  # only the blocks before the image
        assert "pixel_values" in cache.uncached_inputs(second)
        assert torch.equal(_generate(llava, cache.uncached_inputs(second), cache), _cold(llava_ref, second))
    pool.check()


def test_unknown_image_is_a_safe_miss_from_the_first_placeholder(llava, llava_ref):
    pool = hf_paged.KVPool(llava.config, block_size=BS)
    first, second = prompt(LLAVA, BEFORE, AFTER, seed=1), prompt(LLAVA, BEFORE, AFTER, seed=2)
    _fill(pool, llava, first)
    # a cache told nothing of the image: the text before it hits, nothing from the first placeholder on
    with pool.new_cache(second["input_ids"], second["attention_mask"], model=llava) as cache:
        assert cache.stats().prefix_hit_tokens == _hits(len(BEFORE) // BS * BS)
        assert torch.equal(_generate(llava, second, cache), _cold(llava_ref, second))
        cache.commit_tokens(torch.cat([second["input_ids"], torch.zeros(1, NEW, dtype=torch.long)], dim=1))
    pool.check()
    # ... and indexes nothing from there on: the first image's request still hits only its own blocks
    with pool.new_cache(**first, model=llava) as cache:
        assert cache.stats().prefix_hit_tokens == _hits((first["input_ids"].shape[1] - 1) // BS * BS)
        assert torch.equal(_generate(llava, cache.uncached_inputs(first), cache), _cold(llava_ref, first))
    with pool.new_cache(**second, model=llava) as cache:
        assert cache.stats().prefix_hit_tokens == _hits(len(BEFORE) // BS * BS)
    pool.check()


def test_text_before_the_image_hits_with_another_question(llava, llava_ref):
    pool = hf_paged.KVPool(llava.config, block_size=BS)
    _fill(pool, llava, prompt(LLAVA, BEFORE, AFTER, seed=1))
    other = prompt(LLAVA, BEFORE, [20, 21, 22], seed=1)  # same image, another question after it
    with pool.new_cache(**other, model=llava) as cache:
        # the image's last placeholder shares its block with the new question: a hit covers a whole image or
        # none of it (the model encodes images whole), so only the text before it is kept
        assert cache.stats().prefix_hit_tokens == _hits(len(BEFORE) // BS * BS)
        assert torch.equal(_generate(llava, cache.uncached_inputs(other), cache), _cold(llava_ref, other))
    pool.check()


@pytest.mark.parametrize("model_given", [True, False], ids=["model", "pool_config"])
def test_ids_only_caches_never_serve_one_image_for_another(llava, llava_ref, model_given):
    """The issue's case with the API of a text model: caches told only the ids, two images, same text. Without
    `model=`, the placeholder ids are the pool's, which it keeps after its first forward adopted the language
    model's config (naming none)."""
    pool = hf_paged.KVPool(llava.config, block_size=BS)
    for seed in (1, 2):
        inputs = prompt(LLAVA, BEFORE, AFTER, seed=seed)
        model = {"model": llava} if model_given else {}
        with pool.new_cache(inputs["input_ids"], inputs["attention_mask"], **model) as cache:
            assert cache.stats().prefix_hit_tokens <= len(BEFORE) // BS * BS
            out = llava.generate(**inputs, **hf_paged.cache_kwargs(cache), max_new_tokens=NEW, do_sample=False)
            assert torch.equal(out[:, -NEW:], _cold(llava_ref, inputs))
            cache.commit_tokens(out)
        pool.check()


def test_a_pool_that_knows_no_placeholder_ids_refuses_inputs_its_cache_was_not_given(llava):
    """A KVPool made without the config learns only the language model's config (no placeholder ids): a cache told
    only the ids could not tell two images apart, so `uncached_inputs` with pixels it was not given says what to
    do, before anything runs."""
    inputs = prompt(LLAVA, BEFORE, AFTER, seed=1)
    pool = hf_paged.KVPool(block_size=BS)
    with pool.new_cache(inputs["input_ids"], inputs["attention_mask"]) as cache:
        with pytest.raises(ValueError, match=r"carry \['pixel_values'\].*new_cache\(\*\*inputs, model=model\)"):
            cache.uncached_inputs(inputs)
    with pool.new_cache(**inputs) as cache:  # given them: keyed by them from the first block
        assert set(cache.uncached_inputs(inputs)) == set(inputs)


@pytest.mark.skipif(not IMAGE_PROMPT_HITS, reason="prompts with images take no hit before 5.23")
@pytest.mark.parametrize("model_given", [True, False], ids=["model", "pool_config"])
def test_a_text_hit_after_an_image_request_is_positioned_as_a_cold_run(model_given):
    """Qwen2-VL's generate() positions a prompt continuing a cache by an offset the model keeps from its previous
    call: after a request with an image it is not a text prompt's. A hit given the model clears it (the tokens of
    a cold run); without the model, a text-only row of such a VLM misses."""
    case = next(c for c in VLMS if c.model_type == "qwen2_vl")
    path = saved_vlm(case)
    model, ref = load_vlm(path, "paged"), load_vlm(path, "sdpa")
    pool = hf_paged.KVPool(model.config, block_size=BS)
    text = torch.tensor([list(range(1, 14))])
    _fill(pool, model, {"input_ids": text}, model_given)
    _fill(pool, model, prompt(case, [1, 5, 6], [7, 8, 9], seed=1), model_given)
    assert model.model.rope_deltas is not None and model.model.rope_deltas.abs().sum() > 0  # the case at hand
    second = torch.cat([text[:, :12], torch.tensor([[40, 41, 42]])], dim=1)
    with pool.new_cache(second, **({"model": model} if model_given else {})) as cache:
        assert cache.stats().prefix_hit_tokens == (12 if model_given else 0)
        assert torch.equal(_generate(model, {"input_ids": second}, cache), _cold(ref, {"input_ids": second}))


# ---------------------------------------------------------------------------------------------- the VLM matrix
@pytest.mark.parametrize("case", tiered(VLMS, MAKE_TEST))
def test_vlm_generate_equals_dynamic_cache_with_an_image(case):
    """`from_pretrained(path, attn_implementation="paged")`, as a new user loads it: the vision tower runs "paged"
    without a cache too (plain attention over its own K/V)."""
    path = saved_vlm(case)
    paged_model, ref_model = load_vlm(path, "paged", everywhere=True), load_vlm(path, "sdpa")
    inputs = prompt(case, [1, 5, 6], [7, 8, 9], seed=3)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    cache = hf_paged.PagedCache(config=paged_model.config, block_size=BS)
    paged = paged_model.generate(**inputs, **hf_paged.cache_kwargs(cache), **kwargs)
    ref = ref_model.generate(**inputs, **hf_paged.cache_kwargs(DynamicCache(config=ref_model.config)), **kwargs)
    assert torch.equal(paged.sequences, ref.sequences)
    for step, (a, b) in enumerate(zip(paged.logits, ref.logits, strict=True)):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), f"step {step}: {(a - b).abs().max()}"
    assert cache.mode == "paged"
    cache.pool.check()


@pytest.mark.parametrize("model_given", [True, False], ids=["model", "pool_config"])
@pytest.mark.parametrize("told", [True, False], ids=["images_given", "ids_only"])
def test_rows_with_equal_text_and_other_images_are_not_stored_once(llava, llava_ref, told, model_given):
    """Identical prompt rows are stored once (dedupe_rows); equal placeholder ids with other images are not, also
    when the placeholder ids come from the pool's config (the rows' signatures are taken at the first forward,
    after the pool adopted the language model's config)."""
    one, two = prompt(LLAVA, BEFORE, AFTER, seed=1), prompt(LLAVA, BEFORE, AFTER, seed=2)
    batch = {k: torch.cat([one[k], two[k]]) for k in one}
    pool = hf_paged.KVPool(llava.config, block_size=BS)
    non_text = {"pixel_values": batch["pixel_values"]} if told else {}
    model = {"model": llava} if model_given else {}
    with pool.new_cache(batch["input_ids"], batch["attention_mask"], **model, **non_text) as cache:
        out = _generate(llava, cache.uncached_inputs(batch), cache)
        assert cache.stats().blocks_shared == 0
    for row, single in enumerate((one, two)):
        assert torch.equal(out[row : row + 1], _cold(llava_ref, single))
    pool.check()


@pytest.mark.parametrize("case", tiered(VLMS, MAKE_TEST))
def test_vlm_second_question_about_an_image_equals_a_cold_run(case):
    """A pool that served one question about an image: the same image again hits (over the image where the model
    takes it: `support.HITS_OVER_PLACEHOLDERS`, else the text before it), another image only the text before it
    (nothing where every prompt token attends the later ones: `support.BIDIRECTIONAL_PREFIX`); both give the tokens
    of a cold run."""
    path = saved_vlm(case)
    model, ref = load_vlm(path, "paged"), load_vlm(path, "sdpa")
    before = list(range(1, 9))  # two whole blocks of text before the image
    first = prompt(case, before, [20, 21], seed=1)
    image_end = first["input_ids"].shape[1] - 2
    after = [30] * (-image_end % BS) + [31, 32, 33]  # the question starts on a block of its own
    first = prompt(case, before, after, seed=1)
    pool = hf_paged.KVPool(model.config, block_size=BS)
    _fill(pool, model, first)
    over = hf_paged.support.hits_over_placeholders(model.config)
    hits = ((1, image_end + -image_end % BS if over else len(before)), (2, len(before)))
    if hf_paged.support.attends_prefix_bidirectionally(model.config):  # PaliGemma: its text sees the image
        hits = ((1, 0), (2, 0))
    if is_hybrid(model.config) and not over:  # a hit needs its recurrent states, kept where a forward ended (the
        hits = ((1, 0), (2, 0))  # prompt's end): none before the image, where the hit would stop
    for seed, hit in hits:
        inputs = prompt(case, before, after[:-3] + [40, 41, 42], seed=seed)
        kwargs = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
        cold = ref.generate(**inputs, **hf_paged.cache_kwargs(DynamicCache(config=ref.config)), **kwargs)
        with pool.new_cache(**inputs, model=model) as cache:
            assert cache.stats().prefix_hit_tokens == _hits(hit), seed
            out = model.generate(**cache.uncached_inputs(inputs), **hf_paged.cache_kwargs(cache), **kwargs)
        assert torch.equal(out.sequences, cold.sequences)
        for step, (a, b) in enumerate(zip(out.logits, cold.logits, strict=True)):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), f"seed {seed} step {step}: {(a - b).abs().max()}"
        pool.check()


# ---------------------------------------------------------------------------------------------- the digests
def test_digests_cover_the_content_from_the_block_of_the_first_placeholder():
    tokens = list(range(1, 13)) + [IMAGE_TOKEN] * 8 + [3, 4, 5, 6]  # first placeholder at 12: block 3 of 4
    plain = block_digests(tokens, BS)
    a, b = (content_keys({"pixel_values": torch.full((1, 3, 2, 2), float(v))}, [8])[0] for v in (1, 2))
    with_a = block_digests(tokens, BS, content_from=12, content=a)
    assert with_a[:3] == plain[:3] and len(with_a) == len(plain) == 6
    assert not set(with_a[3:]) & set(plain[3:])
    assert not set(with_a[3:]) & set(block_digests(tokens, BS, content_from=12, content=b))
    assert with_a == block_digests(tokens, BS, content_from=12, content=a)  # the same image: the same chain
    assert block_digests(tokens, BS, content_from=12) == plain[:3]  # unknown content: none from its block on
    # rows of a batch key apart, and by every row's placeholder count
    pixels = {"pixel_values": torch.ones(2, 3, 2, 2)}
    assert len(set(content_keys(pixels, [8, 8]))) == 2
    assert content_keys(pixels, [8, 8])[0] != content_keys(pixels, [8, 16])[0]


def test_a_fork_keys_its_blocks_by_the_same_image(llava, llava_ref):
    """A fork (copy.deepcopy, transformers' prompt-cache reuse) extends the same image-keyed chain."""
    pool = hf_paged.KVPool(llava.config, block_size=BS)
    inputs = prompt(LLAVA, BEFORE, AFTER, seed=1)
    with pool.new_cache(**inputs, model=llava) as cache:
        with cache.fork() as fork:
            out = llava.generate(
                **fork.uncached_inputs(inputs), **hf_paged.cache_kwargs(fork), max_new_tokens=NEW, do_sample=False
            )
            fork.commit_tokens(out)
    pool.check()
    with pool.new_cache(**inputs, model=llava) as cache:
        assert cache.stats().prefix_hit_tokens == _hits((inputs["input_ids"].shape[1] - 1) // BS * BS)
        assert torch.equal(_generate(llava, cache.uncached_inputs(inputs), cache), _cold(llava_ref, inputs))
    with pool.new_cache(**prompt(LLAVA, BEFORE, AFTER, seed=2), model=llava) as cache:
        assert cache.stats().prefix_hit_tokens == _hits(len(BEFORE) // BS * BS)
    pool.check()


def test_the_engine_refuses_placeholder_tokens_without_their_inputs():
    """A prompt holding a VLM's image placeholders as bare token ids is refused before anything runs (it would
    otherwise run without the image; requests with images bring the processor's output: test_engine_multimodal.py),
    text-only prompts of the same model are served."""
    engine = hf_paged.Engine(load_vlm(saved_vlm(LLAVA), "paged", everywhere=True))
    with pytest.raises(ValueError, match="placeholder tokens but no inputs.*pixel_values"):
        engine.generate([[5, 6, IMAGE_TOKEN, 7]], max_new_tokens=2, progress=False)
    assert engine.stats().pool.blocks_in_use == 0
    (out,) = engine.generate([[5, 6, 7, 8]], max_new_tokens=3, do_sample=False, progress=False)
    assert len(out) == 3


@pytest.mark.parametrize("case", [c for c in VLMS if c.model_type == "gemma4"], ids=lambda c: c.id)
def test_a_prefill_chunk_inside_a_bidirectional_image_is_attended_as_the_model_masks_it(case):
    """Gemma 4 (`use_bidirectional_attention="vision"`) in chunks of 4: the second chunk is exactly the image's four
    placeholders, whose tokens all see each other. The `"paged"` mask gives the attention transformers' own mask for
    it too (a chunk within a bidirectional block is not an encoder's forward), with the tokens and logits of a
    DynamicCache + sdpa run chunked alike."""
    path = saved_vlm(case)
    model, ref = load_vlm(path, "paged"), load_vlm(path, "sdpa")
    inputs = prompt(case, [1, 5, 6, 7, 8, 9, 10], [7, 8, 9, 10, 11, 13, 14, 15], seed=1)
    assert inputs["input_ids"][0, 8:12].eq(IMAGE_TOKEN).all()
    kwargs = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  prefill_chunk_size=4)
    want = ref.generate(**inputs, **hf_paged.cache_kwargs(DynamicCache(config=ref.config)), **kwargs)
    cache = hf_paged.PagedCache(config=model.config, block_size=BS)
    got = model.generate(**inputs, **hf_paged.cache_kwargs(cache), **kwargs)
    _assert_same_generation(got, want)


@pytest.mark.parametrize("case", tiered([c for c in VLMS if c.both_ways], {"gemma3"}), ids=lambda c: c.id)
def test_a_left_padded_batch_with_bidirectional_images_equals_dynamic_cache(case):
    """Two prompts of other lengths, each with its image, left-padded into one batch, on a family whose mask lets an
    image's tokens see the later ones: the forward that applies the model's own mask learns each row's padding from
    it (a padding column sees nothing) and stores only real tokens."""
    path = saved_vlm(case)
    model, ref = load_vlm(path, "paged"), load_vlm(path, "sdpa")
    rows = [prompt(case, [1, 5, 6], [7, 8, 9], seed=1), prompt(case, [1, 5, 6, 11, 12, 13, 14], [7, 8], seed=2)]
    width = max(r["input_ids"].shape[1] for r in rows)
    batch = {}
    for key in rows[0]:
        parts = [r[key] for r in rows]
        if key in ("input_ids", "attention_mask", case.token_types):
            parts = [torch.nn.functional.pad(p, (width - p.shape[1], 0)) for p in parts]
        batch[key] = torch.cat(parts)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    want = ref.generate(**batch, **hf_paged.cache_kwargs(DynamicCache(config=ref.config)), **kwargs)
    cache = hf_paged.PagedCache(config=model.config, block_size=BS)
    got = model.generate(**batch, **hf_paged.cache_kwargs(cache), **kwargs)
    _assert_same_generation(got, want)
    assert cache.seq_lens == (batch["attention_mask"].sum(dim=1) + NEW - 1).tolist()  # padding never stored
    cache.pool.check()


@pytest.mark.parametrize("case", tiered([c for c in VLMS if c.model_type == "paligemma"], set()), ids=lambda c: c.id)
def test_paligemma_with_its_processors_token_types(case):
    """PaliGemma's processor marks the whole prompt as one bidirectional block (token_type_ids 0): its first forward
    attends that way (a causal model's prompt, not an encoder's forward), its later forwards and chunks causally, as
    transformers masks them; without token_type_ids its mask says nothing of the block, and the error says so."""
    path = saved_vlm(case)
    model, ref = load_vlm(path, "paged"), load_vlm(path, "sdpa")
    inputs = prompt(case, [1, 5, 6], [7, 8, 9], seed=3)
    inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    kwargs = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    for chunk in (None, 5):
        dynamic = DynamicCache(config=ref.config)
        want = ref.generate(**inputs, **hf_paged.cache_kwargs(dynamic), prefill_chunk_size=chunk, **kwargs)
        got = model.generate(**inputs, **hf_paged.cache_kwargs(hf_paged.PagedCache(config=model.config, block_size=BS)),
                             prefill_chunk_size=chunk, **kwargs)
        _assert_same_generation(got, want)
    del inputs["token_type_ids"]
    with pytest.raises(hf_paged.UnsupportedModelError, match="token_type_ids"):
        model.generate(**inputs, **hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=BS)), max_new_tokens=2)


def _assert_same_generation(got, want) -> None:
    """The same tokens, and per-step logits within 1e-4, of two `generate(return_dict_in_generate=True,
    output_logits=True)` outputs."""
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), f"step {step}: {(a - b).abs().max()}"
