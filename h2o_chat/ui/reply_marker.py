"""The marker under a chat reply that was cut short, which also continues it.

A reply the user stopped, or one that reached max new tokens, gets a chip under it (one
of Gradio's message ``options``, which the chat box shows under its last reply only and
leaves out of the message's text: copying, editing, exports and the session's history
never see it). Clicking the chip lets the model go on with the same reply.
"""

from __future__ import annotations

from h2o_chat.sessions import Session


def marker(session: Session, max_new_tokens: int) -> str | None:
    """The chip's text when ``session``'s last reply can go on, else None."""
    if not session.can_continue:
        return None
    if session.finish_reason == "stopped":
        return "⏹ stopped · continue"
    return f"… cut at the {max_new_tokens}-token limit · continue"


def marked(shown: list[dict], session: Session, max_new_tokens: int) -> list[dict]:
    """``shown`` (a chat box's messages, copies of ``session``'s) with the chip under the
    last reply if it was cut short."""
    label = marker(session, max_new_tokens)
    if label is None or not shown or shown[-1]["role"] != "assistant":
        return shown
    return shown[:-1] + [shown[-1] | {"options": [{"label": label, "value": "continue"}]}]
