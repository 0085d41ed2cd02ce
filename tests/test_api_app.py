"""``app.py`` serves the page and the API on one port: the page keeps its login and the
API asks for its key."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from .browser_support import configure, messages, running_app, send


@pytest.fixture(scope="module")
def uploads(tmp_path_factory) -> Path:
    """The folder the app's page writes uploads into (Gradio's temporary folder)."""
    return tmp_path_factory.mktemp("uploads")


@pytest.fixture(scope="module")
def url(tmp_path_factory, uploads):
    """One app with a login, an API key and 1 MB request limits, for the tests below in
    their order: the successful logins come before the failed ones, which the server
    remembers per address."""
    config = tmp_path_factory.mktemp("login") / "config.yaml"
    config.write_text("server:\n  max_request_mb: 1\n  api_max_request_mb: 1\n")
    login = {"H2O_CHAT_USERNAME": "ann", "H2O_CHAT_PASSWORD": "s3cret", "H2O_CHAT_API_KEY": "k-123",
             "GRADIO_TEMP_DIR": str(uploads)}
    with running_app("--config", str(config), env=login, log_path=uploads.parent / "app.log") as url:
        yield url


def test_the_page_and_the_api_share_one_port_each_with_its_own_login(url):
    assert url.startswith("http://127.0.0.1:")
    page = httpx.get(url)
    assert page.status_code == 200 and "gradio" in page.text.lower()
    # The page's own API wants the login; the OpenAI API wants the key.
    assert httpx.get(url + "gradio_api/info").status_code == 401
    page_user = httpx.Client(base_url=url)
    assert page_user.post("login", data={"username": "ann", "password": "s3cret"}).status_code == 200
    assert httpx.get(url + "v1/models").status_code == 401
    # Any method: one no route names went on to the page's 404 (QA).
    assert httpx.request("TRACE", url + "v1/models").status_code == 401
    client = OpenAI(base_url=url + "v1", api_key="k-123", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens <= 4
    assert httpx.get(url + "health").json()["status"] == "ok"
    # The page's request-size limit still holds in front of the mounted UI.
    too_big = page_user.post("gradio_api/upload", content=b"x" * (2**20 + 1),
                             headers={"content-type": "multipart/form-data; boundary=x"})
    assert too_big.status_code == 413 and "server.max_request_mb" in too_big.text
    page_user.close()


def _files(folder: Path) -> set[Path]:
    return {path for path in folder.rglob("*") if path.is_file()}


def test_an_upload_refused_or_left_half_sent_leaves_no_file_behind(url, uploads):
    """The page streams uploads to disk; one over the limit, or one whose client hung up
    midway, left its part on disk (QA: a file of up to the limit's size for each try, and
    a traceback in the server's log for the one left half-sent)."""
    multipart = {"content-type": "multipart/form-data; boundary=cut"}
    head = b'--cut\r\nContent-Disposition: form-data; name="files"; filename="a.bin"\r\n\r\n'
    with httpx.Client(base_url=url, timeout=60) as page_user:
        assert page_user.post("login", data={"username": "ann", "password": "s3cret"}).status_code == 200
        kept = page_user.post("gradio_api/upload", files={"files": ("kept.txt", b"k" * 1000)})
        assert kept.status_code == 200, kept.text
        before = _files(uploads)
        assert any(path.name == "kept.txt" for path in before)  # the folder uploads go to
        chunked = page_user.post("gradio_api/upload", content=iter([head] + [b"x" * 2**18] * 6), headers=multipart)
        assert chunked.status_code == 413 and "server.max_request_mb" in chunked.text
        assert _files(uploads) == before
        cookie = "; ".join(f"{name}={value}" for name, value in page_user.cookies.items())
    port = int(url.rsplit(":", 1)[1].strip("/"))
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"POST /gradio_api/upload HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       b"Content-Type: multipart/form-data; boundary=cut\r\nContent-Length: 900000\r\n"
                       b"Cookie: " + cookie.encode() + b"\r\n\r\n" + head + b"x" * 2**18)
        deadline = time.monotonic() + 30
        while _files(uploads) == before:  # the part being written
            assert time.monotonic() < deadline, "the half-sent upload never reached the disk"
            time.sleep(0.05)
    deadline = time.monotonic() + 30
    while _files(uploads) != before:  # the client left: its part goes
        assert time.monotonic() < deadline, f"left behind: {_files(uploads) - before}"
        time.sleep(0.05)
    assert "Exception in ASGI application" not in (uploads.parent / "app.log").read_text()


def test_the_login_page_logs_in_and_the_chat_answers(browser, url):
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    errors = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.goto(url)
    page.get_by_label("username").fill("ann")
    page.get_by_label("password").fill("s3cret")
    page.get_by_role("button", name="Login").click()
    page.wait_for_selector("#model-status:has-text('Model ready')", timeout=120_000)
    configure(page, max_new_tokens=8)
    send(page, "#chat-input", "#chat-send", "Say hello.")
    assert messages(page, "chatbot", "bot")[0].strip()
    assert errors == []
    page.context.close()


def test_logging_out_ends_the_login_whichever_cookie_the_client_kept(url):
    """Gradio sets a Secure cookie and one for plain HTTP; logging out this session alone
    forgot only the first one's token (QA: a client that kept the other stayed logged in)."""
    with httpx.Client(base_url=url) as ann:
        assert ann.post("login", data={"username": "ann", "password": "s3cret"}).status_code == 200
        (plain,) = [f"{name}={value}" for name, value in ann.cookies.items()
                    if name.startswith("access-token-unsecure-")]
    kept = {"cookie": plain}  # sent as a header each time: the client's jar would drop it
    assert httpx.get(url + "gradio_api/info", headers=kept).status_code == 200
    assert httpx.get(url + "logout", params={"all_session": "false"}, headers=kept).status_code == 302
    assert httpx.get(url + "gradio_api/info", headers=kept).status_code == 401


def test_with_a_login_every_page_route_wants_it_and_failed_logins_wait(url):
    with httpx.Client(base_url=url) as guest, httpx.Client(base_url=url) as ann:
        # Routes Gradio itself leaves open act on sessions: closed without the login.
        open_before = [("POST", "gradio_api/cancel"), ("GET", "gradio_api/heartbeat/abc"),
                       ("GET", "gradio_api/startup-events"), ("POST", "gradio_api/reset")]
        for method, path in open_before:
            answer = guest.request(method, path)
            assert (answer.status_code, answer.json()) == (401, {"detail": "Not authenticated: log in first"}), path
        assert guest.get("").status_code == 200  # the login page itself
        # A wrong password, then a second try at once: refused until the wait is over.
        assert guest.post("login", data={"username": "ann", "password": "nope"}).status_code == 400
        # Whatever address a header claims (QA: X-Forwarded-For from a loopback client was
        # taken as the client's address, a fresh one for each guess).
        early = guest.post("login", data={"username": "ann", "password": "s3cret"},
                           headers={"x-forwarded-for": "10.1.2.3"})
        assert early.status_code == 429 and "too many failed logins from this address" in early.json()["detail"]
        time.sleep(0.6)
        assert guest.post("login", data={"username": "ann", "password": "nope"}).status_code == 400
        assert guest.post("login", data={"username": "ann", "password": "s3cret"}).status_code == 429
        time.sleep(1.1)  # the second failure doubled the wait
        assert ann.post("login", data={"username": "ann", "password": "s3cret"}).status_code == 200
        assert ann.get("gradio_api/startup-events").status_code != 401
        assert ann.get("gradio_api/info").status_code == 200
        # A chunked JSON body over the limit: 413, not Gradio's 400.
        chunks = iter([b'{"data": ["' + b"x" * 2**19, b"x" * 2**19, b"x" * 2**19 + b'"]}'])
        too_big = ann.post("gradio_api/queue/join", content=chunks, headers={"content-type": "application/json"})
        assert too_big.status_code == 413 and "server.api_max_request_mb" in too_big.text


def test_failed_logins_sent_together_are_one_guess(url):
    """Tries sent at once from one address: the first is checked, the others wait as if
    it had failed (QA: 100 wrong logins sent together were 99 real guesses a minute)."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    together = Barrier(20)

    def guess(number: int) -> int:
        with httpx.Client(base_url=url) as client:
            client.get("health")  # connected: the logins below go out as one
            together.wait()
            return client.post("login", data={"username": "ann", "password": f"guess{number}"}).status_code

    with ThreadPoolExecutor(20) as pool:
        assert sorted(pool.map(guess, range(20))) == [400] + [429] * 19


def _server_memory(port: int) -> tuple[Path, Path]:
    """The ``status`` and ``clear_refs`` files of the app serving ``port``."""
    for child in psutil.Process().children(recursive=True):
        if f"--port {port}" in " ".join(child.cmdline()):
            return Path(f"/proc/{child.pid}/status"), Path(f"/proc/{child.pid}/clear_refs")
    raise LookupError(port)


def _kb(status: Path, key: str) -> int:
    return next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith(key + ":"))


def test_bodies_near_or_over_the_limit_cost_the_server_at_most_three_times_their_size(tmp_path):
    """Peak memory of the server process (its high-water mark reset before each body)
    grows by at most 16 MB plus three times the body, whatever the body and route."""
    config = tmp_path / "config.yaml"
    config.write_text("server:\n  api_max_request_mb: 4\n")
    with running_app("--config", str(config)) as url, httpx.Client(base_url=url, timeout=300) as client:
        first = client.post("v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 2})
        assert first.status_code == 200, first.text
        status, clear_refs = _server_memory(int(url.rsplit(":", 1)[1].strip("/")))
        under = 4 * 2**20 - 1000
        message = b'{"messages": [{"role": "user", "content": "' + b"x" * (under - 60) + b'"}]}'
        many_values = b'{"messages": [' + b"[]," * ((under - 20) // 3) + b"[]]}"
        cases = [
            ("v1/chat/completions", message, 400),  # parsed, then refused: the message is too long
            ("v1/chat/completions", many_values, 400),  # refused before parsing: too many values
            ("v1/chat/completions", iter([b"x" * 2**20] * 6), 413),  # chunked, over the limit
            ("gradio_api/queue/join", iter([b"x" * 2**20] * 6), 413),
        ]
        for path, body, expected in cases:
            clear_refs.write_text("5")  # the peak mark := the memory in use now
            before = _kb(status, "VmRSS")
            answer = client.post(path, content=body, headers={"content-type": "application/json"})
            assert answer.status_code == expected, (path, answer.text[:200])
            size = len(body) if isinstance(body, bytes) else 6 * 2**20
            growth = (_kb(status, "VmHWM") - before) * 1024
            print(f"\n{path}: {size:,} bytes -> {answer.status_code}, server peak grew {growth / 2**20:.1f} MB")
            assert growth <= 16 * 2**20 + 3 * min(size, 4 * 2**20), (path, growth / 2**20)
