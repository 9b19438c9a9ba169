"""Test-session setup. TRITON_INTERPRET must be set before anything imports triton, so kernels run on CPU.

`HF_PAGED_TEST_DEVICE=cuda` runs a session of the kernel tests on that device instead (`make gpu-check` sets it for
them, not for the whole suite): the Triton kernels compiled, not interpreted, and tensors that a test makes without
naming a device made there, so the kernel tests check the compiled kernels on the GPU.
"""

import os

TEST_DEVICE = os.environ.get("HF_PAGED_TEST_DEVICE")
if TEST_DEVICE:
    os.environ["TRITON_INTERPRET"] = "0"
    # transformers (5.25 on) swaps in kernels from the Hub when a model loads onto a GPU; the session is offline
    os.environ.setdefault("USE_HUB_KERNELS", "0")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# pytest-xdist workers (`make test`: -n 2) share the machine's cores: each takes its share of OpenMP threads, for torch
# here and for the Python processes its tests start, instead of every worker spinning threads on every core.
# An OMP_NUM_THREADS already set wins.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // _WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

import hf_paged  # noqa: E402, F401  - registers "paged"

if TEST_DEVICE:
    torch.set_default_device(TEST_DEVICE)

if _WORKERS > 1 and os.environ["OMP_NUM_THREADS"].isdigit():  # in case torch was imported before this file
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def one_thread():
    """One torch thread for the test (`pytestmark = pytest.mark.usefixtures("one_thread")`), the count restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield
