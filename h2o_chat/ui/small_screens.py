"""What narrow and touch screens need beyond page.css: the secondary panels start folded,
and a tap shows what was only a hover tooltip (a token's hold count)."""

from __future__ import annotations

import json

import gradio as gr

# The views' secondary accordions (pin_panel, map_panel, fidelity_panel ids): open on a
# wide screen beside or below the conversation, on a phone they made the page 3,000 px
# tall.
FOLDED_WHEN_NARROW = ("chat-pins", "chat-map", "story-pins", "story-map",
                      "compare-plots", "compare-fidelity", "compare-map")
# page.css's breakpoint for narrow screens (its media query says the same).
NARROW = "(max-width: 640px)"


def fold_when_narrow(demo: gr.Blocks) -> None:
    """On page load, fold the ``FOLDED_WHEN_NARROW`` accordions if the window is narrow.
    Done as a prop update, not by clicking their headers in the page: tabs build their
    panels only when first opened, and a header clicked while its tab is being built
    ignores the click."""
    folded = [block for block in demo.blocks.values()
              if isinstance(block, gr.Accordion) and block.elem_id in FOLDED_WHEN_NARROW]
    missing = set(FOLDED_WHEN_NARROW) - {block.elem_id for block in folded}
    if missing:  # a panel renamed: say so, rather than leave it open on phones
        raise ValueError(f"no accordion to fold on narrow screens with the ids {sorted(missing)}")
    narrow = gr.Checkbox(False, visible=False)

    def fold(is_narrow: bool) -> list:
        return [gr.Accordion(open=False) if is_narrow else gr.skip() for _ in folded]

    demo.load(fold, narrow, folded, js=f"() => matchMedia({json.dumps(NARROW)}).matches",
              queue=False, show_progress="hidden")


# Runs once in the page: a click or tap on a token of the retained-token map or the
# fidelity gauge's text shows its title (e.g. "#12: held by 85/90") in a tip beside it,
# until the next click elsewhere or a scroll.
TAP_SHOWS_TITLE = """() => {
  const tip = document.createElement("div");
  tip.id = "tap-tip";
  tip.setAttribute("role", "status");
  tip.hidden = true;
  document.body.append(tip);
  document.addEventListener("click", (event) => {
    const token = event.target instanceof Element
      && event.target.closest(".tokmap [title], .fidtext [title]");
    if (!token) { tip.hidden = true; return; }
    tip.textContent = token.title;
    tip.hidden = false;
    const box = token.getBoundingClientRect();
    tip.style.left = `${Math.max(4, Math.min(box.left, innerWidth - tip.offsetWidth - 4))}px`;
    const below = box.bottom + 4 + tip.offsetHeight <= innerHeight;
    tip.style.top = `${below ? box.bottom + 4 : box.top - tip.offsetHeight - 4}px`;
  });
  document.addEventListener("scroll", () => { tip.hidden = true; }, true);
}"""
