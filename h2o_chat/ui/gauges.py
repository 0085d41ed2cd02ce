"""What the gauges show: slots, memory and speed of a session, read from its stats.

Plain data and HTML (no Gradio): a ``Gauge`` per session and update, per-turn series of
the compared caches for the line plots, and where two replies first differ.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd

from h2o_chat.config import MEGABYTE, Budget, CacheConfig
from h2o_chat.sessions import SessionStats

# For each gauge's gr.HTML (css_template, scoped to it). Text, greys and borders are the
# theme's variables, so the gauge reads in light and dark mode; the state's colour is a
# dot, not the text.
GAUGE_CSS = """
.gauge { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 8px 10px;
  font-size: 13px; color: var(--body-text-color); }
.gauge .glabel { font-weight: 600; margin-bottom: 2px; }
.gauge .gbar { height: 8px; background: var(--background-fill-secondary); border-radius: 4px;
  margin: 6px 0; }
.gauge .gbar div { height: 100%; border-radius: 4px; background: #2563eb; }
.gauge .gstate::before { content: "● "; color: #2563eb; }
.gauge[data-state="filling"] .gstate::before, .gauge[data-state="empty"] .gstate::before {
  color: #10b981; }
.gauge[data-state="full"] .gbar div { background: #d97706; }
.gauge[data-state="full"] .gstate::before { color: #d97706; }
.gauge .gnums { color: var(--body-text-color-subdued); margin-top: 4px; }
"""


@dataclass(frozen=True)
class Gauge:
    """One session's numbers at one moment, all from ``session.stats()``."""

    label: str
    tokens: int  # in the conversation
    seen: int  # fed to the cache
    held: int  # slots per layer and head
    pinned: int
    budget: int | None  # most slots held: the settings' budget + pinned (None: unbounded)
    kv_bytes: int  # allocated, room for incoming tokens included
    held_bytes: int  # of which the slots in use
    tokens_per_s: float
    prefill_seconds: float
    # Storage bits of keys and values (None: not known before the first token), and the
    # budget in bytes where the settings give one.
    key_bits: int | None = None
    value_bits: int | None = None
    budget_bytes: int | None = None
    exact_window: int = 0  # newest tokens also kept as given beside quantized slots

    @classmethod
    def of(cls, label: str, stats: SessionStats, tokens_per_s: float | None = None) -> Gauge:
        """``tokens_per_s`` overrides the session's own rate (e.g. its rate while it
        alone was computing, when two sessions take turns)."""
        cache = stats.cache
        return cls(
            label=label,
            tokens=stats.tokens,
            seen=cache.seen,
            held=cache.held,
            pinned=cache.pinned,
            budget=cache.budget,
            kv_bytes=cache.kv_bytes,
            held_bytes=cache.held_bytes,
            tokens_per_s=stats.decode_tokens_per_s if tokens_per_s is None else tokens_per_s,
            prefill_seconds=stats.prefill_seconds,
            key_bits=cache.key_bits,
            value_bits=cache.value_bits,
            budget_bytes=cache.budget_bytes,
            exact_window=cache.exact_window,
        )

    @property
    def kv_mb(self) -> float:
        return self.kv_bytes / MEGABYTE

    @property
    def state(self) -> str:
        """``empty`` (nothing fed yet), ``full`` (unbounded cache), ``filling`` (nothing
        evicted yet) or ``at-budget`` (evicting). Once evicting, a cache stays
        ``at-budget`` even when a new pin leaves it a few slots short of its limit."""
        if self.seen == 0:
            return "empty"
        if self.budget is None:
            return "full"
        return "at-budget" if self.evicted or self.held >= self.budget else "filling"

    @property
    def evicted(self) -> int:
        """Tokens each layer and head has evicted so far."""
        return self.seen - self.held


def empty_gauge(label: str, budget: int | None, cache: CacheConfig | None = None) -> str:
    """The gauge of a session not started yet, with ``cache``'s bits and byte budget where given."""
    planned = {} if cache is None else {
        "key_bits": cache.key_bits, "value_bits": cache.value_bits, "exact_window": cache.exact_window,
        "budget_bytes": None if cache.budget_mb is None else Budget.of_megabytes(cache.budget_mb).bytes}
    return gauge_html(Gauge(label, 0, 0, 0, 0, budget, 0, 0, 0.0, 0.0, **planned))


def _state_line(g: Gauge) -> str:
    waiting = g.tokens - g.seen
    if g.state == "empty":
        if waiting:
            return f"nothing fed yet: {waiting} tokens are read on the next send"
        return "budget not reached yet: the cache is empty"
    if g.state == "full":
        return "full cache: keeps every token, so memory grows with the conversation"
    if g.state == "filling":
        return (f"budget not reached yet: nothing evicted, {g.budget - g.held} slots free "
                "(the cache grows until then)")
    return (f"at budget: {g.evicted} tokens evicted per layer and head so far; "
            "memory stays flat from here on")


# The gauge's terms in plain words, as tooltips of its lines.
_COUNTS_PLAIN = ("tokens seen: read by the model so far; a slot holds one token in the "
                 "model's memory (in every layer); budget: the most slots kept (sink + "
                 "heavy + recent); text you pin comes on top")
_MEMORY_PLAIN = ("KV cache: the memory holding each kept token's keys and values; bits: how "
                 "precisely each is stored; prefill: the time to read the prompt before the first new token")


def gauge_html(g: Gauge) -> str:
    """The token counter (seen vs held vs budget), its state in words, memory and speed.
    The numbers are also ``data-*`` attributes, for tests and scripts."""
    # "Budget" is the settings' one everywhere: in slots (sink + heavy + recent), pins come
    # on top; in bytes, pins take their slots from it, so the count stays the one shown
    # before the conversation began (it showed 88 slots, then 67 + 21 pinned).
    pinned = ""
    if g.budget is None:
        # A budget in bytes has no slot count until the model that sets a token's bytes is known.
        budget = "∞" if g.budget_bytes is None else f"{g.budget_bytes / MEGABYTE:g} MB"
    elif g.budget_bytes is None:
        budget = str(g.budget - g.pinned)
        pinned = f" + <b>{g.pinned}</b> pinned" if g.pinned else ""
    else:
        budget = f"{g.budget} ({g.budget_bytes / MEGABYTE:g} MB)"
        pinned = f", <b>{g.pinned}</b> of them pinned" if g.pinned else ""
    budget_attr = "" if g.budget is None else str(g.budget)
    bits = "" if g.key_bits is None else f" · keys {g.key_bits}-bit, values {g.value_bits}-bit"
    if bits and g.exact_window:
        bits += f", newest {g.exact_window} exact"
    if g.seen == 0:
        fill = 0.0
    else:
        fill = 100.0 if g.budget is None else min(100.0, 100.0 * g.held / max(g.budget, 1))
    return (
        f'<div class="gauge" data-state="{g.state}" data-tokens="{g.tokens}" '
        f'data-seen="{g.seen}" data-held="{g.held}" data-budget="{budget_attr}" '
        f'data-kv-bytes="{g.kv_bytes}" data-held-bytes="{g.held_bytes}" '
        f'data-budget-bytes="{g.budget_bytes or ""}" data-key-bits="{g.key_bits or ""}" '
        f'data-value-bits="{g.value_bits or ""}" data-exact-window="{g.exact_window}" '
        f'data-tps="{g.tokens_per_s:.2f}">'
        f'<div class="glabel">{html.escape(g.label)}</div>'
        f'<div title="{_COUNTS_PLAIN}">'
        f"<b>{g.seen}</b> tokens seen · <b>{g.held}</b> slots held · budget <b>{budget}</b>{pinned}</div>"
        f'<div class="gbar"><div style="width:{fill:.1f}%"></div></div>'
        f'<div class="gstate">{_state_line(g)}</div>'
        f'<div class="gnums" title="{_MEMORY_PLAIN}">'
        f"KV cache <b>{g.kv_mb:.2f} MB</b> ({g.held_bytes / MEGABYTE:.2f} MB in use){bits} · "
        f"<b>{g.tokens_per_s:.1f}</b> tokens/s decoding · prefill {g.prefill_seconds:.2f} s</div>"
        "</div>"
    )


MEMORY, SLOTS = "KV MB in use", "slots held"  # the series' columns, the plots' y axes


@dataclass
class TurnSeries:
    """KV memory in use and slots held per turn of several caches, for the line plots. A
    turn recorded again replaces its rows. Turns are labels rather than numbers, so the
    axis never shows a turn 1.5; ``order`` sorts them."""

    rows: list[dict] = field(default_factory=list)

    def record(self, turn: int, gauges: Sequence[Gauge]) -> None:
        label = str(turn)
        self.rows = [row for row in self.rows if row["turn"] != label]
        # The bytes in use, not the allocated ones: they are what stays flat once the
        # bounded cache is at budget (as its gauge says), while the allocation moves with
        # the room reserved for incoming tokens.
        self.rows += [
            {"turn": label, "cache": g.label, MEMORY: round(g.held_bytes / MEGABYTE, 3), SLOTS: g.held}
            for g in gauges
        ]

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=["turn", "cache", MEMORY, SLOTS])

    def order(self) -> list[str]:
        return sorted({row["turn"] for row in self.rows}, key=int)

