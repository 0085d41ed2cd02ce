"""The "Save / load" accordion of the chat and story views.

Chat: download the conversation (JSON, Markdown), import a conversation (JSON; a fresh
cache reads it on the next send), save the session with its cache and resume one. Story:
save and resume. The formats are ``h2o_chat.sessions.transcripts`` (a conversation's text)
and ``h2o_chat.sessions.files`` (a session with its cache); a refused file shows a warning and an error line, and the view keeps its session. A session
file refused for its cache settings alone lists every difference and offers to take the
file's settings into the page's controls and resume it.

The views build a panel inside their layout and call ``wire`` with their components;
the view's state class comes in as an argument, so this module does not import the
views.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gradio as gr

from h2o_chat.inputs import InputLimits
from h2o_chat.config import CacheConfig, for_story
from h2o_chat.engine.state import describe_differences, settings_differences
from h2o_chat.sessions.files import SUFFIX, SettingsMismatch, SnapshotError, load_session, save_session
from h2o_chat.sessions.transcripts import Transcript, TranscriptError, read_transcript

from .refusals import Refusal, markdown_literal, warn
from .settings import new_cache
from .view_state import ViewState, admit, close_state, not_streaming, wait_for_model

# Conversations larger than this are refused before they are read. Session files are
# bounded by the server's request limit (server.max_request_mb): one of the default
# budget (260 slots + the system prompt) takes about 13 MB, a full cache of 8k tokens
# about 390 MB.
MAX_CONVERSATION_BYTES = 5 * 1024**2

# Files offered for download; Gradio serves them from its own copy, and the folder goes
# when the app exits.
_EXPORTS = tempfile.TemporaryDirectory(prefix="h2o-chat-files-")
# How long a download or an upload stays on disk (Gradio's copies too: app.py), so that a
# server up for weeks does not fill its disk, or a memory-backed /tmp, with them.
FILES_KEPT_S = 3600


def export_path(kind: str, suffix: str) -> Path:
    """A new file path for a download, named after the view and the time; downloads
    written more than ``FILES_KEPT_S`` ago go."""
    too_old = time.time() - FILES_KEPT_S
    for folder in Path(_EXPORTS.name).iterdir():
        if folder.stat().st_mtime < too_old:
            shutil.rmtree(folder, ignore_errors=True)
    folder = tempfile.mkdtemp(dir=_EXPORTS.name)
    return Path(folder) / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}{suffix}"


def checked_upload(path: str | None, limit: int, suffix: str) -> Path:
    """The uploaded file, refused unless its name ends in ``suffix`` and it fits ``limit``.
    Checked here, not by the upload button's ``file_types``: the page refused a file of
    another type itself, with an error toast of its own and no word in the status line."""
    if not path:
        raise Refusal("no file was uploaded")
    name = Path(path).name  # Gradio keeps the uploaded file's name
    if not name.lower().endswith(suffix):
        raise Refusal(f"{name} is not a {suffix} file")
    size = os.path.getsize(path)
    if size > limit:
        raise Refusal(f"the file has {size:,} bytes, over the upload limit of {limit:,} bytes")
    return Path(path)


class FilesPanel:
    """What both views share: the accordion, save and resume. ``kind`` is the session
    kind ("chat" or "story"), also the prefix of the element ids."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        with gr.Accordion("Save / load", open=False, elem_id=f"{kind}-files"):
            self._build()
            self.save = gr.Button("Save session (with its cache)", elem_id=f"{kind}-save-session")
            self.resume = gr.UploadButton("Resume session…", elem_id=f"{kind}-resume-session")
            self.download = gr.File(label="Download", interactive=False,
                                    elem_id=f"{kind}-download")
            self.status = gr.Markdown(elem_id=f"{kind}-files-status")
            self.adopt = gr.Button("Use the file's settings and resume", visible=False,
                                   variant="primary", elem_id=f"{kind}-adopt-settings")
            # The session file last refused for its cache settings: (path, differences).
            self.mismatched = gr.State(None)
            gr.Markdown(f"A session file (`*{SUFFIX}`) holds the {kind} and its compressed "
                        "cache: resuming it continues exactly where it was saved. It needs the "
                        "same model and cache settings; the page offers to take the file's.")

    def _build(self) -> None:
        """The view's own controls, above save and resume."""

    def wire(self, tab: Any, state_type: type[ViewState]) -> None:
        """Connect to ``tab``'s state, settings, gauge, map and pins; ``state_type`` builds
        the view's per-browser state."""
        self.tab, self.state_type = tab, state_type
        self.save.click(self.on_save, {tab.state}, [self.download, self.status])
        self.view_inputs = {tab.state, tab.map.live, *tab.settings.components, *tab.map.pickers}
        self.view_outputs = [tab.state, tab.gauge, *tab.map.outputs, *tab.pins.outputs,
                             self.status]
        resumed = self.view_outputs + self._session_outputs() + [self.adopt, self.mismatched]
        self.resume.upload(self.on_resume, {self.resume, *self.view_inputs}, resumed)
        self.adopt.click(self.on_adopt, {self.mismatched, *self.view_inputs},
                         resumed + list(tab.settings.cache_controls.values()))

    # ---- handlers -------------------------------------------------------------------------

    def on_save(self, values: dict) -> dict:
        state = values[self.tab.state]
        if state is None:
            return self._refused(f"nothing to save yet: start a {self.kind} first", "Not saved")
        try:
            with state.running():
                path = save_session(state.session, export_path(self.kind, SUFFIX))
                stats = state.session.stats()
        except Refusal as err:  # a reply streams
            return self._refused(str(err), "Not saved")
        return {self.download: str(path),
                self.status: f"Saved {stats.tokens} tokens with {stats.cache.held} cache slots "
                             f"per layer and head ({path.stat().st_size / 1024**2:.1f} MB)."}

    def on_resume(self, values: dict) -> dict:
        try:
            path = checked_upload(values[self.resume], self.tab.server.max_request_mb * 2**20, ".zip")
            return self._resumed(values, path, self.tab.settings.cache(values), "Resumed")
        except SettingsMismatch as mismatch:
            return self._mismatched(values, mismatch)
        except (Refusal, SnapshotError) as err:
            return self._refused(str(err)) | self._no_adopt()

    def on_adopt(self, values: dict) -> dict:
        """Set the cache controls to the refused file's settings and resume it."""
        if values[self.mismatched] is None:
            return (self._refused("no session file to resume: choose one with Resume session")
                    | self._no_adopt())
        path, differences = values[self.mismatched]
        try:
            adopted = self.tab.settings.adopt(values, differences, wait_for_model(self.tab.provider).model)
            outcome = f"Resumed with the file's cache settings ({adopted.summary})"
            return self._resumed(values, path, adopted.cache, outcome) | adopted.updates
        except (Refusal, SnapshotError) as err:
            return self._refused(str(err)) | self._no_adopt()

    # ---- what the views fill in -----------------------------------------------------------

    def _session_outputs(self) -> list:
        """The view's components that show a session (besides gauge and map)."""
        raise NotImplementedError

    def _new_state(self, loaded, cache, session) -> ViewState:
        """The view's state for a resumed ``session`` (replaced into it afterwards)."""
        raise NotImplementedError

    def _shown(self, state: ViewState) -> dict:
        """Updates of ``_session_outputs`` showing ``state``."""
        raise NotImplementedError

    def _runs_with(self, cache: CacheConfig) -> CacheConfig:
        """The settings the view's sessions run with, from the page's."""
        return cache

    # ---- helpers --------------------------------------------------------------------------

    def _resumed(self, values: dict, path: Path, cache: CacheConfig, outcome: str) -> dict:
        """Resume the session file at ``path`` on a fresh cache of ``cache`` settings, in
        place of the view's session; SnapshotError or Refusal if it cannot be."""
        not_streaming(values[self.tab.state])
        admit(self.tab.server, values[self.tab.state])
        loaded = wait_for_model(self.tab.provider)
        session = load_session(path, loaded.model, loaded.tokenizer, new_cache(loaded.model, self._runs_with(cache)),
                               kind=self.kind, prefill_chunk_size=cache.prefill_chunk_size,
                               limits=InputLimits.of(self.tab.server), memory=loaded.memory)
        state = self._new_state(loaded, cache, session)
        state.session = session
        close_state(values[self.tab.state])
        stats = session.stats()
        return ({self.tab.state: state,
                 self.status: f"{outcome}: {stats.tokens} tokens, {stats.cache.held} cache slots."}
                | self._shown(state) | self._views(values, state) | self._no_adopt())

    def _mismatched(self, values: dict, mismatch: SettingsMismatch) -> dict:
        """Refuse a file of other cache settings, naming every difference; offer to
        adopt them where the page can set them all and they make a cache the model can
        hold (the same check as adopting them)."""
        differences, model = mismatch.differences, wait_for_model(self.tab.provider).model
        page = self.tab.settings.cache(values)
        if self._runs_with(page) != page:
            # The view ran the page's settings changed (a story runs turns as h2o): name
            # and adopt the differences with what the controls say, not with what ran.
            differences = settings_differences(mismatch.saved, new_cache(model, page).settings())
        message = ("this session was saved with other cache settings: "
                   + describe_differences(differences, "in the file", "on the page"))
        try:
            self.tab.settings.adopt(values, differences, model)
        except Refusal as why:
            return self._refused(f"{message}; {why}") | self._no_adopt()
        return (self._refused(f"{message}. Set the cache settings to the file's, or use the file's settings "
                              "with the button below.")
                | {self.adopt: gr.update(visible=True),
                   self.mismatched: (str(values[self.resume]), differences)})

    def _no_adopt(self) -> dict:
        return {self.adopt: gr.update(visible=False), self.mismatched: None}

    def _views(self, values: dict, state: ViewState) -> dict:
        """The view's gauge, map and pin list, as at the end of a turn."""
        return self.tab.views(values, state, True)

    def _refused(self, message: str, outcome: str = "Not loaded") -> dict:
        """Tell the user, change nothing else (the view keeps its session)."""
        warn(message)
        return {self.status: f"**{outcome}:** {markdown_literal(message)}"}


def _imported(count: int) -> str:
    if count == 1:
        return "Imported 1 message; it is read into a fresh cache on the next send."
    return f"Imported {count} messages; they are read into a fresh cache on the next send."


class ChatFiles(FilesPanel):
    def __init__(self) -> None:
        super().__init__("chat")

    def _build(self) -> None:
        with gr.Row():
            self.export_json = gr.Button("Conversation as JSON", elem_id="chat-export-json")
            self.export_markdown = gr.Button("Conversation as Markdown", elem_id="chat-export-markdown")
            self.import_json = gr.UploadButton("Import conversation (JSON)…", elem_id="chat-import-json")

    def wire(self, tab: Any, state_type: type[ViewState]) -> None:
        super().wire(tab, state_type)
        self.export_json.click(self.on_export_json, {tab.state}, [self.download, self.status])
        self.export_markdown.click(self.on_export_markdown, {tab.state}, [self.download, self.status])
        self.import_json.upload(self.on_import, {self.import_json, *self.view_inputs},
                                self.view_outputs + self._session_outputs() + [self.adopt, self.mismatched])

    def on_export_json(self, values: dict) -> dict:
        return self._export(values, Transcript.to_json, ".json")

    def on_export_markdown(self, values: dict) -> dict:
        return self._export(values, Transcript.to_markdown, ".md")

    def _export(self, values: dict, render: Callable[[Transcript], str], suffix: str) -> dict:
        state = values[self.tab.state]
        if state is None:
            return self._refused("nothing to export yet: start a chat first", "Not exported")
        try:
            with state.running():
                transcript = Transcript.of(state.session)
        except Refusal as err:  # a reply streams
            return self._refused(str(err), "Not exported")
        path = export_path("chat", suffix)
        path.write_text(render(transcript), encoding="utf-8")
        return {self.download: str(path), self.status: f"Exported {len(transcript.messages)} messages."}

    def on_import(self, values: dict) -> dict:
        try:
            not_streaming(values[self.tab.state])
            admit(self.tab.server, values[self.tab.state])
            path = checked_upload(values[self.import_json], MAX_CONVERSATION_BYTES, ".json")
            transcript = read_transcript(path.read_bytes(), InputLimits.of(self.tab.server))
            loaded = wait_for_model(self.tab.provider)
            state = self.state_type(loaded, self.tab.settings.cache(values),
                                    transcript.system_prompt or "", InputLimits.of(self.tab.server))
            state.rebuild(transcript.messages)
            # Else every send after it is refused: no message could ever be answered.
            state.session.check_room(0, "the imported messages alone")
        except (Refusal, TranscriptError) as err:
            return self._refused(str(err))
        except ValueError as err:  # the session refused the history (e.g. a message too long)
            return self._refused(f"conversation file: {err}")
        close_state(values[self.tab.state])
        return ({self.tab.state: state,
                 self.status: _imported(len(transcript.messages))}
                | self._shown(state) | self._views(values, state) | self._no_adopt())

    def _session_outputs(self) -> list:
        return [self.tab.chatbot, self.tab.system_prompt]

    def _new_state(self, loaded, cache, session) -> ViewState:
        system = next((m["content"] for m in session.messages if m["role"] == "system"), "")
        return self.state_type(loaded, cache, system, InputLimits.of(self.tab.server))

    def _shown(self, state: ViewState) -> dict:
        return {self.tab.chatbot: state.shown(), self.tab.system_prompt: state.system_prompt}


class StoryFiles(FilesPanel):
    def __init__(self) -> None:
        super().__init__("story")

    def _session_outputs(self) -> list:
        return [self.tab.bible, self.tab.story]

    def _new_state(self, loaded, cache, session) -> ViewState:
        # The bible box shows the bible without the blank line the view adds after it.
        bible = session.decode(session.tokens[: session.bible_tokens]).strip()
        return self.state_type(loaded, cache, bible, InputLimits.of(self.tab.server))

    def _shown(self, state: ViewState) -> dict:
        return {self.tab.bible: state.bible, self.tab.story: state.session.text}

    def _runs_with(self, cache: CacheConfig) -> CacheConfig:
        return for_story(cache)
