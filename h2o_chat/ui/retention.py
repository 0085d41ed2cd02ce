"""Which tokens the cache still holds: data from ``CacheStats`` and its HTML rendering.

Pure functions (no Gradio), so the map's numbers can be checked against the cache. A
token's *hold count* is the number of (layer, KV head) pairs that still hold it, in batch
row 0: every pair holds a token right after it is fed, none once it is evicted everywhere.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

from h2o_chat.engine.cache import CacheStats

# Above this many tokens the map shows the newest ones only: the browser re-renders the
# whole map on every update, and a few thousand spans keep that cheap.
MAX_MAP_TOKENS = 3000
# Columns of the heat map image; longer conversations are averaged into this many bins.
MAX_HEAT_COLUMNS = 600
LEVELS = 10  # colour steps of the hold fraction
_DARK_FROM = 6  # levels from here on get white text

_FEW_RGB = np.array([219, 234, 254], dtype=np.float32)  # pale blue: held by few pairs
_ALL_RGB = np.array([29, 78, 216], dtype=np.float32)  # blue: held by every pair
# Text on the pale levels: dark in either theme (the theme's own text colour is light in
# dark mode, unreadable on pale blue).
_LIGHT_LEVEL_TEXT = "#111827"


def _css_rgb(fraction: float) -> str:
    r, g, b = (_FEW_RGB + (_ALL_RGB - _FEW_RGB) * fraction).round().astype(int)
    return f"rgb({r},{g},{b})"


# For the map's gr.HTML (css_template, scoped to it): one class per level keeps each
# token's markup short, which matters at thousands of tokens per update. Greys and
# borders are the theme's variables, so the map follows light and dark mode.
TOKEN_MAP_CSS = "\n".join(
    [
        ".tokmap { font-family: ui-monospace, monospace; font-size: 12px; line-height: 1.8;"
        " white-space: pre-wrap; word-break: break-word; max-height: 320px; overflow-y: auto;"
        " border: 1px solid var(--border-color-primary); padding: 6px; border-radius: 6px; }",
        ".tokmap span, .maplegend span { border-radius: 3px; }",
        ".maplegend { font-size: 12px; margin: 4px 0; }",
        ".maplegend span { padding: 0 5px; margin-right: 4px; }",
        ".ev { color: var(--body-text-color-subdued); text-decoration: line-through; }",
        ".pd { outline: 1px dashed var(--body-text-color-subdued); }",
        ".heat { position: relative; margin: 8px 0 0 8px; }",
        ".heat img { width: 100%; height: 180px; image-rendering: pixelated; display: block;"
        " border: 1px solid var(--border-color-primary); }",
        ".heat .sel { position: absolute; left: -8px; width: 5px; background: #dc2626; }",
        # Wraps on a narrow screen instead of running its three labels together.
        ".heataxis { display: flex; flex-wrap: wrap; justify-content: space-between;"
        " column-gap: 12px; font-size: 11px; color: var(--body-text-color-subdued);"
        " margin-left: 8px; }",
    ]
    + [
        f".k{k} {{ background: {_css_rgb(k / LEVELS)};"
        f" color: {'white' if k >= _DARK_FROM else _LIGHT_LEVEL_TEXT}; }}"
        for k in range(1, LEVELS + 1)
    ]
)


def hold_matrix(stats: CacheStats, n_tokens: int, kv_heads: int) -> np.ndarray:
    """``(layers, kv_heads, n_tokens)`` bool: whether that layer and KV head hold the token
    at that absolute position (batch row 0). Tokens not fed yet are held by none."""
    # numpy from here on: torch would spread these small reductions over its OpenMP
    # threads, which on a busy small CPU costs more than the work, and slows decoding.
    if n_tokens < stats.seen:
        raise ValueError(f"n_tokens = {n_tokens} < {stats.seen} tokens the cache has seen")
    held = np.zeros((len(stats.layers), kv_heads, n_tokens), dtype=bool)
    for row, layer in zip(held, stats.layers):
        if layer.positions.numel():
            positions = layer.positions[0].cpu().numpy()
            row[np.arange(kv_heads)[:, None], positions] = True
    return held


def select(held: np.ndarray, layer: int | None = None, head: int | None = None) -> np.ndarray:
    """The part of ``hold_matrix`` in view: one layer and/or one KV head, None = all."""
    if layer is not None:
        held = held[layer : layer + 1]
    if head is not None:
        held = held[:, head : head + 1]
    return held


def hold_counts(held: np.ndarray) -> tuple[np.ndarray, int]:
    """Per position, how many (layer, head) pairs of ``held`` hold it; and how many pairs
    there are (the count of a token nothing has evicted)."""
    return held.sum(axis=(0, 1)), held.shape[0] * held.shape[1]


def heat_rows(held: np.ndarray, head: int | None = None) -> np.ndarray:
    """``(layers, n_tokens)`` float: 1/0 whether the layer holds each token in ``head``, or
    for ``head`` None the fraction of its KV heads that do."""
    return select(held, head=head).mean(axis=1, dtype=np.float32)


def downsample(rows: np.ndarray, max_columns: int = MAX_HEAT_COLUMNS) -> np.ndarray:
    """Average ``(rows, n)`` into at most ``max_columns`` bins of equal width (the last
    may be narrower), so a long story still fits one image."""
    n = rows.shape[-1]
    if n <= max_columns:
        return rows
    width = math.ceil(n / max_columns)
    columns = math.ceil(n / width)
    padded = np.pad(rows, ((0, 0), (0, columns * width - n)))
    counts = np.full(columns, float(width), dtype=np.float32)
    counts[-1] = n - (columns - 1) * width
    return padded.reshape(rows.shape[0], columns, width).sum(-1) / counts


def _legend(total: int) -> str:
    return (
        '<div class="maplegend">held by '
        f'<span class="k{LEVELS}">all {total}</span>'
        f'<span class="k{LEVELS // 2}">some</span>'
        '<span class="k1">few</span>'
        '<span class="ev">none (evicted)</span>'
        '<span class="pd">not fed yet</span>'
        " layer × KV-head pairs; hover or tap a token for its count</div>"
    )


def token_map_html(
    pieces: Sequence[str], counts: np.ndarray, total: int, seen: int,
    max_tokens: int = MAX_MAP_TOKENS,
) -> str:
    """The tokens (``pieces``, one string each) coloured by ``counts / total``: evicted
    ones greyed and struck through, those at or after ``seen`` (not fed yet) outlined."""
    n = len(pieces)
    start = max(0, n - max_tokens)
    parts = [_legend(total)]
    if start:
        parts.append(f'<div class="maplegend">showing the newest {max_tokens} of {n} tokens</div>')
    parts.append(f'<div class="tokmap" data-tokens="{n}">')
    for pos, count in enumerate(counts[start:n].tolist(), start):
        if pos >= seen:
            cls, note = "pd", "not fed yet"
        elif count == 0:
            cls, note = "ev", "evicted"
        else:
            cls, note = f"k{math.ceil(count * LEVELS / total)}", f"held by {count}/{total}"
        parts.append(f'<span class="{cls}" title="#{pos}: {note}">{html.escape(pieces[pos])}</span>')
    parts.append("</div>")
    return "".join(parts)


def heatmap_png(rows: np.ndarray) -> bytes:
    """``(layers, columns)`` fractions in [0, 1] as a PNG, one pixel each: pale blue (held
    by few) to blue (held by all), and transparent where none holds it, so evicted cells
    show the page's own background in light and dark mode alike."""
    fraction = rows.clip(0, 1)[..., None]
    rgb = _FEW_RGB + (_ALL_RGB - _FEW_RGB) * fraction
    alpha = np.where(fraction > 0, 255.0, 0.0)
    rgba = np.concatenate([rgb, alpha], axis=-1).round().astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buffer, format="PNG")
    return buffer.getvalue()


def heatmap_html(rows: np.ndarray, selected_layer: int | None, caption: str) -> str:
    """Layer × position heat map of ``heat_rows`` (layer 0 on top), downsampled to fit,
    with a marker at ``selected_layer``."""
    layers, n = rows.shape
    if n == 0:
        return '<div class="heataxis">nothing in the cache yet</div>'
    png = base64.b64encode(heatmap_png(downsample(rows))).decode("ascii")
    marker = ""
    if selected_layer is not None:
        marker = (f'<div class="sel" style="top:{100 * selected_layer / layers:.3f}%;'
                  f'height:{100 / layers:.3f}%"></div>')
    return (
        f'<div class="heat"><img alt="layer by position heat map of held tokens" '
        f'src="data:image/png;base64,{png}">{marker}</div>'
        f'<div class="heataxis"><span>position 0</span><span>{html.escape(caption)}</span>'
        f"<span>{n - 1}</span></div>"
    )


def maps_html(pieces: Sequence[str], stats: CacheStats, kv_heads: int,
              layer: int | None, head: int | None) -> tuple[str, str]:
    """Token map and heat map of a conversation (``pieces``: one string per token) for
    one layer and/or KV head (None: all)."""
    held = hold_matrix(stats, len(pieces), kv_heads)
    counts, total = hold_counts(select(held, layer, head))
    caption = (("all KV heads averaged" if head is None else f"KV head {head}")
               + " · layer 0 on top" + ("" if layer is None else f", layer {layer} marked"))
    return (token_map_html(pieces, counts, total, stats.seen),
            heatmap_html(heat_rows(held, head), layer, caption))


class TokenPieces:
    """The display text of token ids, decoded once per id: a long conversation's map is
    rebuilt several times a second, and most of its tokens repeat."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def __call__(self, ids: Sequence[int]) -> list[str]:
        text = self._text
        for token in ids:
            if token not in text:
                # A character split over several tokens shows as U+FFFD on each part.
                text[token] = self._tokenizer.decode([token], skip_special_tokens=False,
                                                     clean_up_tokenization_spaces=False)
        return [text[token] for token in ids]
