"""A hostile web page, opened in Debian's chromium from another origin (a second local
server on another port, as any site the user reads would be), tries everything a page
can do without the user: simple POSTs to the API and to the page's own queue, a form
posted into a hidden frame, and a CORS read. The app refuses all of it before any route
runs: its own metrics count the refusals and no token is generated."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from h2o_chat.bench.client import read_metrics, wait_for_metrics

from .api_support import MODEL_ID, api_config, serving

# What the page does once loaded; it reports what it could read back to the test.
HOSTILE_PAGE = """<!doctype html><html><body>
<iframe name="sink" style="display:none"></iframe>
<form id="form" method="POST" target="sink" enctype="text/plain" action="APP/v1/chat/completions">
  <input name='{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "x": "' value='"}'>
</form>
<script>
const body = JSON.stringify({messages: [{role: "user", content: "Say hi."}], max_tokens: 8});
window.attempts = (async () => {
  const simple = {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body};
  await fetch("APP/v1/chat/completions", simple);
  await fetch("APP/gradio_api/queue/join", simple);
  document.getElementById("form").submit();
  try {
    const read = await fetch("APP/v1/models");
    return "read: " + (await read.text());
  } catch (err) {
    return "blocked";
  }
})();
</script></body></html>"""
ATTEMPTS = 4  # requests the page sends that reach the server


@contextmanager
def page_origin(page: str) -> Iterator[str]:
    """``page`` served at the root of a second local server: another origin; yields its URL."""
    body = page.encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.fixture
def hostile_origin(app_url):
    with page_origin(HOSTILE_PAGE.replace("APP", app_url.rstrip("/"))) as origin:
        yield origin + "/"


def test_a_page_on_another_origin_can_make_the_app_do_nothing(browser, app_url, hostile_origin):
    refused, generated = 'h2o_chat_refused_requests_total{code="forbidden_origin"}', "h2o_chat_generated_tokens_total"
    before = read_metrics(app_url)
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(hostile_origin)
        assert page.evaluate("window.attempts") == "blocked"
        # The server decides: wait until it has refused every attempt.
        wait_for_metrics(app_url, lambda m: m[refused] >= before[refused] + ATTEMPTS, timeout=30)
    finally:
        context.close()
    assert read_metrics(app_url)[generated] == before[generated]


# A web client of the user's own, on another port: it sends JSON (so the browser asks
# first, in a CORS preflight) and reads the reply, the conversation's id and the models.
OWN_CLIENT_PAGE = """<!doctype html><html><body><script>
const app = new URLSearchParams(location.search).get("app");
window.used = (async () => {
  const reply = await fetch(app + "/v1/chat/completions", {method: "POST",
    headers: {"Content-Type": "application/json", "X-Session-Id": "my-page"},
    body: JSON.stringify({messages: [{role: "user", content: "Say hi."}], max_tokens: 4, temperature: 0})});
  const models = await (await fetch(app + "/v1/models")).json();
  return {status: reply.status, session: reply.headers.get("X-Session-Id"),
          reply: (await reply.json()).choices[0].message.content, model: models.data[0].id};
})();
</script></body></html>"""


def test_a_page_on_an_allowed_origin_uses_the_api(browser, smollm):
    with page_origin(OWN_CLIENT_PAGE) as origin, serving(smollm, api_config(allowed_origins=origin)) as url:
        context = browser.new_context()
        try:
            page = context.new_page()
            page.goto(f"{origin}/?app={url}")
            used = page.evaluate("window.used")
        finally:
            context.close()
    assert used["status"] == 200 and used["reply"].strip()
    assert (used["session"], used["model"]) == ("my-page", MODEL_ID)
