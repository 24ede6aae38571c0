"""A matcher per sequence, advanced by every token the sequence accepts, and the batch's
token bitmask: one int32 row of ceil(vocab / 32) words per sampled row, bit ``t % 32`` of
word ``t // 32`` set when token t may come next.

A row without a grammar gets every bit set (the kernel leaves it as it is). A matcher that
has accepted its stop token (its grammar is complete and the model said so) has nothing left
to allow: its row is all ones too — that row's token is thrown away, because its request has
finished (this happens under asynchronous scheduling, when the next step was computed before
the host knew that the request ended). So is the row of a reasoning model still reasoning: its
grammar starts after the reasoning's end token (``GrammarState.waits_for``).

Preemption needs nothing here: this engine recomputes a preempted sequence from its tokens,
which it keeps, and its matcher has accepted exactly those tokens; ``rebuild`` makes a
matcher that has from a list of tokens (what a server that lost its matchers would do).
"""
import os
import threading
from typing import NamedTuple

import torch


class SurrogateGuard(NamedTuple):
    """GrammarCompiler.surrogate_guard: the tokens whose spelling ends in the byte ED, and
    the token filter to AND after one of them (without the tokens that begin with A0-BF)."""

    ends_in_lead: frozenset
    after_lead: torch.Tensor


class GrammarState:
    """Where one sequence stands in its grammar."""

    def __init__(self, compiled_grammar, token_filter: torch.Tensor | None = None, waits_for: int | None = None,
                 surrogate_guard: SurrogateGuard | None = None):
        import xgrammar as xgr

        self.compiled = compiled_grammar
        self.matcher = xgr.GrammarMatcher(compiled_grammar)
        self.num_accepted = 0
        # Tokens never to allow whatever the grammar says (GrammarCompiler.token_filter):
        # a bitmask row ANDed with the grammar's.
        self.token_filter = token_filter
        self.surrogate_guard = surrogate_guard
        self.after_lead = False  # the last token accepted ended in ED (see SurrogateGuard)
        # A matcher ends only by taking a stop token, so it is asked only then (the batch's
        # mask reads this for every row at every step: a call into xgrammar each).
        self.stop_token_ids = frozenset(self.matcher.stop_token_ids)
        self.is_terminated = False
        # A reasoning model's grammar starts after its end-of-reasoning token (</think>,
        # StructuredOutputsParams.reasoning_end_token_id): until the sequence samples it, its
        # tokens are free (its bitmask row allows everything) and the matcher sees none of them,
        # nor that token. None: the grammar has started.
        self.waits_for = waits_for

    @property
    def constrains(self) -> bool:
        """Does the grammar decide what may come next: started, and not ended?"""
        return self.waits_for is None and not self.is_terminated

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and no change) if the grammar does not allow it."""
        if self.waits_for is not None:
            self._wait(token)
            return True
        ok = self.matcher.accept_token(token)
        self._accepted(token, ok)
        return ok

    def _wait(self, token: int) -> None:
        """A token before the grammar starts: the one it waits for starts it at the next."""
        if token == self.waits_for:
            self.waits_for = None

    @property
    def current_filter(self) -> torch.Tensor | None:
        """The token filter to AND with the grammar's row now."""
        return self.surrogate_guard.after_lead if self.after_lead else self.token_filter

    def _accepted(self, token: int, ok: bool) -> None:
        self.num_accepted += ok
        if ok and self.surrogate_guard is not None:
            self.after_lead = token in self.surrogate_guard.ends_in_lead
        if ok and token in self.stop_token_ids:
            self.is_terminated = self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (a CPU int32 tensor)."""
        if self.constrains:
            self.matcher.fill_next_token_bitmask(bitmask, row)
            if self.current_filter is not None:
                bitmask[row] &= self.current_filter

    @classmethod
    def rebuild(cls, compiled_grammar, token_ids: list[int], waits_for: int | None = None) -> "GrammarState":
        """A matcher that has accepted ``token_ids`` (the grammar starting after ``waits_for``,
        if given); ValueError if the grammar refuses one."""
        state = cls(compiled_grammar, waits_for=waits_for)
        for i, token in enumerate(token_ids):
            if not state.accept(token):
                raise ValueError(f"token {token} (output position {i}) is not allowed by the grammar")
        return state


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


# Rows at or above which the matchers fill their rows on a pool of threads (xgrammar's batch
# matcher, in C++ without the interpreter lock): a row of a JSON grammar takes tens of
# microseconds over a large vocabulary, so a batch of 256 filled one by one holds the host for
# milliseconds a step, longer than the GPU's step.
BATCH_FILL_ROWS = 8
_per_thread = threading.local()  # a batch matcher (its thread pool) for each engine thread


def fill_threads() -> int:
    """Half the cores this process may run on (at least 1, at most 8)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(8, cores // 2))


def _batch_matcher():
    if not hasattr(_per_thread, "matcher"):
        import xgrammar as xgr

        # Threads for the cores this process may use: xgrammar's "auto" takes half of the
        # machine's (std::thread::hardware_concurrency), which in a container limited to a
        # few cores of a large host is far more threads than cores.
        _per_thread.matcher = xgr.BatchGrammarMatcher(max_threads=fill_threads())
    return _per_thread.matcher


def accept_tokens(states: list[GrammarState], tokens: list[int]) -> list[bool]:
    """``states[i].accept(tokens[i])`` for a batch: from BATCH_FILL_ROWS rows on the batch
    matcher's threads (at batch 256 one by one was about 26 us a row on the host's critical
    path). A state that refuses its token is left as it was, as ``accept`` leaves it."""
    if len({id(state) for state in states}) != len(states):
        raise ValueError("accept_tokens: each state takes one token a call (a state appears twice in states)")
    if len(states) < BATCH_FILL_ROWS:
        return [state.accept(token) for state, token in zip(states, tokens)]
    started = [i for i, state in enumerate(states) if state.waits_for is None]
    for state, token in zip(states, tokens):
        if state.waits_for is not None:  # (its grammar has not started: nothing to ask the matcher)
            state._wait(token)
    oks = [True] * len(states)
    accepted = _batch_matcher().batch_accept_token([states[i].matcher for i in started],
                                                   [tokens[i] for i in started]) if started else []
    for i, ok in zip(started, accepted):
        states[i]._accepted(tokens[i], ok)
        oks[i] = ok
    return oks


def fill_bitmask(states: list[GrammarState | None], vocab_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The batch's bitmask on the host: [rows, ceil(vocab / 32)] int32, -1 (every bit set)
    where a row has no grammar, or its grammar has not started (a reasoning) or has ended.
    Written into ``out`` when given (a buffer kept from step to step, ``BitmaskBuffers``):
    every row is written, whatever the buffer held before."""
    words = bitmask_words(vocab_size)
    if out is None:
        out = torch.full((len(states), words), -1, dtype=torch.int32)
    elif out.shape != (len(states), words) or out.dtype != torch.int32:
        raise ValueError(f"out must be int32 [{len(states)}, {words}], got {out.dtype} {tuple(out.shape)}")
    else:
        dead = [row for row, state in enumerate(states) if state is None or not state.constrains]
        if dead:
            out[dead] = -1
    live = [(row, state) for row, state in enumerate(states) if state is not None and state.constrains]
    # A state in several rows is filled once and its row copied: two of the batch matcher's
    # threads filling one matcher at once share its scratch buffers and crash the process.
    first_row: dict[int, int] = {}  # id(state) -> the row it is filled in
    filled, copies = [], []  # (row, state) to fill; (row, the row to copy)
    for row, state in live:
        if id(state) in first_row:
            copies.append((row, first_row[id(state)]))
        else:
            first_row[id(state)] = row
            filled.append((row, state))
    if len(filled) >= BATCH_FILL_ROWS:
        # (xgrammar writes every word of a row it fills.)
        _batch_matcher().batch_fill_next_token_bitmask([s.matcher for _, s in filled], out, [r for r, _ in filled])
    else:
        for row, state in filled:
            state.matcher.fill_next_token_bitmask(out, row)
    for row, source in copies:
        out[row] = out[source]
    filtered: dict[int, tuple[torch.Tensor, list[int]]] = {}  # the rows of each token filter, ANDed at once
    for row, state in live:
        if state.current_filter is not None:
            filtered.setdefault(id(state.current_filter), (state.current_filter, []))[1].append(row)
    for token_filter, rows in filtered.values():
        # In place over each run of consecutive rows (usually one: every row of the batch):
        # indexing with the row list would gather the rows, AND them and scatter them back,
        # three passes over a bitmask of 4.9 MB at batch 256 and Qwen3's vocabulary.
        start = 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                out[rows[start] : rows[i - 1] + 1] &= token_filter
                start = i
    return out


class BitmaskBuffers:
    """Host memory for the batch's bitmask, kept from step to step: at batch 256 and
    Qwen3's vocabulary a fresh 4.9 MB tensor a step costs its page faults, and on a GPU the
    sampler's ``pin_memory()`` would copy it into pinned memory before its upload (a tensor
    already pinned it takes as it is).

    Each ``take`` hands out the next of ``count`` buffers in turn. On a GPU a buffer's upload
    is queued without waiting (non-blocking), so a buffer is not written again before its
    copy has run: each take records an event behind the work queued since the one before
    (which includes that one's upload), and a buffer's next take waits for it. With three
    buffers that event is behind at most the step in flight's forward pass before the last,
    long done by then: the wait costs nothing in a steady run."""

    def __init__(self, vocab_size: int, pinned: bool, count: int = 3):
        self.words = bitmask_words(vocab_size)
        self.pinned = pinned
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.uploaded: list = [None] * count  # the event after each buffer's upload (GPU only)
        self.turn = -1

    def take(self, rows: int) -> torch.Tensor:
        """A [rows, words] int32 tensor whose earlier contents no copy will read any more."""
        if self.pinned and self.turn >= 0:
            event = torch.cuda.Event()
            event.record()
            self.uploaded[self.turn] = event
        self.turn = (self.turn + 1) % len(self.buffers)
        if self.uploaded[self.turn] is not None:
            self.uploaded[self.turn].synchronize()
            self.uploaded[self.turn] = None
        buffer = self.buffers[self.turn]
        if buffer is None or buffer.shape[0] < rows:
            size = -(-rows // 64) * 64  # (grown in steps of 64 rows)
            buffer = self.buffers[self.turn] = torch.empty((size, self.words), dtype=torch.int32, pin_memory=self.pinned)
        return buffer[:rows]


def allowed_count(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    """How many tokens each row allows (for the chapter's figure)."""
    from minivllm.ops.token_bitmask import unpack_bitmask

    return unpack_bitmask(bitmask, vocab_size).sum(dim=-1).tolist()
