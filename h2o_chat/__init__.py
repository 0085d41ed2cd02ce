"""h2o-chat: a local chat app whose KV cache stays bounded with the H2O policy.

Public API: ``load_model``, ``make_cache``, ``ChatSession``, ``StorySession``,
``save_session`` / ``load_session`` (a session with its cache, in one file).
"""

from .attention import ATTENTION_NAME, register_h2o_attention
from .cache import H2OCache, make_cache
from .loading import load_model
from .session import ChatSession, StorySession
from .snapshot import load_session, save_session

register_h2o_attention()

__all__ = [
    "ATTENTION_NAME",
    "ChatSession",
    "H2OCache",
    "StorySession",
    "load_model",
    "load_session",
    "make_cache",
    "register_h2o_attention",
    "save_session",
]
