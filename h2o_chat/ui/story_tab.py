"""The story view: notebook-style long generation on a bounded cache, with a story bible
whose tokens are never evicted."""

from __future__ import annotations

from collections.abc import Iterator

import gradio as gr

from h2o_chat.config import MAX_NEW_TOKENS, AppConfig, CacheConfig, for_story
from h2o_chat.inputs import InputLimits
from h2o_chat.runtime import LoadedModel, ModelProvider
from h2o_chat.sessions import StorySession

from .controls import SendStopSwap, send_button, stop_button
from .files_panel import StoryFiles
from .gauges import GAUGE_CSS, empty_gauge
from .map_panel import MapPanel, gauge_and_map
from .pin_panel import PinPanel, warn_dropped_pins
from .refusals import Refusal, refusing
from .reply_settings import NOTHING_YET, ran_with, ran_with_line
from .settings import Settings, TypedSlider, budget, check_fits, new_cache
from .streaming import in_slot, reply_failed, stream_turn
from .view_state import (
    ViewState, admit, browser_state, close_state, generating, not_streaming, unchanged, wait_for_model,
)

GAUGE_LABEL = "Story cache"

# Runs once in the page: while a continuation streams into the story box (its Stop
# shown), the box is read-only, and holds the height it had, its text scrolling. Each
# streamed update rewrites the box from the text the turn began with, so what the user
# typed there meanwhile was lost without a word; and the box grew a line at a time up to
# its 30, moving Stop below it away from the pointer (a click aimed at it landed on the
# slider above). Once Continue is back the box grows to fit.
STORY_BOX_WHILE_STREAMING = """() => {
  const sync = () => {
    const box = document.querySelector("#story-text textarea");
    const streaming = document.querySelector("#story-stop")?.offsetParent != null;
    if (!box || box.readOnly === streaming) return;
    box.readOnly = streaming;
    box.style.maxHeight = streaming ? `${box.getBoundingClientRect().height}px` : "";
    box.style.overflowY = streaming ? "auto" : "";
  };
  new MutationObserver(sync).observe(document.body, {childList: true, subtree: true, attributes: true,
                                                     attributeFilter: ["class", "style"]});
}"""


def bible_prefix(bible: str) -> str:
    """The text before the story: the bible, set off from the story by a blank line."""
    return f"{bible.strip()}\n\n" if bible.strip() else ""


class StoryState(ViewState):
    """One browser's story: a session whose cache starts with the protected bible."""

    def __init__(self, loaded: LoadedModel, cache: CacheConfig, bible: str,
                 limits: InputLimits | None = None) -> None:
        super().__init__(loaded)
        self.bible, self.cache = bible, for_story(cache)  # what the story runs with
        self.session = StorySession(loaded.model, loaded.tokenizer,
                                    cache=new_cache(loaded.model, self.cache),
                                    bible=bible_prefix(bible),
                                    prefill_chunk_size=cache.prefill_chunk_size,
                                    limits=limits, memory=loaded.memory)

    def sessions(self) -> list[StorySession]:
        return [self.session]

    def continues(self, bible: str, story: str) -> bool:
        """Whether ``story`` only adds to what this session holds, so feeding the rest
        is enough (else the cache must be rebuilt: it cannot un-see text)."""
        return bible == self.bible and story.startswith(self.session.text)


class StoryTab:
    """Built inside the story tab's context; wires its events."""

    def __init__(self, provider: ModelProvider, settings: Settings, config: AppConfig) -> None:
        self.provider, self.settings = provider, settings
        self.server = config.server
        self.state = browser_state(config.server)
        with gr.Row():
            with gr.Column(scale=3):
                self.bible = gr.Textbox(
                    lines=3, elem_id="story-bible",
                    label="Story bible: characters and facts, protected from eviction",
                    placeholder="e.g. Mira: a lighthouse keeper on a northern island. "
                                "Tomas: her younger brother, a fisherman.")
                self.story = gr.Textbox(
                    lines=8, max_lines=30, elem_id="story-text",
                    label="Story so far: edit it freely, then continue",
                    placeholder="Write a beginning, e.g. 'The storm reached the island at dusk.'")
                self.tokens = TypedSlider(1, 1024, value=64, step=1, label="tokens per continue",
                                          elem_id="story-tokens", info=f"type up to {MAX_NEW_TOKENS}")
                with gr.Row(elem_id="story-continue-row"):
                    self.go = send_button("Continue", "story-continue")
                    self.stop = stop_button("story")
                    self.new = gr.Button("New story", elem_id="story-new")
                self.ran_with = ran_with_line("story")
            with gr.Column(scale=2):
                self.gauge = gr.HTML(empty_gauge(GAUGE_LABEL, budget(config.cache)),
                                     css_template=GAUGE_CSS, elem_id="story-gauge")
                gr.Markdown(
                    "**Continue** appends tokens to the text, streaming. If you edit the text "
                    "and the start is unchanged, only the new part is read; otherwise (or if "
                    "the bible changes) the story is read again into a fresh cache. The bible "
                    "is pinned, so the model can refer to it however long the story gets.")
                self.files = StoryFiles()
                self.pins = PinPanel("story")
        self.map = MapPanel("story")
        self._wire()

    def _wire(self) -> None:
        outputs = [self.state, self.story, self.ran_with, self.gauge, *self.map.outputs,
                   *self.pins.outputs]
        self.swap = SendStopSwap(self.go, self.stop, self.state)
        self.swap.on([self.go.click])
        turn = self.go.click(
            refusing(self.on_continue, self.story),
            {self.state, self.swap.signal, self.bible, self.story, self.tokens, self.map.live,
             *self.settings.components, *self.map.pickers},
            outputs, **generating(self.server))
        self.swap.until([turn])
        self.new.click(refusing(self.on_new, self.story), {self.state, *self.settings.components}, outputs)
        self.settings.follow(self.state, [self.gauge], self.idle)
        self.map.wire(self.state)
        self.files.wire(self, StoryState)
        self.pins.wire(self.state, lambda values, state: self.views(values, state, True),
                       {self.map.live, *self.map.pickers}, [self.gauge, *self.map.outputs])

    def on_continue(self, values: dict) -> Iterator[dict]:
        bible, story = values[self.bible], values[self.story]
        if not story.strip() and not bible.strip():
            raise Refusal("Write a beginning (or a story bible) to continue from.")
        if not self.provider.ready:
            gr.Info("Waiting for the model to load…")
            yield unchanged(self.story)  # sends the toast now (see streaming.in_slot)
        loaded = wait_for_model(self.provider)
        sampling = self.settings.sampling(values, max_new_tokens=values[self.tokens])
        state = values[self.state]
        if state is None or not state.continues(bible, story):
            admit(self.server, state)
            try:  # built before the story running now closes: a refusal leaves that as it was
                new = StoryState(loaded, self.settings.cache(values), bible, InputLimits.of(self.server))
            except ValueError as err:  # the bible is refused (too long, say)
                raise Refusal(str(err)) from None
            close_state(state)
            warn_dropped_pins(state and state.session)
            state = new
        with state.running():
            try:
                stream = state.session.send(story[len(state.session.text):],
                                            stop=self.swap.stop_event(values), **sampling)
            except ValueError as err:
                raise Refusal(str(err)) from None
            yield {self.state: state, self.ran_with: ran_with(sampling, state.cache)}
            held = len(state.session.tokens)

            def kept() -> bool:
                """Whether the session kept the turn: one that failed before its first
                token is taken back with the text it added."""
                return len(state.session.tokens) > held

            def final() -> dict:  # text taken back stays in the box as the writer left it
                return {self.story: state.session.text if kept() else story}

            # The story box is the user's text: the wait shows as a toast only.
            failure = yield from in_slot(self.provider.admission, self.swap.stop_event(values), stream_turn(
                stream,
                show=lambda added: {self.story: story + added},
                views=lambda final: self.views(values, state, final),
                final=final,
                closed=lambda: state.closed,
            ), waiting=lambda note: unchanged(self.story))
            if failure is None or state.closed:
                return
            reply_failed(failure, taken_back=None if kept() else
                         "the story is as it was before it, and your text stays in its box.")

    def idle(self, cache: CacheConfig) -> dict:
        """The gauge before a story starts, for settings New story takes (a ``Refusal``
        for others: a budget past the model's context)."""
        check_fits(self.provider.loaded_model, for_story(cache))
        return {self.gauge: empty_gauge(GAUGE_LABEL, budget(cache))}

    def on_new(self, values: dict) -> dict:
        # The running turn's updates would go on drawing the old conversation over the new.
        not_streaming(values[self.state])
        # Refused before anything closes, as Continue refuses it.
        idle = self.idle(self.settings.cache(values))
        close_state(values[self.state])
        return idle | {self.state: None, self.story: "", self.ran_with: NOTHING_YET,
                       **{output: "" for output in self.map.outputs}, **self.pins.cleared()}

    def views(self, values: dict, state: StoryState, final: bool) -> dict:
        """Gauge, map (if live or ``final``) and, when ``final``, the pin list."""
        pins = self.pins.render(state.session) if final else {}
        return gauge_and_map(self.gauge, GAUGE_LABEL, self.map, state, values, final) | pins
