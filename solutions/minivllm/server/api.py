# Reference copy of minivllm/server/api.py, generated from it by scripts/make_exercises.py.
# Reference answers for: sse_event (ch14).
# Do not edit: change minivllm/server/api.py and run scripts/make_exercises.py again.

"""An OpenAI-compatible HTTP API over ``AsyncLLMEngine``, on FastAPI and uvicorn.

    POST /v1/completions        text (or token ids) in, text out
    POST /v1/chat/completions   messages in, through the tokenizer's chat template
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop is alive, 503 after it died

With ``stream: true`` the answer is server-sent events: one ``data: {json}`` event per
engine step that gave the request a token, then ``data: [DONE]``. A client that
disconnects mid-stream closes the event generator, which aborts the request and frees its
KV blocks. A non-streaming request is watched for a disconnect too.

Every error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a
4xx status when the client caused it. Checking happens before anything reaches the engine,
so a bad request cannot touch another request's state.
"""
import asyncio
import hmac
import json
import socket
import threading
import uuid
from contextlib import aclosing, asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from minivllm.outputs import RequestOutput
from minivllm.server.async_engine import AsyncLLMEngine, EngineDeadError
from minivllm.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_logprobs,
                                      completion_logprobs, now, parse_request, to_sampling_params, usage)


def sse_event(data: dict) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data)}\n\n"


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


def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``model_name``; with ``api_key``, every /v1
    route wants ``Authorization: Bearer <api_key>``."""
    tokenizer = engine.tokenizer
    max_model_len = engine.engine.max_model_len

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="minivllm", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):  # unknown route (404), wrong method (405)
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request, e: EngineDeadError):
        return JSONResponse(APIError(503, str(e), type="server_error").body(), status_code=503)

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not reveal how much of a guess was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def check_prompt(ids: list[int], max_tokens: int | None, param: str) -> None:
        if len(ids) >= max_model_len or (max_tokens is not None and len(ids) + max_tokens > max_model_len):
            asked = f"{len(ids)} prompt tokens" + (f" + {max_tokens} max_tokens" if max_tokens is not None else "")
            raise APIError(400, f"this model's context is {max_model_len} tokens, but the request needs {asked}",
                           param=param, code="context_length_exceeded")
        try:
            engine.validate(ids)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        return tokenizer.encode(text, add_special_tokens=False)

    # -- endpoints ---------------------------------------------------------------------

    @app.get("/health")
    async def health():
        engine.check_health()
        return {"status": "ok"}

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "minivllm", "max_model_len": max_model_len}]}

    @v1.post("/completions")
    async def completions(request: Request):
        body = parse_request(await request.body(), CompletionRequest)
        check_model(body.model)
        params = to_sampling_params(body)
        ids, text = (encode(body.prompt), body.prompt) if isinstance(body.prompt, str) else (body.prompt, None)
        check_prompt(ids, params.max_tokens, "prompt")
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
        output = await final_output(outputs, request)
        if output is None:
            return Response(status_code=499)  # the client left; nobody reads this
        return {**head, "choices": [choice(output)], "usage": usage(output)}

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = parse_request(await request.body(), ChatCompletionRequest)
        check_model(body.model)
        params = to_sampling_params(body)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template itself refuses (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        ids = encode(text)
        check_prompt(ids, params.max_tokens, "messages")
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
        output = await final_output(outputs, request)
        if output is None:
            return Response(status_code=499)
        return {**head, "choices": [choice(output)], "usage": usage(output)}

    app.include_router(v1)
    return app


async def stream_events(outputs, head: dict, choice, stream_options, first: dict | None = None):
    """The SSE events of one streaming request: a chunk per output (the text and tokens
    new since the last), the usage if asked for, then [DONE]."""
    async with aclosing(outputs):  # leaving early closes ``outputs``, which aborts the request
        if first is not None:
            yield sse_event({**head, "choices": [first]})
        sent_text = sent_tokens = 0
        output = None
        async for output in outputs:
            yield sse_event({**head, "choices": [choice(output, sent_text, sent_tokens)]})
            sent_text, sent_tokens = len(output.outputs[0].text), len(output.outputs[0].token_ids)
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
          api_key: str | None = None) -> None:
    """Serve until interrupted (what ``minivllm serve`` runs)."""
    import uvicorn

    uvicorn.run(build_app(engine, model_name, api_key), host=host, port=port, log_level="info")


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
