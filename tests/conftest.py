import functools
import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. The flag must be set before
# any kernel is decorated, i.e. before minivllm.kernels is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minivllm.testing import make_tiny_checkpoint, torch_threads

# The tiny checkpoints below are written once per session: tests only read them.


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A tiny random-weight Qwen3 checkpoint (float32, tied embeddings)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), family="qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_with_tokenizer(tmp_path_factory):
    """The same weights as ``tiny_qwen3``, with a tokenizer, for tests that pass text."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3-tokenizer"), family="qwen3", seed=0, with_tokenizer=True)


HYBRID_SEEDS = {"qwen3_5": 3, "qwen3_5_moe": 4, "qwen3_next": 8}


@pytest.fixture(scope="session")
def hybrid_checkpoint(tmp_path_factory):
    """``hybrid_checkpoint(family)``: the tiny checkpoint of a hybrid family, written on first use."""

    @functools.cache
    def make(family: str):
        return make_tiny_checkpoint(tmp_path_factory.mktemp(family), family=family, seed=HYBRID_SEEDS[family])

    return make


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one CPU thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    a tiny model's matmuls are too short to pay for waking a thread pool."""
    with torch_threads(1):
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(autouse=True)
def _free_gpu_memory_after_test():
    """Each engine sizes its KV pool to a share of the GPU's memory: an engine left alive by
    an earlier test (reference cycles wait for the garbage collector) would leave the next
    one nothing. Collect it, and hand the cached blocks back, after every test."""
    yield
    if torch.cuda.is_available():
        import gc
        import sys

        # A failed test's traceback (kept in sys.last_* for post-mortem debugging) holds its
        # frames, and with them its engine: drop it, or one failure fails every later test.
        for name in ("last_exc", "last_value", "last_traceback", "last_type"):
            if hasattr(sys, name):
                setattr(sys, name, None)
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _gpu_tests_need_cuda(request):
    """A test marked gpu fails on a machine without CUDA instead of skipping. `make test`
    deselects them (-m "not gpu"); scripts/gpu_check.sh runs them on the GPU."""
    if request.node.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA GPU: run it through scripts/gpu_check.sh")
