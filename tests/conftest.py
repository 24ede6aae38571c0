import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. The flag must be set before
# any kernel is decorated, i.e. before minivllm.kernels is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minivllm.testing import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A tiny random-weight Qwen3 checkpoint (float32, tied embeddings)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), family="qwen3", seed=0)


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
