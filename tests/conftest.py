"""Test-session setup. TRITON_INTERPRET must be set before anything imports triton, so kernels run on CPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

import hf_paged  # noqa: E402, F401  - registers "paged"


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
