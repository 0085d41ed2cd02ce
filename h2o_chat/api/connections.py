"""What a connection may hold before it has sent a request: uvicorn bounds neither how
many connections stay open nor how long a request's headers may take, so a client that
opens sockets and never finishes their headers (slowloris) held one file descriptor
each, without end, until the process ran out and stopped answering anyone."""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from functools import partial
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from h2o_chat.config import ServerConfig

# File descriptors kept back from connections for everything else the process opens
# (model and session files, pipes, the listening socket, the libraries' own).
RESERVED_FDS = 128

log = logging.getLogger("uvicorn.error")


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float


def connection_limits(server: ServerConfig) -> ConnectionLimits:
    """``server``'s limits, with the process's file-descriptor limit raised to hold them
    where the system allows, and the connection count lowered (said once) where not."""
    wanted = server.max_connections + RESERVED_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        soft = raised
    allowed = server.max_connections
    if soft != resource.RLIM_INFINITY and soft - RESERVED_FDS < allowed:
        allowed = max(1, soft - RESERVED_FDS)
        print(f"h2o-chat: server.max_connections = {server.max_connections} needs more open files "
              f"than this system allows ({soft}): at most {allowed} connections", flush=True)
    return ConnectionLimits(allowed, server.header_timeout_s)


def guarded_protocol(limits: ConnectionLimits) -> Any:
    """The protocol factory for uvicorn's ``Config(http=...)``."""
    return partial(GuardedHTTP, limits=limits)


class GuardedHTTP(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus: a connection past ``max_connections`` gets 503
    and is closed at once (so its descriptor is back before the next accept), and one
    that has not sent a whole request head ``header_timeout_s`` after connecting, or
    after its last response, is closed. A request under way (a reply streaming for
    minutes, a page's event stream) is never timed out."""

    # One line when the limit is reached, not one per refused connection: a flood of
    # them would otherwise fill the log as fast as it comes.
    at_limit = False

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.refuse()
            return
        GuardedHTTP.at_limit = False
        self.await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop_waiting()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.await_head()

    def refuse(self) -> None:
        if not GuardedHTTP.at_limit:
            GuardedHTTP.at_limit = True
            log.warning("h2o-chat: %d connections open, the limit (server.max_connections): "
                        "new ones get 503 until some close", self.limits.max_connections)
        body = (f"The server holds {self.limits.max_connections} connections, its limit "
                f"(server.max_connections): try again later.\n").encode()
        self.transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        self.transport.close()

    def await_head(self) -> None:
        self.stop_waiting()
        if not self.transport.is_closing():
            self.head_deadline = self.loop.call_later(self.limits.header_timeout_s, self.head_overdue)

    def stop_waiting(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def head_overdue(self) -> None:
        self.head_deadline = None
        # A request whose head arrived in time has a cycle still answering it.
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()
