"""Structured output after the reasoning (--reasoning-parser): a reasoning model thinks in free
text, and its grammar starts after the token that ends the reasoning (</think>), as vLLM's;
a prompt that closed the reasoning (enable_thinking=false) is constrained from the first
token; without a parser, nothing changes (test_structured_output). The usage counts the
reasoning's tokens.

The tiny model is random: what it reasons is scripted (a test hook bans, at each of the first
output positions, every token but the script's), and only the grammar makes its answer JSON."""
import json

import jsonschema
import openai
import pytest
from tokenizers import AddedToken, Tokenizer

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.engine.engine_args import BUNDLED_MODEL
from minivllm.errors import InvalidParameter
from minivllm.server.api import ServerConfig
from minivllm.server.reasoning import REASONING_PARSERS
from minivllm.structured import matcher
from minivllm.structured.matcher import GrammarState, fill_bitmask
from minivllm.testing import make_tiny_checkpoint, torch_threads, write_tiny_tokenizer
from minivllm.tokenizer import load_tokenizer
from shared import SERVED_ENGINE, SERVED_KEY, SERVED_MODEL, threaded_server

THINK, END = 512, 513  # the tags' ids: one token each, as in Qwen3's and DeepSeek-R1's vocabularies
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "tag": {"enum": ["a", "b"]}}, "required": ["x", "tag"]}
# Qwen3's generation prompt, with the empty reasoning its template writes when thinking is off.
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Qwen3 with <think> and </think> in its vocabulary (ids 512 and 513, past the
    trained tokenizer's 512, inside the model's 514 rows)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("thinking"), family="qwen3", seed=3, vocab_size=514,
                                eos_token_id=0)
    write_tiny_tokenizer(path, vocab_size=512)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")])
    tokenizer.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    for i, tag in ((THINK, "<think>"), (END, "</think>")):
        config["added_tokens_decoder"][str(i)] = {"content": tag, "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def script(engine, tokens: list[int]):
    """Make each request's first output tokens ``tokens`` (every other token banned there);
    after them the model, and its grammar, decide. Returns the list, to change per test."""
    processor, vocab = engine.input_processor, engine.runner.model_config.vocab_size
    original = type(processor).banned.__get__(processor)  # (not an earlier script's)

    def banned(request, position: int = 0) -> list[int]:
        done = request.seq.num_scheduled_tokens - request.seq.num_prompt_tokens + position
        if done < len(tokens):
            return [t for t in range(vocab) if t != tokens[done]]
        return original(request, position)

    processor.banned = banned
    return tokens


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(checkpoint, request):
    with torch_threads(1):
        yield LLM(str(checkpoint), async_scheduling=request.param, **SERVED_ENGINE)


@pytest.mark.parametrize("bad", [-1, True, "513", 1.0])
def test_a_bad_end_token_is_refused(bad):
    with pytest.raises(InvalidParameter, match="reasoning_end_token_id"):
        StructuredOutputsParams(json=POINT, reasoning_end_token_id=bad)


def test_the_tags_are_one_token_each(llm):
    tokenizer = llm.get_tokenizer()
    assert tokenizer.encode("<think>hm</think>", add_special_tokens=False)[::3] == [THINK, END]


def test_the_reasoning_is_free_and_the_answer_follows_the_schema(llm):
    """A reasoning the grammar would refuse from its first character, then </think>, then the
    answer: valid JSON of the schema. Several requests at once, some with n=2 (each completion
    waits for its own end), under both schedulers."""
    thought = llm.get_tokenizer().encode("hmm, no json here", add_special_tokens=False)
    script(llm.engine, thought + [END])
    spec = StructuredOutputsParams(json=POINT, reasoning_end_token_id=END)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=60, n=1 + s % 2, structured_outputs=spec)
              for s, t in enumerate([0, 1, 1, 1])]
    for output in llm.generate(["Hello", "Hi there", "Hello", "One"], params, use_tqdm=False):
        for c in output.outputs:
            assert c.token_ids[:len(thought) + 1] == thought + [END]
            reasoning, _, answer = c.text.partition("</think>")
            assert reasoning == "hmm, no json here" and c.finish_reason == "stop"
            jsonschema.validate(json.loads(answer), POINT)


def test_without_the_end_token_the_grammar_holds_from_the_first_token(llm):
    """The same script under a grammar that has started: its first token is not JSON, and the
    request fails alone, as a grammar that allows nothing the request allows does."""
    script(llm.engine, llm.get_tokenizer().encode("hmm", add_special_tokens=False))
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20,
                                                 structured_outputs=StructuredOutputsParams(json=POINT)),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error"
    script(llm.engine, [])
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=60,
                                                 structured_outputs=StructuredOutputsParams(json=POINT)),
                       use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), POINT)


def test_a_grammar_that_waits_is_no_mask_and_no_step_of_its_matcher(llm):
    """Before its end token a state masks nothing and its matcher stays at the start; the end
    token starts it (unseen by the matcher); one by one and in a batch alike."""
    tokenizer = llm.get_tokenizer()
    compiled = llm.engine.grammar_compiler().compile(StructuredOutputsParams(choice=["ab"]))
    walk = tokenizer.encode("x{", add_special_tokens=False) + [END] + tokenizer.encode("ab", add_special_tokens=False)
    single = [GrammarState(compiled, waits_for=END) for _ in range(matcher.BATCH_FILL_ROWS)]
    batched = [GrammarState(compiled, waits_for=END) for _ in range(matcher.BATCH_FILL_ROWS)]
    plain = GrammarState(compiled)
    vocab = llm.engine.runner.model_config.vocab_size
    end_at, answer = walk.index(END), len(walk) - walk.index(END) - 1
    for i, token in enumerate(walk):
        mask = fill_bitmask([*single[:2], plain], vocab)
        assert bool((mask[:2] == -1).all()) == (i <= end_at) and not bool((mask[2] == -1).all())
        assert all(state.accept(token) for state in single)
        assert all(matcher.accept_tokens(batched, [token] * len(batched)))
        assert all((s.waits_for is None) == (i >= end_at) for s in single + batched)
    assert all(s.constrains and s.num_accepted == answer and not s.matcher.is_terminated() for s in single + batched)
    assert GrammarState.rebuild(compiled, walk, waits_for=END).num_accepted == answer


def test_reasoning_tokens_counted_between_the_tags(llm):
    tokenizer = llm.get_tokenizer()
    qwen3, r1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
    assert qwen3.reasoning_tokens(tokenizer, [THINK, 5, 6, END, 7], "xy") == 2
    assert qwen3.reasoning_tokens(tokenizer, [THINK, 5, 6], "xy") == 2  # cut short
    assert qwen3.reasoning_tokens(tokenizer, [5, 6, 7], None) == 0
    assert r1.reasoning_tokens(tokenizer, [5, 6, END, 7], "xy") == 2  # no opening tag


@pytest.mark.parametrize("prompt, starts_after", [
    ("<|im_start|>assistant\n", END),  # the model decides whether it reasons
    ("<|im_start|>assistant\n<think>\n", END),  # the template opened the reasoning
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", None),  # enable_thinking false
    ("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n<think>\n", END),
    ("<|im_start|>assistant\n<think>a</think>\n\nSure, ", None),  # continued after its reasoning
])
def test_where_the_grammar_starts_is_the_prompts_last_tag(llm, prompt, starts_after):
    """As vLLM decides: the grammar waits for </think> unless the prompt's last tag closed a
    reasoning; a vocabulary without the tags as tokens starts it at once."""
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert REASONING_PARSERS["qwen3"].grammar_start(tokenizer, ids) == starts_after
    bundled = load_tokenizer(BUNDLED_MODEL)  # (its vocabulary spells the tags in several tokens)
    assert REASONING_PARSERS["qwen3"].grammar_start(bundled, bundled.encode(prompt, add_special_tokens=False)) is None


# -- through the server ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(checkpoint):
    config = ServerConfig(api_key=SERVED_KEY, reasoning_parser="qwen3", chat_template=THINKING_TEMPLATE)
    with threaded_server(checkpoint, config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=SERVED_KEY)


@pytest.fixture
def thinks(server):
    """The served model opens a reasoning, writes "hmm ok", closes it, then answers freely."""
    tokenizer = server.engine.tokenizer
    thought = tokenizer.encode("hmm ok", add_special_tokens=False)
    tokens = script(server.engine.engine, [THINK, *thought, END])
    yield thought
    tokens.clear()


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT}}


def test_chat_reasons_then_answers_the_schema(client, thinks):
    whole = client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=60, temperature=0, response_format=SCHEMA_FORMAT)
    message = whole.choices[0].message
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == "hmm ok"
    jsonschema.validate(json.loads(message.content), POINT)
    assert whole.usage.completion_tokens_details.reasoning_tokens == len(thinks)
    stream = client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=60, temperature=0, response_format=SCHEMA_FORMAT, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "hmm ok"
    assert "".join(d.content or "" for d in deltas) == message.content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == len(thinks)


def test_a_required_tool_call_follows_the_reasoning(client, thinks):
    tools = [{"type": "function", "function": {"name": "plot", "parameters": POINT}}]
    message = client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=80, temperature=0, tools=tools,
                                             tool_choice="required").choices[0].message
    assert message.model_extra["reasoning"] == "hmm ok"
    [call] = message.tool_calls
    assert call.function.name == "plot"
    jsonschema.validate(json.loads(call.function.arguments), POINT)


def test_enable_thinking_false_constrains_from_the_first_token(client):
    """The template closed the reasoning: the grammar holds at once, and there is no reasoning."""
    whole = client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=60, temperature=0, response_format=SCHEMA_FORMAT,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = whole.choices[0].message
    assert message.model_extra["reasoning"] is None
    jsonschema.validate(json.loads(message.content), POINT)
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0


def test_responses_count_the_reasoning_tokens(client, thinks):
    text_format = {"format": {"type": "json_schema", "name": "point", "schema": POINT}}
    whole = client.responses.create(model=SERVED_MODEL, input="Hi", max_output_tokens=60, temperature=0,
                                    text=text_format)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "hmm ok"
    jsonschema.validate(json.loads(whole.output_text), POINT)
    assert whole.usage.output_tokens_details.reasoning_tokens == len(thinks)
    with client.responses.stream(model=SERVED_MODEL, input="Hi", max_output_tokens=60, temperature=0,
                                 text=text_format) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens_details.reasoning_tokens == len(thinks)
