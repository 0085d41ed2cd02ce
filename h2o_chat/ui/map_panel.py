"""The retained-token map of one view: layer/head pickers, token map and heat map."""

from __future__ import annotations

from collections.abc import Sequence

import gradio as gr

from h2o_chat.engine.stats import CacheStats
from h2o_chat.runtime import LoadedModel

from . import retention
from .gauges import Gauge, gauge_html
from .view_state import Snapshot, ViewState, unchanged

ALL = -1  # picker value for "every layer" / "every KV head"

# The token map's own script (Gradio's js_on_load): after each update the box shows its
# newest tokens (its end), unless the user scrolled up in it to read; scrolling back to
# the end follows again, and so does a cleared map (new chat). ``watch`` runs after
# Gradio has patched the map in place; a ResizeObserver catches the box being shown
# again (its tab or accordion reopened), which loses the scroll position.
FOLLOW_NEWEST = """
let reading = false, ours = null;
const follow = () => {
  const map = element.querySelector(".tokmap");
  if (!map) { reading = false; return; }
  if (reading) return;
  map.scrollTop = map.scrollHeight;
  ours = map.scrollTop;
};
element.addEventListener("scroll", (event) => {
  const map = event.target;
  if (!(map instanceof Element) || !map.classList.contains("tokmap")) return;
  if (ours !== null && Math.abs(map.scrollTop - ours) < 2) return;  // our own scroll
  reading = map.scrollTop + map.clientHeight < map.scrollHeight - 24;
}, true);
watch("value", follow);
new ResizeObserver(follow).observe(element);
"""
# What the map means, in plain words, above it.
INTRO = (
    "Which tokens the model can still look back at. Each of its layers has a few **KV "
    "heads** (the memory its attention reads), and once the cache is full each layer × "
    "KV-head pair keeps its own choice of tokens: darker = kept by more of them, struck "
    "through = forgotten by all. Below, the same per layer."
)


class MapPanel:
    """Built inside the view's Blocks context; ``render`` returns its output updates."""

    def __init__(self, prefix: str) -> None:
        with gr.Accordion("Retained-token map", open=True, elem_id=f"{prefix}-map"):
            gr.Markdown(INTRO)
            with gr.Row():
                self.layer = gr.Dropdown([("all layers", ALL)], value=ALL, label="layer",
                                         elem_id=f"{prefix}-map-layer")
                self.head = gr.Dropdown([("average of KV heads", ALL)], value=ALL,
                                        label="KV head", elem_id=f"{prefix}-map-head")
                self.live = gr.Checkbox(True, label="update live while tokens stream",
                                        elem_id=f"{prefix}-map-live",
                                        info="about once a second, newest tokens only; "
                                             "the whole map at the end of each reply")
            self.tokens = gr.HTML(css_template=retention.TOKEN_MAP_CSS, js_on_load=FOLLOW_NEWEST,
                                  elem_id=f"{prefix}-token-map")
            self.heat = gr.HTML(css_template=retention.TOKEN_MAP_CSS,
                                elem_id=f"{prefix}-heat-map")

    @property
    def pickers(self) -> list[gr.Dropdown]:
        return [self.layer, self.head]

    def wire(self, state: gr.State) -> None:
        """Re-render when a picker changes; ``state`` holds the view's ``ViewState``."""
        self._state = state
        gr.on([self.layer.change, self.head.change], self.on_pick, {state, *self.pickers},
              self.outputs, show_progress="hidden")

    def on_pick(self, values: dict) -> dict:
        state: ViewState | None = values[self._state]
        snapshot = state.snapshot() if state else None
        if snapshot is None:
            return unchanged(self.outputs[0])
        return self.render(state.loaded, snapshot.tokens, snapshot.stats.cache, values)

    @property
    def outputs(self) -> list[gr.HTML]:
        return [self.tokens, self.heat]

    def choices(self, loaded: LoadedModel) -> dict:
        """Picker updates once the model (and so its shape) is known."""
        return {
            self.layer: gr.Dropdown(choices=[("all layers", ALL)]
                                    + [(f"layer {i}", i) for i in range(loaded.layers)]),
            self.head: gr.Dropdown(choices=[("average of KV heads", ALL)]
                                   + [(f"KV head {i}", i) for i in range(loaded.kv_heads)]),
        }

    def render(self, loaded: LoadedModel, tokens: Sequence[int], stats: CacheStats,
               values: dict, streaming: bool = False) -> dict:
        """Both maps of a session's ``tokens`` and cache ``stats``, for the picked layer
        and head (``values`` holds the pickers' values); ``streaming``: only the newest
        tokens, which is all the box shows while it follows them."""
        limit, note = ((retention.LIVE_MAP_TOKENS, " while the reply streams; all at its end")
                       if streaming else (retention.MAX_MAP_TOKENS, ""))
        token_map, heat_map = retention.maps_html(
            retention.token_pieces(loaded.tokenizer).in_text(tokens), stats, loaded.kv_heads,
            _picked(values[self.layer]), _picked(values[self.head]), limit, note)
        return {self.tokens: token_map, self.heat: heat_map}

    def streamed(self, state: ViewState, snapshot: Snapshot, values: dict, final: bool) -> dict:
        """The maps' part of an update of a streamed turn: the whole map at its end; before
        that, if the map is live, its newest tokens at most once per ``MAP_INTERVAL_S``."""
        if final:
            return self.render(state.loaded, snapshot.tokens, snapshot.stats.cache, values)
        if values[self.live] and state.map_pace.due():
            return self.render(state.loaded, snapshot.tokens, snapshot.stats.cache, values,
                               streaming=True)
        return {}


def _picked(value: int | None) -> int | None:
    return None if value is None or value == ALL else int(value)


def gauge_and_map(gauge: gr.HTML, label: str, panel: MapPanel, state: ViewState,
                  values: dict, final: bool) -> dict:
    """The updates of a one-session view from one snapshot: its gauge, and its map
    (``MapPanel.streamed``)."""
    snapshot = state.take()
    return {gauge: gauge_html(Gauge.of(label, snapshot.stats))} | panel.streamed(
        state, snapshot, values, final)
