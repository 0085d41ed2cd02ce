"""Sessions: conversations on a persistent cache, and their files.

``base`` (what every session does: feed, decode, stop, pin, stats), ``chat`` (turns in
the chat template; ``chat_session``, the builder every door calls), ``story`` (free-form
continuation), ``pins`` (where a piece of text lies in the tokens), ``files`` (a session
with its cache in one file) and ``transcripts`` (a conversation's text as a file).
"""

from .base import Pin, Session, SessionStats
from .chat import ChatSession, chat_session
from .story import StorySession

__all__ = ["ChatSession", "Pin", "Session", "SessionStats", "StorySession", "chat_session"]
