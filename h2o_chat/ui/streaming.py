"""Pacing of streamed updates: a turn's wait for a generation slot, throttled map/gauge
pushes and sessions taking turns."""

from __future__ import annotations

import html
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from collections.abc import Callable, Generator, Iterator, Mapping

import gradio as gr

from h2o_chat.admission import Admission

log = logging.getLogger(__name__)

# What a turn's updates return: the failure that ended it, None where it ended well.
TurnEnd = Exception | None

# Map and gauges are pushed at most this often while tokens stream (text goes out on
# every token): rendering them on every token would slow decoding on a small CPU.
UPDATE_INTERVAL_S = 0.3
# The live retained-token map, rebuilt by the browser on each push, goes out at most this
# often: pushed every 0.3 s, a long chat's map up to doubled the time the page's main
# thread was busy (tools/measure_page.py --views long-chat --map-off-too).
MAP_INTERVAL_S = 1.0
# One reply's text goes out at most this often (ten pushes a second still read as a
# stream). Pushed on every token, a reply of the embedded model kept the page's main
# thread busy 0.37 of a core here, and every push is the server's work too, beside the
# decoding: at 0.1 s, 0.28 of a core and 13% more text a second (docs/benchmarks.md).
TEXT_INTERVAL_S = 0.1
# Two replies streaming at once (compare) push their text together at most this often:
# each push re-renders the chatbots, and one push per token of each side kept the page's
# main thread busy more than a third of the time (tools/measure_page.py).
PAIRED_TEXT_INTERVAL_S = 0.25


def in_slot(admission: Admission, stop: threading.Event, updates: Generator[dict, None, TurnEnd],
            waiting: Callable[[str], dict]) -> Generator[dict, None, TurnEnd]:
    """A turn's page ``updates`` (and what they return), run once the turn holds one of
    the model's generation slots, which the API's requests take too (Gradio's own queue
    counts only the page's turns). While it waits, the note shows as a toast and as the update ``waiting(note)``.
    A Stop while it waits (``stop`` set) ends the wait; the turn then reads nothing and
    ends at once."""
    ticket = admission.request()
    try:
        if not ticket.granted:
            replies = "reply" if admission.limit == 1 else "replies"
            note = (f"Waiting for a free generation slot: the server generates at most "
                    f"{admission.limit} {replies} at once, page and API together.")
            gr.Info(note)
            # An update goes out through the event loop, and the toast with it: a toast
            # alone, raised in this thread, waits for the loop's next wake-up (seconds).
            yield waiting(note)
            ticket.wait(stop)
        return (yield from updates)
    finally:
        ticket.done()


class Throttle:
    """``due()`` is True at most once per ``interval`` seconds, and on the first call."""

    def __init__(self, interval: float = UPDATE_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval, self.clock = interval, clock
        self._last = float("-inf")

    def due(self) -> bool:
        now = self.clock()
        if now - self._last < self.interval:
            return False
        self._last = now
        return True


class Interleaved:
    """Several text streams advanced one chunk each per round, each in a thread of its
    own (their generations run batched in the model's scheduler either way). Chunks come
    out once the whole round is done, so the sides show their text in step."""

    def __init__(self, streams: Mapping[str, Generator[str, None, None]]) -> None:
        self._streams = dict(streams)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        try:
            with ThreadPoolExecutor(max_workers=len(self._streams) or 1,
                                    thread_name_prefix="h2o-chat-stream") as pool:
                while self._streams:
                    steps = {key: pool.submit(self._step, key) for key in self._streams}
                    wait(steps.values())
                    for key, step in steps.items():
                        chunk = step.result()  # a stream's failure ends the round here
                        if chunk is None:
                            del self._streams[key]
                        else:
                            yield key, chunk
        finally:
            # Abandoned midway (client gone) or failed: end each turn now, so its session
            # records the partial reply and frees its turn lock.
            for stream in self._streams.values():
                stream.close()

    def _step(self, key: str) -> str | None:
        """The next chunk of one stream, None once it has ended."""
        return next(self._streams[key], None)


def message_back(box: gr.Textbox, text: str, failure: Exception | None = None) -> dict:
    """The update after a turn its session took back (stopped, or failed, before the
    reply's first token): the message back in ``box``, to send again or edit, and a note
    saying so (a warning naming the ``failure``, if any)."""
    back = "the message is back in its box, and the conversation is as it was before it."
    if failure is None:
        gr.Info(f"Stopped before the reply began: {back}")
    else:
        reply_failed(failure, taken_back=back)
    return {box: text}


def reply_failed(failure: Exception, taken_back: str | None = None) -> None:
    """The note of a reply that failed: once under way, the conversation keeps what it
    generated; before its first token, the turn was ``taken_back`` (what became of it).
    A warning, not a raised ``gr.Error``: that would mark every output of the event as
    failed, the message box included (a red pill over the message given back to it),
    where the views already show what the turn left."""
    named = f"{type(failure).__name__}: {failure}"
    if taken_back is None:
        note = (f"The reply failed: {named}. The conversation keeps what was generated before the "
                "failure; you can send again.")
    else:
        note = f"The reply failed before it began: {named}; {taken_back}"
    gr.Warning(html.escape(note))


def log_failure(failure: Exception) -> None:
    """A failed reply, with its traceback, in the server's log: news to its operator."""
    log.error("h2o-chat: a reply on the page failed", exc_info=failure)


def stream_turn(
    stream: Iterator[str],
    show: Callable[[str], dict],
    views: Callable[[bool], dict],
    final: Callable[[], dict],
    closed: Callable[[], bool],
    throttle: Throttle | None = None,
    paced: Throttle | None = None,
) -> Generator[dict, None, TurnEnd]:
    """The updates of one streamed turn: ``show(text so far)`` when ``paced`` lets it
    through (``TEXT_INTERVAL_S``), and with ``views(final=False)`` (gauges, map) when the
    ``throttle`` lets them through, in step with the tokens; at the end ``final() |
    views(True)``. Stops quietly once ``closed()`` (the view was reset meanwhile, so its
    outputs belong to someone else now). A failure inside the turn ends it the same way
    and is returned, for the view to say what became of the message (kept, or taken back
    with the turn)."""
    throttle = throttle or Throttle()
    paced = paced or Throttle(TEXT_INTERVAL_S)
    text = ""
    failure = None
    try:
        for chunk in stream:
            if closed():
                return None
            text += chunk
            if throttle.due():
                yield show(text) | views(False)
            elif paced.due():
                yield show(text)
    except Exception as err:
        # The session kept the partial reply (or took back a turn that produced nothing):
        # the views show what it holds now, and the next turn starts from there.
        log_failure(err)
        failure = err
    if not closed():
        yield final() | views(True)
    return failure
