"""The sampling and cache controls every view shares, and their values as engine inputs."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import gradio as gr

from h2o_chat.config import (
    MAX_NEW_TOKENS, MAX_TEMPERATURE, POLICIES, STORAGE_BITS, AppConfig, Budget, CacheConfig, ConfigError, validate,
)
from h2o_chat.engine.build import BUDGETS, cache_from_config, policy_from_config
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.state import SettingDifference

from .refusals import Refusal

MODEL_DTYPE = "model's dtype"  # the bits choice that stores keys or values as the model computes them
# Runs in the page as it loads: the settings panel, built open, folded (see Settings).
FOLD_PANEL = """() => ({__type__: "update", open: false})"""
# Runs in the page as it loads. Gradio's slider puts a value typed into its number box
# back inside the slider's ends as the box loses focus, without a word: 5000 new tokens
# ran as 1024, temperature 3 as 2, where the config's rules allow 32768 and 10. A value
# past the ends is kept (``TypedSlider`` hands it to those rules, which refuse what they
# do not allow, by name); a box left empty (or holding no number), which Gradio took for
# the minimum (temperature 0, one new token), gets back the value it had when focused.
# This listens in the capture phase, before Gradio's own blur handler.
KEEP_TYPED_SLIDER_VALUES = """() => {
  const sliderOf = t => t instanceof HTMLInputElement && t.type === "number"
                        && t.closest(".block")?.querySelector("input[type=range]");
  const before = new WeakMap();
  document.addEventListener("focusin", (event) => {
    if (sliderOf(event.target)) before.set(event.target, event.target.value);
  });
  document.addEventListener("blur", (event) => {
    const box = event.target, slider = sliderOf(box);
    if (!slider) return;
    if (box.value === "") {
      if (!before.has(box)) return;
      box.value = before.get(box);
      box.dispatchEvent(new Event("input", {bubbles: true}));
    } else if (Number(box.value) < Number(slider.min) || Number(box.value) > Number(slider.max)) {
      event.stopPropagation();
    }
  }, true);
}"""


class TypedSlider(gr.Slider):
    """A slider for the usual values whose number box takes any other: the handlers check
    its value by the config's rules, by name, where Gradio's own check refused a value past
    the slider's ends with a message naming nothing and a traceback in the server log."""

    is_template = True  # drawn by Gradio's slider

    def preprocess(self, payload: Any) -> Any:
        return payload


class Settings:
    """One set of controls above the tabs. Handlers take them as inputs (a set of
    components, so they receive a dict) and read them with ``sampling``/``cache``."""

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        gen, cache = config.generation, config.cache
        # Built open and folded by the page itself as it loads (``load_in_page``), so its
        # controls are drawn with the page. Gradio 6.31 draws the controls of a panel that
        # starts closed only when it first opens, and a frame later hands each the value
        # it was built with: a value typed in between went back to the default without a
        # word, and the next reply ran with it (a frame comes late on a loaded machine).
        with gr.Accordion("Sampling and cache settings", open=True, elem_id="settings") as self.panel:
            with gr.Row():
                self.temperature = TypedSlider(
                    0, max(2.0, gen.temperature), value=gen.temperature, step=0.05,
                    label="temperature (0 = greedy)", elem_id="temperature",
                    info="0 always picks the likeliest next token; higher = more varied "
                         f"(type up to {MAX_TEMPERATURE:g})")
                self.top_p = TypedSlider(0.05, 1.0, value=gen.top_p, step=0.05, label="top-p",
                                         elem_id="top-p",
                                         info="pick only among the likeliest tokens that "
                                              "together have this much chance (1 = any)")
                self.max_new_tokens = TypedSlider(
                    1, max(1024, gen.max_new_tokens), value=gen.max_new_tokens, step=1,
                    label="max new tokens per reply", elem_id="max-new-tokens",
                    info=f"type up to {MAX_NEW_TOKENS}")
                # A text box: Gradio's number box shows (and sends) 0 when empty, which
                # made every reply repeat the last one.
                self.seed = gr.Textbox("" if gen.seed is None else str(gen.seed),
                                       label="seed (empty = random)", placeholder="random",
                                       elem_id="seed")
            # No ``minimum`` or ``precision`` on the number boxes, and dropdowns that take
            # any value: Gradio's own checks would refuse a bad value (sent to the page's
            # endpoints by hand) with a message that does not name the setting and a
            # traceback in the server log, and its rounding would run 2.5 slots as 2
            # without a word; ``cache`` refuses them by name, as the config file's rules do.
            gr.Markdown("Cache settings apply to the next **new chat**, **new story** or "
                        "**compare reset**; a running one keeps its cache.")
            with gr.Row():
                self.policy = gr.Dropdown(
                    list(POLICIES), value=cache.policy, label="cache policy", elem_id="policy",
                    allow_custom_value=True,
                    info="which tokens the model keeps in memory once the budget is full "
                         "(h2o: sink + recent + heavy; turns: h2o scored turn by turn, "
                         "for chats; full: keeps all)")
                # A slot holds one token's keys and values, in every layer and KV head.
                self.heavy = gr.Number(
                    cache.heavy, label="heavy slots", elem_id="heavy",
                    info="older tokens kept because they drew the most attention")
                self.recent = gr.Number(cache.recent, label="recent slots",
                                        elem_id="recent", info="the newest tokens, always kept")
                self.sink = gr.Number(
                    cache.sink, label="sink slots", elem_id="sink",
                    info="the first tokens, always kept: attention leans on them")
                self.rolling = gr.Checkbox(
                    cache.rolling, label="rolling positions", elem_id="rolling",
                    info="cached tokens at their rank in the cache, so a conversation can "
                         "outgrow the model's trained context")
            with gr.Row():
                bits = [MODEL_DTYPE, *(str(b) for b in STORAGE_BITS)]
                self.key_bits = gr.Dropdown(
                    bits, value=_bits_choice(cache.key_bits), label="key bits", elem_id="key-bits",
                    allow_custom_value=True,
                    info="how precisely each kept key is stored: fewer bits, more slots per MB "
                         "(keys are the fragile half: 8 keeps answers, or 4 with 16 exact newest tokens)")
                self.value_bits = gr.Dropdown(
                    bits, value=_bits_choice(cache.value_bits), label="value bits", elem_id="value-bits",
                    allow_custom_value=True,
                    info="the same for values, which take 4 bits with little loss")
                self.exact_window = gr.Number(
                    cache.exact_window, label="exact newest tokens", elem_id="exact-window",
                    info="kept as the model gave them beside 8- or 4-bit slots: 16 let 4-bit keys "
                         "lose about what 8-bit keys do (0: none)")
                # A text box, for the seed's reason: empty means "count slots instead".
                self.budget_mb = gr.Textbox(
                    "" if cache.budget_mb is None else f"{cache.budget_mb:g}", label="budget in MB",
                    placeholder="empty: the slot counts above", elem_id="budget-mb",
                    info="memory per conversation: replaces heavy and recent with the slots "
                         "these megabytes hold at the bits above (pins counted); the most quality "
                         "per MB: keys and values at 4 bits with 16 exact newest tokens")

    def load_in_page(self, demo: gr.Blocks) -> None:
        """What the page does as it loads, without a server round trip: it folds the panel
        before a user can reach it, and keeps what was typed into a slider's box."""
        demo.load(None, None, self.panel, js=FOLD_PANEL, queue=False, show_progress="hidden")
        demo.load(None, js=KEEP_TYPED_SLIDER_VALUES)

    @property
    def components(self) -> set[gr.components.Component]:
        return {self.temperature, self.top_p, self.max_new_tokens, self.seed,
                self.policy, self.heavy, self.recent, self.sink, self.rolling,
                self.key_bits, self.value_bits, self.exact_window, self.budget_mb}

    def sampling(self, values: dict, max_new_tokens: Any = None) -> dict[str, Any]:
        """Keyword arguments of ``session.send``, checked by the config file's rules;
        a ``Refusal`` naming the setting if one is bad. No seed: a new one per reply.
        ``max_new_tokens``: a view's own control's value, in place of the shared one."""
        tokens = values[self.max_new_tokens] if max_new_tokens is None else max_new_tokens
        generation = dataclasses.replace(
            self.config.generation, temperature=values[self.temperature],
            top_p=values[self.top_p], max_new_tokens=_whole(tokens),
            seed=_seed(values[self.seed]))
        generation = _checked(dataclasses.replace(self.config, generation=generation)).generation
        return {name: getattr(generation, name)
                for name in ("temperature", "top_p", "max_new_tokens", "seed")}

    def cache(self, values: dict) -> CacheConfig:
        """The cache settings, checked by the config file's rules; a ``Refusal`` naming
        the setting if one is bad."""
        return self._cache(values, {})

    @property
    def cache_controls(self) -> dict[str, gr.components.Component]:
        """The cache settings the page can change, by their names in ``H2OCache.settings()``."""
        return {"policy": self.policy, **{name: getattr(self, name) for name in BUDGETS},
                "rolling": self.rolling, "key_bits": self.key_bits, "value_bits": self.value_bits,
                "exact_window": self.exact_window, "budget_bytes": self.budget_mb}

    def check_adoptable(self, differences: Iterable[SettingDifference]) -> None:
        """A ``Refusal`` if the page cannot take a saved session's settings: one without
        a control (the config file sets it, at start) differs from the configured value."""
        fixed = [d for d in differences if d.name not in self.cache_controls
                 and getattr(self.config.cache, d.name, None) != d.saved]
        if fixed:
            raise Refusal("; ".join(f"cache.{d.name} = {d.saved!r} in the file, "
                                    f"{getattr(self.config.cache, d.name, None)!r} in the config file"
                                    for d in fixed)
                          + ": the page cannot change it; set it in the config file and restart the app")

    def adopt(self, values: dict, differences: Iterable[SettingDifference], model: Any) -> Adopted:
        """The cache settings with a saved session's values where they differ from the
        page's, checked like ``cache`` and against ``model`` (its context), and the
        updates that show them in the controls. A setting the file's policy does not use
        keeps the page's value; a ``Refusal`` naming the setting if the page cannot take
        them (see ``check_adoptable``) or one is bad."""
        differences = list(differences)
        self.check_adoptable(differences)
        # Bits left at the model's dtype and a budget in slots are left out of a file's
        # settings, so a difference there saves None: the page's control goes back to it.
        taken = {d.name: d.saved for d in differences if d.name in self.cache_controls
                 and (d.saved is not None or d.name in _NONE_MEANS)}
        try:
            cache = self._cache(values, {_CONFIG_NAMES.get(name, name): _config_value(name, value)
                                         for name, value in taken.items()})
            new_cache(model, cache)
        except (Refusal, ConfigError) as refusal:
            raise Refusal(f"the file's cache settings: {refusal}") from None
        shown = {name: _shown_value(name, value) for name, value in taken.items()}
        return Adopted(cache, {self.cache_controls[name]: value for name, value in shown.items()},
                       ", ".join(f"{_CONFIG_NAMES.get(name, name)} {value}" for name, value in shown.items()))

    def _cache(self, values: dict, taken: dict[str, Any]) -> CacheConfig:
        """The page's cache settings with ``taken`` in place of some, checked."""
        page = {"policy": values[self.policy], "rolling": bool(values[self.rolling]),
                **{name: _whole(values[getattr(self, name)]) for name in BUDGETS},
                "key_bits": _bits(values[self.key_bits]), "value_bits": _bits(values[self.value_bits]),
                "exact_window": _whole(values[self.exact_window]),
                "budget_mb": _megabytes(values[self.budget_mb])}
        cache = dataclasses.replace(self.config.cache, **(page | taken))
        return _checked(dataclasses.replace(self.config, cache=cache)).cache

    def follow(self, state: gr.State, outputs: list[gr.components.Component],
               show: Callable[[CacheConfig], dict]) -> None:
        """While a view has no session (``state`` holds None), ``show(cache)`` gives its
        updates for the cache settings as they change, so its gauge and labels tell the
        budget its next session gets. Settings not valid yet (the user may be typing), or
        that the model cannot hold (``show`` refuses them), change nothing: sending says
        what is wrong."""
        def changed(values: dict) -> dict:
            if values[state] is None:
                try:
                    return show(self.cache(values))
                except Refusal:
                    pass
            return {outputs[0]: gr.skip()}

        gr.on([control.change for control in (self.policy, self.heavy, self.recent, self.sink,
                                               self.key_bits, self.value_bits, self.exact_window,
                                               self.budget_mb)],
              changed, {state, *self.components}, outputs, show_progress="hidden")


@dataclass(frozen=True)
class Adopted:
    """A saved session's cache settings taken into the page's: the settings to resume
    with, the updates that show them in the controls, and what was taken, in words."""

    cache: CacheConfig
    updates: dict
    summary: str


def new_cache(model: Any, cache: CacheConfig) -> H2OCache:
    """A cache for ``model``; a ``Refusal`` if the budget does not fit the model's context."""
    try:
        return cache_from_config(model, cache)
    except ConfigError as err:
        raise Refusal(str(err)) from None


def check_fits(model: Any, cache: CacheConfig) -> None:
    """A ``Refusal`` as ``new_cache`` gives it if ``model`` cannot hold ``cache`` (its
    context); nothing while the model loads (None): sending waits for it and checks then."""
    if model is not None:
        new_cache(model, cache)


def budget(cache: CacheConfig, model: Any = None) -> int | None:
    """Slots a cache with these settings holds at rest, besides pinned tokens (None:
    unbounded, or a budget in bytes while the model that sets a token's bytes is not known)."""
    if cache.budget_mb is None:
        return policy_from_config(cache).capacity
    return None if model is None else new_cache(model, cache).policy.capacity


# What the page offers for the fields the config lets be null (an empty box, a choice): its
# refusals say so rather than "or null", which the page has no way to give.
_EMPTY_MEANS = {"generation.seed": "or empty for a new seed per reply",
                "cache.budget_mb": "or empty for the slot counts",
                "cache.key_bits": f"or {MODEL_DTYPE}", "cache.value_bits": f"or {MODEL_DTYPE}"}


def _checked(config: AppConfig) -> AppConfig:
    try:
        return validate(config)
    except ConfigError as err:
        message = str(err)
        if err.field in _EMPTY_MEANS and message.endswith(", or null"):
            message = message.removesuffix("or null") + _EMPTY_MEANS[err.field]
        raise Refusal(message) from None


def _seed(text: str) -> int | None:
    if not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise Refusal(f"generation.seed = {text.strip()[:40]!r}: must be an integer from 0 to {2**63 - 1}, "
                      + _EMPTY_MEANS["generation.seed"]) from None


def _whole(value: Any) -> Any:
    """A number box's value as an int where it is a whole number; anything else (a
    fraction, an empty box's None) is handed on for the config's check to refuse by name."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# A saved setting whose None is a value the page can show (the model's dtype, no window,
# no byte budget), and the config field a setting's name stands for where they differ.
_NONE_MEANS = ("key_bits", "value_bits", "exact_window", "budget_bytes")
_CONFIG_NAMES = {"budget_bytes": "budget_mb"}


def _config_value(name: str, saved: Any) -> Any:
    """A saved setting as the config holds it; a file's budget in bytes is read (and
    refused by name) as the Python API reads one; a file without a window has none."""
    if name == "exact_window" and saved is None:
        return 0
    return Budget.of_bytes(saved).megabytes if name == "budget_bytes" and saved is not None else saved


def _shown_value(name: str, saved: Any) -> Any:
    if name in ("key_bits", "value_bits"):
        return _bits_choice(saved)
    if name == "exact_window":
        return _config_value(name, saved)
    if name == "budget_bytes":
        # 12 digits: every budget in whole bytes (at most 10^12) reads back as itself.
        return "" if saved is None else f"{Budget.of_bytes(saved).megabytes:.12g}"
    return saved


def _bits_choice(bits: int | None) -> str:
    return MODEL_DTYPE if bits is None else str(bits)


def _bits(choice: Any) -> Any:
    """The dropdown's choice as bits. The page's endpoints take any JSON value, so
    anything but a choice or a number is handed on as it is, for the config's check to
    refuse by name."""
    if choice in (None, MODEL_DTYPE):
        return None
    if isinstance(choice, str) and re.fullmatch(r"\s*[0-9]{1,6}\s*", choice):
        return int(choice)
    return choice


def _megabytes(text: str | None) -> float | None:
    if text is None or not str(text).strip():
        return None
    try:
        return float(text)
    except ValueError:
        raise Refusal(f"cache.budget_mb = {str(text).strip()[:40]!r}: must be a number of megabytes, "
                      + _EMPTY_MEANS["cache.budget_mb"]) from None
