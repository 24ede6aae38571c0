"""The engine loop: add requests, step, collect outputs.

One ``step()`` = schedule → run the model on the batch → sample → update each sequence
(append its token, detokenise, check stop conditions) → free the blocks of those that
finished. Everything a serving front end needs (streaming, aborts) is built on these calls.
"""
import logging
import time
from dataclasses import dataclass, field

import torch

from minivllm.config import EngineConfig
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.state_pool import HybridCacheManager
from minivllm.engine.sequence import Sequence
from minivllm.engine.stop_strings import StopStrings, stop_strings
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import InvalidParameter, SamplingParams
from minivllm.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """What one engine step did, for plots of the scheduler at work."""

    step: int
    seqs: list[tuple[int, int, str]]  # (seq_id, tokens computed, "prefill" | "decode")
    blocks_in_use: int
    num_blocks: int
    cache_hit_tokens: int  # prefix-cache hits at admissions this step
    preempted: list[int]
    finished: list[int]
    seconds: float
    kv_tokens_read: int = 0  # cached tokens the step's attention reads (its K/V traffic)
    attention_pairs: int = 0  # (query, visible key) pairs: the attention FLOPs / (4 * heads * dim)
    # Of `seconds`, the part outside the model runner: scheduling before, bookkeeping after.
    # The device has nothing queued then (the runner returns once the tokens are sampled).
    host_seconds: float = 0.0

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n, kind in self.seqs if kind == "prefill")

    @property
    def num_decode_tokens(self) -> int:
        return sum(n for _, n, kind in self.seqs if kind == "decode")


@dataclass
class Request:
    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    stop_reason: int | str | None = None
    stream: bool = False  # report every new token, not just the final output
    # Worked out once at admission, not at every token: the ids that end the request, the
    # ids banned before min_tokens, and the stop strings' automaton with its state.
    stop_token_ids: frozenset[int] = frozenset()
    banned: list[int] = field(default_factory=list)
    stop_strings: StopStrings | None = None
    stop_state: int = 0
    error: str | None = None  # why the engine failed this request alone (finish_reason "error")
    # Copied once at admission and shared by every output of the request (read-only for
    # callers): a streaming request gets an output per token, and copying a long prompt into
    # each would cost O(prompt length) per token.
    prompt_token_ids: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None):
        self.config = config
        self.tokenizer = tokenizer
        if config.tensor_parallel_size > 1:
            # One process per rank; this one is rank 0 and drives the others (chapter 16).
            from minivllm.engine.tp_worker import TensorParallelRunner

            self.runner = TensorParallelRunner(config)
        else:
            self.runner = ModelRunner(config)
        model_config = self.runner.model_config
        if self.runner.num_state_slots:
            # Hybrid model: a state slot per sequence besides its blocks; no prefix caching
            # (see minivllm.engine.state_pool for why).
            self.block_manager = HybridCacheManager(self.runner.num_kv_blocks, config.block_size, self.runner.num_state_slots)
        else:
            self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = set(model_config.eos_token_id)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.requests: dict[str, Request] = {}
        self.trace: list[StepRecord] = []
        self.num_steps = 0
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "prefill_seconds": 0.0, "decode_seconds": 0.0}
        self.is_shut_down = False

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
        stream: bool = False,
    ) -> str:
        """Queue a request. A bad one raises ValueError and leaves the engine untouched."""
        self._check_running()
        params = sampling_params or SamplingParams()
        banned = self.validate_request(prompt_token_ids, params)
        seq = Sequence(prompt_token_ids, params, request_id)
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) if self.tokenizer else None
        self.requests[seq.request_id] = Request(
            seq, prompt, detok, generator, stream=stream, prompt_token_ids=seq.prompt_token_ids,
            stop_token_ids=frozenset(params.stop_token_ids), banned=banned,
            stop_strings=stop_strings(tuple(params.stop)) if params.stop else None)
        self.scheduler.add(seq)
        return seq.request_id

    def validate_prompt(self, token_ids: list[int]) -> None:
        vocab = self.runner.model_config.vocab_size
        if not isinstance(token_ids, (list, tuple)) or not token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        if len(token_ids) >= self.max_model_len:  # first: it is O(1), the check below is not
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; this engine allows at most {self.max_model_len - 1} "
                f"(max_model_len={self.max_model_len}, limited by the model and by a KV pool of "
                f"{self.runner.num_kv_blocks} blocks x {self.config.block_size} tokens)"
            )
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")

    def validate_request(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        """Raise ValueError (InvalidParameter for a sampling field) for a request this engine
        would refuse; return the ids it bans before min_tokens. Reads only fixed sizes, so it
        is safe beside a running step."""
        self.validate_prompt(token_ids)
        # Before min_tokens, the ids that would end the request may not be drawn. An id the
        # model cannot produce needs no banning (and would index past the logits).
        vocab = self.runner.model_config.vocab_size
        eos = set() if params.ignore_eos else self.eos_token_ids
        banned = sorted({t for t in eos | set(params.stop_token_ids) if t < vocab}) if params.min_tokens else []
        if len(banned) == vocab:
            raise InvalidParameter("SamplingParams.stop_token_ids with min_tokens bans every token of the "
                                   "vocabulary: nothing could be sampled", "stop_token_ids")
        return banned

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any, and give back the device memory
        (weights, KV pool, CUDA graphs). Unfinished requests are dropped; the engine refuses
        new work after."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self.runner.shutdown()

    def _check_running(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("this engine has been shut down: build a new LLM to generate again")

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that finished, and for every
        streaming request that got a token. (Building an output copies the token list:
        doing it for every request at every step would cost O(length^2) per request.)"""
        self._check_running()
        start = time.perf_counter()
        hits_before = self.block_manager.cache_hit_tokens
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.scheduler.waiting and not self.scheduler.running:
                # Nothing runs and the head of the queue does not fit: cannot happen for a
                # validated request, so it is a bug worth a loud error.
                raise RuntimeError(f"scheduler is stuck: {self.scheduler.waiting[0]} cannot be admitted")
            return []
        kinds = ["decode" if n == 1 and seq.num_computed_tokens == seq.num_tokens - 1 and seq.num_output_tokens > 0
                 else "prefill" for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        rows = [i for i in range(len(batch)) if batch.completes(i)]
        params = [batch.seqs[i].sampling_params for i in rows]
        generators = [self.requests[batch.seqs[i].request_id].generator for i in rows]
        banned = [self._banned_tokens(self.requests[batch.seqs[i].request_id]) for i in rows]
        kv_tokens_read = sum(s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens))
        attention_pairs = sum(n * s.num_computed_tokens + n * (n + 1) // 2 for s, n in zip(batch.seqs, batch.num_new_tokens))
        run_start = time.perf_counter()
        sampled = self.runner.run(batch, rows, params, generators, banned)
        run_seconds = time.perf_counter() - run_start

        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.block_manager.commit_full_blocks(seq)
        outputs, finished = [], []
        for j, i in enumerate(rows):
            seq = batch.seqs[i]
            request = self.requests[seq.request_id]
            if j in sampled.errors:
                self._fail(request, sampled.errors[j])
            else:
                try:
                    self._append_token(request, sampled.token_ids[j], sampled.logprobs[j])
                except Exception as e:  # e.g. its detokenizer: this request's problem alone
                    logger.exception("processing the output of request %s failed", seq.request_id)
                    self._fail(request, f"processing its output failed: {type(e).__name__}")
            if seq.is_finished:
                finished.append(seq.seq_id)
                del self.requests[seq.request_id]
            if seq.is_finished or request.stream:
                outputs.append(self._output(request))

        elapsed = time.perf_counter() - start
        num_prefill = sum(n for n, k in zip(batch.num_new_tokens, kinds) if k == "prefill")
        phase = "prefill" if num_prefill else "decode"
        self.stats[f"{phase}_tokens"] += num_prefill if num_prefill else len(batch)
        self.stats[f"{phase}_seconds"] += elapsed
        if self.config.record_trace:
            self.trace.append(StepRecord(
                step=self.num_steps,
                seqs=[(s.seq_id, n, k) for s, n, k in zip(batch.seqs, batch.num_new_tokens, kinds)],
                blocks_in_use=self.block_manager.num_blocks - self.block_manager.num_free_blocks,
                num_blocks=self.block_manager.num_blocks,
                cache_hit_tokens=self.block_manager.cache_hit_tokens - hits_before,
                preempted=[s.seq_id for s in batch.preempted],
                finished=finished,
                seconds=elapsed,
                kv_tokens_read=kv_tokens_read,
                attention_pairs=attention_pairs,
                host_seconds=elapsed - run_seconds,
            ))
        self.num_steps += 1
        return outputs

    def _banned_tokens(self, request: Request) -> list[int]:
        """Before min_tokens, the tokens that would end the request may not be drawn."""
        seq = request.seq
        return request.banned if seq.num_output_tokens < seq.sampling_params.min_tokens else []

    def _append_token(self, request: Request, token: int, logprobs) -> None:
        seq, params = request.seq, request.seq.sampling_params
        seq.token_ids.append(token)
        if logprobs is not None:
            chosen, rank, top_ids, top_values = logprobs
            request.cumulative_logprob += chosen
            entry = {tid: Logprob(v, rank=r + 1, decoded_token=self._decode_one(tid))
                     for r, (tid, v) in enumerate(zip(top_ids, top_values))}
            if token not in entry:
                entry[token] = Logprob(chosen, rank=rank, decoded_token=self._decode_one(token))
            request.logprobs.append(entry)
        # Stop conditions apply once min_tokens tokens exist (as in vLLM). EOS and stop ids
        # cannot be among the first min_tokens anyway: the sampler was not allowed them.
        past_min = seq.num_output_tokens >= params.min_tokens
        reason = None
        if not params.ignore_eos and token in self.eos_token_ids and past_min:
            reason, request.stop_reason = "stop", None
        elif token in request.stop_token_ids and past_min:
            reason, request.stop_reason = "stop", token
        else:
            if request.detokenizer is not None:
                before = len(request.text)
                request.text += request.detokenizer.step(seq.output_token_ids)
                if request.stop_strings is not None:
                    # The automaton reads every character, before min_tokens too, so that a
                    # stop string straddling that point is still found once it counts.
                    request.stop_state, at, stop = request.stop_strings.feed(
                        request.stop_state, request.text, before, report=past_min)
                    if at is not None:
                        request.text = request.text[:at]
                        reason, request.stop_reason = "stop", stop
            if reason is None and (
                (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)
                or seq.num_tokens >= self.max_model_len
            ):
                reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _fail(self, request: Request, error: str) -> None:
        """End one request with finish_reason "error"; the rest of the batch goes on."""
        request.error = error
        if not request.seq.is_finished:
            self.scheduler.finish(request.seq, "error")

    def _decode_one(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def _output(self, request: Request) -> RequestOutput:
        seq = request.seq
        text = request.text
        if request.stop_strings is not None and not seq.is_finished:
            # The end of the text may be the start of a stop string that later tokens
            # complete, and then it is cut off: hold it back until that is ruled out, so a
            # stream never sends text it would have to take back.
            text = text[: max(0, len(text) - request.stop_strings.hold_back)]
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=seq.output_token_ids,  # a slice: already a copy
            cumulative_logprob=request.cumulative_logprob if seq.sampling_params.logprobs is not None else None,
            logprobs=list(request.logprobs) if seq.sampling_params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=seq.is_finished,
            num_cached_tokens=seq.num_cached_tokens,
            error=request.error,
        )
