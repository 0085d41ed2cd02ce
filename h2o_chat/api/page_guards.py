"""What the page's server enforces before Gradio sees a request: body sizes and the login.

Both sit in front of the app as ASGI middleware, because the page's own checks can be
bypassed by any client and Gradio leaves some routes open: with a login configured it
still answered ``/gradio_api/cancel``, ``/heartbeat`` and ``/startup-events`` without
one, and it does not throttle ``/login``.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from http.cookies import CookieError, SimpleCookie
from typing import Any, Callable

from starlette.formparsers import MultiPartException
from starlette.middleware import Middleware

from h2o_chat.config import ServerConfig
from h2o_chat.ui.reload_notice import FRESH_LOGIN_COOKIE

from .body_reads import ReadRefused, Receive, Scope, Send, is_upload, read_guarded


async def _answer(send: Send, status: int, text: str, headers: tuple = ()) -> None:
    body = json.dumps({"detail": text}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class RequestSizeLimit:
    """Answers 413 to a request whose body exceeds its limit: ``max_upload_bytes`` for
    file uploads (multipart, which Gradio streams to disk), ``max_json_bytes`` for any
    other body, which the server parses in memory at a few times its size.

    A declared Content-Length over the limit is refused before reading; a chunked body is
    counted as it streams in, and once over the limit whatever the app answers (it may
    turn the aborted read into a 400) is replaced by the 413.
    """

    def __init__(self, app: Callable, max_upload_bytes: int, max_json_bytes: int) -> None:
        self.app, self.max_upload_bytes, self.max_json_bytes = app, max_upload_bytes, max_json_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = is_upload(scope)
        limit, setting = ((self.max_upload_bytes, "server.max_request_mb") if upload
                          else (self.max_json_bytes, "server.api_max_request_mb"))
        refusal = (f"request body over the server's limit of {limit // 2**20} MB ({setting})")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _answer(send, 413, refusal)
            return
        received, complete = 0, False

        def check(message: dict[str, Any]) -> None:
            nonlocal received, complete
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > limit:
                    raise _UploadRefused(refusal) if upload else ReadRefused
            elif upload and message["type"] == "http.disconnect" and not complete:
                raise MultiPartException("the client left before its upload was whole")

        await read_guarded(self.app, scope, receive, send, check, lambda send: _answer(send, 413, refusal))


class _UploadRefused(ReadRefused, MultiPartException):
    """An upload's read refused, raised as its multipart parse failing: the parsers
    (Gradio's, Starlette's) remove the files they began only then, so an upload refused
    or left half-sent otherwise stayed on disk, up to the limit's size each time."""


# Read (and taken away) by the page that Gradio's login form reloads (ui.reload_notice).
_FRESH_LOGIN = (b"set-cookie", f"{FRESH_LOGIN_COOKIE}=1; Max-Age=60; Path=/; SameSite=Strict".encode())

# Paths the login page itself needs; every other request needs the login's cookie.
_OPEN_PATHS = {"/", "/login", "/login/", "/logout", "/config", "/config/", "/favicon.ico",
               "/theme.css", "/robots.txt", "/manifest.json", "/gradio_api/info", "/gradio_api/info/"}
_OPEN_PREFIXES = ("/assets/", "/static/", "/svelte/", "/pwa_icon")


class LoginGate:
    """With a login configured: every request outside the login page's own needs must
    carry the cookie of a login, and failed logins are throttled per client address.

    The cookie check asks the Gradio app (``scope["app"]``, set by Starlette before the
    middleware runs) which tokens its logins issued. After ``n`` failed logins in a row an
    address must wait ``base_delay_s * 2**(n - 1)`` seconds (at most ``max_delay_s``)
    before its next try; trying earlier is answered 429 at once, so a guessing client
    holds no server resources while it waits.
    """

    def __init__(self, app: Callable, base_delay_s: float = 0.5, max_delay_s: float = 60.0,
                 max_addresses: int = 10_000) -> None:
        self.app = app
        self.base_delay_s, self.max_delay_s, self.max_addresses = base_delay_s, max_delay_s, max_addresses
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()  # address -> (count, last)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or getattr(scope.get("app"), "auth", None) is None:
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path in ("/login", "/login/") and scope.get("method") == "POST":
            await self._login(scope, receive, send)
        elif path in ("/logout", "/logout/"):
            await self.app(scope, receive, send)
            # Gradio forgets only the Secure cookie's token when asked to log out this
            # session alone; a client that kept only the other cookie stayed logged in.
            for token in _cookie_tokens(scope):
                scope["app"].tokens.pop(token, None)
        elif path in _OPEN_PATHS or path.startswith(_OPEN_PREFIXES) or _logged_in(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await _answer(send, 401, "Not authenticated: log in first")
        else:
            await send({"type": "websocket.close", "code": 1008})

    async def _login(self, scope: Scope, receive: Receive, send: Send) -> None:
        address = (scope.get("client") or ("unknown",))[0]
        count, last = self._failures.get(address, (0, 0.0))
        wait = 0.0 if count == 0 else min(self.max_delay_s, self.base_delay_s * 2 ** (count - 1))
        left = last + wait - time.monotonic()
        if left > 0:
            await _answer(send, 429, f"too many failed logins from this address: try again in "
                                     f"{left:.1f} s", headers=((b"retry-after", str(int(left) + 1).encode()),))
            return
        status = 0

        async def watched_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if status == 200:  # the page reloads next: it must not say it was reset
                    message = {**message, "headers": [*message.get("headers", ()), _FRESH_LOGIN]}
            await send(message)

        # Counted as failed until it is known not to be: tries sent together would each
        # be checked while the first one is (QA: 100 sent at once were 99 real guesses).
        self._record_failure(address, count + 1)
        try:
            await self.app(scope, receive, watched_send)
        finally:
            if 0 < status < 400:
                self._failures.pop(address, None)
            else:  # the wait runs from the end of the check
                self._record_failure(address, count + 1)

    def _record_failure(self, address: str, count: int) -> None:
        self._failures.pop(address, None)
        self._failures[address] = (count, time.monotonic())
        while len(self._failures) > self.max_addresses:
            self._failures.popitem(last=False)  # the oldest failure goes first


def _logged_in(scope: Scope) -> bool:
    tokens = getattr(scope.get("app"), "tokens", None)
    return bool(tokens) and any(token in tokens for token in _cookie_tokens(scope))


def _cookie_tokens(scope: Scope) -> list[str]:
    """The login tokens the request's cookies carry (Gradio sets a Secure cookie and one
    for plain HTTP)."""
    cookie_id = getattr(scope.get("app"), "cookie_id", None)
    if cookie_id is None:
        return []
    header = dict(scope.get("headers") or []).get(b"cookie", b"").decode("latin-1")
    try:
        cookies = SimpleCookie(header)
    except CookieError:
        return []
    names = (f"access-token-{cookie_id}", f"access-token-unsecure-{cookie_id}")
    return [cookies[name].value for name in names if name in cookies]


class ImagesFromHere:
    """Tells the browser to load images only from the page's own server (and the data it
    holds itself). A chat renders Markdown, and an image in a reply or an imported
    conversation, "![](https://elsewhere/?what-the-chat-said)", was fetched from anywhere:
    the usual way a prompt injection sends a conversation out."""

    POLICY = (b"content-security-policy", b"img-src 'self' data: blob:")

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_policy(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.POLICY]}
            await send(message)

        await self.app(scope, receive, with_policy)


def page_middleware(server: ServerConfig) -> list[Middleware]:
    """What sits in front of the mounted page: the image policy, the login gate, then the
    request-size limits of ``server``."""
    return [Middleware(ImagesFromHere), Middleware(LoginGate),
            Middleware(RequestSizeLimit, max_upload_bytes=server.max_request_mb * 2**20,
                       max_json_bytes=server.api_max_request_mb * 2**20)]
