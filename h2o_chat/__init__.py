"""h2o-chat: a local chat app whose KV cache stays bounded with the H2O policy."""

from .attention import ATTENTION_NAME, register_h2o_attention
from .cache import H2OCache, make_cache

register_h2o_attention()

__all__ = ["ATTENTION_NAME", "H2OCache", "make_cache", "register_h2o_attention"]
