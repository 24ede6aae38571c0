"""A step's inputs on their way to the device (chapters 05, 07 and 17): the scheduled batch
flattened into one int64 host array (``StepInputs``, filled by ``pack_batch``), and the
pinned buffers that asynchronous scheduling uploads it through (``PinnedStaging``).

One array, one copy: every field the model and the attention kernels read about a step
(input ids, positions, the slot mapping, context lengths, cumulative query lengths, the rows
that get logits, the block tables, ...) goes to the device in a single host-to-device copy,
then is cut into named views. Under tensor parallelism the same small array is what rank 0
sends the other ranks (chapter 16).
"""
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.sequence import Sequence

# Each field of a step's flat array starts at a multiple of this many int64s (128 bytes).
FIELD_ALIGN = 16
STAGING_MAX_ELEMENTS = 2**21  # a PinnedStaging buffer's length at most (16 MiB); larger steps pin their own


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

    @classmethod
    def for_steps(cls, max_tokens: int, max_seqs: int, max_blocks: int) -> "PinnedStaging":
        """Buffers that hold the largest step the scheduler can send (up to a bound:
        STAGING_MAX_ELEMENTS; a larger step pins its own memory)."""
        sizes = StepInputs.sizes(max_tokens, max_seqs, max_blocks, max_tokens, max_seqs, max_seqs, max_tokens)
        return cls(min(StepInputs.offsets(sizes)[1], STAGING_MAX_ELEMENTS))

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


def pack_batch(batch: ScheduledBatch, rows_to_sample: list[int] | None, previous_rows: dict[int, int] | None,
               block_size: int) -> StepInputs:
    """Flatten the batch into one step: its tokens (``token_fields``), which rows get
    logits (the last token of each sequence in ``rows_to_sample``; None: every sequence),
    the prompt rows to score, and the KV blocks to copy first."""
    fields = token_fields(batch, block_size)
    cu = fields["cu_seqlens_q"]
    fields |= pending_rows(batch, previous_rows, cu)
    rows = range(len(batch.seqs)) if rows_to_sample is None else rows_to_sample
    prompt_rows, prompt_targets, prompt_top_k = prompt_logprob_rows(batch, cu)
    copies = batch.block_copies
    fields |= {"logits_indices": logits_rows(batch, rows, cu), "prompt_rows": prompt_rows,
               "prompt_targets": prompt_targets, "copy_src": [c[0] for c in copies], "copy_dst": [c[1] for c in copies]}
    return StepInputs.pack(
        fields, [seq.block_table for seq in batch.seqs], is_prefill=any(n > 1 for n in batch.num_new_tokens),
        max_seqlen_q=max(batch.num_new_tokens), logits_of_every_sequence=list(rows) == list(range(len(batch.seqs))) and not batch.num_drafts,
        prompt_top_k=prompt_top_k, from_scratch=not any(seq.num_computed_tokens for seq in batch.seqs))


def token_fields(batch: ScheduledBatch, block_size: int) -> dict[str, list[int]]:
    """Each sequence's new tokens, their positions and KV slots, its context length after
    the step and the cumulative query lengths."""
    input_ids, positions, slots, context_lens, cu = [], [], [], [], [0]
    bs = block_size
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed_tokens
        input_ids.extend(step_token_ids(seq, n))
        positions.extend(range(start, start + n))
        # BEGIN SOLUTION ch05 slot_mapping
        # One range per block the new tokens touch, not a Python step per token: a
        # 4,096-token prompt is 256 ranges (16-token blocks), not 4,096 appends.
        p, end = start, start + n
        while p < end:
            block, offset = divmod(p, bs)
            take = min(end - p, bs - offset)  # the new tokens that land in this block
            first = seq.block_table[block] * bs + offset
            slots.extend(range(first, first + take))
            p += take
        # END SOLUTION
        context_lens.append(start + n)
        cu.append(cu[-1] + n)
    return {"input_ids": input_ids, "positions": positions, "slot_mapping": slots, "context_lens": context_lens,
            "cu_seqlens_q": cu}


def step_token_ids(seq: Sequence, n: int) -> list[int]:
    """The n input ids ``seq`` computes this step: its next tokens; for a decode verifying
    drafts (speculative decoding, chapter 19) the drafts after them; and a placeholder 0 for
    a newest token still on the device (asynchronous scheduling, chapter 17: ``pending_rows``)."""
    start = seq.num_computed_tokens
    ids = seq.token_ids[start : start + n]
    if seq.draft_token_ids and len(ids) < n:
        ids = ids + seq.draft_token_ids[: n - len(ids)]
    return ids + [0] * (n - len(ids))


def pending_rows(batch: ScheduledBatch, previous_rows: dict[int, int] | None, cu: list[int]) -> dict[str, list[int]]:
    """With asynchronous scheduling a sequence's newest token may still be on the device: its
    input row (the sequence's last) holds a placeholder, filled on the device from row
    ``previous_rows[seq_id]`` of the previous step's sampled tokens. Input row
    ``pending_dst[i]`` is row ``pending_src[i]`` of those tokens."""
    dst, src = [], []
    if previous_rows is None:  # no step in flight: every input is on the host
        return {"pending_dst": dst, "pending_src": src}
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        if seq.num_computed_tokens + n > len(seq.token_ids) + len(seq.draft_token_ids):
            dst.append(cu[i + 1] - 1)
            src.append(previous_rows[seq.seq_id])
    return {"pending_dst": dst, "pending_src": src}


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


def pad_rows(metadata: np.ndarray) -> np.ndarray:
    """``metadata`` (rows of int64, e.g. state_metadata's) with each row widened to a
    FIELD_ALIGN multiple, so that every row starts aligned (see StepInputs.offsets)."""
    n = metadata.shape[1]
    padded = np.zeros((metadata.shape[0], -(-n // FIELD_ALIGN) * FIELD_ALIGN), dtype=np.int64)
    padded[:, :n] = metadata
    return padded
