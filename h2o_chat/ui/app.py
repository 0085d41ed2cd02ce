"""The Gradio app: model status, shared settings and the chat, story and compare views."""

from __future__ import annotations

import gradio as gr

from h2o_chat.config import AppConfig

from .chat_tab import ChatTab
from .compare_tab import CompareTab
from .provider import ModelProvider
from .settings import Settings
from .story_tab import StoryTab

# System fonts: the default theme fetches Google Fonts, which an offline machine waits for.
THEME = gr.themes.Soft(font=["ui-sans-serif", "system-ui", "sans-serif"],
                       font_mono=["ui-monospace", "monospace"])
_STATUS_POLL_S = 1.0

INTRO = """# h2o-chat
A local chat whose KV cache stays within a fixed budget (H2O: attention sinks + heavy
hitters + recent tokens). The gauges and the retained-token map show what the cache holds
while tokens stream."""


def build_app(provider: ModelProvider, config: AppConfig) -> gr.Blocks:
    """The app's Blocks; pass ``THEME`` to ``launch``. ``provider`` may still be loading:
    the page shows its progress and handlers wait for it."""
    with gr.Blocks(title="h2o-chat") as demo:
        gr.Markdown(INTRO)
        status = gr.Markdown(provider.status(), elem_id="model-status")
        settings = Settings(config)
        with gr.Tabs():
            with gr.Tab("Chat", id="chat", elem_id="tab-chat"):
                chat = ChatTab(provider, settings, config)
            with gr.Tab("Story", id="story", elem_id="tab-story"):
                story = StoryTab(provider, settings, config)
            with gr.Tab("Compare", id="compare", elem_id="tab-compare"):
                compare = CompareTab(provider, settings, config)
        panels = [chat.map, story.map, compare.map]
        poll = gr.Timer(_STATUS_POLL_S)

        def refresh() -> dict:
            """Status line; once the model is up, the map pickers learn its shape and
            polling stops."""
            update = {status: provider.status()}
            if provider.ready:
                loaded = provider.get()
                update[poll] = gr.Timer(active=False)
                for panel in panels:
                    update |= panel.choices(loaded)
            return update

        outputs = [status, poll, *(picker for panel in panels for picker in panel.pickers)]
        poll.tick(refresh, None, outputs, show_progress="hidden")
        demo.load(refresh, None, outputs, show_progress="hidden")
    return demo
