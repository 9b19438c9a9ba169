"""Host work of the Triton path per layer and decode step, without a GPU: what hf-paged's own Python does around
the kernels.

On a GPU at small batch the time a decode step takes is the time the host needs to issue it. The `host` row
(`bench_host`) measures the PyTorch path; this measures the Triton path's share on a CPU: the same 24-layer,
width-64 Llama decodes with `HF_PAGED_BACKEND=triton` under `TRITON_INTERPRET=1`, and every kernel launch is
replaced by zeroing its output (the kernels' results are not what is measured; the interpreter would take
milliseconds). What is timed is each layer's attention function and `update()` call (thread CPU time), i.e. the
plan, the checks, laying out the launches and rebinding them; not Triton's own launcher, which runs on a GPU
only (its cost comes on top, per launch: the cache write and the attention, plus the split-KV reduce).

Run alone: `python -m benchmarks.bench_triton_host [--steps 48] [--repeats 5]` (it sets `TRITON_INTERPRET=1`
and `HF_PAGED_BACKEND=triton` itself, before Triton is imported).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.kernels import launch  # noqa: E402

from .bench_host import NUM_LAYERS, tiny_model, timed_calls  # noqa: E402


@contextlib.contextmanager
def stubbed_launches() -> Iterator[None]:
    """Kernel launches zero their output (`out_ptr`) instead of running."""
    original = launch.Launch.__call__

    def stub(self: launch.Launch) -> None:
        out = self.kwargs.get("out_ptr")
        if out is not None:
            out.zero_()

    launch.Launch.__call__ = stub
    try:
        yield
    finally:
        launch.Launch.__call__ = original


def measure(steps: int, repeats: int) -> dict[str, list[float]]:
    """Per repeat (a run of `steps` decode forwards after a 16-token prompt, after one warm-up run), thread
    seconds of a layer's attention + `update()` calls: `first` (the first layer: the plan), `middle` (median
    over the other layers but the last), `last` (the commit), and `mean` (over every layer)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError("bench_triton_host needs TRITON_INTERPRET=1 set before Triton is imported")
    model = tiny_model()
    model.set_attn_implementation("paged")
    ids = torch.randint(1, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    results: dict[str, list[float]] = {"first": [], "middle": [], "last": [], "mean": []}
    threads, backend = torch.get_num_threads(), os.environ.get("HF_PAGED_BACKEND")
    torch.set_num_threads(1)
    os.environ["HF_PAGED_BACKEND"] = "triton"
    try:
        with torch.no_grad(), stubbed_launches():
            for repeat in range(repeats + 1):  # the first run warms up
                cache = hf_paged.PagedCache(model.config)
                kwargs = hf_paged.cache_kwargs(cache)
                model(input_ids=ids, **kwargs)
                with timed_calls("paged", cache) as calls:
                    token = torch.tensor([[5]])
                    for _ in range(steps):
                        model(input_ids=token, **kwargs)
                if not repeat:
                    continue
                per_call = [a + u for a, u in zip(calls.attention, calls.update, strict=True)]
                by_layer = [per_call[layer::NUM_LAYERS] for layer in range(NUM_LAYERS)]
                results["first"].append(_median(by_layer[0]) / 1e9)
                results["middle"].append(_median([t for layer in by_layer[1:-1] for t in layer]) / 1e9)
                results["last"].append(_median(by_layer[-1]) / 1e9)
                results["mean"].append(sum(per_call) / len(per_call) / 1e9)
    finally:
        torch.set_num_threads(threads)
        if backend is None:
            os.environ.pop("HF_PAGED_BACKEND", None)
        else:
            os.environ["HF_PAGED_BACKEND"] = backend
    return results


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = measure(args.steps, args.repeats)
    us = {part: sorted(v * 1e6 for v in values) for part, values in results.items()}
    print("Triton path, host work in a layer's attention + update() per decode step (kernel launches stubbed; "
          "median over runs, range in brackets):")
    for part, label in (("first", "first layer (plans the step)"), ("middle", "a middle layer"),
                        ("last", "last layer (commits)"), ("mean", "mean over the layers")):
        values = us[part]
        print(f"  {label:30s} {_median(values):7.1f} us  [{values[0]:.1f} to {values[-1]:.1f}]")


if __name__ == "__main__":
    main()
