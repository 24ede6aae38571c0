"""Which Triton kernels compile inside a block of code.

Triton compiles a kernel the first time it is launched with a new specialisation (new
constexpr values, or an integer or pointer argument whose divisibility by 16 changed), and
a process that finds the binary in Triton's disk cache still pays for loading it. Done
inside a timed run, that is seconds of a user's first run; ``LLM`` construction is meant
to do all of it (``ModelRunner.compile_kernels``), and this says whether it did.
"""
from contextlib import contextmanager


@contextmanager
def triton_compiles():
    """Collect, in the list this yields, the name and specialisation of every kernel that
    Triton compiles or loads from its disk cache inside the block, each once (compiling
    ahead, kernels.compile_ahead, asks for a kernel at every launch until it is ready)."""
    from triton import knobs

    seen: list[str] = []
    keys: set = set()
    previous = knobs.runtime.jit_cache_hook

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        if (repr, key) not in keys:
            keys.add((repr, key))
            seen.append(repr)
        if previous is not None:
            return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                            already_compiled=already_compiled)
        return False  # go on and compile

    knobs.runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_cache_hook = previous
