"""Saving a chat or story session with its compressed cache, and resuming it later.

One file per session, a zip archive (``*.h2o-session.zip``, members stored
uncompressed) holding:

- ``cache.safetensors``: the cache's tensors (``H2OCache.state``): per layer the held
  slots' keys, values, accumulated scores, positions and flags; and ``tokens``, the
  conversation's token ids. No pickle anywhere.
- ``manifest.json``: format and version, the model's name and weight fingerprint, the
  cache settings (policy, budgets, rolling), protected spans and per-layer counters, the
  session kind and ``fed``, the chat messages (chat) or bible length (story).
- ``sha256``: the hex sha256 of ``manifest.json``, a NUL byte and ``cache.safetensors``,
  so an edit of either is caught.

Resuming builds a new session on a fresh cache and restores the cache exactly, scores
included, so the next logits and every later eviction equal those of the session that
was saved. A file is refused (``SnapshotError``) when it is truncated or corrupted, of
an unknown version, from another model, from other cache settings than the cache it is
resumed into, or when anything in it is out of the limits (``h2o_chat.inputs``): every
number is checked before memory is allocated for it.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..cache_memory import CacheMemory
from ..config import CacheConfig, quoted
from ..engine.cache import H2OCache
from ..engine.state import SettingDifference, describe_differences, settings_differences
from ..inputs import InputError, InputLimits, read_json, read_member, refused_as, require_int
from ..inputs.session_file import (MANIFEST, TENSORS, check_cache_state, check_template_text,
                                   check_tokens, max_story_tokens)
from ..inputs.text import check_chars
from .base import Session
from .chat import ChatSession
from .story import StorySession

FORMAT = "h2o-chat/session"
VERSION = 2  # 1 hashed the tensors only, and kept the tokens in the manifest
SUFFIX = ".h2o-session.zip"
CHECKSUM = "sha256"
# Refused before reading: a session of the default budget takes about 13 MB, a full
# cache of 8k tokens of the embedded model about 390 MB.
MAX_BYTES = 2 * 1024**3


class SnapshotError(InputError):
    """A session file that cannot be resumed here; the message says why."""

    def __init__(self, message: str, field: str = "session file") -> None:
        super().__init__(message, field)


class SettingsMismatch(SnapshotError):
    """A session file saved with other cache settings than the cache it was resumed
    into; ``differences`` holds every setting that differs, ``saved`` the file's settings."""

    def __init__(self, differences: list[SettingDifference], saved: Mapping[str, Any]) -> None:
        self.differences, self.saved = differences, dict(saved)
        super().__init__(f"{describe_differences(differences, 'in the file', 'in this cache')}: "
                         "change the cache settings to the file's to resume it")


def _checksum(manifest: bytes, payload: bytes) -> str:
    # JSON never holds a raw NUL, so the separator keeps the two members apart.
    return hashlib.sha256(manifest + b"\0" + payload).hexdigest()


def model_identity(model) -> dict[str, str]:
    """The model's name (informational) and a fingerprint that tells models apart.

    The fingerprint hashes every parameter's and buffer's name, shape and dtype and a
    strided sample of about 1024 of its values (milliseconds, unlike hashing every
    weight): another architecture, checkpoint, fine-tune, dtype or RoPE scaling differs.
    """
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        # Indexed in logical order, so the layout a loader chose does not change the
        # fingerprint, and a column-major weight is not copied whole to be sampled.
        step = max(1, tensor.numel() // 1024)
        positions = torch.arange(0, tensor.numel(), step, device=tensor.device)
        sample = tensor.detach()[torch.unravel_index(positions, tensor.shape)].reshape(-1)
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(sample.view(torch.uint8).cpu().numpy().tobytes())
    name = model.config.name_or_path
    return {"name": Path(name).name if name else model.config.model_type, "fingerprint": digest.hexdigest()}


def _manifest(session: Session) -> tuple[dict[str, Any], bytes]:
    """The manifest and tensor payload that describe ``session`` now."""
    tensors, cache_state = session.cache.state()
    payload = save_tensors(tensors | {"tokens": torch.tensor(session.tokens, dtype=torch.int32)})
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "model": model_identity(session.model),
        "cache": cache_state,
        "fed": session.fed,
    }
    if isinstance(session, ChatSession):
        return manifest | {"kind": "chat", "messages": [dict(m) for m in session.messages],
                           "template_text": session.template_text}, payload
    if isinstance(session, StorySession):
        return manifest | {"kind": "story", "bible_tokens": session.bible_tokens}, payload
    raise TypeError(f"cannot save a {type(session).__name__}")


def save_session(session: Session, path: str | Path) -> Path:
    """Write ``session`` with its cache to ``path``; refused while a turn is running."""
    try:
        with session.between_turns("save"):
            manifest, payload = _manifest(session)
    except RuntimeError as err:  # a turn is running
        raise SnapshotError(f"{err}, or wait, then save") from None
    return write_session_file(path, json.dumps(manifest, ensure_ascii=False).encode(), payload)


def write_session_file(path: str | Path, manifest: bytes, payload: bytes) -> Path:
    """The session file of a manifest's and a payload's bytes, with their checksum."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")  # renamed when complete: never half a file
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(MANIFEST, manifest)
        archive.writestr(TENSORS, payload)
        archive.writestr(CHECKSUM, _checksum(manifest, payload))
    partial.replace(path)
    return path


def read_manifest(path: str | Path, limits: InputLimits | None = None) -> tuple[dict[str, Any], bytes]:
    """The manifest and the tensor payload of a session file, checked for integrity and
    version (not yet against a model or cache); the manifest's size is bounded by what a
    conversation within ``limits`` needs."""
    limits = limits or InputLimits()
    members = {MANIFEST: limits.document_bytes, TENSORS: MAX_BYTES, CHECKSUM: 64}
    try:
        with zipfile.ZipFile(path) as archive, refused_as(SnapshotError):
            names = sorted(archive.namelist())
            if names != sorted(members):
                raise SnapshotError(f"not a session file: it holds {_short_list(names)}, expected "
                                    f"{sorted(members)} (files of version 1 cannot be resumed: they "
                                    "lack the checksum of their manifest)")
            manifest_bytes, payload, checksum = (read_member(archive, name, cap, "session file")
                                                 for name, cap in members.items())
    except zipfile.BadZipFile as err:
        if "CRC" in str(err):
            raise SnapshotError(f"session file is corrupted ({err})") from None
        raise SnapshotError(f"not a session file, or the file is truncated ({err})") from None
    except (EOFError, zlib.error) as err:
        raise SnapshotError(f"session file is truncated or corrupted ({err})") from None
    if checksum != _checksum(manifest_bytes, payload).encode():
        raise SnapshotError(f"session file is corrupted or was edited: {MANIFEST} and {TENSORS} do "
                            f"not match the sha256 in {CHECKSUM}", CHECKSUM)
    with refused_as(SnapshotError):
        manifest = read_json(manifest_bytes, MANIFEST, limits.document_bytes, limits.document_values)
    if not isinstance(manifest, Mapping) or manifest.get("format") != FORMAT:
        raise SnapshotError(f"not a session file: {MANIFEST} lacks \"format\": \"{FORMAT}\"")
    if manifest.get("version") != VERSION:
        raise SnapshotError(f"unknown session file version {quoted(manifest.get('version'))} "
                            f"(this app reads version {VERSION})", f"{MANIFEST}: version")
    return dict(manifest), payload


def _short_list(names: list[str]) -> str:
    return repr(names) if len(names) <= 5 else f"{len(names):,} files"


def load_session(
    path: str | Path,
    model,
    tokenizer,
    cache: H2OCache,
    kind: str | None = None,
    prefill_chunk_size: int = CacheConfig.prefill_chunk_size,
    limits: InputLimits | None = None,
    memory: CacheMemory | None = None,
) -> ChatSession | StorySession:
    """Resume a saved session into ``cache``, a fresh cache whose settings (policy,
    budgets, rolling) must equal the file's (else ``SettingsMismatch``, naming each
    difference); a refused file (SnapshotError) leaves it fresh. ``kind`` ("chat" or
    "story") refuses the other kind; the last two arguments are the session's own (see
    ``Session``), and the file must keep within ``limits``; ``memory`` counts its cache."""
    limits = limits or InputLimits()
    manifest, payload = read_manifest(path, limits)
    if kind is not None and manifest.get("kind") != kind:
        saved_kind = manifest.get("kind")
        if saved_kind not in ("chat", "story"):  # a crafted kind, shown as such: "a ['chat'] session" read oddly
            raise SnapshotError(f"not a session file: its kind is {quoted(saved_kind)}, not 'chat' or 'story'",
                                f"{MANIFEST}: kind")
        raise SnapshotError(f"this is a {saved_kind} session file, not a {kind} session")
    saved, ours = manifest.get("model"), model_identity(model)
    if not isinstance(saved, Mapping):
        raise SnapshotError(f"not a session file: {MANIFEST} lacks the model's fingerprint", f"{MANIFEST}: model")
    if saved.get("fingerprint") != ours["fingerprint"]:
        raise SnapshotError(f"this session was saved with another model: {quoted(saved.get('name'))} "
                            f"(fingerprint {str(saved.get('fingerprint'))[:12]}), the loaded model is "
                            f"{ours['name']!r} ({ours['fingerprint'][:12]})")
    cache_state = manifest.get("cache")
    if not isinstance(cache_state, Mapping) or not isinstance(cache_state.get("settings"), Mapping):
        raise SnapshotError(f"not a session file: {MANIFEST} lacks the cache settings")
    differences = settings_differences(cache_state["settings"], cache.settings())
    if differences:
        raise SettingsMismatch(differences, cache_state["settings"])
    try:
        tensors = load_tensors(payload)
    except SafetensorError as err:
        raise SnapshotError(f"session file does not describe a valid cache: {err}", TENSORS) from None
    del payload  # the tensors are a copy
    vocab = model.get_input_embeddings().num_embeddings
    try:
        with refused_as(SnapshotError):
            tokens, fed = check_tokens(tensors.pop("tokens", None), manifest.get("fed"), vocab,
                                       _most_tokens(manifest, limits), limits, manifest.get("kind") == "chat")
            check_cache_state(cache_state, tensors, fed, len(tokens), cache, model, prefill_chunk_size)
            session = _new_session(manifest, model, tokenizer, cache, tokens,
                                   dict(prefill_chunk_size=prefill_chunk_size, limits=limits, memory=memory))
        try:
            cache.load_state(tensors, cache_state, model.device)
        except (KeyError, TypeError, ValueError) as err:
            raise SnapshotError(f"session file does not describe a valid cache: {err}") from None
    except SnapshotError:
        cache.reset()  # fresh again: the session may have protected its prompt already
        cache.spans.ranges.clear()
        raise
    if isinstance(session, ChatSession):
        session.restore(tokens, fed, manifest["template_text"])
    else:
        session.restore(tokens, fed)
    return session


def _most_tokens(manifest: Mapping[str, Any], limits: InputLimits) -> int:
    """A bound on the file's token count, known before the tokens are read: a chat's
    tokens spell its template text, at least one byte each."""
    if manifest.get("kind") != "chat":
        return max_story_tokens(limits)
    text = manifest.get("template_text")
    if not isinstance(text, str):
        raise SnapshotError(f"chat session: {MANIFEST} lacks template_text", f"{MANIFEST}: template_text")
    return len(text.encode("utf-8", "surrogatepass")) + 1


def _new_session(manifest: Mapping[str, Any], model, tokenizer, cache: H2OCache, tokens: list[int],
                 options: dict[str, Any]) -> ChatSession | StorySession:
    """The session, built as the app builds one (so the system prompt or bible is
    protected and marked as such, and the texts are checked against the limits),
    before its tokens and cache are restored."""
    kind = manifest.get("kind")
    if kind == "chat":
        messages, text = manifest.get("messages"), manifest.get("template_text")
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise SnapshotError("chat session: messages (a list of objects) is missing", f"{MANIFEST}: messages")
        has_system = bool(messages) and messages[0].get("role") == "system"
        if has_system and not isinstance(messages[0].get("content"), str):
            raise SnapshotError(f"messages[0] = {quoted(messages[0])}: the system prompt must be a string",
                                f"{MANIFEST}: messages[0]")
        try:
            session = ChatSession(model, tokenizer, cache=cache,
                                  system_prompt=messages[0]["content"] if has_system else None,
                                  history=messages[1:] if has_system else messages, **options)
        except InputError as err:
            raise SnapshotError(f"{MANIFEST}: chat session: {err}", f"{MANIFEST}: messages") from None
        check_template_text(text, session.messages, tokenizer)
        return session
    if kind == "story":
        bible = require_int(manifest.get("bible_tokens"), f"{MANIFEST}: bible_tokens", 0, len(tokens),
                            "the tokens in the file")
        text = tokenizer.decode(tokens[:bible], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        session = StorySession(model, tokenizer, cache=cache, bible=text, **options)
        if session.tokens != tokens[:bible]:
            raise SnapshotError("the story bible does not encode to the saved tokens: another tokenizer?")
        story = tokenizer.decode(tokens[bible:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        check_chars(len(text) + len(story), session.limits, "the story")
        return session
    raise SnapshotError(f"kind = {quoted(kind)}: must be chat or story", f"{MANIFEST}: kind")
