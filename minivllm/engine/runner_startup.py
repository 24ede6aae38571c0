"""The model runner's start-up: how many KV blocks fit, the KV pool, and the warm-up work that
moves every first-time cost (Triton compiling a kernel, the GEMM library loading one) from
the user's first run into construction.

On a GPU the number of KV blocks is whatever fits in ``gpu_memory_utilization`` of the card
after a warm-up forward pass has shown the activations' peak; on the CPU it comes from a
configured size. The pool is one tensor, allocated once: [2 (k, v), num_layers, num_blocks,
block_size, num_kv_heads, head_dim], in the cache's dtype (EngineConfig.kv_cache_dtype); each
attention layer gets a view of its slice.

``RunnerStartup`` holds these steps as the model runner's methods (``ModelRunner`` derives
from it), and ``shutdown``, which gives back what they took, so that ``engine.model_runner``
holds only what runs at every step.
"""
import contextlib
import gc
import logging
import sys
import time
from contextlib import contextmanager

import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.context import reset_context, set_context
from minivllm.distributed.parallel_state import get_tp_world_size, min_over_ranks
from minivllm.engine.cuda_graphs import DECODE, CudaGraphDispatcher, CudaGraphs
from minivllm.engine.state_pool import allocate_state_pools, check_state_pools_fit, state_slot_bytes
from minivllm.engine.step_inputs import PinnedStaging, StepInputs
from minivllm.layers.attention import Attention
from minivllm.layers.embed_head import lm_heads
from minivllm.layers.linear import linear_layers
from minivllm.loader import load_model
from minivllm.ops.attention import is_fp8, value_cache_view
from minivllm.sampling_params import SamplingParams

# The sizes of the eager steps that compile_steps lays out, in tokens.
COMPILE_STEP_TOKENS = (4, 256, 2048)
MATMUL_WARM_STEP = 32  # warm_matmuls' stride in row counts above max_num_seqs
WARMUP_MAX_SEQ_LEN = 1024

logger = logging.getLogger(__name__)


@contextmanager
def timed_phase(seconds: dict[str, float], name: str, device: torch.device):
    """Time one phase of construction into ``seconds[name]``, the device's queued work included,
    and say so when it ends (``report_phase``)."""
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds[name] = time.perf_counter() - start
    report_phase(name, seconds[name])


def report_phase(name: str, seconds: float) -> None:
    """One line per phase of start-up, so that whoever waits for ``LLM(...)`` sees where the
    seconds go: logged (INFO), or, on a terminal where nothing set up logging (a script run
    by hand), printed to stderr, as a progress bar would be."""
    message = f"start-up: {name.replace('_', ' ')} took {seconds:.1f} s"
    if sys.stderr.isatty() and not logging.getLogger().hasHandlers():
        print(f"minivllm {message}", file=sys.stderr, flush=True)
    else:
        logger.info(message)


def kv_block_bytes(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    """The bytes one block of the pool takes: keys and values of every attention layer, in
    the cache's dtype (a float8 cache's blocks are half a bf16 one's: twice as many fit)."""
    first = layers[0]
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * len(layers) * block_size * first.num_kv_heads * first.head_dim * itemsize


def blocks_that_fit_on_gpu(model, config: EngineConfig, device: torch.device, block_bytes: int,
                           memory_budget: dict) -> int:
    """How many blocks of ``block_bytes`` fit in the card's allowed share, after a warm-up
    pass; ``memory_budget`` is filled with the figures the answer came from."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    warmup(model, config, device)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    peak = torch.cuda.max_memory_allocated(device)
    current = torch.cuda.memory_allocated(device)
    # Budget = the allowed share of the card, minus what is in use now, minus the
    # activations' headroom the warm-up showed we need on top of the weights.
    budget = total * config.gpu_memory_utilization - used - (peak - current)
    memory_budget.update(total=total, in_use=used, warmup_activations=peak - current,
                         gpu_memory_utilization=config.gpu_memory_utilization)
    return int(budget) // block_bytes


@torch.inference_mode()
def warmup(model, config: EngineConfig, device: torch.device) -> None:
    """One forward pass of the largest batch the scheduler can send, without a cache."""
    # Sequences of at most WARMUP_MAX_SEQ_LEN: the warm-up runs the reference attention
    # (there is no cache yet), whose [len x len] score matrix the engine's flash-style
    # kernels never build; a longer one would measure a peak that real steps never reach.
    max_len = min(config.max_model_len or model.config.max_position_embeddings,
                  config.max_num_batched_tokens, WARMUP_MAX_SEQ_LEN)
    num_seqs = max(1, min(config.max_num_batched_tokens // max_len, config.max_num_seqs))
    ids = torch.zeros(num_seqs * max_len, dtype=torch.long, device=device)
    positions = torch.arange(max_len, device=device).repeat(num_seqs)
    cu = torch.arange(0, num_seqs + 1, device=device, dtype=torch.int32) * max_len
    set_context(is_prefill=True, cu_seqlens_q=cu)
    try:
        model.compute_logits(model(ids, positions))
    finally:
        reset_context()


def allocate_kv_cache(layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """The KV pool in the cache's ``dtype``, each attention layer given a view of its slice
    (a float8 cache's values in their key-contiguous layout, and the pool zeroed: the
    attention reads rows past a sequence's keys unmasked, so every value must be finite)."""
    first = layers[0]
    empty = torch.zeros if is_fp8(dtype) else torch.empty
    kv_cache = empty(2, len(layers), num_blocks, block_size, first.num_kv_heads, first.head_dim, dtype=dtype,
                     device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv_cache[0, i], value_cache_view(kv_cache[1, i])
    return kv_cache


def compile_steps(block_size: int, limit: int, max_model_len: int, max_num_seqs: int, num_kv_blocks: int,
                  decode_graphs: bool) -> list[StepInputs]:
    """The eager steps that ``ModelRunner.compile_kernels`` runs: mixed steps (a prompt from
    scratch, a chunk after a cached prefix, a decode row) of a few, a few hundred and a few
    thousand tokens (the matrix-vector path, the GEMM path, the MoE kernel's tile sizes),
    without decode graphs a decode step, and a prompt from scratch of the whole step budget
    (``limit`` tokens). They write into the first KV blocks, which hold nothing yet; a shape
    too large for the pool is cut (a smaller one covers its kernels)."""
    bs, num_seqs = block_size, min(3, max_num_seqs)
    shapes = [[(max(1, min(n, limit) - num_seqs + 1), 0), (1, bs + 1), (1, 2)][:num_seqs]
              for n in COMPILE_STEP_TOKENS]
    # And one prompt from scratch of the whole step budget: the prefill kernel's
    # FROM_SCRATCH variant, and the matmuls of the widest steps (cuBLAS loads a kernel
    # the first time it picks it: for the largest shapes, inside the user's first prefill
    # steps otherwise).
    shapes.append([(limit, 0)])
    if not decode_graphs:
        # A decode step whose longest context is split across programs (the attention's
        # merge; decode_num_splits makes no split under 256 tokens), and one short enough
        # for a single split (no merge): both variants. (An eager step past 4,096 tokens
        # of context can still need a wider merge.)
        long = max(1, min(max_model_len - 1, 2 * 256 + 1))
        shapes.append([(1, long), (1, 2)][:num_seqs])
        shapes.append([(1, bs + 1), (1, 2)][:num_seqs])
    steps = []
    for shape in shapes:
        fields = {name: [] for name in StepInputs.sizes(0, 0, 0, 0) if name != "block_tables"}
        fields["cu_seqlens_q"], tables, next_block = [0], [], 0
        for new, cached in shape:
            blocks = -(-(cached + new) // bs)
            if next_block + blocks > num_kv_blocks:
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
        steps.append(StepInputs.pack(fields, tables, is_prefill=any(n > 1 for n, _ in shape[: len(tables)]),
                                     max_seqlen_q=max(n for n, _ in shape[: len(tables)]),
                                     logits_of_every_sequence=True,
                                     from_scratch=not any(cached for _, cached in shape[: len(tables)])))
    return steps


@torch.inference_mode()
def warm_matmuls(model, config: EngineConfig, device: torch.device) -> None:
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
    budget = config.max_num_batched_tokens
    few = range(1, min(config.max_num_seqs, budget) + 1)
    counts = sorted(set(few) | set(range(MATMUL_WARM_STEP, budget + 1, MATMUL_WARM_STEP)) | {budget})
    shapes = {}  # (this rank's weight shape and format, bias?) -> a layer of them
    for layer in linear_layers(model):
        shapes.setdefault((tuple(layer.weight.shape), layer.weight.dtype, layer.bias is not None), layer)
    heads = {}
    for head in lm_heads(model):
        heads.setdefault(tuple(head.weight.shape), head.weight)
    widest = max([layer.weight.shape[1] for layer in shapes.values()] + [w.shape[1] for w in heads.values()],
                 default=0)
    if widest == 0:
        return
    x = torch.randn(budget, widest, dtype=config.dtype, device=device)
    for layer in shapes.values():
        for m in counts:
            # (The layer's quantization method, not the layer: no tensor-parallel collective here.)
            layer.quant_method.apply(layer, x[:m, : layer.weight.shape[1]], layer.bias)
    for weight in heads.values():  # the LM head's rows: at most one per sampled row
        for m in few:
            torch.nn.functional.linear(x[:m, : weight.shape[1]], weight)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RunnerStartup:
    """The model runner's start-up, as methods of ``ModelRunner`` (which derives from this
    class; its ``__init__`` calls them in order): the state pools, the KV pool and the
    longest sequence it allows, the CUDA graphs, the compiling steps and the warm matmuls;
    and ``shutdown``, which gives it all back. None of it runs while the engine steps. The
    methods read and set what ``ModelRunner.__init__`` declares (``config``, ``model``,
    ``layers``, ``kv_cache``, ...)."""

    def _pinned_staging(self) -> PinnedStaging | None:
        if not (self.config.async_scheduling and self.device.type == "cuda"):
            return None
        width = -(-self.max_model_len // self.block_size)
        return PinnedStaging.for_steps(self.config.max_num_batched_tokens, self.config.max_num_seqs, width)

    def _prepare_gpu(self) -> None:
        """Capture the CUDA graphs (unless enforce_eager), compile the eager steps' kernels and
        warm the matmuls, so that a user's first steps run at speed. The Triton kernels of
        those passes are compiled first, on many threads at once: the same passes, every
        launch a compile (kernels.compile_ahead), with the matmuls' warm-up beside them."""
        def passes():
            if not self.config.enforce_eager:
                self.capture_cudagraphs(dry=True)
            # (Not the sampler's kernels: it reads what they computed.)
            self.compile_kernels(sample=False, decode_graphs=not self.config.enforce_eager)
            # The GEMM library loads its kernels here, on this thread, while the others
            # compile: the products are thrown away, so the garbage they read costs nothing.
            self.warm_matmuls()

        if not self._compile_ahead(passes, phase="compile_ahead"):
            with self._startup_phase("warm_matmuls"):
                self.warm_matmuls()
        if not self.config.enforce_eager:
            self.capture_cudagraphs()
        with self._startup_phase("compile_kernels"):
            self.compile_kernels()

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

    def _load_weights(self) -> torch.nn.Module:
        """The model with the checkpoint's weights, on the device; on a GPU, Triton hashes
        itself on another thread meanwhile (kernels.compile_ahead)."""
        if self.device.type == "cuda":
            from minivllm.kernels.compile_ahead import hash_triton_in_background

            hash_triton_in_background()
        with self._startup_phase("load_weights"):
            return load_model(self.config.model, dtype=self.config.dtype, device=self.device,
                              quantization=self.config.quantization)

    def _startup_phase(self, name: str):
        return timed_phase(self.startup_seconds, name, self.device)

    def _compile_ahead(self, passes, phase: str | None = None) -> bool:
        """Run ``passes`` once with every Triton launch turned into a compile, on many threads
        at once (kernels.compile_ahead): the same passes run for real after it find their
        kernels compiled. Nothing computed in it may be used. Nothing runs where compiling
        ahead is off (``MINIVLLM_COMPILE_AHEAD=0``) or Triton lacks it. Returns whether
        ``passes`` ran."""
        from minivllm.kernels import compile_ahead

        if not compile_ahead.available():
            return False
        with self._startup_phase(phase) if phase else contextlib.nullcontext(), compile_ahead.compile_only():
            passes()
        return True

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
            # The sizing pass's kernels first, on many threads (its peak memory is measured
            # on the real pass after).
            self._compile_ahead(lambda: warmup(self.model, config, self.device))
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

    def capture_cudagraphs(self, dry: bool = False) -> None:
        """Capture the CUDA graphs this engine replays (minivllm.engine.cuda_graphs): the
        decode graphs, and on one device the prefill and verify graphs (``dry``: their
        passes only, nothing captured)."""
        spec = self.config.speculative
        dispatcher = CudaGraphDispatcher.plan(
            self.config.max_num_seqs, self.config.max_num_batched_tokens, self.max_model_len,
            spec.num_speculative_tokens if spec is not None else None, hybrid=bool(self.state_layers),
            tensor_parallel=get_tp_world_size() > 1)
        graphs = CudaGraphs(dispatcher, hybrid=bool(self.state_layers))
        max_blocks = (self.max_model_len + self.block_size - 1) // self.block_size
        phase = (lambda name: contextlib.nullcontext()) if dry else self._startup_phase
        graphs.capture(self.model, max_blocks, self.max_model_len, self.model_config.hidden_size, self.config.dtype,
                       self.device, phase, dry)
        if not dry:
            self.cudagraphs = graphs

    @property
    def graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        """The decode graphs, by batch size (empty: decode steps run eagerly)."""
        return self.cudagraphs.of_kind(DECODE)

    @property
    def graph_sizes(self) -> list[int]:
        """The decode batch sizes that have a graph, ascending."""
        return self.cudagraphs.dispatcher.sizes.get(DECODE, [])

    @torch.inference_mode()
    def compile_kernels(self, sample: bool = True, decode_graphs: bool | None = None) -> None:
        """Run each kind of eager step once (``runner_startup.compile_steps``), so that Triton
        compiles its kernels here and not inside the user's first run, then (``sample``) the
        sampler's. The kernels do not specialise on what varies from step to step
        (``do_not_specialize``, aligned fields), so these steps reach every variant a run
        can. They write into the first KV blocks and state slots, which hold nothing yet.
        ``decode_graphs``: whether decode steps replay graphs (default: whether any are
        captured), which leaves the eager decode step out."""
        limit = min(self.config.max_num_batched_tokens, self.max_model_len)
        logits = None
        for step in compile_steps(self.block_size, limit, self.max_model_len, self.config.max_num_seqs,
                                  self.num_kv_blocks, decode_graphs=bool(self.graphs) if decode_graphs is None
                                  else decode_graphs):
            input_ids, positions = self.upload_on_this_rank(step)
            if self.state_layers:  # slots 0.., starting from zeros
                self._set_state_slots(np.array([range(step.num_seqs), [0] * step.num_seqs], dtype=np.int64))
            logits, _ = self.execute(input_ids, positions)
        if sample and logits is not None:
            # The sampler's kernels too: a greedy row beside a tempered one (a batch of greedy
            # rows alone takes the argmax, not the sampling kernels). The last step may have
            # left one row of logits: it is copied twice (a copy, not a view of stride 0: the
            # kernels specialise on the row stride's alignment, as in a run).
            logits = logits[:1].repeat(2, 1) if logits.shape[0] < 2 else logits
            rows = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)] * logits.shape[0]
            self.sampler.launch(logits, rows[: logits.shape[0]], [None] * logits.shape[0], None).to_host()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warm_matmuls(self) -> None:
        """Run every matmul at the row counts a run can give it (``runner_startup.warm_matmuls``)."""
        warm_matmuls(self.model, self.config, self.device)

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
