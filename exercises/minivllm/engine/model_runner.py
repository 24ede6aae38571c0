# Exercise copy of minivllm/engine/model_runner.py, generated from it by scripts/make_exercises.py.
# Fill in: ModelRunner.upload (ch17).
# Grade: make grade CH=17
# Running the generator again overwrites this file: commit or copy your work first.

"""The model runner: owns the model and the KV pool, and runs one step of the engine.

    prepare  the scheduled batch flattened into one host array (engine.step_inputs)
    upload   one copy to the device; the step's Context set
    execute  the forward pass: eagerly, or by replaying a captured CUDA graph that the
             dispatcher picks from the step's shape (engine.cuda_graphs)
    sample   the next tokens (layers.sampler)

Its start-up (sizing and allocating the KV pool, capturing the graphs, compiling the eager
steps' kernels, warming the matmuls) is in ``engine.runner_startup``.
"""
import gc
import logging

import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.context import get_context, reset_context, set_context
from minivllm.distributed.parallel_state import get_tp_world_size, min_over_ranks
from minivllm.engine.cuda_graphs import DECODE, BatchDescriptor, CudaGraphDispatcher, CudaGraphs
from minivllm.engine.runner_startup import (allocate_kv_cache, blocks_that_fit_on_gpu, compile_steps, kv_block_bytes,
                                            timed_phase, warm_matmuls)
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.state_pool import (allocate_state_pools, check_state_pools_fit, keep_accepted_states,
                                        state_metadata, state_slot_bytes)
from minivllm.engine.step_inputs import PinnedStaging, StepInputs, pack_batch, pad_rows
from minivllm.layers.attention import attention_layers
from minivllm.layers.gated_deltanet import state_layers
from minivllm.layers.sampler import SampledTokens, Sampler
from minivllm.loader import load_model
from minivllm.ops.attention import is_fp8
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Prompt logprobs score many rows at once (a whole prompt chunk): their logits are computed
# in slices of at most this many elements (rows x vocabulary, 64 MiB in float32), so the
# memory they take does not grow with the chunk. A slice fits in the share of the card that
# gpu_memory_utilization leaves unassigned; the warm-up does not measure it.
PROMPT_LOGITS_ELEMENTS = 2**24


class ModelRunner:
    def __init__(self, config: EngineConfig, draft_block_bytes: int = 0):
        if get_tp_world_size() != config.tensor_parallel_size:
            raise RuntimeError(f"this process belongs to a tensor-parallel group of {get_tp_world_size()}, but the "
                               f"engine asks for tensor_parallel_size={config.tensor_parallel_size}: shut the other "
                               "engine down first")
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        # Speculative decoding with a draft model (chapter 19): the draft keeps a block of its
        # own beside each block of the pool, allocated by its proposer; the budget pays for both.
        self.draft_block_bytes = draft_block_bytes
        # Where construction's time goes, in seconds by phase (``minivllm bench throughput``
        # reports it): the weights, the KV pool, the CUDA graphs, compiling the kernels.
        self.startup_seconds: dict[str, float] = {}
        with self._startup_phase("load_weights"):
            self.model = load_model(config.model, dtype=config.dtype, device=self.device,
                                    quantization=config.quantization)
        self.model_config = self.model.config
        self.sampler = Sampler()
        self.layers = attention_layers(self.model)
        # Hybrid models: a state slot per running sequence in every linear-attention layer,
        # allocated before the KV pool so that the pool is sized from what is left.
        self.state_layers = state_layers(self.model)
        self.num_state_slots = config.max_num_seqs if self.state_layers else 0
        self.state_slot_bytes = self._allocate_state_pools()
        self.memory_budget: dict[str, float] = {}  # on a GPU: what the pool's size came from
        self.kv_cache: torch.Tensor | None = None  # [2, layers, blocks, block_size, kv_heads, head_dim]
        with self._startup_phase("kv_cache"):
            self.num_kv_blocks = self._allocate_kv_cache()
        self.max_model_len = self._max_model_len()
        # Asynchronous scheduling's uploads go through pinned buffers made now, not pinned
        # memory taken per step (see _to_device).
        self.staging = self._pinned_staging()
        # Speculative decoding with an MTP head (chapter 19): it reads the hidden states of
        # every position the last step computed, and which sequences' positions they are.
        self.keep_hidden_states = False
        self.last_step: tuple[list, list[int], list[int]] | None = None  # (seqs, first positions, counts)
        self.last_hidden: torch.Tensor | None = None  # [tokens, hidden_size]
        self.cudagraphs = CudaGraphs(CudaGraphDispatcher())  # none: every step runs eagerly
        if self.device.type == "cuda":
            self._prepare_gpu()
        self._arm_kv_scales()

    def _pinned_staging(self) -> PinnedStaging | None:
        if not (self.config.async_scheduling and self.device.type == "cuda"):
            return None
        width = -(-self.max_model_len // self.block_size)
        return PinnedStaging.for_steps(self.config.max_num_batched_tokens, self.config.max_num_seqs, width)

    def _prepare_gpu(self) -> None:
        """Capture the CUDA graphs (unless enforce_eager), compile the eager steps' kernels and
        warm the matmuls, so that a user's first steps run at speed."""
        if not self.config.enforce_eager:
            self.capture_cudagraphs()
        with self._startup_phase("compile_kernels"):
            self.compile_kernels()
        with self._startup_phase("warm_matmuls"):
            self.warm_matmuls()

    def _arm_kv_scales(self) -> None:
        """calculate_kv_scales on an fp8 cache: every attention layer sets its scales from the
        first real step's keys and values. Armed here, after the start-up's passes (the
        warm-up, the graph captures, the compiling steps), whose dummy tokens would set them
        otherwise; that first step runs eagerly (``_execute_first_step_eagerly``)."""
        if not (self.config.calculate_kv_scales and is_fp8(self.config.cache_dtype)):
            return
        for layer in self.layers:
            layer.calculate_kv_scales_on_next_store()
        self.execute = self._execute_first_step_eagerly

    def _execute_first_step_eagerly(self, input_ids: torch.Tensor,
                                    positions: torch.Tensor) -> tuple[torch.Tensor | None, tuple | None]:
        """``execute`` for the first step after ``_arm_kv_scales``, without CUDA graphs: a
        replay runs no Python, so the layers' hooks would not see its keys. It then hands
        ``execute`` back to the class's method: later steps check nothing."""
        del self.execute
        graphs, self.cudagraphs = self.cudagraphs, CudaGraphs(CudaGraphDispatcher())
        try:
            return self.execute(input_ids, positions)
        finally:
            self.cudagraphs = graphs

    def _startup_phase(self, name: str):
        return timed_phase(self.startup_seconds, name, self.device)

    # -- start-up: the state pools, the KV pool, the graphs, the kernels ------------------

    def _allocate_state_pools(self) -> int:
        """Every linear-attention layer's state pools; the bytes one slot takes in all of them."""
        # Speculative decoding keeps k more states per slot, to roll a rejection back to.
        spec = self.config.speculative
        num_spec_states = spec.num_speculative_tokens if spec is not None else 0
        if self.state_layers and self.device.type == "cuda":
            check_state_pools_fit(state_slot_bytes(self.state_layers, self.config.dtype, num_spec_states),
                                  self.num_state_slots, torch.cuda.mem_get_info(self.device)[0], num_spec_states)
        return allocate_state_pools(self.state_layers, self.num_state_slots, self.config.dtype, self.device,
                                    num_spec_states)

    @property
    def block_bytes(self) -> int:
        return kv_block_bytes(self.layers, self.block_size, self.config.cache_dtype)

    def _allocate_kv_cache(self) -> int:
        config, per_block = self.config, self.block_bytes + self.draft_block_bytes
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif self.device.type == "cuda":
            num_blocks = blocks_that_fit_on_gpu(self.model, config, self.device, per_block, self.memory_budget)
        else:
            num_blocks = int(config.cpu_kv_cache_space * 2**30) // per_block
        num_blocks = min_over_ranks(num_blocks)  # tensor parallelism: every rank's pool the same size
        if num_blocks < 1:
            gib = {k: round(v / 2**30, 2) if k != "gpu_memory_utilization" else v
                   for k, v in self.memory_budget.items()}
            raise RuntimeError(
                f"no memory left for the KV cache (one block needs {per_block} bytes; GiB: {gib}); "
                "raise gpu_memory_utilization or cpu_kv_cache_space, or set num_kv_blocks"
            )
        self.kv_cache = allocate_kv_cache(self.layers, num_blocks, self.block_size, config.cache_dtype, self.device)
        return num_blocks

    def _max_model_len(self) -> int:
        """A sequence can never grow past the model's positions (asking for more is an
        error), nor past the whole pool (a small pool shortens it, and says so)."""
        self.config.check_max_model_len(self.model_config)
        limit = self.config.max_model_len or self.model_config.max_position_embeddings
        max_model_len = min(limit, self.num_kv_blocks * self.block_size)
        # A warning only when the caller asked for that length; the model's own limit being
        # cut by a small pool (a CPU, a test) is the usual case, not news.
        if max_model_len < limit and self.config.max_model_len is not None:
            logger.warning("max_model_len is %d, not %d: the KV pool holds only %d blocks of %d tokens (raise "
                           "gpu_memory_utilization, cpu_kv_cache_space or num_kv_blocks for more)",
                           max_model_len, limit, self.num_kv_blocks, self.block_size)
        return max_model_len

    def capture_cudagraphs(self) -> None:
        """Capture the CUDA graphs this engine replays (minivllm.engine.cuda_graphs): the
        decode graphs, and on one device the prefill and verify graphs."""
        spec = self.config.speculative
        dispatcher = CudaGraphDispatcher.plan(
            self.config.max_num_seqs, self.config.max_num_batched_tokens, self.max_model_len,
            spec.num_speculative_tokens if spec is not None else None, hybrid=bool(self.state_layers),
            tensor_parallel=get_tp_world_size() > 1)
        self.cudagraphs = CudaGraphs(dispatcher, hybrid=bool(self.state_layers))
        max_blocks = (self.max_model_len + self.block_size - 1) // self.block_size
        self.cudagraphs.capture(self.model, max_blocks, self.max_model_len, self.model_config.hidden_size,
                                self.config.dtype, self.device, self._startup_phase)

    @property
    def graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        """The decode graphs, by batch size (empty: decode steps run eagerly)."""
        return self.cudagraphs.of_kind(DECODE)

    @property
    def graph_sizes(self) -> list[int]:
        """The decode batch sizes that have a graph, ascending."""
        return self.cudagraphs.dispatcher.sizes.get(DECODE, [])

    @torch.inference_mode()
    def compile_kernels(self) -> None:
        """Run each kind of eager step once (``runner_startup.compile_steps``), so that Triton
        compiles its kernels here and not inside the user's first run, then the sampler's.
        The kernels do not specialise on what varies from step to step (``do_not_specialize``,
        aligned fields), so these steps reach every variant a run can. They write into the
        first KV blocks and state slots, which hold nothing yet."""
        limit = min(self.config.max_num_batched_tokens, self.max_model_len)
        logits = None
        for step in compile_steps(self.block_size, limit, self.max_model_len, self.config.max_num_seqs,
                                  self.num_kv_blocks, decode_graphs=bool(self.graphs)):
            # ModelRunner's own upload, not a tensor-parallel rank 0's (which would also send
            # the step to the workers): every rank runs these same steps in its own start-up.
            input_ids, positions = ModelRunner.upload(self, step)
            if self.state_layers:  # slots 0.., starting from zeros
                self._set_state_slots(np.array([range(step.num_seqs), [0] * step.num_seqs], dtype=np.int64))
            logits, _ = self.execute(input_ids, positions)
        if logits is not None:  # the sampler's kernels too: greedy rows and tempered ones
            rows = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)] * logits.shape[0]
            self.sampler.launch(logits, rows[: logits.shape[0]], [None] * logits.shape[0], None).to_host()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warm_matmuls(self) -> None:
        """Run every matmul at the row counts a run can give it (``runner_startup.warm_matmuls``)."""
        warm_matmuls(self.model, self.config, self.device)

    # -- one step ----------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch, rows_to_sample: list[int] | None = None,
                previous: tuple[torch.Tensor, dict[int, int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Flatten the batch into input ids and positions, and set the step's Context: its
        attention metadata and which rows get logits (the last token of each sequence in
        ``rows_to_sample``; None: every sequence). With asynchronous scheduling a sequence's
        newest token may still be on the device: ``previous`` is the last step's sampled
        tokens and the row of each sequence in them, and the input is filled from there."""
        if self.keep_hidden_states:
            self.last_step = (list(batch.seqs), [seq.num_computed_tokens for seq in batch.seqs],
                              list(batch.num_new_tokens))
        step = pack_batch(batch, rows_to_sample, previous[1] if previous is not None else None, self.block_size)
        input_ids, positions = self.upload(step, previous[0] if step.num_pending else None)
        if self.state_layers:  # hybrid models (one device only): each row's state slot
            self._set_state_slots(state_metadata(batch.seqs, batch.num_drafts))
        return input_ids, positions

    def upload(self, step: StepInputs, previous_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy a flattened step to the device and set its Context; return input ids and
        positions (the pending ones filled from ``previous_tokens``, on the device)."""
        f = step.fields(self._to_device(step.host))
        if step.num_pending:
            raise NotImplementedError(
                "ch17: pending inputs: under asynchronous scheduling this step was prepared before "
                "the previous step's tokens reached the host; they are still on the device, in "
                "previous_tokens, one per sampled row of that step. The input rows listed in f's "
                "pending_dst are such tokens, each to be taken from the row of previous_tokens "
                "that pending_src lists beside it: fill them all at once, on the device, with one "
                "indexed copy. Pitfall: bringing the tokens to the host (item, tolist, cpu) waits "
                "for the previous step and undoes the overlap, see "
                "notebooks/17_async_scheduling.ipynb"
            )
        if step.num_copies:  # before this step writes into the copies: [2, layers, blocks, ...]
            self.kv_cache[:, :, f["copy_dst"]] = self.kv_cache[:, :, f["copy_src"]]
        set_context(
            is_prefill=step.is_prefill,
            cu_seqlens_q=f["cu_seqlens_q"],
            slot_mapping=f["slot_mapping"],
            context_lens=f["context_lens"],
            block_tables=f["block_tables"],
            max_seqlen_q=step.max_seqlen_q,
            max_context_len=step.max_context_len,
            # Every sequence's last token is what the LM head takes by default: no gather.
            logits_indices=None if step.logits_of_every_sequence else f["logits_indices"],
            prompt_logits_indices=f["prompt_rows"] if step.num_prompt_logits else None,
            prompt_targets=f["prompt_targets"] if step.num_prompt_logits else None,
            prompt_top_k=step.prompt_top_k,
            from_scratch=step.from_scratch,
        )
        return f["input_ids"], f["positions"]

    def _set_state_slots(self, metadata: np.ndarray) -> None:
        """The Context's state slots and has_initial_state (and, in a verifying step, the
        spec state counts), from state_metadata's rows, each row aligned (pad_rows)."""
        rows = self._to_device(pad_rows(metadata))[:, : metadata.shape[1]]
        ctx = get_context()
        ctx.state_slots, ctx.has_initial_state = rows[0], rows[1]
        if metadata.shape[0] > 2:
            ctx.spec_state_counts = rows[2]

    def _to_device(self, host: np.ndarray) -> torch.Tensor:
        """One host-to-device copy for all of the step's metadata. With asynchronous
        scheduling it goes through pinned memory without blocking: a blocking copy would
        wait for the step still running, and the host could not work ahead. (Without it, the
        step waits for its sampled tokens anyway, and the plain copy measured about 5%
        faster on the H200 throughput workload.)"""
        tensor = torch.from_numpy(host)
        if self.config.async_scheduling and self.device.type == "cuda":
            # Pinned memory taken per step would sometimes have to be allocated (cudaHostAlloc,
            # 1.3 ms once in one profiled run on an H200 host, inside the user's run).
            staged = self.staging.upload(tensor, self.device) if self.staging is not None else None
            return staged if staged is not None else tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, rows_to_sample: list[int], params, generators, banned,
            previous: tuple[torch.Tensor, dict[int, int]] | None = None, history=None,
            bitmask: torch.Tensor | None = None) -> tuple[SampledTokens | None, SampledTokens | None]:
        """Compute the batch; sample a token for each sequence in ``rows_to_sample``, and
        score the prompt rows ``batch.prompt_logprobs`` names. Both come back on the device,
        their copies to the host on their way (None where there is nothing to sample, or no
        prompt to score)."""
        logits, prompt_scores = self.forward(batch, rows_to_sample, previous)
        if logits is None:
            return None, prompt_scores
        return self.sample(logits, params, generators, banned, history, bitmask), prompt_scores

    def forward(self, batch: ScheduledBatch, rows_to_sample: list[int],
                previous: tuple[torch.Tensor, dict[int, int]] | None = None
                ) -> tuple[torch.Tensor | None, SampledTokens | None]:
        """The first half of ``run``: the logits of the rows to sample (None: no row samples)
        and the prompt rows' scores. The engine samples later when a grammar's mask waits
        for the step in flight."""
        logits, scores = self.execute(*self.prepare(batch, rows_to_sample, previous))
        # In the sampler's shape, as if each scored prompt token had been sampled there.
        prompt_scores = None
        if scores is not None:
            targets, chosen, rank, top_ids, top_values = scores
            prompt_scores = SampledTokens(targets, (chosen, rank, top_ids, top_values),
                                          [top_ids.shape[1]] * targets.shape[0])
        return logits, prompt_scores

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params, generators, banned, history=None,
               bitmask: torch.Tensor | None = None) -> SampledTokens:
        """The second half of ``run``."""
        return self.sampler.launch(logits, params, generators, banned, history, bitmask)

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor | None, tuple | None]:
        """Run the model on an uploaded step (its Context set): in the CUDA graph the
        dispatcher picks for the step's shape, or eagerly where none fits. Return the logits
        of the rows the Context names (None when it names none) and the scores of its prompt
        rows (None when it has none). Under tensor parallelism every rank runs this on the
        same step, so every rank makes the same choices (the LM head's all-gather is a
        collective)."""
        try:
            ctx = get_context()
            key = self.cudagraphs.dispatcher.dispatch(BatchDescriptor.of(ctx, input_ids.shape[0]))
            if key is None:
                hidden = self.model(input_ids, positions)
            else:
                hidden = self.cudagraphs.replay(key, input_ids, positions)
            if self.keep_hidden_states:
                self.last_hidden = hidden
            prompt_scores = self._score_prompt_rows(hidden, ctx) if ctx.prompt_logits_indices is not None else None
            if ctx.logits_indices is not None and len(ctx.logits_indices) == 0:
                return None, prompt_scores  # no sequence samples this step (all mid-prefill)
            return self.model.compute_logits(hidden), prompt_scores
        finally:
            reset_context()

    def _score_prompt_rows(self, hidden: torch.Tensor, ctx) -> tuple[torch.Tensor, ...]:
        """For each prompt row: the prompt token after it, that token's log-probability, its
        rank (1 = most likely) and the ``ctx.prompt_top_k`` most likely tokens with theirs,
        as the sampler reports a sampled token's (from the model's raw logits). Computed a
        slice of rows at a time (PROMPT_LOGITS_ELEMENTS), so that a long chunk never holds
        all its logits at once."""
        rows, targets, k = ctx.prompt_logits_indices, ctx.prompt_targets, ctx.prompt_top_k
        per_slice = max(1, PROMPT_LOGITS_ELEMENTS // self.model_config.vocab_size)
        parts = []
        for start in range(0, rows.shape[0], per_slice):
            logits = self.model.compute_logits(hidden[rows[start : start + per_slice]], all_tokens=True)
            logprobs = logits.float().log_softmax(dim=-1)
            chosen = logprobs.gather(-1, targets[start : start + per_slice].unsqueeze(-1))
            rank = (logprobs > chosen).sum(dim=-1) + 1
            top = logprobs.topk(k, dim=-1)
            parts.append((chosen.squeeze(-1), rank, top.indices, top.values))
        return (targets, *(torch.cat(p) for p in zip(*parts)))

    def keep_accepted_states(self, slots: list[int], accepted: list[int]) -> None:
        """Hybrid models under speculative decoding: the sequences in ``slots`` rejected a
        draft, each after ``accepted`` accepted ones; their states go back to match
        (minivllm.engine.state_pool)."""
        index = self._to_device(np.array([slots, accepted], dtype=np.int64))
        keep_accepted_states(self.state_layers, index[0], index[1])

    def shutdown(self) -> None:
        """Give the device memory back: the CUDA graphs (their pool holds the captured
        activations), the KV pool, the state pools and the weights. The runner is unusable
        after. (Parameters keep bound weight loaders, a reference cycle, so only the cycle
        collector frees the model.)"""
        self.cudagraphs.clear()
        self.kv_cache = self.model = self.layers = self.state_layers = None
        self.last_step = self.last_hidden = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
