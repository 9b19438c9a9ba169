"""`hf-paged serve [MODEL_PATH_OR_ID] [options]` (also `python -m hf_paged serve`): load a model with
`attn_implementation="paged"`, build its `Engine` and serve it with uvicorn until Ctrl-C / SIGTERM.

On a signal, uvicorn stops accepting connections and gives the requests in flight up to `--drain-timeout`
seconds to finish; then the engine thread cancels what is left (their blocks go back to the pool) and the
process exits with status 0.
"""

from __future__ import annotations

import argparse
import signal
import sys

import torch

from ..errors import UnsupportedModelError
from ..tools.cli_args import (
    existing_file,
    memory_budget,
    model_path_or_id,
    non_negative_float,
    non_negative_int,
    positive_int,
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hf-paged serve", description="An OpenAI-compatible server on hf_paged.Engine.")
    parser.add_argument("model", nargs="?", type=model_path_or_id, default=None,
                        help="model path or hub id (default: the shipped demo model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-memory", type=memory_budget, default=None, help='KV pool size: bytes or a share of free memory ("90%%"); default grows')
    parser.add_argument("--max-batch-tokens", type=positive_int, default=512, help="tokens per engine step at most")
    parser.add_argument("--max-seqs", type=positive_int, default=64, help="requests in flight in the engine at most")
    parser.add_argument("--max-queue", type=non_negative_int, default=256, help="requests waiting beyond --max-seqs before 429s")
    parser.add_argument("--kv-dtype", default=None, choices=["int8", "fp8_e4m3"], help="KV storage (default: the model's dtype)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: the path)")
    parser.add_argument("--chat-template", type=existing_file, default=None, help="a Jinja chat template file")
    parser.add_argument("--drain-timeout", type=non_negative_float, default=10.0, help="seconds in-flight requests get on shutdown")
    return parser.parse_args(argv)


def build_state(args: argparse.Namespace):
    """Loads the model and tokenizer and returns a `ServerState` (the engine thread not yet started)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    from ..demo_model import DEMO_MODEL_PATH  # noqa: PLC0415
    from ..engine import Engine  # noqa: PLC0415
    from ..cache.kvpool import KVPool  # noqa: PLC0415
    from .handling import ServerState  # noqa: PLC0415
    from .metrics import ServerMetrics  # noqa: PLC0415
    from .worker import EngineWorker  # noqa: PLC0415

    path = args.model or str(DEMO_MODEL_PATH)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged", dtype=getattr(torch, args.dtype))
    model.eval()
    if torch.cuda.is_available():
        model.to("cuda")
    tokenizer = AutoTokenizer.from_pretrained(path)
    pool = KVPool.for_model(model, max_memory=args.max_memory, kv_dtype=args.kv_dtype)
    engine = Engine(model, pool, max_batch_tokens=args.max_batch_tokens, max_seqs=args.max_seqs, tokenizer=tokenizer)
    # One token now, before the engine thread starts: a model the engine cannot serve (one whose attention is not
    # causal) is refused here rather than on every request, and a max_memory pool, sized by its first write, tells
    # the server from its first request on how many tokens one request can hold (a request that cannot fit is
    # refused with a 400, and chat's default max_tokens stays within it)
    engine.submit([tokenizer.eos_token_id or 0], max_new_tokens=1, do_sample=False)
    for _ in range(4):
        if not engine.has_work():
            break
        engine.step()
    eos = model.generation_config.eos_token_id
    eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
    if not eos_ids and tokenizer.eos_token_id is not None:
        eos_ids = frozenset([tokenizer.eos_token_id])
    metrics = ServerMetrics()
    return ServerState(
        worker=EngineWorker(engine, metrics, max_pending=args.max_seqs + args.max_queue),
        tokenizer=tokenizer,
        model_name=args.served_model_name or (args.model or "hf-paged-demo"),
        max_positions=getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length,
        vocab_size=model.config.vocab_size,
        eos_ids=eos_ids,
        api_key=args.api_key,
        chat_template=args.chat_template.read_text() if args.chat_template else None,
        kv_tokens=request_kv_tokens(pool),
    )


def request_kv_tokens(pool) -> int | None:
    """Tokens (prompt + output) one request can hold alone in `pool`, as `Engine.submit` counts them (its prompt
    and all but its last new token in the blocks of a full-attention layer group); None when unbounded: a growing
    pool, a fixed one not sized yet, or only sliding-window layers."""
    capacity = pool.fixed_capacity()
    if capacity is None or all(g.sliding_window is not None for g in pool.layout.groups):
        return None
    return capacity * pool.block_size + 1


def _draining_server_class():
    import uvicorn  # noqa: PLC0415

    class DrainingServer(uvicorn.Server):
        """uvicorn's server that, on the first Ctrl-C / SIGTERM, also starts the worker's drain."""

        def __init__(self, config, worker, drain_s: float) -> None:
            super().__init__(config)
            self._worker, self._drain_s = worker, drain_s

        def handle_exit(self, sig: int, frame) -> None:
            self._worker.drain(self._drain_s)
            super().handle_exit(sig, frame)

    return DrainingServer


def main(argv: list[str]) -> int:
    """Runs the server until it is stopped; returns the exit status."""
    try:
        import uvicorn  # noqa: PLC0415

        from .app import build_app  # noqa: PLC0415
    except ImportError as error:
        print(f"hf-paged serve needs the serving extra: pip install 'hf-paged[serve]' ({error})")
        return 2
    args = parse_args(argv)
    try:
        state = build_state(args)
    except UnsupportedModelError as error:
        print(f"hf-paged serve: this model cannot be served: {error}", file=sys.stderr)
        return 2
    # uvicorn's own cut-off comes after the worker's: by then every stream has ended with an error chunk
    config = uvicorn.Config(build_app(state), host=args.host, port=args.port,
                            timeout_graceful_shutdown=args.drain_timeout + 5.0, log_level="info")
    # uvicorn handles SIGINT/SIGTERM while it serves and, once it has shut down, raises the signal again under
    # the handlers it found: these take it, so run() returns and the process exits with status 0 (the shutdown
    # was asked for and is complete), with no exception through uvicorn's event loop.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _shutdown_complete)
    _draining_server_class()(config, state.worker, args.drain_timeout).run()
    return 0


def _shutdown_complete(signum: int, frame: object) -> None:
    """The signal uvicorn raises again after its shutdown: nothing is left to do."""
