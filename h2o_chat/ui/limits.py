"""Server-side limits on what a request may carry, enforced before Gradio reads it."""

from __future__ import annotations

from typing import Any, Callable

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]


class RequestTooLarge(Exception):
    pass


class RequestSizeLimit:
    """ASGI middleware: answers 413 to an HTTP request whose body exceeds ``max_bytes``.

    The page's own checks can be bypassed by any client, and Starlette reads a whole
    body into memory, so the bound has to sit in front of the app: a declared
    Content-Length over the limit is refused before reading, and a chunked body is
    counted as it streams in.
    """

    def __init__(self, app: Callable, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send)
            return
        received = 0
        started = False

        async def counted_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLarge
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except RequestTooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = (f"request body over the server's limit of {self.max_bytes // 2**20} MB "
                "(server.max_request_mb)").encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
