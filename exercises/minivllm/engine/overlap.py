# Exercise copy of minivllm/engine/overlap.py, generated from it by scripts/make_exercises.py.
# Fill in: OverlappedStep.step (ch17), OverlappedStep.previous_tokens (ch17), OverlappedStep.sample_deferred (ch17).
# Grade: make grade CH=17
# Running the generator again overwrites this file: commit or copy your work first.

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
        raise NotImplementedError(
            "ch17: OverlappedStep.step: the synchronous step's three parts (schedule, execute, "
            "update) in another order. Take the engine's outputs from before_schedule; launch the "
            "next batch at once (when there is one), its pending inputs read from the step in "
            "flight's tokens on the device; only then take in the step that was in flight "
            "(update), while the device computes the new one, which becomes the step in flight. A "
            "newly launched step whose sampling was deferred (a grammar waits for the tokens just "
            "taken in) is sampled now, after the update; then the engine accounts for the launched "
            "and the processed step with the start time. Return the outputs: those of the step "
            "taken in. Pitfall: updating before executing gives the same tokens but no overlap. "
            "The given launch and process methods schedule and execute the next batch, and take a "
            "step in, see notebooks/17_async_scheduling.ipynb"
        )

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
        raise NotImplementedError(
            "ch17: previous_tokens: what the next step's pending rows read: the step in flight's "
            "sampled token ids (on the device) and each sequence's row in them (the step's "
            "row_of). None when nothing is in flight, or when the step in flight sampled nothing "
            "yet, see notebooks/17_async_scheduling.ipynb"
        )

    def sample_deferred(self, step) -> None:
        """Sample a step whose forward pass went ahead of its token mask."""
        raise NotImplementedError(
            "ch17: sample_deferred: a step whose forward pass went ahead of its grammar masks kept "
            "its logits and sampling inputs in step.deferred. Take them and clear the field (it "
            "must not be sampled twice); where there are logits, sample them with the runner, with "
            "the inputs' parameters, generators, banned tokens and history, and the masks the "
            "step's requests give now (mask_later), and store the result as the step's sampled "
            "tokens, see notebooks/17_async_scheduling.ipynb"
        )
