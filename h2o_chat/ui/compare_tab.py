"""The compare view: the same turns sent to a bounded and a full cache, side by side."""

from __future__ import annotations

import html
import random
from collections.abc import Iterator

import gradio as gr

from h2o_chat import make_cache
from h2o_chat.config import AppConfig, CacheConfig
from h2o_chat.fidelity import FidelityProbe, first_divergence
from h2o_chat.inputs import InputLimits
from h2o_chat.session import ChatSession

from .chat_tab import shown_messages
from .controls import SendStopSwap, stop_button
from .fidelity_panel import FidelityPanel
from .gauges import (
    GAUGE_CSS, MEMORY, SLOTS, Gauge, TurnSeries, decode_rate, empty_gauge, gauge_html,
)
from .map_panel import MapPanel
from .provider import LoadedModel, ModelProvider
from .refusals import Refusal, refusing
from .settings import Settings, budget, new_cache
from .streaming import TEXT_INTERVAL_S, Interleaved, Throttle
from .view_state import (
    Snapshot, ViewState, browser_state, close_state, generating, wait_for_model,
)

BOUNDED, FULL = "bounded", "full"  # the two sides
FULL_LABEL = "full cache"
_CONTEXT_TOKENS = 8  # tokens of each reply shown after the point where they diverge
# The fidelity gauge's shadow costs the bounded side one more forward pass per token
# (tools/measure_fidelity_cost.py), so it starts off.
FIDELITY_ON = False


def bounded_label(cache: CacheConfig) -> str:
    slots = budget(cache)
    # Never the full side's label, even for the full policy: the plots tell sides by it.
    return f"{cache.policy} cache " + ("(settings)" if slots is None else f"({slots} slots)")


def _title(label: str) -> str:
    return f"**{label}**"


class CompareState(ViewState):
    """One browser's comparison: two chat sessions fed the same turns and seed."""

    def __init__(self, loaded: LoadedModel, cache: CacheConfig, system_prompt: str,
                 limits: InputLimits | None = None) -> None:
        super().__init__(loaded)
        model, tokenizer = loaded.model, loaded.tokenizer

        def session(kv_cache) -> ChatSession:
            return ChatSession(model, tokenizer, cache=kv_cache, system_prompt=system_prompt or None,
                               prefill_chunk_size=cache.prefill_chunk_size,
                               limits=limits)

        self.sides = {BOUNDED: session(new_cache(model, cache)),
                      FULL: session(make_cache(model, "full"))}
        self.labels = {BOUNDED: bounded_label(cache), FULL: FULL_LABEL}
        self.series = TurnSeries()
        self.turns = 0
        self.divergences: list[str] = []  # one line per turn
        self.probe: FidelityProbe | None = None  # the fidelity gauge's shadow, while on
        self.fidelity_step: int | None = None  # the position picked in the gauge

    def use_probe(self, on: bool) -> None:
        """Turn the fidelity gauge's shadow on or off; call it between turns. Turned on
        mid-conversation, the shadow reads the conversation so far on the next send."""
        if on and self.probe is None:
            self.probe = FidelityProbe(self.sides[BOUNDED]).attach()
        elif not on and self.probe is not None:
            self.probe.detach()
            self.probe = None  # lets go of the shadow's cache

    def sessions(self) -> list[ChatSession]:
        return list(self.sides.values())  # the bounded one first: the map shows it

    def shown(self, side: str) -> list[dict[str, str]]:
        return shown_messages(self.sides[side])


class CompareTab:
    """Built inside the compare tab's context; wires its events."""

    def __init__(self, provider: ModelProvider, settings: Settings, config: AppConfig) -> None:
        self.provider, self.settings, self.config = provider, settings, config
        self.server = config.server
        self.state = browser_state(config.server)
        gr.Markdown(
            "Each message goes to two sessions in this process, one on the cache settings "
            "above and one keeping every token, with the same sampling seed; they decode "
            "taking turns token by token. Until the bounded cache starts evicting, the replies "
            "normally match.")
        # The input right under the replies, both sized to the window: in view at 768 px.
        # Each side's name above its chat, not as the chat's label, which floated over the
        # top message.
        with gr.Row():
            with gr.Column():
                self.bounded_title = gr.Markdown(_title(bounded_label(config.cache)),
                                                 elem_id="compare-bounded-title")
                self.bounded_chat = gr.Chatbot(show_label=False, buttons=["copy"],
                                               height="calc(100vh - 490px)", min_height=200,
                                               elem_id="compare-bounded-chat")
            with gr.Column():
                gr.Markdown(_title(FULL_LABEL), elem_id="compare-full-title")
                self.full_chat = gr.Chatbot(show_label=False, buttons=["copy"],
                                            height="calc(100vh - 490px)", min_height=200,
                                            elem_id="compare-full-chat")
        with gr.Row(equal_height=True):
            self.text = gr.Textbox(placeholder="A message for both, Enter to send, Esc to stop",
                                   show_label=False, scale=5, elem_id="compare-input")
            self.send = gr.Button("Send to both", variant="primary", scale=0, min_width=160,
                                  elem_id="compare-send")
            self.stop = stop_button("compare", self.state)
            self.reset = gr.Button("Reset", scale=0, min_width=100, elem_id="compare-reset")
        with gr.Row():
            self.bounded_gauge = gr.HTML(
                empty_gauge(bounded_label(config.cache), budget(config.cache)),
                css_template=GAUGE_CSS, elem_id="compare-bounded-gauge")
            self.full_gauge = gr.HTML(empty_gauge(FULL_LABEL, None), css_template=GAUGE_CSS,
                                      elem_id="compare-full-gauge")
        self.divergence = gr.HTML("", elem_id="compare-divergence")
        with gr.Row():
            # Axes from 0, so the two caches' sizes compare at a glance: fitted to the
            # data, they made small changes look steep.
            self.memory_plot = gr.LinePlot(x="turn", y=MEMORY, color="cache", height=240,
                                           y_lim=[0, None],
                                           title="KV cache memory in use after each turn (MB)",
                                           elem_id="compare-memory-plot")
            self.slots_plot = gr.LinePlot(x="turn", y=SLOTS, color="cache", height=240,
                                          y_lim=[0, None], title="Slots held per layer and head",
                                          elem_id="compare-slots-plot")
        self.fidelity = FidelityPanel("compare", FIDELITY_ON)
        self.map = MapPanel("compare")
        self._wire()

    @property
    def _outputs(self) -> list:
        return [self.state, self.text, self.bounded_title, self.bounded_chat, self.full_chat,
                self.bounded_gauge,
                self.full_gauge, self.divergence, self.memory_plot, self.slots_plot,
                *self.fidelity.outputs, *self.map.outputs]

    def _wire(self) -> None:
        sends = [self.text.submit, self.send.click]
        self.swap = SendStopSwap(self.send, self.stop, self.state)
        self.swap.on(sends)
        turn = gr.on(sends, refusing(self.on_send, self.full_chat),
                     {self.state, self.text, self.map.live, self.fidelity.enabled,
                      *self.settings.components, *self.map.pickers},
                     self._outputs, trigger_mode="multiple", **generating(self.server))
        self.swap.until([turn])
        # A chat's own Clear icon resets the comparison: both sides, as Reset does.
        gr.on([self.reset.click, self.bounded_chat.clear, self.full_chat.clear],
              refusing(self.on_reset, self.full_chat), {self.state, *self.settings.components},
              self._outputs)
        self.settings.follow(self.state, [self.bounded_title, self.bounded_gauge],
                             self._idle_bounded)
        self.map.wire(self.state)
        self.fidelity.wire(self.state)

    def on_send(self, values: dict) -> Iterator[dict]:
        text = values[self.text]
        if not text.strip():
            raise Refusal("Type a message first.")
        if not self.provider.ready:
            gr.Info("Waiting for the model to load…")
        loaded = wait_for_model(self.provider)
        state = values[self.state] or CompareState(
            loaded, self.settings.cache(values), self.config.generation.system_prompt,
            InputLimits.of(self.server))
        sampling = self.settings.sampling(values)
        if sampling["seed"] is None:  # one seed for both, so only the caches differ
            sampling["seed"] = random.randrange(2**31)
        chats = {BOUNDED: self.bounded_chat, FULL: self.full_chat}
        with state.running():
            state.use_probe(values[self.fidelity.enabled])
            state.fidelity_step = None  # a new reply: show its own worst step
            try:
                streams = {side: s.send(text, **sampling) for side, s in state.sides.items()}
            except ValueError as err:
                raise Refusal(str(err)) from None
            turn = state.turns = state.turns + 1
            shown = {side: state.shown(side) + [{"role": "user", "content": text}]
                     for side in state.sides}
            replies = dict.fromkeys(state.sides, "")
            yield {self.state: state, self.text: "", self.full_chat: shown[FULL],
                   self.bounded_chat: shown[BOUNDED],
                   self.bounded_title: _title(state.labels[BOUNDED])}
            steps, throttle, paced = Interleaved(streams), Throttle(), Throttle(TEXT_INTERVAL_S)
            update = {}  # what changed since the last push
            for side, chunk in steps:
                if state.closed:
                    return
                replies[side] += chunk
                update[chats[side]] = shown[side] + [{"role": "assistant", "content": replies[side]}]
                if throttle.due():
                    update |= self._views(values, state, steps.busy, turn, final=False)
                elif not paced.due():
                    continue
                yield update
                update = {}
            if not state.closed:
                yield ({chats[side]: state.shown(side) for side in state.sides}
                       | self._views(values, state, steps.busy, turn, final=True))

    def _views(self, values: dict, state: CompareState, busy: dict[str, float], turn: int,
               final: bool) -> dict:
        """Both gauges, the divergence, at the end the per-turn plots, and (if live or at
        the end) the bounded side's map, all from stats taken now, between two tokens."""
        snapshots = {BOUNDED: state.take(), FULL: Snapshot.of(state.sides[FULL])}
        gauges = {
            side: Gauge.of(state.labels[side], snap.stats,
                           decode_rate(snap.stats.generated, busy[side], snap.stats.prefill_seconds))
            for side, snap in snapshots.items()
        }
        update = {
            self.bounded_gauge: gauge_html(gauges[BOUNDED]),
            self.full_gauge: gauge_html(gauges[FULL]),
            self.divergence: self._divergence(state, turn),
        }
        if final:
            # Once per turn: the chart library re-renders a whole plot per update, which
            # on every throttled update kept the page's main thread busy for seconds.
            state.series.record(turn, list(gauges.values()))
            frame, order = state.series.frame(), state.series.order()
            update |= {self.memory_plot: gr.LinePlot(frame, sort=order),
                       self.slots_plot: gr.LinePlot(frame, sort=order)}
        if state.probe:
            update |= self.fidelity.render(state)
        elif final:
            update |= self.fidelity.cleared("fidelity gauge off: tick it to run the shadow from "
                                            "the next message")
        return update | self.map.streamed(state, snapshots[BOUNDED], values, final)

    def _divergence(self, state: CompareState, turn: int) -> str:
        """Where this turn's replies first differ, under the lines of earlier turns."""
        replies = {side: session.reply for side, session in state.sides.items()}
        at = first_divergence(replies[BOUNDED], replies[FULL])
        if at is None:
            line = f"identical so far ({len(replies[FULL])} tokens)"
        else:
            after = {side: html.escape("".join(state.loaded.pieces(reply[at : at + _CONTEXT_TOKENS])))
                     for side, reply in replies.items()}
            line = (f'<span data-diverge-at="{at}">first differ at token {at}</span>: '
                    f"{html.escape(state.labels[BOUNDED])} wrote <code>{after[BOUNDED]}</code>, "
                    f"{FULL_LABEL} wrote <code>{after[FULL]}</code>")
        del state.divergences[turn - 1 :]
        state.divergences.append(f"<li>turn {turn}: {line}</li>")
        return "<b>Where the replies diverge</b><ul>" + "".join(state.divergences) + "</ul>"

    def _idle_bounded(self, cache: CacheConfig) -> dict:
        """The bounded side before its first message: title and gauge for ``cache``."""
        return {self.bounded_title: _title(bounded_label(cache)),
                self.bounded_gauge: empty_gauge(bounded_label(cache), budget(cache))}

    def on_reset(self, values: dict) -> dict:
        cache = self.settings.cache(values)  # refused before anything closes
        close_state(values[self.state])
        return self._idle_bounded(cache) | {
            self.state: None, self.bounded_chat: [], self.full_chat: [],
            self.full_gauge: empty_gauge(FULL_LABEL, None), self.divergence: "",
            # An empty frame, not None: a plot set to None loses its chart element while
            # the chart library still measures it (hundreds of page errors).
            self.memory_plot: TurnSeries().frame(), self.slots_plot: TurnSeries().frame(),
            **self.fidelity.cleared(), **{output: "" for output in self.map.outputs}}
