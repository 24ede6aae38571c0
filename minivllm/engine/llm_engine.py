"""The engine: add requests, step, collect outputs.

One ``step()`` is schedule → execute → update:

    schedule  the scheduler picks the batch: which sequences, how many tokens each (chapter 07)
    execute   the model runner computes the batch and samples a token for every sequence that
              reaches its last token (chapters 05, 08, 10)
    update    each token goes back to its request: appended, detokenized, checked against the
              stop conditions; a finished sequence gives its blocks back (chapter 08)

Everything a serving front end needs (streaming, aborts) is built on these calls. Every later
feature joins the step beside it, not inside it (the book's architecture page draws this):

- asynchronous scheduling (chapter 17) is a step variant chosen once, in ``__init__``:
  ``minivllm.engine.overlap``;
- per-request features — n completions, prompt logprobs, structured output, speculative
  decoding — are ``StepFeature`` objects (``minivllm.step_hooks``) called at named points of
  the step; one joins ``self.features`` when the first request asks for it, so a feature
  nobody uses runs none of its code;
- the step's totals and its record for plots are ``minivllm.engine.trace``.

The engine's life around its steps (building its parts, the checks a front end runs before
queueing, shutting down, the statistics) is ``minivllm.engine.engine_base.EngineBase``, the
class it derives from; what a request needs worked out once, when it arrives, is
``minivllm.engine.input_processor``.
"""
import logging
import time

from minivllm.config import EngineConfig, generation_defaults
from minivllm.engine.engine_base import EngineBase
from minivllm.engine.input_processor import InputProcessor
from minivllm.engine.launched_step import LaunchedStep
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.overlap import OverlappedStep
from minivllm.engine.parallel_sampling import ParallelSampling, new_group
from minivllm.engine.prompt_logprobs import PromptLogprobs
from minivllm.engine.request_limits import RequestLimits, truncated
from minivllm.engine.request_state import RequestState
from minivllm.engine.sampler_inputs import sampler_inputs
from minivllm.engine.scheduler import ScheduledBatch, Scheduler
from minivllm.engine.sequence import Sequence
from minivllm.engine.trace import StepTrace, num_prefill_tokens, profiler_range
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.feature import Speculation
from minivllm.spec_decode.proposer import make_proposer
from minivllm.step_hooks import StepFeature, is_live
from minivllm.structured.feature import StructuredOutputs

logger = logging.getLogger(__name__)

# The features beside the step, in the order the step calls their hooks: forks add sampler
# rows before a token mask is made for every row.
FEATURES = (ParallelSampling, PromptLogprobs, StructuredOutputs, Speculation)


class LLMEngine(EngineBase):
    def __init__(self, config: EngineConfig, tokenizer=None):
        self.config = config
        self.tokenizer = tokenizer
        self.speculative = config.speculative  # SpeculativeConfig, or None: no speculation
        # What a request leaves out takes the checkpoint's generation_config.json settings.
        self.default_sampling_fields = generation_defaults(config.model, config.generation_config)
        # A draft model's weights are on the device before the KV pool is sized, and the pool's
        # budget pays for the draft's cache too (one draft block beside each block of the pool).
        proposer = make_proposer(self.speculative, config) if self.speculative is not None else None
        self.runner = self._make_runner(proposer)
        model_config = self.runner.model_config
        self.block_manager = self._make_block_manager()
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = set(model_config.eos_token_id)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.input_processor = InputProcessor(tokenizer, self.eos_token_ids, model_config.vocab_size)
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len)
        self.limits = RequestLimits(model_config.vocab_size, self.max_model_len, self.runner.num_kv_blocks,
                                    config.block_size, config.max_num_seqs, bool(self.runner.num_state_slots),
                                    self.speculative is not None)
        self.requests: dict[str, RequestState] = {}  # request id -> its first completion's state
        self.tracer = StepTrace(config)
        self.is_shut_down = False
        self._make_features(proposer)
        # Asynchronous scheduling (chapter 17): the overlapped step, chosen once, here.
        self.overlap = OverlappedStep(self) if config.async_scheduling else None

    def _use(self, feature: StepFeature) -> None:
        if feature not in self.features:
            self.features = sorted([*self.features, feature], key=lambda f: FEATURES.index(type(f)))

    # -- requests ----------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, prompt: str | None = None, stream: bool = False) -> str:
        """Queue a request. A bad one raises ValueError and leaves the engine untouched.

        A grammar (structured_outputs) not in the compiler's cache is compiled on the
        compiler's threads while the engine steps the other requests; the request is
        scheduled once it is ready, or fails alone (finish_reason "error") if it cannot be
        compiled. ``validate_request`` compiles it on the caller's thread instead, to raise
        InvalidParameter before anything is queued (what ``LLM.generate`` does)."""
        self._check_running()
        params = sampling_params or SamplingParams()
        prompt_token_ids = truncated(prompt_token_ids, params)
        self.limits.check_request(prompt_token_ids, params, self.input_processor)
        group = new_group(prompt_token_ids, params, request_id, self.input_processor, self.runner.device,
                          prompt, stream)
        first = group[0].seq
        if first.request_id in self.requests:
            raise ValueError(f"request_id {first.request_id!r} is already in use")
        for wanted, feature in ((params.n > 1, self.parallel_sampling),
                                (params.prompt_logprobs is not None, self.prompt_logprobs),
                                (params.structured_outputs is not None, self.structured)):
            if wanted:
                self._use(feature)
        ready = params.structured_outputs is None or self.structured.add(group)  # (else: compiling)
        self.requests[first.request_id] = group[0]
        if ready:
            self.scheduler.add(first)
        return first.request_id

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if not any([feature.on_abort(request_id) for feature in self.features]):  # (not held by a feature)
            self.scheduler.abort(request_id)
        for completion in request.group:
            for feature in self.features:
                feature.on_finish(completion.seq)
        return True

    def has_unfinished_requests(self) -> bool:
        # (A step still on the device computes only sequences the scheduler holds, or ones
        # that have ended since: nothing is left unfinished by leaving it there.)
        return self.scheduler.has_unfinished() or any(f.has_unfinished() for f in self.features)

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that finished, and for every
        streaming request that got a token. (Building an output copies the token list:
        doing it for every request at every step would cost O(length^2) per request.)"""
        self._check_running()
        if self.overlap is not None:  # asynchronous scheduling: the overlapped variant
            return self.overlap.step()
        start = time.perf_counter()
        outputs = self.before_schedule()
        with profiler_range("minivllm.launch"):
            batch = self.schedule()
            step = self.execute(batch) if batch is not None else None
        if step is None:
            return outputs
        with profiler_range("minivllm.process"):
            outputs += self.update(step)
        self.account(step, step, start)
        return outputs

    def before_schedule(self) -> list[RequestOutput]:
        return [output for feature in self.features for output in feature.before_schedule()]

    def schedule(self) -> ScheduledBatch | None:
        """The scheduler's batch, or None when there is nothing to run."""
        with profiler_range("minivllm.schedule"):
            batch = self.scheduler.schedule()
        for feature in self.features:
            feature.after_schedule(batch)
        if batch.seqs:
            self.tracer.note_first_scheduled(batch, self.requests)
            return batch
        if self.scheduler.waiting and not self.scheduler.running and self._in_flight() is None:
            # Nothing runs and the head of the queue does not fit: cannot happen for a
            # validated request, so it is a bug worth a loud error.
            raise RuntimeError(f"scheduler is stuck: {self.scheduler.waiting[0]} cannot be admitted")
        return None

    def execute(self, batch: ScheduledBatch, previous: tuple | None = None) -> LaunchedStep:
        """Put the batch on the device: its forward pass and the sampling of each sequence
        that reaches its last token; the tokens stay there for now. ``previous``: the step in
        flight's tokens on the device and their rows (asynchronous scheduling)."""
        rows = [i for i in range(len(batch)) if batch.samples(i)]
        step = LaunchedStep(batch, rows, [self._state(batch.seqs[i]) for i in rows],
                            num_prefill_tokens=num_prefill_tokens(batch), trace=self.tracer.before(batch))
        for feature in self.features:
            feature.prepare(step)
        step.lay_out_rows()
        run_start = time.perf_counter()
        inputs = sampler_inputs(step, self.input_processor, previous)
        if step.mask_later is not None:  # the sampling waits for the mask
            logits, step.prompt_scores = self.runner.forward(batch, step.rows, previous)
            step.deferred = (logits, inputs)
        else:
            step.sampled, step.prompt_scores = self.runner.run(
                batch, step.rows, inputs.params, inputs.generators, inputs.banned, previous, inputs.history,
                bitmask=step.bitmask)
        step.run_seconds = time.perf_counter() - run_start
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        for feature in self.features:
            feature.after_execute(step)
        for request in step.requests:
            request.seq.num_pending += 1  # its token is on the device until this step is taken in
        return step

    def update(self, step: LaunchedStep) -> list[RequestOutput]:
        """Take in a step's tokens: append them, check the stop conditions, build outputs."""
        sampled, scored = self._wait_for(step)
        failures = [f for feature in self.features for f in feature.after_sample(step, sampled, scored)]
        for seq in step.batch.seqs:
            self.block_manager.commit_full_blocks(seq)
        touched, finished = {}, []  # request id -> first completion, for each request this step changed
        for request, error in failures:
            self._fail(request, error)
            touched[request.seq.request_id] = request.group[0]
            finished.append(request.seq.seq_id)
        for request, first, accepted in zip(step.requests, step.first_rows, step.accepted):
            request.seq.num_pending -= 1
            if not is_live(request, self.requests):
                continue  # aborted, failed or finished while this step ran
            self._emit(request, sampled, range(first, first + accepted + 1))
            touched[request.seq.request_id] = request.group[0]
            if request.seq.is_finished:
                finished.append(request.seq.seq_id)
        step.finished = finished
        return self._outputs(touched)

    def _wait_for(self, step: LaunchedStep):
        """The step's tokens and prompt scores on the host (waits for that step only)."""
        start = time.perf_counter()
        with profiler_range("minivllm.wait"):
            sampled = step.sampled.to_host() if step.sampled is not None else None
            scored = step.prompt_scores.to_host() if step.prompt_scores is not None else None
        step.wait_seconds = time.perf_counter() - start
        return sampled, scored

    def _emit(self, request: RequestState, sampled, rows: range) -> None:
        """Append the request's tokens of this step (its token; or its accepted drafts and the
        token after them), in order, each through every stop condition."""
        failed = next((r for r in rows if r in sampled.errors), None)
        if failed is not None:
            return self._fail(request, sampled.errors[failed])
        try:
            for r in rows:
                reason = self.output_processor.append_token(request, sampled.token_ids[r], sampled.logprobs[r])
                if reason is not None:
                    return self._finish(request.seq, reason)
        except Exception as e:  # e.g. its detokenizer: this request's problem alone
            logger.exception("processing the output of request %s failed", request.seq.request_id)
            self._fail(request, f"processing its output failed: {type(e).__name__}")

    def _outputs(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        """An output for each changed request that finished (it leaves the engine) or streams."""
        outputs = []
        for request_id, first in touched.items():
            done = all(r.seq.is_finished for r in first.group)
            if done:
                del self.requests[request_id]
            if done or first.stream:
                outputs.append(self.output_processor.make_output(first))
        return outputs

    def account(self, launched: LaunchedStep, processed: LaunchedStep | None, start: float) -> None:
        """The step's share of the stats, and its trace record (with record_trace)."""
        elapsed = time.perf_counter() - start
        waited = processed.wait_seconds if processed is not None else 0.0
        finished = processed.finished if processed is not None else []
        self.tracer.account(launched, elapsed, finished, elapsed - launched.run_seconds - waited,
                            self.block_manager)

    def _fail(self, request: RequestState, error: str) -> None:
        """End one request with finish_reason "error"; the rest of the batch goes on."""
        request.error = error
        if not request.seq.is_finished:
            self._finish(request.seq, "error")

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End seq: its blocks go back, and what the features keep for it (a draft's cache)."""
        self.scheduler.finish(seq, reason)
        for feature in self.features:
            feature.on_finish(seq)

    def _state(self, seq: Sequence) -> RequestState:
        return self.requests[seq.request_id].group[seq.index]

    def _in_flight(self) -> LaunchedStep | None:
        """The step on the device whose tokens are not taken in yet (asynchronous scheduling)."""
        return self.overlap.in_flight if self.overlap is not None else None

    def _is_idle(self) -> bool:
        """Nothing is scheduled and nothing is on the device."""
        return not self.scheduler.has_unfinished() and self._in_flight() is None

