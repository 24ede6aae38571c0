"""How a per-request feature joins the engine's step without living inside it.

The step is schedule → execute → update (``minivllm.engine.llm_engine``). A feature — n
completions, prompt logprobs, structured output, speculative decoding — is a ``StepFeature``
the engine calls at these named points, in this order; each hook does nothing unless the
feature overrides it. The engine keeps a list of the features some request has asked for, so
a feature nobody uses runs none of its code. To add the next feature, subclass this, override
the hooks it needs, and keep its per-request state in its own module (the book's architecture
page walks through one).

This module sits below the engine, ``structured/`` and ``spec_decode/`` alike, so each of them
can define a feature without importing the engine."""
import weakref


class StepFeature:
    def before_schedule(self) -> list:
        """Before the scheduler runs: e.g. queue requests whose grammar has compiled, give
        running sequences their drafts. Returns outputs of requests it ended (failed)."""
        return []

    def after_schedule(self, batch) -> None:
        """The scheduler has chosen ``batch`` (a ScheduledBatch; it may be empty)."""

    def prepare(self, step) -> None:
        """Before the model runs ``step`` (a LaunchedStep): add sampler rows, prompt-logprob
        runs, drafts to verify, or a token mask."""

    def after_execute(self, step) -> None:
        """The step is on the device and its sequences' computed tokens counted."""

    def after_sample(self, step, sampled, scored) -> list:
        """The step's tokens (and prompt scores) are on the host, before they are appended:
        e.g. verify drafts, advance grammars. Returns ``(RequestState, error)`` pairs for
        requests that must fail alone."""
        return []

    def on_finish(self, seq) -> None:
        """A sequence ended (finished, failed or aborted): forget what is kept for it."""

    def on_abort(self, request_id: str) -> bool:
        """A request is aborted. True: the feature held it, outside the scheduler."""
        return False

    def has_unfinished(self) -> bool:
        """Does the feature hold requests the scheduler does not know yet?"""
        return False

    def shutdown(self) -> None:
        """The engine shuts down: give back threads, processes or device memory."""


def is_live(request, requests: dict) -> bool:
    """Is ``request`` (a RequestState) still the engine's and unfinished? A step's tokens can
    arrive for a request aborted, or failed, while the step ran."""
    return requests.get(request.seq.request_id) is request.group[0] and not request.seq.is_finished


def hook_names() -> list[str]:
    """The hooks, in the order the step calls them."""
    return [name for name in vars(StepFeature) if not name.startswith("_")]


def overridden_hooks(feature: type) -> list[str]:
    """The hooks a feature class overrides (the book's architecture figure is drawn from these)."""
    return [name for name in hook_names() if getattr(feature, name) is not getattr(StepFeature, name)]


def weakly(method):
    """``method`` (a bound method) as a function that does not keep its object alive: what
    the engine hands its features, which it holds itself."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)
