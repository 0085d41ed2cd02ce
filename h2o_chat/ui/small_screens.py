"""What narrow, short and touch screens need beyond page.css: the secondary panels start
folded, the message boxes' placeholders leave out the keys, a tap shows what was only a
hover tooltip (a token's hold count), and the row stuck to the window's bottom leaves the
view's conversation or story in view above it."""

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


# Runs once in the page: where a view's message or Continue row sticks to the window's
# bottom (page.css), the box it would cover is scrolled into view above it when the user
# turns to that view (its tab, or a tap on its box, message box or buttons). A page that
# does not fit the window scrolls its content under the row: at 320 x 568 the chat sat
# behind it whole, its reply streaming out of sight, and at 390 x 400 the story's text
# opened below the Continue row. Its top stays in the window, so a long story is shown
# from where it starts rather than scrolled past a tap.
REVEAL_ABOVE_ROW = """() => {
  const views = [["#chat-send-row", "#chatbot"], ["#story-continue-row", "#story-text"],
                 ["#compare-send-row", "#compare-full-chat"]];
  const reveal = () => {
    for (const [rowId, boxId] of views) {
      const row = document.querySelector(rowId), box = document.querySelector(boxId);
      if (!row?.checkVisibility() || !box?.checkVisibility()
          || getComputedStyle(row).position !== "sticky") continue;
      const { top, bottom } = box.getBoundingClientRect();
      const covered = bottom - (innerHeight - row.offsetHeight);
      if (covered > 0) scrollBy(0, Math.min(covered, top));
    }
  };
  document.addEventListener("focusin", (event) => {
    if (event.target.closest(views.flat().join())) reveal();
  });
  // A tab draws its view in the frame after the click (on its first opening, too).
  document.addEventListener("click", (event) => {
    if (event.target.closest("[role=tab]")) requestAnimationFrame(() => requestAnimationFrame(reveal));
  });
}"""
