"""Stopping a reply where the user looks: the send button turns into Stop while a view
generates (as in Open WebUI, LM Studio and llama.cpp's web UI), and Esc stops too, at any
stage of the turn: waiting in the queue, reading the prompt, or generating."""

from __future__ import annotations

import threading
from typing import Any

import gradio as gr
from gradio.events import Dependency, EventListenerMethod

from .view_state import ViewState, stop_state

# Runs once in the page: Esc clicks the Stop button in view (only the open tab's is
# shown, and only while it generates).
ESC_STOPS = """() => {
  document.addEventListener("keydown", (event) => {
    if (event.key !== "Escape") return;
    for (const button of document.querySelectorAll(".stop-reply")) {
      if (button.offsetParent !== null) button.click();
    }
  });
}"""

# Runs once in the page: a double-click on a send button is one send. Its second click
# landed on the Stop now in Send's place, and stopped the turn before its reply ("Stopped
# before the reply began"); or, in the frame where Send is hidden and Stop not drawn yet,
# on the control beside them that slid under the pointer (pin this message, Reset, New
# story). The rest of a multi-click that began on a send button, or that lands on a Stop
# (a Stop is one click), is dropped before Gradio or the browser acts on it.
ONE_CLICK_SENDS_OR_STOPS = """() => {
  let began = null;
  document.addEventListener("click", (event) => {
    if (event.detail <= 1) {
      began = event.target;
    } else if (began?.closest?.(".send-reply") || event.target.closest?.(".stop-reply")) {
      event.stopImmediatePropagation();
      event.preventDefault();
    }
  }, true);
}"""


# The page's half of the swap (see ``SendStopSwap.on``): Send hidden, Stop shown.
SHOW_STOP = """() => [{__type__: "update", visible: false}, {__type__: "update", visible: true}]"""
# The same, where a Send clicked (the button under focus, about to be hidden) took the focus
# with it to the page itself: a keyboard user had to find the way back before the next
# message. ``keep_focus`` says where the focus goes instead. Not on a touch screen, where
# nobody tabs and focus on the box opened the keyboard over the reply.
SHOW_STOP_KEEP_FOCUS = """() => {
  if (document.activeElement?.closest("#%(send)s") && !matchMedia("(pointer: coarse)").matches) {
    %(keep_focus)s
  }
  return (%(show_stop)s)();
}"""
# A view with a message box: to the box, as a chat app does, so the next message is typed
# at once.
FOCUS_BOX = """document.querySelector("#%(box)s textarea")?.focus();"""
# A view without one (the story's Continue): back to Send once the turn ends and Gradio draws
# it anew, unless the user put the focus somewhere meanwhile. Without scrolling: a reader who
# scrolled away from the button while the text streamed stays where they are.
FOCUS_SEND_AGAIN = """const clicked = document.querySelector("#%(send)s");
    const back = new MutationObserver(() => {
      const send = document.querySelector("#%(send)s");
      if (!send || send === clicked) return;
      back.disconnect();
      if (document.activeElement === document.body) send.focus({preventScroll: true});
    });
    back.observe(document.body, {childList: true, subtree: true});"""


class StopSignal:
    """A view's Stop for its next or running turn, kept per browser in a ``gr.State``.
    Asking for a turn renews ``event``; Stop sets it; the turn hands it to its sessions.
    So a Stop while the turn still waits in the queue (no session runs yet to be told)
    ends the turn as soon as it starts, before it reads a token."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __deepcopy__(self, memo: dict) -> StopSignal:
        return StopSignal()  # gr.State copies its first value for every browser

    def renew(self) -> None:
        self.event = threading.Event()


def send_button(label: str, elem_id: str, **layout: Any) -> gr.Button:
    """A view's button that starts a turn, and turns into its Stop while the turn runs
    (``SendStopSwap``); ``layout``: Gradio's ``scale`` and ``min_width``."""
    return gr.Button(label, variant="primary", elem_id=elem_id, elem_classes=["send-reply"], **layout)


def stop_button(prefix: str) -> gr.Button:
    """The Stop button, built beside the send button it replaces while generating (its
    ``SendStopSwap`` wires it)."""
    return gr.Button("Stop", variant="stop", visible=False, elem_id=f"{prefix}-stop",
                     elem_classes=["stop-reply"], scale=0, min_width=100)


def _stop(view: ViewState | None, signal: StopSignal) -> None:
    signal.event.set()
    stop_state(view)  # a turn that began before its signal was renewed holds another event


def ended_either_way(event: Dependency) -> tuple:
    """What chains a step after ``event`` whether it succeeds or fails. Gradio 6.31's page
    runs a ``.then`` step after success alone (its docs say either way), so after a
    failed turn Stop stayed shown for good; ``.failure`` runs after a failure alone."""
    return event.then, event.failure


class SendStopSwap:
    """Shows ``stop`` instead of ``send`` while a turn runs or waits, and makes Stop stop
    it. Only the page shows Stop and only a turn's end shows Send, so the two cannot be
    answered out of order. Call ``on`` before wiring the turns (the page runs a trigger's
    events in the order they were wired, and the swap must come first) and ``until`` with
    the turns once wired; the turns take ``signal`` among their inputs and hand
    ``stop_event(values)`` to their sessions. For others that follow the view's turns (the server line):
    ``started``, the swap's event in the page, which runs at once when a turn is asked for
    (an event wired after a turn on the same trigger waits for the turn to end), and
    ``turns``. ``box``: the view's message box, which a click on Send gives the focus;
    without one, Send gets it back when the turn ends."""

    def __init__(self, send: gr.Button, stop: gr.Button, state: gr.State,
                 box: gr.Textbox | None = None) -> None:
        self.send, self.stop, self.state = send, stop, state
        ids = {"send": send.elem_id, "box": None if box is None else box.elem_id}
        keep_focus = FOCUS_SEND_AGAIN if box is None else FOCUS_BOX
        self.show_stop = SHOW_STOP_KEEP_FOCUS % {"keep_focus": keep_focus % ids, "show_stop": SHOW_STOP, **ids}
        # A closed tab sets it: a turn of that tab that Gradio already took from the queue
        # ends before it reads a token.
        self.signal = gr.State(StopSignal(), delete_callback=lambda signal: signal.event.set())
        self.started: Dependency | None = None
        self.turns: list[Dependency] = []
        stop.click(_stop, [state, self.signal], None, concurrency_limit=None, show_progress="hidden")

    def on(self, triggers: list[EventListenerMethod]) -> None:
        # The swap runs in the page, at the moment of the click or Enter. Answered by the
        # server it could arrive after a turn that had meanwhile ended had shown Send
        # again (seen on a loaded machine: Stop left shown, with nothing to stop). Stop
        # already shown (a turn runs; this one will be refused) stays as it is.
        self.started = gr.on(triggers, None, None, [self.send, self.stop], js=self.show_stop, queue=False,
                             show_progress="hidden", trigger_mode="multiple")

        def start(view: ViewState | None, signal: StopSignal) -> None:
            # With a turn running, the turn asked for will be refused, and a Stop now is
            # a Stop of the running one: its signal stays.
            if view is None or not view.streaming:
                signal.renew()  # a Stop of an earlier turn must not stop this one

        gr.on(triggers, start, [self.state, self.signal], None, queue=False, show_progress="hidden")

    def stop_event(self, values: dict) -> threading.Event:
        """The event that stops the turn whose inputs are ``values``."""
        return values[self.signal].event

    def until(self, events: list[Dependency]) -> None:
        """Back to ``send`` when one of ``events`` ends, unless a turn still runs (a
        refused second turn ends while the first still streams)."""
        self.turns += events

        def after(view: ViewState | None) -> tuple:
            if view is not None and view.streaming:
                # Left to the running turn's own ``after``. Answering "Stop" here could
                # reach the page after that one's "Send" (the two replies race on a busy
                # machine), leaving Stop shown with nothing to stop.
                return gr.skip(), gr.skip()
            return gr.Button(visible=True), gr.Button(visible=False)

        # "multiple": with Gradio's default ("once") the page drops an ``after`` while
        # another is in flight, so a refused turn's, answered late by a busy server, ate
        # the running turn's and left Stop shown.
        for event in events:
            for ended in ended_either_way(event):
                ended(after, [self.state], [self.send, self.stop], queue=False,
                      show_progress="hidden", trigger_mode="multiple")
