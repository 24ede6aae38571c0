"""POST /v1/completions: text (or token ids) in, text out; or a batch of prompts, a choice
each (index = prompt * n + completion), streamed as server-sent events or answered whole."""
import asyncio
import functools
import uuid

from fastapi import Request

from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.server.protocol import (APIError, CompletionRequest, completion_logprobs, echo_logprobs, echo_offset, now,
                                      prompt_logprobs)
from minivllm.server.serving_engine import OpenAIServingGeneration
from minivllm.server.streaming import EventStream, stream_events


class OpenAIServingCompletion(OpenAIServingGeneration):
    async def create_completion(self, body: CompletionRequest, request: Request):
        """The answer to a parsed completion request (``request``: the HTTP request it came
        in, watched for a disconnect): a dict, or an event stream with ``stream: true``."""
        params = self.sampling_params(body)
        batch = await self.encode_prompts(body, params)
        self.check_logprob_entries([len(ids) for ids, _ in batch], params, params.n, body.echo)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        echoed = await self.echo_texts(batch) if body.echo else []
        await self.compile_grammar(params, body, request)
        outputs = self.start(batch, params, request_id, request)
        head = {"id": request_id, "object": "text_completion", "created": now(), "model": self.model_name}
        choice = functools.partial(self.choice, body, params, echoed)
        if body.stream:
            head, streamed = self.live_usage(head, functools.partial(choice, stream=True), body.stream_options)
            return EventStream(stream_events(outputs, head, streamed, body.stream_options, n=params.n))
        return await self.respond(outputs, request, head, choice, params.n)

    async def encode_prompts(self, body: CompletionRequest, params) -> list[tuple[list[int], str | None]]:
        """Each prompt as (token ids, text or None), every one checked against the model's context."""
        prompts = body.prompts()
        if len(prompts) > self.config.max_prompts:
            raise APIError(400, f"prompt: at most {self.config.max_prompts} prompts per request (got {len(prompts)}; "
                                f"see --max-prompts)", param="prompt")
        if self.tokenizer is not None:  # refused by their length before any is tokenized
            self.check_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        if body.echo and self.tokenizer is None:
            raise APIError(400, "echo: this model has no tokenizer to give the prompt's text with", param="echo")
        batch = []
        for i, prompt in enumerate(prompts):
            ids, text = (await self.encode(prompt), prompt) if isinstance(prompt, str) else (prompt, None)
            ids, text = self.truncate(ids, text, params)
            self.check_prompt(ids, params, "prompt", "the prompt" if len(prompts) == 1 else f"prompt {i}", body)
            batch.append((ids, text))
        return batch

    async def echo_texts(self, batch: list[tuple[list[int], str | None]]) -> list[tuple[str, str]]:
        """For each prompt, the text that echo puts before the completion (a prompt of token
        ids decoded, as vLLM does) and its first token's own text (that token has no logprob
        entry to carry it)."""
        tokenizer = self.tokenizer

        def texts():
            return [(text if text is not None else tokenizer.decode(ids), tokenizer.decode(ids[:1]))
                    for ids, text in batch]

        return await asyncio.to_thread(texts)  # off the event loop, as tokenizing is

    @staticmethod
    def choice(body: CompletionRequest, params, echoed: list[tuple[str, str]], index: int, output: RequestOutput,
               c: CompletionOutput, sent_text: int = 0, sent_tokens: int = 0, stream: bool = False) -> dict:
        """One choice of the answer, or of a stream's chunk (what is new since ``sent_text``
        characters and ``sent_tokens`` tokens were sent)."""
        k, as_ids = params.logprobs, body.return_tokens_as_token_ids
        prompt_only = body.echo and body.max_tokens == 0  # its one drawn token is not part of the answer
        text = "" if prompt_only else c.text[sent_text:]
        logprobs = completion_logprobs(c, k, sent_tokens, as_ids=as_ids) if k is not None else None
        if body.echo:
            prompt_text, first_token = echoed[index // params.n]
            if sent_tokens == 0:  # the choice's first chunk (or the whole answer): the prompt first
                text = prompt_text + text
                if k is not None:
                    logprobs = echo_logprobs(output, None if prompt_only else c, k, first_token, as_ids)
            elif k is not None:  # later chunks: offsets from the prompt's start
                logprobs = completion_logprobs(c, k, sent_tokens, offset=echo_offset(output, first_token),
                                               as_ids=as_ids)
        answer = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if body.return_token_ids:  # vLLM's: the prompt's ids in a choice's first chunk, the new ids in each
            if sent_tokens == 0:
                answer["prompt_token_ids"] = output.prompt_token_ids
            answer["token_ids"] = [] if prompt_only else c.token_ids[sent_tokens:]
        if params.prompt_logprobs is not None and not stream:  # vLLM's field (never in a stream's chunks)
            answer["prompt_logprobs"] = prompt_logprobs(output)
        return answer
