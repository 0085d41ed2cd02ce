"""A running h2o-chat server as any plain client sees it: its /metrics read back as
numbers, a wait for them to reach a state, and a chat request sent on a socket of its own
(which the caller closes to leave, as an impatient client would). Shared by the
measurements of the server and the tests that drive it."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Callable

Metrics = dict[str, float]  # "name{labels}" as the server writes it -> value


def read_metrics(url: str) -> Metrics:
    """The server's /metrics now (``url``: its base, a trailing slash allowed)."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


def wait_for_metrics(url: str, condition: Callable[[Metrics], bool], timeout: float = 60,
                     poll_s: float = 0.05) -> Metrics:
    """The metrics once ``condition(metrics)`` holds; TimeoutError, with the metrics last
    read, if it does not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition(seen := read_metrics(url)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server's metrics did not reach the state within {timeout} s: {seen}")
        time.sleep(poll_s)
    return seen


def at_rest(seen: Metrics) -> bool:
    """No API turn generates or waits, and no reply (page or API) is in the scheduler."""
    return (seen["h2o_chat_active_generations"] == seen["h2o_chat_queued_requests"]
            == seen["h2o_chat_scheduler_turns"] == 0)


def send_chat(url: str, body: dict) -> socket.socket:
    """POST ``body`` to /v1/chat/completions on a new connection, read nothing back, and
    hand over the socket."""
    host, port = url.rstrip("/").removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    connection = socket.create_connection((host, int(port)))
    connection.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: "
                       f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return connection
