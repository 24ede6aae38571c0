# Reference copy of minivllm/engine/model_runner.py, generated from it by scripts/make_exercises.py.
# Reference answers for: ModelRunner.prepare (ch05), ModelRunner.upload (ch17), graph_batch_sizes (ch10), padded_batch_size (ch10).
# Do not edit: change minivllm/engine/model_runner.py and run scripts/make_exercises.py again.

"""The model runner: owns the model and the KV pool, turns a scheduled batch into tensors,
runs the forward pass and samples.

On a GPU, decode steps replay CUDA graphs captured once per batch size (the batch is
padded up to the next captured size), which removes the CPU cost of launching a few
hundred small kernels per step. A step that computes one sequence's prompt (or a chunk of
it) replays a prefill graph padded to the next captured token count: for a short prompt
the launches cost far more than the GPU work (a 128-token prompt of Qwen3-0.6B: about 30
ms of host time for 1.4 ms of kernels on the H200). Under speculative decoding, a verifying
step (each sequence its last token and at most k drafts) replays a verify graph captured per
decode batch size, for hybrid models too. Other prefill steps, with several sequences or
more tokens, run eagerly, as every prefill step of a hybrid model does.

The KV pool is one tensor, allocated once: [2 (k, v), num_layers, num_blocks, block_size,
num_kv_heads, head_dim]. Each attention layer gets a view of its slice. On a GPU the number
of blocks is whatever fits in ``gpu_memory_utilization`` of the card after a warm-up
forward pass has shown the activations' peak; on the CPU it comes from a configured size.
"""
import gc
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.context import get_context, reset_context, set_context
from minivllm.cuda_graphs import PaddedGraphs
from minivllm.distributed.parallel_state import get_tp_world_size, min_over_ranks
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.state_pool import (allocate_state_pools, check_state_pools_fit, keep_accepted_states,
                                        state_layers, state_metadata, state_slot_bytes)
from minivllm.kernels.common import SHORT_STEP_TOKENS
from minivllm.layers.attention import attention_layers
from minivllm.layers.sampler import SampledTokens, Sampler
from minivllm.loader import load_model
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """One step's inputs, still on the host: one flat int64 array that ``prepare`` fills and
    ``upload`` copies to the device in one go, and the sizes that say how it is cut into
    fields (``fields``). All that running the model on the step needs, and small: it is what
    rank 0 sends the other ranks under tensor parallelism (chapter 16)."""

    host: np.ndarray
    num_tokens: int
    num_seqs: int
    block_table_width: int  # columns of the block table: the most blocks any sequence holds
    num_logits: int  # rows that get next-token logits (sequences that sample a token)
    is_prefill: bool
    max_seqlen_q: int
    max_context_len: int
    # Asynchronous scheduling: input tokens the previous step sampled, still on the device.
    # Input row pending_dst[i] is row pending_src[i] of that step's sampled tokens.
    num_pending: int = 0
    # Copy on write (SamplingParams.n): KV blocks copy_src[i] -> copy_dst[i], before the step.
    num_copies: int = 0
    # Do the logits rows name every sequence's last token, in order? (Then no gather.)
    logits_of_every_sequence: bool = False
    # Prompt logprobs: rows that score the prompt token after them (prompt_rows), those
    # tokens (prompt_targets), and how many alternatives each reports.
    num_prompt_logits: int = 0
    prompt_top_k: int = 0
    # Every sequence starts at position 0 (Context.from_scratch).
    from_scratch: bool = False

    @staticmethod
    def sizes(num_tokens: int, num_seqs: int, block_table_width: int, num_logits: int,
              num_pending: int = 0, num_copies: int = 0, num_prompt_logits: int = 0) -> dict[str, int]:
        """The fields of the flat array, in order, and their lengths."""
        return {"input_ids": num_tokens, "positions": num_tokens, "slot_mapping": num_tokens,
                "context_lens": num_seqs, "cu_seqlens_q": num_seqs + 1, "logits_indices": num_logits,
                "block_tables": num_seqs * block_table_width, "pending_dst": num_pending, "pending_src": num_pending,
                "copy_src": num_copies, "copy_dst": num_copies, "prompt_rows": num_prompt_logits,
                "prompt_targets": num_prompt_logits}

    @staticmethod
    def offsets(sizes: dict[str, int]) -> tuple[dict[str, int], int]:
        """Where each field starts in the flat array, and the array's length. Every field
        starts on a FIELD_ALIGN boundary: Triton compiles a kernel again for a pointer whose
        16-byte alignment changed, so a field whose offset moved with the step's sizes would
        cost a compile in the middle of a run."""
        starts, end = {}, 0
        for name, n in sizes.items():
            starts[name] = end
            end += -(-n // FIELD_ALIGN) * FIELD_ALIGN
        return starts, end

    @classmethod
    def pack(cls, fields: dict[str, list[int]], block_tables: list[list[int]], is_prefill: bool, max_seqlen_q: int,
             **extra) -> "StepInputs":
        """A step from its fields as lists (the fields of ``sizes`` but block_tables, which
        is a row per sequence, padded with -1 to the widest; the pending, copy and prompt
        fields may be left out when empty)."""
        num_seqs, width = len(block_tables), max(map(len, block_tables))
        sizes = cls.sizes(len(fields["input_ids"]), num_seqs, width, len(fields["logits_indices"]),
                          len(fields.get("pending_dst", ())), len(fields.get("copy_src", ())),
                          len(fields.get("prompt_rows", ())))
        host = np.full(cls.offsets(sizes)[1], -1, dtype=np.int64)
        step = cls(host, sizes["input_ids"], num_seqs, width, sizes["logits_indices"], is_prefill, max_seqlen_q,
                   max(fields["context_lens"]), sizes["pending_dst"], sizes["copy_src"],
                   num_prompt_logits=sizes["prompt_rows"], **extra)
        views = step.fields(host)
        for name, values in fields.items():
            views[name][:] = values
        for row, table in zip(views["block_tables"], block_tables):
            row[: len(table)] = table  # the rest stays -1: padding
        return step

    def fields(self, flat):
        """``flat`` (this step's host array, or its copy on the device) cut into named views."""
        sizes = self.sizes(self.num_tokens, self.num_seqs, self.block_table_width, self.num_logits, self.num_pending,
                           self.num_copies, self.num_prompt_logits)
        starts, _ = self.offsets(sizes)
        views = {name: flat[starts[name] : starts[name] + n] for name, n in sizes.items()}
        views["block_tables"] = views["block_tables"].reshape(self.num_seqs, self.block_table_width)
        return views


class PinnedStaging:
    """A ring of pinned host buffers, made once, that asynchronous scheduling's uploads go
    through in turn: the host writes a step into the next buffer, and the copy to the device
    does not wait for the device's queue (pinned, non-blocking). A buffer is written again
    only once its last copy is done (an event recorded behind that copy; with a few buffers
    it has long been done by then)."""

    def __init__(self, num_elements: int, num_buffers: int = 4):
        self.buffers = [torch.empty(num_elements, dtype=torch.int64, pin_memory=True) for _ in range(num_buffers)]
        self.copied: list[torch.cuda.Event | None] = [None] * num_buffers
        self.next = 0

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """``host`` on the device, through the next buffer; None when it does not fit one
        (an int64 array of at most the buffers' length)."""
        if host.dtype != torch.int64 or host.numel() > self.buffers[0].numel():
            return None
        i, self.next = self.next, (self.next + 1) % len(self.buffers)
        if self.copied[i] is not None:
            self.copied[i].synchronize()
        staged = self.buffers[i][: host.numel()].view(host.shape)
        staged.copy_(host)
        on_device = staged.to(device, non_blocking=True)
        self.copied[i] = torch.cuda.Event()
        self.copied[i].record()
        return on_device


# Each field of a step's flat array starts at a multiple of this many int64s (128 bytes).
FIELD_ALIGN = 16
# The sizes of the eager steps that compile_kernels runs at start-up, in tokens.
COMPILE_STEP_TOKENS = (4, 256, 2048)
MATMUL_WARM_STEP = 32  # warm_matmuls' stride in row counts above max_num_seqs
STAGING_MAX_ELEMENTS = 2**21  # a PinnedStaging buffer's length at most (16 MiB); larger steps pin their own
WARMUP_MAX_SEQ_LEN = 1024
# Prompt logprobs score many rows at once (a whole prompt chunk): their logits are computed
# in slices of at most this many elements (rows x vocabulary, 64 MiB in float32), so the
# memory they take does not grow with the chunk. A slice fits in the share of the card that
# gpu_memory_utilization leaves unassigned; the warm-up does not measure it.
PROMPT_LOGITS_ELEMENTS = 2**24


class ModelRunner:
    def __init__(self, config: EngineConfig, draft_block_bytes: int = 0):
        if get_tp_world_size() != config.tensor_parallel_size:
            raise RuntimeError(
                f"this process belongs to a tensor-parallel group of {get_tp_world_size()}, but the "
                f"engine asks for tensor_parallel_size={config.tensor_parallel_size}: shut the other engine down first"
            )
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        # Speculative decoding with a draft model (chapter 19): the draft keeps a block of its
        # own beside each block of the pool, allocated by its proposer; the budget pays for both.
        self.draft_block_bytes = draft_block_bytes
        # Where construction's time goes, in seconds by phase (``minivllm bench throughput``
        # reports it): loading the weights, sizing and allocating the KV pool (a warm-up
        # forward pass), capturing the CUDA graphs, compiling the eager steps' kernels.
        self.startup_seconds: dict[str, float] = {}
        with self._startup_phase("load_weights"):
            self.model = load_model(config.model, dtype=config.dtype, device=self.device)
        self.model_config = self.model.config
        self.sampler = Sampler()
        self.layers = attention_layers(self.model)
        # Hybrid models: a state slot per running sequence in every linear-attention layer,
        # allocated before the KV pool so that the pool is sized from what is left.
        self.state_layers = state_layers(self.model)
        self.num_state_slots = config.max_num_seqs if self.state_layers else 0
        # Speculative decoding keeps k more states per slot, to roll a rejection back to.
        num_spec_states = config.speculative.num_speculative_tokens if config.speculative is not None else 0
        if self.state_layers and self.device.type == "cuda":
            check_state_pools_fit(state_slot_bytes(self.state_layers, config.dtype, num_spec_states),
                                  self.num_state_slots, torch.cuda.mem_get_info(self.device)[0], num_spec_states)
        self.state_slot_bytes = allocate_state_pools(self.state_layers, self.num_state_slots, config.dtype, self.device,
                                                     num_spec_states)
        with self._startup_phase("kv_cache"):
            self.num_kv_blocks = self._allocate_kv_cache()
        # A sequence can never grow past the model's positions (asking for more is an error),
        # nor past the whole pool (a small pool shortens it, and says so).
        config.check_max_model_len(self.model_config)
        limit = config.max_model_len or self.model_config.max_position_embeddings
        self.max_model_len = min(limit, self.num_kv_blocks * self.block_size)
        # Asynchronous scheduling's uploads go through pinned buffers made now, not pinned
        # memory taken per step (see _to_device).
        self.staging = None
        if config.async_scheduling and self.device.type == "cuda":
            budget, seqs = config.max_num_batched_tokens, config.max_num_seqs
            width = -(-self.max_model_len // self.block_size)
            largest = StepInputs.offsets(StepInputs.sizes(budget, seqs, width, budget, seqs, seqs, budget))[1]
            self.staging = PinnedStaging(min(largest, STAGING_MAX_ELEMENTS))
        # A warning only when the caller asked for that length; the model's own limit being
        # cut by a small pool (a CPU, a test) is the usual case, not news.
        if self.max_model_len < limit and config.max_model_len is not None:
            logger.warning("max_model_len is %d, not %d: the KV pool holds only %d blocks of %d tokens (raise "
                           "gpu_memory_utilization, cpu_kv_cache_space or num_kv_blocks for more)",
                           self.max_model_len, limit, self.num_kv_blocks, self.block_size)
        # Speculative decoding with an MTP head (chapter 19): it reads the hidden states of
        # every position the last step computed, and which sequences' positions they are.
        self.keep_hidden_states = False
        self.last_step: tuple[list, list[int], list[int]] | None = None  # (seqs, first positions, counts)
        self.last_hidden: torch.Tensor | None = None  # [tokens, hidden_size]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.scratch_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # the same for prompts from scratch
        self.verify_graphs: PaddedGraphs | None = None  # speculative decoding's verifying steps
        if self.device.type == "cuda" and not config.enforce_eager:
            self.capture_cudagraphs()
        if self.device.type == "cuda":
            with self._startup_phase("compile_kernels"):
                self.compile_kernels()
            with self._startup_phase("warm_matmuls"):
                self.warm_matmuls()

    @contextmanager
    def _startup_phase(self, name: str):
        """Time one phase of construction into ``startup_seconds[name]``, the device's queued
        work included."""
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.startup_seconds[name] = time.perf_counter() - start

    # -- the KV pool -------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        first = self.layers[0]
        itemsize = torch.empty((), dtype=self.config.dtype).element_size()
        return 2 * len(self.layers) * self.block_size * first.num_kv_heads * first.head_dim * itemsize

    def _allocate_kv_cache(self) -> int:
        config = self.config
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif self.device.type == "cuda":
            num_blocks = self._blocks_that_fit_on_gpu()
        else:
            num_blocks = int(config.cpu_kv_cache_space * 2**30) // (self.block_bytes + self.draft_block_bytes)
        num_blocks = min_over_ranks(num_blocks)  # tensor parallelism: every rank's pool the same size
        if num_blocks < 1:
            gib = {k: round(v / 2**30, 2) if k != "gpu_memory_utilization" else v
                   for k, v in getattr(self, "memory_budget", {}).items()}
            raise RuntimeError(
                f"no memory left for the KV cache (one block needs {self.block_bytes + self.draft_block_bytes} bytes; GiB: {gib}); "
                "raise gpu_memory_utilization or cpu_kv_cache_space, or set num_kv_blocks"
            )
        first = self.layers[0]
        self.kv_cache = torch.empty(
            2, len(self.layers), num_blocks, self.block_size, first.num_kv_heads, first.head_dim,
            dtype=config.dtype, device=self.device,
        )
        for i, layer in enumerate(self.layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        return num_blocks

    def _blocks_that_fit_on_gpu(self) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        peak = torch.cuda.max_memory_allocated(self.device)
        current = torch.cuda.memory_allocated(self.device)
        # Budget = the allowed share of the card, minus what is in use now, minus the
        # activations' headroom the warm-up showed we need on top of the weights.
        budget = total * self.config.gpu_memory_utilization - used - (peak - current)
        self.memory_budget = {"total": total, "in_use": used, "warmup_activations": peak - current,
                              "gpu_memory_utilization": self.config.gpu_memory_utilization}
        return int(budget) // (self.block_bytes + self.draft_block_bytes)

    @torch.inference_mode()
    def _warmup(self) -> None:
        """One forward pass of the largest batch the scheduler can send, without a cache."""
        # Sequences of at most WARMUP_MAX_SEQ_LEN: the warm-up runs the reference attention
        # (there is no cache yet), whose [len x len] score matrix the engine's flash-style
        # kernels never build; a longer one would measure a peak that real steps never reach.
        max_len = min(self.config.max_model_len or self.model_config.max_position_embeddings,
                      self.config.max_num_batched_tokens, WARMUP_MAX_SEQ_LEN)
        num_seqs = max(1, min(self.config.max_num_batched_tokens // max_len, self.config.max_num_seqs))
        ids = torch.zeros(num_seqs * max_len, dtype=torch.long, device=self.device)
        positions = torch.arange(max_len, device=self.device).repeat(num_seqs)
        cu = torch.arange(0, num_seqs + 1, device=self.device, dtype=torch.int32) * max_len
        set_context(is_prefill=True, cu_seqlens_q=cu)
        try:
            self.model.compute_logits(self.model(ids, positions))
        finally:
            reset_context()

    @torch.inference_mode()
    def compile_kernels(self) -> None:
        """Run each kind of eager step once, so that Triton compiles its kernels here and not
        inside the user's first run: mixed steps (a prompt from scratch, a chunk after a
        cached prefix, a decode row) of a few, a few hundred and a few thousand tokens (the
        matrix-vector path, the GEMM path, the MoE kernel's tile sizes), and without CUDA
        graphs a decode step; then a prompt from scratch of the whole step budget. The
        kernels do not specialise on what varies from step to step (``do_not_specialize``,
        aligned fields), so these steps reach every variant a run can. They write into the
        first KV blocks and state slots, which hold nothing yet."""
        bs, limit = self.block_size, min(self.config.max_num_batched_tokens, self.max_model_len)
        num_seqs = min(3, self.config.max_num_seqs)
        shapes = [[(max(1, min(n, limit) - num_seqs + 1), 0), (1, bs + 1), (1, 2)][:num_seqs]
                  for n in COMPILE_STEP_TOKENS]
        # And one prompt from scratch of the whole step budget: the prefill kernel's
        # FROM_SCRATCH variant, and the matmuls of the widest steps (cuBLAS loads a kernel
        # the first time it picks it: for the largest shapes, inside the user's first prefill
        # steps otherwise).
        shapes.append([(limit, 0)])
        if not self.graphs:
            # A decode step whose longest context is split across programs (the attention's
            # merge; decode_num_splits makes no split under 256 tokens), and one short enough
            # for a single split (no merge): both variants. (An eager step past 4,096 tokens
            # of context can still need a wider merge.)
            long = max(1, min(self.max_model_len - 1, 2 * 256 + 1))
            shapes.append([(1, long), (1, 2)][: num_seqs])
            shapes.append([(1, bs + 1), (1, 2)][: num_seqs])
        logits = None
        for shape in shapes:
            fields = {name: [] for name in StepInputs.sizes(0, 0, 0, 0) if name != "block_tables"}
            fields["cu_seqlens_q"], tables, next_block = [0], [], 0
            for new, cached in shape:
                blocks = -(-(cached + new) // bs)
                if next_block + blocks > self.num_kv_blocks:
                    break  # a pool too small for this shape: a smaller one covers the kernels
                table = list(range(next_block, next_block + blocks))
                next_block += blocks
                positions = range(cached, cached + new)
                fields["input_ids"] += [0] * new
                fields["positions"] += positions
                fields["slot_mapping"] += [table[p // bs] * bs + p % bs for p in positions]
                fields["context_lens"].append(cached + new)
                fields["cu_seqlens_q"].append(fields["cu_seqlens_q"][-1] + new)
                tables.append(table)
            if not tables:
                continue
            fields["logits_indices"] = [end - 1 for end in fields["cu_seqlens_q"][1:]]
            step = StepInputs.pack(fields, tables, is_prefill=any(n > 1 for n, _ in shape[: len(tables)]),
                                   max_seqlen_q=max(n for n, _ in shape[: len(tables)]),
                                   logits_of_every_sequence=True,
                                   from_scratch=not any(cached for _, cached in shape[: len(tables)]))
            # ModelRunner's own upload, not a tensor-parallel rank 0's (which would also send
            # the step to the workers): every rank runs these same steps in its own start-up.
            input_ids, positions = ModelRunner.upload(self, step)
            if self.state_layers:  # slots 0.., starting from zeros
                self._set_state_slots(np.array([range(len(tables)), [0] * len(tables)], dtype=np.int64))
            logits, _ = self.execute(input_ids, positions)
        if logits is not None:  # the sampler's kernels too: greedy rows and tempered ones
            rows = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)] * logits.shape[0]
            self.sampler.launch(logits, rows[: logits.shape[0]], [None] * logits.shape[0], None).to_host()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def warm_matmuls(self) -> None:
        """Run every linear layer's matmul at the row counts a run can give it, so that the
        GEMM library picks and loads its kernels here. It loads a kernel's code the first
        time it chooses it (CUDA's lazy module loading), which blocks the host for
        milliseconds, and it chooses by the row count: without this, the user's first run
        paid that for each new number of tokens in an eager step and each new number of
        sampled rows at the LM head (which runs outside the decode graphs), about 4 ms a
        time. Row counts: every one up to ``max_num_seqs`` (decode batches, sampled rows),
        then every ``MATMUL_WARM_STEP``-th up to the step budget: a count between two warmed
        ones may still pick a kernel neither loaded (not checked count by count); the
        H200's first run came level with its second with this stride."""
        from minivllm.layers.embed_head import LMHead
        from minivllm.layers.linear import Linear
        from minivllm.ops.linear import linear

        budget = self.config.max_num_batched_tokens
        few = range(1, min(self.config.max_num_seqs, budget) + 1)
        counts = sorted(set(few) | set(range(MATMUL_WARM_STEP, budget + 1, MATMUL_WARM_STEP)) | {budget})
        shapes = {}  # (this rank's weight shape, bias?) -> a layer's weight and bias
        heads = {}
        for module in self.model.modules():
            if isinstance(module, Linear):
                shapes.setdefault((tuple(module.weight.shape), module.bias is not None), (module.weight, module.bias))
            elif isinstance(module, LMHead):
                heads.setdefault(tuple(module.weight.shape), module.weight)
        widest = max([w.shape[1] for w, _ in shapes.values()] + [w.shape[1] for w in heads.values()], default=0)
        if widest == 0:
            return
        x = torch.randn(budget, widest, dtype=self.config.dtype, device=self.device)
        for weight, bias in shapes.values():
            for m in counts:
                # (The layer's op, not the layer: no tensor-parallel collective here.)
                linear(x[:m, : weight.shape[1]], weight, bias)
        for weight in heads.values():  # the LM head's rows: at most one per sampled row
            for m in few:
                torch.nn.functional.linear(x[:m, : weight.shape[1]], weight)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- one step ----------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch, rows_to_sample: list[int] | None = None,
                previous: tuple[torch.Tensor, dict[int, int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Flatten the batch into input ids and positions, and set the step's Context: its
        attention metadata and which rows get logits (the last token of each sequence in
        ``rows_to_sample``; None: every sequence). With asynchronous scheduling a sequence's
        newest token may still be on the device: ``previous`` is the last step's sampled
        tokens and the row of each sequence in them, and the input is filled from there."""
        input_ids, positions, slots, context_lens, cu = [], [], [], [], [0]
        pending_dst, pending_src = [], []
        if self.keep_hidden_states:
            self.last_step = (list(batch.seqs), [seq.num_computed_tokens for seq in batch.seqs],
                              list(batch.num_new_tokens))
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            ids = seq.token_ids[start : start + n]
            if seq.draft_token_ids and len(ids) < n:  # speculative decoding: the drafts to verify
                ids = ids + seq.draft_token_ids[: n - len(ids)]
            if len(ids) < n:  # the last input was sampled by the previous step, still on the device
                pending_dst.append(len(input_ids) + len(ids))
                pending_src.append(previous[1][seq.seq_id])
                ids = ids + [0]
            input_ids.extend(ids)
            positions.extend(range(start, start + n))
            # One range per block the new tokens touch, not a Python step per token: a
            # 4,096-token prompt is 256 ranges (16-token blocks), not 4,096 appends.
            p, end = start, start + n
            while p < end:
                block, offset = divmod(p, bs)
                take = min(end - p, bs - offset)  # the new tokens that land in this block
                first = seq.block_table[block] * bs + offset
                slots.extend(range(first, first + take))
                p += take
            context_lens.append(start + n)
            cu.append(cu[-1] + n)
        rows = range(len(batch.seqs)) if rows_to_sample is None else rows_to_sample
        copies = batch.block_copies
        # Everything goes to the device in one copy: one int64 array, cut into named views.
        prompt_rows, prompt_targets, prompt_top_k = prompt_logprob_rows(batch, cu)
        step = StepInputs.pack(
            {"input_ids": input_ids, "positions": positions, "slot_mapping": slots, "context_lens": context_lens,
             "cu_seqlens_q": cu, "logits_indices": logits_rows(batch, rows, cu),
             "pending_dst": pending_dst, "pending_src": pending_src,
             "copy_src": [c[0] for c in copies], "copy_dst": [c[1] for c in copies],
             "prompt_rows": prompt_rows, "prompt_targets": prompt_targets},
            [seq.block_table for seq in batch.seqs], is_prefill=any(n > 1 for n in batch.num_new_tokens),
            max_seqlen_q=max(batch.num_new_tokens), logits_of_every_sequence=list(rows) == list(range(len(batch.seqs))) and not batch.num_drafts,
            prompt_top_k=prompt_top_k, from_scratch=not any(seq.num_computed_tokens for seq in batch.seqs))
        input_ids, positions = self.upload(step, previous[0] if pending_dst else None)
        if self.state_layers:  # hybrid models (one device only): each row's state slot
            self._set_state_slots(state_metadata(batch.seqs, batch.num_drafts))
        return input_ids, positions

    def _set_state_slots(self, metadata: np.ndarray) -> None:
        """The Context's state slots and has_initial_state (and, in a verifying step, the
        spec state counts), from state_metadata's rows. Each row starts on a FIELD_ALIGN
        boundary (see StepInputs.offsets)."""
        n = metadata.shape[1]
        padded = np.zeros((metadata.shape[0], -(-n // FIELD_ALIGN) * FIELD_ALIGN), dtype=np.int64)
        padded[:, :n] = metadata
        ctx = get_context()
        rows = self._to_device(padded)[:, :n]
        ctx.state_slots, ctx.has_initial_state = rows[0], rows[1]
        if metadata.shape[0] > 2:
            ctx.spec_state_counts = rows[2]

    def keep_accepted_states(self, slots: list[int], accepted: list[int]) -> None:
        """Hybrid models under speculative decoding: the sequences in ``slots`` rejected a
        draft, each after ``accepted`` accepted ones; their states go back to match
        (minivllm.engine.state_pool)."""
        index = self._to_device(np.array([slots, accepted], dtype=np.int64))
        keep_accepted_states(self.state_layers, index[0], index[1])

    def upload(self, step: StepInputs, previous_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy a flattened step to the device and set its Context; return input ids and
        positions (the pending ones filled from ``previous_tokens``, on the device)."""
        f = step.fields(self._to_device(step.host))
        if step.num_pending:
            f["input_ids"][f["pending_dst"]] = previous_tokens[f["pending_src"]]
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
        """Run the model on an uploaded step (its Context set); return the logits of the rows
        the Context names (None when it names none) and the scores of its prompt rows (None
        when it has none). Under tensor parallelism every rank runs this on the same step,
        so every rank makes the same choices (the LM head's all-gather is a collective)."""
        try:
            ctx = get_context()
            # (A decode step has one token per sequence: tokens = sequences.)
            if not ctx.is_prefill and self.graphs and input_ids.shape[0] <= self.graph_sizes[-1]:
                hidden = self._replay(input_ids, positions)
            elif self.verify_graphs is not None and self.verify_graphs.serves(ctx):
                hidden = self.verify_graphs.replay(input_ids, positions)[: input_ids.shape[0]]
            elif (ctx.is_prefill and self.prefill_graphs and ctx.cu_seqlens_q.shape[0] == 2
                  and input_ids.shape[0] <= self.prefill_graph_sizes[-1]):
                hidden = self._replay_prefill(input_ids, positions)
            else:
                hidden = self.model(input_ids, positions)
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

    def shutdown(self) -> None:
        """Give the device memory back: the CUDA graphs (their pool holds the captured
        activations), the KV pool, the state pools and the weights. The runner is unusable
        after. (Parameters keep bound weight loaders, a reference cycle, so only the cycle
        collector frees the model.)"""
        self.graphs.clear()
        self.prefill_graphs.clear()
        self.scratch_graphs.clear()
        if self.verify_graphs is not None:
            self.verify_graphs.clear()
        self.static = self.prefill_static = self.kv_cache = self.model = self.layers = self.state_layers = None
        self.last_step = self.last_hidden = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- CUDA graphs for decode ----------------------------------------------------------

    @torch.inference_mode()
    def capture_cudagraphs(self) -> None:
        """Capture one decode graph per batch size, largest first, sharing one memory pool.

        A graph replays fixed kernels on fixed addresses, so every input lives in a static
        buffer (one per entry of GRAPH_INPUTS) that ``_replay`` fills before each replay.
        The attention kernels are sized for max_model_len, the longest context any replay
        may see.
        """
        self.graph_sizes = graph_batch_sizes(self.config.max_num_seqs)
        max_bs = self.graph_sizes[-1]
        max_blocks = (self.max_model_len + self.block_size - 1) // self.block_size
        dev = self.device
        self.static = {name: torch.full((max_bs, max_blocks) if name == "block_tables" else (max_bs,),
                                        0 if pad is None else pad, dtype=dtype, device=dev)
                       for name, dtype, pad in GRAPH_INPUTS}
        self.static["cu_seqlens_q"] = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)  # one token each
        self.static["hidden"] = torch.zeros(max_bs, self.model_config.hidden_size, dtype=self.config.dtype, device=dev)
        s = self.static
        pool = None
        with self._startup_phase("decode_graphs"):
            for bs in reversed(self.graph_sizes):
                self._set_decode_context(bs)
                self.graphs[bs] = self._capture(s, bs, pool)
                pool = pool or self.graphs[bs].pool()
        self.graph_replays = dict.fromkeys(self.graph_sizes, 0)  # how often each graph ran
        # A tensor-parallel group would have to capture the same graphs on every rank: it
        # prefills and verifies eagerly. Hybrid models' recurrent layers choose their kernels
        # on the host from a long chunk's length: they prefill eagerly; their verifying steps
        # (short steps, kernels.common.SHORT_STEP_TOKENS) read everything on the device.
        if get_tp_world_size() == 1:
            if not self.state_layers:
                with self._startup_phase("prefill_graphs"):
                    self._capture_prefill_graphs(pool)
            spec = self.config.speculative
            if spec is not None and (not self.state_layers or 1 + spec.num_speculative_tokens <= SHORT_STEP_TOKENS):
                with self._startup_phase("verify_graphs"):
                    self._capture_verify_graphs(pool)

    def _capture_prefill_graphs(self, pool) -> None:
        """One graph per token count in PREFILL_GRAPH_TOKENS (up to the step budget), for a
        step that computes one sequence: its new tokens padded to that count. Everything
        the kernels read about the step is in static buffers on the device (the query
        length in cu_seqlens_q, the context in context_lens and the block table), so one
        graph serves a prompt from scratch, a chunk after a cached prefix and a verifying
        step alike. The padding rows store nothing (slot -1) and their outputs are dropped;
        the attention grid covers all of them and skips the tiles past the real query."""
        limit = min(self.config.max_num_batched_tokens, self.max_model_len)
        self.prefill_graph_sizes = [t for t in PREFILL_GRAPH_TOKENS if t <= limit]
        if not self.prefill_graph_sizes:
            return
        top = self.prefill_graph_sizes[-1]
        max_blocks = (self.max_model_len + self.block_size - 1) // self.block_size
        dev, i64 = self.device, torch.int64  # the dtypes of an eager step's fields: the same kernels
        self.prefill_static = s = {
            "input_ids": torch.zeros(top, dtype=i64, device=dev), "positions": torch.zeros(top, dtype=i64, device=dev),
            "slot_mapping": torch.full((top,), -1, dtype=i64, device=dev),
            "context_lens": torch.zeros(1, dtype=i64, device=dev),
            "block_tables": torch.zeros(1, max_blocks, dtype=i64, device=dev),
            "cu_seqlens_q": torch.zeros(2, dtype=i64, device=dev),
            "hidden": torch.zeros(top, self.model_config.hidden_size, dtype=self.config.dtype, device=dev),
        }
        # From SCRATCH_GRAPH_TOKENS up, where attention is a large share of the step, each
        # size gets a second graph for a prompt from scratch (Context.from_scratch): its
        # prefill kernel is compiled without the loads of cached keys, and runs faster for it.
        for t in reversed(self.prefill_graph_sizes):
            for from_scratch in (False, True) if t >= SCRATCH_GRAPH_TOKENS else (False,):
                s["cu_seqlens_q"][1] = t
                s["context_lens"][0] = t
                set_context(is_prefill=True, cu_seqlens_q=s["cu_seqlens_q"], slot_mapping=s["slot_mapping"][:t],
                            context_lens=s["context_lens"], block_tables=s["block_tables"], max_seqlen_q=t,
                            max_context_len=self.max_model_len, from_scratch=from_scratch)
                graphs = self.scratch_graphs if from_scratch else self.prefill_graphs
                graphs[t] = self._capture(s, t, pool)
        self.prefill_graph_replays = dict.fromkeys(self.prefill_graph_sizes, 0)  # of either graph of a size
        self.scratch_graph_replays = dict.fromkeys(self.scratch_graphs, 0)

    def _capture_verify_graphs(self, pool) -> None:
        """Speculative decoding: one graph per decode batch size (whose step fits the token
        budget) for a verifying step, in which each sequence computes at most 1 + k tokens
        (its last token and up to k drafts), padded (minivllm.cuda_graphs). Without them a
        batched verifying step launches every kernel from Python, as an eager prefill does."""
        q = 1 + self.config.speculative.num_speculative_tokens
        sizes = [bs for bs in self.graph_sizes if bs * q <= self.config.max_num_batched_tokens]
        if sizes:
            max_blocks = (self.max_model_len + self.block_size - 1) // self.block_size
            self.verify_graphs = PaddedGraphs(sizes, q, max_blocks, self.device, state_slots=bool(self.state_layers))
            self.verify_graphs.capture(self.model, self.max_model_len, pool)

    def _capture(self, s: dict, n: int, pool) -> torch.cuda.CUDAGraph:
        """Run the model on the first n rows of the static inputs ``s`` once (Triton compiles
        its kernels here), then capture the same pass into a graph in the shared memory
        ``pool``. The caller has set the Context the pass reads."""
        graph = torch.cuda.CUDAGraph()
        s["hidden"][:n] = self.model(s["input_ids"][:n], s["positions"][:n])
        with torch.cuda.graph(graph, pool):
            s["hidden"][:n] = self.model(s["input_ids"][:n], s["positions"][:n])
        torch.cuda.synchronize()
        reset_context()
        return graph

    def _set_decode_context(self, bs: int) -> None:
        s = self.static
        hybrid = bool(self.state_layers)
        set_context(
            is_prefill=False, cu_seqlens_q=s["cu_seqlens_q"][: bs + 1], slot_mapping=s["slot_mapping"][:bs],
            context_lens=s["context_lens"][:bs], block_tables=s["block_tables"][:bs],
            max_seqlen_q=1, max_context_len=self.max_model_len,
            state_slots=s["state_slots"][:bs] if hybrid else None,
            has_initial_state=s["has_initial_state"][:bs] if hybrid else None,
        )

    def _replay(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = padded_batch_size(n, self.graph_sizes)
        s, ctx = self.static, get_context()
        step = {"input_ids": input_ids, "positions": positions, "slot_mapping": ctx.slot_mapping,
                "context_lens": ctx.context_lens, "block_tables": ctx.block_tables,
                "state_slots": ctx.state_slots, "has_initial_state": ctx.has_initial_state}
        for name, _, pad in GRAPH_INPUTS:
            src = step[name]
            if src is None:  # the state slots of a model without linear attention
                continue
            if pad is not None:
                s[name][n:bs].fill_(pad)  # padding rows: see GRAPH_INPUTS
            if name == "block_tables":
                s[name][:n, : src.shape[1]] = src
            else:
                s[name][:n] = src
        self.graphs[bs].replay()
        self.graph_replays[bs] += 1
        return s["hidden"][:n]

    def _replay_prefill(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        t = padded_batch_size(n, self.prefill_graph_sizes)
        s, ctx = self.prefill_static, get_context()
        s["input_ids"][:n] = input_ids
        s["positions"][:n] = positions
        s["slot_mapping"][:n] = ctx.slot_mapping
        s["slot_mapping"][n:t].fill_(-1)  # padding rows store nothing
        s["context_lens"].copy_(ctx.context_lens)
        s["cu_seqlens_q"].copy_(ctx.cu_seqlens_q)
        s["block_tables"][:, : ctx.block_tables.shape[1]] = ctx.block_tables
        if ctx.from_scratch and t in self.scratch_graphs:
            self.scratch_graphs[t].replay()
            self.scratch_graph_replays[t] += 1
        else:
            self.prefill_graphs[t].replay()
        self.prefill_graph_replays[t] += 1
        return s["hidden"][:n]


def logits_rows(batch: ScheduledBatch, rows, cu: list[int]) -> list[int]:
    """The flat-batch rows whose logits the sampler gets: each sampled sequence's last
    token, and for one verifying d draft tokens (speculative decoding) its last d + 1 rows,
    one per position a token is drawn at."""
    out = []
    for i in rows:
        d = batch.drafts(i)
        out.extend(range(cu[i + 1] - 1 - d, cu[i + 1]))
    return out


def prompt_logprob_rows(batch: ScheduledBatch, cu: list[int]) -> tuple[list[int], list[int], int]:
    """The flat-batch rows that score prompt tokens this step (``batch.prompt_logprobs``),
    the prompt token each scores (the one after it), and the most alternatives any of them
    reports."""
    rows, targets, top_k = [], [], 0
    for i, first, count in batch.prompt_logprobs:
        seq = batch.seqs[i]
        row = cu[i] + first - seq.num_computed_tokens  # this step computes from num_computed_tokens
        rows.extend(range(row, row + count))
        targets.extend(seq.token_ids[first + 1 : first + 1 + count])
        top_k = max(top_k, seq.sampling_params.prompt_logprobs)
    return rows, targets, top_k


# What a decode graph reads, each from a static buffer: (name, dtype, the value written to
# the rows past the real batch, or None where a stale value is harmless). A padding row
# stores nothing (slot -1), attends to nothing (context length 0), and has no state slot.
GRAPH_INPUTS = [
    ("input_ids", torch.long, None),
    ("positions", torch.long, None),
    ("slot_mapping", torch.long, -1),
    ("context_lens", torch.int32, 0),
    ("block_tables", torch.int32, None),
    ("state_slots", torch.long, -1),
    ("has_initial_state", torch.long, None),
]


# -- which batch sizes get a graph -----------------------------------------------------

# The token counts that get a prefill graph (a step of one sequence pads up to the next):
# powers of two, then halfway points, so that padding at most doubles a short step and adds
# at most half to a long one, where the GPU work starts to outweigh the launches.
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)
# The prefill graphs that get a twin for prompts from scratch (ModelRunner.scratch_graphs).
SCRATCH_GRAPH_TOKENS = 512

MAX_GRAPH_BATCH_SIZE = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes that get a CUDA graph, ascending: 1, 2, 4, 8, then every
    multiple of 16, up to max_num_seqs (capped at 512), which is always one of them.

    Each graph costs capture time and a little memory, so not every size gets one; a batch
    runs in the smallest graph that holds it, so the gaps bound the padding: at most 15
    rows, a small share of the large batches where throughput is made."""
    max_bs = min(max_num_seqs, MAX_GRAPH_BATCH_SIZE)
    sizes = {b for b in [1, 2, 4, 8, *range(16, max_bs + 1, 16)] if b <= max_bs}
    return sorted(sizes | {max_bs})


def padded_batch_size(n: int, sizes: list[int]) -> int:
    """The captured size that a decode batch of n sequences replays in: the smallest size
    in ``sizes`` (ascending) that is at least n. Its extra rows are padding."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"a batch of {n} sequences is larger than the largest captured graph ({sizes[-1]})")
