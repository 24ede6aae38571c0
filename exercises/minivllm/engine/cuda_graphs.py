# Exercise copy of minivllm/engine/cuda_graphs.py, generated from it by scripts/make_exercises.py.
# Fill in: graph_batch_sizes (ch10), padded_batch_size (ch10), CudaGraphDispatcher.plan (ch10), CudaGraphDispatcher.dispatch (ch10), StaticInputs.fill (ch10).
# Grade: make grade CH=10
# Running the generator again overwrites this file: commit or copy your work first.

"""CUDA graphs for the model runner (chapter 10): which captured graph a step replays in, and
the graphs themselves with their static inputs.

On a GPU a step's forward pass launches a few hundred small kernels; replaying a graph
captured once launches them all in one call, which removes that CPU cost. A graph replays
fixed kernels on fixed addresses, so every input it reads lives in a static buffer (one per
entry of GRAPH_INPUTS) that a replay fills first, and a step is padded up to a captured size.
Four kinds of graphs, chosen from the step's shape alone (``CudaGraphDispatcher``):

- decode: one token per sequence, one graph per batch size of ``graph_batch_sizes``;
- prefill: one sequence computing its prompt (or a chunk of it), one graph per token count of
  PREFILL_GRAPH_TOKENS (for a short prompt the launches cost far more than the GPU work: a
  128-token prompt of Qwen3-0.6B, about 30 ms of host time for 1.4 ms of kernels on the H200);
- scratch: the twin of a large prefill graph for a prompt from scratch (Context.from_scratch),
  whose prefill kernel is compiled without the loads of cached keys;
- verify: speculative decoding's verifying step, each sequence its last token and at most k
  drafts, one graph per decode batch size whose step fits the token budget.

Other steps (several sequences of long chunks; every prefill step of a hybrid model, whose
recurrent layers choose their kernels on the host from a long chunk's length) run eagerly.
A hybrid model's graphs also read each sequence's state slot, whether it continues from it
and (verify graphs) how many states it keeps for a rollback; a padding sequence has slot -1,
which the kernels such steps run neither read nor write.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from minivllm.context import Context, get_context, reset_context, set_context
from minivllm.ops.gated_delta import SHORT_STEP_TOKENS

DECODE, PREFILL, SCRATCH, VERIFY = "decode", "prefill", "scratch", "verify"

# The token counts that get a prefill graph (a step of one sequence pads up to the next):
# powers of two, then halfway points, so that padding at most doubles a short step and adds
# at most half to a long one, where the GPU work starts to outweigh the launches.
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)
# The prefill graphs that get a twin for prompts from scratch (from this many tokens up,
# attention is a large share of the step).
SCRATCH_GRAPH_TOKENS = 512

MAX_GRAPH_BATCH_SIZE = 512

# Every Context field a graph reads, each from a static buffer: (name, its rows: one per
# token, per sequence, per sequence and one more, or a block-table row per sequence; the
# value written to the rows past the real step, LAST to repeat the last real value, or None
# where a stale value is harmless). A padding row stores nothing (slot -1); a padding
# sequence attends to nothing (context length 0), has no queries (its cu_seqlens_q entry
# repeats the last one), no state slot, and keeps no state. The buffers are int64, the
# dtype of an eager step's fields, so a graph runs the kernels an eager pass would.
LAST = "last"
GRAPH_INPUTS = (
    ("input_ids", "tokens", None),
    ("positions", "tokens", None),
    ("slot_mapping", "tokens", -1),
    ("context_lens", "seqs", 0),
    ("cu_seqlens_q", "seqs+1", LAST),
    ("block_tables", "table", None),
    ("state_slots", "seqs", -1),
    ("has_initial_state", "seqs", None),
    ("spec_state_counts", "seqs", 0),
)
STATE_FIELDS = ("state_slots", "has_initial_state", "spec_state_counts")  # hybrid models only


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes that get a CUDA graph, ascending: 1, 2, 4, 8, then every
    multiple of 16, up to max_num_seqs (capped at 512), which is always one of them.

    Each graph costs capture time and a little memory, so not every size gets one; a batch
    runs in the smallest graph that holds it, so the gaps bound the padding: at most 15
    rows, a small share of the large batches where throughput is made."""
    raise NotImplementedError(
        "ch10: graph_batch_sizes: the batch sizes that get a captured decode graph, ascending, "
        "without duplicates: the small ones 1, 2, 4 and 8, then every multiple of 16, all up to "
        "the largest batch the engine runs (max_num_seqs, capped at MAX_GRAPH_BATCH_SIZE), and "
        "that largest size itself even when it is none of the others. Each size costs capture time "
        "and memory; a batch runs in the smallest captured size that holds it, its extra rows "
        "padding, see notebooks/10_cuda_graphs.ipynb"
    )


def padded_batch_size(n: int, sizes: list[int]) -> int:
    """The captured size that a decode batch of n sequences replays in: the smallest size
    in ``sizes`` (ascending) that is at least n. Its extra rows are padding."""
    raise NotImplementedError(
        "ch10: padded_batch_size: a batch of n sequences replays the graph of the smallest "
        "captured size that holds it (sizes is ascending), the rows in between padding. When no "
        "captured size holds n, raise ValueError with n in the message, see "
        "notebooks/10_cuda_graphs.ipynb"
    )


@dataclass(frozen=True)
class BatchDescriptor:
    """A step as the dispatcher sees it: what its Context says on the host."""

    num_tokens: int
    num_seqs: int
    max_query_len: int  # tokens of the step's longest sequence (Context.max_seqlen_q)
    is_prefill: bool
    from_scratch: bool = False

    @classmethod
    def of(cls, ctx: Context, num_tokens: int) -> BatchDescriptor:
        num_seqs = 1 if ctx.cu_seqlens_q is None else ctx.cu_seqlens_q.shape[0] - 1
        return cls(num_tokens=num_tokens, num_seqs=num_seqs, max_query_len=ctx.max_seqlen_q,
                   is_prefill=ctx.is_prefill, from_scratch=ctx.from_scratch)


@dataclass(frozen=True)
class GraphKey:
    """One captured graph: its kind and the size it was captured for (sequences for decode
    and verify graphs, tokens for prefill and scratch ones)."""

    kind: str
    size: int


class CudaGraphDispatcher:
    """Which graphs are captured (``sizes``: kind -> ascending sizes) and which one a step
    replays in. It knows the steps' shapes only, nothing of tensors or models."""

    def __init__(self, sizes: dict[str, list[int]] | None = None, verify_query_len: int = 0):
        self.sizes = {kind: list(s) for kind, s in (sizes or {}).items() if s}
        self.verify_query_len = verify_query_len  # 1 + k: a verifying sequence's tokens at most

    @classmethod
    def plan(cls, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
             num_speculative_tokens: int | None, hybrid: bool, tensor_parallel: bool) -> CudaGraphDispatcher:
        """The graphs an engine captures. A tensor-parallel group would have to capture the
        same graphs on every rank: it prefills and verifies eagerly. A hybrid model prefills
        eagerly; its verifying steps (short steps, at most SHORT_STEP_TOKENS per sequence)
        read everything on the device and get verify graphs."""
        raise NotImplementedError(
            "ch10: plan: the graphs an engine captures, as a dict from kind to ascending sizes, "
            "and the tokens a verifying sequence brings (1 + k, or 0 without drafts). Decode "
            "graphs always, one per batch size of graph_batch_sizes. A tensor-parallel engine "
            "captures nothing else. Otherwise: a model that is not hybrid gets prefill graphs for "
            "the token counts of PREFILL_GRAPH_TOKENS that neither the step budget nor "
            "max_model_len exceeds, and scratch twins for those of them from SCRATCH_GRAPH_TOKENS "
            "up; with k drafts, verify graphs for the decode sizes whose sequences times (1 + k) "
            "fit the step budget, except on a hybrid model whose verifying step would be longer "
            "than SHORT_STEP_TOKENS. Pitfall: a kind with no size at all must not appear (the "
            "constructor drops empty lists). Second hint: the verify graphs' size counts "
            "sequences, their tokens are that times 1 + k, see notebooks/10_cuda_graphs.ipynb"
        )

    def dispatch(self, batch: BatchDescriptor) -> GraphKey | None:
        """The graph that ``batch`` replays in, padded up to its size; None: run eagerly."""
        raise NotImplementedError(
            "ch10: dispatch: the graph a step replays in, from its shape alone, or None to run it "
            "eagerly. In order: a decode step (not a prefill; one token per sequence, so its "
            "tokens count its sequences) that the largest decode graph holds replays the decode "
            "graph of its padded size. Then a verifying step: verify graphs exist, the step is a "
            "prefill exactly when a verifying sequence brings more than one token, no sequence "
            "brings more than 1 + k tokens, and the largest verify graph holds its sequences; its "
            "size counts sequences. Then a prefill of one sequence whose tokens the largest "
            "prefill graph holds, padded by tokens; a prompt from scratch takes the scratch twin "
            "of that size where one was captured. Pitfall: the order matters, a short verifying "
            "step of one sequence must not land in a prefill graph, see "
            "notebooks/10_cuda_graphs.ipynb"
        )

    def shape(self, key: GraphKey) -> tuple[int, int, int]:
        """A graph's padded sequences, padded tokens and tokens per sequence."""
        if key.kind in (PREFILL, SCRATCH):  # one sequence
            return 1, key.size, key.size
        q = self.verify_query_len if key.kind == VERIFY else 1
        return key.size, key.size * q, q

    def capture_order(self) -> list[tuple[str, list[GraphKey]]]:
        """The keys to capture, by start-up phase, each kind largest first (the first graph
        captured sizes the shared memory pool); a prefill size's twin right after it."""
        prefill = [GraphKey(kind, t) for t in reversed(self.sizes.get(PREFILL, []))
                   for kind in (PREFILL, SCRATCH) if kind == PREFILL or t in self.sizes.get(SCRATCH, [])]
        phases = [("decode_graphs", [GraphKey(DECODE, s) for s in reversed(self.sizes.get(DECODE, []))]),
                  ("prefill_graphs", prefill),
                  ("verify_graphs", [GraphKey(VERIFY, s) for s in reversed(self.sizes.get(VERIFY, []))])]
        return [(phase, keys) for phase, keys in phases if keys]


class StaticInputs:
    """The static buffers that one kind of graph reads (decode, prefill and its twins, or
    verify), sized for its largest graph, and the hidden states its graphs write."""

    def __init__(self, names: list[str], max_seqs: int, max_tokens: int, max_blocks: int, hidden: torch.Tensor,
                 constant: tuple[str, ...] = ()):
        device = hidden.device
        shapes = {"tokens": (max_tokens,), "seqs": (max_seqs,), "seqs+1": (max_seqs + 1,),
                  "table": (max_seqs, max_blocks)}
        self.buffers = {name: torch.full(shapes[rows], pad if isinstance(pad, int) else 0, dtype=torch.int64,
                                         device=device)
                        for name, rows, pad in GRAPH_INPUTS if name in names}
        self.hidden = hidden  # [max_tokens, hidden_size]
        self.constant = constant  # buffers written at capture only, never by a replay

    def context(self, seqs: int, tokens: int, **host_fields) -> Context:
        """Set the Context of a graph of ``seqs`` sequences and ``tokens`` rows: views of
        the buffers' first rows, and ``host_fields`` (max_seqlen_q, ...)."""
        rows = {"tokens": tokens, "seqs": seqs, "seqs+1": seqs + 1, "table": seqs}
        views = {name: self.buffers[name][: rows[r]] for name, r, _ in GRAPH_INPUTS
                 if name in self.buffers and name not in ("input_ids", "positions")}
        return set_context(**views, **host_fields)

    def fill(self, ctx: Context, input_ids: torch.Tensor, positions: torch.Tensor, padded_seqs: int,
             padded_tokens: int) -> None:
        """Copy the step (its Context set) into the buffers' first rows, and write each
        field's padding value into the rows up to the graph's size."""
        raise NotImplementedError(
            "ch10: StaticInputs.fill: a graph reads only its static buffers, so a replay first "
            "copies the step into them: for every field of GRAPH_INPUTS that this kind of graph "
            "has (and that is not one of its constant buffers, written once at capture), the real "
            "rows first (a token field has a row per token, a sequence field one per sequence, "
            "cu_seqlens_q one more; the block table's rows are as wide as the step's, which may be "
            "narrower than the buffer), input_ids and positions from the arguments, every other "
            "field from the Context. Then the padding rows, from the real ones up to the graph's "
            "size (and not one further: rows past it belong to no one): the field's pad value, or "
            "the last real value for LAST, or nothing for None (a stale value there is harmless). "
            "A field the step does not have (None in the Context, e.g. no drafts verified) gets "
            "its pad value in the real rows too. Second hint: count the real and padded rows per "
            "kind of row once, in two small dicts, see notebooks/10_cuda_graphs.ipynb"
        )


class CudaGraphs:
    """The captured graphs (one dict, by GraphKey), their static inputs, and how often each
    one ran. The runner asks ``dispatcher`` for a step's key and replays it here."""

    def __init__(self, dispatcher: CudaGraphDispatcher, hybrid: bool = False):
        self.dispatcher = dispatcher
        self.hybrid = hybrid
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.replays: dict[GraphKey, int] = {}
        self.static: dict[str, StaticInputs] = {}  # by kind; a scratch twin reads its prefill graph's

    @torch.inference_mode()
    def capture(self, model: Callable, max_blocks: int, max_context_len: int, hidden_size: int, dtype: torch.dtype,
                device: torch.device, phase: Callable[[str], AbstractContextManager], dry: bool = False) -> None:
        """Capture every graph the dispatcher names, kind by kind (each in its start-up
        ``phase``), largest first, all in one memory pool. The attention kernels are sized
        for ``max_context_len``, the longest context any replay may see. ``dry``: run each
        graph's pass once and capture nothing (compiling ahead: kernels.compile_ahead)."""
        pool = None
        for name, keys in self.dispatcher.capture_order():
            with phase(name):
                seqs, tokens, _ = self.dispatcher.shape(keys[0])  # the largest of its kind
                hidden = torch.zeros(tokens, hidden_size, dtype=dtype, device=device)
                # A decode graph's cu_seqlens_q is one token per sequence, written at capture.
                constant = ("cu_seqlens_q",) if keys[0].kind == DECODE else ()
                self.static[keys[0].kind] = StaticInputs(self._fields(keys[0].kind), seqs, tokens, max_blocks, hidden,
                                                         constant)
                for key in keys:
                    if dry:
                        self._pass(model, key, max_context_len)
                        continue
                    self.graphs[key] = self._capture(model, key, max_context_len, pool)
                    self.replays[key] = 0
                    pool = pool or self.graphs[key].pool()

    def _fields(self, kind: str) -> list[str]:
        """The GRAPH_INPUTS a kind of graph reads: the state fields only for a hybrid
        model, and the kept-state counts only where a step verifies drafts."""
        states = (STATE_FIELDS if kind == VERIFY else STATE_FIELDS[:2]) if self.hybrid else ()
        return [name for name, _, _ in GRAPH_INPUTS if name not in STATE_FIELDS or name in states]

    def _pass(self, model: Callable, key: GraphKey, max_context_len: int, graph: torch.cuda.CUDAGraph | None = None,
              pool=None) -> None:
        """Run the model once on the static inputs of ``key``'s size (Triton compiles its
        kernels here), and with a ``graph`` capture the same pass into it, in the shared
        memory ``pool``. A step from scratch of ``q`` tokens per sequence; a decode step
        with no context (its buffers' zeros)."""
        s, (seqs, tokens, q) = self._static_of(key), self.dispatcher.shape(key)
        b = s.buffers
        b["cu_seqlens_q"][: seqs + 1] = torch.arange(seqs + 1, device=b["cu_seqlens_q"].device) * q
        if key.kind != DECODE:
            b["context_lens"][:seqs] = q
        s.context(seqs, tokens, is_prefill=q > 1, max_seqlen_q=q, max_context_len=max_context_len,
                  from_scratch=key.kind == SCRATCH)
        try:
            s.hidden[:tokens] = model(b["input_ids"][:tokens], b["positions"][:tokens])
            if graph is not None:
                with torch.cuda.graph(graph, pool):
                    s.hidden[:tokens] = model(b["input_ids"][:tokens], b["positions"][:tokens])
                torch.cuda.synchronize()
        finally:
            reset_context()

    def _capture(self, model: Callable, key: GraphKey, max_context_len: int, pool) -> torch.cuda.CUDAGraph:
        """``key``'s graph, captured after one eager pass (``_pass``)."""
        graph = torch.cuda.CUDAGraph()
        self._pass(model, key, max_context_len, graph, pool)
        return graph

    def replay(self, key: GraphKey, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run the step whose Context is set in ``key``'s graph; return its hidden states
        (the next replay overwrites them)."""
        s, (seqs, tokens, _) = self._static_of(key), self.dispatcher.shape(key)
        s.fill(get_context(), input_ids, positions, seqs, tokens)
        self.graphs[key].replay()
        self.replays[key] += 1
        return s.hidden[: input_ids.shape[0]]

    def _static_of(self, key: GraphKey) -> StaticInputs:
        return self.static[PREFILL if key.kind == SCRATCH else key.kind]

    def of_kind(self, kind: str) -> dict[int, torch.cuda.CUDAGraph]:
        """The captured graphs of one kind, by size."""
        return {key.size: graph for key, graph in self.graphs.items() if key.kind == kind}

    def replays_of(self, *kinds: str) -> dict[int, int]:
        """How often the graphs of ``kinds`` ran, by size (summed over the kinds)."""
        counts: dict[int, int] = {}
        for key, n in self.replays.items():
            if key.kind in kinds:
                counts[key.size] = counts.get(key.size, 0) + n
        return counts

    def clear(self) -> None:
        """Give the graphs' memory back (their pool holds the captured activations)."""
        self.graphs.clear()
        self.static.clear()
