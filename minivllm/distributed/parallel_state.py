"""Who am I in the tensor-parallel group, and the two collectives the model needs.

Every rank runs the same model code on its own slice of the weights. The layers ask this
module, when they are built, for their rank and the group's size and take their slice; in
the forward pass they call ``all_reduce`` (after a row-parallel matmul) and ``all_gather``
(the vocabulary-parallel logits). At world size 1, the default, there is no process group
at all and both collectives return their input untouched: the single-process engine never
notices this module.

Backends: NCCL between GPUs, gloo between CPU processes (the tests and the notebook).
"""
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    rank: int = 0
    world_size: int = 1
    # True once init_tensor_parallel has joined a real process group.
    connected: bool = False


_STATE = ParallelState()


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_world_size() -> int:
    return _STATE.world_size


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str,
                         timeout_s: float = 300.0) -> None:
    """Join the group of ``world_size`` processes that meet at ``init_method``
    (``tcp://host:port``). Blocks until all of them have arrived, at most ``timeout_s``;
    the same limit then applies to every collective."""
    if _STATE.connected or dist.is_initialized():
        raise RuntimeError("this process already belongs to a tensor-parallel group; shut that engine down first")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    _STATE.rank, _STATE.world_size, _STATE.connected = rank, world_size, True


def destroy_tensor_parallel(abort: bool = False) -> None:
    """Leave the group (if any) and go back to world size 1.

    Under NCCL leaving is itself collective: ``destroy_process_group`` returns only once every
    rank has called it, so all ranks must leave together. When a rank has failed and will
    never arrive, ``abort=True`` tears this rank's side down without waiting for the others
    (gloo, the CPU backend, never waits: it leaves either way)."""
    if dist.is_initialized():
        if abort and dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    _STATE.rank, _STATE.world_size, _STATE.connected = 0, 1, False


@contextmanager
def as_rank(rank: int, world_size: int):
    """Build layers inside this block as rank ``rank`` of ``world_size`` would, without a
    process group: to look at one rank's shards in a single process (tests, the chapter).
    A collective called inside raises: there is nobody to talk to."""
    if _STATE.connected:
        raise RuntimeError("as_rank is for a single process; this one belongs to a real group")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    before = (_STATE.rank, _STATE.world_size)
    _STATE.rank, _STATE.world_size = rank, world_size
    try:
        yield
    finally:
        _STATE.rank, _STATE.world_size = before


def _check_connected(op: str) -> None:
    if not _STATE.connected:
        raise RuntimeError(f"{op} at world size {_STATE.world_size} needs a process group (init_tensor_parallel)")


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; every rank gets the sum. Identity at world size 1."""
    if _STATE.world_size == 1:
        return x
    _check_connected("all_reduce")
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order. Identity at world size 1."""
    if _STATE.world_size == 1:
        return x
    _check_connected("all_gather")
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.world_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


def min_over_ranks(value: int) -> int:
    """The smallest ``value`` any rank holds (e.g. the KV blocks that fit on every GPU)."""
    if _STATE.world_size == 1:
        return value
    _check_connected("min_over_ranks")
    # gloo reduces CPU tensors, NCCL device tensors: use the device the group works on.
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
