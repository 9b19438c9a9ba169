"""Tensor parallelism (`tp_plan="auto"` under `torchrun`, CPU/gloo): generate() with a PagedCache gives the
tokens of the single-process run, and every rank allocates the same blocks, even where one rank's K/V
shard would decide identical rows differently, or one rank has more free memory for a `max_memory` share."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from helpers import saved_model

from tp_worker import CASES, run

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

WORKER = Path(__file__).parent / "tp_worker.py"


def _torchrun(model: Path, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    with socket.socket() as probe:  # a free port for the rendezvous (torchrun's port 0 is not portable)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port), str(WORKER), str(model), "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, list[dict]]:
    """(single-process result, each rank's result under torchrun) on a tiny Llama (4 heads, 2 KV heads: one
    KV head per rank)."""
    model = saved_model("llama")
    return run(str(model)), _torchrun(model, tmp_path_factory.mktemp("tp") / "ranks.json")


@pytest.mark.parametrize("mode", ["agreeing", "one-rank-differs"])
@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_generate_equals_single_process(runs, mode, case):
    single, ranks = runs
    assert len(ranks) == 2
    assert ranks[0][mode][case]["tokens"] == single["agreeing"][case]["tokens"]
    # every rank planned the same forwards: the same block tables, hence the same allocations
    assert ranks[0][mode][case]["tables"] == ranks[1][mode][case]["tables"]
    if mode == "agreeing":  # the repeated prompt row is stored once, as in one process
        assert ranks[0][mode][case]["blocks_in_use"] == single["agreeing"][case]["blocks_in_use"]


def test_a_share_of_free_memory_is_agreed_over_the_ranks(runs):
    """Rank 1 sees more free memory than rank 0: both pools take rank 0's blocks, so the ranks preempt alike (a
    rank preempting alone would run other forwards and the collectives would mismatch) and decode the tokens of one
    process."""
    single, ranks = runs
    assert ranks[0]["budget"]["blocks_total"] == ranks[1]["budget"]["blocks_total"]
    assert ranks[0]["budget"]["preemptions"] == ranks[1]["budget"]["preemptions"] > 0
    assert ranks[0]["budget"]["tokens"] == ranks[1]["budget"]["tokens"] == single["budget"]["tokens"]


def test_arrival_times_are_refused_under_tensor_parallelism(runs):
    """`Engine.stream(arrival_s=...)` admits requests by each process's clock: one process serves it, the ranks of a
    tensor-parallel model refuse it (they would admit at other steps and run other forwards)."""
    single, ranks = runs
    assert single["budget"]["arrival_s"] == "served"
    assert all("tensor-parallel" in rank["budget"]["arrival_s"] for rank in ranks)
