"""`hf_paged.Engine` with images (issue 32, item 3): requests carry their processor output, the model's own vision path
runs when a chunk first reaches the images, and each request's greedy tokens equal single-request `generate()` (with
a `PagedCache`, and with `DynamicCache` + sdpa); prefix hits over an image skip its vision path; `pool.check()` after
every step."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.compat import ENGINE_IMAGES
from hf_paged.engine.media import Media
from hf_paged.engine.rows_step import is_hybrid
from hf_paged.engine.scheduler import Scheduler
from hf_paged.errors import UnsupportedModelError
from helpers import load, tiered
from matrix import MODELS, saved_case
from vlm_matrix import IMAGE_TOKEN, MAKE_TEST, VLMS, load_vlm, prompt, prompt_images, saved_vlm

pytestmark = pytest.mark.xdist_group("engine")

#: The Engine's requests with images run on the releases they were checked on; before them they are refused
#: (`compat.ENGINE_IMAGES`), which `test_images_are_refused_on_releases_the_engine_was_not_checked_on` checks.
runs_images = pytest.mark.skipif(not ENGINE_IMAGES, reason="the Engine refuses requests with images before 5.23")

BS = 4
NEW = 6
BEFORE, AFTER = [1, 5, 6, 7, 8, 9, 10, 11, 12], [7, 8, 9, 10, 11]  # 9 text tokens: 2 whole blocks before the image
TEXT_ONLY = [1, 5, 6, 7, 8, 9, 10]
CASES = {c.model_type: c for c in VLMS}
#: The families of the default tier: an image over which prefix hits reach (llava), mrope positions (qwen2_vl), and an
#: image's tokens attending each other both ways (gemma3).
ENGINE_TEST = frozenset({"llava", "qwen2_vl", "gemma3"})


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _models(case):
    path = saved_vlm(case)
    return load_vlm(path, "paged"), load_vlm(path, "sdpa")


def _options() -> dict:
    return dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)


def _reference(model, ref, request: dict | list[int], top: int | None = None):
    """Single-request generate() on a PagedCache, checked against DynamicCache + sdpa; the generated ids (with `top`,
    also per step the `top` largest raw log-probabilities)."""
    inputs = request if isinstance(request, dict) else {"input_ids": torch.tensor([request])}
    length = inputs["input_ids"].shape[1]
    options = dict(_options(), output_logits=True, return_dict_in_generate=True)
    cache = hf_paged.PagedCache(config=model.config, block_size=BS)
    paged = model.generate(**inputs, **hf_paged.cache_kwargs(cache), **options)
    cold = ref.generate(**inputs, **hf_paged.cache_kwargs(DynamicCache(config=ref.config)), **options)
    assert torch.equal(paged.sequences, cold.sequences)
    tokens = paged.sequences[0, length:].tolist()
    if top is None:
        return tokens
    return tokens, [torch.log_softmax(step[0].float(), -1).topk(top).values for step in paged.logits]


def _assert_same_logprobs(outputs: list, want: list) -> None:
    """Engine outputs (`top_logprobs=k`) against `_reference(top=k)`: tokens, and every step's top log-probabilities
    (so a position or feature slightly off fails even where the greedy tokens survive it)."""
    assert [out.token_ids for out in outputs] == [tokens for tokens, _ in want]
    for i, (out, (_, steps)) in enumerate(zip(outputs, want, strict=True)):
        for step, (got, expected) in enumerate(zip(out.logprobs, steps, strict=True)):
            values = torch.tensor([value for _, value in got.raw_top])
            assert torch.allclose(values, expected, atol=1e-4), f"request {i} step {step}: {values} vs {expected}"


def _requests(case) -> list[dict | list[int]]:
    """Two images under the same text, a text-only prompt, and a prompt with two images."""
    return [
        prompt(case, BEFORE, AFTER, seed=1),
        TEXT_ONLY,
        prompt(case, BEFORE, AFTER, seed=2),
        prompt_images(case, [BEFORE[:3], [20, 21, 22], AFTER], seed=3),
    ]


def _first_placeholder(request: dict) -> int:
    return request["input_ids"][0].tolist().index(IMAGE_TOKEN)


def _checked(model, pool: hf_paged.KVPool, **kwargs) -> hf_paged.Engine:
    return hf_paged.Engine(model, pool, on_step=lambda engine: engine.pool.check(), **kwargs)


def _vision_calls(model) -> list[int]:
    """A counter of the vision tower's forwards (one per encoded request)."""
    calls = [0]
    base = model.model
    tower = next(getattr(base, name) for name in ("vision_tower", "visual", "vision_model") if hasattr(base, name))
    tower.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _qwen_video(grid: tuple[int, int, int], seed: int = 0) -> dict:
    """A Qwen2-VL prompt `[1, 2] <vision_start> video <vision_end> [7, 8, 9]` with one video of `grid` (t, h, w)
    patches, merged 2x2 into `t * h * w / 4` placeholders (id 103, the matrix's `video_token_id`)."""
    t, h, w = grid
    gen = torch.Generator().manual_seed(seed)
    ids = [1, 2, 101] + [103] * (t * h * w // 4) + [102, 7, 8, 9]
    types = [2 if token == 103 else 0 for token in ids]
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "mm_token_type_ids": torch.tensor([types]),
        "pixel_values_videos": torch.randn(t * h * w, 3 * 2 * 7 * 7, generator=gen),
        "video_grid_thw": torch.tensor([list(grid)]),
    }


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
@runs_images
def test_generated_tokens_go_on_from_each_rotary_dimension_of_the_prompts_last_token(model_type):
    """`generate()` steps each multimodal rotary dimension on by one from the prompt's last token, whatever position
    the prompt reached inside an image: a video longer in time than in space (its positions reach past the text
    after it), and a prompt ending inside an image (its last token's three positions differ, so the decoding row
    needs three: it also leaves the compiled step). Greedy tokens and log-probabilities equal `generate()`'s."""
    model, ref = _models(CASES[model_type])
    image = prompt(CASES[model_type], BEFORE, AFTER, seed=4)
    cut = image["input_ids"][0].tolist().index(IMAGE_TOKEN) + 4  # up to its last placeholder (4 per image)
    ends_in_image = {
        key: value[:, :cut] if key in ("input_ids", "attention_mask", "mm_token_type_ids") else value
        for key, value in image.items()
    }
    requests = [_qwen_video((8, 2, 2), seed=5), ends_in_image, TEXT_ONLY]
    want = [_reference(model, ref, r, top=3) for r in requests]
    engine = _checked(model, hf_paged.KVPool(model.config, block_size=BS))
    media = Media(
        {k: v for k, v in ends_in_image.items() if k not in ("input_ids", "attention_mask")},
        [i for i, t in enumerate(ends_in_image["input_ids"][0].tolist()) if t == IMAGE_TOKEN],
    )
    media.encode(model, ends_in_image["input_ids"][0].tolist())
    assert not media.rows_agree_after_prompt  # the case this test is about
    _assert_same_logprobs(engine.generate(requests, **_options(), top_logprobs=3, progress=False), want)


# ---------------------------------------------------------------------------------------------- per family
@pytest.mark.parametrize("case", tiered([c for c in VLMS if not c.engine_error], ENGINE_TEST))
@runs_images
def test_engine_gives_each_request_the_tokens_of_generate(case):
    """Images and text in one batch, two images under equal text, two images in one prompt; the first step's budget
    ends two tokens into the first image, so its prefill is split across steps (inside the image; or, for a family
    whose image tokens attend each other both ways, before it: the image goes whole into the next step)."""
    model, ref = _models(case)
    requests = _requests(case)
    want = [_reference(model, ref, r, top=3) for r in requests]
    budget = _first_placeholder(requests[0]) + 2
    engine = _checked(model, hf_paged.KVPool(model.config, block_size=BS), max_batch_tokens=budget, max_seqs=4)
    _assert_same_logprobs(engine.generate(requests, **_options(), top_logprobs=3, progress=False), want)
    assert engine.pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("case", tiered([c for c in VLMS if not c.engine_error], ENGINE_TEST))
@runs_images
def test_engine_preempts_requests_with_images_and_recomputes_them(case):
    """A pool holding the longest request and a few blocks more: requests are preempted (some after their features
    were dropped) and recomputed, from prefix hits or from their images encoded again."""
    model, ref = _models(case)
    requests = _requests(case) * 2
    want = [_reference(model, ref, r) for r in requests[:4]] * 2
    lengths = [r["input_ids"].shape[1] if isinstance(r, dict) else len(r) for r in requests]
    need = max(math.ceil((n + NEW - 1) / BS) for n in lengths)
    engine = _checked(model, hf_paged.KVPool(model.config, block_size=BS, num_blocks=need + 3), max_seqs=8)
    assert engine.generate(requests, **_options(), progress=False) == want
    assert engine.stats().preemptions > 0
    assert engine.pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("case", tiered([c for c in VLMS if not c.engine_error], ENGINE_TEST))
@runs_images
def test_second_request_about_an_image_hits_and_another_image_does_not(case):
    """The same image and text again hits its blocks (over the image, skipping its vision path, for the families of
    `support.HITS_OVER_PLACEHOLDERS`; else up to the block of its first placeholder); another image only the text
    before it. Each gives the tokens of generate()."""
    model, ref = _models(case)
    first, other = prompt(case, BEFORE, AFTER, seed=1), prompt(case, BEFORE, AFTER, seed=2)
    want = {1: _reference(model, ref, first), 2: _reference(model, ref, other)}
    engine = _checked(model, hf_paged.KVPool(model.config, block_size=BS))
    calls = _vision_calls(model)
    assert engine.generate([first], **_options(), progress=False) == [want[1]]
    assert calls[0] == 1
    over = hf_paged.support.hits_over_placeholders(model.config)
    length = first["input_ids"].shape[1]
    text_hit = _first_placeholder(first) // BS * BS
    if is_hybrid(model.config) and not over:  # a hit needs the recurrent states, kept where a forward ended (the
        text_hit = 0  # prompt's end): none before the image
    for request, seed, hit, encodes in ((first, 1, (length - 1) // BS * BS if over else text_hit, 0 if over else 1),
                                        (other, 2, text_hit, 1)):
        before, hits_before = calls[0], engine.stats().prefix_hit_tokens
        assert engine.generate([request], **_options(), progress=False) == [want[seed]]
        assert engine.stats().prefix_hit_tokens - hits_before == hit
        assert calls[0] - before == encodes
    engine.pool.check()


@runs_images
def test_engine_hits_the_blocks_a_kvpool_cache_indexed_for_generate():
    """One digest machinery: blocks `generate()` indexed through `KVPool.new_cache(**inputs)` serve the Engine's
    request with the same image (without its vision path), and the Engine's blocks serve `new_cache`."""
    case = CASES["llava"]
    model, ref = _models(case)
    pool = hf_paged.KVPool(model.config, block_size=BS)
    inputs = prompt(case, BEFORE, AFTER, seed=1)
    length = inputs["input_ids"].shape[1]
    want = _reference(model, ref, inputs)
    with pool.new_cache(**inputs, model=model) as cache:
        out = model.generate(**cache.uncached_inputs(inputs), **hf_paged.cache_kwargs(cache), **_options())
        cache.commit_tokens(out)
    calls = _vision_calls(model)
    engine = _checked(model, pool)
    assert engine.generate([inputs], **_options(), progress=False) == [want]
    assert engine.stats().prefix_hit_tokens == (length - 1) // BS * BS and calls[0] == 0
    other = prompt(case, BEFORE, AFTER, seed=2)
    engine.generate([other], **_options(), progress=False)
    with pool.new_cache(**other, model=model) as cache:
        assert cache.stats().prefix_hit_tokens == (length - 1) // BS * BS
    pool.check()


@runs_images
def test_submitted_requests_with_images_stream_the_tokens_of_generate():
    """The incremental API (a server's loop) takes the same processor outputs."""
    case = CASES["qwen2_vl"]
    model, ref = _models(case)
    requests = _requests(case)
    want = [_reference(model, ref, r) for r in requests]
    engine = _checked(model, hf_paged.KVPool(model.config, block_size=BS), max_batch_tokens=8)
    ids = [engine.submit(r, **_options()) for r in requests]
    got: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        for event in engine.step():
            got[event.request_id].append(event.token)
    assert [got[i] for i in ids] == want
    assert engine.pool.stats().blocks_in_use == 0


@pytest.mark.models
@pytest.mark.parametrize("model_type", sorted(ENGINE_TEST))
@runs_images
def test_compiled_engine_decodes_requests_with_images(model_type):
    """`Engine(compile=True)`: decode rows of requests with images run in the compiled step at their positions
    (Qwen2-VL's after an image are shifted), prefill chunks eagerly beside them."""
    model, ref = _models(CASES[model_type])
    requests = _requests(CASES[model_type])
    want = [_reference(model, ref, r) for r in requests]
    pool = hf_paged.KVPool(model.config, block_size=BS, num_blocks=200)
    engine = _checked(model, pool, max_seqs=2, compile=True)
    assert engine.generate(requests, **_options(), progress=False) == want


# ---------------------------------------------------------------------------------------------- both ways
@pytest.mark.parametrize("case", tiered([c for c in VLMS if c.both_ways and not c.engine_error], {"gemma3"}))
@pytest.mark.parametrize("budget", [1, 3])
@runs_images
def test_an_image_attended_both_ways_is_never_split_across_steps(case, budget, monkeypatch):
    """A step budget smaller than an image (4 placeholders): each prefill chunk ends before an image, or holds it
    whole (a step that exceeds the budget by the rest of the image); each request's tokens and log-probabilities
    equal `generate()`'s."""
    model, ref = _models(case)
    requests = [prompt(case, BEFORE, AFTER, seed=1), prompt_images(case, [BEFORE[:3], [20, 21, 22], AFTER], seed=3)]
    want = [_reference(model, ref, r, top=3) for r in requests]
    chunks = []  # (the request's runs of placeholders, the chunk's first token, its length) of every step
    schedule = Scheduler.schedule

    def recorded(self):
        plan = schedule(self)
        chunks.extend((req.media.runs, req.fed, n) for req, n, _ in plan.chunks if req.media is not None)
        return plan

    monkeypatch.setattr(Scheduler, "schedule", recorded)
    engine = _checked(model, hf_paged.KVPool(model.config, block_size=BS), max_batch_tokens=budget, max_seqs=2)
    _assert_same_logprobs(engine.generate(requests, **_options(), top_logprobs=3, progress=False), want)
    assert sum(len(runs) for runs, fed, _ in chunks if fed == 0) == 3  # three images, each a run
    for runs, fed, n in chunks:
        for start, stop in runs:
            assert stop <= fed or fed + n <= start or fed <= start < stop <= fed + n, (runs, fed, n)
    assert max(n for _, _, n in chunks) == 4 > budget  # an image's run whole, past the budget


@pytest.mark.parametrize("case", tiered([c for c in VLMS if c.engine_error], MAKE_TEST))
def test_a_family_whose_prompts_attend_both_ways_whole_gets_no_engine(case):
    """PaliGemma, whose every prompt is one bidirectional block, gets no Engine at all."""
    model = load_vlm(saved_vlm(case), "paged")
    with pytest.raises(UnsupportedModelError, match=case.engine_error):
        hf_paged.Engine(model, hf_paged.KVPool(model.config, block_size=BS))


@pytest.fixture(scope="module")
def llava():
    return load_vlm(saved_vlm(CASES["llava"]), "paged")


def test_images_are_refused_on_releases_the_engine_was_not_checked_on(llava, monkeypatch):
    from hf_paged.engine import inputs as engine_inputs  # noqa: PLC0415

    monkeypatch.setattr(engine_inputs, "ENGINE_IMAGES", False)
    engine = hf_paged.Engine(llava, hf_paged.KVPool(llava.config, block_size=BS))
    with pytest.raises(UnsupportedModelError, match="5.23 and later.*pool.new_cache"):
        engine.generate([prompt(CASES["llava"], BEFORE, AFTER, seed=1)], **_options(), progress=False)
    assert engine.pool.stats().blocks_in_use == 0


@runs_images
def test_bad_multimodal_requests_are_refused(llava):
    engine = hf_paged.Engine(llava, hf_paged.KVPool(llava.config, block_size=BS))
    inputs = prompt(CASES["llava"], BEFORE, AFTER, seed=1)
    ids = inputs["input_ids"]
    batch = {k: torch.cat([v, v]) for k, v in inputs.items()}
    padded = dict(inputs, attention_mask=inputs["attention_mask"].clone())
    padded["attention_mask"][0, 0] = 0
    cases = [
        ([ids[0]], ValueError, "placeholder tokens but no inputs"),
        ([{"input_ids": ids}], ValueError, "placeholder tokens but no inputs"),
        ([dict(inputs, input_ids=torch.tensor([TEXT_ONLY]), attention_mask=None)], ValueError, "no placeholder token"),
        ([batch], ValueError, "batch of 2 prompts"),
        ([padded], ValueError, "not all ones"),
        ([dict(inputs, image_sizes=[[28, 28]])], TypeError, "'image_sizes' is a list"),
        ([{"pixel_values": inputs["pixel_values"]}], ValueError, "without 'input_ids'"),
        (inputs, ValueError, "not a single prompt"),
    ]
    for prompts, error, message in cases:
        with pytest.raises(error, match=message):
            engine.generate(prompts, max_new_tokens=2, progress=False)
    assert engine.stats().steps == 0 and engine.pool.stats().blocks_in_use == 0
    draft = load(saved_case(next(c for c in MODELS if c.model_type == "llama" and not c.label)), "paged")
    with pytest.raises(UnsupportedModelError, match="draft model"):
        hf_paged.Engine(llava, draft_model=draft).generate([inputs], max_new_tokens=2, progress=False)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda kwargs: kwargs.update(deepstack_visual_embeds=[kwargs["inputs_embeds"]]), "also feeds its language"),
        (lambda kwargs: kwargs["inputs_embeds"][:, 0].add_(1.0), "changes the embeddings of text tokens"),
        (lambda kwargs: kwargs.update(position_ids=torch.zeros(2, 1, 3, dtype=torch.long)), "position ids of shape"),
        (lambda kwargs: kwargs.update(attention_mask=torch.ones(1, 1, *[kwargs["inputs_embeds"].shape[1]] * 2).bool()),
         "lets tokens attend others than the rest of their image"),
    ],
    ids=["extra_inputs", "text_embeddings", "positions", "future_mask"],
)
@runs_images
def test_a_vision_path_the_packed_step_cannot_reproduce_is_refused(change, message):
    """What a family's vision path passes its language model beyond embeddings, positions and a causal mask (e.g.
    Qwen3-VL's deepstack features) is refused when it first runs; the run's blocks go back to the pool."""
    model = load_vlm(saved_vlm(CASES["llava"]), "paged")

    def altered(module, args, kwargs):
        change(kwargs)
        return args, kwargs

    model.get_decoder().register_forward_pre_hook(altered, with_kwargs=True)
    engine = _checked(model, hf_paged.KVPool(model.config, block_size=BS))
    with pytest.raises(UnsupportedModelError, match=f"{message}.*new_cache"):
        engine.generate([TEXT_ONLY, prompt(CASES["llava"], BEFORE, AFTER)], max_new_tokens=2, progress=False)
    assert engine.pool.stats().blocks_in_use == 0
    engine.pool.check()


# ---------------------------------------------------------------------------------------------- Media
def test_media_slices_features_across_chunks_and_positions_past_the_prompt():
    media = Media({"pixel_values": torch.zeros(1)}, [3, 4, 5, 6])
    assert media.needs_features(0, 3) is False and media.needs_features(2, 4) is True
    with pytest.raises(RuntimeError, match="before the request's images were encoded"):
        media.rows(0, 5)
    media.features = torch.arange(4.0)[:, None].expand(4, 2)
    assert media.rows(0, 3) is None
    offsets, rows = media.rows(2, 5)  # a chunk ending inside the image
    assert offsets.tolist() == [1, 2] and rows[:, 0].tolist() == [0.0, 1.0]
    offsets, rows = media.rows(5, 9)  # the next chunk: the rest of it
    assert offsets.tolist() == [0, 1] and rows[:, 0].tolist() == [2.0, 3.0]
    assert not media.all_stored(6) and media.all_stored(7)
    assert media.position(9) == 9 and media.rope_positions(1, 3).tolist() == [[1, 2]] * 3
    assert media.rows_agree_after_prompt
    media.positions = torch.tensor([[0, 1, 2, 3, 5, 4, 5, 5]] * 3)  # past the prompt: from its last token, not its max
    assert media.rows_agree_after_prompt and media.position(7) == 5 and media.position(8) == 6
    assert media.rope_positions(6, 10).tolist() == [[5, 5, 6, 7]] * 3
    media.positions = torch.tensor([[0, 1, 2, 2], [0, 1, 2, 3], [0, 1, 2, 4]])  # a prompt ending inside an image
    assert not media.rows_agree_after_prompt
    assert media.rope_positions(3, 6).tolist() == [[2, 3, 4], [3, 4, 5], [4, 5, 6]]


def test_media_keeps_runs_attended_both_ways_whole():
    """A family whose image tokens attend each other both ways: its runs of consecutive placeholders, and where a
    chunk must end so as to hold each run whole or not at all."""
    media = Media({"pixel_values": torch.zeros(1)}, [3, 4, 5, 6, 9, 10], bidirectional=True)
    assert media.runs == [(3, 7), (9, 11)]
    assert media.chunk_stop(0, 3) == 3 and media.chunk_stop(0, 5) == 3  # ends before the run it would split
    assert media.chunk_stop(3, 4) == 7 and media.chunk_stop(9, 10) == 11  # begins at a run: holds it, past the budget
    assert media.chunk_stop(3, 8) == 8 and media.chunk_stop(7, 10) == 9 and media.chunk_stop(0, 12) == 12
    assert media.chunk_mask(0, 3, None) is None  # no run in the chunk: causal
    with pytest.raises(RuntimeError, match="before the request's images were encoded"):
        media.chunk_mask(3, 7, None)
    assert Media({"pixel_values": torch.zeros(1)}, [3, 4, 5]).runs == []  # a causal family: chunks split images


# ---------------------------------------------------------------------------------------------- a hybrid VLM
@pytest.mark.parametrize("budget", [3, 64])
@runs_images
def test_a_hybrid_models_batched_steps_feed_each_row_its_images(budget):
    """LFM2-VL (short convolutions + attention): a hybrid model's prefill steps are batched, a request per row;
    rows holding placeholders at other offsets get their own features, in chunks that split an image (budget 3)
    or hold whole prompts; each request's tokens and log-probabilities equal `generate()`'s."""
    case = CASES["lfm2_vl"]
    model, ref = _models(case)
    requests = [prompt(case, [1, 5, 6, 7, 8], [9, 10, 11], seed=1), TEXT_ONLY,
                prompt(case, [1, 5], [9, 10, 11, 12, 13, 14], seed=2), prompt(case, [1, 5, 6, 7, 8], [9, 10], seed=3)]
    want = [_reference(model, ref, r, top=3) for r in requests]
    engine = _checked(model, hf_paged.KVPool(model.config, block_size=BS), max_batch_tokens=budget, max_seqs=4)
    _assert_same_logprobs(engine.generate(requests, **_options(), top_logprobs=3, progress=False), want)
    assert engine.pool.stats().blocks_in_use == 0
