"""The one gate for data from outside the process.

Typed text, system prompts, story bibles, imported conversations and session files are
checked here against the config's limits, before anything is allocated or fed to the
model; a refusal is an :class:`InputError` whose message names the field and what is
allowed. Sessions, the file readers and the API call these checks; nothing from
outside reaches the model around them.
"""

from .documents import read_json, read_member, require_int
from .limits import InputError, InputLimits, refused_as
from .text import (check_chat_turn, check_conversation, check_message, check_story_turn,
                   check_system_prompt, check_text, is_blank)

__all__ = [
    "InputError",
    "InputLimits",
    "check_chat_turn",
    "check_conversation",
    "check_message",
    "check_story_turn",
    "check_system_prompt",
    "check_text",
    "is_blank",
    "read_json",
    "read_member",
    "refused_as",
    "require_int",
]
