"""What every route of the server shares before and after its own work: the X-Request-Id
and Host headers (ASGI middleware), the API key (a route dependency), and the errors turned
into OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``."""
import hmac
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from minivllm.server.async_engine import EngineDeadError, RequestFailedError
from minivllm.server.protocol import APIError


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


async def check_api_key(request: Request) -> None:
    """The dependency of every keyed route: with a key (``app.state.api_key``), the request
    must send ``Authorization: Bearer <key>``."""
    api_key = request.app.state.api_key
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # compare_digest: the time taken does not reveal how much of a guess was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


# -- errors, in OpenAI's shape ---------------------------------------------------------


async def api_error(request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status)


async def http_error(request, e: HTTPException):  # unknown route (404), wrong method (405)
    return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)


async def engine_dead(request, e: EngineDeadError):
    return JSONResponse(APIError(503, str(e), type="server_error").body(), status_code=503)


async def request_failed(request, e: RequestFailedError):
    from minivllm.structured.feature import NOTHING_TO_SAMPLE

    if NOTHING_TO_SAMPLE in str(e):  # the request's own constraints left no token to draw: the client's 400
        return JSONResponse(APIError(400, f"this request ended early: {e}").body(), status_code=400)
    message = f"the engine failed this request ({e}); other requests are unaffected"
    return JSONResponse(APIError(500, message, type="server_error").body(), status_code=500)


# The app's exception handlers: an exception class -> its response.
ERROR_HANDLERS = {APIError: api_error, HTTPException: http_error, EngineDeadError: engine_dead,
                  RequestFailedError: request_failed}
