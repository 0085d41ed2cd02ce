"""The sampling and cache controls every view shares, and their values as engine inputs."""

from __future__ import annotations

import dataclasses
from typing import Any

import gradio as gr

from h2o_chat.config import POLICIES, AppConfig, CacheConfig, ConfigError, validate
from h2o_chat.engine.build import BUDGETS, cache_from_config, policy_from_config
from h2o_chat.engine.cache import H2OCache


class Settings:
    """One set of controls above the tabs. Handlers take them as inputs (a set of
    components, so they receive a dict) and read them with ``sampling``/``cache``."""

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        gen, cache = config.generation, config.cache
        with gr.Accordion("Sampling and cache settings", open=False, elem_id="settings"):
            with gr.Row():
                self.temperature = gr.Slider(
                    0, max(2.0, gen.temperature), value=gen.temperature, step=0.05,
                    label="temperature (0 = greedy)", elem_id="temperature")
                self.top_p = gr.Slider(0.05, 1.0, value=gen.top_p, step=0.05, label="top-p",
                                       elem_id="top-p")
                self.max_new_tokens = gr.Slider(
                    1, max(1024, gen.max_new_tokens), value=gen.max_new_tokens, step=1,
                    label="max new tokens per reply", elem_id="max-new-tokens")
                self.seed = gr.Number(gen.seed, precision=0, minimum=0,
                                      label="seed (empty = random)", elem_id="seed")
            gr.Markdown("Cache settings apply to the next **new chat**, **new story** or "
                        "**compare reset**; a running one keeps its cache.")
            with gr.Row():
                self.policy = gr.Dropdown(list(POLICIES), value=cache.policy, label="cache policy",
                                          elem_id="policy")
                self.heavy = gr.Number(cache.heavy, precision=0, minimum=0,
                                       label="heavy slots", elem_id="heavy")
                self.recent = gr.Number(cache.recent, precision=0, minimum=0,
                                        label="recent slots", elem_id="recent")
                self.sink = gr.Number(cache.sink, precision=0, minimum=0,
                                      label="sink slots", elem_id="sink")
                self.rolling = gr.Checkbox(
                    cache.rolling, label="rolling positions", elem_id="rolling",
                    info="cached tokens at their rank in the cache, so a conversation can "
                         "outgrow the model's trained context")

    @property
    def components(self) -> set[gr.components.Component]:
        return {self.temperature, self.top_p, self.max_new_tokens, self.seed,
                self.policy, self.heavy, self.recent, self.sink, self.rolling}

    def sampling(self, values: dict) -> dict[str, Any]:
        """Keyword arguments of ``session.send`` (checked there)."""
        return {
            "temperature": float(values[self.temperature]),
            "top_p": float(values[self.top_p]),
            "max_new_tokens": int(values[self.max_new_tokens]),
            "seed": None if values[self.seed] is None else int(values[self.seed]),
        }

    def cache(self, values: dict) -> CacheConfig:
        """The cache settings, checked by the config file's rules; gr.Error if bad."""
        cache = dataclasses.replace(
            self.config.cache, policy=values[self.policy], rolling=bool(values[self.rolling]),
            **{name: _int_or_none(values[getattr(self, name)]) for name in BUDGETS},
        )
        try:
            return validate(dataclasses.replace(self.config, cache=cache)).cache
        except ConfigError as err:
            raise gr.Error(str(err)) from None


def new_cache(model: Any, cache: CacheConfig) -> H2OCache:
    """A cache for ``model``; gr.Error if the budget does not fit the model's context."""
    try:
        return cache_from_config(model, cache)
    except ConfigError as err:
        raise gr.Error(str(err)) from None


def budget(cache: CacheConfig) -> int | None:
    """Slots a cache with these settings holds at rest, besides pinned tokens (None:
    unbounded)."""
    return policy_from_config(cache).capacity


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)
