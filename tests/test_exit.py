"""Ending cleanly: a finished Python program that used the chat API exits with status 0
every time, and Ctrl-C stops the app with status 0 and no traceback, whatever is open.
The scheduler's worker is stopped and joined before the interpreter finalizes. Before, a
daemon worker still inside torch at exit aborted the process ("terminate called without
an active exception", status 134) in about one run of five of ``chat_program.py``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import uvicorn
from fastapi import FastAPI

from h2o_chat.api.server import CancelledAtExit

from .browser_support import open_app, running_app

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = Path(__file__).with_name("chat_program.py")
RUNS = 20
EXPECTED_END = ("refused: message is empty: type something to send\n"
                "two threads: ['no', 'yes']\n"
                "stopped after 5 chunks\n")


def test_a_program_that_used_chat_sessions_exits_cleanly_every_time():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    outcomes = []
    for _ in range(RUNS // 2):  # two at a time: each run spends most of its time importing torch
        runs = [subprocess.Popen([sys.executable, str(PROGRAM)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outcomes += [(*run.communicate(timeout=300), run.returncode) for run in runs]
    failed = [(status, err[-2000:]) for _, err, status in outcomes if status != 0]
    assert not failed, f"{len(failed)} of {RUNS} runs failed: {failed}"
    assert all(out.endswith(EXPECTED_END) for out, _, _ in outcomes), [out for out, _, _ in outcomes]


def app_process(url: str) -> psutil.Process:
    """The app ``running_app`` started for ``url``: the child of this process listening there."""
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    return next(child for child in psutil.Process().children()
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in child.net_connections("tcp")))


def test_ctrl_c_ends_the_app_cleanly_with_a_page_open_and_a_reply_streaming(browser, tmp_path):
    log = tmp_path / "server.log"
    story = {"messages": [{"role": "user", "content": "Write a long story about the sea."}], "stream": True,
             "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with running_app(log_path=log) as url:
        page = open_app(browser, url)  # its heartbeat stream stays open
        app = app_process(url)
        with httpx.stream("POST", url + "v1/chat/completions", json=story, timeout=120) as reply:
            lines = reply.iter_lines()
            next(line for line in lines if '"content": "' in line and '"role"' not in line)  # generating
            app.send_signal(signal.SIGINT)
            rest = list(lines)  # the reply ends on its own, cut
        status = app.wait(timeout=60)
        page.context.close()
    assert status == 0
    # Said to be cut, not a finish: it ended with "stop", as if the reply were whole (QA).
    events = [line for line in rest if line]
    assert '"code": "server_shutting_down"' in events[-2] and events[-1] == "data: [DONE]", events[-3:]
    assert not any('"finish_reason": "' in line for line in events), events[-3:]
    printed = log.read_text()
    assert printed.endswith("h2o-chat: stopped.\n") and "Traceback" not in printed, printed


def test_a_response_cancelled_at_the_end_of_the_grace_period_is_one_line_not_a_traceback(caplog):
    """What uvicorn logs when it cancels a response still open after the grace period (an
    ASGI exception with its traceback) becomes one line, but only once the server is
    stopping: a cancellation while it serves keeps its traceback."""
    server = uvicorn.Server(uvicorn.Config(FastAPI()))
    logger, quiet = logging.getLogger("test.uvicorn.error"), CancelledAtExit(server)
    logger.addFilter(quiet)
    cancelled = asyncio.CancelledError("Task cancelled, timeout graceful shutdown exceeded")
    try:
        with caplog.at_level(logging.ERROR, logger=logger.name):
            logger.error("Exception in ASGI application\n", exc_info=cancelled)
            server.should_exit = True
            logger.error("Exception in ASGI application\n", exc_info=cancelled)
            logger.error("Exception in ASGI application\n", exc_info=ValueError("a real one"))
    finally:
        logger.removeFilter(quiet)
    serving, stopping, other = caplog.records
    assert serving.exc_info is not None
    assert stopping.getMessage() == "h2o-chat: a response still open after 3 s was closed" and not stopping.exc_info
    assert other.exc_info is not None and other.getMessage().startswith("Exception in ASGI application")
