"""h2o-chat: a local chat app whose KV cache stays bounded with the H2O policy.

Public API: ``load_model``, ``make_cache``, ``ChatSession``, ``StorySession``.
"""

from .attention import ATTENTION_NAME, register_h2o_attention
from .cache import H2OCache, make_cache
from .loading import load_model
from .session import ChatSession, StorySession

register_h2o_attention()

__all__ = [
    "ATTENTION_NAME",
    "ChatSession",
    "H2OCache",
    "StorySession",
    "load_model",
    "make_cache",
    "register_h2o_attention",
]
