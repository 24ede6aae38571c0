"""What the sampler needs for each of a step's rows, besides the logits: each row's
SamplingParams and generator, the ids it may not draw yet (min_tokens), and the tokens it
has seen (penalties, bad words). A row is a completion that samples this step; a sequence
verifying d drafts has d + 1 rows (speculative decoding)."""
from dataclasses import dataclass

import torch

from minivllm.layers.logits_processors import TokenHistory


@dataclass
class SamplerInputs:
    params: list
    generators: list
    banned: list[list[int]]
    history: TokenHistory | None


def sampler_inputs(step, input_processor, previous: tuple | None) -> SamplerInputs:
    """The rows of ``step`` (a LaunchedStep). ``previous``: the step in flight's sampled
    tokens on the device and its rows (asynchronous scheduling), or None."""
    requests = step.requests
    if any(step.drafts):  # a row per position: the draft at position j has j more tokens before it
        requests = [r for r, d in zip(step.requests, step.drafts) for _ in range(len(d) + 1)]
        banned = [input_processor.banned(r, j) for r, d in zip(step.requests, step.drafts) for j in range(len(d) + 1)]
    else:
        banned = [input_processor.banned(r) for r in requests]
    history = token_history(requests, previous) if any(r.needs_history for r in step.requests) else None
    return SamplerInputs([r.seq.sampling_params for r in requests], [r.generator for r in requests], banned, history)


def token_history(requests: list, previous: tuple[torch.Tensor, dict[int, int]] | None) -> TokenHistory:
    """What each sampled row has seen, for its penalties and bad words (empty lists for a row
    that uses neither). A token the step in flight sampled is not on the host yet: its place
    in that step's tokens, on the device, is passed instead."""
    prompt, output, pending, bad_words = [], [], [], []
    for r in requests:
        seq, params = r.seq, r.seq.sampling_params
        prompt.append(r.prompt_token_ids if params.repetition_penalty != 1 else [])
        output.append(seq.output_token_ids if r.needs_history else [])
        pending.append(previous[1][seq.seq_id] if seq.num_pending and r.needs_history else -1)
        bad_words.append(r.bad_words)
    return TokenHistory(prompt, output, pending, previous[0] if previous is not None else None, bad_words)
