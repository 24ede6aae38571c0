"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the score of every prompt token,
computed from the logits of the position before it as the prompt's chunks run.

Position p scores prompt token p + 1; the prompt's last position predicts the first output
token instead, the sampler's row. The runner scores the runs of positions this feature names
(``batch.prompt_logprobs``) beside the step's sampling, and the scores are recorded here,
in order, once they are on the host."""
import logging

import torch

from minivllm.layers.sampled_tokens import SampledTokens
from minivllm.outputs import Logprob
from minivllm.step_hooks import StepFeature, is_live

logger = logging.getLogger(__name__)

# Prompt logprobs score many rows at once (a whole prompt chunk): their logits are computed
# in slices of at most this many elements (rows x vocabulary, 64 MiB in float32), so the
# memory they take does not grow with the chunk. A slice fits in the share of the card that
# gpu_memory_utilization leaves unassigned; the warm-up does not measure it.
PROMPT_LOGITS_ELEMENTS = 2**24


def score_prompt_rows(model, hidden: torch.Tensor, ctx) -> tuple[torch.Tensor, ...]:
    """For each prompt row: the prompt token after it, that token's log-probability, its
    rank (1 = most likely) and the ``ctx.prompt_top_k`` most likely tokens with theirs,
    as the sampler reports a sampled token's (from the model's raw logits). Computed a
    slice of rows at a time (PROMPT_LOGITS_ELEMENTS), so that a long chunk never holds
    all its logits at once."""
    rows, targets, k = ctx.prompt_logits_indices, ctx.prompt_targets, ctx.prompt_top_k
    per_slice = max(1, PROMPT_LOGITS_ELEMENTS // model.config.vocab_size)
    parts = []
    for start in range(0, rows.shape[0], per_slice):
        logits = model.compute_logits(hidden[rows[start : start + per_slice]], all_tokens=True)
        logprobs = logits.float().log_softmax(dim=-1)
        chosen = logprobs.gather(-1, targets[start : start + per_slice].unsqueeze(-1))
        rank = (logprobs > chosen).sum(dim=-1) + 1
        top = logprobs.topk(k, dim=-1)
        parts.append((chosen.squeeze(-1), rank, top.indices, top.values))
    return (targets, *(torch.cat(p) for p in zip(*parts)))


def as_sampled_tokens(scores: tuple[torch.Tensor, ...]) -> SampledTokens:
    """The prompt rows' scores in the sampler's shape, as if each scored prompt token had been
    sampled there (their copy to the host under way)."""
    targets, chosen, rank, top_ids, top_values = scores
    return SampledTokens(targets, (chosen, rank, top_ids, top_values), [top_ids.shape[1]] * targets.shape[0])


class PromptLogprobs(StepFeature):
    def __init__(self, requests: dict, state_of, tokenizer):
        self.requests = requests  # the engine's: request id -> its first completion's state
        self.state_of = state_of  # Sequence -> its RequestState
        self.tokenizer = tokenizer

    def prepare(self, step) -> None:
        """Which positions of the batch score a prompt token this step, as (sequence i,
        first position, count), and the request each run belongs to (``step.scoring``)."""
        batch = step.batch
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.sampling_params.prompt_logprobs is None or seq.index:
                continue  # (the n completions of a prompt share its first one's scores)
            request = self.state_of(seq)
            # After a preemption the prompt is computed again; the tokens it scored before
            # are not scored twice. (A preempted sequence comes back only once no step of it
            # is in flight, so what it scored is all in its list by then.)
            first = max(seq.num_computed_tokens, len(request.prompt_logprobs) - 1)
            end = min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1)
            if end > first:
                batch.prompt_logprobs.append((i, first, end - first))
                step.scoring.append(request)

    def after_sample(self, step, sampled, scored) -> list:
        """Give each request the scores of its prompt tokens from this step; a request whose
        scores cannot be recorded fails, with the forks of its prompt (which never start)."""
        if scored is None:
            return []
        row, failed = 0, []
        for (_, first, count), request in zip(step.batch.prompt_logprobs, step.scoring):
            rows = scored.logprobs[row : row + count]
            row += count
            if not is_live(request, self.requests):
                continue  # aborted, or failed, while the step ran
            try:
                self.append(request, first, rows)
            except Exception as e:  # e.g. its detokenizer: this request's problem alone
                logger.exception("recording the prompt logprobs of request %s failed", request.seq.request_id)
                error = f"recording its prompt logprobs failed: {type(e).__name__}"
                failed += [(completion, error) for completion in request.group]
        return failed

    def append(self, request, first: int, rows: list) -> None:
        """Record the scores of prompt tokens first + 1, first + 2, ... (one row each: the
        token's log-probability, its rank, the top token ids and their log-probabilities),
        each entry shaped as a sampled token's: the request's k most likely tokens, and the
        prompt's own token if it is not among them."""
        scored = request.prompt_logprobs
        if len(scored) != first + 1:
            raise RuntimeError(f"prompt logprobs of request {request.seq.request_id} arrive for token {first + 1}, "
                               f"after {len(scored)} tokens: they must come in order")
        k = request.seq.sampling_params.prompt_logprobs
        targets = request.prompt_token_ids[first + 1 : first + 1 + len(rows)]
        text = self._decode_each({t for target, row in zip(targets, rows) for t in (target, *row[2][:k])})
        for token, (chosen, rank, top_ids, top_values) in zip(targets, rows):
            entry = {tid: Logprob(v, rank=r + 1, decoded_token=text.get(tid))
                     for r, (tid, v) in enumerate(zip(top_ids[:k], top_values[:k]))}
            if token not in entry:
                entry[token] = Logprob(chosen, rank=rank, decoded_token=text.get(token))
            scored.append(entry)

    def _decode_each(self, token_ids: set[int]) -> dict[int, str]:
        """Each token's own text, in one call to the tokenizer (a prompt chunk's worth of
        tokens one call each would be thousands of calls)."""
        if self.tokenizer is None:
            return {}
        ids = sorted(token_ids)
        return dict(zip(ids, self.tokenizer.batch_decode([[t] for t in ids])))
