"""A hostile web page, opened in Debian's chromium from another origin (a second local
server on another port, as any site the user reads would be), tries everything a page
can do without the user: simple POSTs to the API and to the page's own queue, a form
posted into a hidden frame, and a CORS read. The app refuses all of it before any route
runs: its own metrics count the refusals and no token is generated."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from h2o_chat.bench.client import read_metrics, wait_for_metrics

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


@pytest.fixture
def hostile_origin(app_url):
    page = HOSTILE_PAGE.replace("APP", app_url.rstrip("/")).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()


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
