"""Compiling a start-up's Triton kernels on many threads at once.

On a fresh machine (Triton's disk cache empty) most of an engine's start-up is Triton's
compiler: each kernel variant the start-up's passes launch (the CUDA graphs' batch sizes, the
eager steps of ``compile_kernels``) compiles at its first launch, one after another, while the
GPU waits. Compiling is CPU work, and enough of it runs outside Python's lock to spread
over cores: on the H200's 16, the captures and compiling steps took 11.8 s compiling one
kernel after another, and 3.1 s of compiling ahead plus 2.8 s with it
(benchmarks/startup_compile_ahead.json).

``compile_only()`` runs a block of code with every Triton launch turned into a compile
request: Triton's ``AsyncCompileMode`` hands each kernel variant not yet compiled to a pool of
threads, and the launch itself is skipped (the launch's ``warmup`` flag: compile, do not run).
Leaving the block waits for every compile and puts the kernels in each kernel's own cache,
where the real passes find them. Inside the block the torch operations still run, on
whatever the skipped kernels left in their outputs: nothing computed there may be used.

The start-up runs its graph and eager passes once inside it, then for real
(``RunnerStartup._prepare_gpu``); ``MINIVLLM_COMPILE_AHEAD=0`` turns it off. The GEMM
library's warm-up runs inside it too, on the main thread while the compiles run on the
others: it computes nothing that is used, and its time is the library loading kernels.

Before any kernel compiles or launches, Triton hashes its own installation (its compiler's
sources and its 400-MB shared library), once a process, to key its cache: 0.57 s of a
start-up on an H200 (benchmarks/startup_profile_warm.txt), which ``hash_triton_in_background``
moves under the weights' loading.
"""
import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import triton
from triton.runtime.jit import JITFunction


# One block at a time in a process: each saves and restores JITFunction.run.
_ONE_AT_A_TIME = threading.Lock()


def hash_triton_in_background() -> None:
    """Start Triton's hash of itself (``triton_key``, cached for the process) on a thread
    of its own: the first compile or launch, later, finds it done. (Hashing and file reads
    run outside Python's lock.) Nothing happens where this Triton has no such function."""
    from triton.runtime import cache

    if hasattr(cache, "triton_key"):
        threading.Thread(target=cache.triton_key, name="triton-key", daemon=True).start()


def available() -> bool:
    """Does this Triton have its asynchronous compile mode, and is it not turned off?"""
    return hasattr(triton, "AsyncCompileMode") and os.environ.get("MINIVLLM_COMPILE_AHEAD", "1") != "0"


@contextlib.contextmanager
def compile_only(workers: int | None = None):
    """Within the block, Triton launches compile on ``workers`` threads (default: the CPU
    count, at most 32) and do not run; on leaving it, every compile has finished."""
    workers = workers or min(32, os.cpu_count() or 1)
    owner = threading.get_ident()

    def compile_without_launching(self, *args, grid, warmup, **kwargs):
        # Only this thread's launches: another thread of the process (an engine already
        # stepping) launches as usual. (Triton's compile mode is a context variable: this
        # thread's only, too.)
        return launch(self, *args, grid=grid, warmup=warmup or threading.get_ident() == owner, **kwargs)

    with _ONE_AT_A_TIME, ThreadPoolExecutor(workers, thread_name_prefix="triton-compile") as pool:
        launch = JITFunction.run
        JITFunction.run = compile_without_launching
        try:
            with triton.AsyncCompileMode(pool):
                yield
        finally:
            JITFunction.run = launch
