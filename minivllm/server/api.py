"""An OpenAI-compatible HTTP API over ``AsyncLLMEngine``, on FastAPI and uvicorn.

    POST /v1/completions        text (or token ids) in, text out; or a batch of prompts, a choice each
    POST /v1/chat/completions   messages in, through the chat template
    GET  /v1/models[/{id}]      the one model served
    POST /tokenize, /detokenize text or messages to token ids, and back (vLLM's)
    GET  /version               minivllm's version
    GET  /health                200 while the engine loop is alive, 503 after it died (HEAD too)
    GET  /metrics               Prometheus' text format (see ``metrics``)
    GET  /docs, /openapi.json   the API's description (behind the key when there is one)

Every response carries an ``X-Request-Id`` header. With ``stream: true`` the answer is
server-sent events: one ``data: {json}`` event per engine step that gave a prompt of the
request a token (its choice carries the prompt's ``index``), then ``data: [DONE]``. A client that
disconnects mid-stream closes the event generator, which aborts the request and frees its
KV blocks. A non-streaming request is watched for a disconnect too. A stream the engine
cannot finish ends with an ``{"error": ...}`` event, then ``[DONE]``.

Every error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a
4xx status when the client caused it. Checking happens before anything reaches the engine,
so a bad request cannot touch another request's state. Every client is assumed careless and
some hostile, so what one request can cost is bounded before any work is done for it (see
``ServerConfig``): the body's size, the stop lists, the number of prompts, the prompt's
length (counted in characters before it is tokenized, and tokenized off the event loop), a
grammar's size and nesting (compiled off the event loop too, see ``structured.compiler``).
"""
import asyncio
import dataclasses
import gc
import hmac
import html
import json
import logging
import socket
import threading
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from minivllm import __version__
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import InvalidParameter
from minivllm.server.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from minivllm.server.metrics import ServerMetrics
from minivllm.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest, apply_defaults, chat_logprobs, completion_logprobs,
                                      echo_logprobs, echo_offset, ignored_fields, now, parse_request,
                                      prompt_logprobs, to_sampling_params, usage, with_extensions)
from minivllm.server.tools import ToolAnswer, structured_outputs, template_messages, tool_plan
from minivllm.tokenizer import encode_chat, max_token_chars

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


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

    def __post_init__(self):
        for name in ("max_request_bytes", "max_stop", "max_stop_chars", "max_stop_token_ids", "max_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        from minivllm.server.tools import TOOL_PARSERS

        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r}: known parsers are {', '.join(TOOL_PARSERS)}")


def sse_event(data: dict) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    # BEGIN SOLUTION ch14 sse_event
    return f"data: {json.dumps(data)}\n\n"
    # END SOLUTION


DONE_EVENT = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response that closes its generator however the response ends
    (finished, client gone, error), so the request behind it is aborted at once rather than
    when the garbage collector gets to it."""

    def __init__(self, events):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None,
              config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``model_name``; with an API key (``api_key``
    or ``config.api_key``), every route but /health and /metrics wants
    ``Authorization: Bearer <key>``."""
    config = config or ServerConfig()
    api_key = api_key if api_key is not None else config.api_key
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len
    vocab_size = engine.vocab_size
    # What the checkpoint's generation_config.json suggests, for the fields a request leaves out.
    defaults = engine.default_sampling_fields
    metrics = ServerMetrics(engine, model_name)
    # A prompt of more characters than this cannot fit in max_model_len tokens whatever it
    # says (twice the bound, for tokenizers whose normalizer merges characters): refused by
    # its length alone, before any time is spent tokenizing it.
    max_prompt_chars = max_model_len * max_token_chars(tokenizer) * 2 if tokenizer is not None else 0

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await engine.shutdown()

    # FastAPI's own docs pages load their scripts from a CDN and answer without the key:
    # ours are served below, self-contained and behind the key.
    app = FastAPI(title="minivllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestIdHeader)
    app.add_middleware(HostCheck, allowed=config.allowed_hosts)
    if config.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"])

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):  # unknown route (404), wrong method (405)
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request, e: EngineDeadError):
        return JSONResponse(APIError(503, str(e), type="server_error").body(), status_code=503)

    @app.exception_handler(RequestFailedError)
    async def request_failed(request, e: RequestFailedError):
        message = f"the engine failed this request ({e}); other requests are unaffected"
        return JSONResponse(APIError(500, message, type="server_error").body(), status_code=500)

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not reveal how much of a guess was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def read_body(request: Request) -> bytes:
        """The body, if it is JSON and not too big. Only ``application/json``: a browser
        sends a cross-site form or text/plain body without asking first (no CORS preflight),
        so accepting those would let any web page drive a key-less local server."""
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise APIError(415, f"the body must be JSON, sent with 'Content-Type: application/json' "
                                f"(got {media_type or 'none'!r})", code="unsupported_media_type")
        too_big = APIError(413, f"the request body is larger than this server's limit of {config.max_request_bytes} "
                                f"bytes (--max-request-bytes)", code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_request_bytes:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():  # counted as it arrives: a body need not declare its length
            size += len(chunk)
            if size > config.max_request_bytes:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:  # left out: the one model served
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def check_stops(body) -> None:
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
        if body.allowed_token_ids and len(body.allowed_token_ids) > vocab_size:
            raise APIError(400, f"allowed_token_ids: at most the vocabulary's {vocab_size} ids", param="allowed_token_ids")

    def check_chars(num_chars: int, param: str) -> None:
        if num_chars > max_prompt_chars:
            raise APIError(400, f"this model's context is {max_model_len} tokens, and {num_chars} characters "
                                f"cannot fit in it (at most {max_prompt_chars})", param=param,
                           code="context_length_exceeded")

    def check_prompt(ids: list[int], params, param: str, which: str = "the prompt", body=None) -> None:
        if len(ids) >= max_model_len:
            raise APIError(400, f"this model's context is {max_model_len} tokens, but {which} has {len(ids)}",
                           param=param, code="context_length_exceeded")
        if params.max_tokens is not None and len(ids) + params.max_tokens > max_model_len:
            raise APIError(400, f"this model's context is {max_model_len} tokens, but the request needs "
                                f"{len(ids)} prompt tokens + {params.max_tokens} max_tokens: ask for at most "
                                f"{max_model_len - len(ids)}", param="max_tokens", code="context_length_exceeded")
        try:
            engine.validate(ids, params)
        except InvalidParameter as e:
            if e.param == "structured_outputs" and body is not None:  # name the field the client wrote
                source = structured_outputs(body)[1]
                raise APIError(400, f"{source}: {e}", param=source) from None
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise APIError(400, f"{which}: {e}" if which != "the prompt" else str(e), param=param) from None

    async def compile_grammar(params, body) -> None:
        """The request's grammar compiled off the event loop (a JSON schema can take seconds,
        and everyone else is served meanwhile): a bad one is the client's 400, naming the
        field they wrote. The last check before the request starts: the cheap ones first."""
        try:
            await engine.compile_grammar(params)
        except InvalidParameter as e:
            source = structured_outputs(body)[1]
            raise APIError(400, f"{source}: {e}", param=source) from None

    async def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        check_chars(len(text), "prompt")
        # In a worker thread: a long text takes a while, and the event loop must go on
        # serving everyone else meanwhile (the tokenizer lets go of the GIL while it works).
        return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def encode_messages(body) -> tuple[list[int], str]:
        """A chat request's messages through the chat template (the request's, if this server
        trusts those; else --chat-template's; else the tokenizer's): (token ids, text)."""
        if body.chat_template is not None and not config.trust_request_chat_template:
            # A template is code the server runs: a client's could loop for as long as it likes.
            raise APIError(400, "chat_template: this server uses its own chat template (start it with "
                                "--trust-request-chat-template to accept one per request)", param="chat_template")
        template = body.chat_template or config.chat_template
        if tokenizer is None or not (template or getattr(tokenizer, "chat_template", None)):
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions or start the "
                                "server with --chat-template", param="messages")
        messages = template_messages(body.messages)
        check_chars(sum(len(m["content"]) for m in messages), "messages")
        tools = getattr(body, "tools", None)
        extra = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {}
        try:
            # The template and the tokenizer in a worker thread, as for a text prompt.
            return await asyncio.to_thread(
                encode_chat, tokenizer, messages, body.add_generation_prompt, chat_template=template,
                continue_final_message=body.continue_final_message, **extra, **(body.chat_template_kwargs or {}))
        except Exception as e:  # the template itself refuses (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    async def parse(request: Request, model):
        """The request's body as ``model`` and its SamplingParams, every check passed."""
        body = parse_request(await read_body(request), model)
        warn_ignored(request, body)
        check_model(body.model)
        check_stops(body)
        apply_defaults(body, defaults)
        params = with_extensions(to_sampling_params(body), body)
        constraint, source = structured_outputs(body)  # response_format, structured_outputs, tools
        if constraint is not None:
            try:
                params = dataclasses.replace(params, structured_outputs=constraint)
            except InvalidParameter as e:
                raise APIError(400, f"{source}: {e}", param=e.param) from None
        return body, params

    def warn_ignored(request: Request, body) -> None:
        ignored = ignored_fields(body)
        if ignored:
            logger.warning("%s %s: ignoring the unknown field(s) %s", request.method, request.url.path,
                           ", ".join(ignored[:20]) + (" ..." if len(ignored) > 20 else ""))

    def start(generate_args: list[tuple], params, request_id: str, request: Request) -> list:
        """Hand a request's prompts to the engine (after every check), each under an id of its own."""
        request.state.request_id = request_id  # what the X-Request-Id header says, unless the client named it
        arrival = time.perf_counter()
        ids = [request_id] if len(generate_args) == 1 else [f"{request_id}-{i}" for i in range(len(generate_args))]
        return [metrics.observe(engine.generate(prompt_ids, params, rid, text), arrival)
                for rid, (prompt_ids, text) in zip(ids, generate_args)]

    async def respond(outputs, request: Request, head: dict, choice, n: int, extra=None):
        """A non-streaming answer: every prompt run to its end. Choices in OpenAI's order:
        prompt by prompt, its n completions in turn (index = prompt * n + completion).
        ``extra(finals)``: more top-level fields."""
        finals = await final_outputs(outputs, request)
        if finals is None:
            return Response(status_code=499)  # the client left; nobody reads this
        choices = [choice(i * n + c.index, o, c) for i, o in enumerate(finals) for c in o.outputs]
        return {**head, "choices": choices, "usage": usage(*finals), **(extra(finals) if extra else {})}

    # -- endpoints ---------------------------------------------------------------------

    # /health and /metrics answer without the key, as vLLM's do (its key guards only /v1):
    # a load balancer's probe and a Prometheus scraper hold no secrets, and neither route
    # does work for a client. Everything else, the tokenizer routes included, wants the key:
    # tokenizing is work done on the caller's behalf (vLLM leaves /tokenize open).
    @app.get("/health")
    async def health():
        engine.check_health()
        return {"status": "ok"}

    app.head("/health", include_in_schema=False)(health)  # probes that only want the status

    @app.get("/metrics", include_in_schema=False)
    async def metrics_page():
        text, content_type = metrics.render()
        return Response(text, media_type=content_type)

    keyed = APIRouter(dependencies=[Depends(check_api_key)])

    @keyed.get("/version")
    async def version():
        return {"version": __version__}

    @keyed.post("/tokenize")
    async def tokenize(request: Request):
        body = parse_request(await read_body(request), TokenizeRequest)
        warn_ignored(request, body)
        check_model(body.model)
        if body.messages is not None:
            ids, _ = await encode_messages(body)
        else:
            ids = await encode(body.prompt, body.add_special_tokens)
        strs = await asyncio.to_thread(tokenizer.convert_ids_to_tokens, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    @keyed.post("/detokenize")
    async def detokenize(request: Request):
        body = parse_request(await read_body(request), DetokenizeRequest)
        warn_ignored(request, body)
        check_model(body.model)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        # As long as the longest sequence this server can hold: what one request can cost.
        if len(body.tokens) > max_model_len:
            raise APIError(400, f"tokens: at most {max_model_len} (max_model_len), got {len(body.tokens)}",
                           param="tokens")
        if not all(0 <= t < len(tokenizer) for t in body.tokens):
            raise APIError(400, f"tokens: each must be in [0, {len(tokenizer)})", param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}

    app.include_router(keyed)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": now(), "owned_by": "minivllm",
                "max_model_len": max_model_len}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model_id:path}")  # :path: a served name may hold a slash (Qwen/Qwen3-0.6B)
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @v1.post("/completions")
    async def completions(request: Request):
        body, params = await parse(request, CompletionRequest)
        prompts = body.prompts()
        if len(prompts) > config.max_prompts:
            raise APIError(400, f"prompt: at most {config.max_prompts} prompts per request (got {len(prompts)}; "
                                f"see --max-prompts)", param="prompt")
        if tokenizer is not None:  # refused by their length before any is tokenized
            check_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        if body.echo and tokenizer is None:
            raise APIError(400, "echo: this model has no tokenizer to give the prompt's text with", param="echo")
        batch = []
        for i, prompt in enumerate(prompts):
            ids, text = (await encode(prompt), prompt) if isinstance(prompt, str) else (prompt, None)
            check_prompt(ids, params, "prompt", "the prompt" if len(prompts) == 1 else f"prompt {i}", body)
            batch.append((ids, text))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        echoed = await echo_texts(batch) if body.echo else []
        await compile_grammar(params, body)
        outputs = start(batch, params, request_id, request)
        head = {"id": request_id, "object": "text_completion", "created": now(), "model": model_name}
        k = params.logprobs
        prompt_only = body.echo and body.max_tokens == 0  # its one drawn token is not part of the answer

        def choice(index: int, output: RequestOutput, c: CompletionOutput, sent_text: int = 0, sent_tokens: int = 0,
                   stream: bool = False) -> dict:
            text = "" if prompt_only else c.text[sent_text:]
            logprobs = completion_logprobs(c, k, sent_tokens) if k is not None else None
            if body.echo:
                prompt_text, first_token = echoed[index // params.n]
                if sent_tokens == 0:  # the choice's first chunk (or the whole answer): the prompt first
                    text = prompt_text + text
                    if k is not None:
                        logprobs = echo_logprobs(output, None if prompt_only else c, k, first_token)
                elif k is not None:  # later chunks: offsets from the prompt's start
                    logprobs = completion_logprobs(c, k, sent_tokens, offset=echo_offset(output, first_token))
            answer = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
            if params.prompt_logprobs is not None and not stream:  # vLLM's field (never in a stream's chunks)
                answer["prompt_logprobs"] = prompt_logprobs(output)
            return answer

        if body.stream:
            return EventStream(stream_events(outputs, head, lambda *a: choice(*a, stream=True), body.stream_options,
                                             n=params.n))
        return await respond(outputs, request, head, choice, params.n)

    async def echo_texts(batch: list[tuple[list[int], str | None]]) -> list[tuple[str, str]]:
        """For each prompt, the text that echo puts before the completion (a prompt of token
        ids decoded, as vLLM does) and its first token's own text (that token has no logprob
        entry to carry it)."""
        def texts():
            return [(text if text is not None else tokenizer.decode(ids), tokenizer.decode(ids[:1]))
                    for ids, text in batch]

        return await asyncio.to_thread(texts)  # off the event loop, as tokenizing is

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body, params = await parse(request, ChatCompletionRequest)
        ids, text = await encode_messages(body)
        check_prompt(ids, params, "messages", body=body)
        plan = tool_plan(body)
        if plan is not None and plan.mode == "none":
            plan = None  # the tools reached the template; the answer is text
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        await compile_grammar(params, body)
        outputs = start([(ids, text)], params, request_id, request)
        head = {"id": request_id, "object": "chat.completion", "created": now(), "model": model_name}
        k = params.logprobs
        answers: dict[int, ToolAnswer] = {}  # per choice: its tool calls, whole or streamed

        def choice(index: int, output: RequestOutput, c: CompletionOutput, sent_text: int = 0, sent_tokens: int = 0,
                   stream: bool = False) -> dict:
            reason = c.finish_reason
            if plan is not None:
                answer = answers.setdefault(index, ToolAnswer(plan, config.tool_call_parser))
                message, reason = answer.delta(c.text, reason) if stream else answer.message(c.text, reason)
            else:
                message = {"content": c.text[sent_text:]} if stream else {"role": "assistant", "content": c.text}
            return {"index": index, "delta" if stream else "message": message,
                    "logprobs": chat_logprobs(c, k, sent_tokens) if k is not None else None,
                    "finish_reason": reason, "stop_reason": c.stop_reason}

        if body.stream:
            head = {**head, "object": "chat.completion.chunk"}
            first = [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                     for j in range(params.n)]
            return EventStream(stream_events(outputs, head, lambda *a: choice(*a, stream=True), body.stream_options,
                                             first=first, n=params.n))
        # vLLM's prompt_logprobs, for the whole response (one prompt).
        extra = (lambda finals: {"prompt_logprobs": prompt_logprobs(finals[0])}) if params.prompt_logprobs is not None \
            else None
        return await respond(outputs, request, head, choice, params.n, extra)

    app.include_router(v1)

    # -- the API's description ---------------------------------------------------------

    docs = APIRouter(dependencies=[Depends(check_api_key)], include_in_schema=False)

    @docs.get("/openapi.json")
    async def openapi():
        return app.openapi()

    @docs.get("/docs")
    async def docs_page():
        return HTMLResponse(docs_html(app.openapi(), {"/v1/completions": CompletionRequest,
                                                      "/v1/chat/completions": ChatCompletionRequest,
                                                      "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}))

    app.include_router(docs)
    return app


# As OpenAI's API allows: a bias is for a few tokens, not a second vocabulary.
MAX_LOGIT_BIAS = 300
# The longest X-Request-Id a client may send: an id for logs, not a place to store data.
MAX_REQUEST_ID_CHARS = 128


class RequestIdHeader:
    """ASGI middleware: every response carries ``X-Request-Id``, the client's own if it sent
    one (visible ASCII, at most MAX_REQUEST_ID_CHARS: it is echoed into our logs and
    headers), else the id the route gave the request (``cmpl-...``), else a fresh one. The
    client's id names the response only: the engine's request ids stay ours, so that two
    clients who send the same one cannot collide."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope["headers"]).get(b"x-request-id")
        if sent is not None and not (0 < len(sent) <= MAX_REQUEST_ID_CHARS and all(33 <= c < 127 for c in sent)):
            error = APIError(400, f"the X-Request-Id header must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII "
                                  f"characters", code="invalid_request_id")
            await JSONResponse(error.body(), status_code=400)(scope, receive, send)
            return
        state = scope.setdefault("state", {})

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                rid = sent or str(state.get("request_id") or uuid.uuid4().hex).encode()
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)



class HostCheck:
    """ASGI middleware: refuse a request whose Host header is not an allowed name."""

    def __init__(self, app, allowed: list[str]):
        self.app = app
        self.allowed = {h.lower() for h in allowed}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and "*" not in self.allowed:
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
            # "name:port", "[v6]:port" or a bare name: the name is what counts.
            name = host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] or host
            if name not in self.allowed:
                error = APIError(400, f"the Host header {host!r} is not one this server answers to "
                                      f"(allowed: {', '.join(sorted(self.allowed))}; see --allowed-hosts)",
                                 code="host_not_allowed")
                await JSONResponse(error.body(), status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def docs_html(spec: dict, bodies: dict) -> str:
    """A one-page description of the API, with nothing to fetch: the routes, and the fields
    each POST body takes (from the request models themselves)."""
    parts = [f"<!doctype html><meta charset='utf-8'><title>{html.escape(spec['info']['title'])} API</title>",
             "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}td,th{text-align:left;"
             "padding:2px 8px;border-bottom:1px solid #ddd}code{background:#f4f4f4}</style>",
             f"<h1>{html.escape(spec['info']['title'])} API</h1>"]
    for path, methods in spec["paths"].items():
        for method in methods:
            parts.append(f"<h2><code>{method.upper()} {html.escape(path)}</code></h2>")
        model = bodies.get(path)
        if model is not None:
            parts.append("<table><tr><th>field</th><th>type</th><th>default</th></tr>")
            for name, f in model.model_fields.items():
                kind = str(f.annotation).replace("typing.", "")
                default = "required" if f.is_required() else repr(f.default)
                parts.append(f"<tr><td><code>{name}</code></td><td>{html.escape(kind)}</td>"
                             f"<td>{html.escape(default)}</td></tr>")
            parts.append("</table>")
    return "\n".join(parts)


async def merged(outputs: list):
    """``(index, output)`` from several requests' outputs, as each arrives. Closing this
    closes every one of them (which aborts those not finished); an error of one (the engine
    failed it, or died) is raised here, and the others are closed too.

    A request's outputs are cumulative (each holds all its text so far), so when several of
    one request have queued up while the reader was busy (a server behind its streams, under
    load), only the newest is handed on: one event carries all their tokens, and the server
    catches up instead of writing an event per step it is behind (vLLM merges a lagging
    stream's outputs the same way). The engines' own queues do that for each request
    (``OutputQueue``), so one request's outputs are read directly, with no task between."""
    if len(outputs) == 1:
        async with aclosing(outputs[0]) as one:
            async for output in one:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(i, one):
        try:
            async with aclosing(one):
                async for output in one:
                    queue.put_nowait((i, output))
        except Exception as e:  # handed to the reader, who raises it
            queue.put_nowait((i, e))
            return
        queue.put_nowait((i, finished))

    tasks = [asyncio.ensure_future(pump(i, one)) for i, one in enumerate(outputs)]
    try:
        remaining = len(tasks)
        while remaining:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            newest = {i: k for k, (i, item) in enumerate(batch) if item is not finished and not isinstance(item, Exception)}
            for k, (i, item) in enumerate(batch):
                if item is finished:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                elif newest[i] == k:
                    yield i, item
    finally:
        for task in tasks:
            task.cancel()  # a request still running: cancelling its wait aborts it
        await asyncio.gather(*tasks, return_exceptions=True)


async def stream_events(outputs: list, head: dict, choice, stream_options, first: list | None = None, n: int = 1):
    """The SSE events of one streaming request: a chunk per output of each of its prompts,
    with a choice for each completion that moved (the text and tokens new since its last
    chunk, under index prompt * n + completion), the usage if asked for, then [DONE]. If the
    engine fails the request, or dies, the stream says so in an error event before its [DONE].

    The last chunk, the usage and [DONE] go in one write: each write is a system call and a
    packet, and a request's stream is a few of them per token at most."""
    include_usage = stream_options is not None and stream_options.include_usage
    async with aclosing(merged(outputs)) as events:  # leaving early closes them: the requests are aborted
        if first is not None:
            yield sse_event({**head, "choices": first})
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens) sent
        ended: set[int] = set()  # choices whose finish_reason has been sent
        last: list[RequestOutput | None] = [None] * len(outputs)
        num_finished = 0
        try:
            async for i, output in events:
                choices = []
                for c in output.outputs:  # with n > 1, only the completions that moved
                    index = i * n + c.index
                    text_sent, tokens_sent = sent.get(index, (0, 0))
                    if len(c.token_ids) > tokens_sent or (c.finish_reason is not None and index not in ended):
                        choices.append(choice(index, output, c, text_sent, tokens_sent))
                        sent[index] = (len(c.text), len(c.token_ids))
                        if c.finish_reason is not None:
                            ended.add(index)
                last[i] = output
                num_finished += output.finished
                event = sse_event({**head, "choices": choices}) if choices else ""
                if num_finished == len(outputs):  # every prompt's last output: the stream's end follows
                    if include_usage:
                        event += sse_event({**head, "choices": [], "usage": usage(*last)})
                    yield event + DONE_EVENT
                    return
                if event:
                    yield event
        except RequestFailedError as e:
            yield sse_event(APIError(500, f"the engine failed this request ({e}); other requests are unaffected",
                                     type="server_error").body())
            yield DONE_EVENT
            return
        except EngineDeadError as e:
            yield sse_event(APIError(503, str(e), type="server_error").body())
            yield DONE_EVENT
            return
        # (the outputs ended without a finished one: not from an engine, but said the same way)
        if include_usage and all(o is not None for o in last):
            yield sse_event({**head, "choices": [], "usage": usage(*last)})
        yield DONE_EVENT


async def final_outputs(outputs: list, request: Request, poll_s: float = 0.5) -> list[RequestOutput] | None:
    """Run a non-streaming request's prompts to their end; if the client disconnects first,
    abort them and return None."""

    async def last():
        finals: list[RequestOutput | None] = [None] * len(outputs)
        async with aclosing(merged(outputs)) as events:
            async for i, output in events:
                finals[i] = output
        return finals

    task = asyncio.ensure_future(last())
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()  # cancels the waits inside generate(), whose cleanup aborts the requests
            await asyncio.gather(task, return_exceptions=True)
            return None



# -- running it ------------------------------------------------------------------------


def serve(engine: AsyncLLMEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          config: ServerConfig | None = None, grace_s: float = 2.0) -> int:
    """Serve until interrupted (what ``minivllm serve`` runs). Returns the process's exit
    status: 1 if the engine died, so that a supervisor restarts the server; open streams get
    their error events during ``grace_s`` before it stops."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(build_app(engine, model_name, config=config), host=host, port=port,
                                           log_level="info", timeout_graceful_shutdown=5))

    def stop_soon():
        asyncio.get_running_loop().call_later(grace_s, setattr, server, "should_exit", True)

    engine.on_dead = stop_soon
    # Everything loaded so far (torch, the tokenizer, the app) lives as long as the server:
    # frozen, the garbage collector no longer walks it in every full collection, which under
    # load (objects made per token) was about a third of the server's CPU time.
    gc.collect()
    gc.freeze()
    # And the young generation collected every 20,000 new objects, not 700: the server makes
    # them by the thousand per step (outputs, events, futures), nearly all freed at once by
    # their reference counts, so frequent collections mostly walk the few that live on.
    gc.set_threshold(20_000, 10, 10)
    server.run()
    return 1 if engine.error is not None else 0


class ServerThread:
    """Run ``app`` under uvicorn on a background thread, on a free loopback port (for
    tests, notebooks and benchmarks)::

        with ServerThread(app) as server:
            httpx.get(server.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.app, self.host, self.port = app, host, port
        self.server = None
        self.thread = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServerThread":
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))  # port 0: the system picks a free one, no race
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="minivllm-server")
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited before it started")
            self.thread.join(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
