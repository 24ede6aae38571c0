import pytest
import torch

from minivllm.testing import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A tiny random-weight Qwen3 checkpoint (float32, tied embeddings)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), family="qwen3", seed=0)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
