"""Run a function on every rank of a fresh tensor-parallel group, one process per rank.

For tests, the chapter's measurements and the benchmark: ``run_on_ranks(fn, 2, *args)``
starts two processes, joins them in a group (gloo on the CPU, NCCL on GPUs), calls
``fn(*args)`` in each and returns the results in rank order. The calling process joins no
group, so it stays a plain single process. ``fn`` must be importable by name (defined at
the top level of a module), as spawned processes look it up afresh.
"""
import pickle
import time
import traceback

import torch
import torch.multiprocessing as mp

from minivllm.distributed.parallel_state import backend_for, destroy_tensor_parallel, init_tensor_parallel
from minivllm.distributed.processes import ProcessExited, free_port, get_from


def _rank_main(rank: int, world_size: int, init_method: str, device: str, fn, args, results, num_threads: int):
    try:
        torch.set_num_threads(num_threads)
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(rank)
        init_tensor_parallel(rank, world_size, init_method, backend_for(device))
        # Pickled here, by value: a tensor sent through a queue as-is would be shared
        # memory that disappears with this process.
        results.put((rank, "ok", pickle.dumps(fn(*args))))
        destroy_tensor_parallel()  # every rank leaves together (under NCCL, leaving is collective)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        destroy_tensor_parallel(abort=True)  # the other ranks may never arrive to leave with


def run_on_ranks(fn, world_size: int, *args, device: str = "cpu", timeout_s: float = 300.0,
                 num_threads: int | None = None) -> list:
    """``[fn(*args) on rank 0, ..., on rank world_size - 1]``; an error on any rank is raised
    here with that rank's traceback. Each rank uses ``num_threads`` CPU threads (default:
    the caller's number)."""
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    threads = num_threads or torch.get_num_threads()
    procs = [spawn.Process(target=_rank_main, daemon=True,
                           args=(rank, world_size, init_method, device, fn, args, results, threads))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, kind, payload = get_from(results, procs, deadline, poll_s=0.5, exit_ok=True)
            except TimeoutError:
                raise TimeoutError(f"{fn.__name__} did not finish on {world_size} ranks within {timeout_s:.0f} s") from None
            except ProcessExited as e:
                raise RuntimeError(f"a rank process exited with code {e.process.exitcode}") from None
            if kind == "error":
                raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{payload}")
            out[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[rank] for rank in range(world_size)]
