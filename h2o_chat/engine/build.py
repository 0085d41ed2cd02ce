"""Building a cache for a model: by policy name and budgets (in slots or in bytes), from
the app's cache settings, or around a policy object of one's own (the benchmarks')."""

from __future__ import annotations

from dataclasses import replace

import torch

from h2o_chat.config import Budget, CacheConfig, ConfigError, check_field

from .attention import ATTENTION_NAME
from .budget import ByteBudget, split_slots, token_bytes, window_bytes
from .cache import H2OCache
from .policies import EvictionPolicy, make_policy
from .quant import KVStorage
from .rope import RopeShifter

BUDGETS = ("heavy", "recent", "sink")


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
               budget_bytes: int | None = None, exact_window: int = 0, **budgets: int | str) -> H2OCache:
    """A fresh cache for ``model`` under ``policy`` (one of ``config.POLICIES``).

    ``budgets`` are ``heavy``, ``recent`` and ``sink`` slot counts, and for h2o optionally
    ``score_norm`` ("sum" or "mean", see ``H2OPolicy``); the budget must fit the model's
    context. ``rolling`` places cached tokens at their rank in the cache rather than
    their absolute position (see ``H2OLayer``), for conversations longer than the
    model's trained context. ``key_bits``/``value_bits`` (32, 16, 8, 4; None: the model's
    dtype) set the storage precision (``quant.py``), ``exact_window`` how many newest
    tokens are also kept as given where it loses precision (``window.py``). ``budget_bytes`` (an integer number
    of bytes, ``config.Budget.of_bytes``) replaces ``heavy`` and ``recent``: the slots
    follow from the bytes a token takes at that precision, pinned tokens counted
    (``budget.py``); ``sink`` still applies. A bad value raises ``ConfigError`` naming it.
    """
    unknown = set(budgets) - {*BUDGETS, "score_norm"}
    if unknown:
        raise TypeError(f"unknown budget(s) {sorted(unknown)}; allowed: {', '.join(BUDGETS)}, score_norm")
    budget = None if budget_bytes is None else Budget.of_bytes(budget_bytes)
    return _build(model, policy, rolling, _storage(key_bits, value_bits, exact_window), budget, budgets)


def cache_from_config(model: torch.nn.Module, cache: CacheConfig) -> H2OCache:
    """A fresh cache for ``model`` as ``cache`` (the config file's cache section) says;
    ``ConfigError`` naming the field if the model cannot hold it (its context)."""
    budget = None if cache.budget_mb is None else Budget.of_megabytes(cache.budget_mb)
    return _build(model, cache.policy, cache.rolling,
                  _storage(cache.key_bits, cache.value_bits, cache.exact_window), budget,
                  dict(heavy=cache.heavy, recent=cache.recent, sink=cache.sink, score_norm=cache.score_norm))


def model_context(model: torch.nn.Module) -> int | None:
    """The positions ``model`` was trained on (None: its config names none)."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def _build(model: torch.nn.Module, policy: str, rolling: bool, storage: KVStorage, budget: Budget | None,
           budgets: dict) -> H2OCache:
    """Where every budget, in slots or in bytes, is checked against the model's context."""
    context = model_context(model)
    byte_budget = None
    if budget is not None:
        budgets, byte_budget = _fill_bytes(model, policy, budget, storage, rolling, context, budgets)
    chosen = make_policy(policy, **budgets)
    if byte_budget is None and chosen.capacity is not None and context and chosen.capacity > context:
        parts = {k: v for k, v in chosen.describe().items() if k in BUDGETS}
        raise ConfigError(
            f"{' + '.join(f'cache.{k}' for k in parts)} = {' + '.join(map(str, parts.values()))} = "
            f"{chosen.capacity} slots: must be at most the model's context of {context:,} tokens "
            "(max_position_embeddings)", field="cache.heavy" if "heavy" in parts else "cache.recent")
    if byte_budget is not None:
        byte_budget = replace(byte_budget, settings=chosen.describe())
    return cache_for_policy(model, chosen, rolling, storage, byte_budget)


def _storage(key_bits: int | None, value_bits: int | None, exact_window: int) -> KVStorage:
    # KVStorage checks the window by the config's rule itself.
    return KVStorage(check_field("cache.key_bits", key_bits), check_field("cache.value_bits", value_bits),
                     exact_window)


def _fill_bytes(model: torch.nn.Module, policy: str, budget: Budget, storage: KVStorage, rolling: bool,
                context: int | None, budgets: dict) -> tuple[dict, ByteBudget]:
    """``budgets`` with the slot counts that ``budget`` buys, and the budget; refused by
    the field it was given as unless it holds the sink plus one token and at most the
    model's context."""
    if policy == "full":
        raise ConfigError(f"{budget.field}: the full policy keeps every token and takes no budget; "
                          "choose h2o, sink or recent", field=budget.field)
    bought = ByteBudget(budget.bytes, token_bytes(model, storage, rolling), window_bytes=window_bytes(model, storage))
    sink = check_field("cache.sink", budgets.get("sink", 0)) if policy != "recent" else 0
    least, per_token = sink + 1, bought.token_bytes
    if bought.slots < least or (context and bought.slots > context):
        allowed = (f"from {least:,} (the sink plus one) to {context:,} (the model's context, "
                   f"max_position_embeddings), i.e. from {budget.amount(bought.bytes_for(least))} to "
                   f"{budget.amount(bought.bytes_for(context + 1) - 1)}" if context else
                   f"at least {least:,} (the sink plus one), i.e. {budget.amount(bought.bytes_for(least))} or more")
        window = f" after the exact window's {bought.window_bytes:,}" if bought.window_bytes else ""
        raise ConfigError(f"{budget.field} = {budget.given!r}: holds {bought.slots:,} tokens at "
                          f"{per_token:,} bytes a token{window}; must hold {allowed}", field=budget.field)
    slots = split_slots(policy, bought.slots, sink)
    kept = {k: v for k, v in budgets.items() if k == "score_norm"}
    return kept | slots, bought


def policy_from_config(cache: CacheConfig) -> EvictionPolicy:
    """The policy that ``cache`` (the config file's cache section) describes in slots
    (a byte budget needs the model: ``cache_from_config``)."""
    return make_policy(cache.policy, heavy=cache.heavy, recent=cache.recent, sink=cache.sink,
                       score_norm=cache.score_norm)
