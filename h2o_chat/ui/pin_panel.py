"""Pinned memory in a view: pin text of the conversation, see the pins and their slots
beside the cache budget, unpin.

Gradio's Chatbot has no text-selection event, so the user selects text in the
conversation, copies it into "text to pin" and presses Pin; the session finds it
(``Session.pin``). In the chat, a checkbox by the send box pins a message as it is sent.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable

import gradio as gr

from h2o_chat.config import MEGABYTE
from h2o_chat.engine.stats import CacheStats
from h2o_chat.sessions import Pin, Session

from .refusals import Refusal, warn
from .view_state import ViewState

# For the panel's gr.HTML (css_template, scoped to it).
PIN_CSS = """
.pins { font-size: 13px; }
.pins table { border-collapse: collapse; width: 100%; margin-top: 4px; }
.pins td, .pins th { border-top: 1px solid var(--border-color-primary); padding: 2px 6px;
  text-align: left; }
/* A pin's text breaks anywhere: "<|im_start|>system", one word, made the table wider than
   the panel at 768 px, which cut it off. */
.pins td:last-child { overflow-wrap: anywhere; }
.pins .fixed { color: var(--body-text-color-subdued); }
"""

TEXT_SHOWN = 80  # characters of a pin's text in the list


def pin_message_checkbox(prefix: str) -> gr.Checkbox:
    """The "pin this message" box, built where the view puts it (by the send box)."""
    return gr.Checkbox(False, label="pin this message", min_width=130, scale=0,
                       elem_id=f"{prefix}-pin-message")


def pins_html(pins: Iterable[Pin], stats: CacheStats) -> str:
    """The pinned slots beside the cache budget, then one row per pin. The numbers are
    also ``data-*`` attributes, for tests and scripts."""
    pins = list(pins)
    fixed = _slots([p for p in pins if p.fixed], stats.seen)
    yours = _slots([p for p in pins if not p.fixed], stats.seen)
    # Pins not read yet (an imported chat's before its first send) hold their slots once read.
    reserved = _slots(pins)
    capacity = None if stats.budget is None else stats.budget - stats.pinned
    if capacity is None:
        budget = "the full cache never evicts: pins matter only with an evicting policy"
    elif stats.budget_bytes is None:
        budget = (f"on top of the cache budget of <b>{capacity}</b>: at most "
                  f"<b>{capacity + reserved}</b> slots held per layer and KV head")
    else:  # a budget in bytes holds the pins too
        capacity = stats.budget - reserved
        budget = (f"within the budget of <b>{stats.budget}</b> slots ({stats.budget_bytes / MEGABYTE:g} MB): "
                  f"<b>{capacity}</b> left for the rest, per layer and KV head")
    rows = "".join(
        f'<tr class="{"fixed" if p.fixed else "pin"}"><td>{p.id}</td>'
        f"<td>{html.escape(p.fixed or 'yours')}</td>"
        f"<td>{p.tokens}{' (not read yet)' if p.end > stats.seen else ''}</td>"
        f"<td>{html.escape(_cut(p.text))}</td></tr>"
        for p in pins
    )
    table = (f"<table><tr><th>pin</th><th>what</th><th>tokens</th><th>text</th></tr>{rows}</table>"
             if pins else "<div>Nothing pinned.</div>")
    return (
        f'<div class="pins" data-pinned="{stats.pinned}" data-fixed="{fixed}" '
        f'data-yours="{yours}" data-capacity="{"" if capacity is None else capacity}" '
        f'data-count="{len(pins)}">'
        f"<div><b>{stats.pinned}</b> pinned slots ({fixed} fixed, {yours} yours, "
        f"overlaps counted once) {budget}</div>{table}</div>"
    )


def _slots(pins: list[Pin], seen: int | None = None) -> int:
    """Slots ``pins`` hold together: their tokens read so far (None: all of them), each
    once. Counted per kind: ``pinned - fixed`` gave a pin of yours inside the system
    prompt none of yours, while its row was listed."""
    held = set()
    for pin in pins:
        held.update(range(pin.start, pin.end if seen is None else min(pin.end, seen)))
    return len(held)


def unpin_choices(pins: Iterable[Pin]) -> list[tuple[str, int]]:
    """The pins a user may unpin (not the system prompt or bible), for a dropdown."""
    return [(f"{p.id}: {_cut(p.text, 40)} ({p.tokens} tokens)", p.id) for p in pins if not p.fixed]


def carry_pins(old: Session, new: Session, resent: str | None = None, then: str | None = None) -> list[str]:
    """Pin in ``new`` (a fresh session on an edited history) the text of ``old``'s pins,
    each at the occurrence nearest its old place; a warning for each whose text is gone.
    A pin of the text ``resent`` is left to the message that sends it again, pinned; the
    texts of the pins found only in ``then``, the message about to be sent on ``new``
    (regenerate, edit), are returned, to be pinned as it is sent (``pin_parts``)."""
    in_message = []
    for pin in old.pins():
        if pin.fixed or (resent is not None and same_text(pin.text, resent)):
            continue
        try:
            new.pin(pin.text, near=pin.start)
        except ValueError as err:
            if then is not None and "".join(pin.text.split()) in "".join(then.split()):
                in_message.append(pin.text)
            else:
                gr.Warning(html.escape(f"Pin {pin.id} was dropped: {err}"))
    return in_message


def warn_dropped_pins(old: Session | None) -> None:
    """Warn that ``old``'s pins go with it: a story whose start changed is read again into
    a fresh cache, where the text is fed at once, too late to pin it before it is read."""
    dropped = [p for p in old.pins() if not p.fixed] if old else []
    if dropped:
        gr.Warning(f"{len(dropped)} pin(s) dropped: the story was read again into a fresh "
                   "cache. Pin their text again: what the cache holds still can be.")


def same_text(a: str, b: str) -> bool:
    """Whether two texts are the same to a pin, which ignores whitespace."""
    return a.split() == b.split()


def _cut(text: str, limit: int = TEXT_SHOWN) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class PinPanel:
    """Built inside the view's Blocks context; ``render`` returns its output updates."""

    def __init__(self, prefix: str) -> None:
        with gr.Accordion("Pinned memory", open=True, elem_id=f"{prefix}-pins"):
            gr.Markdown(
                "Pinned tokens are never evicted. Select text in the conversation, copy it "
                "here and press **Pin** (the last place it occurs; whitespace does not "
                "matter). Text the cache already evicted cannot be pinned any more.")
            with gr.Row():
                self.text = gr.Textbox(label="text to pin", scale=4, elem_id=f"{prefix}-pin-text")
                self.pin = gr.Button("Pin", scale=1, min_width=60, elem_id=f"{prefix}-pin")
            self.list = gr.HTML(css_template=PIN_CSS, elem_id=f"{prefix}-pin-list")
            with gr.Row():
                self.choice = gr.Dropdown([], label="pin to unpin", scale=4,
                                          elem_id=f"{prefix}-unpin-choice")
                self.unpin = gr.Button("Unpin", scale=1, min_width=60, elem_id=f"{prefix}-unpin")

    @property
    def outputs(self) -> list[gr.components.Component]:
        return [self.list, self.choice]

    def render(self, session: Session) -> dict:
        pins = session.pins()
        return {self.list: pins_html(pins, session.cache.stats()),
                self.choice: gr.Dropdown(choices=unpin_choices(pins), value=None)}

    @property
    def unchanged(self) -> dict:
        """A handler's "change nothing": Gradio reads an empty dict as one missing value."""
        return {self.text: gr.skip()}

    def cleared(self) -> dict:
        """The panel of a view with no session yet."""
        return {self.list: "", self.choice: gr.Dropdown(choices=[], value=None)}

    def wire(self, state: gr.State, refresh: Callable[[dict, ViewState], dict],
             inputs: Iterable[gr.components.Component] = (),
             outputs: Iterable[gr.components.Component] = ()) -> None:
        """Pin and Unpin act on ``state``'s map session; ``refresh(values, state)`` gives
        the view's other updates after a change (its gauge, say), from ``inputs`` to
        ``outputs``."""
        self._state, self._refresh = state, refresh
        outputs = [self.text, *self.outputs, *outputs]
        gr.on([self.pin.click, self.text.submit], self.on_pin, {state, self.text, *inputs},
              outputs)
        self.unpin.click(self.on_unpin, {state, self.choice, *inputs}, outputs)

    def on_pin(self, values: dict) -> dict:
        return self._change(values, lambda session: session.pin(values[self.text]),
                            clear_text=True)

    def on_unpin(self, values: dict) -> dict:
        choice = values[self.choice]
        if choice is None:
            gr.Warning("Choose a pin to unpin first.")
            return self.unchanged
        return self._change(values, lambda session: session.unpin(int(choice)))

    def _change(self, values: dict, change: Callable[[Session], Pin], clear_text: bool = False) -> dict:
        """Apply ``change`` to the view's session; on failure a warning, and nothing changes."""
        state: ViewState | None = values[self._state]
        if state is None:
            gr.Warning("Nothing to pin yet: send a message first.")
            return self.unchanged
        try:
            with state.running():
                change(state.map_session())
                update = self.render(state.map_session()) | self._refresh(values, state)
        except (ValueError, RuntimeError, Refusal) as err:
            warn(str(err))
            return self.unchanged
        return update | ({self.text: ""} if clear_text else {})
