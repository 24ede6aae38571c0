# Exercise copy of minivllm/engine/tp_worker.py, generated from it by scripts/make_exercises.py.
# Fill in: check_tensor_parallel (ch16).
# Grade: make grade CH=16
# Running the generator again overwrites this file: commit or copy your work first.

"""Tensor parallelism across processes: rank 0 runs the engine, the other ranks run the model.

One process per rank, started with ``torch.multiprocessing`` (spawn). This process is
rank 0: it holds the scheduler, the block manager and the sampler, exactly as in a single
process. Each step it prepares the batch as usual (``ModelRunner.prepare``: one small host
array, ``engine.step_inputs.StepInputs``), puts it in every worker's queue, and runs its own share of the
forward pass. Each worker loops: take a step from its queue, run the model on it
(``ModelRunner.execute``), throw the logits away. The workers' all-reduces meet rank 0's
inside the forward pass, so the ranks stay in lockstep without any other synchronisation.
Only rank 0 samples, so seeds and generators live in one place.

Why a queue and not a broadcast over the process group: a worker waiting for the next step
blocks in ``queue.get``, which may wait for hours between requests, where a collective
would time out. The message is the step's metadata, a few integers per token and per
sequence, never the sequences' whole histories.

Shutdown: rank 0 sends ``None`` and leaves the group; each worker leaves it too and exits.
Under NCCL leaving is collective (every rank's ``destroy_process_group`` waits for the
others), so rank 0 leaves at once rather than after waiting for the workers to exit. After a
failure nobody can be waited for: the ranks abort the group instead. The workers are daemon
processes, so they also end with rank 0.
"""
import time
import traceback
import weakref
from queue import Empty

import torch
import torch.multiprocessing as mp

from minivllm.config import EngineConfig, ModelConfig
from minivllm.distributed.parallel_state import backend_for, destroy_tensor_parallel, init_tensor_parallel
from minivllm.distributed.processes import ProcessExited, free_port, get_from
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.step_inputs import StepInputs

# How long any rank waits for the others: to start (spawn, imports, loading weights) and
# in any one collective.
TIMEOUT_S = 300.0
# How long shutdown waits for a worker to exit before killing it.
JOIN_TIMEOUT_S = 30.0


def check_tensor_parallel(config: ModelConfig, world_size: int, device: str) -> None:
    """Refuse, before any process starts, a model that does not split over ``world_size`` ranks.

    Every split the sharded layers make must come out even: whole query heads per rank, key/value
    heads split or copied, the feed-forward's (and each expert's) intermediate features. Finding
    out here costs nothing; finding out in a worker costs a spawn, a process group and a load.
    """
    raise NotImplementedError(
        "ch16: check_tensor_parallel: refuse, with a ValueError, every model the sharded layers "
        "cannot split evenly over world_size ranks, before any process starts. Walk the layers of "
        "one decoder block and ask what each splits: attention splits whole query heads; the "
        "key/value heads are split when there are at least as many as ranks and copied when there "
        "are fewer (then the ranks must come in whole groups per head); the feed-forward splits "
        "its intermediate features, and a mixture of experts splits each expert's features too "
        "(only when the model has experts: a dense config may carry the field). Hybrid models (a "
        "linear_attention entry in the Hugging Face config's layer_types) are refused outright: "
        "their recurrent state is not split. On a CUDA device each rank needs its own GPU. Each "
        "message names tensor_parallel_size and the config field with its value (the hybrid one "
        "says hybrid). Second hint: a count c and world size w work for KV heads when either "
        "divides the other, and for everything else only when w divides c, see "
        "notebooks/16_tensor_parallelism.ipynb"
    )


def worker_main(rank: int, config: EngineConfig, init_method: str, steps, reports, num_threads: int) -> None:
    """A worker rank: join the group, load this rank's shards, run every step rank 0 sends."""
    reports.put(("started", rank, ""))
    failed = True
    try:
        torch.set_num_threads(num_threads)  # as many CPU threads as rank 0 uses
        if torch.device(config.device).type == "cuda":
            torch.cuda.set_device(rank)  # "cuda" in this process now means GPU number `rank`
        init_tensor_parallel(rank, config.tensor_parallel_size, init_method, backend_for(config.device), TIMEOUT_S)
        runner = ModelRunner(config)
        while (step := steps.get()) is not None:
            runner.execute(*runner.upload(step))
        failed = False
    except BaseException:
        reports.put(("error", rank, traceback.format_exc()))
        raise
    finally:
        destroy_tensor_parallel(abort=failed)


def _stop(workers: list, steps: list, abort: bool = False) -> None:
    """Ask every worker to exit, leave the group together with them, then wait for them
    (killing any still there after JOIN_TIMEOUT_S). With a worker already gone, or with
    ``abort`` (start-up failed), nobody may arrive to leave with: abort the group instead.
    A module function, not a method, so the finalizer holds no reference to the runner."""
    abort = abort or not all(worker.is_alive() for worker in workers)
    for queue, worker in zip(steps, workers):
        if worker.is_alive():
            queue.put(None)
    destroy_tensor_parallel(abort=abort)
    for worker in workers:
        worker.join(JOIN_TIMEOUT_S)
        if worker.is_alive():
            worker.kill()
            worker.join()


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: a ModelRunner over this rank's shards that first sends each
    step to the worker ranks."""

    def __init__(self, config: EngineConfig):
        world_size = config.tensor_parallel_size
        check_tensor_parallel(ModelConfig.from_pretrained(config.model), world_size, config.device)
        spawn = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.reports = spawn.Queue()  # ("started" | "error", rank, traceback)
        self.steps = [spawn.Queue() for _ in range(1, world_size)]
        self.workers = [
            spawn.Process(target=worker_main, name=f"minivllm-tp-rank{rank}", daemon=True,
                          args=(rank, config, init_method, queue, self.reports, torch.get_num_threads()))
            for rank, queue in zip(range(1, world_size), self.steps)
        ]
        for worker in self.workers:
            worker.start()
        # Runs on shutdown(), when the runner is garbage-collected, or at exit: whichever is first.
        self._stop = weakref.finalize(self, _stop, self.workers, self.steps)
        try:
            self._wait_until_started()
            init_tensor_parallel(0, world_size, init_method, backend_for(config.device), TIMEOUT_S)
            super().__init__(config)
        except BaseException as e:
            self._stop.detach()
            _stop(self.workers, self.steps, abort=True)
            raise RuntimeError(f"tensor-parallel start-up failed{self._worker_errors()}") from e

    def forward(self, batch, rows_to_sample: list[int], previous=None):
        dead = [w.name for w in self.workers if not w.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker(s) {dead} are not running{self._worker_errors()}")
        return super().forward(batch, rows_to_sample, previous)

    def upload(self, step: StepInputs, previous_tokens=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Send the flattened step to every worker, then upload it here too. (The step says
        which rows get logits: the LM head's all-gather is a collective, so either every
        rank computes them or none does.)"""
        for queue in self.steps:
            queue.put(step)
        return super().upload(step, previous_tokens)

    def shutdown(self) -> None:
        self._stop()
        super().shutdown()

    def _wait_until_started(self) -> None:
        """Wait until every worker runs worker_main, so that a worker that cannot even start
        fails here at once instead of leaving rank 0 waiting for it in the group."""
        started: set[int] = set()
        deadline = time.monotonic() + TIMEOUT_S
        while len(started) < len(self.workers):
            try:
                kind, rank, text = get_from(self.reports, self.workers, deadline, poll_s=0.2)
            except ProcessExited as e:
                raise RuntimeError(
                    f"worker {e.process.name} exited with code {e.process.exitcode} before starting (workers are "
                    "spawned: a script that builds a tensor-parallel LLM must do so under "
                    "`if __name__ == '__main__':`)"
                ) from None
            except TimeoutError:
                raise TimeoutError(f"the workers did not start within {TIMEOUT_S:.0f} s") from None
            if kind == "error":
                raise RuntimeError(f"worker rank {rank} failed:\n{text}")
            started.add(rank)

    def _worker_errors(self) -> str:
        """What the workers reported before they died, for an error message."""
        errors = []
        while True:
            try:
                kind, rank, text = self.reports.get(timeout=1.0)
            except Empty:  # nothing more was reported
                break
            if kind == "error":
                errors.append(f"\n--- worker rank {rank}:\n{text}")
        return "".join(errors)
