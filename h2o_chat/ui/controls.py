"""Stopping a reply where the user looks: the send button turns into Stop while a view
generates (as in Open WebUI, LM Studio and llama.cpp's web UI), and Esc stops too."""

from __future__ import annotations

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


def stop_button(prefix: str, state: gr.State) -> gr.Button:
    """The Stop button, built beside the send button it replaces while generating; it
    stops the turn of the view whose ``state`` it is given, at once (no queue)."""
    button = gr.Button("Stop", variant="stop", visible=False, elem_id=f"{prefix}-stop",
                       elem_classes=["stop-reply"], scale=0, min_width=100)
    button.click(stop_state, [state], None, concurrency_limit=None, show_progress="hidden")
    return button


class SendStopSwap:
    """Shows ``stop`` instead of ``send`` while a turn runs. Call ``on`` before wiring the
    turns (the page runs a trigger's events in the order they were wired, and the swap
    must come first) and ``until`` with the turns once wired. For others that follow the
    view's turns (the server line): ``started``, the swap's own event, which runs at once
    when a turn is asked for (an event wired after a turn on the same trigger waits for
    the turn to end), and ``turns``."""

    def __init__(self, send: gr.Button, stop: gr.Button, state: gr.State) -> None:
        self.send, self.stop, self.state = send, stop, state
        self.started: Dependency | None = None
        self.turns: list[Dependency] = []

    def on(self, triggers: list[EventListenerMethod]) -> None:
        self.started = gr.on(triggers, lambda: (gr.Button(visible=False), gr.Button(visible=True)),
                             None, [self.send, self.stop], queue=False, show_progress="hidden")

    def until(self, events: list[Dependency]) -> None:
        """Back to ``send`` when one of ``events`` ends, unless a turn still runs (a
        refused second turn ends while the first still streams)."""
        self.turns += events

        def after(view: ViewState | None) -> tuple[gr.Button, gr.Button]:
            running = view is not None and view.streaming
            return gr.Button(visible=not running), gr.Button(visible=running)

        for event in events:
            event.then(after, [self.state], [self.send, self.stop], queue=False,
                       show_progress="hidden")
