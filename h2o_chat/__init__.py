"""h2o-chat: a local chat app whose KV cache stays bounded with the H2O policy.

Public API: ``load_model``, ``make_cache`` / ``cache_from_config``, ``ChatSession``,
``StorySession``, ``save_session`` / ``load_session`` (a session with its cache, in one file).
"""

from .engine.attention import ATTENTION_NAME, register_h2o_attention
from .engine.build import cache_from_config, make_cache
from .engine.cache import H2OCache
from .loading import load_model
from .sessions import ChatSession, StorySession
from .sessions.files import load_session, save_session

register_h2o_attention()

__all__ = [
    "ATTENTION_NAME",
    "ChatSession",
    "H2OCache",
    "StorySession",
    "cache_from_config",
    "load_model",
    "load_session",
    "make_cache",
    "register_h2o_attention",
    "save_session",
]
