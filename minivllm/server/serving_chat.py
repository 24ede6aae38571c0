"""POST /v1/chat/completions: messages in, through the chat template; the answer's text, or
its tool calls when the request offers tools (``server.tools``), streamed or whole; with
``--reasoning-parser``, the model's reasoning apart from its answer (``server.reasoning``)."""
import functools
import uuid

from fastapi import Request

from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.server.protocol import ChatCompletionRequest, chat_logprobs, now, prompt_logprobs, usage
from minivllm.server.reasoning import ReasoningAnswer, grammar_after_reasoning, reasoning_parser
from minivllm.server.serving_engine import OpenAIServingGeneration
from minivllm.server.streaming import EventStream, stream_events
from minivllm.server.tools import ToolAnswer, tool_plan
from minivllm.structured.tools import ToolPlan


class OpenAIServingChat(OpenAIServingGeneration):
    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request):
        """The answer to a parsed chat request (``request``: the HTTP request it came in,
        watched for a disconnect): a dict, or an event stream with ``stream: true``."""
        params = self.sampling_params(body)
        ids, text = self.truncate(*await self.encode_messages(body), params)
        parser = reasoning_parser(self.config.reasoning_parser)
        grammar_after_reasoning(params, parser, self.tokenizer, ids)  # the model reasons freely first
        self.check_prompt(ids, params, "messages", body=body)
        self.check_logprob_entries([len(ids)], params, 1)
        plan = tool_plan(body)
        if plan is not None and plan.mode == "none":
            plan = None  # the tools reached the template; the answer is text
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        await self.compile_grammar(params, body, request)
        outputs = self.start([(ids, text)], params, request_id, request)
        head = {"id": request_id, "object": "chat.completion", "created": now(), "model": self.model_name}
        answers: dict[int, ToolAnswer] = {}  # per choice: its tool calls, whole or streamed
        reasoning = ReasoningAnswer(parser, text) if parser is not None else None
        choice = functools.partial(self.choice, plan, answers, reasoning, params.logprobs, body)
        if body.stream:
            head = {**head, "object": "chat.completion.chunk"}
            first = [{"index": j, "delta": {"role": "assistant", "content": echoed(body, plan)}, "logprobs": None,
                      "finish_reason": None} for j in range(params.n)]
            if body.return_token_ids:  # vLLM's: the prompt's ids in the first chunk
                first = [{**f, "prompt_token_ids": ids} for f in first]
            head, streamed = self.live_usage(head, functools.partial(choice, stream=True), body.stream_options,
                                             len(ids))
            counted = functools.partial(self.reasoning_usage, reasoning) if reasoning is not None else usage
            return EventStream(stream_events(outputs, head, streamed, body.stream_options, first=first, n=params.n,
                                             usage=counted))
        return await self.respond(outputs, request, head, choice, params.n, self.extra_fields(body, params, reasoning))

    def extra_fields(self, body: ChatCompletionRequest, params, reasoning: ReasoningAnswer | None = None):
        """The answer's top-level fields beyond OpenAI's: vLLM's prompt_logprobs and
        prompt_token_ids (one prompt: for the whole response); with a reasoning parser, the
        usage with its reasoning tokens (``completion_tokens_details``, as OpenAI's)."""
        if params.prompt_logprobs is None and not body.return_token_ids and reasoning is None:
            return None

        def extra(finals) -> dict:
            fields = {"prompt_logprobs": prompt_logprobs(finals[0])} if params.prompt_logprobs is not None else {}
            if reasoning is not None:
                fields["usage"] = self.reasoning_usage(reasoning, *finals)
            return {**fields, "prompt_token_ids": finals[0].prompt_token_ids} if body.return_token_ids else fields

        return extra

    def reasoning_usage(self, reasoning: ReasoningAnswer, *finals: RequestOutput) -> dict:
        """The usage of a finished request (``finals``: its prompts' last outputs), its
        completions' reasoning tokens counted."""
        parser = reasoning.parser
        count = sum(parser.reasoning_tokens(self.tokenizer, c.token_ids, parser.split(reasoning.prompt_text, c.text)[0])
                    for output in finals for c in output.outputs)
        return usage(*finals, reasoning_tokens=count)

    def choice(self, plan: ToolPlan | None, answers: dict[int, ToolAnswer], reasoning: ReasoningAnswer | None,
               k: int | None, body, index: int,
               output: RequestOutput, c: CompletionOutput, sent_text: int = 0, sent_tokens: int = 0,
               stream: bool = False) -> dict:
        """One choice of the answer (a message), or of a stream's chunk (a delta: what is new
        since ``sent_text`` characters and ``sent_tokens`` tokens were sent). With a reasoning
        parser, the reasoning goes apart from the content (``reasoning_fields``)."""
        reason = c.finish_reason
        text, new_text, thought = c.text, c.text[sent_text:], None
        if reasoning is not None:
            text, new_text, thought = reasoning.split(index, c.text, reason is not None, stream)
        if plan is not None:
            answer = answers.setdefault(index, ToolAnswer(plan, self.config.tool_call_parser))
            message, reason = answer.delta(text, reason) if stream else answer.message(text, reason)
        else:
            message = {"content": new_text} if stream else {"role": "assistant", "content": echoed(body, plan) + text}
        if reasoning is not None:
            message = reasoning.fields(message, thought, stream)
        answer = {"index": index, "delta" if stream else "message": message,
                  "logprobs": chat_logprobs(c, k, sent_tokens, body.return_tokens_as_token_ids) if k is not None
                  else None, "finish_reason": reason, "stop_reason": c.stop_reason}
        if body.return_token_ids:  # vLLM's: the choice's new token ids
            answer["token_ids"] = c.token_ids[sent_tokens:]
        return answer


def echoed(body: ChatCompletionRequest, plan: ToolPlan | None) -> str:
    """What ``echo`` puts before the answer's text: the last message's, if it is the
    assistant's (as vLLM does; an answer of tool calls echoes nothing)."""
    last = body.messages[-1]
    return last.text() if body.echo and plan is None and last.role == "assistant" else ""
