"""From ``step()`` to a server: one background loop drives the engine for many callers.

``LLMEngine`` is synchronous: someone must call ``step()`` over and over, and the requests
in the batch are whoever was added before that call. A server has many callers arriving
at any moment, each waiting for its own tokens, and some leaving early. The shape that
serves them all with one model and one KV pool:

- **one thread owns the engine.** Every call that touches its state (``add_request``,
  ``step``, ``abort_request``) is a job for a single worker thread, so they never overlap
  and need no locks; the asyncio event loop stays free to read and write sockets while a
  step runs on the model;
- **one loop task** submits ``step()`` to that thread again and again while there is work,
  and sleeps on an event when there is none;
- **one queue per request**: the loop routes each ``RequestOutput`` to its request's queue;
  ``generate()`` is an async iterator over that queue (which keeps only the newest output:
  they are cumulative, so a caller that falls behind skips nothing it needs, see
  ``OutputQueue``);
- **leaving aborts**: when the caller stops iterating before the end (a client that
  disconnects), ``generate()`` queues ``abort_request``, which frees the request's blocks.

While it runs, the AsyncLLMEngine owns its LLMEngine: nothing else may call it until
``shutdown()`` has returned.

Jobs run in the order they are submitted (one worker, one FIFO queue), which is what makes
"add, then abort" safe even when the abort is submitted before the add has run.

The engine thread shares the interpreter lock with the event loop, so HTTP work and the
engine's host work take turns. ``minivllm serve`` on a GPU runs the engine in a process of
its own instead (``minivllm.server.engine_client``), behind the same interface.
"""
import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import InvalidParameter, SamplingParams


logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """A step raised: the engine's state can no longer be trusted, so it serves no more."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (finish_reason "error") and went on with the others."""


@dataclass(frozen=True)
class EngineState:
    """The engine's load, as /metrics reports it."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_aborted: int  # requests aborted before they finished (clients that left)
    num_preemptions: int  # running requests sent back to the queue for want of KV blocks, since the start


class OutputQueue:
    """One request's outputs, from the engine's loop to the request's one reader: a queue
    that holds the newest output only. Outputs are cumulative (each holds all the text and
    tokens so far), so a reader that was busy while several arrived (a server behind its
    streams, under load) takes the newest and has lost nothing: one event carries all their
    tokens, and the server catches up instead of paying for every step it is behind (vLLM's
    ``RequestOutputCollector`` merges the same way). A reader that keeps up gets every
    output. An error (the engine died) comes after the output that arrived before it."""

    __slots__ = ("newest", "unread", "error", "_waiter")

    def __init__(self):
        self.newest: RequestOutput | None = None  # the last output put (read or not)
        self.unread = False
        self.error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self.error = item
        else:
            self.newest, self.unread = item, True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput | BaseException:
        """The newest output not read yet, else the error; waits for one."""
        while not self.unread and self.error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.unread:
            self.unread = False
            return self.newest
        return self.error


class RequestQueues:
    """What both engine handles (this one, and ``engine_client.EngineCoreClient`` for a core
    in its own process) do before a request goes to the engine: check it, and open the queue
    its outputs arrive in."""

    _queues: dict[str, OutputQueue]

    def _open(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None,
              request_id: str | None) -> tuple[str, OutputQueue]:
        self.check_health()
        self.start()
        self.validate(prompt_token_ids, sampling_params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        queue = OutputQueue()
        self._queues[request_id] = queue
        return request_id, queue

    async def compile_grammar(self, sampling_params: SamplingParams | None) -> None:
        """Compile the request's grammar, if it has one, off the event loop (on the grammar
        compiler's threads: a JSON schema can take seconds), so that a bad schema or grammar
        is the caller's InvalidParameter before the request is queued; the compiled grammar
        stays in the compiler's cache for the engine. (``generate`` does not: a grammar that
        nobody compiled first is compiled by the engine, which fails the request alone if it
        cannot be, RequestFailedError.)"""
        if sampling_params is None or sampling_params.structured_outputs is None:
            return
        compiler = await asyncio.to_thread(self.grammar_compiler)  # (the first call reads the vocabulary)
        # Shielded: the compile is shared with whoever else asked for this spec, and goes on
        # for the cache if this caller leaves.
        compiled = await asyncio.shield(asyncio.wrap_future(compiler.submit(sampling_params.structured_outputs)))
        allowed = sampling_params.allowed_token_ids
        if allowed is not None and not compiler.first_tokens(compiled)[sorted(set(allowed))].any():
            # Nothing could be drawn for the first token: refused here, not failed in a step.
            raise InvalidParameter("SamplingParams.allowed_token_ids: the grammar allows none of these tokens "
                                   "to start the output, so nothing could be sampled", "allowed_token_ids")


class AsyncLLMEngine(RequestQueues):
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        # The engine thread runs torch on as many CPU threads as its creator does (the count
        # is per thread under OpenMP, so a new thread would otherwise take the default).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-engine",
                                            initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))
        self._queues: dict[str, OutputQueue] = {}  # request id -> its newest output
        self._work: asyncio.Event | None = None  # set when a request arrives
        self._loop_task: asyncio.Task | None = None
        self.error: BaseException | None = None
        self.num_aborted = 0  # requests aborted before they finished (clients that left)
        # Called once, on the event loop, when the engine dies (a server stops itself then,
        # so that a supervisor can restart it).
        self.on_dead = None

    @classmethod
    def from_model(cls, model=None, **engine_args) -> "AsyncLLMEngine":
        """Build the engine from a user's arguments, as ``LLM(model, **engine_args)`` does
        (the bundled model by default)."""
        return cls(LLMEngine.from_engine_args(model, **engine_args))

    # What the server reads of the engine, the same for an engine in another process.

    @property
    def config(self):
        return self.engine.config

    @property
    def default_sampling_fields(self) -> dict:
        """What the checkpoint's generation_config.json suggests, for the fields a request leaves out."""
        return self.engine.default_sampling_fields

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.limits.vocab_size

    def state(self) -> EngineState:
        """Read from the event loop while a step may run: each figure is one attribute read
        (safe under the interpreter lock) and at worst a step stale, which is all a gauge
        promises."""
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        waiting = len(scheduler.waiting) + self.engine.num_compiling  # (those whose grammar is compiling too)
        return EngineState(len(scheduler.running), waiting, blocks.num_free_blocks, blocks.num_blocks,
                           self.num_aborted, scheduler.num_preemptions)

    # -- the loop ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop on the running event loop (idempotent)."""
        if self._loop_task is None or self._loop_task.done():
            self._work = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def shutdown(self) -> None:
        """Stop the loop; when this returns, no job of ours runs or waits in the engine
        thread, so the LLMEngine may be used directly again."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        await self._in_engine_thread(lambda: None)  # jobs run in order: this one runs last
        # Anyone still waiting gets an answer instead of waiting forever.
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _in_engine_thread(self, fn, *args) -> asyncio.Future:
        """Queue ``fn(*args)`` for the engine thread now; await the result when needed."""
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _step_if_busy(self) -> list[RequestOutput] | None:
        """Runs in the engine thread: one step, or None when there is nothing to do."""
        return self.engine.step() if self.engine.has_unfinished_requests() else None

    async def _run(self) -> None:
        try:
            while True:
                # Clear before looking for work: a request that arrives after the check sets
                # the event again, so the wait below cannot miss it.
                self._work.clear()
                outputs = await self._in_engine_thread(self._step_if_busy)
                if outputs is None:
                    await self._work.wait()
                    continue
                self._dispatch(outputs)
                # A step of a tiny model can take microseconds: give the HTTP side a turn.
                await asyncio.sleep(0)
        except Exception as e:
            # Not one request's fault (those fail alone, inside step()): a bug or a device
            # error, after which the engine's state cannot be trusted. Fail loudly: the
            # traceback in the log, an error to every open request, nothing new accepted.
            logger.exception("the engine step failed: the engine is dead and serves no more requests")
            self.error = e
            dead = EngineDeadError("the engine stopped after an internal error (see the server log)")
            dead.__cause__ = e  # for a caller in this process (a test, a notebook); a client sees only the message
            self._fail_all(dead)
            if self.on_dead is not None:
                self.on_dead()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to the queue of the request it belongs to."""
        # BEGIN SOLUTION ch14 dispatch
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
        # END SOLUTION

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)

    # -- requests ----------------------------------------------------------------------

    def check_health(self) -> None:
        # What went wrong is in the log; a client is told only that it did.
        if self.error is not None:
            raise EngineDeadError("the engine stopped after an internal error")
        if self._loop_task is not None and self._loop_task.done():
            raise EngineDeadError("the engine loop is not running")

    def validate(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None) -> None:
        """Raise ValueError for a request the engine would refuse. Reads only fixed sizes
        (vocabulary, max_model_len), so it is safe beside a running step. (A grammar is
        checked by ``compile_grammar``.)"""
        self.engine.limits.check_request(prompt_token_ids, sampling_params or SamplingParams(),
                                         self.engine.input_processor)

    def grammar_compiler(self):
        return self.engine.grammar_compiler()

    def _abort(self, request_id: str) -> None:
        """Runs in the engine thread."""
        if self.engine.abort_request(request_id):
            self.num_aborted += 1

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that gives it a token (the newest
        only, if several arrived while the caller was busy); the last one has
        ``finished=True``. Stop iterating early (or be cancelled) and the request is
        aborted. A bad prompt raises ValueError before anything is queued; a request the
        engine fails alone raises RequestFailedError, and one cut short by the engine's death
        EngineDeadError."""
        request_id, queue = self._open(prompt_token_ids, sampling_params, request_id)
        added = finished = False
        try:
            submitted = self._in_engine_thread(
                self.engine.add_request, prompt_token_ids, sampling_params, request_id, prompt, True)
            added = True  # from here on the add will run, even if we are cancelled while it waits
            # (shielded: cancelling the future of a job that has not started would take it
            # off the engine thread's queue, and the abort below would find nothing to abort)
            await asyncio.shield(submitted)
            self._work.set()
            while True:
                # BEGIN SOLUTION ch14 next_output
                output = await queue.get()
                if isinstance(output, BaseException):
                    finished = True  # nothing left to abort: the engine is gone
                    raise output
                finished = output.finished
                if output.error is not None:
                    raise RequestFailedError(output.error)
                # END SOLUTION
                yield output
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if added and not finished:
                # BEGIN SOLUTION ch14 generate_abort
                self._executor.submit(self._abort, request_id)
                # END SOLUTION
