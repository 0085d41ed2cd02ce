"""Who may talk to the server: the Host it answers to and the web pages it serves.

A local server without a key is only safe if the browser one reads the web with cannot
use it. Two checks, for every route (API and page alike), before anything runs:

- **Host**: a page on a hostname that resolves to 127.0.0.1 (DNS rebinding) reaches the
  server as same-origin, but its requests name that hostname in ``Host``. Only the
  configured host, the loopback names, IP literals (a rebinding needs a name) and
  ``server.allowed_hosts`` pass; with ``server.share``, Gradio's share domain too.
- **Origin**: a page on another origin can send "simple" requests (a form POST, a
  ``text/plain`` fetch) without a CORS preflight. Requests whose ``Origin`` is not the
  server's own (or ``Sec-Fetch-Site: cross-site`` without one) are refused unless the
  origin is in ``server.allowed_origins``. A link followed to the page (a top-level GET
  navigation) still opens it: a navigation reads nothing back and acts on nothing (but
  ``/logout``, which a link from another site could follow to log the user out).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from h2o_chat.config import ServerConfig

from .errors import APIError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
SHARE_DOMAIN = ".gradio.live"  # where Gradio's share tunnel serves the page from
LOGOUT = "/logout"  # Gradio's: a GET that acts
# Headers some layer reads as one value: two of one could be judged on one and acted on
# by the other (the size limit reading the last Content-Type, the body parser the first).
_SINGLE = {name.lower(): name for name in ("Host", "Origin", "Sec-Fetch-Site", "Sec-Fetch-Mode", "Content-Type",
                                           "Content-Length", "Authorization", "X-Session-Id")}


def listed(text: str) -> list[str]:
    """The items of a comma list setting, stripped, empty ones left out."""
    return [item.strip() for item in text.split(",") if item.strip()]


def allowed_origins(server: ServerConfig) -> list[str]:
    """``server.allowed_origins`` as browsers write an ``Origin`` (``*``: any)."""
    return [origin.rstrip("/").lower() for origin in listed(server.allowed_origins)]


class OriginGuard:
    """ASGI middleware refusing (403, OpenAI's error shape) requests from a Host the
    server does not answer to or from a foreign web page, and (400) requests with two of
    a header that is read as one; ``refused`` is told the code of each refusal (for the
    metrics)."""

    def __init__(self, app: ASGIApp, server: ServerConfig,
                 refused: Callable[[str], None] = lambda code: None) -> None:
        self.app, self.refused = app, refused
        self.hosts = {name.lower() for name in (server.host, *LOOPBACK_NAMES, *listed(server.allowed_hosts))}
        self.share = server.share
        self.origins = set(allowed_origins(server))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = origin_form(scope)
            refusal = self.refusal(scope)
            if refusal is not None:
                self.refused(refusal.code)
                if scope["type"] == "http":
                    await refusal.response()(scope, receive, send)
                else:  # a websocket handshake refused before it is accepted
                    await send({"type": "websocket.close", "code": 1008})
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> APIError | None:
        headers: dict[str, str] = {}
        for raw_name, raw_value in scope["headers"]:
            name = raw_name.decode("latin-1").lower()
            if name in _SINGLE and name in headers:
                return APIError(400, f"the request has more than one {_SINGLE[name]} header: send one",
                                param=_SINGLE[name], code="duplicate_header")
            headers[name] = raw_value.decode("latin-1")
        # Only HTTP/1.0 may leave Host out (the HTTP layer refuses an HTTP/1.1 request
        # without one), and no browser does: no page can name a host it is not.
        host = headers.get("host", "")
        if "host" in headers and not self.host_allowed(host):
            return APIError(403, f"Host {host[:100]!r} is not a name this server answers to: add it to "
                                 "server.allowed_hosts to reach the server by that name",
                            param="Host", code="forbidden_host")
        origin = headers.get("origin")
        if origin is not None:
            if self.origin_allowed(origin, host):
                return None
            return APIError(403, f"requests from the web page at {origin[:100]!r} are refused: add that "
                                 "origin to server.allowed_origins to let its pages use this server",
                            param="Origin", code="forbidden_origin")
        navigation = (headers.get("sec-fetch-mode") == "navigate" and scope.get("method") in ("GET", "HEAD")
                      and scope.get("path") != LOGOUT)
        if headers.get("sec-fetch-site") == "cross-site" and not navigation and "*" not in self.origins:
            return APIError(403, "cross-site requests are refused: send them from the server's own page "
                                 "or from an origin in server.allowed_origins",
                            param="Sec-Fetch-Site", code="forbidden_origin")
        return None

    def host_allowed(self, host: str) -> bool:
        name = _hostname(host)
        if name is None:
            return False
        if name in self.hosts or (self.share and name.endswith(SHARE_DOMAIN)):
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.rstrip("/").lower()
        if "*" in self.origins or origin in self.origins:
            return True
        parts = urlsplit(origin)
        # The server's own pages: the origin names the host (and port) the request went to.
        return parts.scheme in ("http", "https") and parts.netloc == host.lower()


def origin_form(scope: Scope) -> Scope:
    """``scope`` with a request target in absolute form (``GET http://host/path``, which
    HTTP/1.1 servers must accept, RFC 9112 3.2.2) as one in origin form, the target's
    authority as its Host, which that form replaces: uvicorn hands such a target on as the
    path, which no route then matched (the page's plain 404 instead of the API's key
    check and errors)."""
    path = scope.get("path", "")
    if not path[:8].lower().startswith(("http://", "https://")):
        return scope
    raw_path = scope.get("raw_path") or path.encode("latin-1")
    try:
        target, raw_target = urlsplit(path), urlsplit(raw_path)
        authority = raw_target.netloc
    except ValueError:  # no authority a Host could name ("http://[::1/"): refused as a Host
        target, raw_target, authority = urlsplit("/"), urlsplit(b"/"), b""
    headers = [(name, value) for name, value in scope["headers"] if name.lower() != b"host"]
    return {**scope, "path": target.path or "/", "raw_path": raw_target.path or b"/",
            "headers": [(b"host", authority), *headers]}


def _hostname(host: str) -> str | None:
    """The name in a Host header without its port (``[::1]:7860`` -> ``::1``); None if
    it is not one."""
    if "@" in host:  # read as a user name by urlsplit: "evil.example@localhost" is no host
        return None
    try:
        name = urlsplit(f"//{host}").hostname
    except ValueError:
        return None
    return name.lower() if name else None
