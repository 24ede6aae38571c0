"""Tools in the offline ``LLM.chat`` (chapter 18): the tools reach the chat template, a named
or required ``tool_choice`` constrains the output as the server's does, and the calls are
read back from the text with the server's own parser. Tool results and an assistant's calls
go through the template exactly as the server renders them.
"""
import json
import re

import jsonschema
import pytest

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.sampling_params import InvalidParameter
from minivllm.server.protocol import ChatCompletionRequest
from minivllm.server.tools import template_messages
from minivllm.structured.tools import MAX_TOOL_CALLS, parse_tool_calls, tool_plan
from minivllm.tokenizer import encode_chat
from shared import MESSAGES, SCHEMAS, TOOLS, WEATHER

pytestmark = pytest.mark.usefixtures("one_thread")

# A template that shows what it is given: the tools, each message, and an assistant's calls
# with one of their arguments read as an object's field (as Qwen's and Hermes' templates do).
TEMPLATE = ("{% for t in tools or [] %}TOOL {{ t.function.name }};{% endfor %}"
            "{% for m in messages %}[{{ m.role }}{% if m.tool_call_id %} {{ m.tool_call_id }}{% endif %}]{{ m.content }}"
            "{% for c in m.tool_calls or [] %}CALL {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }};"
            "{% endfor %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=16, num_kv_blocks=256)  # (sized: on a GPU two engines at 90% would not fit)


def sampling(n_seeds, max_tokens=200):
    return [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens) for s in range(n_seeds)]


def test_named_tool_choice_makes_one_call_to_that_function(llm):
    outs = llm.chat([MESSAGES] * 6, sampling(6), tools=TOOLS, tool_choice=NAMED, use_tqdm=False)
    plan = tool_plan(TOOLS, NAMED)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        content, [call] = parse_tool_calls(out.outputs[0].text, plan)
        assert content is None and call.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_makes_calls_to_the_tools(llm, parallel):
    outs = llm.chat([MESSAGES] * 3, sampling(3, max_tokens=600), tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=parallel, use_tqdm=False)
    plan = tool_plan(TOOLS, "required", parallel)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        items = json.loads(out.outputs[0].text)
        _, calls = parse_tool_calls(out.outputs[0].text, plan)
        assert 1 <= len(calls) == len(items) <= (MAX_TOOL_CALLS if parallel else 1)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_auto_leaves_the_output_free_and_the_parser_reads_the_models_syntax(llm):
    """The bundled model never writes a call on its own: a regex makes it write Hermes' syntax."""
    forced = StructuredOutputsParams(regex=r'Let me check\. <tool_call>\n\{"name": "get_weather", "arguments": '
                                           r'\{"city": "[A-Z][a-z]{2,6}", "unit": "celsius"\}\}\n</tool_call>')
    [out] = llm.chat(MESSAGES, SamplingParams(seed=1, max_tokens=200, structured_outputs=forced), tools=TOOLS,
                     use_tqdm=False)
    text = out.outputs[0].text
    assert text.startswith("Let me check. <tool_call>")  # the text as the model wrote it
    content, [call] = parse_tool_calls(text, tool_plan(TOOLS, "auto"))
    assert content == "Let me check." and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert parse_tool_calls(text, tool_plan(TOOLS, "none")) == (text, [])


def test_the_tools_tool_results_and_calls_reach_the_template_as_on_the_server(llm):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris <|im_end|>", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    [out] = llm.chat(messages, SamplingParams(max_tokens=3), tools=TOOLS, tool_choice="none", chat_template=TEMPLATE,
                     use_tqdm=False)
    assert out.prompt == ("TOOL get_weather;TOOL get_time;[user]What is the weather like in Paris?"
                          "[assistant]CALL call_1 get_weather Paris <|im_end|>;[tool call_1]18 degrees and sunny"
                          "[assistant]")
    # What the server renders for the same request, token for token.
    body = ChatCompletionRequest.model_validate({"messages": messages, "tools": TOOLS})
    ids, text = encode_chat(llm.get_tokenizer(), template_messages(body.messages), True, chat_template=TEMPLATE,
                            tools=[t.model_dump(exclude_none=True) for t in body.tools])
    assert (out.prompt, out.prompt_token_ids) == (text, ids)
    im_end = llm.get_tokenizer().convert_tokens_to_ids("<|im_end|>")
    assert im_end not in out.prompt_token_ids  # the one written in the arguments is text


def test_without_a_constraint_the_outputs_are_the_prompts(llm):
    """tool_choice auto and none change nothing but the prompt: the bundled template renders
    the tools (as Qwen3's does), and the outputs are those of that prompt, unconstrained."""
    params = SamplingParams(temperature=0, max_tokens=12)
    with_tools = llm.get_tokenizer().apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True,
                                                         tokenize=False)
    assert "get_weather" in with_tools and "get_weather" not in llm.get_tokenizer().apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False), "the template renders the tools into the prompt"
    plain = llm.chat(MESSAGES, params, tools=TOOLS, tool_choice="auto", use_tqdm=False)[0]
    assert plain.prompt == with_tools
    for choice in ("none", None):
        assert llm.chat(MESSAGES, params, tools=TOOLS, tool_choice=choice, use_tqdm=False)[0].outputs[0].token_ids \
            == plain.outputs[0].token_ids


@pytest.mark.parametrize("kwargs,param,message", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "no tool is named 'nope' (tools: get_weather, get_time)"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=TOOLS, tool_choice="always"), "tool_choice", "must be one of 'none', 'auto', 'required'"),
    (dict(tools=[TOOLS[0], TOOLS[0]]), "tools", "function names must be unique"),
    (dict(tools=[{"name": "f"}]), "tools", "tool 0 must be {'type': 'function'"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
          tool_choice="required"), "tool_choice", "unsupported JSON schema feature: the keyword 'not'"),
    (dict(tools=TOOLS, tool_choice=NAMED,
          sampling_params=SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))), "tool_choice",
     "cannot be combined with SamplingParams.structured_outputs"),
    (dict(tools=TOOLS, tool_choice="required", sampling_params=SamplingParams(ignore_eos=True)), "ignore_eos",
     "ignore_eos"),
])
def test_what_cannot_work_is_refused_by_name(llm, kwargs, param, message):
    with pytest.raises(InvalidParameter, match=re.escape(message)) as e:
        llm.chat(MESSAGES, kwargs.pop("sampling_params", None), use_tqdm=False, **kwargs)
    assert e.value.param == param
    assert not llm.engine.has_unfinished_requests()
