"""The retained-token map of one view: layer/head pickers, token map and heat map."""

from __future__ import annotations

from collections.abc import Sequence

import gradio as gr

from h2o_chat.engine.cache import CacheStats

from . import retention
from .gauges import Gauge, gauge_html
from .provider import LoadedModel
from .view_state import ViewState, unchanged

ALL = -1  # picker value for "every layer" / "every KV head"

# Runs once in the page: a token map, re-rendered with each update, shows its newest
# tokens (its end) unless the user scrolled up in it to read.
FOLLOW_NEWEST = """() => {
  const following = {};
  const view = map => map.closest("[id]").id;
  document.addEventListener("scroll", (event) => {
    const map = event.target;
    if (!(map instanceof Element) || !map.classList.contains("tokmap")) return;
    following[view(map)] = map.scrollTop + map.clientHeight >= map.scrollHeight - 24;
  }, true);
  new MutationObserver((records) => {
    if (!records.some(r => r.target instanceof Element && r.target.closest("[id$=token-map]"))) return;
    for (const map of document.querySelectorAll(".tokmap")) {
      if (following[view(map)] !== false) map.scrollTop = map.scrollHeight;
    }
  }).observe(document.body, {childList: true, subtree: true});
}"""


class MapPanel:
    """Built inside the view's Blocks context; ``render`` returns its output updates."""

    def __init__(self, prefix: str) -> None:
        with gr.Accordion("Retained-token map", open=True, elem_id=f"{prefix}-map"):
            gr.Markdown(
                "Each token of the conversation, coloured by how many layer × KV-head pairs "
                "of the cache still hold it; below, which layers hold which positions."
            )
            with gr.Row():
                self.layer = gr.Dropdown([("all layers", ALL)], value=ALL, label="layer",
                                         elem_id=f"{prefix}-map-layer")
                self.head = gr.Dropdown([("average of KV heads", ALL)], value=ALL,
                                        label="KV head", elem_id=f"{prefix}-map-head")
                self.live = gr.Checkbox(True, label="update live while tokens stream",
                                        elem_id=f"{prefix}-map-live")
            self.tokens = gr.HTML(css_template=retention.TOKEN_MAP_CSS,
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
               values: dict) -> dict:
        """Both maps of a session's ``tokens`` and cache ``stats``, for the picked layer
        and head (``values`` holds the pickers' values)."""
        token_map, heat_map = retention.maps_html(
            loaded.pieces(tokens), stats, loaded.kv_heads,
            _picked(values[self.layer]), _picked(values[self.head]))
        return {self.tokens: token_map, self.heat: heat_map}


def _picked(value: int | None) -> int | None:
    return None if value is None or value == ALL else int(value)


def gauge_and_map(gauge: gr.HTML, label: str, panel: MapPanel, state: ViewState,
                  values: dict, final: bool) -> dict:
    """The updates of a one-session view from one snapshot: its gauge, and its map when
    the map is live or the turn is over."""
    snapshot = state.take()
    update = {gauge: gauge_html(Gauge.of(label, snapshot.stats))}
    if final or values[panel.live]:
        update |= panel.render(state.loaded, snapshot.tokens, snapshot.stats.cache, values)
    return update
