"""n completions of one prompt (``SamplingParams.n``): n sequences, of which the first
computes the prompt and then forks into the others, which start from its blocks (copy on
write for the partial one, ``BlockManager.fork``) and from then on step as any sequence.

The step that computes the prompt's last token samples n tokens from its last logits, one
per completion, each with its own generator."""
import torch

from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.step_hooks import StepFeature


def new_group(prompt_token_ids: list[int], params, request_id: str | None, input_processor, device,
              prompt: str | None, stream: bool) -> list:
    """The RequestStates of a new request's completions, in index order, sharing one list."""
    first = Sequence(prompt_token_ids, params, request_id)
    seqs = [first] + [Sequence(prompt_token_ids, params, first.request_id) for _ in range(params.n - 1)]
    group = []
    for i, seq in enumerate(seqs):
        seq.index = i
        generator = None
        if params.seed is not None:  # each completion its own stream of draws
            generator = torch.Generator(device=device).manual_seed((params.seed + i) % 2**64)
        group.append(input_processor.new_request(seq, prompt, generator, stream))
    for request in group:
        request.group = group
    first.num_forks = params.n - 1
    return group


class ParallelSampling(StepFeature):
    def __init__(self, scheduler, block_manager):
        self.scheduler = scheduler
        self.block_manager = block_manager

    def prepare(self, step) -> None:
        """A prompt reaching its last token samples a row for each of its forks too."""
        for i, first in [(i, r) for i, r in zip(step.rows, step.requests) if r.seq.num_forks]:
            step.rows += [i] * first.seq.num_forks
            step.requests += first.group[1:]

    def after_execute(self, step) -> None:
        """The prompts computed: their other completions start from their blocks."""
        for first in [r for r in step.requests if r.seq.num_forks]:
            for request in first.group[1:]:
                self.block_manager.fork(first.seq, request.seq)
                request.seq.status = SequenceStatus.RUNNING
                self.scheduler.running.append(request.seq)
            first.seq.num_forks = 0
