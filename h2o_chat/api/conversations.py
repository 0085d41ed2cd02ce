"""The conversations the API keeps between stateless requests, with their caches.

A chat-completions request carries the whole conversation. When its messages before the
new user message are exactly what a kept conversation holds (system prompt, turns and
replies as the session recorded them, pins), the request continues that session: its
tokens, and so its cache, already cover all of it, and only the new message is fed. An
evicting cache cannot go back, so anything else (an edited turn, a reply cut by a stop
string, a dropped pin) starts a fresh session on the request's history.

Each API key is a user of its own: a conversation is continued, named or matched, only
by requests with the key that began it.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from h2o_chat.sessions import ChatSession, SessionStats

from .errors import APIError
from .schema import Message

MAX_ID_CHARS = 128
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


@dataclass(eq=False)
class Conversation:
    id: str
    owner: str  # whose it is (an API key's place): no other key's request reaches it
    named: bool  # the client chose the id (X-Session-Id): only requests naming it reach it
    # What the session holds, spelled as requests spell it; () while a fresh session waits
    # to be built on the next turn's history.
    messages: tuple[Message, ...] = ()
    session: ChatSession | None = None
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)
    stats: SessionStats | None = None  # after the last turn: metrics never touch a busy cache


def check_session_id(value: str) -> str:
    if not 1 <= len(value) <= MAX_ID_CHARS or not set(value) <= _ID_CHARS:
        raise APIError(400, f"X-Session-Id must be 1 to {MAX_ID_CHARS} characters from "
                            "A-Z a-z 0-9 - _ . :", param="X-Session-Id", code="invalid_value")
    return value


class ConversationStore:
    """At most ``max_conversations`` idle conversations (the least recently used go first),
    each freed after ``idle_seconds`` without a turn; ``released`` runs after any is freed
    (e.g. to hand freed heap pages back to the system)."""

    def __init__(self, max_conversations: int, idle_seconds: float,
                 released: Callable[[], None] = lambda: None) -> None:
        self.max_conversations, self.idle_seconds = max_conversations, idle_seconds
        self._released = released
        # By (owner, id), the least recently used first.
        self._items: OrderedDict[tuple[str, str], Conversation] = OrderedDict()
        self._lock = threading.Lock()  # turns end on worker threads

    def checkout(self, history: tuple[Message, ...], owner: str, session_id: str | None) -> Conversation:
        """The conversation for ``owner``'s request whose messages before the new one are
        ``history``, marked busy: a kept one of ``owner``'s that holds exactly ``history``,
        else a new one whose ``session`` is None, to be built on ``history``."""
        with self._lock:
            self._drop_idle()
            if session_id is not None:
                conversation = self._items.get((owner, session_id))
                if conversation is not None and conversation.busy:
                    raise APIError(409, f"conversation {session_id!r} is generating a reply: wait for "
                                        "it to end, or use another X-Session-Id", param="X-Session-Id",
                                   code="session_busy")
                if conversation is None or conversation.messages != history:
                    conversation = Conversation(session_id, owner, named=True)
            else:
                conversation = next((c for c in reversed(self._items.values()) if c.owner == owner
                                     and not c.busy and not c.named and c.messages == history), None)
                if conversation is None:
                    conversation = Conversation("conv-" + secrets.token_hex(8), owner, named=False)
            conversation.busy = True
            key = (owner, conversation.id)
            replaced = self._items.get(key) not in (None, conversation)
            self._items[key] = conversation
            self._items.move_to_end(key)
            self._drop_over_bound()
        if replaced:
            self._released()
        return conversation

    def checkin(self, conversation: Conversation, messages: tuple[Message, ...] | None,
                stats: SessionStats | None = None) -> None:
        """A turn ended: the session now holds ``messages`` and its ``stats``; None drops
        the conversation (its turn failed, so what its session holds is uncertain)."""
        with self._lock:
            conversation.busy = False
            conversation.last_used = time.monotonic()
            if messages is None:
                if self._items.get((conversation.owner, conversation.id)) is conversation:
                    del self._items[conversation.owner, conversation.id]
            else:
                conversation.messages, conversation.stats = messages, stats
            self._drop_over_bound()
        if messages is None:
            self._released()

    def drop_least_recent(self) -> bool:
        """Free the least recently used idle conversation, to make room for a turn in the
        server's cache memory (its client's next request builds it again); False when
        every conversation is busy."""
        with self._lock:
            idle = next((c for c in self._items.values() if not c.busy), None)
            self._drop([idle] if idle is not None else [])
        return idle is not None

    def conversations(self) -> list[Conversation]:
        with self._lock:
            self._drop_idle()
            return list(self._items.values())

    def _drop_idle(self) -> None:
        deadline = time.monotonic() - self.idle_seconds
        self._drop([c for c in self._items.values() if not c.busy and c.last_used < deadline])

    def _drop_over_bound(self) -> None:
        idle = [c for c in self._items.values() if not c.busy]
        self._drop(idle[: max(0, len(self._items) - self.max_conversations)])

    def _drop(self, conversations: list[Conversation]) -> None:
        for conversation in conversations:
            del self._items[conversation.owner, conversation.id]
        if conversations:
            self._released()
