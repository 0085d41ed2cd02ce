"""The small print under a view's replies: the settings its latest reply runs with.

Shown as the reply starts, from the values the turn itself took (not from the page's
controls), so what it says is what the model was asked to do: a user who set temperature
0 or a seed sees that the reply used them, and a test reads the same line (its data
attributes hold each value as the page's controls show it).
"""

from __future__ import annotations

import html
from typing import Any

import gradio as gr

from h2o_chat.config import CacheConfig

from .settings import budget

# For each view's gr.HTML (css_template, scoped to it): a line of small, subdued text.
RAN_WITH_CSS = """
.ran-with { font-size: 12px; line-height: 18px; min-height: 18px;
  color: var(--body-text-color-subdued); }
"""
NOTHING_YET = '<div class="ran-with"></div>'


def ran_with_line(prefix: str) -> gr.HTML:
    """The view's small print, ``#<prefix>-ran-with``: empty until its first reply."""
    return gr.HTML(NOTHING_YET, css_template=RAN_WITH_CSS, elem_id=f"{prefix}-ran-with")


def cache_budget(cache: CacheConfig) -> str:
    """The cache's budget in words: megabytes where the settings give them, else slots."""
    if cache.budget_mb is not None:
        return f"{cache.budget_mb:g} MB"
    slots = budget(cache)
    return "unbounded" if slots is None else f"{slots} slots"


def ran_with(sampling: dict[str, Any], cache: CacheConfig) -> str:
    """The small print of a reply sampled with ``sampling`` (``session.send``'s keyword
    arguments) on a cache of ``cache`` settings."""
    seed = "random" if sampling["seed"] is None else str(sampling["seed"])
    values = {"temperature": f"{sampling['temperature']:g}", "top-p": f"{sampling['top_p']:g}",
              "seed": seed, "max-new-tokens": str(sampling["max_new_tokens"]),
              "policy": cache.policy, "budget": cache_budget(cache)}
    data = " ".join(f'data-{name}="{html.escape(value)}"' for name, value in values.items())
    text = (f"Ran with temperature {values['temperature']} · top-p {values['top-p']} · "
            f"seed {seed} · up to {values['max-new-tokens']} new token{'' if sampling['max_new_tokens'] == 1 else 's'} · "
            f"{cache.policy} cache, {values['budget']}")
    return f'<div class="ran-with" {data}>{html.escape(text)}</div>'
