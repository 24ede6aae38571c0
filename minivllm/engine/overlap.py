"""Asynchronous scheduling (chapter 17): the host prepares step N+1 while the device runs
step N. The step variant ``LLMEngine.step`` hands over to when ``async_scheduling`` is on.

The same three parts as the synchronous step, in another order: schedule and execute step
N+1 first — its sequences read the tokens step N sampled where they are, on the device
(``previous``: those tokens and each sequence's row) — and only then take in step N's
tokens, while the device computes N+1. A sequence counts the tokens sampled for it but not
yet on the host (``Sequence.num_pending``), and the scheduler plans over them.

One feature needs a token before it can sample: a grammar's mask depends on the token the
step in flight sampled. Such a step's forward pass goes on the device at once, and its
sampling waits until step N is taken in (``sample_deferred``)."""
import time
import weakref

from minivllm.engine.trace import profiler_range


class OverlappedStep:
    def __init__(self, engine):
        # The LLMEngine whose step this is, held weakly: the engine holds this object, and a
        # cycle would keep an engine that was let go (its KV pool too) until a full collection.
        self.engine = weakref.proxy(engine)
        self.in_flight = None  # the LaunchedStep on the device, whose tokens are not taken in yet
        self.launched_none = False  # the last launch found nothing to run (the loop drains)

    def step(self) -> list:
        """Launch step N+1, then take in step N: the outputs returned are step N's."""
        start = time.perf_counter()
        # BEGIN SOLUTION ch17 overlapped_step
        engine = self.engine
        outputs = engine.before_schedule()
        launched = self.launch()
        processed, self.in_flight = self.in_flight, launched
        outputs += self.process(processed)
        if launched is not None:
            if launched.deferred is not None:
                self.sample_deferred(launched)  # its grammars now know the tokens of `processed`
            engine.account(launched, processed, start)
        return outputs
        # END SOLUTION

    def launch(self):
        """Schedule the next batch and execute it, its pending inputs read from the step in
        flight; the LaunchedStep, or None when there is nothing to run."""
        with profiler_range("minivllm.launch"):
            batch = self.engine.schedule()
            launched = self.engine.execute(batch, self.previous_tokens()) if batch is not None else None
        self.launched_none = launched is None
        return launched

    def process(self, step) -> list:
        """Take in a launched step's tokens (waiting for them): its outputs; none for no step."""
        with profiler_range("minivllm.process"):
            outputs = self.engine.update(step) if step is not None else []
        if step is not None and self.launched_none:
            # Nothing was launched with it, so no step record follows to carry the sequences
            # it finished: the last record takes them.
            self.engine.tracer.note_finished(step.finished)
        return outputs

    def previous_tokens(self):
        """The step in flight's sampled tokens, on the device, and each sequence's row in them."""
        # BEGIN SOLUTION ch17 previous_tokens
        if self.in_flight is None or self.in_flight.sampled is None:
            return None
        return self.in_flight.sampled.token_ids, self.in_flight.row_of()
        # END SOLUTION

    def sample_deferred(self, step) -> None:
        """Sample a step whose forward pass went ahead of its token mask."""
        # BEGIN SOLUTION ch17 sample_deferred
        logits, inputs = step.deferred
        step.deferred = None
        if logits is not None:
            step.sampled = self.engine.runner.sample(logits, inputs.params, inputs.generators, inputs.banned,
                                                     inputs.history, step.mask_later(step.requests))
        # END SOLUTION
