"""Per-request changes to the logits before the draw: ``allowed_token_ids``, ``bad_words``,
``logit_bias`` and the penalties on tokens already seen (``minivllm.layers.penalties``).

The host knows each request's settings and tokens as Python lists; the device holds the
logits. Everything the batch needs goes over in two copies (the integers, the floats), both
pinned and non-blocking like every per-step copy (``rows_to_device``): under asynchronous
scheduling the host must not wait for the device. For the same reason a request's newest
token may not be on the host yet (the step that sampled it is still running): it is read
where it is, on the device, from the tokens of the step in flight (``TokenHistory.pending``).
Nothing here is built when no row of the batch uses it.
"""
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.layers.penalties import presence_frequency_penalty, repetition_penalty, token_counts
from minivllm.sampling_params import SamplingParams


@dataclass
class TokenHistory:
    """What the batch's rows have seen, for the penalties and the bad words. A row that
    needs none of it has empty lists (its counts stay 0)."""

    prompt: list[list[int]]  # per row: the prompt's ids
    output: list[list[int]]  # per row: the generated ids the host knows
    pending: list[int]  # per row: where its newest generated id is in pending_tokens, or -1
    pending_tokens: torch.Tensor | None  # the step in flight's sampled ids, on the device
    bad_words: list[list[list[int]]]  # per row: each bad word's token ids

    def row(self, r: int) -> "TokenHistory":
        return TokenHistory(self.prompt[r : r + 1], self.output[r : r + 1], self.pending[r : r + 1],
                            self.pending_tokens, self.bad_words[r : r + 1])


def padded(lists: list[list[int]], width: int, left: bool = False) -> np.ndarray:
    """[len(lists), width] int64, each list padded with -1 (on the left: its last ids kept)."""
    out = np.full((len(lists), width), -1, dtype=np.int64)
    for r, ids in enumerate(lists):
        ids = list(ids[max(0, len(ids) - width) :] if left else ids[:width]) if width else []
        if ids:
            if left:
                out[r, width - len(ids) :] = ids
            else:
                out[r, : len(ids)] = ids
    return out


def to_device(parts: dict[str, np.ndarray], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Named arrays to the device in one pinned, non-blocking copy; views of it come back."""
    flat = np.concatenate([np.asarray(a).reshape(-1) for a in parts.values()]) if parts else np.zeros(0)
    host = torch.from_numpy(flat.astype(np.int64 if dtype == torch.long else np.float32))
    dev = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    out, at = {}, 0
    for name, a in parts.items():
        a = np.asarray(a)
        out[name] = dev[at : at + a.size].view(a.shape)
        at += a.size
    return out


def allowed_tokens_mask(logits: torch.Tensor, restricted: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """-inf everywhere in the ``restricted`` rows ([rows] bool) except at ``cells`` ([n, 2]:
    (row, token id) pairs that stay)."""
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[cells[:, 0], cells[:, 1]] = True
    return logits.masked_fill(restricted.unsqueeze(-1) & ~keep, float("-inf"))


def add_logit_bias(logits: torch.Tensor, cells: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Add ``bias`` ([n]) at ``cells`` ([n, 2]: (row, token id))."""
    return logits.index_put((cells[:, 0], cells[:, 1]), bias, accumulate=True)


def bad_words_mask(logits: torch.Tensor, tail: torch.Tensor, pair_row: torch.Tensor, pair_last: torch.Tensor,
                   pair_prefix: torch.Tensor) -> torch.Tensor:
    """Ban each bad word's last token in its row when the row's generated tail ends with the
    word's other tokens (as vLLM does; a one-token word is always banned).

    ``tail``: [rows, W] the last W generated ids (-1 before the first); per bad word
    (``pair_*``, one entry per (row, word)): its row, its last token, and its other tokens
    right-aligned in [W] with -2 before them ("anything": shorter words match fewer ids)."""
    matches = ((tail[pair_row] == pair_prefix) | (pair_prefix == -2)).all(dim=-1)
    # Added, not assigned: two words of a row may share a last token, and assigning with
    # repeated indices keeps an arbitrary one of the values.
    ban = torch.where(matches, float("-inf"), 0.0).to(logits.dtype)
    return logits.index_put((pair_row, pair_last), ban, accumulate=True)


def needs_processing(params: list[SamplingParams], history: TokenHistory | None) -> bool:
    """Does any row ask for what process_logits applies?"""
    return (any(p.allowed_token_ids or p.logit_bias for p in params)
            or (history is not None and (any(p.uses_penalties for p in params) or any(history.bad_words))))


def process_logits(logits: torch.Tensor, params: list[SamplingParams], history: TokenHistory | None) -> torch.Tensor:
    """Apply, in vLLM's order, allowed_token_ids, bad_words, logit_bias and the penalties."""
    vocab, device = logits.shape[-1], logits.device
    if not needs_processing(params, history):
        return logits
    use_allowed = any(p.allowed_token_ids for p in params)
    use_bias = any(p.logit_bias for p in params)
    use_penalties = history is not None and any(p.uses_penalties for p in params)
    use_bad = history is not None and any(history.bad_words)
    ints: dict[str, np.ndarray] = {}
    floats: dict[str, np.ndarray] = {}
    if use_allowed:
        ints["restricted"] = np.array([p.allowed_token_ids is not None for p in params], dtype=np.int64)
        ints["allowed"] = np.array([[r, t] for r, p in enumerate(params) for t in p.allowed_token_ids or ()],
                                   dtype=np.int64).reshape(-1, 2)
    if use_bias:
        cells = [(r, t, b) for r, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        ints["bias_cells"] = np.array([c[:2] for c in cells], dtype=np.int64).reshape(-1, 2)
        floats["bias"] = np.array([c[2] for c in cells], dtype=np.float32)
    if use_penalties or use_bad:
        ints["pending"] = np.array(history.pending, dtype=np.int64)
    if use_penalties:
        ints["prompt"] = padded(history.prompt, max(map(len, history.prompt)))
        ints["output"] = padded(history.output, max(map(len, history.output)))
        floats["penalties"] = np.array([[p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                                        [p.repetition_penalty for p in params]], dtype=np.float32)
    if use_bad:
        width = max(len(w) - 1 for words in history.bad_words for w in words)
        # A pending token comes after every id the host knows: a place is left for it.
        ints["tail"] = padded([out + [-1] * (pend >= 0) if width else []
                               for out, pend in zip(history.output, history.pending)], width, left=True)
        pairs = [(r, w) for r, words in enumerate(history.bad_words) for w in words]
        ints["pair_row"] = np.array([r for r, _ in pairs], dtype=np.int64)
        ints["pair_last"] = np.array([w[-1] for _, w in pairs], dtype=np.int64)
        prefix = np.full((len(pairs), width), -2, dtype=np.int64)
        for i, (_, w) in enumerate(pairs):
            if len(w) > 1:
                prefix[i, width - len(w) + 1 :] = w[:-1]
        ints["pair_prefix"] = prefix
    i = to_device(ints, torch.long, device)
    f = to_device(floats, torch.float32, device) if floats else {}
    newest = None
    if "pending" in i and history.pending_tokens is not None:
        has = i["pending"] >= 0
        newest = (has, history.pending_tokens[i["pending"].clamp(min=0)])  # read on the device: no sync
    if use_allowed:
        logits = allowed_tokens_mask(logits, i["restricted"].bool(), i["allowed"])
    if use_bad:
        tail = i["tail"]
        if newest is not None and tail.shape[1]:
            tail = tail.clone()
            tail[:, -1] = torch.where(newest[0], newest[1], tail[:, -1])
        logits = bad_words_mask(logits, tail, i["pair_row"], i["pair_last"], i["pair_prefix"])
    if use_bias:
        logits = add_logit_bias(logits, i["bias_cells"], f["bias"])
    if use_penalties:
        prompt_counts = token_counts(i["prompt"], vocab)
        output_counts = token_counts(i["output"], vocab)
        if newest is not None:
            output_counts.scatter_add_(1, newest[1].unsqueeze(-1), newest[0].to(torch.int32).unsqueeze(-1))
        presence, frequency, repetition = f["penalties"]
        logits = repetition_penalty(logits, (prompt_counts > 0) | (output_counts > 0), repetition)
        logits = presence_frequency_penalty(logits, output_counts, presence, frequency)
    return logits
