"""What the serving classes share (vLLM's ``OpenAIServing``): the server's limits, and the
checks a request passes before anything reaches the engine, so that a bad request cannot
touch another request's state.

Every client is assumed careless and some hostile, so what one request can cost is bounded
before any work is done for it (see ``ServerConfig``): the body's size, the stop lists, the
number of prompts, the prompt's length (counted in characters before it is tokenized, and
tokenized off the event loop), a grammar's size and nesting (compiled off the event loop
too, see ``structured.compiler``). Every error is an ``APIError``, OpenAI's shape, with a 4xx
status when the client caused it.
"""
import asyncio
import dataclasses
import functools
import json
import logging
import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from minivllm.engine.request_limits import truncated
from minivllm.errors import InvalidParameter
from minivllm.sampling_params import MAX_LOGPROBS, check_max_logprobs, resolve_logprobs
from minivllm.server.grammar_gate import CompileGate
from minivllm.server.metrics import ServerMetrics
from minivllm.server.protocol import (APIError, apply_defaults, ignored_fields, parse_request, to_sampling_params,
                                      usage, with_extensions)
from minivllm.server.reasoning import reasoning_parser
from minivllm.server.streaming import final_outputs
from minivllm.server.tools import TOOL_PARSERS, structured_outputs, template_messages
from minivllm.tokenizer import encode_chat, max_token_chars

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# As OpenAI's API allows: a bias is for a few tokens, not a second vocabulary.
MAX_LOGIT_BIAS = 300


@dataclass
class ServerConfig:
    """What the server accepts. The defaults suit a server on loopback; each is a flag of
    ``minivllm serve``."""

    api_key: str | None = None  # every route but /health and /metrics wants 'Authorization: Bearer <key>'
    max_request_bytes: int = 16 * 2**20  # a bigger body gets 413 before it is read
    max_prompts: int = 256  # prompts in one /v1/completions batch: each is a request's worth of work
    max_stop: int = 64  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string
    max_stop_token_ids: int = 256
    # Log-probability entries one request may ask for: prompts x n x tokens x (top-k + 1),
    # prompt tokens and echoed ones counted as they are sent. Each becomes an object in the
    # answer (about 50 bytes of JSON, 500 in the server while it is built): the limit keeps
    # the largest answer near 0.5 GB of memory. lm-eval's loglikelihood requests (a few
    # prompts, echo, logprobs 1) and n=8 with 5 logprobs for a few thousand tokens stay far
    # below it.
    max_logprob_entries: int = 1_000_000
    # The Host header names the server a browser thinks it talks to: on loopback, only
    # loopback names, so that a web page whose domain was pointed at 127.0.0.1 (DNS
    # rebinding) is refused. "*" allows any.
    allowed_hosts: list[str] = field(default_factory=lambda: list(LOOPBACK_HOSTS))
    # Origins whose web pages may call the API from a browser (CORS); none by default.
    allowed_origins: list[str] = field(default_factory=list)
    chat_template: str | None = None  # Jinja text that replaces the tokenizer's (--chat-template)
    # A chat_template in a request is code the server would run for a stranger: refused
    # unless the operator says every client is trusted (as vLLM's flag of the same name).
    trust_request_chat_template: bool = False
    tool_call_parser: str = "hermes"  # how tool_choice=auto reads the model's calls (structured.tools.TOOL_PARSERS)
    # How a reasoning model's <think> text is told from its answer (server.reasoning.REASONING_PARSERS);
    # None: the reasoning stays in the content.
    reasoning_parser: str | None = None
    # Top log-probabilities a request may ask for per token (vLLM's --max-logprobs); -1 lets
    # logprobs=-1 ask for the whole vocabulary, bounded still by max_logprob_entries.
    max_logprobs: int = MAX_LOGPROBS
    # More names a request may give the model by (vLLM's --served-model-name a b: aliases).
    # Answers name the model by the server's first name, whichever the request gave.
    model_aliases: list[str] = field(default_factory=list)
    # What /v1/models gives as each card's "root": the model as the operator named it (a
    # hub id or a folder), from which a client such as vLLM's benchmark loads the tokenizer.
    model_root: str | None = None

    def __post_init__(self):
        for name in ("max_request_bytes", "max_stop", "max_stop_chars", "max_stop_token_ids", "max_prompts",
                     "max_logprob_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        check_max_logprobs(self.max_logprobs)
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r}: known parsers are {', '.join(TOOL_PARSERS)}")
        reasoning_parser(self.reasoning_parser)  # a name it does not know: a ValueError naming the known ones


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, if it is JSON and not too big. Only ``application/json``: a browser
    sends a cross-site form or text/plain body without asking first (no CORS preflight),
    so accepting those would let any web page drive a key-less local server."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"the body must be JSON, sent with 'Content-Type: application/json' "
                            f"(got {media_type or 'none'!r})", code="unsupported_media_type")
    too_big = APIError(413, f"the request body is larger than this server's limit of {max_bytes} "
                            f"bytes (--max-request-bytes)", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():  # counted as it arrives: a body need not declare its length
        size += len(chunk)
        if size > max_bytes:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


class OpenAIServing:
    """The one model served, its tokenizer, and the checks on what a request names and
    how long its prompt is. ``engine``: an ``AsyncLLMEngine`` or an ``EngineCoreClient``
    (anything with their reads: ``tokenizer``, ``max_model_len``, ``vocab_size``,
    ``default_sampling_fields``; and for generating, ``validate``, ``compile_grammar``,
    ``generate``)."""

    def __init__(self, engine, model_name: str, config: ServerConfig):
        self.engine = engine
        self.model_name = model_name
        self.config = config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        # A prompt of more characters than this cannot fit in max_model_len tokens whatever it
        # says (twice the bound, for tokenizers whose normalizer merges characters): refused by
        # its length alone, before any time is spent tokenizing it.
        self.max_prompt_chars = (self.max_model_len * max_token_chars(self.tokenizer) * 2
                                 if self.tokenizer is not None else 0)

    async def read_request(self, request: Request, model):
        """The request's body as ``model`` (a pydantic request class), its unknown fields logged.
        Parsed in a worker thread: a big body takes a while, and others are served meanwhile."""
        body = await asyncio.to_thread(parse_request, await read_body(request, self.config.max_request_bytes), model)
        ignored = ignored_fields(body)
        if ignored:
            logger.warning("%s %s: ignoring the unknown field(s) %s", request.method, request.url.path,
                           ", ".join(ignored[:20]) + (" ..." if len(ignored) > 20 else ""))
        return body

    @property
    def model_names(self) -> list[str]:
        """The names the model is served under: the server's own first, then its aliases."""
        return [self.model_name, *(a for a in self.config.model_aliases if a != self.model_name)]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:  # left out: the one model served
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(400, f"this model's context is {self.max_model_len} tokens, and {num_chars} characters "
                                f"cannot fit in it (at most {self.max_prompt_chars})", param=param,
                           code="context_length_exceeded")

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        self.check_chars(len(text), "prompt")
        # In a worker thread: a long text takes a while, and the event loop must go on
        # serving everyone else meanwhile (the tokenizer lets go of the GIL while it works).
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def encode_messages(self, body) -> tuple[list[int], str]:
        """A chat request's messages through the chat template (the request's, if this server
        trusts those; else --chat-template's; else the tokenizer's): (token ids, text)."""
        if body.chat_template is not None and not self.config.trust_request_chat_template:
            # A template is code the server runs: a client's could loop for as long as it likes.
            raise APIError(400, "chat_template: this server uses its own chat template (start it with "
                                "--trust-request-chat-template to accept one per request)", param="chat_template")
        template = body.chat_template or self.config.chat_template
        if self.tokenizer is None or not (template or getattr(self.tokenizer, "chat_template", None)):
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions or start the "
                                "server with --chat-template", param="messages")
        messages = template_messages(body.messages)
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        # What the template writes into the prompt: the messages' text, their calls' arguments
        # and the tools' descriptions (a template that renders tools prints their JSON).
        self.check_chars(sum(len(m["content"]) + len(m.get("tool_calls") and json.dumps(m["tool_calls"]) or "")
                             + len(m.get("reasoning_content", "")) for m in messages)
                         + (len(json.dumps(tools)) if tools else 0), "messages")
        extra = {"tools": tools} if tools else {}
        try:
            # The template and the tokenizer in a worker thread, as for a text prompt.
            return await asyncio.to_thread(
                encode_chat, self.tokenizer, messages, body.add_generation_prompt, chat_template=template,
                continue_final_message=body.continue_final_message, **extra, **(body.chat_template_kwargs or {}))
        except Exception as e:  # the template itself refuses (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None


class OpenAIServingGeneration(OpenAIServing):
    """What completions and chat share: a request's sampling parameters, its prompt's checks
    against the engine, the start of its prompts in the engine (counted by ``metrics``) and
    its non-streaming answer."""

    def __init__(self, engine, model_name: str, config: ServerConfig, metrics: ServerMetrics,
                 compile_gate: CompileGate | None = None):
        super().__init__(engine, model_name, config)
        self.metrics = metrics
        # Shared by the routes that compile grammars (build_app gives them one), so that a
        # client's turn is one across them.
        self.compile_gate = compile_gate or CompileGate()
        self.vocab_size = engine.vocab_size
        # What the checkpoint's generation_config.json suggests, for the fields a request leaves out.
        self.defaults = engine.default_sampling_fields

    def sampling_params(self, body):
        """The SamplingParams of a parsed request, every check on its fields passed."""
        self.check_model(body.model)
        self.check_stops(body)
        apply_defaults(body, self.defaults)
        params = with_extensions(to_sampling_params(body), body)
        constraint, source = structured_outputs(body)  # response_format, structured_outputs, tools
        if constraint is not None:
            try:
                params = dataclasses.replace(params, structured_outputs=constraint)
            except InvalidParameter as e:
                raise APIError(400, f"{source}: {e}", param=e.param) from None
        try:  # last: a whole vocabulary's k is past what SamplingParams' own check allows
            return resolve_logprobs(params, self.vocab_size, self.config.max_logprobs)
        except InvalidParameter as e:
            param = "top_logprobs" if e.param == "logprobs" and hasattr(body, "messages") else e.param
            raise APIError(400, f"{e} (--max-logprobs)", param=param) from None

    def check_stops(self, body) -> None:
        config = self.config
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        if len(stops) > config.max_stop:
            raise APIError(400, f"stop: at most {config.max_stop} stop strings (got {len(stops)})", param="stop")
        if any(len(s) > config.max_stop_chars for s in stops):
            raise APIError(400, f"stop: each stop string is at most {config.max_stop_chars} characters", param="stop")
        ids = body.stop_token_ids or []
        if len(ids) > config.max_stop_token_ids:
            raise APIError(400, f"stop_token_ids: at most {config.max_stop_token_ids} ids (got {len(ids)})",
                           param="stop_token_ids")
        # The other per-token lists cost the sampler their length at every step: bounded too.
        bad_words = body.bad_words or []
        if len(bad_words) > config.max_stop or any(len(w) > config.max_stop_chars for w in bad_words):
            raise APIError(400, f"bad_words: at most {config.max_stop} words of at most {config.max_stop_chars} "
                                "characters", param="bad_words")
        if body.logit_bias and len(body.logit_bias) > MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias: at most {MAX_LOGIT_BIAS} tokens (got {len(body.logit_bias)})",
                           param="logit_bias")
        if body.allowed_token_ids and len(body.allowed_token_ids) > self.vocab_size:
            raise APIError(400, f"allowed_token_ids: at most the vocabulary's {self.vocab_size} ids",
                           param="allowed_token_ids")

    @staticmethod
    def truncate(ids: list[int], text: str | None, params) -> tuple[list[int], str | None]:
        """The prompt the engine will run, before any check of its length: with
        ``truncate_prompt_tokens``, its last k ids (a prompt longer than the context may ask
        to keep only its end, as in vLLM); a shortened prompt's text is no longer its own."""
        kept = truncated(ids, params)
        return (ids, text) if len(kept) == len(ids) else (kept, None)

    def check_prompt(self, ids: list[int], params, param: str, which: str = "the prompt", body=None) -> None:
        max_model_len = self.max_model_len
        if len(ids) >= max_model_len:
            raise APIError(400, f"this model's context is {max_model_len} tokens, but {which} has {len(ids)}",
                           param=param, code="context_length_exceeded")
        if params.max_tokens is not None and len(ids) + params.max_tokens > max_model_len:
            raise APIError(400, f"this model's context is {max_model_len} tokens, but the request needs "
                                f"{len(ids)} prompt tokens + {params.max_tokens} max_tokens: ask for at most "
                                f"{max_model_len - len(ids)}", param="max_tokens", code="context_length_exceeded")
        try:
            self.engine.validate(ids, params)
        except InvalidParameter as e:
            if e.param == "structured_outputs" and body is not None:  # name the field the client wrote
                source = structured_outputs(body)[1]
                raise APIError(400, f"{source}: {e}", param=source) from None
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise APIError(400, f"{which}: {e}" if which != "the prompt" else str(e), param=param) from None

    def check_logprob_entries(self, prompt_lens: list[int], params, prompt_copies: int, echo: bool = False) -> None:
        """Refuse, before any work, a request whose answer would carry more log-probability
        entries than ``--max-logprob-entries``: for each prompt, n completions x the tokens
        each may sample (max_tokens, or what the context leaves) x (top-k + 1), and the
        prompt's tokens x (top-k + 1) as often as the answer repeats them (``prompt_copies``
        times, and once more per completion with ``echo``). The answer is built in memory,
        about 500 bytes an entry, so this bounds the memory one request can take."""
        k, pk, n, limit = params.logprobs, params.prompt_logprobs, params.n, self.config.max_logprob_entries
        sampled = (sum(params.max_tokens or self.max_model_len - length for length in prompt_lens)
                   if k is not None else 0)
        per_prompt_token = ((prompt_copies * (pk + 1) if pk is not None else 0)
                            + (n * (k + 1) if echo and k is not None else 0))
        sampled_entries = n * sampled * (k + 1) if k is not None else 0
        total = sampled_entries + sum(prompt_lens) * per_prompt_token
        if total <= limit:
            return
        parts = [f"{len(prompt_lens)} prompt(s) x n={n} x {sampled // max(len(prompt_lens), 1):,} tokens to sample "
                 f"x (logprobs {k} + 1)"] if k is not None else []
        if per_prompt_token:
            parts.append(f"{sum(prompt_lens):,} prompt tokens x {per_prompt_token} entries each (prompt_logprobs "
                         f"and echo, top-k + 1, per copy in the answer)")
        unbounded = " (max_tokens is not set: each completion counts up to the context's end)" \
            if k is not None and params.max_tokens is None else ""
        param = "logprobs" if sampled_entries * 2 >= total or params.prompt_logprobs is None else "prompt_logprobs"
        raise APIError(400, f"{param}: this request asks for {total:,} log-probability entries ({' + '.join(parts)}); "
                            f"this server's limit is {limit:,} (--max-logprob-entries): ask for fewer prompts, a "
                            f"smaller n, fewer tokens or fewer logprobs{unbounded}", param=param,
                       code="too_many_logprobs")

    @staticmethod
    def live_usage(head: dict, choice, stream_options, prompt_tokens: int = 0):
        """``stream_options.continuous_usage_stats`` (with ``include_usage``, as vLLM reads it):
        every chunk carries the usage of its prompt so far. The chunk's ``usage`` is a dict in
        ``head`` that the choice function brings up to date as the chunk's choices are made,
        before the chunk is written. Returns (head, choice), unchanged without the option."""
        if stream_options is None or not (stream_options.include_usage and stream_options.continuous_usage_stats):
            return head, choice
        live = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}

        def counted(index, output, *args, **kwargs):
            live.update(usage(output))
            return choice(index, output, *args, **kwargs)

        return {**head, "usage": live}, counted

    async def compile_grammar(self, params, body, request: Request) -> None:
        """The request's grammar compiled off the event loop (a JSON schema can take seconds,
        and everyone else is served meanwhile), in its client's turn (``grammar_gate``): a bad
        one is the client's 400, naming the field they wrote. The last check before the
        request starts: the cheap ones first."""
        if params.structured_outputs is None:
            return
        client = request.client.host if request.client is not None else ""
        try:
            await self.compile_gate.compile(client, functools.partial(self.engine.compile_grammar, params))
        except InvalidParameter as e:
            if e.param != "structured_outputs":  # (allowed_token_ids that the grammar never allows)
                raise APIError(400, str(e), param=e.param) from None
            source = structured_outputs(body)[1]
            raise APIError(400, f"{source}: {e}", param=source) from None

    def start(self, generate_args: list[tuple], params, request_id: str, request: Request) -> list:
        """Hand a request's prompts to the engine (after every check), each under an id of its own."""
        request.state.request_id = request_id  # what the X-Request-Id header says, unless the client named it
        arrival = time.perf_counter()
        ids = [request_id] if len(generate_args) == 1 else [f"{request_id}-{i}" for i in range(len(generate_args))]
        return [self.metrics.observe(self.engine.generate(prompt_ids, params, rid, text), arrival, params)
                for rid, (prompt_ids, text) in zip(ids, generate_args)]

    async def respond(self, outputs, request: Request, head: dict, choice, n: int, extra=None):
        """A non-streaming answer: every prompt run to its end. Choices in OpenAI's order:
        prompt by prompt, its n completions in turn (index = prompt * n + completion).
        ``extra(finals)``: more top-level fields."""
        finals = await final_outputs(outputs, request)
        if finals is None:
            return Response(status_code=499)  # the client left; nobody reads this

        def answer() -> dict:
            choices = [choice(i * n + c.index, o, c) for i, o in enumerate(finals) for c in o.outputs]
            return {**head, "choices": choices, "usage": usage(*finals), **(extra(finals) if extra else {})}

        # Built in a worker thread (and written out in one too: api.json_response): with
        # logprobs an answer holds up to --max-logprob-entries objects, seconds of work that
        # must not hold up the event loop, and /health, meanwhile.
        return await asyncio.to_thread(answer)
