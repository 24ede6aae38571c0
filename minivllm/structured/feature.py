"""Structured output's part in the engine's step: the grammar lifecycle of a request.

    compile   add_request looks the grammar up in the compiler's cache; one that is not there
              is compiled on the compiler's threads while the engine steps the other requests
    admit     before scheduling, requests whose grammar has compiled join the scheduler's
              queue (one that could not be compiled fails alone, finish_reason "error")
    mask      before the model runs, the batch's token bitmask: what each row's grammar allows
              (everything, while a reasoning model reasons: its grammar starts after the
              reasoning's end token, StructuredOutputsParams.reasoning_end_token_id)
    defer     under asynchronous scheduling a grammar may need the token the step in flight
              sampled: the forward pass goes on the device now and the sampling waits for
              the mask (minivllm.engine.overlap samples it once that token is known)
    accept    after sampling, each grammar advances by its token, all at once (a grammar not
              started yet only looks for the token that starts it)

The engine builds this feature when the first constrained request arrives; until then none of
this runs."""
import threading
from concurrent import futures

from minivllm.step_hooks import StepFeature, is_live

# How long a step with nothing else to do waits for a grammar being compiled, before it returns
# (so that the caller's loop takes in new requests and aborts meanwhile).
GRAMMAR_WAIT_S = 0.05
# What a grammar's refusal of a sampled token says. The mask lets through only what the
# grammar allows, so a refused token means the row had nothing left to draw: the request's
# own allowed_token_ids, bad_words or logit_bias banned every token the grammar allows there
# (the server answers that with a 400, as any other bad request).
NOTHING_TO_SAMPLE = "nothing could be sampled"


class StructuredOutputs(StepFeature):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, pinned: bool, scheduler, requests: dict,
                 make_output, is_idle):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.pinned = pinned  # the bitmask's host buffers pinned (a GPU engine)
        self.scheduler = scheduler
        self.requests = requests  # the engine's: request id -> its first completion's state
        self.make_output = make_output  # RequestState -> RequestOutput
        self.is_idle = is_idle  # () -> nothing scheduled and nothing on the device
        self._compiler = None  # made when the first request needs it
        self._lock = threading.Lock()  # (a server asks for the compiler from its own thread)
        # Requests whose grammar is being compiled: id -> (future, first completion).
        self.compiling: dict[str, tuple[futures.Future, object]] = {}
        # Where each constrained completion stands in its grammar: seq_id -> GrammarState,
        # from its grammar's compile until the completion ends (on_finish).
        self.grammars: dict[int, object] = {}
        self.bitmask_buffers = None  # BitmaskBuffers, made at the first constrained step

    def compiler(self):
        """The grammar compiler (chapter 18), made when the first request needs it."""
        with self._lock:
            if self._compiler is None:
                from minivllm.structured.compiler import grammar_compiler_for

                self._compiler = grammar_compiler_for(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._compiler

    def add(self, group: list) -> bool:
        """A new request's completions: give them their grammar if it is compiled (True: it
        can be scheduled now), else start compiling it (False: it waits here)."""
        spec = group[0].seq.sampling_params.structured_outputs
        compiled = self.compiler().lookup(spec)
        if compiled is None:  # (a failed compile fails the request in a later step, never here)
            self.compiling[group[0].seq.request_id] = (self.compiler().submit(spec), group[0])
            return False
        self._give_grammars(group, compiled)
        return True

    def _give_grammars(self, group: list, compiled) -> None:
        """Each completion of a request walks the grammar on its own."""
        from minivllm.structured.matcher import GrammarState

        spec = group[0].seq.sampling_params.structured_outputs
        token_filter, guard = self.compiler().token_filter(spec), self.compiler().surrogate_guard(spec)
        for request in group:
            self.grammars[request.seq.seq_id] = GrammarState(
                compiled, token_filter, waits_for=spec.reasoning_end_token_id, surrogate_guard=guard)

    def before_schedule(self) -> list:
        """Queue the requests whose grammar has compiled; fail those whose grammar could not
        be (their outputs are returned). With nothing else to run, wait a little for one."""
        if not self.compiling:
            return []
        if self.is_idle():
            futures.wait([f for f, _ in self.compiling.values()], timeout=GRAMMAR_WAIT_S,
                         return_when=futures.FIRST_COMPLETED)
        failed = []
        for request_id, (future, first) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            try:
                self._give_grammars(first.group, future.result())
            except Exception as e:  # InvalidParameter: its spec, checked by nobody before
                for request in first.group:
                    request.error = f"structured output: {e}"
                    request.seq.finish("error")
                del self.requests[request_id]
                failed.append(self.make_output(first))
                continue
            self.scheduler.add(first.seq)
        return failed

    def prepare(self, step) -> None:
        """The step's token mask; or, when a grammar needs a token still on the device, ask
        for the sampling to wait for the mask (step.mask_later). A grammar waiting for the end
        of a reasoning needs it too: that token may be the one that starts it."""
        constrained = [r for r in step.requests if r.seq.seq_id in self.grammars]
        if not constrained:
            return
        if any(r.seq.num_pending for r in constrained):
            step.mask_later = self.bitmask
        else:
            step.bitmask = self.bitmask(step.requests)

    def bitmask(self, requests: list):
        """The tokens each sampled row's grammar allows next (every token for a row without
        one, whose grammar has not started, or whose request has ended), on the host; None
        when no row's grammar has anything to say (the sampler then needs no mask). Written
        into buffers kept from step to step (pinned on a GPU, so that the upload copies
        nothing first)."""
        from minivllm.structured.matcher import BitmaskBuffers, fill_bitmask

        states = [self.grammars.get(r.seq.seq_id) for r in requests]
        states = [None if state is None or r.seq.is_finished or not state.constrains else state
                  for r, state in zip(requests, states)]
        if not any(states):
            return None
        if self.bitmask_buffers is None:
            self.bitmask_buffers = BitmaskBuffers(self.vocab_size, pinned=self.pinned)
        return fill_bitmask(states, self.vocab_size, out=self.bitmask_buffers.take(len(states)))

    def after_sample(self, step, sampled, scored) -> list:
        """Advance the grammars of the step's constrained requests by their sampled tokens,
        all at once (on the matchers' threads at a large batch). A token a grammar refuses
        fails its request: the mask allowed only what the grammar allows, so this is a bug,
        but one request's. (Only requests that emit exactly one token this step, which is
        every constrained one: speculation refuses structured outputs.)"""
        from minivllm.structured.matcher import accept_tokens

        if sampled is None:
            return []
        rows, states, tokens = [], [], []
        for request, row, drafts in zip(step.requests, step.first_rows, step.drafts):
            state = self.grammars.get(request.seq.seq_id)
            if state is not None and is_live(request, self.requests) and not drafts and row not in sampled.errors:
                rows.append((request, row))
                states.append(state)
                tokens.append(sampled.token_ids[row])
        if not rows:
            return []
        return [(request, f"structured output: the sampled token {sampled.token_ids[row]} is not allowed by the "
                          f"grammar: {NOTHING_TO_SAMPLE} (the request's allowed_token_ids, bad_words or logit_bias "
                          "leave no token the grammar allows here)")
                for (request, row), ok in zip(rows, accept_tokens(states, tokens)) if not ok]

    def on_finish(self, seq) -> None:
        self.grammars.pop(seq.seq_id, None)

    def on_abort(self, request_id: str) -> bool:
        # (A compile under way finishes for the cache.)
        return self.compiling.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.compiling)

    def shutdown(self) -> None:
        """End the grammar compiler's worker processes, if it was made."""
        with self._lock:
            if self._compiler is not None:
                self._compiler.shutdown()
