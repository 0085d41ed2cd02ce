"""What narrow and touch screens need beyond page.css: the secondary panels start folded,
the message boxes' placeholders leave out the keys, and a tap shows what was only a hover
tooltip (a token's hold count)."""

from __future__ import annotations

import json

import gradio as gr

# The views' secondary accordions (pin_panel, map_panel, fidelity_panel ids): open on a
# wide screen beside or below the conversation, on a phone they made the page 3,000 px
# tall.
FOLDED_WHEN_NARROW = ("chat-pins", "chat-map", "story-pins", "story-map",
                      "compare-plots", "compare-fidelity", "compare-map")
# The message boxes' placeholders get the keys that send and stop where the window is
# wide enough: at 390 px the whole line wrapped to two, and the message row that stays at
# the window's bottom grew by a line (and a phone has no Esc). Added to the short one on
# wide screens rather than cut on narrow ones: the box drawn with the page keeps the
# height of its first placeholder.
KEYS_HINT = ", Enter to send, Esc to stop"
MESSAGE_BOXES = ("chat-input", "compare-input")
# page.css's breakpoint for narrow screens (its media query says the same).
NARROW = "(max-width: 640px)"


def _blocks(demo: gr.Blocks, kind: type, elem_ids) -> list:
    found = [block for block in demo.blocks.values()
             if isinstance(block, kind) and block.elem_id in elem_ids]
    missing = set(elem_ids) - {block.elem_id for block in found}
    if missing:  # one renamed: say so, rather than leave it as it is on every screen
        raise ValueError(f"no {kind.__name__} to fit to the screen with the ids {sorted(missing)}")
    return found


def fit_screen_width(demo: gr.Blocks) -> None:
    """On page load, fold the ``FOLDED_WHEN_NARROW`` accordions if the window is narrow,
    and add ``KEYS_HINT`` to the ``MESSAGE_BOXES``' placeholders if it is not. Done as
    prop updates, not in the page: tabs build their panels only when first opened, and a
    header clicked while its tab is being built ignores the click."""
    folded = _blocks(demo, gr.Accordion, FOLDED_WHEN_NARROW)
    boxes = _blocks(demo, gr.Textbox, MESSAGE_BOXES)
    narrow = gr.Checkbox(False, visible=False)

    def fit(is_narrow: bool) -> list:
        if is_narrow:
            return [gr.Accordion(open=False) for _ in folded] + [gr.skip() for _ in boxes]
        return ([gr.skip() for _ in folded] +
                [gr.Textbox(placeholder=box.placeholder + KEYS_HINT) for box in boxes])

    demo.load(fit, narrow, folded + boxes, js=f"() => matchMedia({json.dumps(NARROW)}).matches",
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
