"""The server's side of an engine core in its own process: ``AsyncLLMEngine``'s interface,
with the engine in another interpreter.

``EngineCoreClient(model, **engine_args)`` spawns the core (``minivllm.server.engine_core``;
the spawn start method, as CUDA needs: a forked child would inherit a half-initialised CUDA
state) and waits until it has loaded the model. The server's process keeps what HTTP needs:
the tokenizer (prompts are tokenized here, off the core's critical path), the fixed sizes
requests are checked against (``RequestLimits``, sent by the core: the same checks as the
engine's own, so a request that would be refused is refused here with its 400), and, per
request, a queue its outputs arrive on.

The socket is read by the event loop itself (``add_reader``): no thread of ours competes
with the event loop for the interpreter lock. Writes never block the loop: what the
socket cannot take now is kept and written when it can.

If the core dies (a step raised, or the process was killed), every open request gets
EngineDeadError, /health answers 503, and ``on_dead`` runs (``minivllm serve`` then exits
1, for a supervisor to restart it). If the server's process dies, the core sees its socket
close and exits too.
"""
import asyncio
import atexit
import logging
import multiprocessing as mp
import select
import socket
import threading
import time
import weakref
from collections.abc import AsyncIterator

import torch

from minivllm.config import generation_defaults
from minivllm.engine.input_processor import InputProcessor
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.server.async_engine import EngineDeadError, EngineState, OutputQueue, RequestFailedError, RequestQueues
from minivllm.server.engine_core import FrameDecoder, apply_delta, frame, run_engine_core
from minivllm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# How long shutdown waits for the core to exit by itself before it is terminated.
JOIN_TIMEOUT_S = 30.0


class EngineCoreClient(RequestQueues):
    def __init__(self, model=None, startup_s: float | None = None, core_main=run_engine_core, **engine_args):
        """Start the engine core, which builds its engine with
        ``LLMEngine.from_engine_args(model, **engine_args)`` as ``LLM`` does, and wait until
        it is ready (at most ``startup_s`` seconds; None: as long as it is alive). A bad
        argument raises ValueError, as LLM() does. ``core_main``: what the
        core's process runs (``run_engine_core``'s arguments; a stand-in core that speaks the
        same protocol measures the server alone, ``scripts/profile_server.py``)."""
        spawn = mp.get_context("spawn")
        self._sock, theirs = socket.socketpair()
        self.process = spawn.Process(
            target=core_main, name="minivllm-engine-core",
            args=(theirs, model, engine_args, torch.get_num_threads(), logging.getLogger().getEffectiveLevel()))
        self.process.start()
        theirs.close()  # the core holds its end now; ours alone stays here
        self._unsent = bytearray()  # what the socket could not take yet (written before "shutdown")
        # Runs on shutdown(), when the client is garbage-collected, or at exit: whichever is
        # first. (Registered with atexit here, after multiprocessing's own exit handler, so
        # that it runs before that one waits for the core to end.)
        self._stop = weakref.finalize(self, stop_core, self.process, self._sock, self._unsent)
        atexit.register(self._stop)
        try:
            self._decoder = FrameDecoder()
            info = self._wait_until_ready(startup_s)
        except BaseException:  # refused, died, timed out, or Ctrl-C: no need to let it finish loading
            if self.process.is_alive():
                self.process.terminate()
            self._stop()
            raise
        self.config, self.limits = info.config, info.limits
        self._state: EngineState = info.state
        self.tokenizer = load_tokenizer(self.config.model)
        # What the checkpoint's generation_config.json suggests, for the fields a request
        # leaves out (read here from the files, as the core's engine read them).
        self.default_sampling_fields = generation_defaults(self.config.model, self.config.generation_config)
        # For the checks only (the tokens that may not end a request early, bad words).
        self._checks = InputProcessor(self.tokenizer, info.eos_token_ids, self.limits.vocab_size)
        self._eos_token_ids = info.eos_token_ids
        self._grammars = None  # only to check requests' grammars here: the core compiles its own
        self._grammars_lock = threading.Lock()
        self._sock.setblocking(False)
        self._queues: dict[str, OutputQueue] = {}  # request id -> the newest output the core sent for it
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self.is_shut_down = False
        # Called once, on the event loop, when the engine dies (a server stops itself then).
        self.on_dead = None

    def _wait_until_ready(self, startup_s: float | None):
        deadline = None if startup_s is None else time.monotonic() + startup_s
        while True:
            readable, _, _ = select.select([self._sock], [], [], 0.5)
            data = self._sock.recv(1 << 20) if readable else None
            if data == b"" or (data is None and not self.process.is_alive()):
                self.process.join(5)
                raise RuntimeError(
                    f"the engine core exited with code {self.process.exitcode} before it was ready (see its log "
                    "above; it is spawned: a script that starts it must do so under `if __name__ == '__main__':`)")
            messages = self._decoder.feed(data) if data else []
            if messages:
                kind, *rest = messages[0]
                if kind == "ready":
                    return rest[0]
                refused, message, trace = rest
                if refused:  # a bad argument, as LLM() would have raised it
                    raise ValueError(message)
                raise RuntimeError(f"the engine core failed to start: {message}\n--- in the engine core:\n{trace}")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine core was not ready within {startup_s} s")

    # -- what the server reads of the engine ---------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    def state(self) -> EngineState:
        """As of the core's last message (it sends one whenever the figures change)."""
        return self._state

    @property
    def num_aborted(self) -> int:
        return self._state.num_aborted

    # -- the socket ----------------------------------------------------------------------

    def start(self) -> None:
        """Read the core's messages on the running event loop (idempotent; a test or a
        notebook that runs one event loop after another moves the reading to the new one)."""
        if self.error is not None or self.is_shut_down:
            return
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                self._close_socket()
            self._loop = loop
            loop.add_reader(self._sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        try:
            data = self._sock.recv(1 << 22)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            code = self.process.exitcode
            self._die(f"the engine core process exited{'' if code is None else f' with code {code}'}")
            return
        for message in self._decoder.feed(data):
            kind = message[0]
            if kind == "outputs":
                _, outputs, self._state = message
                queues = self._queues
                for output in outputs:  # a RequestOutput, or an OutputDelta (a tuple that starts with the id)
                    if isinstance(output, RequestOutput):
                        queue = queues.get(output.request_id)
                        if queue is not None:  # else its caller left, and its abort is on the way
                            queue.put_nowait(output)
                    else:
                        queue = queues.get(output[0])
                        if queue is not None:  # built here, on the newest output: the caller may skip some
                            queue.put_nowait(apply_delta(queue.newest, output))
            elif kind == "dead":
                self._die(f"a step raised {message[1]} (the traceback is in the engine core's log)")
                return

    def _send(self, message) -> None:
        if self._unsent:  # behind what is waiting: messages keep their order
            self._unsent += frame(message)
            return
        data = frame(message)
        try:
            n = self._sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError:  # the core is gone: the reader sees it too, and fails every request
            return
        if n < len(data):
            self._unsent += data[n:]
            self._loop.add_writer(self._sock.fileno(), self._flush)

    def _flush(self) -> None:
        try:
            n = self._sock.send(self._unsent)
        except BlockingIOError:
            return
        except OSError:
            n = len(self._unsent)
        del self._unsent[:n]
        if not self._unsent:
            self._loop.remove_writer(self._sock.fileno())

    def _die(self, why: str) -> None:
        """The core is gone: say so loudly, answer every open request, accept no more."""
        logger.error("the engine core died: %s; the engine serves no more requests", why)
        self.error = RuntimeError(why)
        self._close_socket()
        dead = EngineDeadError("the engine stopped after an internal error (see the server log)")
        dead.__cause__ = self.error
        self._fail_all(dead)
        if self.on_dead is not None:
            self.on_dead()

    def _close_socket(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_writer(self._sock.fileno())
            self._loop = None

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)

    def close(self) -> None:
        """``shutdown()`` for a caller with no event loop running."""
        self.is_shut_down = True
        if self._loop is not None and not self._loop.is_closed():
            self._close_socket()
        self._loop = None
        self._stop()
        self._fail_all(EngineDeadError("the engine was shut down"))

    async def shutdown(self) -> None:
        """Stop the core: it finishes the step it is in, frees the device and exits. Open
        requests get EngineDeadError. The client cannot be started again."""
        self.is_shut_down = True
        self._close_socket()
        await asyncio.to_thread(self._stop)
        self._fail_all(EngineDeadError("the engine was shut down"))
        with self._grammars_lock:  # this side's grammar checks have compile workers of their own
            if self._grammars is not None:
                self._grammars.shutdown()

    # -- requests ------------------------------------------------------------------------

    def check_health(self) -> None:
        if self.error is not None:
            raise EngineDeadError("the engine stopped after an internal error")
        if self.is_shut_down or not self.process.is_alive():
            raise EngineDeadError("the engine core is not running")

    def validate(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None) -> None:
        """Raise ValueError for a request the engine would refuse (its own checks, here). A
        grammar is checked by ``compile_grammar``: compiled here too, off the event loop, so
        that a bad schema is the caller's 400 (the core compiles its own, while it steps the
        other requests)."""
        self.limits.check_request(prompt_token_ids, sampling_params or SamplingParams(), self._checks)

    def grammar_compiler(self):
        with self._grammars_lock:
            if self._grammars is None:
                from minivllm.structured.compiler import grammar_compiler_for

                self._grammars = grammar_compiler_for(self.tokenizer, self.limits.vocab_size, self._eos_token_ids)
            return self._grammars

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """As ``AsyncLLMEngine.generate``: the request's outputs as the core's steps give
        them; leave early and the request is aborted in the core, which frees its blocks."""
        request_id, queue = self._open(prompt_token_ids, sampling_params, request_id)
        # One write, not awaited: from here the core has it (or is dead, and says so).
        self._send(("add", request_id, prompt_token_ids, sampling_params, prompt))
        finished = False
        try:
            while True:
                output = await queue.get()
                if isinstance(output, BaseException):
                    finished = True  # nothing left to abort: the engine is gone
                    raise output
                finished = output.finished
                if output.error is not None:
                    raise RequestFailedError(output.error)
                yield output
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.error is None and self._loop is not None:
                self._send(("abort", request_id))


def stop_core(process, sock, unsent: bytearray, timeout: float = JOIN_TIMEOUT_S) -> None:
    """Ask the core to exit (after the bytes not sent yet: the stream must stay whole), wait
    for it (terminating it past ``timeout``), close the socket. A module function, not a
    method, so that the finalizer holds no reference to the client."""
    if process.is_alive():
        try:
            sock.setblocking(True)
            sock.sendall(bytes(unsent) + frame(("shutdown",)))
        except OSError:
            logger.info("the engine core's socket is closed: it is exiting already")
        process.join(timeout)
        if process.is_alive():
            logger.warning("the engine core did not exit within %.0f s: terminating it", timeout)
            process.terminate()
            process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
    else:
        process.join()
    sock.close()
