"""What several test modules check with, or ask of the model, defined once."""
import collections
import contextlib
import random

import pytest

# Two tools with bounded arguments, for the chat-template and tool-call tests (offline and served).
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris?"}]


def same_outputs(a, b, logprob_tol: float = 1e-5, rel: float | None = None) -> None:
    """Speculation on against off: the same tokens, text, finish and stop reasons, and
    logprobs of the same ranks with values within ``logprob_tol`` (and ``rel``, if given)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        x, y = x.outputs[0], y.outputs[0]
        assert x.token_ids == y.token_ids
        assert x.text == y.text
        assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
        if x.logprobs is not None:
            for e, f in zip(x.logprobs, y.logprobs, strict=True):
                assert {t: lp.rank for t, lp in e.items()} == {t: lp.rank for t, lp in f.items()}
                assert [lp.logprob for lp in e.values()] == pytest.approx([lp.logprob for lp in f.values()],
                                                                          rel=rel, abs=logprob_tol)


class OracleProposer:
    """Drafts what greedy decoding without speculation produced next (``reference``: prompt
    -> output tokens), with one draft, at a random place or at none, made wrong: so the
    target accepts 0, 1, .., k drafts, each length about as often. ``lengths`` counts how
    many drafts it expects accepted at each proposal. One time in five it proposes nothing,
    so that plain decode steps come between the verifying ones."""

    block_bytes = 0

    def __init__(self, reference: dict[tuple, list[int]], vocab_size: int, seed: int = 0):
        self.reference, self.vocab_size = reference, vocab_size
        self.rng = random.Random(seed)
        self.lengths = collections.Counter()

    def allocate(self, num_blocks: int, runner=None) -> None:
        pass

    def forget(self, seq) -> None:
        pass

    def propose(self, seqs, ks):
        drafts = []
        for seq, k in zip(seqs, ks):
            if self.rng.random() < 0.2:
                drafts.append([])
                continue
            done = seq.num_output_tokens
            right = self.reference[tuple(seq.prompt_token_ids)][done : done + k]
            wrong = self.rng.randint(0, len(right))  # len(right): every draft right
            if wrong < len(right):
                right[wrong] = (right[wrong] + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
            self.lengths[wrong] += 1
            drafts.append(right)
        return drafts


# -- the served tiny model (the server test modules) -----------------------------------

SERVED_MODEL = "tiny-qwen3"  # the name clients ask for
SERVED_KEY = "test-key"
SERVED_ENGINE = dict(num_kv_blocks=512, block_size=8, max_num_seqs=64)


def served_checkpoint(tmp_path_factory, name: str):
    """The tiny Qwen3 (with a tokenizer) that the server tests serve and run offline."""
    from minivllm.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp(name), family="qwen3", seed=3, with_tokenizer=True)


@contextlib.contextmanager
def offline_engine(checkpoint):
    """The offline LLM on the served checkpoint, one torch thread (as the server's)."""
    from minivllm import LLM
    from minivllm.testing import torch_threads

    with torch_threads(1):
        yield LLM(str(checkpoint), **SERVED_ENGINE)


@contextlib.contextmanager
def threaded_server(checkpoint, config=None, engine=None):
    """The app on a thread of this process over ``engine`` (default: an AsyncLLMEngine on
    the checkpoint, in this process), with ``config`` (default: the API key only); the
    running server carries its engine as ``.engine``."""
    from minivllm import LLM
    from minivllm.server import AsyncLLMEngine
    from minivllm.server.api import ServerConfig, ServerThread, build_app
    from minivllm.testing import torch_threads

    with torch_threads(1):
        engine = engine if engine is not None else AsyncLLMEngine(LLM(str(checkpoint), **SERVED_ENGINE).engine)
    with ServerThread(build_app(engine, SERVED_MODEL, config=config or ServerConfig(api_key=SERVED_KEY))) as running:
        running.engine = engine
        yield running
