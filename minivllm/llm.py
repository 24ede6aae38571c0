"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, SamplingParams(...))``."""
import dataclasses
import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from minivllm.engine.engine_args import BUNDLED_MODEL  # noqa: F401  (the tests and notebooks read it here)
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.request_limits import truncated
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import (MAX_LOGPROBS, InvalidParameter, SamplingParams, check_max_logprobs,
                                      resolve_logprobs)
from minivllm.structured.tools import template_tool_calls, tool_plan
from minivllm.tokenizer import encode_chat, message_text


@contextmanager
def frozen_heap():
    """Inside the block, the cyclic garbage collector leaves alone every object that existed
    before it (``gc.freeze``): the engine, torch, the model. A full collection walks every
    tracked object, over 200,000 of them once torch and an engine are loaded (112 ms on the
    project's 2-core CPU machine); inside a generate call one would stall a step for that long with the
    GPU idle. Objects made in the block are collected as usual, and the old ones are given
    back to the collector at the end. A heap someone froze already (the server's) is left
    as it is.

    Full (generation-2) collections wait for the end of the block too: even over the young
    objects alone, one took 0.23 s inside a timed run on the H200 machine (first run of
    ``minivllm bench throughput``), a step's worth of idle GPU forty times over. The young
    generations are collected as usual, so cycles made in the block are still freed."""
    if gc.get_freeze_count():
        yield
        return
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(thresholds[0], thresholds[1], 1_000_000)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


class LLM:
    """Offline inference. ``LLM()`` with no model uses the small bundled model.

    ``engine_args`` are EngineConfig's fields, and vLLM's keywords as
    ``minivllm.engine.engine_args.vllm_engine_args`` reads them (``trust_remote_code``,
    ``seed``, ``revision``, ``tokenizer``: the model's own...). ``max_logprobs`` bounds the
    log-probabilities a request may ask for per token (vLLM's; -1 allows ``logprobs=-1``, the
    whole vocabulary)."""

    def __init__(self, model: str | os.PathLike | None = None, dtype: str | torch.dtype = "auto",
                 device: str | None = None, max_logprobs: int = MAX_LOGPROBS, **engine_args):
        self.max_logprobs = check_max_logprobs(max_logprobs)
        self.engine = LLMEngine.from_engine_args(model, dtype, device, **engine_args)
        self.tokenizer = self.engine.tokenizer
        self.default_sampling_fields = self.engine.default_sampling_fields
        self._counter = 0

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name for it)."""
        return self.engine

    # -- inputs ------------------------------------------------------------------------

    def _tokenize(self, prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model ships no tokenizer: pass prompts as token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False), prompt
        if isinstance(prompt, dict):  # minivllm.inputs' TokensPrompt or TextPrompt
            if "multi_modal_data" in prompt:
                raise ValueError("multi_modal_data: minivllm serves text models only")
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt), None
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _add(self, prompts, sampling_params, stream: bool = False) -> list[str]:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        # Check every prompt before queueing any, so a bad one leaves the engine untouched.
        tokenized = [self._tokenize(p) for p in prompts]
        sampling_params = list(sampling_params)
        for i, ((ids, _), params) in enumerate(zip(tokenized, sampling_params)):
            try:  # the prompt, and its parameters against this model
                params = resolve_logprobs(params or SamplingParams(), self.engine.limits.vocab_size, self.max_logprobs)
                self.engine.validate_request(truncated(ids, params), params)
            except ValueError as e:
                e.args = (f"prompt {i}: {e}",)  # (an InvalidParameter stays one, naming its field)
                raise
            sampling_params[i] = params
        ids = []
        for (token_ids, text), params in zip(tokenized, sampling_params):
            self._counter += 1
            ids.append(self.engine.add_request(token_ids, params, request_id=f"req-{self._counter}", prompt=text,
                                               stream=stream))
        return ids

    # -- generation --------------------------------------------------------------------

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or a ``minivllm.inputs``
        TextPrompt / TokensPrompt dict); outputs come back in prompt order."""
        with frozen_heap():  # (queueing many requests makes enough objects for a full collection)
            return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(self, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        request_ids = self._add(prompts, sampling_params)
        order = {rid: i for i, rid in enumerate(request_ids)}
        results: list[RequestOutput | None] = [None] * len(request_ids)
        engine = self.engine
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while any(r is None for r in results):
                for output in engine.step():
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
                        bar.update(1)
                s = engine.stats
                bar.set_postfix_str(
                    f"prefill {s['prefill_tokens'] / max(s['prefill_seconds'], 1e-9):.0f} tok/s, "
                    f"decode {s['decode_tokens'] / max(s['decode_seconds'], 1e-9):.0f} tok/s", refresh=False)
        except BaseException:
            for rid in request_ids:  # leave no half-done request behind
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return results

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one prompt's completion piece by piece, as tokens arrive."""
        [request_id] = self._add([prompt], sampling_params, stream=True)
        sent = 0
        try:
            while True:
                for output in self.engine.step():
                    if output.request_id != request_id:
                        continue
                    text = output.outputs[0].text
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    if output.finished:
                        return
        finally:
            self.engine.abort_request(request_id)  # a no-op once finished

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None, tool_choice=None,
             parallel_tool_calls: bool = True) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.

        A message's content may be a string, a list of text parts or (an assistant's) None,
        as in the server; a ``tool`` message answers a call (``tool_call_id``), and an
        assistant's ``tool_calls`` (OpenAI's shape, arguments as JSON text) reach the template
        with their arguments as objects, as the server sends them. ``continue_final_message``
        carries on the last message instead of opening a new one (with
        ``add_generation_prompt=False``); ``chat_template`` replaces the tokenizer's;
        ``chat_template_kwargs`` are more variables for the template (e.g. Qwen3's
        ``enable_thinking``).

        ``tools`` (OpenAI's function definitions) go into the chat template, as vLLM's
        ``LLM.chat`` puts them. ``tool_choice`` (minivllm's, the server's meaning) constrains
        the output: a named function (``{"type": "function", "function": {"name": ...}}``)
        makes it that function's arguments, ``"required"`` a JSON array of
        ``{"name", "parameters"}`` calls (one at most without ``parallel_tool_calls``);
        ``"auto"`` (the default with tools) and ``"none"`` leave it free. The outputs are text,
        as vLLM's are; the calls are read from it as the server reads them::

            from minivllm.structured.tools import parse_tool_calls, tool_plan
            content, calls = parse_tool_calls(out.outputs[0].text, tool_plan(tools, tool_choice))
        """
        if self.tokenizer is None or not (chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise ValueError("this model's tokenizer has no chat template (pass chat_template=...)")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False")
        template_kwargs = dict(chat_template_kwargs or {})
        if tools:
            if "tools" in template_kwargs:
                raise ValueError("give the tools as chat(tools=...), not in chat_template_kwargs")
            template_kwargs["tools"] = tools
        plan = tool_plan(tools, tool_choice, parallel_tool_calls)
        constraint = plan.constraint() if plan is not None else None
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            conversation = [template_message(m) for m in conversation]
            # What the messages say stays text: a special token written in one is not a control token.
            ids, text = encode_chat(self.tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, chat_template=chat_template,
                                    **template_kwargs)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        if constraint is None:
            return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        sampling_params = constrained(sampling_params or self.get_default_sampling_params(), constraint, len(prompts))
        try:
            return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        except InvalidParameter as e:  # the tools' schemas did not compile: name what the caller wrote
            if e.param != "structured_outputs":
                raise
            raise InvalidParameter(f"tool_choice: {e}", "tool_choice") from None

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams gets: the checkpoint's generation_config.json
        settings where it has them (``generation_config="vllm"`` ignores the file), else
        SamplingParams' own defaults."""
        return SamplingParams(**self.default_sampling_fields)

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        """Free what the engine holds: the worker processes of a tensor-parallel engine (also
        stopped at exit) and the device memory, so that another LLM can take its place."""
        self.engine.shutdown()


def template_message(message: dict) -> dict:
    """One message of LLM.chat as the chat template takes it."""
    if not isinstance(message, dict):
        raise ValueError(f"a message must be a dict with 'role' and 'content', got {type(message).__name__}")
    message = {**message, "content": message_text(message.get("content"))}
    if message.get("tool_calls"):
        message["tool_calls"] = template_tool_calls(message["tool_calls"])
    return message


def constrained(sampling_params, constraint, num_prompts: int) -> list[SamplingParams]:
    """Each prompt's SamplingParams with a tool_choice's constraint (which cannot share a
    request with another one)."""
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * num_prompts
    out = []
    for params in sampling_params:
        params = params or SamplingParams()
        if params.structured_outputs is not None:
            raise InvalidParameter("tool_choice: a named or required tool choice constrains the output, so it "
                                   "cannot be combined with SamplingParams.structured_outputs", "tool_choice")
        out.append(dataclasses.replace(params, structured_outputs=constraint))
    return out
