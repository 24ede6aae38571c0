"""The model runner: owns the model and the KV pool, and runs one step of the engine.

    prepare  the scheduled batch flattened into one host array (engine.step_inputs)
    upload   one copy to the device; the step's Context set
    execute  the forward pass: eagerly, or by replaying a captured CUDA graph that the
             dispatcher picks from the step's shape (engine.cuda_graphs)
    sample   the next tokens (layers.sampler)

Its start-up (sizing and allocating the KV pool, capturing the graphs, compiling the eager
steps' kernels, warming the matmuls) and its shutdown are ``engine.runner_startup.RunnerStartup``,
the class it derives from; prompt-logprob scoring is ``engine.prompt_logprobs``.
"""
import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.context import get_context, reset_context, set_context
from minivllm.distributed.parallel_state import get_tp_world_size
from minivllm.engine.cuda_graphs import BatchDescriptor, CudaGraphDispatcher, CudaGraphs
from minivllm.engine.prompt_logprobs import as_sampled_tokens, score_prompt_rows
from minivllm.engine.runner_startup import RunnerStartup
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.state_pool import keep_accepted_states, state_metadata
from minivllm.engine.step_inputs import StepInputs, pack_batch, pad_rows
from minivllm.layers.attention import attention_layers
from minivllm.layers.gated_deltanet import state_layers
from minivllm.layers.sampled_tokens import SampledTokens
from minivllm.layers.sampler import Sampler


class ModelRunner(RunnerStartup):
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
        self.model = self._load_weights()
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
            # BEGIN SOLUTION ch17 pending_inputs
            f["input_ids"][f["pending_dst"]] = previous_tokens[f["pending_src"]]
            # END SOLUTION
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

    # Start-up runs its compiling steps on every rank, each rank alone, through this name: a
    # tensor-parallel rank 0 overrides ``upload`` (to send each step to the workers), not it.
    upload_on_this_rank = upload

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
        return logits, as_sampled_tokens(scores) if scores is not None else None

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
            prompt_scores = score_prompt_rows(self.model, hidden, ctx) if ctx.prompt_logits_indices is not None else None
            if ctx.logits_indices is not None and len(ctx.logits_indices) == 0:
                return None, prompt_scores  # no sequence samples this step (all mid-prefill)
            return self.model.compute_logits(hidden), prompt_scores
        finally:
            reset_context()

    def keep_accepted_states(self, slots: list[int], accepted: list[int]) -> None:
        """Hybrid models under speculative decoding: the sequences in ``slots`` rejected a
        draft, each after ``accepted`` accepted ones; their states go back to match
        (minivllm.engine.state_pool)."""
        index = self._to_device(np.array([slots, accepted], dtype=np.int64))
        keep_accepted_states(self.state_layers, index[0], index[1])
