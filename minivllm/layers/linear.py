"""Linear layers that know how to load their own weights.

Every parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)``. A plain
layer copies the tensor in. A packed layer (q, k and v in one matrix; gate and up in
another) copies each checkpoint tensor into its own rows. The loader then stays a few
lines: it looks a tensor up, finds the parameter and calls that parameter's loader.
"""
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.ops.dispatch import use_triton

GEMV_MAX_ROWS = 16  # up to this many rows, kernels.gemv beats a general GEMM


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


class Linear(nn.Module):
    """y = x W^T (+ b), with W stored as [output_size, input_size] like nn.Linear."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x) and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
            from minivllm.kernels.gemv import gemv

            # Decode at small batch: a matrix times a few vectors, bound by reading W.
            return gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """Several projections of the same input stacked into one matrix.

    ``shard_sizes`` maps each shard id (e.g. "q", "k", "v" or 0, 1) to its number of
    output rows, in order. One matmul then computes all of them at once.
    """

    def __init__(self, input_size: int, shard_sizes: dict, bias: bool = False):
        super().__init__(input_size, sum(shard_sizes.values()), bias)
        self.shard_offsets = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; this layer packs {list(self.shard_offsets)}")
        offset, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, offset, size)
        if target.shape != loaded_weight.shape:
            raise ValueError(
                f"shard {shard_id!r}: expected shape {tuple(target.shape)}, got {tuple(loaded_weight.shape)}"
            )
        target.copy_(loaded_weight)


class QKVLinear(PackedLinear):
    """The query, key and value projections in one matrix: [q rows | k rows | v rows]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        super().__init__(
            hidden_size,
            {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim},
            bias,
        )


class GateUpLinear(PackedLinear):
    """The feed-forward gate and up projections in one matrix: [gate rows | up rows]."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__(hidden_size, {0: intermediate_size, 1: intermediate_size}, bias)
