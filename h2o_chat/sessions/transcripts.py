"""A chat conversation as a file: JSON to export and import back, Markdown to read.

Only the text travels (system prompt and user/assistant messages), not the cache: an
imported conversation is a fresh ``ChatSession`` whose history is read again on the next
send. ``files.py`` saves a session with its cache.

JSON layout, version 1::

    {"format": "h2o-chat/conversation", "version": 1,
     "system_prompt": "..." or null,
     "messages": [{"role": "user" | "assistant", "content": "..."}, ...]}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import quoted
from ..inputs import InputError, InputLimits, check_conversation, read_json, refused_as
from ..inputs.markdown import disarm_html, split_lines
from .chat import ChatSession

FORMAT = "h2o-chat/conversation"
VERSION = 1


class TranscriptError(InputError):
    """A conversation file that cannot be imported; the message says why."""

    def __init__(self, message: str, field: str = "conversation file") -> None:
        super().__init__(message, field)


@dataclass(frozen=True)
class Transcript:
    """What a conversation says, without its cache."""

    system_prompt: str | None
    messages: list[dict[str, str]]  # user/assistant only

    @classmethod
    def of(cls, session: ChatSession) -> Transcript:
        system = [m["content"] for m in session.messages if m["role"] == "system"]
        return cls(system[0] if system else None,
                   [dict(m) for m in session.messages if m["role"] != "system"])

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "system_prompt": self.system_prompt,
                           "messages": self.messages}, ensure_ascii=False, indent=2)

    def to_markdown(self) -> str:
        """Every message as a quote under its speaker's heading: a message's own headings,
        fences and raw HTML stay inside its quote, so no text can pass for another turn."""
        parts = ["# Conversation"]
        if self.system_prompt:
            parts += ["**System prompt:**", _quoted(self.system_prompt)]
        for message in self.messages:
            parts += [f"## {message['role'].capitalize()}", _quoted(message["content"])]
        return "\n\n".join(parts) + "\n"

    def session(self, model, tokenizer, **kwargs) -> ChatSession:
        """A chat that continues this conversation (``kwargs`` as for ``ChatSession``)."""
        return ChatSession(model, tokenizer, system_prompt=self.system_prompt,
                           history=self.messages, **kwargs)


def _quoted(text: str) -> str:
    """``text`` as a Markdown block quote: it holds whatever Markdown the text has (an
    unclosed fence ends with it), and raw HTML shows as text, since ``</blockquote>``
    would close the quote in renderers that pass HTML through."""
    lines = split_lines(disarm_html(text, "&lt;"))
    return "\n".join(f"> {line}" if line else ">" for line in lines)


def read_transcript(data: str | bytes, limits: InputLimits | None = None) -> Transcript:
    """Parse an exported conversation; TranscriptError if it is not one this app wrote or
    it does not keep within ``limits``."""
    limits = limits or InputLimits()
    with refused_as(TranscriptError):
        document = read_json(data, "conversation file", limits.document_bytes, limits.document_values)
        if not isinstance(document, Mapping) or document.get("format") != FORMAT:
            raise TranscriptError(f"not a conversation file: expected \"format\": \"{FORMAT}\"")
        version = document.get("version")
        if version != VERSION:
            raise TranscriptError(f"unknown conversation file version {quoted(version)} "
                                  f"(this app reads version {VERSION})", "version")
        system_prompt = document.get("system_prompt")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise TranscriptError(f"system_prompt = {quoted(system_prompt)}: must be a string or null", "system_prompt")
        return Transcript(*check_conversation(system_prompt, document.get("messages"), limits, "messages"))
