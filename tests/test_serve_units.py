"""The server's pieces on their own: the JSON-object recognizer and its logits processor, OpenAI's additive
penalties and logit_bias, incremental detokenization with stop strings, the default chat template, each token's
bytes and the completions `top_logprobs` dict, and the metrics' preemption counter."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")

from hf_paged.demo_model import load_demo_model  # noqa: E402
from hf_paged.engine import TokenEvent  # noqa: E402
from hf_paged.engine.outputs import TokenLogprobs  # noqa: E402
from hf_paged.serve.metrics import ServerMetrics  # noqa: E402
from hf_paged.serve.responses import ChoiceState, completion_top  # noqa: E402
from hf_paged.serve.json_mode import MAX_DEPTH, MAX_WS, JsonObjectProcessor, JsonState, JsonVocabulary, run  # noqa: E402
from hf_paged.serve.sampling import AdditivePenaltyProcessor, LogitBiasProcessor  # noqa: E402
from hf_paged.serve.text import TextStream, TokenPieces, chat_prompt  # noqa: E402

VALID = ['{}', '{"a": [1, -2.5e+3, 0.0, true, null, {"b": "x\\u00e9\\n\\""}], "c": false}', ' {"k" :0}', '{"a":[]}']
INVALID = ['[]', '"x"', '{"a" 1}', '{"a": 01}', '{"a": tru}', '{,}', '{"a":1,}', '{"a": "\n"}', '{"a": -}',
           '{"a": 1.}', '{"a": 1e}', '{} x', "{'a': 1}", '{"a": [1 2]}', '{"a": "\\x"}', '{"a": "\\u12g4"}']


@pytest.mark.parametrize("text", VALID)
def test_json_valid_texts_close(text):
    state = run(JsonState(), text)
    assert state is not None and state.mode == "done"
    json.loads(text)


@pytest.mark.parametrize("text", INVALID)
def test_json_invalid_texts_are_refused(text):
    state = run(JsonState(), text)
    assert state is None or state.mode != "done"
    try:
        assert not isinstance(json.loads(text), dict)  # valid JSON, but not an object ([] or "x")
    except json.JSONDecodeError:
        pass


def test_json_every_prefix_of_valid_text_is_live():
    text = VALID[1]
    for i in range(1, len(text)):
        assert run(JsonState(), text[:i]) is not None, text[:i]


def test_json_bounds():
    assert run(JsonState(), '{"a":' + "[" * (MAX_DEPTH - 1)) is not None
    assert run(JsonState(), '{"a":' + "[" * MAX_DEPTH) is None  # nesting is bounded
    assert run(JsonState(), "{" + " " * MAX_WS) is not None
    assert run(JsonState(), "{" + " " * (MAX_WS + 1)) is None  # whitespace runs are bounded


@pytest.fixture(scope="module")
def demo():
    return load_demo_model()


def test_json_processor_masks_and_allows_eos_only_when_closed(demo):
    model, tok = demo
    vocab = JsonVocabulary(tok, model.config.vocab_size, frozenset([0]))
    prompt = tok.encode("x = ")
    proc = JsonObjectProcessor(vocab, len(prompt))
    gen = torch.Generator().manual_seed(0)
    out: list[int] = []
    for _ in range(200):  # random scores: every choice the mask allows must keep the text a JSON prefix
        scores = proc(torch.tensor([prompt + out]), torch.randn(1, model.config.vocab_size, generator=gen))
        allowed = torch.isfinite(scores[0])
        assert allowed.any()
        token = int(torch.argmax(scores[0]))
        if token == 0:
            break
        out.append(token)
        assert run(JsonState(), tok.decode(out)) is not None
    start = JsonObjectProcessor(vocab, 1)(torch.tensor([[5]]), torch.zeros(1, model.config.vocab_size))
    assert not bool(torch.isfinite(start[0, 0]))  # no EOS before the object closed
    closed = JsonObjectProcessor(vocab, len(prompt))
    done = closed(torch.tensor([prompt + tok.encode("{}")]), torch.zeros(1, model.config.vocab_size))
    assert torch.isfinite(done[0]).nonzero().flatten().tolist() == [0]  # only EOS after the object closed


def test_additive_penalties_follow_openai():
    proc = AdditivePenaltyProcessor(presence_penalty=0.5, frequency_penalty=0.25, prompt_len=2)
    ids = torch.tensor([[3, 3, 1, 1, 1, 2]])  # prompt [3, 3]; output: token 1 three times, token 2 once
    out = proc(ids, torch.zeros(1, 5))
    assert out[0].tolist() == [0.0, -(3 * 0.25 + 0.5), -(0.25 + 0.5), 0.0, 0.0]  # the prompt's 3 is not counted


def test_logit_bias_adds_and_checks_ids():
    out = LogitBiasProcessor({1: 5.0, 3: -100.0}, vocab_size=4)(torch.zeros(1, 2), torch.zeros(1, 4))
    assert out[0].tolist() == [0.0, 5.0, 0.0, -100.0]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        LogitBiasProcessor({9: 1.0}, vocab_size=4)


def test_text_stream_holds_back_stop_prefixes_and_cuts_at_stop(demo):
    _, tok = demo
    ids = tok.encode("def f(x):\n    return x\n\nclass A:\n")
    stream = TextStream(tok, ["\n\nclass"])
    pieces = [stream.add(t) for t in ids]
    assert "".join(pieces) == "def f(x):\n    return x" and stream.stopped
    plain = TextStream(tok, [])
    assert "".join(plain.add(t) for t in ids) + plain.finish() == tok.decode(ids)
    held = TextStream(tok, ["return y"])
    text = "".join(held.add(t) for t in tok.encode("x = 1\nreturn"))
    assert "return" not in text  # might still become the stop string
    assert text + held.finish() == "x = 1\nreturn"


def test_default_chat_template(demo):
    _, tok = demo
    ids = chat_prompt(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], None)
    assert tok.decode(ids) == "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"
    custom = chat_prompt(tok, [{"role": "user", "content": "hi"}], "{{ messages[0]['content'] }}!")
    assert tok.decode(custom) == "hi!"


def _byte_tokens(tok, count: int) -> list[int]:
    """Ids of byte-level tokens that decode to U+FFFD alone (parts of a multi-byte UTF-8 character)."""
    ids = [i for i in range(1, 400) if tok.decode([i]) == "\ufffd"]
    assert len(ids) >= count
    return ids[:count]


def test_token_pieces_give_each_tokens_real_bytes(demo):
    _, tok = demo
    pieces = TokenPieces(tok)
    first, second = tok.encode("\u00e9")  # "é" = 0xC3 0xA9, one byte-level token each
    assert pieces.text(first) == "\ufffd" and pieces.bytes(first) == b"\xc3" and pieces.bytes(second) == b"\xa9"
    assert pieces.bytes(first) + pieces.bytes(second) == "\u00e9".encode()
    for text in ("def", " return", "\n    ", "<|endoftext|>"):
        (token,) = tok.encode(text)
        assert pieces.bytes(token) == text.encode()  # plain and special tokens: their text's bytes
    assert pieces.key(first) == "bytes:\\xc3"


def test_completion_top_logprobs_keep_k_entries_and_the_chosen_token(demo):
    _, tok = demo
    a, b, c = _byte_tokens(tok, 3)
    (plain,) = tok.encode("def")
    pieces = TokenPieces(tok)
    top = [(a, -0.5), (b, -1.0), (plain, -2.0), (c, -3.0)]  # three alternatives whose texts are all U+FFFD
    entries = completion_top(pieces, b, top)
    assert len(entries) == 4 and entries["\ufffd"] == -1.0  # the chosen token keeps its own text (as in `tokens`)
    assert entries[pieces.key(a)] == -0.5 and entries[pieces.key(c)] == -3.0 and entries["def"] == -2.0
    assert list(entries.values()) == [-0.5, -1.0, -2.0, -3.0]  # most likely first
    # the chosen token outside the top k: no other token takes its text as a key
    outside = completion_top(pieces, c, [(a, -0.5), (b, -1.0)])
    assert "\ufffd" not in outside and len(outside) == 2
    # through a choice: bytes of the chosen and alternatives, offsets of each token in the text
    choice = ChoiceState(0, TextStream(tok, []), offset_base=3)
    lp = TokenLogprobs(a, -0.5, -0.5, [], [(a, -0.5), (b, -1.0)])
    choice.add(TokenEvent(0, 0, plain, False, None, TokenLogprobs(plain, -0.1, -0.1, [], [(plain, -0.1)])), pieces)
    _, out = choice.add(TokenEvent(0, 0, a, True, "length", lp), pieces)
    assert out["chat"]["bytes"] == list(pieces.bytes(a)) and len(out["completion"]["top_logprobs"][0]) == 2
    assert [e["bytes"] for e in out["chat"]["top_logprobs"]] == [list(pieces.bytes(a)), list(pieces.bytes(b))]
    assert choice.completion_logprobs["text_offset"] == [3, 3 + len("def")]


def test_preemptions_are_a_counter_advanced_from_engine_stats():
    metrics = ServerMetrics()
    pool = SimpleNamespace(blocks_in_use=0, blocks_cached=0, blocks_total=0)

    def stats(preemptions: int) -> SimpleNamespace:
        return SimpleNamespace(running=0, waiting=0, pool=pool, prefix_hit_tokens=0, prefix_query_tokens=0,
                               preemptions=preemptions, tokens_per_s=0.0)

    for total in (0, 2, 2, 5):
        metrics.record_engine(stats(total))
    text = metrics.render().decode()
    assert "hf_paged_preemptions_total 5.0" in text
    assert any(line.startswith("# TYPE hf_paged_preemptions") and line.endswith(" counter") for line in text.splitlines())


def test_text_stream_counts_the_decoded_text_before_each_token(demo):
    _, tok = demo
    ids = tok.encode("x = 1\n\u00e9t\u00e9 = 2\n")
    stream = TextStream(tok, ["\n\n"])
    for k, token in enumerate(ids):
        assert stream.decoded_len == len(tok.decode(ids[:k]).rstrip("\ufffd"))
        stream.add(token)


def test_a_sample_whose_text_reached_a_stop_string_is_dropped_and_counted_once():
    """`EngineWorker.finish_sample` (the HTTP side saw sample k's text reach a stop string): the engine drops that
    sample at once, its siblings go on, and the request is finished (counted once, reason "stop") when the last
    sample finished, whether the engine or a stop string ended it, even if both did."""
    import hf_paged
    from hf_paged.serve.worker import EngineWorker, Ticket

    model, tok = load_demo_model(attn_implementation="paged")
    replies: list[tuple[str, object]] = []
    loop = SimpleNamespace(call_soon_threadsafe=lambda put, reply: replies.append(reply[::2]))
    worker = EngineWorker(hf_paged.Engine(model), ServerMetrics(), max_pending=4)
    generation = dict(max_new_tokens=6, min_new_tokens=6, do_sample=True, num_return_sequences=3)
    ticket = Ticket(tok.encode("def f(x):\n"), generation, 1, None, [], loop, SimpleNamespace(put_nowait=None))
    worker._accept(ticket)
    worker._step()
    worker._finish_sample(ticket, 1)
    worker._finish_sample(ticket, 1)  # (a second notice changes nothing)
    assert ticket.samples_left == 2 and ticket.finished_samples == {1}
    while worker.engine.has_work():
        worker._step()
    tokens = [payload for kind, payload in replies if kind == "token"]
    assert sum(e.sample == 1 for e in tokens) == 1 and sum(e.sample == 0 for e in tokens) == 6
    assert ticket.samples_left == 0 and ticket.request_id not in worker._tickets
    worker._finish_sample(ticket, 0)  # after the end: nothing
    assert worker.metrics.finished.labels("length")._value.get() == 1
    assert worker.engine.pool.stats().blocks_in_use == 0
