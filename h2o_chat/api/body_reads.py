"""Request bodies read under rules of the server's own: one request's size, and what all
the bodies being received may hold together.

A JSON body is read into memory whole before it is parsed (up to
``server.api_max_request_mb``), so without a shared bound ``server.max_connections``
clients each sending a large body slowly held their sum: about 8 GB at the defaults,
before any of them was refused.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ReadRefused(Exception):
    """Raised by a check on a request's body pieces: read no more of it."""


async def read_guarded(app: Callable, scope: Scope, receive: Receive, send: Send,
                       check: Callable[[dict[str, Any]], None], refuse: Callable[[Send], Awaitable[None]]) -> None:
    """Run ``app`` with each message it receives shown to ``check`` first. Once ``check``
    raises ReadRefused, the app's own answer to the aborted read (a 400, a 500) is dropped
    and ``refuse`` answers instead, unless the app had begun its response already."""
    refused = started = False

    async def checked_receive() -> dict[str, Any]:
        nonlocal refused
        message = await receive()
        try:
            check(message)
        except ReadRefused:
            refused = True
            raise
        return message

    async def guarded_send(message: dict[str, Any]) -> None:
        nonlocal started
        if refused:
            return
        started = started or message["type"] == "http.response.start"
        await send(message)

    try:
        await app(scope, checked_receive, guarded_send)
    except ReadRefused:
        pass
    if refused and not started:
        await refuse(send)


def is_upload(scope: Scope) -> bool:
    """A multipart body, which Gradio streams to disk rather than holding."""
    return any(name == b"content-type" and value.startswith(b"multipart/form-data")
               for name, value in scope.get("headers") or [])


class BodyBudget:
    """The bytes of the request bodies being received now, and the most they may hold.
    One event loop serves every request: no lock is needed."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.held = max_bytes, 0


class BodyMemory:
    """ASGI middleware: the bodies of the requests being received (uploads, streamed to
    disk, aside) hold at most ``budget.max_bytes`` together; a piece past that ends its
    request with ``refusal`` (503: the server, not the request, is at its limit). A body's
    bytes count from its first piece until its last one came or its request ended."""

    def __init__(self, app: Callable, budget: BodyBudget, refusal: Callable[[], Any]) -> None:
        self.app, self.budget, self.refusal = app, budget, refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_upload(scope):
            await self.app(scope, receive, send)
            return
        mine = 0

        def check(message: dict[str, Any]) -> None:
            nonlocal mine
            if message["type"] != "http.request":
                return
            size, budget = len(message.get("body", b"")), self.budget
            if budget.held + size > budget.max_bytes:
                raise ReadRefused
            budget.held, mine = budget.held + size, mine + size
            if not message.get("more_body", False):
                budget.held, mine = budget.held - mine, 0

        async def refuse(send: Send) -> None:
            await self.refusal()(scope, receive, send)

        try:
            await read_guarded(self.app, scope, receive, send, check, refuse)
        finally:
            self.budget.held -= mine
