"""What several test modules check with, or ask of the model, defined once."""
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
