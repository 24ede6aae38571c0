"""Grammar compiles on trial in processes of their own, so that one that runs too long can be
stopped: xgrammar's C++ compile cannot be interrupted, but its process can be killed.

A ``WorkerPool`` keeps up to ``size`` worker processes, each holding the vocabulary (a
``TokenizerInfo``, sent once as JSON) and an xgrammar compiler of its own. ``trial(call,
timeout_s)`` runs one compile call in an idle worker and returns how it ended, or kills
the worker past ``timeout_s`` (``CompileTimeout``) and starts another in its place.

The compiled grammar does not come back: xgrammar 0.2.8 can serialize one
(``CompiledGrammar.serialize_json``), but its JSON repeats the whole grammar's automaton for
every rule, 147 MB for a list of 20 tools, which takes longer to write and read back than the
compile itself (10 s and 2.4 s against 3.2 s at Qwen's 151k vocabulary). A compile is
deterministic, so the caller compiles the spec again in its own process once a worker has
shown that it ends in time; that costs twice the compile time of a spec that is not cached.

A worker is this file run as a script in a fresh interpreter (``RUN_WORKER``; not
multiprocessing's spawn, which would import the caller's ``__main__`` again, and run a script
without a main guard a second time): it imports the standard library and xgrammar only. It
reads requests on its stdin and answers on its stdout, pickled (``multiprocessing.connection``
framing); it exits when its stdin closes, or within ``PARENT_CHECK_S`` of its parent's death,
even in the middle of a compile. Starting one takes 1.3-2.5 s (importing xgrammar imports
torch) and it holds about 300 MB: the pool starts when the first spec is compiled.
"""
import logging
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # for a worker to import xgrammar (and torch, which it imports) and read the vocabulary
PARENT_CHECK_S = 1.0  # how often a worker looks whether its parent is still alive
# A worker: this file run as a script, with neither the working folder nor this one on its path.
RUN_WORKER = "import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv[1], run_name='__main__')"


class CompileTimeout(Exception):
    """The compile ran past its time limit; its worker was killed."""


class WorkerDied(Exception):
    """The worker ended in the middle of a compile (a crash of xgrammar's, or killed)."""


class Worker:
    """One worker process, and the two pipes to it."""

    def __init__(self, tokenizer_info_json: str):
        start = time.perf_counter()
        self.lock = threading.Lock()  # (the pool's shutdown may kill it while its trial does too)
        to_child, requests = os.pipe()  # (os.pipe's ends are not inherited by other children)
        replies, from_child = os.pipe()
        try:
            self.process = subprocess.Popen([sys.executable, "-c", RUN_WORKER, os.path.abspath(__file__)],
                                            stdin=to_child, stdout=from_child,
                                            env={**os.environ, "OMP_NUM_THREADS": "1"})
        except BaseException:
            os.close(requests)
            os.close(replies)
            raise
        finally:
            os.close(to_child)
            os.close(from_child)
        self.requests = Connection(requests, readable=False)
        self.replies = Connection(replies, writable=False)
        try:
            self.requests.send(tokenizer_info_json)
            if not self.replies.poll(START_TIMEOUT_S):
                raise RuntimeError(f"a grammar compile worker did not start within {START_TIMEOUT_S:g} s")
            reply = self.replies.recv()
        except (EOFError, OSError) as e:
            self.kill()
            raise RuntimeError(f"a grammar compile worker failed to start (exit code {self.process.poll()}); "
                               "its error is on stderr") from e
        except BaseException:
            self.kill()
            raise
        assert reply == "ready", reply
        self.start_seconds = time.perf_counter() - start

    def run(self, call: tuple, timeout_s: float) -> "tuple[float, tuple[bool, str] | None]":
        """What became of ``call`` ((method of xgrammar's GrammarCompiler, args, kwargs)): the
        seconds it took, and its error if it raised one (whether a RuntimeError, and the text)."""
        try:
            self.requests.send(call)
            if not self.replies.poll(timeout_s):
                raise CompileTimeout
            return self.replies.recv()
        except (EOFError, OSError) as e:
            code = self.process.wait()
            raise WorkerDied(f"signal {-code}" if code < 0 else f"exit code {code}") from e

    def kill(self) -> None:
        """End the process and close the pipes (again: a no-op)."""
        with self.lock:
            if self.requests.closed:
                return
            self.process.kill()
            self.process.wait()
            self.requests.close()
            self.replies.close()


class WorkerPool:
    """``size`` workers, started when the first trial needs one; each runs one trial at a
    time, and a caller waits for one to be idle. Safe to use from several threads."""

    def __init__(self, tokenizer_info_json: str, size: int):
        self.tokenizer_info_json, self.size = tokenizer_info_json, size
        self.idle: list[Worker] = []
        self.busy: set[Worker] = set()
        self.starting = 0  # workers being started
        self.closed = False
        self.cond = threading.Condition()
        self.start_seconds: list[float] = []  # one entry per worker started, replacements too
        self.killed = 0  # workers killed past a time limit or found dead

    def trial(self, call: tuple, timeout_s: float) -> "tuple[float, tuple[bool, str] | None]":
        """Run ``call`` in a worker: as ``Worker.run``. CompileTimeout past ``timeout_s`` (the
        worker is killed, and another started in the background), WorkerDied if it died."""
        worker = self._take()
        try:
            outcome = worker.run(call, timeout_s)
        except BaseException:  # (past the limit, dead, or interrupted in a state nobody knows)
            self._lose(worker)
            raise
        with self.cond:
            self.busy.discard(worker)
            if self.closed:
                worker.kill()
            else:
                self.idle.append(worker)
            self.cond.notify()
        return outcome

    def processes(self) -> list[subprocess.Popen]:
        """The worker processes alive or being used now (for tests: none after shutdown)."""
        with self.cond:
            return [w.process for w in [*self.idle, *self.busy]]

    def shutdown(self) -> None:
        """Kill every worker; a trial under way fails (WorkerDied), a later one raises."""
        with self.cond:
            self.closed = True
            workers, self.idle, self.busy = [*self.idle, *self.busy], [], set()
            self.cond.notify_all()
        for worker in workers:
            worker.kill()

    def _take(self) -> Worker:
        with self.cond:
            while True:
                if self.closed:
                    raise RuntimeError("the grammar compiler has been shut down")
                if self.idle:
                    worker = self.idle.pop()
                    self.busy.add(worker)
                    return worker
                if len(self.busy) + self.starting < self.size:
                    self.starting += 1
                    break
                self.cond.wait()
        self._fill()  # the others start beside this one: the next caller should not wait for a start
        worker = self._start()
        with self.cond:
            self.starting -= 1
            if self.closed:
                worker.kill()
                raise RuntimeError("the grammar compiler has been shut down")
            self.busy.add(worker)
            return worker

    def _start(self) -> Worker:
        """A new worker (``starting`` counted it; the caller counts it down once it is busy or
        idle, here if it failed to start)."""
        try:
            worker = Worker(self.tokenizer_info_json)
        except BaseException:
            with self.cond:
                self.starting -= 1
                self.cond.notify()
            raise
        self.start_seconds.append(worker.start_seconds)
        return worker

    def _lose(self, worker: Worker) -> None:
        """Kill ``worker`` and start another, off this thread: the caller's error goes back now,
        and the next trial finds a worker ready (or starting)."""
        worker.kill()
        with self.cond:
            self.busy.discard(worker)
            self.killed += 1
        self._fill()

    def _fill(self) -> None:
        """Start, each on a thread of its own, as many workers as the pool lacks."""
        with self.cond:
            missing = 0 if self.closed else self.size - len(self.idle) - len(self.busy) - self.starting
            self.starting += missing
        for _ in range(missing):
            threading.Thread(target=self._start_idle, name="minivllm-grammar-worker-start", daemon=True).start()

    def _start_idle(self) -> None:
        try:
            worker = self._start()
        except Exception:  # (the next trial starts one itself, and raises what went wrong to its caller)
            logger.exception("a grammar compile worker failed to start")
            return
        with self.cond:
            self.starting -= 1
            if self.closed:
                worker.kill()
                return
            self.idle.append(worker)
            self.cond.notify()


# -- the worker process ------------------------------------------------------------------------


def main() -> None:
    parent = os.getppid()
    requests = Connection(os.dup(0), writable=False)
    replies = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # a stray print goes to stderr, not into the replies
    threading.Thread(target=exit_with, args=(parent,), daemon=True).start()

    import xgrammar as xgr

    tokenizer_info = xgr.TokenizerInfo.deserialize_json(requests.recv())
    compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
    replies.send("ready")
    while True:
        try:
            method, args, kwargs = requests.recv()
        except EOFError:  # the parent closed its end: done
            return
        start = time.perf_counter()
        error = None
        try:
            getattr(compiler, method)(*args, **kwargs)
        except Exception as e:  # (sent as text: the caller need not unpickle xgrammar's types)
            error = (isinstance(e, RuntimeError), str(e))
        replies.send((time.perf_counter() - start, error))


def exit_with(parent: int) -> None:
    """End this process when ``parent`` has (it is then another's child), compile or not
    (xgrammar's compile runs without the interpreter lock, so this thread runs beside it)."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


if __name__ == "__main__":
    main()
