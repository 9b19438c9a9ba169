"""Text prompts for the Engine (issue 28 item 7): with `Engine(model, tokenizer=tok)`, `generate()` takes and
returns text, `stream()` yields text deltas, `submit()` takes a string; token ids work as before, and text
without a tokenizer is a clear error."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.demo_model import load_demo_model
from hf_paged.engine.text import Detokenizer

pytestmark = pytest.mark.xdist_group("engine_text")

PROMPTS = ["def read_config(path):\n", "import os\n", "    for key, value in sorted("]


@pytest.fixture(scope="module")
def demo():
    torch.set_num_threads(1)
    return load_demo_model(attn_implementation="paged")


def test_text_prompts_give_the_text_of_the_token_outputs(demo):
    model, tokenizer = demo
    engine = hf_paged.Engine(model, tokenizer=tokenizer)
    texts = engine.generate(PROMPTS, max_new_tokens=12, progress=False)
    ids = engine.generate([tokenizer.encode(p) for p in PROMPTS], max_new_tokens=12, progress=False)
    assert all(isinstance(t, str) for t in texts) and all(isinstance(i, list) for i in ids)
    assert texts == [tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    assert all(len(i) == 12 for i in ids)
    samples = engine.generate(PROMPTS[:1], max_new_tokens=6, do_sample=True, num_return_sequences=3, seed=5,
                              progress=False)
    assert len(samples) == 3 and all(isinstance(t, str) for t in samples)


def test_stream_yields_text_deltas_that_add_up_to_the_text(demo):
    model, tokenizer = demo
    engine = hf_paged.Engine(model, tokenizer=tokenizer)
    texts = engine.generate(PROMPTS, max_new_tokens=16, progress=False)
    pieces: dict[int, list[str]] = {}
    finished = set()
    for index, delta, done in engine.stream(PROMPTS, max_new_tokens=16):
        assert isinstance(delta, str) and index not in finished
        pieces.setdefault(index, []).append(delta)
        if done:
            finished.add(index)
    assert finished == {0, 1, 2}
    assert ["".join(pieces[i]) for i in range(3)] == texts
    ids_stream = list(engine.stream([tokenizer.encode(PROMPTS[0])], max_new_tokens=4))
    assert all(isinstance(token, int) for _, token, _ in ids_stream)  # token ids in, token ids out


def test_a_text_stream_stopped_early_frees_its_blocks(demo):
    model, tokenizer = demo
    engine = hf_paged.Engine(model, tokenizer=tokenizer)
    stream = engine.stream(PROMPTS, max_new_tokens=32)
    next(stream)
    assert engine.pool.stats().blocks_in_use > 0
    stream.close()
    assert engine.pool.stats().blocks_in_use == 0
    engine.pool.check()


def test_submit_takes_text(demo):
    model, tokenizer = demo
    engine = hf_paged.Engine(model, tokenizer=tokenizer)
    by_text = engine.submit(PROMPTS[0], max_new_tokens=8)
    by_ids = engine.submit(tokenizer.encode(PROMPTS[0]), max_new_tokens=8)
    tokens: dict[int, list[int]] = {by_text: [], by_ids: []}
    while engine.has_work():
        for event in engine.step():
            tokens[event.request_id].append(event.token)
    assert tokens[by_text] == tokens[by_ids] and len(tokens[by_text]) == 8


def test_text_without_a_tokenizer_or_mixed_with_ids_is_refused(demo):
    model, tokenizer = demo
    engine = hf_paged.Engine(model)
    for call in (lambda: engine.generate(["def f():\n"]), lambda: engine.stream(["def f():\n"]),
                 lambda: engine.submit("def f():\n")):
        with pytest.raises(TypeError, match=r"tokenizer=tokenizer"):
            call()
    with_tokenizer = hf_paged.Engine(model, tokenizer=tokenizer)
    with pytest.raises(TypeError, match="mix text and token ids"):
        with_tokenizer.generate(["def f():\n", tokenizer.encode("import os\n")])
    with pytest.raises(ValueError, match="not a single prompt"):
        with_tokenizer.generate("def f():\n")
    assert engine.pool.stats().blocks_in_use == 0


def test_detokenizer_holds_back_a_split_character(demo):
    _, tokenizer = demo
    text = "s = 'naïve café ☕ 😀'\n"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the case must split a character across tokens"
    detokenizer = Detokenizer(tokenizer)
    deltas = [detokenizer.add(token, finished=k == len(ids) - 1) for k, token in enumerate(ids)]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


class _SentencePieceLike:
    """Decodes like a SentencePiece tokenizer: a word token carries its leading space, which a decode that
    starts with it drops."""

    vocab = ["▁def", "▁f", "(", "x", "):", "\n", "▁▁", "▁return", "▁x"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")


def test_detokenizer_keeps_the_space_a_fresh_decode_would_drop():
    tokenizer = _SentencePieceLike()
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 8]
    detokenizer = Detokenizer(tokenizer)
    deltas = [detokenizer.add(token, finished=k == len(ids) - 1) for k, token in enumerate(ids)]
    assert "".join(deltas) == tokenizer.decode(ids) == "def f(x):\n   return x"
