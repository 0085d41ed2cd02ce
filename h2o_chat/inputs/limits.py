"""The error every refused input raises, and the limits inputs are checked against."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

from ..config import ServerConfig, check_field


class InputError(ValueError):
    """Data from outside (typed text, an uploaded file, an API call) that is refused.

    The message says what was wrong and what is allowed; ``field`` names the part of the
    input that was refused (``"messages[3].content"``, ``"manifest.json: fed"``), so an
    API can point at it.
    """

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@contextmanager
def refused_as(error_type: type[InputError]) -> Iterator[None]:
    """Raise the refusals inside as ``error_type`` (an InputError for one kind of input,
    say a session file), same message and field."""
    try:
        yield
    except InputError as err:
        if isinstance(err, error_type):
            raise
        raise error_type(str(err), err.field) from None


@dataclass(frozen=True)
class InputLimits:
    """How much one conversation may hold; the ``server.max_*`` settings of the config.

    Checked like the config file's fields, so a Python caller gets the same messages.
    """

    message_chars: int = ServerConfig.max_message_chars
    system_prompt_chars: int = ServerConfig.max_system_prompt_chars  # the story bible too
    conversation_messages: int = ServerConfig.max_conversation_messages
    conversation_chars: int = ServerConfig.max_conversation_chars

    def __post_init__(self) -> None:
        for item in fields(self):
            check_field(self.setting(item.name), getattr(self, item.name))

    @classmethod
    def of(cls, server: ServerConfig) -> InputLimits:
        return cls(**{item.name: getattr(server, cls.setting(item.name)[len("server."):])
                      for item in fields(cls)})

    @staticmethod
    def setting(name: str) -> str:
        """The config field behind limit ``name``, for messages."""
        return f"server.max_{name}"

    @property
    def document_bytes(self) -> int:
        """The largest JSON document (a conversation file, a session file's manifest) a
        conversation within these limits makes: its text twice (a manifest holds the
        messages and the rendered template), each character at most 6 bytes of JSON
        (``\\u001b``), plus per message a template and its JSON keys."""
        return 2**20 + 12 * self.conversation_chars + 512 * self.conversation_messages

    @property
    def document_values(self) -> int:
        """The most JSON values besides strings such a document holds: a few per message
        (its object, role, content, a pinned span), a few thousand for the rest (a
        manifest's counters, per model layer)."""
        return 16 * self.conversation_messages + 4096
