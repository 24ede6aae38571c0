"""The engine loop: add requests, step, collect outputs.

One ``step()`` = schedule → run the model on the batch → sample → update each sequence
(append its token, detokenise, check stop conditions) → free the blocks of those that
finished. Everything a serving front end needs (streaming, aborts) is built on these calls.
"""
import itertools
import logging
import threading
import time
from concurrent import futures
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from minivllm.config import EngineConfig, generation_defaults
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.engine_args import create_engine_config
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.output_processor import OutputProcessor, RequestState
from minivllm.engine.scheduler import ScheduledBatch, Scheduler
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.state_pool import HybridCacheManager
from minivllm.layers.logits_processors import TokenHistory
from minivllm.layers.sampler import SampledTokens
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import InvalidParameter, SamplingParams
from minivllm.spec_decode.proposer import make_proposer
from minivllm.spec_decode.verify import num_accepted
from minivllm.tokenizer import load_tokenizer

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


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None):
        self.config = config
        self.tokenizer = tokenizer
        # What a request leaves out takes the checkpoint's generation_config.json settings.
        self.default_sampling_fields = generation_defaults(config.model, config.generation_config)
        self.speculative = config.speculative  # SpeculativeConfig, or None: no speculation
        # The proposer of speculative decoding (chapter 19) comes first: a draft model's weights
        # are then on the device when the KV pool is sized, and the pool's budget pays for the
        # draft's cache too (one draft block beside each block of the pool).
        self.proposer = make_proposer(self.speculative, config) if self.speculative is not None else None
        if config.tensor_parallel_size > 1:
            # One process per rank; this one is rank 0 and drives the others (chapter 16).
            from minivllm.engine.tp_worker import TensorParallelRunner

            self.runner = TensorParallelRunner(config)
        else:
            self.runner = ModelRunner(config, self.proposer.block_bytes if self.proposer is not None else 0)
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
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len,
                                                model_config.vocab_size)
        if self.proposer is not None:
            self.proposer.allocate(self.runner.num_kv_blocks, self.runner)
        self.limits = RequestLimits(model_config.vocab_size, self.max_model_len, self.runner.num_kv_blocks,
                                    config.block_size, config.max_num_seqs, bool(self.runner.num_state_slots),
                                    self.speculative is not None)
        self.requests: dict[str, RequestState] = {}
        self.trace: list[StepRecord] = []
        self.num_steps = 0
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "prefill_seconds": 0.0, "decode_seconds": 0.0}
        if self.speculative is not None:  # drafts verified, drafts accepted, verifying steps (per sequence)
            self.stats.update(spec_draft_tokens=0, spec_accepted_tokens=0, spec_verify_steps=0)
        self.is_shut_down = False
        self._in_flight: LaunchedStep | None = None  # asynchronous scheduling: the step on the device
        self._waited = 0.0  # this step's time waiting for the device's tokens
        self._grammars = None  # structured output: the grammar compiler, made at the first such request
        self._grammars_lock = threading.Lock()  # (a server asks for the compiler from its own thread)
        # Requests whose grammar is being compiled on the compiler's threads: id -> (future,
        # first completion). They join the scheduler's queue once it is done; meanwhile the
        # others step on.
        self._compiling: dict[str, tuple] = {}

    @classmethod
    def from_engine_args(cls, model=None, dtype="auto", device=None, **engine_args) -> "LLMEngine":
        """Build an engine from what a user writes: ``LLM(...)``, the server and its
        engine-core process all call this (minivllm.engine.engine_args checks the arguments)."""
        config = create_engine_config(model, dtype, device, **engine_args)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        return cls(config, load_tokenizer(config.model))

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
        stream: bool = False,
    ) -> str:
        """Queue a request. A bad one raises ValueError and leaves the engine untouched.

        A grammar (structured_outputs) not in the compiler's cache is compiled on the
        compiler's threads while the engine steps the other requests; the request is
        scheduled once it is ready, or fails alone (finish_reason "error") if it cannot be
        compiled. ``validate_request`` compiles it on the caller's thread instead, to raise
        InvalidParameter before anything is queued (what ``LLM.generate`` does)."""
        self._check_running()
        params = sampling_params or SamplingParams()
        prompt_token_ids = truncated(prompt_token_ids, params)
        self.limits.check_request(prompt_token_ids, params, self.output_processor)
        first = Sequence(prompt_token_ids, params, request_id)
        if first.request_id in self.requests:
            raise ValueError(f"request_id {first.request_id!r} is already in use")
        # n completions: n sequences, of which the first computes the prompt and then forks
        # into the others, which start from its blocks (copy on write for the partial one).
        seqs = [first] + [Sequence(prompt_token_ids, params, first.request_id) for _ in range(params.n - 1)]
        group = []
        for i, seq in enumerate(seqs):
            seq.index = i
            generator = None
            if params.seed is not None:  # each completion its own stream of draws
                generator = torch.Generator(device=self.runner.device).manual_seed((params.seed + i) % 2**64)
            group.append(self.output_processor.new_request(seq, prompt, generator, stream))
        for request in group:
            request.group = group
        first.num_forks = params.n - 1
        if params.structured_outputs is not None:
            compiler = self.grammar_compiler()
            compiled = compiler.lookup(params.structured_outputs)
            if compiled is None:  # (a failed compile fails the request in a later step, never here)
                self.requests[first.request_id] = group[0]
                self._compiling[first.request_id] = (compiler.submit(params.structured_outputs), group[0])
                return first.request_id
            self._give_grammars(group, compiled)
        self.requests[first.request_id] = group[0]
        self.scheduler.add(first)
        return first.request_id

    def validate_prompt(self, token_ids: list[int]) -> None:
        self.limits.check_prompt(token_ids)

    def validate_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (InvalidParameter for a sampling field) for a request this engine
        would refuse. Reads only fixed sizes, so it is safe beside a running step."""
        self.limits.check_request(token_ids, params, self.output_processor)
        self.validate_structured(params)

    def validate_structured(self, params: SamplingParams) -> None:
        """Compile the request's grammar, if it has one, so that a bad schema or grammar is the
        caller's error before the request is queued (the compiled grammar is cached for
        add_request). InvalidParameter names what is wrong."""
        if params.structured_outputs is not None:
            self.grammar_compiler().compile(params.structured_outputs)

    def grammar_compiler(self):
        """The engine's grammar compiler (chapter 18), made when the first request needs it."""
        with self._grammars_lock:
            if self._grammars is None:
                from minivllm.structured.compiler import grammar_compiler_for

                self._grammars = grammar_compiler_for(self.tokenizer, self.runner.model_config.vocab_size,
                                                      self.eos_token_ids)
            return self._grammars

    def _shutdown_grammars(self) -> None:
        """End the grammar compiler's worker processes, if it was made."""
        with self._grammars_lock:
            if self._grammars is not None:
                self._grammars.shutdown()

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if self._compiling.pop(request_id, None) is None:  # (a compile under way finishes for the cache)
            self.scheduler.abort(request_id)
        if self.proposer is not None:
            for completion in request.group:
                self.proposer.forget(completion.seq)
        return True

    def has_unfinished_requests(self) -> bool:
        # (A step still on the device computes only sequences the scheduler holds, or ones
        # that have ended since: nothing is left unfinished by leaving it there.)
        return self.scheduler.has_unfinished() or bool(self._compiling)

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar to be compiled (not yet in the scheduler's queue)."""
        return len(self._compiling)

    def _give_grammars(self, group: list[RequestState], compiled) -> None:
        """Each completion of a request walks the grammar on its own."""
        from minivllm.structured.matcher import GrammarState

        token_filter = self.grammar_compiler().token_filter(group[0].seq.sampling_params.structured_outputs)
        for request in group:
            request.grammar = GrammarState(compiled, token_filter)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar has compiled; fail those whose grammar could not
        be (their outputs are returned). With nothing else to run, wait a little for one."""
        if not self.scheduler.has_unfinished() and self._in_flight is None:
            futures.wait([f for f, _ in self._compiling.values()], timeout=GRAMMAR_WAIT_S,
                         return_when=futures.FIRST_COMPLETED)
        failed = []
        for request_id, (future, first) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                self._give_grammars(first.group, future.result())
            except Exception as e:  # InvalidParameter: its spec, checked by nobody before
                for request in first.group:
                    request.error = f"structured output: {e}"
                    request.seq.status = SequenceStatus.FINISHED
                    request.seq.finish_reason = "error"
                del self.requests[request_id]
                failed.append(self.output_processor.make_output(first))
                continue
            self.scheduler.add(first.seq)
        return failed

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any, and give back the device memory
        (weights, KV pool, CUDA graphs). Unfinished requests are dropped; the engine refuses
        new work after."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self._shutdown_grammars()
        self.runner.shutdown()
        self.proposer = None  # a draft model's weights and cache go with it

    def _check_running(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("this engine has been shut down: build a new LLM to generate again")

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that finished, and for every
        streaming request that got a token. (Building an output copies the token list:
        doing it for every request at every step would cost O(length^2) per request.)

        With asynchronous scheduling the outputs are those of the step before: this call
        puts step N+1 on the device first, then takes in step N's tokens while the device
        runs N+1."""
        self._check_running()
        failed = self._admit_compiled() if self._compiling else []
        start = time.perf_counter()
        self._waited = 0.0
        with profiler_range("minivllm.launch"):
            launched = self._launch()
        if self.config.async_scheduling:
            previous, self._in_flight = self._in_flight, launched
            with profiler_range("minivllm.process"):
                outputs, finished = self._process(previous) if previous is not None else ([], [])
            if launched is not None and launched.deferred is not None:
                self._sample_deferred(launched)  # its grammars now know the tokens of `previous`
        else:
            with profiler_range("minivllm.process"):
                outputs, finished = self._process(launched) if launched is not None else ([], [])
        if launched is not None:
            self._account(launched, time.perf_counter() - start, finished)
        return failed + outputs if failed else outputs

    def _launch(self) -> "LaunchedStep | None":
        """Schedule a step and put it on the device; its tokens stay there for now."""
        hits_before = self.block_manager.cache_hit_tokens
        if self.speculative is not None:
            self._propose_drafts()
        with profiler_range("minivllm.schedule"):
            batch = self.scheduler.schedule()
        if self.proposer is not None:
            for seq in batch.preempted:  # a draft model computes it again from its tokens when it comes back
                self.proposer.forget(seq)
        if not batch.seqs:
            if self.scheduler.waiting and not self.scheduler.running and self._in_flight is None:
                # Nothing runs and the head of the queue does not fit: cannot happen for a
                # validated request, so it is a bug worth a loud error.
                raise RuntimeError(f"scheduler is stuck: {self.scheduler.waiting[0]} cannot be admitted")
            return None
        trace = self._trace_before(batch) if self.config.record_trace else None
        # (A decode verifying drafts is a decode: its drafts are not prompt tokens.)
        num_prefill_tokens = sum(n for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                                 if not is_decode(seq, n - batch.drafts(i)))
        # The sequences that reach their last token this step get a token sampled; a prompt
        # with n completions gets n, one per fork, from its last token's logits.
        rows = [i for i in range(len(batch)) if batch.samples(i)]
        requests = [self._state(batch.seqs[i]) for i in rows]
        forks = [(i, r) for i, r in zip(rows, requests) if r.seq.num_forks]
        for i, first in forks:
            rows += [i] * first.seq.num_forks
            requests += first.group[1:]
        batch.prompt_logprobs, scoring = self._prompt_logprob_rows(batch)
        # A sequence whose newest token the step in flight sampled reads it on the device.
        previous = None
        if self._in_flight is not None and self._in_flight.sampled is not None:
            previous = (self._in_flight.sampled.token_ids, self._in_flight.row_of)
        run_start = time.perf_counter()
        # Speculative decoding: a sequence verifying d drafts gets d + 1 sampler rows, one per
        # position (minivllm.spec_decode.verify); every other sequence gets one.
        drafts, row_requests = [[]] * len(rows), requests
        if batch.num_drafts:
            drafts = [batch.seqs[i].draft_token_ids for i in rows]
            row_requests = [r for r, d in zip(requests, drafts) for _ in range(len(d) + 1)]
            banned = [self.output_processor.banned(r, j) for r, d in zip(requests, drafts) for j in range(len(d) + 1)]
        else:
            banned = [self.output_processor.banned(r) for r in requests]
        history = token_history(row_requests, previous) if any(r.needs_history for r in requests) else None
        args = ([r.seq.sampling_params for r in row_requests], [r.generator for r in row_requests], banned, history)
        deferred = None
        if not any(r.grammar is not None for r in requests):
            sampled, prompt_scores = self.runner.run(batch, rows, *args[:3], previous, history)
        elif any(r.seq.num_pending for r in requests if r.grammar is not None):
            # A grammar's mask needs the token the step in flight sampled, which the host does
            # not have yet (asynchronous scheduling): the forward pass goes on the device now,
            # the sampling once that step is processed (step() calls _sample_deferred), so the
            # device computes this step while the host takes in the last one.
            logits, prompt_scores = self.runner.forward(batch, rows, previous)
            sampled, deferred = None, (logits, args)
        else:
            sampled, prompt_scores = self.runner.run(batch, rows, *args[:3], previous, history,
                                                     bitmask=self._bitmask(requests))
        run_seconds = time.perf_counter() - run_start
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        for _, first in forks:
            self._fork(first)
        for request in requests:
            request.seq.num_pending += 1  # its token is on the device until this step is processed
        row_of = {r.seq.seq_id: j for j, r in enumerate(requests)}
        if batch.num_drafts:  # the drafts travel with the step now; a sequence's token is its last row's
            for seq in batch.seqs:
                seq.draft_token_ids = []
            row_of = {r.seq.seq_id: e - 1 for e, r in zip(itertools.accumulate(len(d) + 1 for d in drafts), requests)}
        return LaunchedStep(batch, requests, sampled, row_of,
                            num_prefill_tokens, self.block_manager.cache_hit_tokens - hits_before, run_seconds, trace,
                            scoring, prompt_scores, deferred, drafts)

    def _propose_drafts(self) -> None:
        """Give each running sequence in decode its drafts for the next step, from the
        proposer (at most num_speculative_tokens, and never past max_tokens or max_model_len:
        the step emits up to one token more than it has drafts). Runs with the synchronous
        loop only (see EngineConfig.speculative_config), so every sequence's tokens are on
        the host."""
        seqs, ks = [], []
        for seq in self.scheduler.running:
            seq.draft_token_ids = []
            if seq.num_pending or seq.num_computed_tokens != seq.num_tokens - 1 or seq.num_output_tokens == 0:
                continue  # not a decode (a prompt, or a chunk of one, is still to compute)
            if self._state(seq).needs_history:
                continue  # penalties and bad words would need each draft row's own history
            k = min(self.speculative.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
            max_tokens = seq.sampling_params.max_tokens
            if max_tokens is not None:
                k = min(k, max_tokens - seq.num_output_tokens - 1)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        # (Also with no sequence to draft for: an MTP head takes in every step the target ran.)
        for seq, drafts in zip(seqs, self.proposer.propose(seqs, ks)):
            seq.draft_token_ids = drafts

    def _prompt_logprob_rows(self, batch: ScheduledBatch) -> tuple[list[tuple[int, int, int]], list[RequestState]]:
        """Which positions of the batch score a prompt token this step (the requests with
        SamplingParams.prompt_logprobs), as (sequence i, first position, count), and the
        request each run belongs to. Position p scores prompt token p + 1; the prompt's last
        position predicts the first output token instead, the sampler's row."""
        runs, requests = [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.sampling_params.prompt_logprobs is None or seq.index:
                continue  # (the n completions of a prompt share its first one's scores)
            request = self._state(seq)
            # After a preemption the prompt is computed again; the tokens it scored before
            # are not scored twice. (A preempted sequence comes back only once no step of it
            # is in flight, so what it scored is all in its list by then.)
            first = max(seq.num_computed_tokens, len(request.prompt_logprobs) - 1)
            end = min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1)
            if end > first:
                runs.append((i, first, end - first))
                requests.append(request)
        return runs, requests

    def _bitmask(self, requests: list[RequestState]):
        """The tokens each sampled row's grammar allows next (every token for a row without
        one, or whose request has ended), on the host; None when no row's grammar has
        anything left to say (the sampler then needs no mask). Written into buffers kept
        from step to step (pinned on a GPU, so that the upload copies nothing first)."""
        from minivllm.structured.matcher import BitmaskBuffers, fill_bitmask

        states = [None if r.grammar is None or r.seq.is_finished or r.grammar.is_terminated else r.grammar
                  for r in requests]
        if not any(states):
            return None
        vocab_size = self.runner.model_config.vocab_size
        buffers = getattr(self, "_bitmask_buffers", None)  # (made at the first constrained step)
        if buffers is None:
            buffers = self._bitmask_buffers = BitmaskBuffers(vocab_size, pinned=self.runner.device.type == "cuda")
        return fill_bitmask(states, vocab_size, out=buffers.take(len(states)))

    def _sample_deferred(self, step: "LaunchedStep") -> None:
        """Sample a step whose forward pass went ahead of its grammars' masks (see _launch)."""
        logits, (params, generators, banned, history) = step.deferred
        step.deferred = None
        if logits is not None:
            step.sampled = self.runner.sample(logits, params, generators, banned, history,
                                              self._bitmask(step.requests))

    def _process(self, step: "LaunchedStep") -> tuple[list[RequestOutput], list[int]]:
        """Take in a step's tokens: append them, check the stop conditions, build outputs."""
        wait_start = time.perf_counter()
        with profiler_range("minivllm.wait"):
            sampled = step.sampled.to_host() if step.sampled is not None else None  # waits for that step only
            scored = step.prompt_scores.to_host() if step.prompt_scores is not None else None
        self._waited += time.perf_counter() - wait_start
        accepted = self._verify(step, sampled) if any(step.drafts) else None
        step.num_accepted = sum(accepted) if accepted else 0
        for seq in step.batch.seqs:
            self.block_manager.commit_full_blocks(seq)
        finished, touched = [], {}
        if scored is not None:  # before the tokens: a request's first output carries its prompt's scores
            for request in self._take_prompt_scores(step, scored):  # those that failed
                finished.append(request.seq.seq_id)
                touched[request.seq.request_id] = request.group[0]
        grammar_ok = self._accept_grammar_tokens(step, sampled) if sampled is not None else {}
        row = 0
        for j, request in enumerate(step.requests):
            seq = request.seq
            seq.num_pending -= 1
            first, row = row, row + len(step.drafts[j]) + 1  # this request's sampler rows
            if self.requests.get(seq.request_id) is not request.group[0] or seq.is_finished:
                continue  # aborted, or finished by an earlier step, while this one ran
            if grammar_ok.get(j) is False:
                # The mask allowed only what the grammar allows: this is a bug, but one request's.
                self._fail(request, f"structured output: the sampled token {sampled.token_ids[first]} is not "
                                    "allowed by the grammar")
                finished.append(seq.seq_id)
                touched[seq.request_id] = request.group[0]
                continue
            emitted = range(first, first + (accepted[j] if accepted else 0) + 1)
            failed = next((r for r in emitted if r in sampled.errors), None)
            if failed is not None:
                self._fail(request, sampled.errors[failed])
            else:
                try:
                    for r in emitted:  # in order, each through every stop condition; stop at the first that ends it
                        self._append_token(request, sampled.token_ids[r], sampled.logprobs[r], j in grammar_ok)
                        if seq.is_finished:
                            break
                except Exception as e:  # e.g. its detokenizer: this request's problem alone
                    logger.exception("processing the output of request %s failed", seq.request_id)
                    self._fail(request, f"processing its output failed: {type(e).__name__}")
            if seq.is_finished:
                finished.append(seq.seq_id)
            touched[seq.request_id] = request.group[0]
        outputs = []
        for request_id, first in touched.items():
            done = all(r.seq.is_finished for r in first.group)
            if done:
                del self.requests[request_id]
            if done or first.stream:
                outputs.append(self.output_processor.make_output(first))
        return outputs, finished

    def _verify(self, step: "LaunchedStep", sampled) -> list[int]:
        """How many drafts each sampled request of the step accepted. The KV of rejected
        positions stays in the pool past the sequence's end, to be overwritten; the sequence's
        computed tokens and blocks are cut back to the accepted ones (before the full blocks
        are hashed, so that only known tokens are), and a hybrid model's states to those the
        step kept after the last accepted token (minivllm.engine.state_pool)."""
        accepted, row, rolled_back = [], 0, []
        for request, drafts in zip(step.requests, step.drafts):
            n = len(drafts)
            a = num_accepted(drafts, sampled.token_ids[row : row + n + 1]) if n else 0
            row += n + 1
            accepted.append(a)
            seq = request.seq
            if not n or seq.is_finished:
                continue
            seq.num_computed_tokens -= n - a
            self.block_manager.shrink(seq, seq.num_computed_tokens + 1)  # + 1: the token this step appends
            if a < n and seq.state_slot is not None:  # a hybrid model's state ran past the rejected drafts
                rolled_back.append((seq.state_slot, a))
            request.num_draft_tokens += n
            request.num_accepted_tokens += a
            request.num_spec_steps += 1
            self.stats["spec_draft_tokens"] += n
            self.stats["spec_accepted_tokens"] += a
            self.stats["spec_verify_steps"] += 1
        if rolled_back:
            self.runner.keep_accepted_states(*map(list, zip(*rolled_back)))
        return accepted

    def _take_prompt_scores(self, step: "LaunchedStep", scored) -> list[RequestState]:
        """Give each request the scores of its prompt tokens from this step; return those
        that failed doing so."""
        row, failed = 0, []
        for (_, first, count), request in zip(step.batch.prompt_logprobs, step.scoring):
            rows = scored.logprobs[row : row + count]
            row += count
            if self.requests.get(request.seq.request_id) is not request.group[0] or request.seq.is_finished:
                continue  # aborted, or failed, while the step ran
            try:
                self.output_processor.append_prompt_logprobs(request, first, rows)
            except Exception as e:  # e.g. its detokenizer: this request's problem alone
                logger.exception("recording the prompt logprobs of request %s failed", request.seq.request_id)
                for completion in request.group:  # the n - 1 forks of its prompt will never start
                    self._fail(completion, f"recording its prompt logprobs failed: {type(e).__name__}")
                failed.append(request)
        return failed

    def _account(self, step: "LaunchedStep", elapsed: float, finished: list[int]) -> None:
        """The step's share of the stats, and its trace record (with record_trace)."""
        phase = "prefill" if step.num_prefill_tokens else "decode"
        # (A decode step emits a token per sequence, and one per accepted draft.)
        self.stats[f"{phase}_tokens"] += step.num_prefill_tokens or len(step.batch) + step.num_accepted
        self.stats[f"{phase}_seconds"] += elapsed
        if step.trace is not None:
            self.trace.append(StepRecord(
                step=self.num_steps, **step.trace,
                blocks_in_use=self.block_manager.num_blocks - self.block_manager.num_free_blocks,
                num_blocks=self.block_manager.num_blocks, cache_hit_tokens=step.cache_hit_tokens,
                finished=finished, seconds=elapsed, host_seconds=elapsed - step.run_seconds - self._waited,
            ))
        self.num_steps += 1

    def _trace_before(self, batch: ScheduledBatch) -> dict:
        """What the step's trace record needs from the batch before the step changes it
        (only with record_trace: at batch 256 it is a noticeable share of the host's time)."""
        return dict(
            seqs=[(s.seq_id, n, "decode" if is_decode(s, n - batch.drafts(i)) else "prefill")
                  for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))],
            preempted=[s.seq_id for s in batch.preempted],
            kv_tokens_read=sum(s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens)),
            attention_pairs=sum(n * s.num_computed_tokens + n * (n + 1) // 2
                                for s, n in zip(batch.seqs, batch.num_new_tokens)),
        )

    def _state(self, seq: Sequence) -> RequestState:
        return self.requests[seq.request_id].group[seq.index]

    def _fork(self, first: RequestState) -> None:
        """The prompt of ``first`` is computed: its other completions start from its blocks."""
        for request in first.group[1:]:
            self.block_manager.fork(first.seq, request.seq)
            request.seq.status = SequenceStatus.RUNNING
            self.scheduler.running.append(request.seq)
        first.seq.num_forks = 0

    def _accept_grammar_tokens(self, step: "LaunchedStep", sampled) -> dict[int, bool]:
        """Advance the grammars of the step's constrained requests by their sampled tokens,
        all at once (on the matchers' threads at a large batch); {request's index in the
        step: whether its grammar took the token}. Only requests that emit exactly one token
        this step, which is every constrained one (speculation refuses structured outputs)."""
        from minivllm.structured.matcher import accept_tokens

        rows, states, tokens, row = [], [], [], 0
        for j, request in enumerate(step.requests):
            first, row = row, row + len(step.drafts[j]) + 1
            live = self.requests.get(request.seq.request_id) is request.group[0] and not request.seq.is_finished
            if request.grammar is not None and live and not step.drafts[j] and first not in sampled.errors:
                rows.append(j)
                states.append(request.grammar)
                tokens.append(sampled.token_ids[first])
        return dict(zip(rows, accept_tokens(states, tokens))) if rows else {}

    def _append_token(self, request: RequestState, token: int, logprobs, grammar_accepted: bool = False) -> None:
        """Append one token; ``grammar_accepted``: the request's grammar has taken it already."""
        if request.grammar is not None and not grammar_accepted and not request.grammar.accept(token):
            # The mask allowed only what the grammar allows: this is a bug, but one request's.
            self._fail(request, f"structured output: the sampled token {token} is not allowed by the grammar")
            return
        reason = self.output_processor.append_token(request, token, logprobs)
        if reason is not None:
            self._finish(request.seq, reason)

    def _fail(self, request: RequestState, error: str) -> None:
        """End one request with finish_reason "error"; the rest of the batch goes on."""
        request.error = error
        if not request.seq.is_finished:
            self._finish(request.seq, "error")

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End seq: its blocks go back, and what the proposer keeps for it (a draft's cache)."""
        self.scheduler.finish(seq, reason)
        if self.proposer is not None:
            self.proposer.forget(seq)


@dataclass(frozen=True)
class RequestLimits:
    """The fixed sizes a request is checked against. They are known once the KV pool is
    sized and never change, so a server whose engine runs in another process
    (``minivllm.server.engine_core``) keeps a copy and checks each request with this same
    code before sending it."""

    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    hybrid: bool  # a recurrent state slot per sequence (Gated DeltaNet layers)
    speculative: bool = False  # speculative decoding is on (EngineConfig.speculative_config)

    def check_prompt(self, token_ids: list[int]) -> None:
        vocab = self.vocab_size
        if not isinstance(token_ids, (list, tuple)) or not token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        if len(token_ids) >= self.max_model_len:  # first: it is O(1), the check below is not
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; this engine allows at most {self.max_model_len - 1} "
                f"(max_model_len={self.max_model_len}, limited by the model and by a KV pool of "
                f"{self.num_kv_blocks} blocks x {self.block_size} tokens)"
            )
        # The types, then the range: two passes in C (set, min, max) where one Python test
        # per token cost half a millisecond of a 4,096-token prompt's time to first token.
        if not all(issubclass(t, int) for t in set(map(type, token_ids))) or min(token_ids) < 0 \
                or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")

    def check_request(self, token_ids: list[int], params: SamplingParams, outputs: OutputProcessor) -> None:
        """Raise ValueError (InvalidParameter for a sampling field) for a request the engine
        would refuse."""
        self.check_prompt(token_ids)
        vocab = self.vocab_size
        banned = outputs.banned_ids(params)
        if len(banned) == vocab:
            raise InvalidParameter("SamplingParams.stop_token_ids with min_tokens bans every token of the "
                                   "vocabulary: nothing could be sampled", "stop_token_ids")
        if params.n > self.max_num_seqs:
            raise InvalidParameter(f"SamplingParams.n={params.n} is invalid: the n completions run together, so at "
                                   f"most max_num_seqs ({self.max_num_seqs})", "n")
        if params.n > 1 and self.hybrid:
            raise InvalidParameter("SamplingParams.n > 1 is not supported for hybrid models: their completions "
                                   "would have to fork the recurrent state too", "n")
        # Token ids the sampler indexes the logits with must be in the vocabulary.
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidParameter(f"SamplingParams.logit_bias has token id {max(params.logit_bias)}: "
                                   f"must be in [0, {vocab})", "logit_bias")
        if params.allowed_token_ids is not None:
            if max(params.allowed_token_ids) >= vocab:
                raise InvalidParameter(f"SamplingParams.allowed_token_ids has token id "
                                       f"{max(params.allowed_token_ids)}: must be in [0, {vocab})", "allowed_token_ids")
            if not set(params.allowed_token_ids) - set(banned):
                raise InvalidParameter("SamplingParams.allowed_token_ids are all stop or EOS ids banned before "
                                       "min_tokens: nothing could be sampled", "allowed_token_ids")
        if self.speculative:
            for name, unsupported in (("n", params.n > 1), ("prompt_logprobs", params.prompt_logprobs is not None),
                                      ("structured_outputs", params.structured_outputs is not None)):
                if unsupported:
                    raise InvalidParameter(f"SamplingParams.{name} is not supported with speculative_config "
                                           "(speculative decoding) yet", name)
        bad = [t for ids in outputs.bad_word_ids(params) for t in ids if t >= vocab]
        if bad:
            raise InvalidParameter(f"SamplingParams.bad_words tokenize to ids {sorted(set(bad))[:5]} outside the "
                                   f"model's vocabulary [0, {vocab})", "bad_words")


# How long a step with nothing else to do waits for a grammar being compiled, before it returns
# (so that the caller's loop takes in new requests and aborts meanwhile).
GRAMMAR_WAIT_S = 0.05


def truncated(prompt_token_ids, params: SamplingParams):
    """The prompt the engine runs: with truncate_prompt_tokens, its last k ids, as in vLLM."""
    if params.truncate_prompt_tokens is not None and isinstance(prompt_token_ids, (list, tuple)):
        return prompt_token_ids[-params.truncate_prompt_tokens :]
    return prompt_token_ids


@dataclass
class LaunchedStep:
    """A step on the device whose tokens the host has not taken in yet."""

    batch: ScheduledBatch
    requests: list[RequestState]  # those that sample, in the order of the sampled rows
    sampled: SampledTokens | None  # None: nobody samples (every sequence mid-prefill)
    row_of: dict[int, int]  # seq_id -> its row in sampled
    num_prefill_tokens: int
    cache_hit_tokens: int
    run_seconds: float  # the host's time putting it on the device
    trace: dict | None
    # Prompt logprobs: the request of each run in batch.prompt_logprobs, and their scores.
    scoring: list[RequestState] = field(default_factory=list)
    prompt_scores: SampledTokens | None = None
    # Structured output under asynchronous scheduling: (logits, sampling arguments) of a step
    # whose forward pass is on the device and whose sampling waits for its grammars' masks.
    deferred: tuple | None = None
    # Speculative decoding: the drafts each request in ``requests`` verifies (most often
    # none); its sampler rows are len(drafts) + 1 consecutive ones.
    drafts: list[list[int]] = field(default_factory=list)
    num_accepted: int = 0  # of those drafts, how many were accepted (known once processed)


def profiler_range(name: str):
    """A named range of the step in a torch.profiler trace (chapter 17 draws the step's
    timeline from them: launch, with schedule inside it; process, with wait inside it). Only
    while a profiler records: an idle ``record_function`` still costs microseconds, at every
    step."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


def token_history(requests: list[RequestState], previous: tuple[torch.Tensor, dict[int, int]] | None) -> TokenHistory:
    """What each sampled row has seen, for its penalties and bad words (empty lists for a row
    that uses neither). A token the step in flight sampled is not on the host yet: its place
    in that step's tokens, on the device, is passed instead."""
    prompt, output, pending, bad_words = [], [], [], []
    for r in requests:
        seq, params = r.seq, r.seq.sampling_params
        prompt.append(r.prompt_token_ids if params.repetition_penalty != 1 else [])
        output.append(seq.output_token_ids if r.needs_history else [])
        pending.append(previous[1][seq.seq_id] if seq.num_pending and r.needs_history else -1)
        bad_words.append(r.bad_words)
    return TokenHistory(prompt, output, pending, previous[0] if previous is not None else None, bad_words)


def is_decode(seq: Sequence, num_new_tokens: int) -> bool:
    """Does seq compute just the token it sampled last (a decode), not part of a prompt?"""
    total = seq.num_scheduled_tokens
    return num_new_tokens == 1 and seq.num_computed_tokens == total - 1 and total > seq.num_prompt_tokens
