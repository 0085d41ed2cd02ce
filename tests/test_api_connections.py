"""Sockets that never finish a request cannot pile up (slowloris): past
``server.max_connections`` a connection gets 503 at once, and a client silent for
``server.send_timeout_s`` while it owes a request (its head, or the rest of its body), or
sending its body slower than a real link would, is closed by the server. Sent for real, over raw sockets, to the served API; real clients
check the rest."""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from h2o_chat.api.connections import MIN_BODY_BYTES_PER_S
from h2o_chat.config import ConfigError

from h2o_chat.bench.client import read_metrics, wait_for_metrics

from .api_support import MODEL_ID, api_config, client, serving

LIMIT, SEND_TIMEOUT_S = 8, 1.0
# A request head that never ends: no blank line after its last header.
HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"


@pytest.fixture(scope="module")
def url(smollm):
    with serving(smollm, api_config(max_connections=LIMIT, send_timeout_s=SEND_TIMEOUT_S)) as url:
        yield url


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


@contextmanager
def half_open(url: str, count: int) -> Iterator[list[socket.socket]]:
    """``count`` connections, each having sent part of a request head."""
    with ExitStack() as stack:
        sockets = []
        for _ in range(count):
            sock = stack.enter_context(socket.create_connection(address(url), timeout=30))
            sock.sendall(HALF_HEAD)
            sockets.append(sock)
        yield sockets


def read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (the socket's timeout bounds
    the wait: a server that never closes fails the test there)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_connection_past_the_limit_gets_503_and_is_closed(url):
    with half_open(url, LIMIT):
        with socket.create_connection(address(url), timeout=30) as extra:
            answer = read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert answer.endswith(b"The server holds 8 connections, its limit (server.max_connections): "
                               b"try again later.\n")
        # A real client sees the same while the limit holds.
        refused = httpx.get(url + "/health")
        assert refused.status_code == 503 and "server.max_connections" in refused.text


def test_the_limit_is_said_once_while_it_holds_whatever_another_server_accepts(url, smollm):
    """A flood refused at one server's limit writes one line, not one per refusal, even
    while a second server in the same process (the page's, a test's) accepts connections."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("uvicorn.error")
    assert httpx.get(url + "/health").status_code == 200  # under the limit: the next reach is said
    # Added once both servers run: a server's start sets uvicorn's loggers afresh.
    with serving(smollm, api_config(max_connections=LIMIT, send_timeout_s=SEND_TIMEOUT_S)) as other, \
            half_open(url, LIMIT):
        logger.addHandler(handler)
        try:
            for _ in range(3):
                with socket.create_connection(address(url), timeout=30) as extra:
                    assert read_all(extra).startswith(b"HTTP/1.1 503")
                assert httpx.get(other + "/health").status_code == 200
        finally:
            logger.removeHandler(handler)
    assert [line for line in lines if "server.max_connections" in line] == [
        "h2o-chat: 8 connections open, the limit (server.max_connections): new ones get 503 until some close"]


def test_a_head_not_sent_in_time_is_closed_and_frees_its_place(url):
    with half_open(url, LIMIT) as sockets:
        started = time.monotonic()
        for sock in sockets:
            assert read_all(sock) == b""  # closed by the server, with nothing sent
        assert time.monotonic() - started >= SEND_TIMEOUT_S * 0.9
        # Their places are free again: the API answers.
        assert httpx.get(url + "/health").status_code == 200


def test_a_keep_alive_connection_idle_past_the_deadline_is_closed(url):
    with socket.create_connection(address(url), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = b""
        while b"\r\n\r\n" not in first:
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 OK")
        # Half of the next request's head, then nothing: closed like a new connection's.
        sock.sendall(HALF_HEAD)
        read_all(sock)


def chat_request(padding: int = 0) -> tuple[bytes, bytes]:
    """A one-token chat request's head and body, the body padded with ``padding`` spaces
    (JSON whitespace) to make it as long as a test needs."""
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1%s}' % (
        MODEL_ID.encode(), b" " * padding)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    return head, body


def test_a_body_that_stops_coming_is_closed_and_one_that_keeps_coming_is_answered(url):
    """A pause longer than the deadline inside a body closes the connection; a body whose
    pieces come more often than that, at a real link's rate, is read whole however long
    it takes in all."""
    head, body = chat_request()
    with socket.create_connection(address(url), timeout=30) as sock:
        sock.sendall(head + body[:10])
        assert read_all(sock) == b""  # closed, unanswered
    head, body = chat_request(padding=4000)
    pieces = [body[i:i + 400] for i in range(0, len(body), 400)]
    with socket.create_connection(address(url), timeout=60) as sock:
        sock.sendall(head)
        for piece in pieces:  # 0.4 s apart: the whole body takes longer than the deadline
            time.sleep(SEND_TIMEOUT_S * 0.4)
            sock.sendall(piece)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        assert len(pieces) * SEND_TIMEOUT_S * 0.4 > 3 * SEND_TIMEOUT_S
        assert answer.startswith(b"HTTP/1.1 200 OK")


def test_a_body_that_trickles_is_closed_though_its_pieces_come_in_time(url):
    """A byte at a time, each well within the deadline, cannot hold a connection for ever:
    past the deadline, a body earns its time by the bytes it has sent
    (``MIN_BODY_BYTES_PER_S``)."""
    head, body = chat_request()
    pause = SEND_TIMEOUT_S * 0.4
    with socket.create_connection(address(url), timeout=30) as sock:
        sock.sendall(head)
        sock.settimeout(pause)
        started, sent, closed = time.monotonic(), 0, False
        while sent < len(body) - 1 and not closed:
            try:
                closed = sock.recv(65536) == b""  # a server that answers fails below
                assert closed
            except TimeoutError:
                sock.sendall(body[sent:sent + 1])
                sent += 1
        elapsed = time.monotonic() - started
    assert closed, f"{sent} bytes sent one at a time, {pause} s apart, and the connection still open"
    assert SEND_TIMEOUT_S * 0.9 <= elapsed < SEND_TIMEOUT_S + (len(head) + sent) / MIN_BODY_BYTES_PER_S + 2 * pause


def test_bodies_being_read_hold_at_most_their_shared_limit(smollm):
    """Each within its own limit, two bodies at once past ``server.max_body_memory_mb``:
    the one that would pass it gets 503 while the first is still coming, and the held
    bytes are let go when the first one's client leaves."""
    with serving(smollm, api_config(api_max_request_mb=1, max_body_memory_mb=1)) as url:
        head, body = chat_request(padding=900_000)
        _, small_body = chat_request(padding=200_000)
        with socket.create_connection(address(url), timeout=30) as stalled:
            stalled.sendall(head + body[:900_000])  # and no more, for now: with the next, past 1 MB
            wait_for_metrics(url, lambda seen: seen["h2o_chat_request_body_bytes"] >= 900_000)
            refused = httpx.post(url + "/v1/chat/completions", content=small_body, timeout=60,
                                 headers={"Content-Type": "application/json"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"] == {
            "message": "the server is reading 1 MB of request bodies, its limit (server.max_body_memory_mb): "
                       "try again later", "type": "unavailable_error", "param": None, "code": "server_busy"}
        wait_for_metrics(url, lambda seen: seen["h2o_chat_request_body_bytes"] == 0)  # the client left
        assert httpx.post(url + "/v1/chat/completions", content=small_body, timeout=120,
                          headers={"Content-Type": "application/json"}).status_code == 200
        assert read_metrics(url)['h2o_chat_refused_requests_total{code="server_busy"}'] == 1


def test_a_reply_that_streams_past_the_deadline_is_not_cut(url):
    """The deadline is for a request head only: a stream read slowly, well past it,
    ends whole, with its finish reason."""
    stream = client(url).chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Count from one to twenty."}],
        max_tokens=24, temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    time.sleep(SEND_TIMEOUT_S * 2)  # the deadline passes while the response is under way
    rest = list(chunks)
    assert first.choices[0].delta.role == "assistant"
    assert rest[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("max_connections", 7, "must be an integer from 8 to 1000000"),
    ("send_timeout_s", 0, "must be a number of seconds > 0 and <= 3600"),
    ("api_key", "k-1,,k-2", "must be a key, or different keys separated by commas, none empty"),
    ("api_key", "k-1, k-1", "must be a key, or different keys separated by commas, none empty"),
    ("max_body_memory_mb", 4, r"must be at least server.api_max_request_mb \(8\)"),
])
def test_the_limits_are_checked_by_name(field, value, allowed):
    with pytest.raises(ConfigError, match=rf"server\.{field} = {re.escape(repr(value))}: {allowed}"):
        api_config(**{field: value})
