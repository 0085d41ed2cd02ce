"""The real app in a subprocess and Debian's chromium driven by Playwright, for the
browser tests and the screenshot script. Playwright never downloads a browser here: it
drives /usr/bin/chromium (``make test`` installs it)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
from playwright.sync_api import JSHandle, Locator, Page, expect

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
DONE_TIMEOUT_MS = 120_000
# What the page shows waits behind decoding, which on a busy 2-core machine takes far
# longer than Playwright's default 5 s for each expect().
expect.set_options(timeout=30_000)
# Settings under which the reply to "Count from one to two hundred in words." streams for
# 236 tokens (top-p 0.9, the config's; "two" in its first line), long enough to stop it or
# press Enter again while it streams on a busy machine. Greedy, the reply is 25 tokens
# long and often over first.
LONG_COUNTING_REPLY = {"temperature": 1, "seed": 3}
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# uvicorn's words when the port was taken between free_port() and the app's bind.
PORT_TAKEN = "address already in use"


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself listens on ``port``: while the app imports, another
    program (a test beside it, another user's) may take its port, and must not be taken
    for the app."""
    try:
        return any(conn.status == psutil.CONN_LISTEN and conn.laddr.port == port
                   for conn in psutil.Process(pid).net_connections("tcp"))
    except psutil.NoSuchProcess:
        return False


@contextmanager
def running_app(*args: str, timeout: float = 120, log_path: Path | None = None,
                env: dict[str, str] | None = None, attempts: int = 3,
                script: Path = ROOT / "app.py") -> Iterator[str]:
    """Start ``script`` (the app) on a free port with ``args`` (and ``env`` added to its
    environment); yield its URL once it listens there and answers; stop it at the end. A
    port taken before the app could bind it costs a new start on another port, up to
    ``attempts`` starts. Its output goes to a log that a failure to start shows, kept at
    ``log_path`` if given (for tests that read what the server printed)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    for attempt in range(1, attempts + 1):
        port = free_port()
        log = (open(log_path, "w+") if log_path else
               tempfile.NamedTemporaryFile("w+", prefix="h2o-chat-app-", suffix=".log", delete=False))
        process = subprocess.Popen([sys.executable, str(script), "--port", str(port), *args],
                                   cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}/"
        try:
            if _answers(process, port, url, timeout, Path(log.name), retry=attempt < attempts):
                yield url
                return
        finally:
            _stop(process)
            log.close()
            if not log_path:
                os.unlink(log.name)


def _answers(process: subprocess.Popen, port: int, url: str, timeout: float, log: Path,
             retry: bool) -> bool:
    """Wait until the app ``process`` listens on ``port`` and ``url`` answers: True; False
    if it exited because the port was taken and ``retry``; raise otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            output = log.read_text()
            if retry and PORT_TAKEN in output.lower():
                return False
            raise RuntimeError(f"the app exited with {process.returncode}:\n{output}")
        if listens_on(process.pid, port):
            try:
                with urllib.request.urlopen(url, timeout=2):
                    return True
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the app did not answer within {timeout} s:\n{log.read_text()}")
        time.sleep(0.3)


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def chromium(playwright) -> Iterator:
    """Headless Debian chromium. ``launch`` gives it a fresh temporary profile (user data
    dir) of its own, removed on close."""
    if not Path(CHROMIUM).is_file():
        raise RuntimeError(f"{CHROMIUM} is missing: `make test` installs it "
                           "(or: apt-get install -y chromium)")
    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=CHROMIUM_ARGS)
    try:
        yield browser
    finally:
        browser.close()


def open_app(browser, url: str, width: int = 1400, height: int = 1000, **context) -> Page:
    """A page in a new context (a new Gradio session), once the model is ready;
    ``context``: more options of the context (``has_touch=True``, ``color_scheme="dark"``)."""
    page = browser.new_context(viewport={"width": width, "height": height}, **context).new_page()
    page.goto(url)
    page.wait_for_selector("#model-status:has-text('Model ready')", timeout=120_000)
    # The page folds its settings panel as it loads (ui/settings.py); a click on the
    # header before that would have folded the panel rather than opened it.
    expect(page.locator("#settings .label-wrap")).not_to_have_class(re.compile(r"(^|\s)open(\s|$)"))

    def navigated(frame) -> None:
        # Gradio reloads a page whose event stream broke; a failed test's captured output
        # then says so, which tells that kind of failure from the others.
        if frame is page.main_frame:
            print(f"the page navigated again (a reload?): {frame.url}")

    page.on("framenavigated", navigated)
    return page


def _number_control(page: Page, elem_id: str) -> tuple[Locator, Locator]:
    """The box a number is typed into, and what shows the value taken (the slider, where
    the control has one)."""
    box = page.locator(f"#{elem_id} input[type=number], #{elem_id} textarea")
    # Counted once the control is visible (a panel opening shows it a moment later):
    # counted before, a slider looked like a plain box, and the typed text itself ("1.0"
    # for 1) was then compared with the value.
    expect(box).to_be_visible()
    sliders = page.locator(f"#{elem_id} input[type=range]")
    return box, sliders if sliders.count() else box  # plain number boxes have no slider


def set_number(page: Page, elem_id: str, value: float) -> None:
    """Type ``value`` into the number control ``#elem_id`` once, as a user does, and wait
    until what shows the value taken (the slider) shows it."""
    box, slider = _number_control(page, elem_id)
    box.fill(str(value))
    box.press("Enter")
    box.blur()
    # A value past a slider's ends is held by its box alone (the slider stops at its end).
    if slider != box and not float(slider.get_attribute("min")) <= value <= float(slider.get_attribute("max")):
        expect(box).to_have_value(str(value))
    else:
        expect(slider).to_have_value(f"{value:g}")


def choose(page: Page, elem_id: str, option: str) -> None:
    """Pick ``option`` in the dropdown ``#elem_id`` from its list, as a user does."""
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=option, exact=True).click()
    expect(page.locator(f"#{elem_id} input")).to_have_value(option)
    # The list closes after the choice; until it has, a second dropdown's options would
    # share names with this one's.
    expect(page.get_by_role("option")).to_have_count(0)


def show_settings(page: Page, shown: bool = True) -> None:
    header = page.locator("#settings .label-wrap")
    if ("open" in header.get_attribute("class").split()) != shown:
        header.click()
    expect(page.locator("#settings [data-testid=accordion-content]")).to_be_visible(visible=shown)


def _by_elem_id(numbers: dict[str, float]) -> dict[str, float]:
    """``configure``'s settings by element id (``max_new_tokens`` -> ``max-new-tokens``),
    greedy unless ``temperature`` is given."""
    return {name.replace("_", "-"): value for name, value in {"temperature": 0, **numbers}.items()}


def typed_settings(**numbers: float) -> dict[str, str]:
    """What the page shows once ``configure(page, **numbers)`` has typed them, by element id."""
    return {elem_id: f"{value:g}" for elem_id, value in _by_elem_id(numbers).items()}


def shown_settings(page: Page, *elem_ids: str) -> dict[str, str]:
    """What the number controls ``elem_ids`` show now, by element id."""
    return {elem_id: _number_control(page, elem_id)[1].input_value() for elem_id in elem_ids}


def configure(page: Page, **numbers: float) -> None:
    """Open the settings and type into number controls by element id (``max_new_tokens``
    -> ``#max-new-tokens``), once each. Greedy decoding unless ``temperature`` is given."""
    show_settings(page)
    for elem_id, value in _by_elem_id(numbers).items():
        set_number(page, elem_id, value)


def ran_with(page: Page, view: str) -> dict[str, str]:
    """The settings the view's latest reply ran with, from its small print
    (``#<view>-ran-with``): the sampling settings by the element ids of their controls,
    and ``policy`` and ``budget``."""
    return page.locator(f"#{view}-ran-with .ran-with").evaluate(
        "e => Object.fromEntries([...e.attributes].filter(a => a.name.startsWith('data-'))"
        "                                         .map(a => [a.name.slice(5), a.value]))")


# Installed before a click: notes every Gradio status tracker that shows from then on (the
# outputs of a pending or running event show one; trackers already showing are not the
# click's until they have hidden: an event just ending, whose toast came before its end,
# shares its outputs' trackers with the click's), and says whether all of them are done:
# hidden again, gone, or showing an error. A short event can show and hide its trackers
# between two looks, so each class change is read with the class it had before, and added
# or removed nodes are examined.
_WATCH_EVENT = """() => {
  const trackers = '[data-testid=status-tracker]';
  const shows = t => !t.classList.contains('hide');
  const before = new Set([...document.querySelectorAll(trackers)].filter(shows));
  const shown = new Set();
  const note = (t, showed) => { if (!before.has(t) && (showed || shows(t))) shown.add(t); };
  const within = n => n.nodeType !== 1 ? [] : [n, ...n.querySelectorAll(trackers)].filter(e => e.matches(trackers));
  new MutationObserver(records => {
    for (const r of records) {
      if (r.type === 'attributes' && r.target.matches(trackers)) {
        const wasHidden = (r.oldValue || '').split(/\\s+/).includes('hide');
        if (wasHidden) before.delete(r.target);
        note(r.target, !wasHidden);
      }
      [...r.addedNodes, ...r.removedNodes].flatMap(within).forEach(t => note(t, false));
    }
  }).observe(document.body, {subtree: true, childList: true, attributes: true,
                             attributeFilter: ['class'], attributeOldValue: true});
  return {done: () => shown.size > 0 &&
                      [...shown].every(t => !t.isConnected || !shows(t) || t.querySelector('.error'))};
}"""


def start_and_wait(page: Page, click: str) -> None:
    """Click ``click`` and wait until the event it starts has finished: the status trackers
    of its outputs showed, and are hidden again."""
    event = page.evaluate_handle(_WATCH_EVENT)
    page.click(click)
    page.wait_for_function("event => event.done()", arg=event, timeout=DONE_TIMEOUT_MS)
    event.dispose()


# Installed before an action: notes whether a status tracker within ``selector`` ever
# shows ``text`` (a waiting event's "queue: 2/2" may show for a moment only).
_WATCH_PROGRESS = """([selector, text]) => {
  const state = {seen: false};
  const look = () => {
    const shown = document.querySelectorAll(`${selector} [data-testid=status-tracker]:not(.hide)`);
    if ([...shown].some(tracker => tracker.textContent.includes(text))) {
      state.seen = true;
      observer.disconnect();
    }
  };
  const observer = new MutationObserver(look);
  observer.observe(document.body, {subtree: true, childList: true, characterData: true,
                                   attributes: true, attributeFilter: ['class']});
  look();
  return state;
}"""


def watch_progress(page: Page, selector: str, text: str) -> JSHandle:
    """From now on, whether the progress shown on ``selector`` ever contains ``text``:
    read it with ``seen(handle)``."""
    return page.evaluate_handle(_WATCH_PROGRESS, [selector, text])


def seen(watch: JSHandle) -> bool:
    return watch.evaluate("state => state.seen")


def settled_box(page: Page, selector: str) -> dict[str, float]:
    """The bounding box of the element ``selector`` once it is visible and the layout has
    settled: the same in two animation frames in a row, web fonts loaded."""
    expect(page.locator(selector)).to_be_visible()
    return page.locator(selector).evaluate("""async element => {
      await document.fonts.ready;
      const frame = () => new Promise(resolve => requestAnimationFrame(resolve));
      let before = '';
      for (;;) {
        await frame();
        const r = element.getBoundingClientRect();
        const now = [r.x, r.y, r.width, r.height].join();
        if (now === before) return {x: r.x, y: r.y, width: r.width, height: r.height};
        before = now;
      }
    }""")


def send(page: Page, box: str, button: str, text: str) -> None:
    page.fill(f"{box} textarea", text)
    start_and_wait(page, button)


def gauge(page: Page, elem_id: str) -> dict[str, str]:
    return page.locator(f"#{elem_id} .gauge").evaluate("e => ({...e.dataset})")


def messages(page: Page, chatbot: str, role: str) -> list[str]:
    return page.locator(f"#{chatbot} [data-testid={role}]").all_inner_texts()


def after_next_frame(page: Page) -> None:
    """Wait until the page has drawn two more animation frames: what waited for its next
    frame has run."""
    page.evaluate("() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))")


def open_tab(page: Page, name: str) -> None:
    """Open the tab ``name`` and wait until its controls hold their values: Gradio 6.31
    draws a tab's controls when the tab first opens and, in the next animation frame,
    hands each the value it was built with, so text typed before that frame is lost
    (docs/design.md, "Settings")."""
    page.get_by_role("tab", name=name).click()
    expect(page.get_by_role("tab", name=name)).to_have_attribute("aria-selected", "true")
    after_next_frame(page)


def page_errors(page: Page) -> list[str]:
    """Console errors and uncaught exceptions of ``page`` from now on, as they come."""
    errors: list[str] = []
    page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
    page.on("pageerror", lambda err: errors.append(f"uncaught: {err}"))
    return errors


def toasts(page: Page) -> list[str]:
    """The texts of the notices (warnings, errors) shown in the page's corner."""
    return page.locator("[data-testid=toast-body]").all_inner_texts()
