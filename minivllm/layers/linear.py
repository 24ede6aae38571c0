"""Linear layers that know how to load their own weights, and how to split them across GPUs.

Every parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)``. A plain
layer copies the tensor in. A packed layer (q, k and v in one matrix; gate and up in
another) copies each checkpoint tensor into its own rows. The loader then stays a few
lines: it looks a tensor up, finds the parameter and calls that parameter's loader.

Tensor parallelism (chapter 16) splits the big matrices across ranks, in the two ways that
need the least communication:

- column-parallel (``ColumnParallelLinear``, and the packed ``QKVLinear``, ``GateUpLinear``):
  each rank keeps a slice of the *output* rows (whole attention heads, a slice of the
  feed-forward's intermediate features) and computes that slice of y from the whole x;
- row-parallel (``RowParallelLinear``: the attention output and the feed-forward down
  projection): each rank keeps the matching slice of the *input* columns, multiplies the
  slice of x it already holds, and an all-reduce sums the partial results.

A column-parallel layer followed by a row-parallel one (attention, feed-forward) costs one
all-reduce. The weight loaders read the full checkpoint tensor and keep their rank's
slice. At world size 1 the slice is the whole tensor and there is no all-reduce.

How the weight is stored and multiplied (the model's dtype, or fp8 with its scales) is the
layer's quantization method (``layers.quantization``): every product goes through it.
"""
from dataclasses import dataclass

import torch
from torch import nn

from minivllm.distributed.parallel_state import all_reduce, get_tp_rank, get_tp_world_size
from minivllm.layers.quantization import UnquantizedLinearMethod


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    if shard_id is not None:
        raise ValueError(f"unknown shard {shard_id!r}: this parameter is one whole tensor")
    if param.shape != loaded_weight.shape:
        raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def split_rows(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """The rows [start, start + size) of an evenly split dimension that ``rank`` keeps."""
    if num_rows % world_size != 0:
        raise ValueError(f"{num_rows} rows cannot be split evenly over tensor_parallel_size={world_size}")
    # BEGIN SOLUTION ch16 split_rows
    size = num_rows // world_size
    return rank * size, size
    # END SOLUTION


def kv_head_range(num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first key/value head, number of them) that ``rank`` keeps.

    With at least as many KV heads as ranks they are split like any rows. With fewer, each
    rank keeps one, copied on world_size / num_kv_heads ranks: the head its query heads
    attend with (query head h uses KV head h // (num_heads / num_kv_heads)).
    """
    # BEGIN SOLUTION ch16 kv_head_range
    if num_kv_heads >= world_size:
        return split_rows(num_kv_heads, rank, world_size)
    if world_size % num_kv_heads != 0:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) must divide tensor_parallel_size ({world_size}) when it is smaller"
        )
    return rank * num_kv_heads // world_size, 1
    # END SOLUTION


# The method of every layer built: the weight in the model's dtype until the loader says otherwise.
UNQUANTIZED = UnquantizedLinearMethod()


class Linear(nn.Module):
    """y = x W^T (+ b), with W stored as [output_size, input_size] like nn.Linear. Every
    rank holds all of it (replicated). ``quant_method`` computes the product."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.quant_method = UNQUANTIZED
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    weight_loader = staticmethod(default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def gated_fuses(self, x: torch.Tensor, activation: str) -> bool:
        """Does ``forward_gated`` run as one kernel here (the gate/up product ending in its
        activation)?"""
        return self.quant_method.gated_fuses(self, x, activation)

    def forward_gated(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gate) * up for a [gate | up] layer (GateUpLinear)."""
        return self.quant_method.apply_gated(self, x, activation)


def linear_layers(model: nn.Module) -> list[Linear]:
    """Every linear layer of a model (of every kind: packed, column- and row-parallel), in order."""
    return [m for m in model.modules() if isinstance(m, Linear)]


@dataclass
class Shard:
    """Rows [start, start + size) of a checkpoint tensor with ``full_rows`` rows, kept at
    rows [offset, offset + size) of this rank's matrix."""

    full_rows: int
    start: int
    size: int
    offset: int


class PackedLinear(Linear):
    """Several projections of the same input stacked into one matrix, each split by rows
    across ranks (column-parallel).

    ``shards`` maps each shard id (e.g. "q", "k", "v" or 0, 1) to (its rows in the
    checkpoint, the (start, size) this rank keeps of them), in order. One matmul then
    computes this rank's part of all of them at once.
    """

    def __init__(self, input_size: int, shards: dict, bias: bool = False):
        super().__init__(input_size, sum(size for _, (_, size) in shards.values()), bias)
        self.shards: dict[object, Shard] = {}
        offset = 0
        for shard_id, (full_rows, (start, size)) in shards.items():
            self.shards[shard_id] = Shard(full_rows, start, size, offset)
            offset += size
        for param in (self.weight, self.bias):  # the pieces the loader must find in a checkpoint
            if param is not None:
                param.shard_ids = list(self.shards)

    @property
    def shard_offsets(self) -> dict:
        """Where each shard's rows sit in this rank's matrix: {shard id: (first row, rows)}."""
        return {shard_id: (s.offset, s.size) for shard_id, s in self.shards.items()}

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id not in self.shards:
            raise ValueError(f"unknown shard {shard_id!r}; this layer packs {list(self.shards)}")
        shard = self.shards[shard_id]
        expected = (shard.full_rows, *param.shape[1:])
        if tuple(loaded_weight.shape) != expected:
            name = "" if shard_id is None else f"shard {shard_id!r}: "
            raise ValueError(f"{name}expected shape {expected}, got {tuple(loaded_weight.shape)}")
        param.data.narrow(0, shard.offset, shard.size).copy_(loaded_weight.narrow(0, shard.start, shard.size))


class ColumnParallelLinear(PackedLinear):
    """One projection whose output rows are split across ranks: no communication, each rank
    ends up with its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        rows = split_rows(output_size, get_tp_rank(), get_tp_world_size())
        super().__init__(input_size, {None: (output_size, rows)}, bias)


class RowParallelLinear(Linear):
    """A projection whose input columns are split across ranks. Each rank multiplies the
    slice of x it holds by its columns of W; an all-reduce sums the partial products into
    the full y on every rank. The bias is added once, after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        rank, world_size = get_tp_rank(), get_tp_world_size()
        _, local_input = split_rows(input_size, rank, world_size)
        super().__init__(local_input, output_size, bias)
        self.tp_rank, self.tp_size, self.full_input_size = rank, world_size, input_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if param is self.bias:  # the bias is not split: every rank holds all of it
            return default_weight_loader(param, loaded_weight)
        expected = (self.output_size, self.full_input_size)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"expected shape {expected}, got {tuple(loaded_weight.shape)}")
        start, size = split_rows(self.full_input_size, self.tp_rank, self.tp_size)
        param.data.copy_(loaded_weight.narrow(1, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION ch16 row_parallel_forward
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        y = all_reduce(self.quant_method.apply(self, x))
        return y if self.bias is None else y + self.bias
        # END SOLUTION


def replicated_shards(sizes: dict) -> dict:
    """PackedLinear shards that keep every row, for a layer that tensor parallelism does
    not split: {shard id: rows} -> {shard id: (rows, (0, rows))}."""
    return {shard_id: (rows, (0, rows)) for shard_id, rows in sizes.items()}


class QKVLinear(PackedLinear):
    """The query, key and value projections in one matrix: [q rows | k rows | v rows] of
    this rank's heads. ``num_heads`` and ``num_kv_heads`` are the heads this rank keeps."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        # BEGIN SOLUTION ch16 qkv_split
        rank, world_size = get_tp_rank(), get_tp_world_size()
        if num_heads % world_size != 0:
            raise ValueError(f"num_attention_heads ({num_heads}) must be divisible by tensor_parallel_size ({world_size})")
        q_first, q_count = split_rows(num_heads, rank, world_size)
        kv_first, kv_count = kv_head_range(num_kv_heads, rank, world_size)
        q_rows = (num_heads * head_dim, (q_first * head_dim, q_count * head_dim))
        kv_rows = (num_kv_heads * head_dim, (kv_first * head_dim, kv_count * head_dim))
        super().__init__(hidden_size, {"q": q_rows, "k": kv_rows, "v": kv_rows}, bias)
        self.num_heads, self.num_kv_heads = q_count, kv_count
        # END SOLUTION


class GateUpLinear(PackedLinear):
    """The feed-forward gate and up projections in one matrix: [gate rows | up rows], each
    this rank's slice of the intermediate features."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        rows = split_rows(intermediate_size, get_tp_rank(), get_tp_world_size())
        super().__init__(hidden_size, {0: (intermediate_size, rows), 1: (intermediate_size, rows)}, bias)
