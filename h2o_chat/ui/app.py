"""The Gradio app: model status, shared settings and the chat, story and compare views."""

from __future__ import annotations

import gc
from pathlib import Path

import gradio as gr

from h2o_chat.config import AppConfig, ServerConfig
from h2o_chat.engine.memory import return_freed_memory
from h2o_chat.runtime import ModelProvider

from .chat_box import COPY_AS_TYPED
from .chat_tab import ChatTab
from .compare_tab import CompareTab
from .controls import ESC_STOPS, ONE_CLICK_SENDS_OR_STOPS, SendStopSwap, ended_either_way
from .files_panel import FILES_KEPT_S
from .reload_notice import say_when_reloaded
from .settings import Settings
from .small_screens import REVEAL_ABOVE_ROW, TAP_SHOWS_TITLE, fit_screen_width
from .story_tab import STORY_BOX_WHILE_STREAMING, StoryTab
from .view_state import ViewState, server_load

# System fonts: the default theme fetches Google Fonts, which an offline machine waits for.
THEME = gr.themes.Soft(font=["ui-sans-serif", "system-ui", "sans-serif"],
                       font_mono=["ui-monospace", "monospace"])
# Rules for the page as a whole (Gradio's own components, narrow screens); each custom
# HTML component keeps its own scoped css_template.
PAGE_CSS = (Path(__file__).parent / "page.css").read_text()
_STATUS_POLL_S = 1.0
_LOAD_POLL_S = 5.0  # every open tab polls; rarely, so many tabs cost the server little
# While a view of the tab itself generates: each poll is an event the page runs, and at
# 0.5 s the page's main thread was busy 0.28 of a core while a reply streamed here, 0.24
# at 1 s, 0.21 without the poll (docs/benchmarks.md, "The app on a small CPU").
_BUSY_LOAD_POLL_S = 1.0

# One line: the views below must leave their input in view on a 768 px high screen.
INTRO = ("**h2o-chat** · a local chat whose KV cache stays within a fixed budget (H2O: "
         "attention sinks + heavy hitters + recent tokens); the gauges and the retained-token "
         "map show what the cache holds while tokens stream.")


def build_app(provider: ModelProvider, config: AppConfig) -> gr.Blocks:
    """The app's Blocks; mount them with ``launch_options``. ``provider`` may still be loading:
    the page shows its progress and handlers wait for it."""
    # Gradio's copies of uploads and downloads go an hour after they were made.
    with gr.Blocks(title="h2o-chat", delete_cache=(600, FILES_KEPT_S)) as demo:
        gr.Markdown(INTRO)
        status = gr.Markdown(model_status(provider), elem_id="model-status")
        say_when_reloaded(demo)
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
            update = {status: model_status(provider)}
            if provider.ready:
                loaded = provider.get()
                update[poll] = gr.Timer(active=False)
                for panel in panels:
                    update |= panel.choices(loaded)
            return update

        outputs = [status, poll, *(picker for panel in panels for picker in panel.pickers)]
        poll.tick(refresh, None, outputs, show_progress="hidden")
        demo.load(refresh, None, outputs, show_progress="hidden")

        follow_server_load(demo, config.server, [chat.swap, story.swap, compare.swap])

        def release(request: gr.Request) -> None:
            """A closed tab frees its views now, not after Gradio's one-hour grace."""
            demo.state_holder.delete_state(request.session_hash)
            gc.collect()
            return_freed_memory()

        demo.unload(release)
        settings.load_in_page(demo)
        fit_screen_width(demo)
        for script in (ESC_STOPS, ONE_CLICK_SENDS_OR_STOPS, TAP_SHOWS_TITLE, REVEAL_ABOVE_ROW,
                       STORY_BOX_WHILE_STREAMING, COPY_AS_TYPED):
            demo.load(None, js=script)
    return demo


def model_status(provider: ModelProvider) -> str:
    """One line of Markdown for the page: loading, ready or failed."""
    if provider.failure is not None:
        return f"**The model cannot be used:** {provider.failure}"
    if not provider.ready:
        return f"**Loading the model…** ({provider.loading_seconds:.0f} s so far)"
    m = provider.get()
    return (f"Model ready: **{m.name}** · {m.layers} layers × {m.kv_heads} KV heads · "
            f"loaded in {m.load_seconds:.1f} s")


START_TIMER = """() => ({__type__: "update", active: true})"""


def follow_server_load(demo: gr.Blocks, server: ServerConfig, swaps: list[SendStopSwap]) -> None:
    """The server line: polled rarely, for other browsers' turns; often from the moment
    one of this page's views (given by their ``swaps``) is asked for a turn until the
    turn ends; and once more then. A turn's own updates cannot carry the line (a view
    knows nothing of the page around it), and when a turn gets the model depends on its
    place in the queue, which the page does not see: hence the fast poll. Only the few
    pages that generate or wait to poll often; an idle page costs the server what it
    did before."""
    line = gr.Markdown(elem_id="server-load")
    busy_poll = gr.Timer(_BUSY_LOAD_POLL_S, active=False)
    options = dict(show_progress="hidden", concurrency_limit=None)
    for event in (demo.load, gr.Timer(_LOAD_POLL_S).tick, busy_poll.tick):
        event(lambda: server_line(server), None, line, **options)
    states = [swap.state for swap in swaps]

    def after_turn(*views: ViewState | None) -> tuple[str, gr.Timer]:
        """The line now; the fast poll goes on while another view of the page generates."""
        running = any(view is not None and view.streaming for view in views)
        return server_line(server), gr.Timer(active=running)

    for swap in swaps:
        # In the page, as the swap: a server's answer could come after the turn ended.
        swap.started.then(None, None, busy_poll, js=START_TIMER, queue=False, show_progress="hidden")
        for turn in swap.turns:  # "multiple": see ``SendStopSwap.until``
            for ended in ended_either_way(turn):
                ended(after_turn, states, [line, busy_poll], trigger_mode="multiple", **options)


def server_line(server: ServerConfig) -> str:
    """How busy the one model is, for every browser to see."""
    views, streaming = server_load()
    return (f"Server: {views} conversation{'s' * (views != 1)} open · {streaming} generating "
            f"(at most {server.max_concurrent_generations} at once; more wait in a queue)")


def launch_options(server: ServerConfig) -> dict:
    """``gr.mount_gradio_app`` keyword arguments: the page's look, upload limit and login
    (the HTTP shell adds the middleware in front of it, ``api.page_guards``)."""
    max_bytes = server.max_request_mb * 2**20
    return dict(
        theme=THEME, css=PAGE_CSS,
        server_name=server.host, server_port=server.port,
        auth=(server.username, server.password) if server.username is not None else None,
        max_file_size=max_bytes,
    )
