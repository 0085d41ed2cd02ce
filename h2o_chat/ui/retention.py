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
import weakref
from collections.abc import Sequence

import numpy as np
from PIL import Image

from h2o_chat.engine.stats import CacheStats
from h2o_chat.sessions.pins import token_pieces as whole_pieces

# Above this many tokens the map shows the newest ones only: the browser rebuilds the
# whole map at the end of each reply, and a few thousand tokens keep that cheap.
MAX_MAP_TOKENS = 3000
# While a reply streams, the map shows only its newest tokens (about what its box shows
# on a wide screen): the browser parses and patches the map's whole DOM on every update,
# which in a 2,000-token chat was 2,000 spans (100 kB) each time (tools/measure_page.py).
LIVE_MAP_TOKENS = 500
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
        # No scroll anchoring: the page script keeps the box at its end, and the browser's
        # own adjustments would read as the user scrolling.
        ".tokmap { font-family: ui-monospace, monospace; font-size: 12px; line-height: 1.8;"
        " white-space: pre-wrap; word-break: break-word; max-height: 320px; overflow-y: auto;"
        " overflow-anchor: none; border: 1px solid var(--border-color-primary); padding: 6px;"
        " border-radius: 6px; }",
        ".tokmap span, .maplegend span { border-radius: 3px; }",
        ".maplegend, .mapnote { font-size: 12px; margin: 4px 0; }",
        ".mapnote:empty { display: none; }",
        ".maplegend span { padding: 0 5px; margin-right: 4px; }",
        ".ev { color: var(--body-text-color-subdued); text-decoration: line-through; }",
        ".pd { outline: 1px dashed var(--body-text-color-subdued); }",
        # The heat map: layer labels in the left margin, one hover row per layer over the
        # image, the selected layer outlined.
        ".heat { position: relative; margin: 8px 0 0 2.6rem; }",
        ".heat img { width: 100%; height: 240px; image-rendering: pixelated; display: block;"
        " border: 1px solid var(--border-color-primary); }",
        ".hrows { position: absolute; inset: 0; margin: 0; padding: 0; list-style: none;"
        " display: grid; grid-template-rows: repeat(var(--layers), 1fr); }",
        ".hrows li { position: relative; min-height: 0; }",
        ".hrows li:hover { outline: 1px solid var(--body-text-color); }",
        ".hrows li.sel { outline: 2px solid #dc2626; }",
        ".hrows b { position: absolute; right: 100%; top: 50%; transform: translateY(-50%);"
        " padding-right: 4px; font: 10px/1 ui-monospace, monospace; font-weight: normal;"
        " color: var(--body-text-color-subdued); white-space: nowrap; }",
        ".hev { outline: 1px dashed var(--body-text-color-subdued); }",
        # Wraps on a narrow screen instead of running its three labels together.
        ".heataxis { display: flex; flex-wrap: wrap; justify-content: space-between;"
        " column-gap: 12px; font-size: 11px; color: var(--body-text-color-subdued);"
        " margin-left: 2.6rem; }",
        ".heatnote { font-size: 12px; margin: 6px 0 0 2.6rem; color: var(--body-text-color); }",
        ".turnlegend { font-size: 12px; margin: 6px 0 0 2.6rem; }",
        ".turnshares { display: flex; height: 14px; margin: 4px 0 0 2.6rem; overflow: hidden;"
        " border: 1px solid var(--border-color-primary); border-radius: 3px; }",
        ".tshare { min-width: 1px; } .tshare.t0 { background: #1d4ed8; } .tshare.t1 { background: #93c5fd; }",
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
        '<div class="maplegend">kept by '
        f'<span class="k{LEVELS}">all {total}</span>'
        f'<span class="k{LEVELS // 2}">some</span>'
        '<span class="k1">few</span>'
        '<span class="ev">none (evicted)</span>'
        '<span class="pd">not fed yet</span>'
        " of the layer × KV-head pairs; hover or tap a stretch of tokens for its counts</div>"
    )


_UNFED = LEVELS + 1  # state code of tokens not fed yet; 0 is evicted, 1..LEVELS the levels


def token_states(counts: np.ndarray, total: int, seen: int) -> np.ndarray:
    """Per position the colour state of ``counts / total``: 0 evicted everywhere,
    1..LEVELS how many pairs hold it (rounded up), ``LEVELS + 1`` not fed yet."""
    states = -((-counts * LEVELS) // total)  # ceil without floats
    states[seen:] = _UNFED
    return states


def _state_class(state: int) -> str:
    return {0: "ev", _UNFED: "pd"}.get(state, f"k{state}")


def _run_title(first: int, last: int, low: int, high: int, total: int, state: int) -> str:
    where = f"#{first}" if first == last else f"#{first}–{last}"
    if state == _UNFED:
        return f"{where}: not fed yet"
    if state == 0:
        return f"{where}: evicted by every pair"
    held = f"{low}" if low == high else f"{low}–{high}"
    return f"{where}: kept by {held} of {total} pairs"


def token_map_html(
    pieces: Sequence[str], counts: np.ndarray, total: int, seen: int,
    max_tokens: int = MAX_MAP_TOKENS, note: str = "",
) -> str:
    """The tokens (``pieces``, one string each) coloured by ``counts / total``: evicted
    ones greyed and struck through, those at or after ``seen`` (not fed yet) outlined.
    One span per run of tokens in the same state (far fewer nodes for the browser to
    rebuild), titled with its positions and counts. Shows the newest ``max_tokens``,
    saying so with ``note`` appended."""
    n = len(pieces)
    start = max(0, n - max_tokens)
    shown = f"showing the newest {n - start} of {n} tokens{note}" if start else ""
    # The same three blocks every time: Gradio updates the map in place, node by node, so
    # the token box stays the same element (and keeps its scroll position).
    parts = [_legend(total), f'<div class="mapnote">{shown}</div>',
             f'<div class="tokmap" data-tokens="{n}">']
    window = np.asarray(counts[start:n])
    if n > start:
        states = token_states(window, total, max(0, seen - start))
        starts = np.flatnonzero(np.diff(states, prepend=-1))
        lows, highs = np.minimum.reduceat(window, starts), np.maximum.reduceat(window, starts)
        ends = [*starts[1:].tolist(), n - start]
        for first, end, low, high in zip(starts.tolist(), ends, lows.tolist(), highs.tolist()):
            state = int(states[first])
            title = _run_title(start + first, start + end - 1, low, high, total, state)
            text = html.escape("".join(pieces[start + first : start + end]))
            parts.append(f'<span class="{_state_class(state)}" title="{title}">{text}</span>')
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


def layer_rows(held: np.ndarray, head: int | None, seen: int) -> list[str]:
    """One line per layer of ``hold_matrix`` for ``head`` (None: all KV heads): how many
    of the ``seen`` positions it keeps and how many it evicted, for the heat map's rows."""
    view = select(held, head=head)
    lines = []
    for layer, kept in enumerate(view):
        per_head = kept.sum(axis=1)
        low, high = int(per_head.min()), int(per_head.max())
        count = str(low) if low == high else f"{low}–{high}"
        if head is not None:
            lines.append(f"layer {layer}, KV head {head}: keeps {count} of {seen} positions, "
                         f"{seen - high} evicted")
        else:
            anywhere = int(kept.any(axis=0).sum())
            lines.append(f"layer {layer}, all {len(per_head)} KV heads: each keeps {count} of "
                         f"{seen} positions ({seen - high} evicted); {anywhere} kept by at "
                         "least one head")
    return lines


def _heat_legend(head: int | None) -> str:
    kept = ('<span class="k10">kept by every KV head</span><span class="k3">by few</span>'
            if head is None else '<span class="k10">kept</span>')
    return (f'<div class="maplegend">Colour: {kept}<span class="hev">evicted (blank)</span>'
            "· one row per layer, positions left (oldest) to right (newest); hover a row "
            "for its counts</div>")


def blocks_note(policy: dict[str, int | str], pinned: int, evicted: bool) -> str:
    """What the solid blocks of the heat map are, for a cache with ``policy`` (its
    ``describe()``) and ``pinned`` tokens; ``evicted``: whether anything is evicted yet
    (before that every row is solid end to end)."""
    if not evicted:
        return ("Nothing evicted yet: every layer still keeps every token, so each row is "
                "solid end to end.")
    sink, recent, heavy = (int(policy.get(name, 0)) for name in ("sink", "recent", "heavy"))
    left = []
    if sink:
        left.append(f"the first {sink} tokens (the “sink”: attention leans on them, so they "
                    "are always kept)")
    if pinned:
        left.append(f"{pinned} pinned tokens (system prompt, story bible or pinned messages; "
                    "a pin further on shows as a solid stripe)")
    lines = []
    if left:
        lines.append("Solid block on the left: " + " and ".join(left) + ".")
    if recent:
        lines.append(f"Solid block on the right: the recent window, the newest {recent} "
                     "tokens, always kept.")
    if heavy:
        lines.append("In between: the “heavy hitters”, tokens each layer and KV head keeps "
                     "because they drew the most attention; blank cells are evicted.")
    return " ".join(lines)


def heatmap_html(rows: np.ndarray, selected_layer: int | None, caption: str,
                 row_titles: Sequence[str], legend: str = "", note: str = "") -> str:
    """Layer × position heat map of ``heat_rows`` (layer 0 on top), downsampled to fit:
    a labelled row per layer titled with ``row_titles``, ``selected_layer`` outlined,
    ``legend`` above and ``note`` below."""
    layers, n = rows.shape
    if n == 0:
        return '<div class="heataxis">nothing in the cache yet</div>'
    png = base64.b64encode(heatmap_png(downsample(rows))).decode("ascii")
    ticks = set(range(0, layers, 5)) | {layers - 1}  # every label would overlap at 30 layers
    labels = []
    for layer, title in enumerate(row_titles):
        selected = ' class="sel"' if layer == selected_layer else ""
        label = f"<b>{layer}</b>" if layer in ticks else ""
        labels.append(f'<li{selected} data-layer="{layer}" title="{html.escape(title)}">{label}</li>')
    return (
        f"{legend}"
        f'<div class="heat" style="--layers:{layers}"><img alt="layer by position heat map '
        f'of kept tokens" src="data:image/png;base64,{png}"><ol class="hrows">{"".join(labels)}</ol></div>'
        f'<div class="heataxis"><span>layer ↓ · position 0</span><span>{html.escape(caption)}</span>'
        f"<span>{n - 1}</span></div>"
        + (f'<div class="heatnote">{html.escape(note)}</div>' if note else "")
    )


def turn_shares(counts: np.ndarray, total: int, starts: Sequence[int], seen: int,
                budget: int | None) -> list[tuple[int, int, float, float | None]]:
    """Per turn of a turn-aware cache (``starts``: where each begins), ``(first, last
    position, slots held per layer and KV head, share of the budget or None)``, oldest
    first; what comes before the first turn (the system prompt) is a turn of its own."""
    bounds = [0, *[s for s in starts if 0 < s < seen], seen]
    shares = []
    for first, end in zip(bounds, bounds[1:]):
        if end > first:
            held = float(counts[first:end].sum()) / total
            shares.append((first, end - 1, held, None if not budget else held / budget))
    return shares


def turn_shares_html(shares: Sequence[tuple[int, int, float, float | None]],
                     limit: int | None = None, pinned: int = 0) -> str:
    """A bar of the budget split between turns, oldest on the left, each turn's part
    titled with its positions and what it holds, so a user sees which turns the cache
    still remembers; empty where the cache does not keep turns. ``limit``: the slots the
    shares are of (the budget plus ``pinned``), named where pins make it more than the
    budget the gauge shows."""
    if not shares:
        return ""
    held = sum(share[2] for share in shares) or 1.0
    # "Budget" is the settings' slots everywhere (the gauge: "budget 32 + 21 pinned"); the
    # shares are of those and the pins, which the title once called "the budget".
    whole = ("the budget" if not pinned or limit is None else
             f"the {limit} slots held at most (budget {limit - pinned} + {pinned} pinned)")
    parts = []
    for index, (first, last, slots, of_budget) in enumerate(shares):
        name = "before the first turn" if index == 0 and first == 0 else f"turn {index}"
        budget_part = "" if of_budget is None else f", {of_budget:.0%} of {whole}"
        title = f"{name}, tokens #{first}–{last}: {slots:.1f} slots per layer and KV head{budget_part}"
        parts.append(f'<span class="tshare t{index % 2}" style="flex-grow:{slots / held:.4f}" '
                     f'title="{html.escape(title)}"></span>')
    oldest = next((i for i, share in enumerate(shares) if share[0] > 0), None)
    first_turn = "" if oldest is None else (
        f"; the first turn holds {shares[oldest][2]:.1f} slots per layer and KV head")
    return (f'<div class="turnlegend">Budget by turn, oldest left ({len(shares)} parts){first_turn}:'
            f'</div><div class="turnshares">{"".join(parts)}</div>')


def maps_html(pieces: Sequence[str], stats: CacheStats, kv_heads: int,
              layer: int | None, head: int | None,
              max_tokens: int = MAX_MAP_TOKENS, note: str = "") -> tuple[str, str]:
    """Token map and heat map of a conversation (``pieces``: one string per token) for
    one layer and/or KV head (None: all); the token map shows the newest ``max_tokens``
    (``note``: why, if fewer than all)."""
    held = hold_matrix(stats, len(pieces), kv_heads)
    counts, total = hold_counts(select(held, layer, head))
    caption = (("all KV heads averaged" if head is None else f"KV head {head}")
               + " · layer 0 on top" + ("" if layer is None else f", layer {layer} outlined"))
    all_counts, everywhere = hold_counts(held)
    evicted = bool((all_counts[: stats.seen] < everywhere).any())
    shares = []
    if stats.turn_starts:
        shares = turn_shares(all_counts, everywhere, stats.turn_starts, stats.seen, stats.budget)
    return (token_map_html(pieces, counts, total, stats.seen, max_tokens, note),
            turn_shares_html(shares, stats.budget, stats.pinned)
            + heatmap_html(heat_rows(held, head), layer, caption,
                           layer_rows(held, head, stats.seen), _heat_legend(head),
                           blocks_note(stats.policy, stats.pinned, evicted)))


_PIECES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its TokenPieces


def token_pieces(tokenizer) -> TokenPieces:
    """The one ``TokenPieces`` of ``tokenizer``, which every view on it shares (its cache
    of decoded ids fills once per server)."""
    pieces = _PIECES.get(tokenizer)
    if pieces is None:
        pieces = _PIECES[tokenizer] = TokenPieces(tokenizer)
    return pieces


class TokenPieces:
    """The display text of token ids, decoded once per id: a long conversation's map is
    rebuilt several times a second, and most of its tokens repeat."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def __call__(self, ids: Sequence[int]) -> list[str]:
        """Each token's text decoded alone: a character split over several tokens shows
        as U+FFFD on each part. For tokens taken from anywhere (the forgotten ones)."""
        text = self._text
        for token in ids:
            if token not in text:
                text[token] = self._tokenizer.decode([token], skip_special_tokens=False,
                                                     clean_up_tokenization_spaces=False)
        return [text[token] for token in ids]

    def in_text(self, ids: Sequence[int]) -> list[str]:
        """The texts of consecutive tokens of a text: a character split over several
        shows whole on the first of them, and the others show nothing (decoded alone,
        each part showed U+FFFD: an emoji or a CJK character as two or three of them)."""
        singles = self(ids)
        if not any("\ufffd" in single for single in singles):
            return singles
        firsts, pieces = whole_pieces(self._tokenizer, ids, singles)
        shown = [""] * len(ids)
        for first, piece in zip(firsts, pieces):
            shown[first] = piece
        return shown
