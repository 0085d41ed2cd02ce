"""Building a cache for a model: by policy name and budgets (in slots or in bytes), from
the app's cache settings, or around a policy object of one's own (the benchmarks')."""

from __future__ import annotations

import torch

from h2o_chat.config import CacheConfig, ConfigError, check_field

from .attention import ATTENTION_NAME
from .budget import ByteBudget, split_slots, token_bytes
from .cache import H2OCache
from .policies import EvictionPolicy, make_policy
from .quant import KVStorage
from .rope import RopeShifter

BUDGETS = ("heavy", "recent", "sink")
MEGABYTE = 1_000_000


def cache_for_policy(model: torch.nn.Module, policy: EvictionPolicy, rolling: bool = False,
                     storage: KVStorage = KVStorage(), byte_budget: ByteBudget | None = None) -> H2OCache:
    """A fresh cache for ``model`` whose layers evict by ``policy``; ``rolling``,
    ``storage`` as in ``make_cache``. The model must use the registered ``h2o`` attention
    (``load_model`` sets it), which feeds the cache its scores."""
    config = model.config.get_text_config(decoder=True)
    if config._attn_implementation != ATTENTION_NAME:
        raise ValueError(
            f"the model uses attention {config._attn_implementation!r}; the H2O cache needs "
            f"{ATTENTION_NAME!r}: load it with h2o_chat.load_model or call "
            f"register_h2o_attention() and model.set_attn_implementation({ATTENTION_NAME!r})"
        )
    rope = RopeShifter.from_model(model) if rolling else None
    return H2OCache(policy, config.num_hidden_layers, rope, storage, byte_budget)


def make_cache(model: torch.nn.Module, policy: str = "h2o", rolling: bool = False,
               key_bits: int | None = None, value_bits: int | None = None,
               budget_bytes: int | None = None, **budgets: int | str) -> H2OCache:
    """A fresh cache for ``model`` under ``policy`` (one of ``config.POLICIES``).

    ``budgets`` are ``heavy``, ``recent`` and ``sink`` slot counts, and for h2o optionally
    ``score_norm`` ("sum" or "mean", see ``H2OPolicy``); the budget must fit the model's
    context. ``rolling`` places cached tokens at their rank in the cache rather than
    their absolute position (see ``H2OLayer``), for conversations longer than the
    model's trained context. ``key_bits``/``value_bits`` (32, 16, 8, 4; None: the model's
    dtype) set the storage precision (``quant.py``). ``budget_bytes`` replaces ``heavy``
    and ``recent``: the slots follow from the bytes a token takes at that precision,
    pinned tokens counted (``budget.py``); ``sink`` still applies.
    """
    unknown = set(budgets) - {*BUDGETS, "score_norm"}
    if unknown:
        raise TypeError(f"unknown budget(s) {sorted(unknown)}; allowed: {', '.join(BUDGETS)}, score_norm")
    storage = _storage(key_bits, value_bits)
    byte_budget = None
    if budget_bytes is not None:
        budgets, byte_budget = _fill_bytes(model, policy, budget_bytes, storage, rolling, budgets)
    chosen = make_policy(policy, **budgets)
    context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if chosen.capacity is not None and context and chosen.capacity > context:
        parts = " + ".join(f"{k} {v}" for k, v in chosen.describe().items() if k in BUDGETS)
        raise ConfigError(
            f"cache budget {parts} = {chosen.capacity} slots: must be at most the "
            f"model's context of {context} tokens (max_position_embeddings)",
            field="cache.heavy" if byte_budget is None else "cache.budget_mb")
    if byte_budget is not None:
        byte_budget = ByteBudget(byte_budget.bytes, byte_budget.token_bytes, chosen.describe())
    return cache_for_policy(model, chosen, rolling, storage, byte_budget)


def _storage(key_bits: int | None, value_bits: int | None) -> KVStorage:
    return KVStorage(check_field("cache.key_bits", key_bits), check_field("cache.value_bits", value_bits))


def _fill_bytes(model: torch.nn.Module, policy: str, budget_bytes: int, storage: KVStorage, rolling: bool,
                budgets: dict) -> tuple[dict, ByteBudget]:
    """``budgets`` with the slot counts that ``budget_bytes`` buys, and the budget."""
    if policy == "full":
        raise ConfigError("cache.budget_mb: the full policy keeps every token and takes no budget; "
                          "choose h2o, sink or recent", field="cache.budget_mb")
    budget = ByteBudget(int(budget_bytes), token_bytes(model, storage, rolling))
    sink = int(budgets.get("sink", 0)) if policy != "recent" else 0
    least = sink + 1
    if budget.slots < least:
        raise ConfigError(
            f"cache.budget_mb = {budget_bytes / MEGABYTE:g}: holds {budget.slots} tokens at "
            f"{budget.token_bytes:,} bytes a token; must hold at least {least} (the sink plus one), "
            f"i.e. {least * budget.token_bytes / MEGABYTE:g} MB or more", field="cache.budget_mb")
    slots = split_slots(policy, budget.slots, sink)
    kept = {k: v for k, v in budgets.items() if k == "score_norm"}
    return kept | slots, budget


def policy_from_config(cache: CacheConfig) -> EvictionPolicy:
    """The policy that ``cache`` (the config file's cache section) describes in slots
    (a byte budget needs the model: ``cache_from_config``)."""
    return make_policy(cache.policy, heavy=cache.heavy, recent=cache.recent, sink=cache.sink,
                       score_norm=cache.score_norm)


def cache_from_config(model: torch.nn.Module, cache: CacheConfig) -> H2OCache:
    """A fresh cache for ``model`` as ``cache`` (the config file's cache section) says."""
    budget_bytes = None if cache.budget_mb is None else int(cache.budget_mb * MEGABYTE)
    return make_cache(model, cache.policy, rolling=cache.rolling, key_bits=cache.key_bits,
                      value_bits=cache.value_bits, budget_bytes=budget_bytes, heavy=cache.heavy,
                      recent=cache.recent, sink=cache.sink, score_norm=cache.score_norm)
