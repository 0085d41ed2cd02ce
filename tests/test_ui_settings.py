"""The settings panel's cache controls reach the caches of new chats, stories and compares."""

import re
from dataclasses import replace

import gradio as gr
import pytest

from h2o_chat import make_cache
from h2o_chat.config import AppConfig, CacheConfig
from h2o_chat.engine.build import cache_from_config
from h2o_chat.engine.quant import KVStorage
from h2o_chat.engine.state import settings_differences
from h2o_chat.ui.chat_tab import ChatState, ChatTab
from h2o_chat.ui.compare_tab import BOUNDED, FULL, CompareState, CompareTab
from h2o_chat.runtime import ModelProvider
from h2o_chat.ui.refusals import Refusal
from h2o_chat.ui.reply_settings import ran_with
from h2o_chat.ui.settings import MODEL_DTYPE, Settings, budget
from h2o_chat.ui.story_tab import StoryState, StoryTab


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
    assert settings.sampling(values(settings, max_new_tokens=12.0))["max_new_tokens"] == 12
    # Past the slider's ends (temperature 2, 1024 tokens), within the config's rules: as typed.
    assert settings.sampling(values(settings, temperature=3, max_new_tokens=5000)) == {
        "temperature": 3.0, "top_p": 0.9, "max_new_tokens": 5000, "seed": None}
    assert settings.temperature.preprocess(3) == 3 and settings.max_new_tokens.preprocess(5000) == 5000
    # A view's own count (the story's tokens per continue) in place of the shared one, checked alike.
    assert settings.sampling(values(settings), max_new_tokens=48.0)["max_new_tokens"] == 48
    with pytest.raises(Refusal, match=re.escape("generation.max_new_tokens = 4.5: expected int, got float")):
        settings.sampling(values(settings), max_new_tokens=4.5)
    top = 2**63 - 1  # OpenAI's int64
    for changed, message in [(dict(seed="abc"), f"generation.seed = 'abc': must be an integer from 0 to {top}"),
                             (dict(seed="-1"), f"generation.seed = -1: must be an integer from 0 to {top}, "
                                              "or empty for a new seed per reply"),
                             (dict(seed=str(2**64)), f"generation.seed = {2**64}: must be an integer from 0 to {top}"),
                             (dict(top_p=0), "generation.top_p = 0: must be a number > 0 and <= 1"),
                             # Past the slider's end, and past the config's: refused by the config's rule.
                             (dict(max_new_tokens=40000), "generation.max_new_tokens = 40000: must be an "
                                                          "integer from 1 to 32768"),
                             (dict(temperature=11), "generation.temperature = 11: must be a number from 0 to 10"),
                             # Sent to the page's endpoint by hand.
                             (dict(temperature="hot"), "generation.temperature = 'hot': expected float, got str"),
                             # Refused, not run as 4 while the slider shows 5.
                             (dict(max_new_tokens=4.5), "generation.max_new_tokens = 4.5: expected int, got float")]:
        with pytest.raises(Refusal, match=re.escape(message)):
            settings.sampling(values(settings, **changed))
    with pytest.raises(Refusal, match=re.escape("cache.heavy = -5: must be an integer >= 0")):
        settings.cache(values(settings, heavy=-5))


def test_bits_and_a_budget_in_megabytes_reach_new_chats_and_compares_at_equal_bytes(loaded):
    settings = panel(AppConfig(cache=CacheConfig(heavy=8, recent=8, sink=4)))
    assert (settings.key_bits.value, settings.value_bits.value, settings.budget_mb.value) == (
        MODEL_DTYPE, MODEL_DTYPE, "")
    plain = settings.cache(values(settings))
    assert (plain.key_bits, plain.value_bits, plain.budget_mb) == (None, None, None)
    chosen = settings.cache(values(settings, key_bits="8", value_bits="4", budget_mb=" 0.8 "))
    assert (chosen.key_bits, chosen.value_bits, chosen.budget_mb) == (8, 4, 0.8)

    chat = ChatState(loaded, chosen, "Be brief.")
    compare = CompareState(loaded, chosen, "Be brief.")
    for session in (chat.session, compare.sides[BOUNDED]):
        "".join(session.send("Tell me about the sea and its ships, every one of them. " * 6,
                             temperature=0, max_new_tokens=4))
        stats = session.stats().cache
        assert (stats.key_bits, stats.value_bits, stats.budget_bytes) == (8, 4, 800_000)
        assert stats.seen > stats.held and stats.held_bytes <= 800_000
        assert stats.budget == budget(chosen, loaded.model)
    assert compare.labels[BOUNDED] == "turns cache (0.8 MB, K8/V4)"
    assert compare.sides[FULL].cache.storage == KVStorage()  # the full side keeps the model's precision
    compare.close()


def test_bad_bits_and_budgets_are_refused_by_name():
    settings = panel(AppConfig())
    for changed, message in [
            (dict(budget_mb="lots"), "cache.budget_mb = 'lots': must be a number of megabytes, or empty"),
            (dict(budget_mb="-1"), "cache.budget_mb = -1.0: must be a number of megabytes > 0 and <= 1000000, "
                                   "or empty for the slot counts"),
            (dict(key_bits="3"), "cache.key_bits = 3: must be one of 32, 16, 8, 4"),
            (dict(budget_mb="2", policy="full"), "cache.budget_mb is set but cache.policy is 'full'")]:
        with pytest.raises(Refusal, match=re.escape(message)):
            settings.cache(values(settings, **changed))


@pytest.mark.parametrize("changed, message", [
    # What the page's endpoints can be sent besides the dropdowns' choices (any JSON value).
    (dict(key_bits=3), "cache.key_bits = 3: must be one of 32, 16, 8, 4, or model's dtype"),
    (dict(value_bits=0), "cache.value_bits = 0: must be one of 32, 16, 8, 4, or model's dtype"),
    (dict(key_bits=" 3 "), "cache.key_bits = 3: must be one of 32, 16, 8, 4, or model's dtype"),
    (dict(key_bits=8.0), "cache.key_bits = 8.0: expected int or null, got float; must be one of 32, 16, 8, 4"),
    (dict(key_bits=["8"]), "cache.key_bits = ['8']: expected int or null, got list; must be one of 32, 16, 8, 4"),
    (dict(value_bits="eight"), "cache.value_bits = 'eight': expected int or null, got str; must be one of 32, 16, 8, 4"),
    (dict(policy="h3o"), "cache.policy = 'h3o': must be one of full, h2o, recent, sink, turns"),
    (dict(policy=7), "cache.policy = 7: expected str, got int; must be one of full, h2o, recent, sink, turns"),
    # A fraction in a whole-number box is refused, not rounded.
    (dict(heavy=2.5), "cache.heavy = 2.5: expected int, got float; must be an integer >= 0"),
    (dict(exact_window=0.5), "cache.exact_window = 0.5: expected int, got float; must be an integer from 0 to 1024"),
    # An emptied number box (QA: "cache.heavy = None: expected int, got null").
    (dict(heavy=None), "cache.heavy is empty: must be an integer >= 0"),
    (dict(exact_window=None), "cache.exact_window is empty: must be an integer from 0 to 1024"),
])
def test_values_no_dropdown_offers_are_refused_by_the_configs_rule(changed, message):
    settings = panel(AppConfig())
    with pytest.raises(Refusal) as refused:
        settings.cache(values(settings, **changed))
    assert str(refused.value) == message


def test_a_number_of_bits_sent_as_a_number_is_those_bits():
    settings = panel(AppConfig())
    assert settings.cache(values(settings, key_bits=8, value_bits="4")).key_bits == 8


def test_a_whole_number_sent_as_a_float_is_that_number():
    settings = panel(AppConfig())
    cache = settings.cache(values(settings, heavy=12.0, recent=20, sink=2.0, exact_window=16.0))
    assert (cache.heavy, cache.recent, cache.sink, cache.exact_window) == (12, 20, 2, 16)
    assert all(type(n) is int for n in (cache.heavy, cache.recent, cache.sink, cache.exact_window))


# A page on h2o's slots: what differs from a saved h2o cache is its bytes and bits only.
H2O_PAGE = AppConfig(cache=CacheConfig(policy="h2o", heavy=128, recent=128))


def test_a_saved_byte_budget_and_bits_are_taken_into_the_controls(loaded):
    settings = panel(H2O_PAGE)
    saved = cache_from_config(loaded.model, CacheConfig(policy="h2o", sink=4, key_bits=8, value_bits=4,
                                                        budget_mb=1.5))
    ours = cache_from_config(loaded.model, settings.cache(values(settings)))
    adopted = settings.adopt(values(settings), settings_differences(saved.settings(), ours.settings()), loaded.model)
    cache, shown = adopted.cache, adopted.updates
    assert (cache.key_bits, cache.value_bits, cache.budget_mb) == (8, 4, 1.5)
    assert shown[settings.key_bits] == "8" and shown[settings.value_bits] == "4" and shown[settings.budget_mb] == "1.5"
    assert adopted.summary == "budget_mb 1.5, heavy 64, key_bits 8, recent 64, value_bits 4"
    assert cache_from_config(loaded.model, cache).settings() == saved.settings()
    # And back: a file saved with slots and the model's precision clears them again.
    chosen = values(settings, key_bits="8", value_bits="4", budget_mb="1.5")
    adopted = settings.adopt(chosen, settings_differences(ours.settings(), saved.settings()), loaded.model)
    cache, shown = adopted.cache, adopted.updates
    assert (cache.key_bits, cache.value_bits, cache.budget_mb) == (None, None, None)
    assert shown[settings.key_bits] == MODEL_DTYPE and shown[settings.budget_mb] == ""


def test_the_exact_window_reaches_a_new_chat_and_a_saved_one_is_taken_and_cleared(loaded):
    settings = panel(H2O_PAGE)
    assert settings.exact_window.value == 0
    chosen = settings.cache(values(settings, key_bits="4", value_bits="4", exact_window=16, budget_mb="1"))
    chat = ChatState(loaded, chosen, "Be brief.")
    "".join(chat.session.send("Tell me about the sea. " * 20, temperature=0, max_new_tokens=4))
    stats = chat.session.stats().cache
    assert (stats.key_bits, stats.exact_window, stats.budget_bytes) == (4, 16, 1_000_000)
    assert stats.held_bytes <= 1_000_000 and "window_keys" in chat.session.cache.layers[0].held_slots()
    with pytest.raises(Refusal, match=re.escape("cache.exact_window = -2: must be an integer from 0 to 1024")):
        settings.cache(values(settings, exact_window=-2))
    # A file saved with a window gives it to the page; one saved without gives 0 back.
    saved, ours = chat.session.cache, cache_from_config(loaded.model, settings.cache(values(settings)))
    adopted = settings.adopt(values(settings), settings_differences(saved.settings(), ours.settings()), loaded.model)
    assert adopted.cache.exact_window == 16 and adopted.updates[settings.exact_window] == 16
    assert cache_from_config(loaded.model, adopted.cache).settings() == saved.settings()
    adopted = settings.adopt(values(settings, key_bits="4", value_bits="4", exact_window=16, budget_mb="1"),
                             settings_differences(ours.settings(), saved.settings()), loaded.model)
    assert adopted.cache.exact_window == 0 and adopted.updates[settings.exact_window] == 0


def test_a_saved_budget_of_any_whole_number_of_bytes_is_taken_exactly(loaded):
    """The file's bytes go through the page's megabytes and back without moving a byte."""
    settings = panel(H2O_PAGE)
    ours = cache_from_config(loaded.model, settings.cache(values(settings)))
    for budget in (1_000_001, 1_234_567, 9_999_999):
        saved = make_cache(loaded.model, "h2o", sink=4, key_bits=8, value_bits=4, budget_bytes=budget)
        adopted = settings.adopt(values(settings), settings_differences(saved.settings(), ours.settings()),
                                 loaded.model)
        assert cache_from_config(loaded.model, adopted.cache).settings() == saved.settings()
        typed = values(settings, key_bits="8", value_bits="4", budget_mb=adopted.updates[settings.budget_mb])
        assert cache_from_config(loaded.model, settings.cache(typed)).settings() == saved.settings()


def _small_print(html_text: str) -> dict[str, str]:
    return dict(re.findall(r'data-([a-z-]+)="([^"]*)"', html_text))


def test_a_replys_small_print_names_the_settings_it_ran_with():
    sampled = {"temperature": 1.0, "top_p": 0.8, "seed": 11, "max_new_tokens": 12}
    shown = ran_with(sampled, CacheConfig(policy="h2o", heavy=16, recent=8, sink=4))
    assert _small_print(shown) == {"temperature": "1", "top-p": "0.8", "seed": "11",
                                   "max-new-tokens": "12", "policy": "h2o", "budget": "28 slots"}
    assert "Ran with temperature 1 · top-p 0.8 · seed 11 · up to 12 new tokens · h2o cache, 28 slots" in shown
    # No seed typed: a new one per reply; a full cache has no budget; megabytes as set.
    unseeded = ran_with(sampled | {"seed": None}, CacheConfig(policy="full"))
    assert (_small_print(unseeded)["seed"], _small_print(unseeded)["budget"]) == ("random", "unbounded")
    assert _small_print(ran_with(sampled, CacheConfig(budget_mb=1.5)))["budget"] == "1.5 MB"
    assert "up to 1 new token · " in ran_with(sampled | {"max_new_tokens": 1}, CacheConfig())


def test_the_idle_gauges_follow_only_settings_a_new_conversation_takes(smollm):
    """Before a view's first message its gauge follows the settings, but not to a budget
    the model cannot hold, which New chat (New story, Reset) then refuses: it showed a
    heavy of 100,000 as the next chat's budget."""
    provider = ModelProvider(lambda: smollm, "SmolLM2").start()
    provider.get()
    config = AppConfig()
    with gr.Blocks():
        settings = Settings(config)
        views = [ChatTab(provider, settings, config), StoryTab(provider, settings, config),
                 CompareTab(provider, settings, config)]
    fits = CacheConfig(policy="h2o", heavy=16, recent=16, sink=4)
    for view in views:
        assert any('data-budget="36"' in str(shown) for shown in view.idle(fits).values())
        with pytest.raises(Refusal, match="context"):
            view.idle(replace(fits, heavy=100_000))
