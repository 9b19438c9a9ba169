"""Serving benchmark on loopback, in the style of vLLM's `benchmark_serving`: `hf-paged serve` against
`transformers serve` (and its `--continuous-batching` mode) on the same model, side by side in one run.

Each server is started as a subprocess on 127.0.0.1, warmed up with one request, then sent the same
requests — streamed `/v1/completions` with prompts drawn from the model's training domain, `max_tokens`
fixed, greedy — with Poisson arrivals at `--rate` requests/s (the same arrival times for every server); the
servers take turns, `--rounds` times. Per request: TTFT (request sent -> first text chunk), ITL (gaps
between text chunks), TPOT ((last - first chunk) / (chunks - 1)); per run: output chunks/s over the run's wall
time. Each chunk is one token on both servers. Figures are p50/p99 over all requests of a server's rounds.

    .venv/bin/python -m benchmarks.serve_load --requests 32 --rate 4 --rounds 2 \\
        --out benchmarks/results/serve_load.csv --plot benchmarks/results/serve_load.png
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from hf_paged.demo_model import DEMO_MODEL_PATH

from .common import machine_info

PROMPTS = ["def read_config(path):\n", "import os\n\n\ndef walk(top):\n", "class Stack:\n    def __init__(self):\n",
           "    for key, value in sorted(", "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(\n"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(target: str, port: int) -> list[str]:
    model = str(DEMO_MODEL_PATH)
    if target == "hf-paged":
        return [sys.executable, "-m", "hf_paged", "serve", model, "--port", str(port), "--served-model-name", model]
    cli = [str(Path(sys.executable).parent / "transformers"), "serve", model, "--host", "127.0.0.1", "--port", str(port)]
    return cli + (["--continuous-batching"] if target == "transformers-cb" else [])


async def one(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, delay_s: float) -> dict[str, object]:
    await asyncio.sleep(delay_s)
    body = {"model": str(DEMO_MODEL_PATH), "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    sent = time.perf_counter()
    times: list[float] = []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            return {"ok": False, "status": reply.status_code}
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    if not times:
        return {"ok": False, "status": 200}
    itl = [b - a for a, b in zip(times, times[1:])]
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return {"ok": True, "ttft": times[0] - sent, "itl": itl, "tpot": tpot, "chunks": len(times), "end": times[-1]}


async def load(url: str, arrivals: list[float], prompts: list[str], max_tokens: int) -> tuple[list[dict], float]:
    async with httpx.AsyncClient(timeout=600) as http:
        await one(http, url, PROMPTS[0], 4, 0.0)  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(one(http, url, p, max_tokens, t) for p, t in zip(prompts, arrivals, strict=True)))
        return results, time.perf_counter() - start


def run_server(target: str, arrivals: list[float], prompts: list[str], max_tokens: int) -> tuple[list[dict], float]:
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(server_command(target, port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):  # up to 120 s to load
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"{target} did not start")
        return asyncio.run(load(url, arrivals, prompts, max_tokens))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson arrival rate, requests/s")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--targets", nargs="+", default=["hf-paged", "transformers", "transformers-cb"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        arrivals.append(t)
    prompts = [rng.choice(PROMPTS) for _ in range(args.requests)]
    collected: dict[str, dict[str, list]] = {t: {"ttft": [], "itl": [], "tpot": [], "tput": [], "failed": []} for t in args.targets}
    for r in range(args.rounds):
        order = args.targets[r % len(args.targets):] + args.targets[: r % len(args.targets)]  # rotate who goes first
        for target in order:
            try:
                results, wall = run_server(target, arrivals, prompts, args.max_tokens)
            except Exception as error:  # noqa: BLE001 - a server that fails is reported, the others still run
                print(f"{target}: failed: {error}", file=sys.stderr)
                collected[target]["failed"].append(args.requests)
                continue
            ok = [x for x in results if x["ok"]]
            c = collected[target]
            c["ttft"] += [x["ttft"] for x in ok]
            c["itl"] += [v for x in ok for v in x["itl"]]
            c["tpot"] += [x["tpot"] for x in ok if x["tpot"] is not None]
            c["tput"].append(sum(x["chunks"] for x in ok) / wall)
            c["failed"].append(len(results) - len(ok))
            print(f"round {r} {target}: {len(ok)}/{len(results)} ok, {c['tput'][-1]:.1f} tokens/s", file=sys.stderr)
    info = machine_info()
    rows = []
    for target, c in collected.items():
        row = {"server": target, "requests": args.requests, "rate": args.rate, "max_tokens": args.max_tokens,
               "rounds": args.rounds, "failed": sum(c["failed"])}
        for name in ("ttft", "tpot", "itl"):
            row[f"{name}_p50_ms"] = round(1e3 * _pct(c[name], 0.5), 2)
            row[f"{name}_p99_ms"] = round(1e3 * _pct(c[name], 0.99), 2)
        row["tokens_per_s_p50"] = round(_pct(c["tput"], 0.5), 2)
        row.update(device=info["device"], versions=info["versions"], date=info["date"], load=info["load"])
        rows.append(row)
    out = sys.stdout if args.out is None else args.out.open("w", newline="")
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    if args.plot is not None:
        plot(rows, args.plot)
    return 0


def plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2))
    names = [r["server"] for r in rows]
    for ax, (metric, label) in zip(axes, [("ttft", "TTFT ms"), ("tpot", "TPOT ms"), ("itl", "ITL ms")], strict=False):
        ax.bar([f"{n}\np50" for n in names], [r[f"{metric}_p50_ms"] for r in rows])
        ax.bar([f"{n}\np99" for n in names], [r[f"{metric}_p99_ms"] for r in rows])
        ax.set_title(label)
        ax.tick_params(axis="x", labelsize=6)
    axes[3].bar(names, [r["tokens_per_s_p50"] for r in rows])
    axes[3].set_title("output tokens/s")
    axes[3].tick_params(axis="x", labelsize=7)
    fig.suptitle(f"serving on loopback: {rows[0]['requests']} requests, Poisson {rows[0]['rate']}/s, {rows[0]['max_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
