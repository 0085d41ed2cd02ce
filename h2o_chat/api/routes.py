"""The HTTP API: OpenAI's chat completions and models under /v1, plus /health and /metrics.

``create_api`` returns the FastAPI app the web UI is then mounted in (at ``/``), so both
share one port; the API's routes come first and answer their own paths.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.routing import request_response
from starlette.types import Receive, Scope, Send

from h2o_chat.config import AppConfig, api_keys, quoted
from h2o_chat.inputs import InputError, InputLimits, read_json
from h2o_chat.scheduler import scheduler_for

from .conversations import ConversationStore, check_session_id
from .turns import Delta, Finished, Turn, TurnRunner
from .errors import APIError
from .body_reads import BodyBudget, BodyMemory
from .origins import OriginGuard, allowed_origins
from .metrics import CONTENT_TYPE, Metrics
from .responses import DONE, Reply, event
from .schema import ChatRequest, parse_chat_request

if TYPE_CHECKING:
    from h2o_chat.runtime import ModelProvider

def create_api(provider: ModelProvider, name: str, config: AppConfig,
               released: Callable[[], None] = lambda: None) -> FastAPI:
    """The API on ``provider``'s model, called ``name`` (a ``ModelProvider``: it may still
    be loading). ``released`` runs after kept conversations are freed."""
    server = config.server
    store = ConversationStore(server.api_max_conversations, server.idle_release_minutes * 60, released)
    provider.memory.add_reclaimer(store.drop_least_recent)  # a kept conversation is rebuilt if it returns
    metrics = Metrics(store.conversations,
                      lambda: scheduler_for(provider.get().model) if provider.ready else None,
                      provider.admission, provider.memory)
    turns = TurnRunner(provider, config, metrics, store)
    authorize = _authorizer(server.api_key, login=server.username is not None)
    max_body = server.api_max_request_mb * 2**20
    limits = InputLimits.of(server)
    started = int(time.time())
    # Docs pages off: they would fetch scripts from a CDN, and the UI owns the paths.
    api = FastAPI(title="h2o-chat API", docs_url=None, redoc_url=None, openapi_url=None)
    # The pages the guard lets through may read what they are answered (a web client of
    # the user's own on another port): CORS headers and preflights for those origins.
    api.add_middleware(CORSMiddleware, allow_origins=allowed_origins(server),
                       allow_methods=["GET", "HEAD", "POST"], expose_headers=["X-Session-Id"],
                       allow_headers=["Authorization", "Content-Type", "X-Session-Id"])

    def bodies_at_limit() -> JSONResponse:
        metrics.refused.labels("server_busy").inc()
        return APIError(503, f"the server is reading {server.max_body_memory_mb} MB of request bodies, "
                             "its limit (server.max_body_memory_mb): try again later",
                        code="server_busy", headers={"Retry-After": "1"}).response()

    bodies = BodyBudget(server.max_body_memory_mb * 2**20)
    metrics.request_body_bytes.set_function(lambda: bodies.held)
    api.add_middleware(BodyMemory, budget=bodies, refusal=bodies_at_limit)
    # Outermost: the page mounted on this app later is behind the same checks.
    api.add_middleware(OriginGuard, server=server, refused=lambda code: metrics.refused.labels(code).inc())

    def count(request: Request, status: int) -> None:
        # By route template, not path: clients must not be able to add label values.
        metrics.requests.labels(getattr(request.scope.get("route"), "path", "other"), str(status)).inc()

    @api.exception_handler(APIError)
    async def refused(request: Request, err: APIError) -> JSONResponse:
        count(request, err.status)
        return err.response()

    def answered(request: Request, response: Response) -> Response:
        count(request, response.status_code)
        return response

    @api.exception_handler(ClientDisconnect)
    async def left(request: Request, err: ClientDisconnect) -> Response:
        return answered(request, Response(status_code=499))  # while its body was read: nothing started

    @api.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> Response:
        status = "ok" if provider.ready else "error" if provider.error is not None else "loading"
        why = {} if provider.failure is None else {"error": provider.failure}
        return answered(request, JSONResponse({"status": status, "model": name} | why,
                                              status_code=200 if status == "ok" else 503))

    @api.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus(request: Request) -> Response:
        authorize(request)
        return answered(request, Response(metrics.render(), media_type=CONTENT_TYPE))

    def model_card() -> dict[str, Any]:
        return {"id": name, "object": "model", "created": started, "owned_by": "h2o-chat"}

    @api.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request) -> Response:
        authorize(request)
        return answered(request, JSONResponse({"object": "list", "data": [model_card()]}))

    @api.api_route("/v1/models/{wanted:path}", methods=["GET", "HEAD"])
    async def model(request: Request, wanted: str) -> Response:
        authorize(request)
        if wanted != name:
            raise APIError(404, f"the model {quoted(wanted, 40)} does not exist; this server has {name!r}",
                           param="model", code="model_not_found")
        return answered(request, JSONResponse(model_card()))

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        owner = authorize(request)
        chat = parse_chat_request(await _read_json(request, max_body, limits), config.generation, limits)
        session_id = request.headers.get("x-session-id")
        started = asyncio.ensure_future(
            turns.start(chat, owner, None if session_id is None else check_session_id(session_id)))
        if not await _while_connected(request, started):
            metrics.cancelled.labels("queued").inc()
            return answered(request, Response(status_code=499))
        turn = started.result()
        reply = Reply(name)
        headers = {"X-Session-Id": turn.session_id}
        if chat.stream:  # counted when it ends: 499 if the client left before the last event
            # The session's refusal is a status, not an event in a 200 stream.
            accepted = asyncio.ensure_future(turn.accepted())
            if not await _while_connected(request, accepted):
                turn.cancel()
                return answered(request, Response(status_code=499))
            accepted.result()
            return _TurnStream(turn, _events(turn, chat, reply), headers, lambda status: count(request, status))
        collected = asyncio.ensure_future(_collect(turn))
        if not await _while_connected(request, collected):
            turn.cancel()
            return answered(request, Response(status_code=499))
        return answered(request, JSONResponse(reply.completion(*collected.result()), headers=headers))

    async def unknown(request: Request) -> Response:
        authorize(request)  # the key guards all of /v1: what exists is not told without it
        path = request.path_params.get("path", "")
        raise APIError(404, f"no such endpoint: {request.method[:20]} /v1{'/' + path[:100] if path else ''}",
                       code="unknown_url")

    async def only_read(request: Request) -> Response:
        if request.scope["path"] == "/metrics":
            authorize(request)
        raise APIError(405, f"{request.method[:20]} {request.scope['path']}: this endpoint answers GET and HEAD",
                       code="method_not_allowed", headers={"Allow": "GET, HEAD"})

    # Every method: a method no route named (TRACE, PROPFIND) went on to the page mounted
    # at / and its 404, past the key; at /health and /metrics, to Starlette's bare 405.
    api.add_route("/v1", _EveryMethod(unknown))
    api.add_route("/v1/{path:path}", _EveryMethod(unknown))
    api.add_route("/health", _EveryMethod(only_read))
    api.add_route("/metrics", _EveryMethod(only_read))

    return api


class _EveryMethod:
    """A request handler as an ASGI endpoint, whose route takes every method: Starlette
    gives a route of a function only the methods it lists (GET unless told)."""

    def __init__(self, handler: Callable[[Request], Awaitable[Response]]) -> None:
        self.app = request_response(handler)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def _authorizer(setting: str | None, login: bool) -> Callable[[Request], str]:
    """A check of the request's ``Authorization: Bearer`` key, giving whose request it is
    (the key's place in ``server.api_key``; "" without keys), so that each key's
    conversations stay its own. Without a key configured, a server with a login for its
    page refuses the API, which would bypass the login."""
    expected = [key.encode() for key in api_keys(setting)]

    def authorize(request: Request) -> str:
        if not expected:
            if login:
                raise APIError(401, "the API is off: this server has a login (server.username) but no "
                                    "API key; set server.api_key or H2O_CHAT_API_KEY",
                               code="invalid_api_key")
            return ""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # Every key compared, in constant time each: the answer's timing tells no key's place.
        matches = [hmac.compare_digest(given.strip().encode(), key) for key in expected]
        if scheme.lower() != "bearer" or not any(matches):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                "with a key of server.api_key", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return f"key {matches.index(True) + 1}"

    return authorize


async def _read_json(request: Request, max_bytes: int, limits: InputLimits) -> Any:
    """The body as JSON, read no further than ``max_bytes`` (413 beyond), and parsed only
    if it holds no more JSON values than a conversation within ``limits`` needs."""
    too_large = APIError(413, f"request body over the API's limit of {max_bytes // 2**20} MB "
                              "(server.api_max_request_mb)", code="request_too_large")
    kind = request.headers.get("content-type")
    # A body a browser page may send without asking first (text/plain, a form) is not an
    # API request; clients that send none are taken as JSON, as curl's users expect.
    if kind is not None and kind.split(";")[0].strip().lower() != "application/json":
        raise APIError(415, f"Content-Type {kind[:100]!r}: the request body must be JSON, sent with "
                            "'Content-Type: application/json'", param="Content-Type",
                       code="unsupported_media_type")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large
    try:
        return read_json(bytes(body), "the request body", max_bytes, limits.document_values)
    except InputError as err:
        raise APIError(400, str(err), code="invalid_json") from None


class _TurnStream(StreamingResponse):
    """A streamed reply whose turn stops when the response ends, however it ends: the
    client leaving (the server then cancels the stream, perhaps before its first event),
    a failed send, or the last event out (then there is nothing left to stop). ``ended``
    is told its status: 200 once the last event went out, else 499 (the client left)."""

    def __init__(self, turn: Turn, events: AsyncIterator[bytes], headers: dict[str, str],
                 ended: Callable[[int], None]) -> None:
        super().__init__(self._sent(events), media_type="text/event-stream", headers=headers)
        self.turn, self.ended, self.complete = turn, ended, False

    async def _sent(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for item in events:
            yield item
        self.complete = True  # resumed after the last event was sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.turn.cancel()
            self.ended(200 if self.complete else 499)


async def _events(turn: Turn, chat: ChatRequest, reply: Reply) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed reply."""
    try:
        yield event(reply.chunk({"role": "assistant", "content": ""}))
        async for item in turn:
            if isinstance(item, Delta):
                yield event(reply.chunk({"content": item.text}))
            else:
                finished = item
        yield event(reply.chunk({}, finished.finish_reason, h2o=finished.h2o))
        if chat.include_usage:
            yield event(reply.usage_chunk(finished))
    except APIError as err:  # after the 200 went out: the error travels as an event
        yield event(err.body())
    yield DONE


async def _collect(turn: Turn) -> tuple[str, Finished]:
    """A whole reply: its text and how it ended."""
    parts = []
    async for item in turn:
        if isinstance(item, Delta):
            parts.append(item.text)
        else:
            return "".join(parts), item
    raise AssertionError("a turn always ends with Finished or an error")


async def _while_connected(request: Request, work: asyncio.Future) -> bool:
    """Wait for ``work`` while the client stays; True once it is done. False, ``work``
    cancelled, when the client left first (a turn ``work`` already gave is not stopped
    by this: the caller does that)."""
    async def client_gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work.done():
        work.result()  # raises what the work raised (a refusal)
        return True
    work.cancel()
    return False
