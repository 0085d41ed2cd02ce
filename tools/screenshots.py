"""Retake the screenshots in assets/ from the real app after a few real turns, each view
three ways: light at 1366 px (``chat.png``), dark (``chat-dark.png``) and a 400 px wide
phone (``chat-400.png``): ``make screenshots`` or ``python -m tools.screenshots``."""

from __future__ import annotations

from pathlib import Path

from playwright.sync_api import Page, sync_playwright

from tests.browser_support import (
    ROOT, after_next_frame, chromium, configure, open_app, open_tab, running_app, send, set_number, show_settings,
    start_and_wait,
)

ASSETS = ROOT / "assets"
# Small budgets, so a few turns already show evicted tokens in the maps.
SAMPLING = dict(temperature=0.7, seed=7)


def prepare(page: Page, tab: str | None, **numbers: float) -> None:
    if tab:
        open_tab(page, tab)
    configure(page, **SAMPLING, **numbers)
    show_settings(page, False)


def chat(page: Page) -> None:
    prepare(page, None, heavy=24, recent=24, max_new_tokens=60)
    for message in ["Hi! Suggest a name for a lighthouse keeper's cat.",
                    "Nice. Write a two-line poem about that cat."]:
        send(page, "#chat-input", "#chat-send", message)


def story(page: Page) -> None:
    prepare(page, "Story", heavy=24, recent=24)
    page.fill("#story-bible textarea",
              "Mira: keeper of the lighthouse on Skarra island. Tomas: her younger brother, "
              "a fisherman. Odd: Mira's grey cat.")
    page.fill("#story-text textarea", "The storm reached Skarra at dusk, and Mira climbed "
                                      "the stairs to light the lamp.")
    set_number(page, "story-tokens", 70)
    for _ in range(2):
        start_and_wait(page, "#story-continue")


def compare(page: Page) -> None:
    prepare(page, "Compare", heavy=16, recent=16, max_new_tokens=40)
    for message in ["Name a fruit.", "What colour is it?", "Where does it grow?",
                    "Write one sentence about it."]:
        send(page, "#compare-input", "#compare-send", message)


# name suffix -> window width, height and colour scheme
LOOKS = {"": (1366, 900, "light"), "-dark": (1366, 900, "dark"), "-400": (400, 860, "light")}


def capture(page: Page, path: Path) -> None:
    """The whole page, its send rows in their places: on a phone they stick to the window's
    bottom, and a full-page capture drew them there, over the text, with their own place
    left blank."""
    page.add_style_tag(content="#chat-send-row, #story-continue-row, #compare-send-row "
                               "{ position: static !important; }")
    after_next_frame(page)
    page.screenshot(path=path, full_page=True)


def main() -> None:
    ASSETS.mkdir(exist_ok=True)
    with running_app() as url, sync_playwright() as playwright, chromium(playwright) as browser:
        for name, take in [("chat", chat), ("story", story), ("compare", compare)]:
            for suffix, (width, height, scheme) in LOOKS.items():
                page = open_app(browser, url, width=width, height=height, color_scheme=scheme)
                take(page)
                path = ASSETS / f"{name}{suffix}.png"
                capture(page, path)
                page.context.close()
                print(f"wrote {path}")


if __name__ == "__main__":
    main()
