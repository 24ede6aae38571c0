"""The model runner's start-up: how many KV blocks fit, the KV pool, and the warm-up work that
moves every first-time cost (Triton compiling a kernel, the GEMM library loading one) from
the user's first run into construction.

On a GPU the number of KV blocks is whatever fits in ``gpu_memory_utilization`` of the card
after a warm-up forward pass has shown the activations' peak; on the CPU it comes from a
configured size. The pool is one tensor, allocated once: [2 (k, v), num_layers, num_blocks,
block_size, num_kv_heads, head_dim], in the cache's dtype (EngineConfig.kv_cache_dtype); each
attention layer gets a view of its slice.
"""
import logging
import sys
import time
from contextlib import contextmanager

import torch

from minivllm.config import EngineConfig
from minivllm.context import reset_context, set_context
from minivllm.engine.step_inputs import StepInputs
from minivllm.layers.attention import Attention
from minivllm.layers.embed_head import lm_heads
from minivllm.layers.linear import linear_layers

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
    """The KV pool in the cache's ``dtype``, each attention layer given a view of its slice."""
    first = layers[0]
    kv_cache = torch.empty(2, len(layers), num_blocks, block_size, first.num_kv_heads, first.head_dim,
                           dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]
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
