# Reference copy of minivllm/spec_decode/feature.py, generated from it by scripts/make_exercises.py.
# Reference answers for: Speculation.after_sample (ch19).
# Do not edit: change minivllm/spec_decode/feature.py and run scripts/make_exercises.py again.

"""Speculative decoding's part in the engine's step (chapter 19):

    propose   before scheduling, each running sequence in decode gets its drafts from the
              proposer (at most num_speculative_tokens, never past max_tokens or max_model_len)
    verify    the step runs 1 + d sampler rows for a sequence with d drafts (the engine lays
              them out from ``step.drafts``); once they are on the host, the longest prefix of
              drafts the target agrees with is accepted (``verify.num_accepted``)
    roll back the sequence's computed tokens and blocks are cut back to the accepted ones
              (before its full blocks are hashed, so that only known tokens are), and a hybrid
              model's states to those the step kept after the last accepted token

The engine runs the synchronous loop with speculation (see the package's docstring for why)."""
from minivllm.spec_decode.verify import num_accepted
from minivllm.step_hooks import StepFeature


class Speculation(StepFeature):
    def __init__(self, proposer, num_speculative_tokens: int, max_model_len: int, scheduler, block_manager,
                 runner, state_of, stats: dict):
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.runner = runner  # puts a hybrid model's accepted states back (keep_accepted_states)
        self.state_of = state_of  # Sequence -> its RequestState
        self.stats = stats  # the engine's: drafts verified, drafts accepted, verifying steps
        stats.update(spec_draft_tokens=0, spec_accepted_tokens=0, spec_verify_steps=0)

    def before_schedule(self) -> list:
        """Give each running sequence in decode its drafts for the next step. Every
        sequence's tokens are on the host (the synchronous loop)."""
        seqs, ks = [], []
        for seq in self.scheduler.running:
            seq.draft_token_ids = []
            if seq.num_pending or seq.num_computed_tokens != seq.num_tokens - 1 or seq.num_output_tokens == 0:
                continue  # not a decode (a prompt, or a chunk of one, is still to compute)
            if self.state_of(seq).needs_history:
                continue  # penalties and bad words would need each draft row's own history
            k = min(self.k, self.max_model_len - seq.num_tokens - 1)
            max_tokens = seq.sampling_params.max_tokens
            if max_tokens is not None:
                k = min(k, max_tokens - seq.num_output_tokens - 1)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        # (Also with no sequence to draft for: an MTP head takes in every step the target ran.)
        for seq, drafts in zip(seqs, self.proposer.propose(seqs, ks)):
            seq.draft_token_ids = drafts
        return []

    def after_schedule(self, batch) -> None:
        if any(seq.draft_token_ids for seq in batch.seqs):  # the drafts the scheduler kept (their budget)
            batch.num_drafts = [len(seq.draft_token_ids) for seq in batch.seqs]
        for seq in batch.preempted:  # a draft model computes it again from its tokens when it comes back
            self.proposer.forget(seq)

    def prepare(self, step) -> None:
        if step.batch.num_drafts:
            step.drafts = [step.batch.seqs[i].draft_token_ids for i in step.rows]

    def after_execute(self, step) -> None:
        for seq in step.batch.seqs:  # the drafts travel with the step now
            seq.draft_token_ids = []

    def after_sample(self, step, sampled, scored) -> list:
        """How many drafts each sampled request of the step accepted (step.accepted). The KV
        of rejected positions stays in the pool past the sequence's end, to be overwritten."""
        if not any(step.drafts):
            return []
        rolled_back = []
        for j, (request, drafts, row) in enumerate(zip(step.requests, step.drafts, step.first_rows)):
            n = len(drafts)
            a = num_accepted(drafts, sampled.token_ids[row : row + n + 1]) if n else 0
            step.accepted[j] = a
            seq = request.seq
            if not n or seq.is_finished:
                continue
            seq.num_computed_tokens -= n - a
            self.block_manager.shrink(seq, seq.num_computed_tokens + 1)  # + 1: the token this step appends
            if a < n and seq.state_slot is not None:  # a hybrid model's state ran past the rejected drafts
                rolled_back.append((seq.state_slot, a))
            request.num_draft_tokens += n
            request.num_accepted_tokens += a
            request.num_spec_steps += 1
            self.stats["spec_draft_tokens"] += n
            self.stats["spec_accepted_tokens"] += a
            self.stats["spec_verify_steps"] += 1
        if rolled_back:
            self.runner.keep_accepted_states(*map(list, zip(*rolled_back)))
        return []

    def on_finish(self, seq) -> None:
        self.proposer.forget(seq)

    def shutdown(self) -> None:
        self.proposer = None  # a draft model's weights and cache go with it
