"""The settings panel's cache controls reach the caches of new chats, stories and compares."""

import re

import gradio as gr
import pytest

from h2o_chat.config import AppConfig, CacheConfig
from h2o_chat.ui.chat_tab import ChatState
from h2o_chat.ui.compare_tab import BOUNDED, FULL, CompareState
from h2o_chat.ui.provider import ModelProvider
from h2o_chat.ui.refusals import Refusal
from h2o_chat.ui.settings import Settings
from h2o_chat.ui.story_tab import StoryState


@pytest.fixture(scope="module")
def loaded(smollm):
    return ModelProvider(lambda: smollm, "SmolLM2").start().get()


def panel(config: AppConfig) -> Settings:
    with gr.Blocks():
        return Settings(config)


def values(settings: Settings, **changed) -> dict:
    """What a handler receives: every control's value, as the page shows it after
    ``changed`` (attribute name -> value)."""
    return {component: changed.get(name, component.value) for name, component in vars(settings).items()
            if isinstance(component, gr.components.Component)}


def test_rolling_box_reaches_new_chats_stories_and_compares(loaded):
    settings = panel(AppConfig(cache=CacheConfig(heavy=8, recent=8, sink=4)))
    assert settings.rolling.value is False  # the config's default
    ticked = settings.cache(values(settings, rolling=True, heavy=16))
    assert ticked.rolling and ticked.heavy == 16
    assert not settings.cache(values(settings)).rolling

    chat = ChatState(loaded, ticked, "Be brief.")
    story = StoryState(loaded, ticked, "Mira keeps the lighthouse.")
    compare = CompareState(loaded, ticked, "Be brief.")
    assert chat.session.cache.rolling and story.session.cache.rolling and compare.sides[BOUNDED].cache.rolling
    assert not compare.sides[FULL].cache.rolling  # never evicts: nothing to roll
    # A chat rebuilt after an edit starts a fresh cache with the same settings.
    chat.rebuild([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}])
    assert chat.session.cache.rolling
    # And the cache really rolls: once past budget, the keys sit at their ranks.
    "".join(chat.session.send("Tell me about lighthouses.", temperature=0, max_new_tokens=8))
    layer = chat.session.cache.layers[0]
    assert layer.seen > layer.held and int(layer.rotated_at.max()) == layer.held - 1
    assert not ChatState(loaded, settings.cache(values(settings)), "").session.cache.rolling
    compare.close()


def test_rolling_box_starts_ticked_when_the_config_says_so():
    assert panel(AppConfig(cache=CacheConfig(rolling=True))).rolling.value is True


def test_an_empty_seed_box_means_a_new_seed_and_bad_values_are_refused_by_name():
    settings = panel(AppConfig())
    assert settings.seed.value == ""  # the config's seed: null
    assert settings.sampling(values(settings))["seed"] is None
    assert settings.sampling(values(settings, seed=" 7 "))["seed"] == 7
    for changed, message in [(dict(seed="abc"), "generation.seed = 'abc': must be an integer >= 0"),
                             (dict(seed="-1"), "generation.seed = -1: must be an integer >= 0"),
                             (dict(top_p=0), "generation.top_p = 0.0")]:
        with pytest.raises(Refusal, match=re.escape(message)):
            settings.sampling(values(settings, **changed))
    with pytest.raises(Refusal, match=re.escape("cache.heavy = -5: must be an integer >= 0")):
        settings.cache(values(settings, heavy=-5))
