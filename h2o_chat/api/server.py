"""One web server for the UI and the API: the Gradio app mounted at ``/`` inside the
API's FastAPI app, served by uvicorn on one port."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import socket
import threading
import time
from types import FrameType

import gradio as gr
import uvicorn
from fastapi import FastAPI
from gradio.networking import setup_tunnel
from gradio.routes import App as PageApp
from starlette.routing import Mount

from h2o_chat.config import AppConfig, ConfigError, ServerConfig
from h2o_chat.engine.memory import return_freed_memory
from h2o_chat.runtime import ModelProvider
from h2o_chat.scheduler import stop_workers
from h2o_chat.ui.app import launch_options

from .connections import connection_limits, guarded_protocol
from .page_guards import page_middleware
from .routes import create_api

# Seconds uvicorn waits, once told to stop, for responses still open before cancelling them.
GRACE_S = 3


def create_app(provider: ModelProvider, name: str, config: AppConfig, demo: gr.Blocks) -> FastAPI:
    """The API (``/v1``, ``/health``, ``/metrics``) with ``demo`` mounted at ``/``, keeping
    the page's login and request-size limit."""
    api = create_api(provider, name, config, released=return_freed_memory)
    app = gr.mount_gradio_app(api, demo.queue(), "/", show_error=True,
                              app_kwargs={"middleware": page_middleware(config.server)},
                              **launch_options(config.server))
    # Gradio checks that a file handed to an input was uploaded to its own folder only
    # for a Blocks it launched itself (Gradio 6.31, processing_utils._check_allowed):
    # mounted, a page client could name any path on the server, /dev/zero included,
    # and have it read into the cache. Mounted here is launched.
    demo.has_launched = True
    return app


def listen(server: ServerConfig) -> socket.socket:
    """The socket the app serves on, bound now: before the model starts loading, so an
    address in use or not this machine's ends the start with one line naming the
    settings. Left to uvicorn, the bind failed after the page's address was printed, and
    its exit, with the model's loader thread inside torch, aborted the process."""
    where = f"server.host = {server.host!r}, server.port = {server.port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            server.host, server.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except OSError as err:
        raise ConfigError(f"{where}: cannot listen there: {err.strerror or err}", field="server.host") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise ConfigError(f"{where}: cannot listen there: {err.strerror or err}", field="server.port") from None
    return sock


def serve(app: FastAPI, server: ServerConfig, sock: socket.socket) -> None:
    """Serve ``app`` on ``sock`` (from ``listen``) until interrupted; with
    ``server.share`` also through a public Gradio share link."""
    runner = _Server(uvicorn_config(app, server))
    logging.getLogger("uvicorn.error").addFilter(CancelledAtExit(runner))
    if server.share:
        threading.Thread(target=_share, args=(runner, server), name="share-link", daemon=True).start()
    host = f"[{server.host}]" if ":" in server.host else server.host  # an IPv6 address, as URLs write it
    print(f"h2o-chat: page at http://{host}:{server.port}/, API at http://{host}:{server.port}/v1", flush=True)
    if warning := exposure_warning(server):
        print(warning, flush=True)
    runner.run(sockets=[sock])


def exposure_warning(server: ServerConfig) -> str | None:
    """A line saying who else can use what, when ``server`` is reachable from beyond this
    machine (a host not on loopback, or a share link) with the page or the API unguarded:
    a deliberate setting, but one whose reach is easy to miss."""
    reach = []
    if not _loopback(server.host):
        reach.append(f"anyone who can reach this machine (server.host = {server.host})")
    if server.share:
        reach.append("anyone with the public share link (server.share)")
    # With a login and no key the API is off, so only an unguarded page is open then.
    open_doors = []
    if server.username is None:
        open_doors.append("the page (no login: set server.username and server.password, "
                          "or H2O_CHAT_USERNAME and H2O_CHAT_PASSWORD)")
        if server.api_key is None:
            open_doors.append("the API (no key: set server.api_key or H2O_CHAT_API_KEY)")
    if not reach or not open_doors:
        return None
    return f"h2o-chat: warning: {' and '.join(reach)} can use {' and '.join(open_doors)}"


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any address


def uvicorn_config(app: FastAPI, server: ServerConfig) -> uvicorn.Config:
    """How uvicorn serves ``app`` on ``server``'s address, within its connection limits."""
    # Open pages hold event streams: on Ctrl-C, wait for them only briefly. The client's
    # address is the socket's: uvicorn would take X-Forwarded-For from any loopback peer,
    # which on the default host is every client, and the login's throttle keys on it.
    return uvicorn.Config(app, host=server.host, port=server.port, log_level="warning", proxy_headers=False,
                          timeout_graceful_shutdown=GRACE_S, http=guarded_protocol(connection_limits(server)))


class CancelledAtExit(logging.Filter):
    """Once ``server`` is stopping, a response still open when the grace period ends is
    cancelled by uvicorn, by design (a page's event stream that outlives it, say): uvicorn
    logs that as an ASGI exception with its traceback; this says it in one line."""

    def __init__(self, server: uvicorn.Server) -> None:
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if self.server.should_exit and isinstance(exc, asyncio.CancelledError):
            record.msg, record.args = f"h2o-chat: a response still open after {GRACE_S} s was closed", ()
            record.exc_info = record.exc_text = None
        return True


class _Server(uvicorn.Server):
    """Told to stop (Ctrl-C), it first ends what would keep a response open: the replies
    under way (the model's worker stops, they end as stopped) and the open pages'
    heartbeat streams, which Gradio ends only for an app it launched itself. Left open,
    uvicorn's graceful shutdown cancelled them after ``GRACE_S``, with a traceback each."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # In a thread of its own: this signal handler runs on the event loop's thread,
        # which the worker's last step may wait for (a lock held where the signal came).
        threading.Thread(target=stop_workers, name="stop-workers").start()
        loop = asyncio.get_running_loop()
        for mounted in self.config.app.routes:
            if isinstance(mounted, Mount) and isinstance(mounted.app, PageApp):
                loop.call_soon_threadsafe(mounted.app.stop_event.set)
        super().handle_exit(sig, frame)


def _share(runner: uvicorn.Server, server: ServerConfig) -> None:
    while not runner.started:
        time.sleep(0.1)
    try:
        url = setup_tunnel(server.host, server.port, secrets.token_urlsafe(32), None, None)
    except Exception as err:  # no network, blocked download of the tunnel client, ...
        print(f"h2o-chat: no share link: {err}", flush=True)
        return
    print(f"h2o-chat: public share link {url}", flush=True)
