# Exercise copy of minivllm/engine/sequence.py, generated from it by scripts/make_exercises.py.
# Fill in: Sequence.last_token_pending (ch17).
# Grade: make grade CH=17
# Running the generator again overwrites this file: commit or copy your work first.

"""A request as the engine sees it: its tokens, its progress and the KV blocks it holds."""
import itertools
from enum import Enum, auto

from minivllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = itertools.count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, request_id: str | None = None):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        # Tokens whose keys and values are in the cache (found there, or computed).
        # The scheduler computes tokens num_computed_tokens .. num_tokens - 1 next.
        self.num_computed_tokens = 0
        # Of those, how many were found in the prefix cache at admission.
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.state_slot: int | None = None  # hybrid models: the slot of its recurrent state
        self.finish_reason: str | None = None
        # Asynchronous scheduling (chapter 17): tokens already sampled on the device whose ids
        # the host does not know yet. The scheduler counts them (the next step computes the
        # newest one); token_ids gets them when the step that sampled them is processed.
        self.num_pending = 0
        # SamplingParams.n: which of the request's completions this is, and (for the first,
        # which computes the prompt) how many more it forks into once the prompt is done.
        self.index = 0
        self.num_forks = 0
        self.num_preemptions = 0
        # Speculative decoding (chapter 19): tokens proposed to follow token_ids, which the
        # next step verifies; set by the engine before scheduling, cut by the scheduler to
        # what its budget allows.
        self.draft_token_ids: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """The tokens the scheduler plans over: those in token_ids and those still pending."""
        return len(self.token_ids) + self.num_pending

    @property
    def last_token_pending(self) -> bool:
        """Is the token still on the device the sequence's last (it reaches max_tokens)? Then
        the scheduler leaves it out: a step for it would compute a token nobody wants."""
        if not self.num_pending:
            return False  # nothing is on the device (always so in the synchronous loop)
        raise NotImplementedError(
            "ch17: last_token_pending (num_pending > 0 here): whether the token still on the "
            "device is the sequence's last: true when its output tokens, those on the host and "
            "those pending on the device alike (all it has been scheduled beyond its prompt), "
            "already reach sampling_params.max_tokens, so that another step would compute a token "
            "past its end. A max_tokens of None never ends it, see "
            "notebooks/17_async_scheduling.ipynb"
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def finish(self, reason: str) -> None:
        """Mark it finished (its blocks are the scheduler's to give back: Scheduler.finish)."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def num_blocks_needed(self, block_size: int, num_tokens: int | None = None) -> int:
        n = self.num_tokens if num_tokens is None else num_tokens
        return (n + block_size - 1) // block_size

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size : (i + 1) * block_size]

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, {self.status.name})")
