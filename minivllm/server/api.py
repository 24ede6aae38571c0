"""An OpenAI-compatible HTTP API over an engine client (``AsyncLLMEngine``, or
``EngineCoreClient`` for an engine core in its own process), on FastAPI and uvicorn.

    POST /v1/completions        text (or token ids) in, text out; or a batch of prompts, a choice each
    POST /v1/chat/completions   messages in, through the chat template
    POST /v1/responses          OpenAI's Responses API, for text (``serving_responses``)
    GET  /v1/models[/{id}]      the one model served
    POST /tokenize, /detokenize text or messages to token ids, and back (vLLM's)
    GET  /version               minivllm's version
    GET  /health                200 while the engine loop is alive, 503 after it died (HEAD too)
    GET  /metrics               Prometheus' text format (see ``metrics``)
    GET  /docs, /openapi.json   the API's description (behind the key when there is one)

As vLLM's server is built: the routes are declared here, at module level, and find what they
serve on ``request.app.state``; each route's work is a method of a small serving class
(``serving_completions``, ``serving_chat``, ``serving_tokenize``, ``serving_models``, with
the checks they share in ``serving_engine``), which can be built and called alone.
``build_app`` only puts them together. Every response carries an ``X-Request-Id`` header
(``middleware``); streams are server-sent events (``streaming``); every error is OpenAI's
shape, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx status when the client
caused it.
"""
import asyncio
import gc
import html
import json
import socket
import threading
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, Response

from minivllm import __version__
from minivllm.server.async_engine import AsyncLLMEngine
from minivllm.server.grammar_gate import CompileGate
from minivllm.server.metrics import ServerMetrics
from minivllm.server.middleware import ERROR_HANDLERS, HostCheck, RequestIdHeader, check_api_key
from minivllm.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ResponsesRequest,
                                      TokenizeRequest)
from minivllm.server.serving_chat import OpenAIServingChat
from minivllm.server.serving_completions import OpenAIServingCompletion
from minivllm.server.serving_engine import ServerConfig
from minivllm.server.serving_models import OpenAIServingModels
from minivllm.server.serving_responses import OpenAIServingResponses
from minivllm.server.serving_tokenize import OpenAIServingTokenization
from minivllm.server.streaming import sse_event  # noqa: F401  (chapter 14 shows and tests it from here)

# /health and /metrics answer without the key, as vLLM's do (its key guards only /v1):
# a load balancer's probe and a Prometheus scraper hold no secrets, and neither route
# does work for a client. Everything else, the tokenizer routes included, wants the key:
# tokenizing is work done on the caller's behalf (vLLM leaves /tokenize open).
open_routes = APIRouter()
keyed = APIRouter(dependencies=[Depends(check_api_key)])
v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
# FastAPI's own docs pages load their scripts from a CDN and answer without the key: ours
# are served here, self-contained and behind the key.
docs = APIRouter(dependencies=[Depends(check_api_key)], include_in_schema=False)
# The request bodies whose fields /docs lists, by route.
REQUEST_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/v1/responses": ResponsesRequest,
                  "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


@open_routes.get("/health")
async def health(request: Request):
    request.app.state.engine.check_health()
    return {"status": "ok"}


open_routes.head("/health", include_in_schema=False)(health)  # probes that only want the status


@open_routes.get("/metrics", include_in_schema=False)
async def metrics_page(request: Request):
    text, content_type = request.app.state.metrics.render()
    return Response(text, media_type=content_type)


@keyed.get("/version")
async def version():
    return {"version": __version__}


@keyed.post("/tokenize")
async def tokenize(request: Request):
    serving = request.app.state.serving_tokenization
    return await json_response(await serving.tokenize(await serving.read_request(request, TokenizeRequest)))


@keyed.post("/detokenize")
async def detokenize(request: Request):
    serving = request.app.state.serving_tokenization
    return await serving.detokenize(await serving.read_request(request, DetokenizeRequest))


@v1.get("/models")
async def models(request: Request):
    return request.app.state.serving_models.show_available_models()


@v1.get("/models/{model_id:path}")  # :path: a served name may hold a slash (Qwen/Qwen3-0.6B)
async def model(model_id: str, request: Request):
    return request.app.state.serving_models.show_model(model_id)


@v1.post("/completions")
async def completions(request: Request):
    serving = request.app.state.serving_completion
    return await json_response(
        await serving.create_completion(await serving.read_request(request, CompletionRequest), request))


@v1.post("/chat/completions")
async def chat_completions(request: Request):
    serving = request.app.state.serving_chat
    return await json_response(
        await serving.create_chat_completion(await serving.read_request(request, ChatCompletionRequest), request))


@v1.post("/responses")
async def responses(request: Request):
    serving = request.app.state.serving_responses
    return await json_response(
        await serving.create_response(await serving.read_request(request, ResponsesRequest), request))


async def json_response(answer):
    """An answer (a dict) written out as JSON in a worker thread, where FastAPI would write it on
    the event loop: a big one (logprobs, token ids) takes a while, and others are served
    meanwhile. Anything else (a stream, an empty 499) goes back as it is."""
    if not isinstance(answer, dict):
        return answer

    def dump() -> bytes:
        pieces: list[str] = []
        encode_json(answer, pieces)
        return "".join(pieces).encode()

    return Response(await asyncio.to_thread(dump), media_type="application/json")


_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode
JSON_SLICE = 4096  # list items written by one call of the C encoder


def encode_json(value, pieces: list[str]) -> None:
    """``value`` as compact JSON, appended to ``pieces`` a small part at a time. The C encoder
    holds the interpreter lock for as long as one call runs (a second for a 40 MB answer),
    so the event loop's thread could not answer /health meanwhile; between calls, it can."""
    if isinstance(value, dict) and any(isinstance(v, (dict, list)) for v in value.values()):
        pieces.append("{")
        for i, (key, item) in enumerate(value.items()):
            pieces.append(("," if i else "") + _dumps(str(key)) + ":")
            encode_json(item, pieces)
        pieces.append("}")
    elif isinstance(value, list) and value and isinstance(value[0], (dict, list)):
        pieces.append("[")
        for i, item in enumerate(value):
            if i:
                pieces.append(",")
            encode_json(item, pieces)
        pieces.append("]")
    elif isinstance(value, list) and len(value) > JSON_SLICE:
        pieces.append("[" + ",".join(_dumps(value[i : i + JSON_SLICE])[1:-1]
                                     for i in range(0, len(value), JSON_SLICE)) + "]")
    else:
        pieces.append(_dumps(value))


@docs.get("/openapi.json")
async def openapi(request: Request):
    return request.app.openapi()


@docs.get("/docs")
async def docs_page(request: Request):
    return HTMLResponse(docs_html(request.app.openapi(), REQUEST_BODIES))


@asynccontextmanager
async def lifespan(app: FastAPI):
    engine = app.state.engine
    engine.start()
    yield
    await engine.shutdown()


def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None,
              config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (or an ``EngineCoreClient``) under ``model_name``;
    with an API key (``api_key`` or ``config.api_key``), every route but /health and
    /metrics wants ``Authorization: Bearer <key>``."""
    config = config or ServerConfig()
    app = FastAPI(title="minivllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    state = app.state
    state.engine = engine
    state.api_key = api_key if api_key is not None else config.api_key
    state.metrics = metrics = ServerMetrics(engine, model_name)
    state.serving_models = OpenAIServingModels(engine, model_name, config)
    state.serving_tokenization = OpenAIServingTokenization(engine, model_name, config)
    gate = CompileGate()
    state.serving_completion = OpenAIServingCompletion(engine, model_name, config, metrics, gate)
    state.serving_chat = OpenAIServingChat(engine, model_name, config, metrics, gate)
    state.serving_responses = OpenAIServingResponses(engine, model_name, config, metrics, gate)
    app.add_middleware(RequestIdHeader)
    app.add_middleware(HostCheck, allowed=config.allowed_hosts)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"])
    for error, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    for router in (open_routes, keyed, v1, docs):
        app.include_router(router)
    return app


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


# -- running it ------------------------------------------------------------------------


def serve(engine: AsyncLLMEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          config: ServerConfig | None = None, grace_s: float = 2.0, log_level: str = "info",
          access_log: bool = True) -> int:
    """Serve until interrupted (what ``minivllm serve`` runs). Returns the process's exit
    status: 1 if the engine died, so that a supervisor restarts the server; open streams get
    their error events during ``grace_s`` before it stops. ``log_level`` is uvicorn's
    (--uvicorn-log-level); ``access_log`` False logs no line per request (--disable-log-requests)."""
    import uvicorn

    from minivllm.server.connections import uvicorn_config

    server = uvicorn.Server(uvicorn_config(build_app(engine, model_name, config=config), host=host, port=port,
                                           log_level=log_level, access_log=access_log,
                                           timeout_graceful_shutdown=5))

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

        from minivllm.server.connections import uvicorn_config

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))  # port 0: the system picks a free one, no race
        self.port = sock.getsockname()[1]
        config = uvicorn_config(self.app, log_level="warning", timeout_graceful_shutdown=5)
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
