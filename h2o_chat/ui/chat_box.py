"""The chat boxes: Gradio's Chatbot, showing each message's Markdown but none of its HTML.

Gradio renders a message's Markdown and passes the HTML in it through its sanitizer: a
typed "What does <div> do?" showed "What does", and the rest of the message moved into a
box of its own; a reply's "<br>" broke its line. A chat about HTML has to show the tags.
The box is handed each message with an invisible word joiner after every ``<`` that
would start markup (only on the lines CommonMark reads as HTML: code keeps its text),
which no renderer takes for a tag; what the box hands back (an edit) and what its copy
buttons copy lose them again.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import gradio as gr

from h2o_chat.inputs.markdown import disarm_html

_JOINER = "\u2060"  # WORD JOINER: no width, no break, not the start of a tag name
_SHOWN_LT = "<" + _JOINER
# Runs in the page as it loads: a message's copy button copies the text as it was typed.
COPY_AS_TYPED = """() => {
  const clipboard = navigator.clipboard;
  if (!clipboard) return;
  const write = clipboard.writeText.bind(clipboard);
  clipboard.writeText = (text) => write(String(text).replaceAll("<\\u2060", "<"));
}"""


class ChatBox(gr.Chatbot):
    """A ``gr.Chatbot`` (the page draws it as one) whose messages' HTML shows as text.

    A subclass, not a display step added to one ``gr.Chatbot``: once a handler updates a
    component (``gr.skip()`` included), Gradio keeps a copy of it per browser session,
    made from its class, and shows values through the copy."""

    is_template = True  # Gradio's name for a component its parent's frontend draws

    def postprocess(self, value: Any) -> Any:
        if value:
            value = [_shown(message) for message in value]
        return super().postprocess(value)


def typed_text(value: Any) -> str:
    """The text of a message the box hands back (a string or a list of content parts),
    as it was before the box showed it."""
    if isinstance(value, str):
        return value.replace(_SHOWN_LT, "<")
    if isinstance(value, dict):
        return typed_text(value.get("text") or value.get("content") or "")
    return "".join(typed_text(part) for part in value or [])


def _shown(message: Any) -> Any:
    if isinstance(message, dict) and isinstance(message.get("content"), str):
        return message | {"content": _shown_text(message["content"])}
    return message


@lru_cache(maxsize=4096)  # a streamed reply hands every earlier message over again
def _shown_text(text: str) -> str:
    return disarm_html(text, _SHOWN_LT)
