"""`hf-paged serve` driven by real clients on 127.0.0.1: the `openai` package (sync, async, streaming) and raw
HTTP (httpx). Completions and chat equal greedy `generate()`; n, seeds, logprobs, stop, penalties, logit_bias,
json_object; OpenAI-style 400s that leave other requests alone; 401 without the key; 429 beyond the queue;
64 concurrent streams and a burst of disconnects with the pool clean afterwards; the CLI exits cleanly on
SIGINT. Every loop is bounded; nothing asserts a duration."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402
import uvicorn  # noqa: E402

from hf_paged.demo_model import load_demo_model  # noqa: E402
from hf_paged.serve.app import build_app  # noqa: E402
from hf_paged.serve.cli import build_state, parse_args  # noqa: E402
from hf_paged.serve.json_mode import JsonState, run  # noqa: E402

pytestmark = pytest.mark.xdist_group("serve")

MODEL = "hf-paged-demo"
PROMPTS = ["def read_config(path):\n", "import os\n\n\ndef walk(top):\n", "class Stack:\n    def __init__(self):\n"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(predicate, what: str, tries: int = 400, pause_s: float = 0.05) -> None:
    """Polls `predicate` a bounded number of times."""
    for _ in range(tries):
        if predicate():
            return
        time.sleep(pause_s)
    raise AssertionError(f"gave up waiting for {what}")


class _Server:
    """The app under uvicorn in a thread, on 127.0.0.1 and a free port."""

    def __init__(self, *flags: str) -> None:
        self.port = _free_port()
        self.state = build_state(parse_args(["--port", str(self.port), *flags]))
        config = uvicorn.Config(build_app(self.state), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        _wait(lambda: self.server.started, "the server to start")
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def pool(self):
        return self.state.worker.engine.pool

    def idle(self) -> bool:
        return self.state.worker.pending == 0 and not self.state.worker.engine.has_work()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server():
    torch.set_num_threads(1)
    srv = _Server("--max-seqs", "64")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    """Greedy generate() on a separate copy of the model (the server's belongs to its engine thread)."""
    model, tok = load_demo_model()

    def greedy(ids: list[int], max_new_tokens: int) -> list[int]:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        return out[0, len(ids) :].tolist()

    return greedy, tok


def _clean(server: _Server) -> None:
    _wait(server.idle, "the engine to go idle")
    server.pool.check()
    assert server.pool.stats().blocks_in_use == 0


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_greedy_completions_equal_generate(server, client, reference):
    greedy, tok = reference
    out = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for prompt, choice in zip(PROMPTS, out.choices, strict=True):
        assert choice.text == tok.decode(greedy(tok.encode(prompt), 8))
        assert choice.finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    ids = tok.encode(PROMPTS[0])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert by_ids.choices[0].text == PROMPTS[0] + out.choices[0].text
    _clean(server)


def test_chat_stream_and_usage(server, client, reference):
    greedy, tok = reference
    messages = [{"role": "user", "content": "Write a stack class."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    prompt = tok.encode("<|user|>\nWrite a stack class.\n<|assistant|>\n")
    assert full.choices[0].message.content == tok.decode(greedy(prompt, 10))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == full.choices[0].message.content
    capped = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3, temperature=0)
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a stack class." * 8}],
                                           max_tokens=2, temperature=0)
    repeat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a stack class." * 8}],
                                            max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert repeat.usage.prompt_tokens_details.cached_tokens >= 16  # its full prompt blocks were prefix hits
    _clean(server)


def test_n_and_seeds(server, client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, n=3, seed=7)
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in second.choices]  # a seed reproduces every choice
    assert len(set(texts)) > 1  # the samples are seeded apart
    assert [c.index for c in first.choices] == [0, 1, 2] and first.usage.completion_tokens == 24
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text
    _clean(server)


def test_logprobs(server, client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and chosen == pytest.approx(max(top.values()))  # greedy: the chosen is the best
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    _clean(server)


def test_stop_penalties_bias_and_json(server, client, reference):
    greedy, tok = reference
    text = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"
    first = greedy(tok.encode(PROMPTS[2]), 1)[0]
    biased = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert tok.encode(biased.choices[0].text)[0] != first
    penalised = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.choices[0].text != text
    js = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}], max_tokens=24,
                                        temperature=0, response_format={"type": "json_object"},
                                        extra_body={"repetition_penalty": 1.2, "top_k": 5, "min_p": 0.05})
    content = js.choices[0].message.content
    assert run(JsonState(), content) is not None  # always a prefix of one JSON object
    if js.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    _clean(server)


@pytest.mark.parametrize("body, param", [
    ({"model": "gpt-4", "prompt": "x"}, "model"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "prompt": "x " * 5000, "max_tokens": 4}, "prompt"),  # the prompt alone fills the context
    ({"model": MODEL, "prompt": "x " * 2000, "max_tokens": 3000}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": MODEL, "prompt": "x", "best_of": 2}, "best_of"),
    ({"model": MODEL, "prompt": "x", "temperature": 3}, "temperature"),
    ({"model": MODEL, "prompt": [10**7]}, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"], "logit_bias": {"99999999": 1}}, "logit_bias"),
])
def test_bad_completion_requests_are_400s(server, body, param):
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert server.state.worker.pending == 0  # nothing of the refused request was left running


def test_bad_chat_requests_are_400s_and_others_go_on(server, client):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        good = asyncio.create_task(aclient.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0))
        bad = [
            {"model": MODEL, "messages": []},
            {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []},
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}},
        ]
        async with httpx.AsyncClient(timeout=60) as http:
            replies = await asyncio.gather(*(http.post(f"{server.url}/v1/chat/completions", json=b) for b in bad))
        return await good, replies

    good, replies = asyncio.run(main())
    assert [r.status_code for r in replies] == [400] * 5
    assert replies[2].json()["error"]["param"] == "tools"
    expected = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert good.choices[0].text == expected.choices[0].text  # the bad requests did not disturb it
    _clean(server)


def test_64_concurrent_streams(server):
    async def one(aclient, i: int) -> tuple[str, str]:
        stream = await aclient.completions.create(model=MODEL, prompt=PROMPTS[i % 3] + "#" * (i % 5), max_tokens=4,
                                                  temperature=0, stream=True)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    results = asyncio.run(main())
    assert all(reason in ("length", "stop") for _, reason in results)
    assert results[0] == results[15]  # same prompt, same greedy text, whatever else shared its steps
    _clean(server)


def _metric(server: _Server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_disconnects_free_blocks_at_once(server):
    aborted = _metric(server, "hf_paged_requests_aborted_total")
    # logit_bias keeps the demo model from ending a stream with its EOS (id 0) before the hang-up is seen: a
    # request that finished on its own is not aborted
    body = {"model": MODEL, "prompt": PROMPTS[1] * 20, "max_tokens": 3000, "stream": True, "logit_bias": {"0": -100}}
    with httpx.Client(timeout=60) as http:
        for _ in range(8):
            with http.stream("POST", f"{server.url}/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                next(reply.iter_lines())  # a token arrived: the request holds blocks; then hang up
    _wait(lambda: _metric(server, "hf_paged_requests_aborted_total") >= aborted + 8, "8 aborts")
    _clean(server)
    assert _metric(server, "hf_paged_kv_blocks_in_use") == 0
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("hf_paged_requests_running", "hf_paged_requests_waiting", "hf_paged_kv_blocks_cached",
                 "hf_paged_prefix_hit_rate", "hf_paged_preemptions", "hf_paged_time_to_first_token_seconds_bucket",
                 "hf_paged_inter_token_latency_seconds_bucket", "hf_paged_tokens_per_second"):
        assert name in text, name


def _metric_lines(server: _Server) -> list[str]:
    return httpx.get(f"{server.url}/metrics").text.splitlines()


def test_bad_params_name_the_field_and_stop_is_bounded(server):
    cases = [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": 5}, "stop"),  # not 'stop.str'
        ("/v1/completions", {"model": MODEL, "prompt": 5}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages.0.content"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream_options": {"include_usage": True}},
         "stream_options"),  # stream_options needs stream=true
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),  # at most 4
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["y" * 257]}, "stop"),  # at most 256 characters
    ]
    for path, body, param in cases:
        reply = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert reply.status_code == 400, (body, reply.text)
        assert reply.json()["error"]["param"] == param, (body, reply.text)
    # a chat prompt longer than the context, without max_tokens: the messages are too long (not "max_tokens -920")
    reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "x " * 5000}]})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "messages" and error["code"] == "context_length_exceeded"
    ok = httpx.post(f"{server.url}/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stop": ["a", "b", "c", "d"]})
    assert ok.status_code == 200
    _clean(server)


def test_stop_strings_match_the_generated_text_only(server, client, reference):
    greedy, tok = reference
    prompt = "def read_config(path):\n"  # ends with "\n"; the first generated token is "\n" too
    text = tok.decode(greedy(tok.encode(prompt), 24))
    assert text.startswith("\n") and "\n\n" not in text
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=["\n\n"])
    assert out.choices[0].text == text and out.choices[0].finish_reason == "length"  # no "\n\n" in the output
    assert out.usage.completion_tokens == 24
    # a stop inside the output still ends it there, the usage counting the tokens up to the one completing it
    stop = text[8:12]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], n=2)
    ids = greedy(tok.encode(prompt), 24)
    upto = next(k for k in range(1, 25) if stop in tok.decode(ids[:k]))
    assert [c.text for c in cut.choices] == [text[: text.find(stop)]] * 2
    assert [c.finish_reason for c in cut.choices] == ["stop"] * 2 and cut.usage.completion_tokens == 2 * upto
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text[: text.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    _clean(server)  # the engine stopped the requests the server ended


def test_multi_prompt_tokens_are_never_lost_while_submitting(server, monkeypatch):
    worker = server.state.worker
    submit = worker.submit

    def slow_submit(ticket):  # the engine steps the first prompt before the second is queued
        submit(ticket)
        time.sleep(0.05)

    monkeypatch.setattr(worker, "submit", slow_submit)
    prompts = ["def f(x):\n", "import os\n", "class A:\n"]
    for max_tokens in (1, 4):
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0,
                                 "logit_bias": {"0": -100}})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] == 3 * max_tokens
        assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 3
    _clean(server)


def test_logprobs_bytes_and_text_offsets(server, reference):
    greedy, tok = reference
    e_ids = tok.encode("\u00e9")  # "é" is two byte-level tokens: 0xC3 then 0xA9
    assert len(e_ids) == 2 and tok.decode(e_ids[:1]) == "\ufffd"
    reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0,
        "logprobs": True, "logit_bias": {str(e_ids[0]): 100}})
    entry = reply.json()["choices"][0]["logprobs"]["content"][0]
    assert entry["bytes"] == [0xC3]  # the token's own byte, not U+FFFD's
    prompt = "def read_config(path):\n"
    ids = greedy(tok.encode(prompt), 8)
    for extra in ({"stop": ["_get_pa"]}, {}):  # a stop string makes the text handed out wait behind the tokens
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2, **extra})
        lp = reply.json()["choices"][0]["logprobs"]
        assert lp["text_offset"] == [len(tok.decode(ids[:i])) for i in range(len(lp["tokens"]))]  # each token's start
        assert all(len(top) == 2 for top in lp["top_logprobs"])
    _clean(server)


def test_tiny_temperature_is_greedy_and_a_failing_request_fails_alone(server, client):
    greedy_text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0).choices[0].text
    for temperature in (1e-45, 1e-39, 1e-6):  # below 1e-5: greedy, as vLLM
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=temperature)
        assert out.choices[0].text == greedy_text
    innocent = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "logit_bias": {"0": -100},
                "stream": True}
    result: dict[str, list[str]] = {}

    def run_innocent():
        with httpx.stream("POST", f"{server.url}/v1/completions", json=innocent, timeout=120) as reply:
            result["lines"] = [line for line in reply.iter_lines() if line]

    thread = threading.Thread(target=run_innocent)
    thread.start()
    try:
        _wait(lambda: server.state.worker.engine.stats().running > 0, "the innocent stream to run")
        # repetition_penalty=1e-40 while sampling: scores overflow to inf, the engine fails this request alone
        bad = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "def f(x):\n    return x\n", "max_tokens": 4, "repetition_penalty": 1e-40})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["type"] == "invalid_request_error" and "Traceback" not in bad.text
        streamed = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "def f(x):\n    return x\n", "max_tokens": 4, "repetition_penalty": 1e-40,
            "stream": True})
        lines = [line for line in streamed.text.splitlines() if line]
        assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
    finally:
        thread.join(120)
    lines = result["lines"]
    assert lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in lines[-2]  # it went on to its end
    _clean(server)


def test_a_non_streaming_client_that_goes_away_is_aborted(server):
    aborted = _metric(server, "hf_paged_requests_aborted_total")
    # tokens flow all along (no EOS): the hang-up must be noticed anyway, not only between tokens
    body = {"model": MODEL, "prompt": PROMPTS[1] * 20, "max_tokens": 3000, "temperature": 0, "logit_bias": {"0": -100}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    _wait(server.idle, "the request to end", tries=1200)
    assert _metric(server, "hf_paged_requests_aborted_total") == aborted + 1  # aborted, not run to max_tokens
    _clean(server)


def test_ttft_once_per_request_and_preemptions_count(server, client):
    ttft = _metric(server, "hf_paged_time_to_first_token_seconds_count")
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=1.0, n=4, seed=1)
    assert _metric(server, "hf_paged_time_to_first_token_seconds_count") == ttft + 1  # not once per sample
    lines = _metric_lines(server)
    assert any(line.startswith("# TYPE hf_paged_preemptions") and line.endswith(" counter") for line in lines)
    assert any(line.startswith("hf_paged_preemptions_total ") for line in lines)


def test_fixed_pool_refuses_what_never_fits_and_keeps_serving():
    srv = _Server("--max-memory", "1000000")  # ~15 blocks of 16 tokens on the demo model
    try:
        limit = srv.state.context_tokens()
        assert limit < 4096
        assert httpx.get(f"{srv.url}/v1/models").json()["data"][0]["max_model_len"] == limit
        # the first request already (the pool is sized at startup): a clear 400, not a dead engine thread
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0}
        reply = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
        small = httpx.post(f"{srv.url}/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
        assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 4
        # chat without max_tokens: the rest of what the pool holds for one request, not of the model's context
        chat = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "logit_bias": {"0": -100}})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["total_tokens"] == limit and chat.json()["choices"][0]["finish_reason"] == "length"
        # an OutOfBlocksError from Engine.submit itself (the HTTP side's check bypassed) is a 400 too
        srv.state.kv_tokens = None
        reply = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded", reply.text
        assert httpx.get(f"{srv.url}/health").json()["status"] == "ok"
        _clean(srv)
    finally:
        srv.close()


def test_unexpected_engine_errors_fail_requests_and_a_dead_engine_is_unhealthy(monkeypatch):
    srv = _Server()
    try:
        engine = srv.state.worker.engine
        submit = engine.submit
        calls = []

        def broken_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise KeyError("a bug in Engine.submit")
            return submit(*args, **kwargs)

        monkeypatch.setattr(engine, "submit", broken_once)
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
        first = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
        assert first.status_code == 500 and "KeyError" in first.json()["error"]["message"]
        assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30).status_code == 200  # the thread went on
        assert httpx.get(f"{srv.url}/health").status_code == 200

        def broken(*args, **kwargs):
            raise RuntimeError("the engine is broken for good")

        monkeypatch.setattr(engine, "has_work", broken)  # every turn of the thread fails from now on
        failed = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
        assert failed.status_code in (500, 503), failed.text
        _wait(lambda: httpx.get(f"{srv.url}/health").status_code == 503, "/health to report the dead engine thread")
        assert httpx.get(f"{srv.url}/health").json()["status"] == "unhealthy"
        after = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
        assert after.status_code == 503, after.text  # answered at once, not left hanging
        monkeypatch.undo()
    finally:
        srv.close()


def test_api_key_and_a_burst_beyond_the_queue():
    srv = _Server("--max-seqs", "1", "--max-queue", "1", "--api-key", "sesame")
    try:
        denied = httpx.get(f"{srv.url}/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()
        headers = {"Authorization": "Bearer sesame"}
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0}

        async def burst():
            async with httpx.AsyncClient(timeout=120, headers=headers) as http:
                return await asyncio.gather(*(http.post(f"{srv.url}/v1/completions", json=body) for _ in range(8)))

        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}  # at most 2 pending: the rest refused
        assert _metric(srv, 'hf_paged_requests_rejected_total') >= codes.count(429)
        _clean(srv)
    finally:
        srv.close()


def _cli_server() -> tuple[subprocess.Popen, int]:
    """`python -m hf_paged serve` on a free port of 127.0.0.1, once it answers."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "hf_paged", "serve", "--port", str(port), "--drain-timeout", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)

    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait(up, "the CLI server to answer", tries=600, pause_s=0.1)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, port


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_cli_exits_cleanly_when_idle(sig):
    proc, _ = _cli_server()
    try:
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read().decode()
        assert "Traceback" not in log and "ERROR" not in log and "Finished server process" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_exits_cleanly_on_sigint_with_a_stream_in_flight(tmp_path):
    proc, port = _cli_server()
    try:
        # logit_bias keeps the demo model from ending the stream with its EOS (id 0) before the signal lands
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3000, "stream": True, "logit_bias": {"0": -100}}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as reply:
            lines = reply.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]  # --drain-timeout seconds, then an error chunk and [DONE]
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read().decode()
        assert "Traceback" not in log and "Finished server process" in log
        assert any("shutting down" in line for line in rest) and rest[-1] == "data: [DONE]"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_model_the_engine_cannot_serve_is_refused_at_startup(tmp_path, capsys, monkeypatch):
    """A bidirectional model (BERT with `is_decoder=False`) loads with `"paged"`, but its first forward is refused:
    `serve` runs one token before it listens, so it exits with one message (status 2) instead of answering every
    request with a 500."""
    from transformers import AutoTokenizer, BertConfig, BertLMHeadModel

    from hf_paged.demo_model import DEMO_MODEL_PATH
    from hf_paged.serve import cli

    def never_serve():
        raise AssertionError("the server started")

    monkeypatch.setattr(cli, "_draining_server_class", never_serve)

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    BertLMHeadModel(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(str(DEMO_MODEL_PATH)).save_pretrained(tmp_path)
    assert cli.main([str(tmp_path), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "hf-paged serve: this model cannot be served" in err and "bidirectional" in err
