"""The compare view's fidelity gauge: how far the bounded cache's predictions drift from a
full-cache shadow fed the same tokens, and which forgotten tokens it missed at a step."""

from __future__ import annotations

import html
from collections.abc import Sequence

import gradio as gr
import pandas as pd

from h2o_chat.fidelity import FidelityPoint, FidelityProbe

from .retention import MAX_MAP_TOKENS, TokenPieces, token_pieces
from .view_state import unchanged

AGREE, DIFFER = "same top token", "top token differs"
_COLUMNS = ["token", "KL (nats)", "top-1"]

FIDELITY_CSS = """
.fidsum { font-size: 13px; margin: 4px 0; }
.fidtext { font-family: ui-monospace, monospace; font-size: 12px; line-height: 1.8;
  white-space: pre-wrap; word-break: break-word; max-height: 260px; overflow-y: auto;
  border: 1px solid var(--border-color-primary); padding: 6px; border-radius: 6px; }
.fidtext mark { background: rgba(220, 38, 38, var(--a)); border-radius: 3px; }
.fidtext .step { outline: 2px solid #2563eb; border-radius: 3px; }
.fidlist { font-size: 12px; margin: 4px 0 0 0; }
"""

# The detail's js_on_load: each step shown opens its conversation scrolled to the first
# highlighted token (or, with none, the predicted one), a line of context above it. At
# the top, it showed the system prompt, the marks far below.
SHOW_FIRST_MARK = """
const show = () => {
  const box = element.querySelector(".fidtext");
  const first = box && box.querySelector("mark, .step");
  if (!first) return;
  const above = parseFloat(getComputedStyle(box).lineHeight) || 20;
  box.scrollTop += first.getBoundingClientRect().top - box.getBoundingClientRect().top - above;
};
show();
new MutationObserver(show).observe(element, {childList: true, subtree: true});
"""


def points_frame(points: Sequence[FidelityPoint]) -> pd.DataFrame:
    """One row per prediction: its position, KL(full || bounded) and top-1 agreement."""
    return pd.DataFrame([(p.position, round(p.kl, 5), AGREE if p.agree else DIFFER) for p in points],
                        columns=_COLUMNS)


def summary_html(points: Sequence[FidelityPoint], since: int = 0) -> str:
    """Agreement and KL over every prediction, and over those from position ``since``
    (the current reply) when it differs."""

    def line(label: str, pts: Sequence[FidelityPoint]) -> str:
        if not pts:
            return f"{label}: nothing predicted yet"
        agree = sum(p.agree for p in pts)
        worst = max(pts, key=lambda p: p.kl)
        return (f"{label}: top-1 agreement <b>{agree}/{len(pts)}</b> "
                f"({100 * agree / len(pts):.1f}%), mean KL <b>{sum(p.kl for p in pts) / len(pts):.4f}</b> "
                f"nats, largest {worst.kl:.4f} at token {worst.position}")

    lines = [line("this reply", [p for p in points if p.position >= since])]
    if since and points and points[0].position < since:
        lines.append(line("whole conversation", points))
    return ('<div class="fidsum" data-points="%d">%s</div>'
            % (len(points), "<br>".join(lines)))


def _x_range(points: Sequence[FidelityPoint]) -> list[float] | None:
    """The plot's x range, fitted to the points. A new range also makes the page draw the
    plot afresh, which it must when a colour first appears (the first differing top
    token): an update of the data alone keeps the colours of the first drawing."""
    if not points:
        return None
    return [points[0].position - 0.5, points[-1].position + 0.5]


def pick_point(points: Sequence[FidelityPoint], low: float | None = None,
               high: float | None = None) -> FidelityPoint | None:
    """The prediction with the largest KL among positions in ``[low, high]`` (all when
    not given); None if there is none."""
    inside = [p for p in points if (low is None or p.position >= low) and (high is None or p.position <= high)]
    return max(inside, key=lambda p: p.kl, default=None)


def forgotten_html(point: FidelityPoint, tokens: Sequence[int],
                   pieces: TokenPieces, pairs: int,
                   max_tokens: int = MAX_MAP_TOKENS) -> str:
    """The conversation (``tokens``) up to ``point`` with its forgotten tokens highlighted
    (redder: more of the full cache's attention), the predicted token outlined, and a
    list of them. ``pieces`` gives tokens' texts; ``pairs`` is the cache's layer × KV-head
    pair count."""
    end = min(point.position + 1, len(tokens))
    start = max(0, end - max_tokens)
    texts = pieces.in_text(tokens[start:end])
    heaviest = point.forgotten[0].mass if point.forgotten else 1.0
    marks = {f.position: f for f in point.forgotten}
    parts = []
    for pos, piece in enumerate(texts, start):
        text = html.escape(piece)
        if pos in marks:
            f = marks[pos]
            alpha = 0.2 + 0.6 * f.mass / heaviest
            text = (f'<mark style="--a:{alpha:.2f}" data-pos="{pos}" title="#{pos}: '
                    f"{100 * f.mass:.2f}% of the full cache's attention, lacking in "
                    f'{f.pairs}/{pairs} layer × KV-head pairs">{text}</mark>')
        elif pos == point.position:
            text = f'<span class="step" title="#{pos}: the predicted token">{text}</span>'
        parts.append(text)
    items = "".join(
        f"<li>#{f.position} <code>{html.escape(piece)}</code>: {100 * f.mass:.2f}% of the "
        f"attention, lacking in {f.pairs}/{pairs} pairs</li>"
        for f, piece in zip(point.forgotten, pieces([tokens[f.position] for f in point.forgotten])))
    full_top, bounded_top = (html.escape(t) for t in pieces([point.full_top, point.bounded_top]))
    return (
        f'<div class="fidsum" data-step="{point.position}" data-agree="{int(point.agree)}">'
        f"Token {point.position}: the full cache's top token <code>{full_top}</code>, the "
        f"bounded cache's <code>{bounded_top}</code>; KL {point.kl:.4f} nats; "
        f"{100 * point.lost_mass:.2f}% of the full cache's attention went to tokens the "
        "bounded cache no longer held there (highlighted, by share).</div>"
        + ("" if start == 0 else f'<div class="fidsum">showing the newest {max_tokens} tokens</div>')
        + f'<div class="fidtext">{"".join(parts)}</div>'
        + (f'<ol class="fidlist">{items}</ol>' if items else
           '<div class="fidsum">no forgotten token got any attention at this step</div>')
    )


# Hidden but kept on the page: a plot taken off it leaves the chart library's resize
# watcher reading the gone element's width (a page error at every Reset).
HIDDEN_PLOT = "hidden"


class FidelityPanel:
    """Built inside the view's Blocks context. The view's state provides ``probe`` (a
    ``FidelityProbe`` or None), ``fidelity_step`` (the picked position or None) and
    ``loaded``."""

    def __init__(self, prefix: str, enabled: bool) -> None:
        with gr.Accordion("Fidelity gauge: what did it forget?", open=True,
                          elem_id=f"{prefix}-fidelity"):
            gr.Markdown(
                "A shadow full cache reads exactly the bounded side's tokens (same model, no "
                "sampling of its own). Per predicted token: do both caches rank the same next "
                "token first, and KL(full ‖ bounded) of their next-token distributions. Select "
                "a range on the plot (or type a token number) to see which tokens the bounded "
                "cache had evicted that the full cache attended to most at that step.")
            self.enabled = gr.Checkbox(
                enabled, label="run the shadow (costs one more forward pass per token; "
                "applies from the next message)", elem_id=f"{prefix}-fidelity-on")
            # Summary, plot, token box and detail only once they have something to show:
            # empty, they were blank frames under a gauge that was off.
            self.summary = gr.HTML(css_template=FIDELITY_CSS, visible=False,
                                   elem_id=f"{prefix}-fidelity-summary")
            self.plot = gr.ScatterPlot(x="token", y="KL (nats)", color="top-1", height=240,
                                       color_map={AGREE: "#2563eb", DIFFER: "#dc2626"},
                                       title="KL(full ‖ bounded) per predicted token",
                                       visible=HIDDEN_PLOT, elem_id=f"{prefix}-fidelity-plot")
            # No minimum or precision for Gradio to enforce: it refused -1 with a message
            # naming no box (and a traceback in the log) and showed 2.5 as token 2.
            self.step = gr.Number(None, visible=False,
                                  label="token shown: type one and press Enter (empty: the "
                                  "largest KL of this reply)", elem_id=f"{prefix}-fidelity-step")
            self.detail = gr.HTML(css_template=FIDELITY_CSS, js_on_load=SHOW_FIRST_MARK,
                                  visible=False, elem_id=f"{prefix}-fidelity-detail")

    @property
    def outputs(self) -> list:
        return [self.summary, self.plot, self.step, self.detail]

    def wire(self, state: gr.State) -> None:
        self.plot.select(self.on_select, state, [self.step, self.detail], show_progress="hidden")
        self.step.submit(self.on_step, [state, self.step], [self.step, self.detail],
                         show_progress="hidden")

    def render(self, state) -> dict:
        """Summary, plot and the picked (or worst) step, from the probe's points now."""
        probe: FidelityProbe | None = state.probe if state else None
        if probe is None:
            return self.cleared()
        points = list(probe.points)
        tokens = list(probe.session.tokens)
        since = len(tokens) - len(probe.session.reply)
        detail = self._detail(state, points, tokens, since)
        shown = bool(points)
        return {self.summary: gr.HTML(summary_html(points, since), visible=True),
                self.plot: gr.ScatterPlot(points_frame(points), x_lim=_x_range(points),
                                           visible=shown or HIDDEN_PLOT),
                self.step: gr.Number(detail[self.step], visible=shown),
                self.detail: gr.HTML(detail[self.detail], visible=shown)}

    def cleared(self, note: str = "") -> dict:
        """The panel of a view without the shadow: the note if any, nothing else."""
        return {self.summary: gr.HTML(note, visible=bool(note)),
                self.plot: gr.ScatterPlot(visible=HIDDEN_PLOT),
                self.step: gr.Number(None, visible=False),
                self.detail: gr.HTML("", visible=False)}

    def _detail(self, state, points: list[FidelityPoint], tokens: list[int], since: int) -> dict:
        """The picked step (or this reply's largest KL) and its number in the box."""
        step = state.fidelity_step
        point = (pick_point(points, since) if step is None
                 else next((p for p in points if p.position == step), None))
        if point is None:
            note = "" if step is None else f'<div class="fidsum">no prediction recorded at token {step}</div>'
            return {self.step: step, self.detail: note}
        loaded = state.loaded
        return {self.step: point.position,
                self.detail: forgotten_html(point, tokens, token_pieces(loaded.tokenizer),
                                            loaded.layers * loaded.kv_heads)}

    def on_select(self, state, event: gr.SelectData) -> dict:
        probe = state.probe if state else None
        if probe is None or not isinstance(event.index, (list, tuple)):
            return unchanged(self.detail)
        point = pick_point(probe.points, *event.index[:2])
        if point is None:
            return unchanged(self.detail)
        return self.on_step(state, point.position)

    def on_step(self, state, step: float | None) -> dict:
        if state is None or state.probe is None:
            return unchanged(self.detail)
        points, tokens = list(state.probe.points), list(state.probe.session.tokens)
        if step is not None and not (step >= 0 and float(step).is_integer()):
            return {self.step: step, self.detail: f'<div class="fidsum">token shown = {step:g}: must be a token\'s '
                                                  f"number, a whole number from 0 to {len(tokens) - 1}</div>"}
        state.fidelity_step = None if step is None else int(step)
        since = len(tokens) - len(state.probe.session.reply)
        return self._detail(state, points, tokens, since)
