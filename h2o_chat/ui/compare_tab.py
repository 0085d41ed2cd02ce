"""The compare view: the same turns sent to a bounded and a full cache, side by side."""

from __future__ import annotations

import html
import random
from collections.abc import Generator, Iterator

import gradio as gr

from h2o_chat import make_cache
from h2o_chat.config import AppConfig, CacheConfig
from h2o_chat.fidelity import FidelityProbe, first_divergence
from h2o_chat.inputs import InputLimits, is_blank
from h2o_chat.runtime import LoadedModel, ModelProvider
from h2o_chat.sessions import ChatSession, chat_session

from .chat_box import ChatBox
from .chat_tab import echo_while_loading, shown_messages
from .controls import SendStopSwap, send_button, stop_button
from .fidelity_panel import FidelityPanel
from .gauges import (
    GAUGE_CSS, MEMORY, SLOTS, Gauge, TurnSeries, empty_gauge, gauge_html,
)
from .map_panel import MapPanel
from .refusals import Refusal, refusing
from .reply_marker import marked
from .reply_settings import NOTHING_YET, ran_with, ran_with_line
from .retention import token_pieces
from .settings import Settings, budget, check_fits, new_cache
from .streaming import (PAIRED_TEXT_INTERVAL_S, Interleaved, Throttle, TurnEnd, in_slot, log_failure, message_back,
                        reply_failed)
from .view_state import (
    Snapshot, ViewState, admit, browser_state, close_state, generating, not_streaming, wait_for_model,
)

BOUNDED, FULL = "bounded", "full"  # the two sides
FULL_LABEL = "full cache"
_CONTEXT_TOKENS = 8  # tokens of each reply shown after the point where they diverge
# The fidelity gauge's shadow costs the bounded side one more forward pass per token
# (tools/measure_fidelity_cost.py), so it starts off.
FIDELITY_ON = False


def bounded_label(cache: CacheConfig) -> str:
    """The bounded side's name: its policy and budget, in megabytes where the settings give
    bytes (the comparison at equal memory), and the storage bits where set."""
    if cache.budget_mb is not None:
        size = f"{cache.budget_mb:g} MB"
    else:
        slots = budget(cache)
        size = "settings" if slots is None else f"{slots} slots"
    bits = "/".join(f"{side}{b}" for side, b in (("K", cache.key_bits), ("V", cache.value_bits)) if b is not None)
    if bits and cache.exact_window:
        bits += f" +{cache.exact_window} exact"
    # Never the full side's label, even for the full policy: the plots tell sides by it.
    return f"{cache.policy} cache ({size}{', ' + bits if bits else ''})"


def _title(label: str) -> str:
    return f"**{label}**"


class CompareState(ViewState):
    """One browser's comparison: two chat sessions fed the same turns and seed."""

    def __init__(self, loaded: LoadedModel, cache: CacheConfig, system_prompt: str,
                 limits: InputLimits | None = None) -> None:
        super().__init__(loaded)
        self.cache = cache  # the bounded side's
        self.system_prompt, self.limits = system_prompt, limits
        self.sides = {side: self._new_session(side, []) for side in (BOUNDED, FULL)}
        self.labels = {BOUNDED: bounded_label(cache), FULL: FULL_LABEL}
        self.series = TurnSeries()
        self.turns = 0
        self.divergences: list[str] = []  # one line per turn
        self.probe: FidelityProbe | None = None  # the fidelity gauge's shadow, while on
        self.fidelity_step: int | None = None  # the position picked in the gauge

    def _new_session(self, side: str, history: list[dict[str, str]]) -> ChatSession:
        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        kv_cache = new_cache(model, self.cache) if side == BOUNDED else make_cache(model, "full")
        return chat_session(model, tokenizer, self.cache, system_prompt=self.system_prompt,
                            history=history, limits=self.limits, cache=kv_cache, memory=self.loaded.memory)

    def rebuild(self, side: str, history: list[dict[str, str]]) -> None:
        """Take ``side`` back to ``history``: a fresh cache, fed on the next send, as the
        chat's undo does (an evicting cache cannot un-see a turn)."""
        probed = side == BOUNDED and self.probe is not None  # the shadow of the old session
        if probed:
            self.use_probe(False)
        self.sides[side] = self._new_session(side, history)
        if probed:
            self.use_probe(True)
        self.forget_snapshot()

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

    def cut_short(self) -> list[str]:
        """The sides whose last reply can go on."""
        return [side for side, session in self.sides.items() if session.can_continue]


class CompareTab:
    """Built inside the compare tab's context; wires its events."""

    def __init__(self, provider: ModelProvider, settings: Settings, config: AppConfig) -> None:
        self.provider, self.settings, self.config = provider, settings, config
        self.server = config.server
        self.state = browser_state(config.server)
        gr.Markdown(
            "Each message goes to two sessions in this process, one on the cache settings "
            "above and one keeping every token, with the same sampling seed; they decode "
            "together, in the same batched steps. Until the bounded cache starts evicting, the replies "
            "normally match.")
        # The input right under the replies, both sized to the window: in view at 768 px.
        # Each side's name above its chat, not as the chat's label, which floated over the
        # top message.
        with gr.Row():
            with gr.Column():
                self.bounded_title = gr.Markdown(_title(bounded_label(config.cache)),
                                                 elem_id="compare-bounded-title")
                self.bounded_chat = ChatBox(show_label=False, buttons=["copy"],
                                            height="calc(100vh - 520px)", min_height=200,
                                            elem_id="compare-bounded-chat")
            with gr.Column():
                gr.Markdown(_title(FULL_LABEL), elem_id="compare-full-title")
                self.full_chat = ChatBox(show_label=False, buttons=["copy"],
                                         height="calc(100vh - 520px)", min_height=200,
                                         elem_id="compare-full-chat")
        self.ran_with = ran_with_line("compare")
        with gr.Row(equal_height=True, elem_id="compare-send-row"):
            # Its label is only read out (screen readers said "Textbox"). Where the
            # window has room, small_screens adds the keys that send and stop to the
            # placeholder.
            self.text = gr.Textbox(placeholder="A message for both",
                                   label="Message for both", show_label=False, scale=5,
                                   elem_id="compare-input")
            self.send = send_button("Send to both", "compare-send", scale=0, min_width=160)
            self.stop = stop_button("compare")
            self.reset = gr.Button("Reset", scale=0, min_width=100, elem_id="compare-reset")
        with gr.Row():
            self.bounded_gauge = gr.HTML(
                self._empty_gauge(config.cache),
                css_template=GAUGE_CSS, elem_id="compare-bounded-gauge")
            self.full_gauge = gr.HTML(empty_gauge(FULL_LABEL, None), css_template=GAUGE_CSS,
                                      elem_id="compare-full-gauge")
        self.divergence = gr.HTML("", elem_id="compare-divergence")
        with gr.Accordion("Memory and slots, turn by turn", elem_id="compare-plots"), gr.Row():
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
                self.ran_with, self.bounded_gauge,
                self.full_gauge, self.divergence, self.memory_plot, self.slots_plot,
                *self.fidelity.outputs, *self.map.outputs]

    def _wire(self) -> None:
        sends = [self.text.submit, self.send.click]
        # The only option a message has is the Continue chip of a reply cut short.
        continues = [self.bounded_chat.option_select, self.full_chat.option_select]
        self.swap = SendStopSwap(self.send, self.stop, self.state, self.text)
        self.swap.on(sends + continues)
        turn_inputs = {self.state, self.swap.signal, self.text, self.map.live, self.fidelity.enabled,
                       *self.settings.components, *self.map.pickers}
        turn = gr.on(sends, refusing(self.on_send, self.full_chat), turn_inputs,
                     self._outputs, trigger_mode="multiple", **generating(self.server))
        more = gr.on(continues, refusing(self.on_continue, self.full_chat), turn_inputs,
                     self._outputs, **generating(self.server))
        self.swap.until([turn, more])
        # A chat's own Clear icon resets the comparison: both sides, as Reset does.
        gr.on([self.reset.click, self.bounded_chat.clear, self.full_chat.clear],
              refusing(self.on_reset, self.full_chat), {self.state, *self.settings.components},
              self._outputs)
        self.settings.follow(self.state, [self.bounded_title, self.bounded_gauge],
                             self.idle)
        self.map.wire(self.state)
        self.fidelity.wire(self.state)

    def on_send(self, values: dict) -> Iterator[dict]:
        text = values[self.text]
        if is_blank(text):
            raise Refusal("Type a message first.")
        if values[self.state] is None:
            admit(self.server)
            if not self.provider.ready:
                echo = echo_while_loading(text)
                yield {self.bounded_chat: echo, self.full_chat: echo}
        loaded = wait_for_model(self.provider)
        state = values[self.state] or CompareState(
            loaded, self.settings.cache(values), self.config.generation.system_prompt,
            InputLimits.of(self.server))
        sampling = self._sampling(values)
        with state.running():
            self._start_reply(values, state)
            try:
                stop = self.swap.stop_event(values)
                streams = {side: s.send(text, stop=stop, **sampling) for side, s in state.sides.items()}
                # Each side fits alone; the two turns run at once, so they must fit together.
                state.loaded.memory.check({cache: count for s in state.sides.values() for cache, count
                                           in s.message_needs(text, sampling["max_new_tokens"]).items()})
            except ValueError as err:
                raise Refusal(str(err)) from None
            state.turns += 1
            shown = {side: state.shown(side) + [{"role": "user", "content": text}]
                     for side in state.sides}
            yield {self.state: state, self.text: "", self.full_chat: shown[FULL],
                   self.bounded_chat: shown[BOUNDED],
                   self.bounded_title: _title(state.labels[BOUNDED]),
                   self.ran_with: ran_with(sampling, state.cache)}
            failure = yield from self._stream(values, state, streams, sampling, shown, dict.fromkeys(streams, ""))
            if state.closed:
                return
            taken_back = [side for side in state.sides if len(state.shown(side)) < len(shown[side])]
            if taken_back:
                # A Stop (or a failure) before a side's first token took its turn back; one
                # that came between the sides' first tokens, not the other's: the two stay
                # in step.
                for side in state.sides.keys() - taken_back:
                    state.rebuild(side, shown[side][:-1])
                state.turns -= 1
                yield ({self.bounded_chat: state.shown(BOUNDED), self.full_chat: state.shown(FULL)}
                       | message_back(self.text, text, failure))
            elif failure is not None:
                reply_failed(failure)

    def on_continue(self, values: dict) -> Iterator[dict]:
        """Both sides' replies go on where they were cut short (a side whose reply ended
        by itself stays as it is), as the same turn."""
        state = values[self.state]
        if state is None or not state.cut_short():
            raise Refusal("Nothing to continue: only a reply cut short by its token limit "
                          "(max new tokens) or by Stop can go on.")
        sampling = self._sampling(values)
        with state.running():
            self._start_reply(values, state)
            try:
                stop = self.swap.stop_event(values)
                streams = {side: state.sides[side].continue_reply(stop=stop, **sampling)
                           for side in state.cut_short()}
                state.loaded.memory.check({cache: count for side in streams for cache, count
                                           in state.sides[side].cache_needs(sampling["max_new_tokens"]).items()})
            except ValueError as err:
                raise Refusal(str(err)) from None
            shown = {side: state.shown(side) for side in state.sides}  # without the chips
            yield {self.bounded_chat: shown[BOUNDED], self.full_chat: shown[FULL],
                   self.ran_with: ran_with(sampling, state.cache)}
            # The chunks extend each reply's text, which ends at its last whole character.
            so_far = {side: shown[side][-1]["content"] for side in streams}
            failure = yield from self._stream(values, state, streams, sampling,
                                              {side: shown[side][:-1] for side in shown}, so_far)
            if failure is not None and not state.closed:
                reply_failed(failure)

    def _sampling(self, values: dict) -> dict:
        sampling = self.settings.sampling(values)
        if sampling["seed"] is None:  # one seed for both, so only the caches differ
            sampling["seed"] = random.randrange(2**31)
        return sampling

    def _start_reply(self, values: dict, state: CompareState) -> None:
        state.use_probe(values[self.fidelity.enabled])
        state.fidelity_step = None  # a new reply: show its own worst step

    def _stream(self, values: dict, state: CompareState, streams: dict, sampling: dict,
                shown: dict[str, list[dict]], so_far: dict[str, str]) -> Generator[dict, None, TurnEnd]:
        """``_replies`` once the turn holds a generation slot (both sides take one)."""
        def waiting(note: str) -> dict:
            return {chat: shown[side] + [{"role": "assistant", "content": f"*{note}*"}]
                    for side, chat in ((BOUNDED, self.bounded_chat), (FULL, self.full_chat))}

        return (yield from in_slot(self.provider.admission, self.swap.stop_event(values),
                                   self._replies(values, state, streams, sampling, shown, so_far), waiting))

    def _replies(self, values: dict, state: CompareState, streams: dict, sampling: dict,
                 shown: dict[str, list[dict]], so_far: dict[str, str]) -> Generator[dict, None, TurnEnd]:
        """Stream the replies of ``streams``' sides under ``shown``, each after its text
        ``so_far``; at the end both conversations as the sessions hold them, with the chip
        of a reply cut short. Returns the failure that ended them, if any (as
        ``stream_turn``)."""
        chats = {BOUNDED: self.bounded_chat, FULL: self.full_chat}
        replies = dict(so_far)
        steps, throttle, paced = Interleaved(streams), Throttle(), Throttle(PAIRED_TEXT_INTERVAL_S)
        update = {}  # what changed since the last push
        limit = sampling["max_new_tokens"]

        def final() -> dict:
            return ({chats[side]: marked(state.shown(side), session, limit) for side, session in state.sides.items()}
                    | self._views(values, state, final=True))

        failure = None
        try:
            for side, chunk in steps:
                if state.closed:
                    return None
                replies[side] += chunk
                update[chats[side]] = shown[side] + [{"role": "assistant", "content": replies[side]}]
                if throttle.due():
                    update |= self._views(values, state, final=False)
                elif not paced.due():
                    continue
                yield update
                update = {}
        except Exception as err:  # as ``stream_turn``: the views show what the sessions hold
            log_failure(err)
            failure = err
        if not state.closed:
            yield final()
        return failure

    def _views(self, values: dict, state: CompareState, final: bool) -> dict:
        """Both gauges, the divergence, at the end the per-turn plots, and (if live or at
        the end) the bounded side's map, all from stats taken now, between two tokens."""
        snapshots = {BOUNDED: state.take(), FULL: Snapshot.of(state.sides[FULL])}
        # Each side's speed is its session's own: its tokens over the time since its first.
        # Not the time a side's thread waited for its chunks: the scheduler decodes both
        # sides in one batched step, so one side's wait held the step and the other's next
        # token was ready at once (thousands of tokens/s). A side a Continue does not take
        # on (its reply ended by itself) keeps the speed of its last reply.
        gauges = {side: Gauge.of(state.labels[side], snap.stats) for side, snap in snapshots.items()}
        turn = state.turns
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
            pieces = token_pieces(state.loaded.tokenizer)
            after = {side: html.escape("".join(pieces.in_text(reply[at : at + _CONTEXT_TOKENS])))
                     for side, reply in replies.items()}
            line = (f'<span data-diverge-at="{at}">first differ at token {at}</span>: '
                    f"{html.escape(state.labels[BOUNDED])} wrote <code>{after[BOUNDED]}</code>, "
                    f"{FULL_LABEL} wrote <code>{after[FULL]}</code>")
        del state.divergences[turn - 1 :]
        state.divergences.append(f"<li>turn {turn}: {line}</li>")
        return "<b>Where the replies diverge</b><ul>" + "".join(state.divergences) + "</ul>"

    def idle(self, cache: CacheConfig) -> dict:
        """The bounded side before its first message: title and gauge for ``cache`` (a
        ``Refusal`` for settings Reset refuses: a budget past the model's context)."""
        check_fits(self.provider.loaded_model, cache)
        return {self.bounded_title: _title(bounded_label(cache)),
                self.bounded_gauge: self._empty_gauge(cache)}

    def _empty_gauge(self, cache: CacheConfig) -> str:
        return empty_gauge(bounded_label(cache), budget(cache, self.provider.loaded_model), cache)

    def on_reset(self, values: dict) -> dict:
        # The running turn's updates would go on drawing the old conversation over the new.
        not_streaming(values[self.state])
        # Refused before anything closes, as Send refuses it.
        idle = self.idle(self.settings.cache(values))
        close_state(values[self.state])
        return idle | {
            self.state: None, self.bounded_chat: [], self.full_chat: [], self.ran_with: NOTHING_YET,
            self.full_gauge: empty_gauge(FULL_LABEL, None), self.divergence: "",
            # An empty frame, not None: a plot set to None loses its chart element while
            # the chart library still measures it (hundreds of page errors).
            self.memory_plot: TurnSeries().frame(), self.slots_plot: TurnSeries().frame(),
            **self.fidelity.cleared(), **{output: "" for output in self.map.outputs}}
