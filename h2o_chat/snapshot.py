"""Saving a chat or story session with its compressed cache, and resuming it later.

One file per session, a zip archive (``*.h2o-session.zip``, members stored
uncompressed) holding:

- ``cache.safetensors``: the cache's tensors (``H2OCache.state``): per layer the held
  slots' keys, values, accumulated scores, positions and flags. No pickle anywhere.
- ``manifest.json``: format and version, the model's name and weight fingerprint, the
  cache settings (policy, budgets, rolling), protected spans and per-layer counters, the
  session kind with its tokens and ``fed``, the chat messages (chat) or bible length
  (story), and the sha256 of ``cache.safetensors``.

Resuming builds a new session on a fresh cache and restores the cache exactly, scores
included, so the next logits and every later eviction equal those of the session that
was saved. A file is refused (``SnapshotError``) when it is truncated or corrupted, of
an unknown version, from another model, or from other cache settings than the cache it
is resumed into.
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

from .engine.cache import H2OCache
from .config import CacheConfig
from .session import ChatSession, Session, StorySession

FORMAT = "h2o-chat/session"
VERSION = 1
SUFFIX = ".h2o-session.zip"
MANIFEST = "manifest.json"
TENSORS = "cache.safetensors"
# Refused before reading: a session of the default budget takes about 13 MB, a full
# cache of 8k tokens of the embedded model about 390 MB.
MAX_BYTES = 2 * 1024**3


class SnapshotError(ValueError):
    """A session file that cannot be resumed here; the message says why."""


def model_identity(model) -> dict[str, str]:
    """The model's name (informational) and a fingerprint that tells models apart.

    The fingerprint hashes every parameter's and buffer's name, shape and dtype and a
    strided sample of about 1024 of its values (milliseconds, unlike hashing every
    weight): another architecture, checkpoint, fine-tune, dtype or RoPE scaling differs.
    """
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        flat = tensor.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 1024)].contiguous()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(sample.view(torch.uint8).cpu().numpy().tobytes())
    name = model.config.name_or_path
    return {"name": Path(name).name if name else model.config.model_type, "fingerprint": digest.hexdigest()}


def _manifest(session: Session) -> tuple[dict[str, Any], bytes]:
    """The manifest and tensor payload that describe ``session`` now."""
    tensors, cache_state = session.cache.state()
    payload = save_tensors(tensors)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "model": model_identity(session.model),
        "cache": cache_state,
        "tokens": list(session.tokens),
        "fed": session.fed,
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
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
    path = Path(path)
    partial = path.with_name(path.name + ".partial")  # renamed when complete: never half a file
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(MANIFEST, json.dumps(manifest, ensure_ascii=False))
        archive.writestr(TENSORS, payload)
    partial.replace(path)
    return path


def read_manifest(path: str | Path) -> tuple[dict[str, Any], bytes]:
    """The manifest and the tensor payload of a session file, checked for integrity and
    version (not yet against a model or cache)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = sorted(archive.namelist())
            if names != sorted([MANIFEST, TENSORS]):
                raise SnapshotError(f"not a session file: it holds {names}, expected {MANIFEST} and {TENSORS}")
            size = sum(info.file_size for info in archive.infolist())
            if size > MAX_BYTES:
                raise SnapshotError(f"session file unpacks to {size} bytes, more than the limit {MAX_BYTES}")
            manifest_bytes, payload = archive.read(MANIFEST), archive.read(TENSORS)
    except zipfile.BadZipFile as err:
        if "CRC" in str(err):
            raise SnapshotError(f"session file is corrupted ({err})") from None
        raise SnapshotError(f"not a session file, or the file is truncated ({err})") from None
    except (EOFError, zlib.error) as err:
        raise SnapshotError(f"session file is truncated or corrupted ({err})") from None
    try:
        manifest = json.loads(manifest_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SnapshotError(f"session file is corrupted: {MANIFEST} is not valid JSON ({err})") from None
    if not isinstance(manifest, Mapping) or manifest.get("format") != FORMAT:
        raise SnapshotError(f"not a session file: {MANIFEST} lacks \"format\": \"{FORMAT}\"")
    if manifest.get("version") != VERSION:
        raise SnapshotError(f"unknown session file version {manifest.get('version')!r} "
                            f"(this app reads version {VERSION})")
    if hashlib.sha256(payload).hexdigest() != manifest.get("payload_sha256"):
        raise SnapshotError(f"session file is corrupted: {TENSORS} does not match the sha256 "
                            f"in {MANIFEST}")
    return dict(manifest), payload


def load_session(
    path: str | Path,
    model,
    tokenizer,
    cache: H2OCache,
    kind: str | None = None,
    prefill_chunk_size: int = CacheConfig.prefill_chunk_size,
    max_message_chars: int | None = None,
) -> ChatSession | StorySession:
    """Resume a saved session into ``cache``, a fresh cache whose settings (policy,
    budgets, rolling) must equal the file's; a refused file (SnapshotError) leaves it
    fresh. ``kind`` ("chat" or "story") refuses the other kind; the last two arguments
    are the session's own (see ``Session``)."""
    manifest, payload = read_manifest(path)
    if kind is not None and manifest.get("kind") != kind:
        raise SnapshotError(f"this is a {manifest.get('kind')} session file, not a {kind} session")
    saved, ours = manifest.get("model") or {}, model_identity(model)
    if saved.get("fingerprint") != ours["fingerprint"]:
        raise SnapshotError(f"this session was saved with another model: {saved.get('name')!r} "
                            f"(fingerprint {str(saved.get('fingerprint'))[:12]}), the loaded model is "
                            f"{ours['name']!r} ({ours['fingerprint'][:12]})")
    cache_state = manifest.get("cache")
    if not isinstance(cache_state, Mapping) or not isinstance(cache_state.get("settings"), Mapping):
        raise SnapshotError(f"not a session file: {MANIFEST} lacks the cache settings")
    try:
        cache.check_settings(cache_state["settings"], "the file")
    except ValueError as err:
        raise SnapshotError(f"{err}: change the cache settings to the file's to resume it") from None
    tokens, fed = manifest.get("tokens"), manifest.get("fed")
    vocab = model.get_input_embeddings().num_embeddings
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise SnapshotError(f"tokens: must be a list of token ids below {vocab}")
    if type(fed) is not int or not 0 <= fed <= len(tokens):
        raise SnapshotError(f"fed = {fed!r}: must be an integer from 0 to {len(tokens)} (the tokens)")
    try:
        options = dict(prefill_chunk_size=prefill_chunk_size, max_message_chars=max_message_chars)
        session = _new_session(manifest, model, tokenizer, cache, tokens, options)
        try:
            cache.load_state(load_tensors(payload), cache_state, model.device)
        except (KeyError, TypeError, ValueError, SafetensorError) as err:
            raise SnapshotError(f"session file does not describe a valid cache: {err}") from None
        if cache.seen != fed:
            raise SnapshotError(f"fed = {fed} but the cache has seen {cache.seen} tokens")
    except SnapshotError:
        cache.reset()  # fresh again: the session may have protected its prompt already
        cache.spans.ranges.clear()
        raise
    if isinstance(session, ChatSession):
        session.restore(tokens, fed, manifest["template_text"])
    else:
        session.restore(tokens, fed)
    return session


def _new_session(manifest: dict, model, tokenizer, cache: H2OCache, tokens: list[int],
                 options: dict[str, Any]) -> ChatSession | StorySession:
    """The session, built as the app builds one (so the system prompt or bible is
    protected and marked as such), before its tokens and cache are restored."""
    kind = manifest.get("kind")
    if kind == "chat":
        messages, text = manifest.get("messages"), manifest.get("template_text")
        if (not isinstance(text, str) or not isinstance(messages, list)
                or not all(isinstance(m, Mapping) for m in messages)):
            raise SnapshotError("chat session: messages (a list of objects) or template_text is missing")
        system = messages[0].get("content") if messages and messages[0].get("role") == "system" else None
        if messages and system is None and messages[0].get("role") == "system":
            raise SnapshotError(f"messages[0] = {messages[0]!r}: the system prompt must be a string")
        try:
            session = ChatSession(model, tokenizer, cache=cache, system_prompt=system,
                                  history=messages[1:] if system is not None else messages, **options)
        except ValueError as err:
            raise SnapshotError(f"chat session: {err}") from None
        return session
    if kind == "story":
        bible = manifest.get("bible_tokens")
        if type(bible) is not int or not 0 <= bible <= len(tokens):
            raise SnapshotError(f"bible_tokens = {bible!r}: must be an integer from 0 to {len(tokens)}")
        text = tokenizer.decode(tokens[:bible], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        session = StorySession(model, tokenizer, cache=cache, bible=text, **options)
        if session.tokens != tokens[:bible]:
            raise SnapshotError("the story bible does not encode to the saved tokens: another tokenizer?")
        return session
    raise SnapshotError(f"kind = {kind!r}: must be chat or story")
