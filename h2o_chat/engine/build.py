"""Building a cache for a model: by policy name and budgets, from the app's cache
settings, or around a policy object of one's own (the benchmarks' variants)."""

from __future__ import annotations

import torch

from h2o_chat.config import CacheConfig, ConfigError

from .attention import ATTENTION_NAME
from .cache import H2OCache
from .policies import EvictionPolicy, make_policy
from .rope import RopeShifter

BUDGETS = ("heavy", "recent", "sink")


def cache_for_policy(model: torch.nn.Module, policy: EvictionPolicy, rolling: bool = False) -> H2OCache:
    """A fresh cache for ``model`` whose layers evict by ``policy``; ``rolling`` as in
    ``make_cache``. The model must use the registered ``h2o`` attention (``load_model``
    sets it), which feeds the cache its scores."""
    config = model.config.get_text_config(decoder=True)
    if config._attn_implementation != ATTENTION_NAME:
        raise ValueError(
            f"the model uses attention {config._attn_implementation!r}; the H2O cache needs "
            f"{ATTENTION_NAME!r}: load it with h2o_chat.load_model or call "
            f"register_h2o_attention() and model.set_attn_implementation({ATTENTION_NAME!r})"
        )
    rope = RopeShifter.from_model(model) if rolling else None
    return H2OCache(policy, config.num_hidden_layers, rope)


def make_cache(model: torch.nn.Module, policy: str = "h2o", rolling: bool = False,
               **budgets: int | str) -> H2OCache:
    """A fresh cache for ``model`` under ``policy`` (one of ``config.POLICIES``).

    ``budgets`` are ``heavy``, ``recent`` and ``sink`` slot counts, and for h2o optionally
    ``score_norm`` ("sum" or "mean", see ``H2OPolicy``); the budget must fit the model's
    context. ``rolling`` places cached tokens at their rank in the cache rather than
    their absolute position (see ``H2OLayer``), for conversations longer than the
    model's trained context.
    """
    unknown = set(budgets) - {*BUDGETS, "score_norm"}
    if unknown:
        raise TypeError(f"unknown budget(s) {sorted(unknown)}; allowed: {', '.join(BUDGETS)}, score_norm")
    chosen = make_policy(policy, **budgets)
    context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if chosen.capacity is not None and context and chosen.capacity > context:
        parts = " + ".join(f"{k} {v}" for k, v in chosen.describe().items() if k in BUDGETS)
        raise ConfigError(
            f"cache budget {parts} = {chosen.capacity} slots: must be at most the "
            f"model's context of {context} tokens (max_position_embeddings)", field="cache.heavy")
    return cache_for_policy(model, chosen, rolling)


def policy_from_config(cache: CacheConfig) -> EvictionPolicy:
    """The policy that ``cache`` (the config file's cache section) describes."""
    return make_policy(cache.policy, heavy=cache.heavy, recent=cache.recent, sink=cache.sink,
                       score_norm=cache.score_norm)


def cache_from_config(model: torch.nn.Module, cache: CacheConfig) -> H2OCache:
    """A fresh cache for ``model`` as ``cache`` (the config file's cache section) says."""
    return make_cache(model, cache.policy, rolling=cache.rolling, heavy=cache.heavy,
                      recent=cache.recent, sink=cache.sink, score_norm=cache.score_norm)
