"""What a connection may hold while it sends a request: uvicorn bounds neither how many
connections stay open nor how long a request may take to arrive, so a client that opens
sockets and never finishes their requests (slowloris, or a body sent a byte at a time)
held one file descriptor each, without end, until the process ran out and stopped
answering anyone."""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from functools import partial
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from h2o_chat.config import ServerConfig

# File descriptors kept back from connections for everything else the process opens
# (model and session files, pipes, the listening socket, the libraries' own).
RESERVED_FDS = 128
# The slowest average a request body may arrive at, past its first send_timeout_s: a
# deadline between pieces alone let a client sending a byte every few seconds hold its
# connection for ever. 1 KB/s is slower than any real link, so no upload is cut by it.
MIN_BODY_BYTES_PER_S = 1024

log = logging.getLogger("uvicorn.error")


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    send_timeout_s: float


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
    return ConnectionLimits(allowed, server.send_timeout_s)


@dataclass
class LimitLog:
    """Whether one server has said its connection limit is reached: one line when it is,
    not one per refused connection, since a flood of them would fill the log as fast as
    it comes. Per server, so one server's flood does not silence another's."""

    said: bool = False


def guarded_protocol(limits: ConnectionLimits) -> Any:
    """The protocol factory for uvicorn's ``Config(http=...)``."""
    return partial(GuardedHTTP, limits=limits, limit_log=LimitLog())


class GuardedHTTP(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus: a connection past ``max_connections`` gets 503
    and is closed at once (so its descriptor is back before the next accept), and a
    client that owes a request is closed when it is late: a whole request head is due
    ``send_timeout_s`` after connecting or after its last response; a body's next piece
    is due ``send_timeout_s`` after its last one, and the body as a whole may take
    ``send_timeout_s`` plus a second for each ``MIN_BODY_BYTES_PER_S`` it has sent. A
    request sent whole is never timed out, however long its answer takes (a reply
    streaming for minutes, a page's event stream)."""

    def __init__(self, *args: Any, limits: ConnectionLimits, limit_log: LimitLog, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.limit_log = limit_log
        self.deadline: asyncio.TimerHandle | None = None
        self.body_started: float | None = None  # loop time of the body's first piece
        self.body_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.refuse()
            return
        self.limit_log.said = False
        self.await_client()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.SEND_BODY:
            self.await_body(len(data))

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop_waiting()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.await_client()

    def refuse(self) -> None:
        if not self.limit_log.said:
            self.limit_log.said = True
            log.warning("h2o-chat: %d connections open, the limit (server.max_connections): "
                        "new ones get 503 until some close", self.limits.max_connections)
        body = (f"The server holds {self.limits.max_connections} connections, its limit "
                f"(server.max_connections): try again later.\n").encode()
        self.transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        self.transport.close()

    def await_client(self) -> None:
        """Give the client ``send_timeout_s`` for a whole request head."""
        self.body_started = None
        self.wait(self.limits.send_timeout_s)

    def await_body(self, received: int) -> None:
        now = self.loop.time()
        if self.body_started is None:
            self.body_started, self.body_bytes = now, 0
        self.body_bytes += received
        earned = self.body_started + self.limits.send_timeout_s + self.body_bytes / MIN_BODY_BYTES_PER_S
        self.wait(min(self.limits.send_timeout_s, earned - now))

    def wait(self, seconds: float) -> None:
        self.stop_waiting()
        if not self.transport.is_closing():
            self.deadline = self.loop.call_later(max(seconds, 0.0), self.overdue)

    def stop_waiting(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def overdue(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the app, not the client, is behind: the body's clock restarts
            self.body_started = None
            self.wait(self.limits.send_timeout_s)
            return
        awaiting_head = self.cycle is None or self.cycle.response_complete
        if awaiting_head or self.conn.their_state is h11.SEND_BODY:
            self.transport.close()
