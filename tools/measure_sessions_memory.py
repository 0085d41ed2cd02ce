"""Server memory as browser sessions open and close: ``python -m tools.measure_sessions_memory [sessions] [batch]``
(defaults 50 and 10).

Starts the real app and opens browser contexts in batches of ``batch``, each sending a
message long enough to fill its cache to the budget (so every session holds a full
cache); once a batch is open it is closed, and the next batch opens. Prints the server
process's resident memory and its conversation count (the page's server line) with each
batch open and after it closed. (Batches, because one small machine cannot render 50
live pages at once.)
"""

from __future__ import annotations

import sys
import time

import psutil
from playwright.sync_api import sync_playwright

from tests.browser_support import DONE_TIMEOUT_MS, chromium, configure, open_app, running_app

MESSAGE = "Summarise this. " + "The river ran past the mill, and the miller counted sacks of grain. " * 40


def server_process(url: str) -> psutil.Process:
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            return psutil.Process(conn.pid)
    raise RuntimeError(f"no process listens on port {port}")


def main(sessions: int = 50, batch: int = 10) -> None:
    with running_app() as url, sync_playwright() as playwright, chromium(playwright) as browser:
        server = server_process(url)

        def report(stage: str, page=None) -> None:
            line = page.locator("#server-load").inner_text() if page else ""
            print(f"| {stage} | {server.memory_info().rss / 2**20:.0f} | {line} |", flush=True)

        print("| stage | server RSS MB | server line |\n|---|---:|---|")
        first = open_app(browser, url)
        report("model loaded, no conversation", first)
        first.context.close()
        for done in range(0, sessions, batch):
            pages = []
            for _ in range(min(batch, sessions - done)):
                page = open_app(browser, url)
                configure(page, max_new_tokens=2)
                page.fill("#chat-input textarea", MESSAGE)
                page.click("#chat-send")
                page.wait_for_selector("#chatbot [data-testid=bot]", timeout=DONE_TIMEOUT_MS)
                page.wait_for_selector(".generating", state="detached", timeout=DONE_TIMEOUT_MS)
                pages.append(page)
            time.sleep(5.5)  # one tick of the server line
            report(f"sessions {done + 1}-{done + len(pages)} open", pages[-1])
            for page in pages:
                page.context.close()
            time.sleep(5)
            check = open_app(browser, url)
            time.sleep(2.5)
            report(f"sessions {done + 1}-{done + len(pages)} closed", check)
            check.context.close()

if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:]))
