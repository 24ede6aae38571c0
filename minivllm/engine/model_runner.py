"""The model runner: owns the model and the KV pool, turns a scheduled batch into tensors,
runs the forward pass and samples.

The KV pool is one tensor, allocated once: [2 (k, v), num_layers, num_blocks, block_size,
num_kv_heads, head_dim]. Each attention layer gets a view of its slice. On a GPU the number
of blocks is whatever fits in ``gpu_memory_utilization`` of the card after a warm-up
forward pass has shown the activations' peak; on the CPU it comes from a configured size.
"""
import torch

from minivllm.config import EngineConfig
from minivllm.context import reset_context, set_context
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.generate import attention_layers
from minivllm.layers.sampler import Sampler, SamplerOutput
from minivllm.loader import load_model


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.model = load_model(config.model, dtype=config.dtype, device=self.device)
        self.model_config = self.model.config
        self.sampler = Sampler()
        self.layers = attention_layers(self.model)
        self.num_kv_blocks = self._allocate_kv_cache()

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
            num_blocks = int(config.cpu_kv_cache_space * 2**30) // self.block_bytes
        if num_blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache (one block needs {self.block_bytes} bytes); "
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
        return int(budget) // self.block_bytes

    @torch.inference_mode()
    def _warmup(self) -> None:
        """One forward pass of the largest batch the scheduler can send, without a cache."""
        max_len = min(self.config.max_model_len or self.model_config.max_position_embeddings,
                      self.config.max_num_batched_tokens)
        num_seqs = max(1, min(self.config.max_num_batched_tokens // max_len, self.config.max_num_seqs))
        ids = torch.zeros(num_seqs * max_len, dtype=torch.long, device=self.device)
        positions = torch.arange(max_len, device=self.device).repeat(num_seqs)
        cu = torch.arange(0, num_seqs + 1, device=self.device, dtype=torch.int32) * max_len
        set_context(is_prefill=True, cu_seqlens_q=cu)
        try:
            self.model.compute_logits(self.model(ids, positions))
        finally:
            reset_context()

    # -- one step ----------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Flatten the batch into input ids and positions, and set the step's Context."""
        input_ids, positions, slots, context_lens, cu = [], [], [], [], [0]
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            # BEGIN SOLUTION ch05 "slot mapping: for each position p in start .. start + n - 1, append seq.block_table[p // bs] * bs + p % bs to slots"
            for p in range(start, start + n):
                slots.append(seq.block_table[p // bs] * bs + p % bs)
            # END SOLUTION
            context_lens.append(start + n)
            cu.append(cu[-1] + n)
        width = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in batch.seqs]
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int32, device=self.device)  # noqa: E731
        set_context(
            is_prefill=any(n > 1 for n in batch.num_new_tokens),
            cu_seqlens_q=as_tensor(cu),
            slot_mapping=as_tensor(slots).long(),
            context_lens=as_tensor(context_lens),
            block_tables=as_tensor(tables),
        )
        return as_tensor(input_ids).long(), as_tensor(positions).long()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, rows_to_sample: list[int], params, generators, banned) -> SamplerOutput | None:
        """Compute the batch; sample a token for each sequence in ``rows_to_sample``."""
        input_ids, positions = self.prepare(batch)
        try:
            hidden = self.model(input_ids, positions)
            if not rows_to_sample:
                return None
            logits = self.model.compute_logits(hidden)[rows_to_sample]
        finally:
            reset_context()
        return self.sampler(logits, params, generators, banned)
