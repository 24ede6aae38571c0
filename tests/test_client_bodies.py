"""What real clients send, replayed: the request bodies of LangChain's ChatOpenAI and OpenAI,
``vllm bench serve`` and lm-eval (tests/fixtures/clients, rebuilt from each client's source)
get a 200 and an answer the openai package's types accept, on the bundled model. Then echo
and prompt_logprobs, which lm-eval's loglikelihood relies on, as vLLM answers them.
"""
import copy
import json
from pathlib import Path

import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from minivllm import LLM, SamplingParams
from minivllm.server import AsyncLLMEngine
from minivllm.server.api import ServerThread, build_app
from minivllm.testing import torch_threads

FIXTURES = Path(__file__).parent / "fixtures" / "clients"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.json"))
MODEL = "bundled"  # the name the fixtures' clients were configured with
ENGINE = dict(num_kv_blocks=256, block_size=16, max_num_seqs=16)


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def offline():
    with torch_threads(1):
        yield LLM(**ENGINE)


@pytest.fixture(scope="module")
def server():
    with torch_threads(1):
        engine = AsyncLLMEngine(LLM(**ENGINE).engine)
        with ServerThread(build_app(engine, MODEL)) as running:
            yield running


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def valid_completion(answer: dict) -> Completion:
    """The answer as the openai package's Completion. An echoed prompt's first token has a
    null logprob and null top_logprobs (OpenAI's API and vLLM send it so), which that type's
    list of floats does not allow: that entry is checked here, and the rest validated."""
    answer = copy.deepcopy(answer)
    for choice in answer["choices"]:
        logprobs = choice.get("logprobs")
        if logprobs and logprobs["token_logprobs"] and logprobs["token_logprobs"][0] is None:
            assert logprobs["top_logprobs"][0] is None
            for key in logprobs:
                logprobs[key] = logprobs[key][1:]
    return Completion.model_validate(answer)


@pytest.mark.parametrize("name", NAMES)
def test_every_client_body_gets_a_well_formed_answer(server, name):
    f = fixture(name)
    body, path = f["body"], f["endpoint"]
    chat = path.endswith("chat/completions")
    batched = not chat and isinstance(body["prompt"], list) and not isinstance(body["prompt"][0], int)
    prompts = len(body["prompt"]) if batched else 1
    if f["stream"]:
        chunks = events(server, path, body)
        assert not any("error" in c for c in chunks), chunks
        if chat:
            assert all(ChatCompletionChunk.model_validate(c) for c in chunks)
        else:  # (the package's type has no null finish_reason: the chunks that end choices, and the usage one)
            assert all(valid_completion(c) for c in chunks if all(ch["finish_reason"] for ch in c["choices"]))
        text = "".join(ch["delta"].get("content") or "" if chat else ch["text"] for c in chunks for ch in c["choices"])
        finals = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        assert len(finals) == 1
        usage = chunks[-1].get("usage")
        assert (usage is not None) == bool(body.get("stream_options", {}).get("include_usage"))
    else:
        r = post(server, path, body)
        assert r.status_code == 200, r.text
        answer = r.json()
        parsed = ChatCompletion.model_validate(answer) if chat else valid_completion(answer)
        assert len(parsed.choices) == prompts * body.get("n", 1)
        text = parsed.choices[0].message.content if chat else parsed.choices[0].text
        usage = answer["usage"]
    limit = body.get("max_tokens", body.get("max_completion_tokens"))
    if usage is not None:
        assert 0 < usage["completion_tokens"] <= max(limit, 1) * prompts  # (max_tokens 0 draws one, as in vLLM)
        if body.get("ignore_eos"):
            assert usage["completion_tokens"] == limit * prompts
    for stop in body.get("stop") or []:
        assert stop not in text


@pytest.mark.parametrize("name", ["lm_eval_local_completions_loglikelihood",
                                  "lm_eval_openai_completions_loglikelihood_max_tokens_0"])
def test_lm_evals_loglikelihood_reads_the_prompts_scores(server, offline, name):
    """What lm-eval computes from the answer (the continuation's summed log-probability and
    whether it is greedy) is what the engine's prompt_logprobs say."""
    f = fixture(name)
    body = f["body"]
    answer = post(server, "/v1/completions", body).json()
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    with torch_threads(1):
        want = offline.generate(body["prompt"], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                                use_tqdm=False)
    drawn = body["max_tokens"]  # 1: the answer ends with the token it drew, which lm-eval cuts off
    for choice, ctxlen, ref in zip(choices, f["ctxlens"], want, strict=True):
        logprobs = choice["logprobs"]
        ids = ref.prompt_token_ids
        assert len(logprobs["tokens"]) == len(ids) + drawn
        assert choice["text"].startswith(offline.get_tokenizer().decode(ids))
        end = len(logprobs["token_logprobs"]) - drawn
        got = sum(logprobs["token_logprobs"][ctxlen:end])
        scored = ref.prompt_logprobs
        assert got == pytest.approx(sum(scored[p][ids[p]].logprob for p in range(ctxlen, len(ids))), abs=1e-4)
        greedy = all(tok == max(top.values())
                     for tok, top in zip(logprobs["token_logprobs"][ctxlen:end], logprobs["top_logprobs"][ctxlen:end]))
        assert greedy == all(scored[p][ids[p]].rank == 1 for p in range(ctxlen, len(ids)))
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert all(len(top) == min(body["logprobs"], 10) for top in logprobs["top_logprobs"][1:])
        assert logprobs["text_offset"][0] == 0
        assert choice["finish_reason"] == "length"


def test_echo_puts_the_prompt_first(server, offline):
    prompt = "It was the best of times, it was the worst of times"
    with torch_threads(1):
        [want] = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2),
                                  use_tqdm=False)
    completion = want.outputs[0]
    n_prompt = len(want.prompt_token_ids)
    # echo alone: the text only, and no prompt_logprobs field (nothing asked for them)
    plain = post(server, "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 4, "temperature": 0}).json()
    [choice] = plain["choices"]
    assert choice["text"] == prompt + completion.text and choice["logprobs"] is None and "prompt_logprobs" not in choice
    # with logprobs: the prompt's tokens, then the completion's; offsets over the echoed text
    scored = post(server, "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 4, "logprobs": 2,
                                              "temperature": 0}).json()
    [choice] = scored["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n_prompt + len(completion.token_ids)
    assert "".join(lp["tokens"]) == choice["text"] == prompt + completion.text
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    ids = want.prompt_token_ids
    assert lp["token_logprobs"][1:n_prompt] == pytest.approx(
        [want.prompt_logprobs[p][ids[p]].logprob for p in range(1, n_prompt)], abs=1e-4)
    assert lp["token_logprobs"][n_prompt:] == pytest.approx(
        [e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)], abs=1e-4)
    # vLLM's prompt_logprobs field comes along (echo with logprobs scores the prompt)
    assert [None if e is None else sorted(map(int, e)) for e in choice["prompt_logprobs"]] == \
        [None if e is None else sorted(e) for e in want.prompt_logprobs]
    valid_completion(scored)
    # token ids in: the echoed text is their decoding
    by_ids = post(server, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 0}).json()
    assert by_ids["choices"][0]["text"] == offline.get_tokenizer().decode(ids)


def test_echo_streams_the_prompt_in_the_first_chunk(server, offline):
    prompt = "It was the best of times"
    body = {"prompt": prompt, "echo": True, "max_tokens": 5, "logprobs": 1, "temperature": 0, "stream": True}
    chunks = events(server, "/v1/completions", body)
    whole = post(server, "/v1/completions", {**body, "stream": False}).json()["choices"][0]
    pieces = [c["choices"][0] for c in chunks if c["choices"]]
    assert pieces[0]["text"].startswith(prompt)
    assert "".join(p["text"] for p in pieces) == whole["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [x for p in pieces for x in p["logprobs"][key]] == pytest.approx(whole["logprobs"][key], abs=1e-5)
    # max_tokens 0: one chunk, the prompt alone
    [only] = [c for c in events(server, "/v1/completions", {**body, "max_tokens": 0}) if c["choices"]]
    assert only["choices"][0]["text"] == prompt and only["choices"][0]["finish_reason"] == "length"
    assert len(only["choices"][0]["logprobs"]["tokens"]) == len(offline.get_tokenizer().encode(prompt))


def test_prompt_logprobs_as_a_vllm_extra_field(server, offline):
    prompt = "It was the best of times"
    with torch_threads(1):
        [want] = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                                  use_tqdm=False)
    answer = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                              "prompt_logprobs": 3, "n": 2}).json()
    assert len(answer["choices"]) == 2
    for choice in answer["choices"]:  # each choice carries its prompt's (vLLM's shape)
        got = choice["prompt_logprobs"]
        assert got[0] is None and len(got) == len(want.prompt_token_ids)
        for entry, ref in zip(got[1:], want.prompt_logprobs[1:]):
            assert {int(t): (v["rank"], v["decoded_token"]) for t, v in entry.items()} == \
                {t: (lp.rank, lp.decoded_token) for t, lp in ref.items()}
            want_values = [lp.logprob for lp in ref.values()]
            assert [v["logprob"] for v in entry.values()] == pytest.approx(want_values, abs=1e-4)
        assert choice["text"] == want.outputs[0].text
    # chat: on the response (one prompt)
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                                 "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
    ChatCompletion.model_validate(chat)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),  # vLLM refuses it with a stream too
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # no echo: nothing to answer with
    ({"prompt": "hi", "echo": "yes"}, "echo"),
])
def test_bad_scoring_requests_are_refused_by_name(server, body, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
