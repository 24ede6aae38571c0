"""The engine core in a process of its own: a busy loop that schedules, runs the model and
samples, and talks to the server's process over one socket.

Why another process. In one process the engine's thread and the HTTP event loop take turns
holding the one interpreter lock: while the event loop parses a body or writes a stream's
event, the engine cannot prepare its next step, and the device waits. A second process has
an interpreter of its own, so the two run at the same time on two cores (vLLM's split of
AsyncLLM and EngineCore). What crosses between them:

- server -> core: ``("add", request_id, prompt_token_ids, SamplingParams, prompt)``,
  ``("abort", request_id)`` and ``("shutdown",)``;
- core -> server: ``("ready", CoreInfo)`` once the model is loaded (or ``("failed", ...)``),
  then one ``("outputs", [...], EngineState)`` per step that had something to say (every
  request that moved in that step, in one message), and ``("dead", why)`` if a step raises.

Each message is a pickle behind an 8-byte length. Both ends read the socket in order, so
"add, then abort" cannot overtake itself, as in the single engine thread of chapter 14.

**Where detokenizing and stop strings run: here, in the core**, inside ``LLMEngine.step`` as
offline and in the in-thread server. The tokens are then the same as theirs by
construction, a stop string ends its request in the step that completes it (no token is
computed past it, no abort has to travel back), and offline throughput, the yardstick of
the serving benchmark, does the same work. vLLM detokenizes in the front end instead and
aborts in the core a request whose stop string the front end found. What the server's
process still does per token is all of HTTP: the JSON of every event and its write.

**A stream gets what is new, not everything again.** An output of a streaming request
carries its whole text and token list; sent at every step it would cost O(length) per
token. So a request's first output and its last go whole (whatever fields a
``RequestOutput`` has, they arrive), and those in between as an ``OutputDelta`` of the new
tokens, text and logprobs, which the server's process adds to the last output it built.
Each step's outputs, whole or not, go in one message.
"""
import gc
import logging
import pickle
import select
import signal
import struct
import sys
import traceback
from dataclasses import dataclass

import torch

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.request_limits import RequestLimits
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.request_state import RequestState
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.server.async_engine import EngineState

logger = logging.getLogger(__name__)

HEADER = struct.Struct("!Q")  # the length of the pickle that follows


def frame(message) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


class FrameDecoder:
    """Bytes in as they arrive, whole messages out."""

    def __init__(self):
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list:
        self.buffer += data
        messages, start = [], 0
        while len(self.buffer) - start >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buffer, start)
            end = start + HEADER.size + n
            if len(self.buffer) < end:
                break
            messages.append(pickle.loads(memoryview(self.buffer)[start + HEADER.size:end]))
            start = end
        del self.buffer[:start]
        return messages


class Channel:
    """The core's end of the socket: blocking writes, reads that wait only when asked to."""

    def __init__(self, sock):
        self.sock = sock
        self.decoder = FrameDecoder()

    def send(self, message) -> None:
        self.sock.sendall(frame(message))

    def receive(self, wait: bool) -> list:
        """The messages that have arrived; with ``wait``, block until there is one. Raises
        EOFError when the server's end is closed (its process ended, however it ended)."""
        messages: list = []
        timeout = None if wait else 0
        while True:
            readable, _, _ = select.select([self.sock], [], [], timeout)
            if not readable:
                return messages
            data = self.sock.recv(1 << 20)
            if not data:
                raise EOFError("the server closed its end of the engine core's socket")
            messages += self.decoder.feed(data)
            if messages:
                timeout = 0  # take what else has arrived, without waiting for more


@dataclass
class CoreInfo:
    """What the server's process needs to know of the engine, sent once it is built."""

    config: EngineConfig  # as the core built it (the model's path resolved, the device chosen)
    limits: RequestLimits
    eos_token_ids: set[int]
    state: EngineState


# A streaming request's output less what its earlier outputs said, as it crosses the socket:
#   (request_id, [completion, ...], num_cached_tokens, error), for the completions that moved:
#   (index, new token ids, new text, new logprobs (None without logprobs), cumulative_logprob,
#    finish_reason, stop_reason).
# Plain tuples: the core pickles one per request per step, and a named tuple pickles eight
# times slower (0.75 ms against 0.09 ms for a step of 256 requests).
OutputDelta = tuple


def _copy(obj):
    """A shallow copy of a dataclass instance, every field included (copy.copy, four times faster)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


def apply_delta(last: RequestOutput, delta: OutputDelta) -> RequestOutput:
    """The output ``delta`` stands for, built on ``last`` (which stays as it was: a stream
    may still hold it). Copies, not fresh objects: a field the delta does not name, those
    added to the output classes later included, is the last output's."""
    _, completions, num_cached_tokens, error = delta
    outputs = list(last.outputs)
    for index, token_ids, text, logprobs, cumulative_logprob, finish_reason, stop_reason in completions:
        before = outputs[index]
        c = outputs[index] = _copy(before)
        c.text, c.token_ids = before.text + text, before.token_ids + token_ids
        if logprobs is not None:
            c.logprobs = before.logprobs + logprobs
        c.cumulative_logprob, c.finish_reason, c.stop_reason = cumulative_logprob, finish_reason, stop_reason
    output = _copy(last)
    output.outputs, output.num_cached_tokens, output.error = outputs, num_cached_tokens, error
    return output


class DeltaOutputProcessor(OutputProcessor):
    """The core's output processor: the first and the last output of a request whole, the
    ones in between as deltas."""

    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        super().__init__(tokenizer, eos_token_ids, max_model_len)
        # request id -> per completion: (tokens, characters, logprobs, finish_reason) sent
        self.sent: dict[str, list[tuple]] = {}

    def make_output(self, request: RequestState) -> RequestOutput | OutputDelta:
        first = request.group[0]
        request_id = first.seq.request_id
        sent = self.sent.get(request_id)
        finished = all(r.seq.is_finished for r in first.group)
        if sent is None or finished:
            output = super().make_output(request)
            if finished:
                self.sent.pop(request_id, None)
            else:
                self.sent[request_id] = [(len(c.token_ids), len(c.text), len(c.logprobs or ()), c.finish_reason)
                                         for c in output.outputs]
            return output
        completions = []
        for i, r in enumerate(first.group):
            seq = r.seq
            num_tokens, num_chars, num_logprobs, reason = sent[i]
            shown = self.shown_text_len(r)
            if seq.num_output_tokens == num_tokens and shown == num_chars and seq.finish_reason == reason:
                continue
            want_logprobs = seq.sampling_params.logprobs is not None
            completions.append((seq.index, seq.token_ids[seq.num_prompt_tokens + num_tokens:], r.text[num_chars:shown],
                                r.logprobs[num_logprobs:] if want_logprobs else None,
                                r.cumulative_logprob if want_logprobs else None, seq.finish_reason, r.stop_reason))
            sent[i] = (seq.num_output_tokens, shown, len(r.logprobs), seq.finish_reason)
        return (request_id, completions, first.seq.num_cached_tokens,
                next((r.error for r in first.group if r.error is not None), None))

    def forget(self, request_id: str) -> None:
        self.sent.pop(request_id, None)


class EngineCore:
    """The busy loop: take in what the server sent, step while there is work, send each
    step's outputs as one message; when there is no work, sleep until a message comes."""

    def __init__(self, engine: LLMEngine, channel: Channel):
        self.engine = engine
        self.channel = channel
        op = engine.output_processor
        self.outputs = engine.output_processor = DeltaOutputProcessor(
            op.tokenizer, op.eos_token_ids, op.max_model_len)
        self.num_aborted = 0
        self.rejected: list[RequestOutput] = []  # adds the engine refused, answered with the next message

    def state(self) -> EngineState:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        waiting = len(scheduler.waiting) + self.engine.num_compiling  # (those whose grammar is compiling too)
        return EngineState(len(scheduler.running), waiting, blocks.num_free_blocks, blocks.num_blocks,
                           self.num_aborted, scheduler.num_preemptions)

    def run(self) -> None:
        """Until the server says stop, or goes away (EOFError)."""
        engine, last_state = self.engine, None
        while True:
            for message in self.channel.receive(wait=not engine.has_unfinished_requests()):
                if message[0] == "shutdown":
                    return
                self.handle(message)
            outputs = engine.step() if engine.has_unfinished_requests() else []
            if self.rejected:
                outputs, self.rejected = self.rejected + outputs, []
            state = self.state()
            if outputs or state != last_state:
                self.channel.send(("outputs", outputs, state))
                last_state = state

    def handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt_token_ids, params, prompt = message
            try:
                self.engine.add_request(prompt_token_ids, params, request_id, prompt, stream=True)
            except Exception as e:
                # The server checked it first, with the engine's own checks: this is a bug,
                # and it is this request's alone (add_request changes nothing before it
                # has checked everything).
                logger.exception("the engine refused request %s", request_id)
                self.rejected.append(RequestOutput(
                    request_id, prompt, prompt_token_ids,
                    [CompletionOutput(i, "", [], finish_reason="error") for i in range(params.n if params else 1)],
                    finished=True, error=f"the engine refused it: {type(e).__name__}: {e}"))
        elif kind == "abort":
            _, request_id = message
            self.outputs.forget(request_id)
            if self.engine.abort_request(request_id):
                self.num_aborted += 1
        else:
            raise ValueError(f"the engine core got a message it does not know: {kind!r}")


def _exit_on_sigterm(signum, frame):
    raise SystemExit(0)  # through the finally below, which stops the engine (and its workers)


def run_engine_core(sock, model, engine_args: dict, num_threads: int, log_level: int) -> None:
    """The core process's main: build the engine (``LLMEngine.from_engine_args``, as
    ``LLM(model, **engine_args)`` does), say it is ready, then run the loop. Exits 1 if a
    step raised."""
    # Ctrl-C in a terminal reaches every process of the group: the server decides when the
    # core stops (it sends "shutdown"), so a step is never cut in half.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=log_level, format="%(levelname)s:     %(name)s: %(message)s")
    torch.set_num_threads(num_threads)  # as many CPU threads as the server's process would use
    channel = Channel(sock)
    try:
        engine = LLMEngine.from_engine_args(model, **engine_args)
    except Exception as e:
        channel.send(("failed", isinstance(e, ValueError), str(e), traceback.format_exc()))
        return
    # The engine lives as long as this process: frozen, the startup heap (torch, the model,
    # the engine) is no longer walked by full collections, each of which would stall a step
    # (the server's process does the same), and the young generation is collected every
    # 20,000 new objects: a step makes them by the thousand, nearly all freed by their
    # reference counts.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)
    try:
        core = EngineCore(engine, channel)
        channel.send(("ready", CoreInfo(engine.config, engine.limits, engine.eos_token_ids, core.state())))
        core.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("the server is gone: the engine core stops")
    except Exception as e:
        # Not one request's fault (those fail alone, inside step()): the engine's state
        # cannot be trusted any more. The traceback goes to the log; the server is told.
        logger.exception("the engine step failed: the engine is dead and serves no more requests")
        try:
            channel.send(("dead", f"{type(e).__name__}: {e}"))
        except OSError:
            logger.info("the server is gone too")
        sys.exit(1)
    finally:
        engine.shutdown()
