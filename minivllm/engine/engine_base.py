"""``LLMEngine``'s life around its steps, as methods of the class it derives from: building
its runner, block manager and features from a config (``from_engine_args`` is the one factory
that ``LLM``, the server and its engine-core process all use), the checks a front end runs
before it queues a request, shutting down, and what the steps have done. ``engine.llm_engine`` holds
the requests and the step."""
from typing import Self

import torch

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.engine_args import create_engine_config
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.parallel_sampling import ParallelSampling
from minivllm.engine.prompt_logprobs import PromptLogprobs
from minivllm.engine.state_pool import HybridCacheManager
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.feature import Speculation
from minivllm.step_hooks import StepFeature, weakly
from minivllm.structured.feature import StructuredOutputs
from minivllm.tokenizer import load_tokenizer


class EngineBase:
    """Everything of ``LLMEngine`` but its requests and its step (see the module's docstring).
    Its methods read what ``LLMEngine.__init__`` declares: ``config``, ``runner``, ``limits``,
    ``input_processor``, ``structured``, ``speculation``, ``tracer``."""

    def _make_runner(self, proposer):
        if self.config.tensor_parallel_size > 1:
            # One process per rank; this one is rank 0 and drives the others (chapter 16).
            from minivllm.engine.tp_worker import TensorParallelRunner

            return TensorParallelRunner(self.config)
        return ModelRunner(self.config, proposer.block_bytes if proposer is not None else 0)

    def _make_block_manager(self):
        if self.runner.num_state_slots:
            # Hybrid model: a state slot per sequence besides its blocks; no prefix caching
            # (see minivllm.engine.state_pool for why).
            return HybridCacheManager(self.runner.num_kv_blocks, self.config.block_size, self.runner.num_state_slots)
        return BlockManager(self.runner.num_kv_blocks, self.config.block_size, self.config.enable_prefix_caching)

    def _make_features(self, proposer) -> None:
        """The features beside the step, in the order the step calls them; each joins
        ``self.features`` when the first request asks for it (speculation: at start-up)."""
        self.parallel_sampling = ParallelSampling(self.scheduler, self.block_manager)
        # The features get the engine's methods held weakly: a bound method holds its
        # engine, and the cycle would keep an engine that was let go until a full collection.
        state = weakly(self._state)
        self.prompt_logprobs = PromptLogprobs(self.requests, state, self.tokenizer)
        self.structured = StructuredOutputs(
            self.tokenizer, self.runner.model_config.vocab_size, self.eos_token_ids,
            self.runner.device.type == "cuda", self.scheduler, self.requests, self.output_processor.make_output,
            weakly(self._is_idle))
        self.speculation = None
        if proposer is not None:
            proposer.allocate(self.runner.num_kv_blocks, self.runner)
            self.speculation = Speculation(proposer, self.speculative.num_speculative_tokens, self.max_model_len,
                                           self.scheduler, self.block_manager, self.runner, state,
                                           self.tracer.stats)
        self.features: list[StepFeature] = []
        if self.speculation is not None:
            self._use(self.speculation)

    @classmethod
    def from_engine_args(cls, model=None, dtype="auto", device=None, **engine_args) -> Self:
        """Build an engine from what a user writes: ``LLM(...)``, the server and its
        engine-core process all call this (minivllm.engine.engine_args checks the arguments)."""
        config = create_engine_config(model, dtype, device, **engine_args)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        return cls(config, load_tokenizer(config.model))

    def validate_prompt(self, token_ids: list[int]) -> None:
        self.limits.check_prompt(token_ids)

    def validate_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (InvalidParameter for a sampling field) for a request this engine
        would refuse. Reads only fixed sizes, so it is safe beside a running step."""
        self.limits.check_request(token_ids, params, self.input_processor)
        self.validate_structured(params)

    def validate_structured(self, params: SamplingParams) -> None:
        """Compile the request's grammar, if it has one, so that a bad schema or grammar is the
        caller's error before the request is queued (the compiled grammar is cached for
        add_request). InvalidParameter names what is wrong."""
        if params.structured_outputs is not None:
            self.grammar_compiler().compile(params.structured_outputs)

    def grammar_compiler(self):
        """The engine's grammar compiler (chapter 18), made when the first request needs it."""
        return self.structured.compiler()

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar to be compiled (not yet in the scheduler's queue)."""
        return len(self.structured.compiling)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any, and give back the device memory
        (weights, KV pool, CUDA graphs). Unfinished requests are dropped; the engine refuses
        new work after."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        for request_id in list(self.requests):
            self.abort_request(request_id)
        for feature in (self.structured, self.speculation):  # (built at start-up, used or not)
            if feature is not None:
                feature.shutdown()
        self.runner.shutdown()

    def _check_running(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("this engine has been shut down: build a new LLM to generate again")

    # -- what the steps have done ----------------------------------------------------------

    @property
    def stats(self) -> dict:
        return self.tracer.stats

    @property
    def trace(self) -> list:
        return self.tracer.records

    @property
    def num_steps(self) -> int:
        return self.tracer.num_steps

    @property
    def proposer(self):
        """Speculative decoding's proposer (chapter 19), or None."""
        return self.speculation.proposer if self.speculation is not None else None

    @proposer.setter
    def proposer(self, proposer) -> None:
        self.speculation.proposer = proposer
