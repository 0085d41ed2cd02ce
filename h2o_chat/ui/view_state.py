"""Per-browser state of a view: its sessions, one turn at a time, and map snapshots."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import gradio as gr

from h2o_chat.config import ServerConfig
from h2o_chat.runtime import LoadedModel, ModelProvider
from h2o_chat.sessions import Session, SessionStats

from .refusals import Refusal
from .streaming import MAP_INTERVAL_S, Throttle


def generating(server: ServerConfig) -> dict:
    """Event listener options of every handler that generates: they share one queue, so
    at most ``server.max_concurrent_generations`` run at once over all views and
    browsers, and the page shows a waiting turn its place in the queue."""
    return dict(concurrency_id="generation", concurrency_limit=server.max_concurrent_generations)


def browser_state(server: ServerConfig) -> gr.State:
    """A view's per-browser ``gr.State``: Gradio deletes it (closing the view) once idle for
    ``server.idle_release_minutes``; the app's unload handler deletes it when the tab
    closes. A turn renews it by returning the state."""
    return gr.State(None, delete_callback=close_state, time_to_live=server.idle_release_minutes * 60)


def unchanged(output: gr.components.Component) -> dict:
    """The update of a handler that has nothing to change. Not ``{}``: Gradio reads an
    empty dict as missing values and marks every output as failed."""
    return {output: gr.skip()}


def wait_for_model(provider: ModelProvider) -> LoadedModel:
    """The model, once loaded; a message in the page if loading failed."""
    try:
        return provider.get()
    except RuntimeError as err:
        raise Refusal(str(err)) from None


@dataclass(frozen=True)
class Snapshot:
    """A session's tokens and stats at one moment (read under the session's lock, between
    two of the worker's steps)."""

    tokens: list[int]
    stats: SessionStats

    @classmethod
    def of(cls, session: Session) -> Snapshot:
        return cls(*session.tokens_and_stats())


class ViewState:
    """Kept in a ``gr.State``: Gradio deletes it when the browser session ends, and its
    ``close`` (the state's delete callback) stops what still runs and lets go of the
    caches."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self._turn_lock = threading.Lock()
        self._last: Snapshot | None = None
        self.closed = False
        self.map_pace = Throttle(MAP_INTERVAL_S)  # when the live map may go out again
        _open_states.add(self)

    def sessions(self) -> list[Session]:
        raise NotImplementedError

    def map_session(self) -> Session:
        """The session the retained-token map shows."""
        return self.sessions()[0]

    @contextmanager
    def running(self) -> Iterator[None]:
        """Hold the view's turn: two turns (or a turn and an edit) never overlap."""
        # A plain Lock, not an RLock: Gradio may resume a generator in another thread.
        if not self._turn_lock.acquire(blocking=False):
            raise Refusal(STILL_STREAMING)
        try:
            yield
        finally:
            self._turn_lock.release()

    def take(self) -> Snapshot:
        """A fresh snapshot of the map's session (from any thread)."""
        self._last = Snapshot.of(self.map_session())
        return self._last

    def snapshot(self) -> Snapshot | None:
        """What the map can show now without touching a cache mid-forward: fresh when no
        turn runs, else the last snapshot the turn took (None before its first)."""
        if self._turn_lock.acquire(blocking=False):
            try:
                return self.take()
            finally:
                self._turn_lock.release()
        return self._last

    def forget_snapshot(self) -> None:
        """After the sessions are replaced, the last snapshot describes a dead cache."""
        self._last = None

    def stop(self) -> None:
        """End the running turn after its current token (any thread)."""
        for session in self.sessions():
            session.stop()

    def close(self) -> None:
        self.closed = True
        _open_states.discard(self)
        self.stop()

    @property
    def streaming(self) -> bool:
        return self._turn_lock.locked()


STILL_STREAMING = "A reply is still streaming: press Stop (or Esc) first."


def admit(server: ServerConfig, replacing: ViewState | None = None) -> None:
    """Refuse a new view state when pages hold ``server.max_page_conversations`` already
    (``replacing``, closed once the new one stands, not counted): every state holds its
    caches until its tab closes or it idles out."""
    held = sum(state is not replacing for state in list(_open_states))
    if held >= server.max_page_conversations:
        raise Refusal(f"The server holds {held} conversations open in pages, its limit "
                      f"(server.max_page_conversations): close a tab you no longer use, or wait until "
                      f"one idle for {server.idle_release_minutes:g} minutes is freed.")


def not_streaming(state: ViewState | None) -> None:
    """Refuse to replace a view's session while its reply streams: the page would go on
    showing the old conversation over the new one's session."""
    if state is not None and state.streaming:
        raise Refusal(STILL_STREAMING)


# Views not closed yet, for the page's server line. Weak: a state Gradio deleted without
# its callback (e.g. on a server error) must not stay counted or alive.
_open_states: weakref.WeakSet[ViewState] = weakref.WeakSet()


def server_load() -> tuple[int, int]:
    """Views open over all browsers, and how many of them run a turn now."""
    states = list(_open_states)
    return len(states), sum(state.streaming for state in states)


def close_state(state: ViewState | None) -> None:
    """``gr.State`` delete callback, and what resetting a view does to its old state."""
    if state is not None:
        state.close()


def stop_state(state: ViewState | None) -> None:
    if state is not None:
        state.stop()
