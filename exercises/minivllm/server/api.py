# Exercise copy of minivllm/server/api.py, generated from it by scripts/make_exercises.py.
# Fill in: sse_event (ch14).
# Grade: make grade CH=14
# Running the generator again overwrites this file: commit or copy your work first.

"""An OpenAI-compatible HTTP API over ``AsyncLLMEngine``, on FastAPI and uvicorn.

    POST /v1/completions        text (or token ids) in, text out
    POST /v1/chat/completions   messages in, through the tokenizer's chat template
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop is alive, 503 after it died (HEAD too)
    GET  /docs, /openapi.json   the API's description (behind the key when there is one)

With ``stream: true`` the answer is server-sent events: one ``data: {json}`` event per
engine step that gave the request a token, then ``data: [DONE]``. A client that
disconnects mid-stream closes the event generator, which aborts the request and frees its
KV blocks. A non-streaming request is watched for a disconnect too. A stream the engine
cannot finish ends with an ``{"error": ...}`` event, then ``[DONE]``.

Every error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a
4xx status when the client caused it. Checking happens before anything reaches the engine,
so a bad request cannot touch another request's state. Every client is assumed careless and
some hostile, so what one request can cost is bounded before any work is done for it (see
``ServerConfig``): the body's size, the stop lists, the prompt's length (counted in
characters before it is tokenized, and tokenized off the event loop).
"""
import asyncio
import hmac
import html
import json
import logging
import socket
import threading
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from minivllm.outputs import RequestOutput
from minivllm.sampling_params import InvalidParameter
from minivllm.server.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from minivllm.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_logprobs,
                                      completion_logprobs, now, parse_request, to_sampling_params, usage)
from minivllm.tokenizer import encode_chat, max_token_chars

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass
class ServerConfig:
    """What the server accepts. The defaults suit a server on loopback; each is a flag of
    ``minivllm serve``."""

    api_key: str | None = None  # every /v1 route (and the docs) want 'Authorization: Bearer <key>'
    max_request_bytes: int = 16 * 2**20  # a bigger body gets 413 before it is read
    max_stop: int = 64  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string
    max_stop_token_ids: int = 256
    # The Host header names the server a browser thinks it talks to: on loopback, only
    # loopback names, so that a web page whose domain was pointed at 127.0.0.1 (DNS
    # rebinding) is refused. "*" allows any.
    allowed_hosts: list[str] = field(default_factory=lambda: list(LOOPBACK_HOSTS))
    # Origins whose web pages may call the API from a browser (CORS); none by default.
    allowed_origins: list[str] = field(default_factory=list)


def sse_event(data: dict) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    raise NotImplementedError(
        "ch14: frame one server-sent event: the line 'data: ' + the JSON of data (json.dumps, "
        "which escapes newlines inside strings), then a blank line, i.e. the event ends with two "
        "newlines, see notebooks/14_serving.ipynb"
    )


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
    or ``config.api_key``), every /v1 route wants ``Authorization: Bearer <key>``."""
    config = config or ServerConfig()
    api_key = api_key if api_key is not None else config.api_key
    tokenizer = engine.tokenizer
    max_model_len = engine.engine.max_model_len
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
    app.add_middleware(HostCheck, allowed=config.allowed_hosts)
    if config.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

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

    def check_model(name: str) -> None:
        if name != model_name:
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

    def check_chars(num_chars: int, param: str) -> None:
        if num_chars > max_prompt_chars:
            raise APIError(400, f"this model's context is {max_model_len} tokens, and {num_chars} characters "
                                f"cannot fit in it (at most {max_prompt_chars})", param=param,
                           code="context_length_exceeded")

    def check_prompt(ids: list[int], params, param: str) -> None:
        if len(ids) >= max_model_len:
            raise APIError(400, f"this model's context is {max_model_len} tokens, but the prompt has {len(ids)}",
                           param=param, code="context_length_exceeded")
        if params.max_tokens is not None and len(ids) + params.max_tokens > max_model_len:
            raise APIError(400, f"this model's context is {max_model_len} tokens, but the request needs "
                                f"{len(ids)} prompt tokens + {params.max_tokens} max_tokens: ask for at most "
                                f"{max_model_len - len(ids)}", param="max_tokens", code="context_length_exceeded")
        try:
            engine.validate(ids, params)
        except InvalidParameter as e:
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    async def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        check_chars(len(text), "prompt")
        # In a worker thread: a long text takes a while, and the event loop must go on
        # serving everyone else meanwhile (the tokenizer lets go of the GIL while it works).
        return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)

    async def parse(request: Request, model):
        """The request's body as ``model`` and its SamplingParams, every check passed."""
        body = parse_request(await read_body(request), model)
        check_model(body.model)
        check_stops(body)
        return body, to_sampling_params(body)

    async def respond(outputs, request: Request, head: dict, choice):
        """A non-streaming answer: the request run to its end."""
        output = await final_output(outputs, request)
        if output is None:
            return Response(status_code=499)  # the client left; nobody reads this
        return {**head, "choices": [choice(output)], "usage": usage(output)}

    # -- endpoints ---------------------------------------------------------------------

    @app.get("/health")
    async def health():
        engine.check_health()
        return {"status": "ok"}

    app.head("/health", include_in_schema=False)(health)  # probes that only want the status

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "minivllm", "max_model_len": max_model_len}]}

    @v1.post("/completions")
    async def completions(request: Request):
        body, params = await parse(request, CompletionRequest)
        ids, text = (await encode(body.prompt), body.prompt) if isinstance(body.prompt, str) else (body.prompt, None)
        check_prompt(ids, params, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        outputs = engine.generate(ids, params, request_id, text)
        head = {"id": request_id, "object": "text_completion", "created": now(), "model": model_name}
        k = params.logprobs

        def choice(output: RequestOutput, sent_text: int = 0, sent_tokens: int = 0) -> dict:
            c = output.outputs[0]
            return {"index": 0, "text": c.text[sent_text:],
                    "logprobs": completion_logprobs(c, k, sent_tokens) if k is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

        if body.stream:
            return EventStream(stream_events(outputs, head, choice, body.stream_options))
        return await respond(outputs, request, head, choice)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body, params = await parse(request, ChatCompletionRequest)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            # The template and the tokenizer in a worker thread, as for a text prompt.
            ids, text = await asyncio.to_thread(encode_chat, tokenizer, messages)
        except Exception as e:  # the template itself refuses (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        check_prompt(ids, params, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = engine.generate(ids, params, request_id, text)
        head = {"id": request_id, "object": "chat.completion", "created": now(), "model": model_name}
        k = params.logprobs

        def choice(output: RequestOutput, sent_text: int = 0, sent_tokens: int = 0, stream: bool = False) -> dict:
            c = output.outputs[0]
            message = {"content": c.text[sent_text:]} if stream else {"role": "assistant", "content": c.text}
            return {"index": 0, "delta" if stream else "message": message,
                    "logprobs": chat_logprobs(c, k, sent_tokens) if k is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

        if body.stream:
            head = {**head, "object": "chat.completion.chunk"}
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            return EventStream(stream_events(outputs, head, lambda *a: choice(*a, stream=True), body.stream_options,
                                             first=first))
        return await respond(outputs, request, head, choice)

    app.include_router(v1)

    # -- the API's description ---------------------------------------------------------

    docs = APIRouter(dependencies=[Depends(check_api_key)], include_in_schema=False)

    @docs.get("/openapi.json")
    async def openapi():
        return app.openapi()

    @docs.get("/docs")
    async def docs_page():
        return HTMLResponse(docs_html(app.openapi(), {"/v1/completions": CompletionRequest,
                                                      "/v1/chat/completions": ChatCompletionRequest}))

    app.include_router(docs)
    return app


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


async def stream_events(outputs, head: dict, choice, stream_options, first: dict | None = None):
    """The SSE events of one streaming request: a chunk per output (the text and tokens
    new since the last), the usage if asked for, then [DONE]. If the engine fails the
    request, or dies, the stream says so in an error event before its [DONE]."""
    async with aclosing(outputs):  # leaving early closes ``outputs``, which aborts the request
        if first is not None:
            yield sse_event({**head, "choices": [first]})
        sent_text = sent_tokens = 0
        output = None
        try:
            async for output in outputs:
                yield sse_event({**head, "choices": [choice(output, sent_text, sent_tokens)]})
                sent_text, sent_tokens = len(output.outputs[0].text), len(output.outputs[0].token_ids)
        except RequestFailedError as e:
            yield sse_event(APIError(500, f"the engine failed this request ({e}); other requests are unaffected",
                                     type="server_error").body())
            yield DONE_EVENT
            return
        except EngineDeadError as e:
            yield sse_event(APIError(503, str(e), type="server_error").body())
            yield DONE_EVENT
            return
        if stream_options is not None and stream_options.include_usage and output is not None:
            yield sse_event({**head, "choices": [], "usage": usage(output)})
        yield DONE_EVENT


async def final_output(outputs, request: Request, poll_s: float = 0.5) -> RequestOutput | None:
    """Run a non-streaming request to its end; if the client disconnects first, abort it and
    return None."""

    async def last():
        async with aclosing(outputs):
            output = None
            async for output in outputs:
                pass
            return output

    task = asyncio.ensure_future(last())
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()  # cancels the wait inside generate(), whose cleanup aborts the request
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
