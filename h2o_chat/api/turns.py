"""Turns of API conversations on sessions: the API's place in the model's one admission,
a worker thread per turn, and the turn's events handed to the event loop.

Each admitted turn runs ``ChatSession.send`` on its own thread; the model's scheduler
batches the decode steps of all turns decoding at once. The routes see only
``TurnRunner.start`` and the ``Turn`` it returns (an async stream of ``Delta`` and a final
``Finished``), so another way of running turns can replace this one without touching
them.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from h2o_chat import ChatSession
from h2o_chat.admission import Admission, Ticket
from h2o_chat.cache_memory import CacheMemoryFull
from h2o_chat.config import AppConfig
from h2o_chat.inputs import InputError, InputLimits
from h2o_chat.scheduler import stop_workers
from h2o_chat.sessions import SessionStats, chat_session

from .conversations import Conversation, ConversationStore
from .errors import APIError
from .metrics import Metrics
from .schema import ChatRequest, Message
from .stops import StopMatcher

if TYPE_CHECKING:
    from h2o_chat.runtime import LoadedModel, ModelProvider

log = logging.getLogger(__name__)

# The threads of the turns under way (daemons: a turn never holds the process up).
_turn_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register  # after the scheduler's hook is registered, so this one runs first
def join_turns_at_exit() -> None:
    """End every turn under way and wait for its thread: stopping the scheduler's workers
    ends their generations as stopped, and each turn thread then finishes its turn (it
    lets go of a conversation, freeing tensors). One still doing that as the interpreter
    finalizes aborts the process, as a worker did (``scheduler.stop_workers``): an API
    test that left a streamed reply at its end exited with status 134."""
    stop_workers()
    for thread in list(_turn_threads):
        thread.join(timeout=30)


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt, already in the kept conversation's cache


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # stop | length
    usage: Usage
    h2o: dict[str, Any]  # what the bounded cache holds after the turn


@dataclass(frozen=True)
class _Failed:
    error: APIError


class _Accepted:
    """The session took the request's message (its own checks passed): the reply follows."""


class APIQueue:
    """The API's requests in the model's ``admission`` (which page turns take too): at
    most ``waiting`` of them wait for a slot, others get 429."""

    def __init__(self, admission: Admission, waiting: int, metrics: Metrics) -> None:
        self._admission = admission
        self.waiting, self.max_waiting = 0, waiting
        self._metrics = metrics

    async def enter(self) -> Ticket:
        """A granted ticket, once a slot is free; cancelled while waiting, it leaves."""
        running, _ = self._admission.load()
        if running >= self._admission.limit and self.waiting >= self.max_waiting:
            raise APIError(429, f"the server is busy: every generation slot is taken and the queue for "
                                f"one is full (server.api_max_queued = {self.max_waiting}); retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        ticket = self._admission.request(lambda: loop.call_soon_threadsafe(_resolve, ready))
        if not ticket.granted:
            self.waiting += 1
            self._metrics.queued.inc()
            try:
                await ready
            except BaseException:
                ticket.done()
                raise
            finally:
                self.waiting -= 1
                self._metrics.queued.dec()
        self._metrics.active.inc()
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """The turn ended (any thread): its slot goes to the next waiting turn."""
        self._metrics.active.dec()
        ticket.done()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class Turn:
    """One request's turn: iterate it for its events; ``cancel`` stops it (the client left)
    at whatever stage it is: not begun, it never feeds a token; prefilling, it stops after
    the prompt piece under way; decoding, after the token under way."""

    def __init__(self, conversation: Conversation, arrived: float, metrics: Metrics) -> None:
        self.conversation, self.arrived, self._metrics = conversation, arrived, metrics
        self._first_text_at: float | None = None
        self._events: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.cancelled = threading.Event()

    @property
    def session_id(self) -> str:
        return self.conversation.id

    def cancel(self) -> None:
        self.cancelled.set()  # the session's stop event for this turn (see TurnRunner._generate)

    async def accepted(self) -> None:
        """Once the session has taken the message; what refused it (a conversation past
        the model's context, say) is raised here, before a streamed reply's 200 goes out."""
        event = await self._events.get()
        if isinstance(event, _Failed):
            raise event.error

    def emit(self, event: Delta | Finished | _Failed | _Accepted) -> None:
        """From the worker thread."""
        self.call_in_loop(self._events.put_nowait, event)

    def call_in_loop(self, function: Callable[..., object], *args: object) -> None:
        """Run ``function(*args)`` on the event loop, from the worker thread."""
        try:
            self.loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the loop closed: the server is shutting down, nobody listens
            self.cancel()

    async def __aiter__(self) -> AsyncIterator[Delta | Finished]:
        while True:
            event = await self._events.get()
            if isinstance(event, _Failed):
                raise event.error
            if isinstance(event, _Accepted):  # not awaited by a reply sent whole
                continue
            if self._first_text_at is None and isinstance(event, Delta):
                self._first_text_at = time.monotonic()
                self._metrics.ttft.observe(self._first_text_at - self.arrived)
            if isinstance(event, Finished):
                self._metrics.latency.observe(time.monotonic() - self.arrived)
            yield event
            if isinstance(event, Finished):
                return


class TurnRunner:
    """``provider.get()`` gives the model (it may still be loading); ``store`` keeps the
    conversations between turns."""

    def __init__(self, provider: ModelProvider, config: AppConfig, metrics: Metrics,
                 store: ConversationStore) -> None:
        self.provider, self.config, self.metrics, self.store = provider, config, metrics, store
        self.queue = APIQueue(provider.admission, config.server.api_max_queued, metrics)

    async def start(self, request: ChatRequest, owner: str, session_id: str | None) -> Turn:
        """Admit ``owner``'s request (429 when the queue is full) and start its turn."""
        if self.provider.failure is not None:  # known now: refused before a streamed 200 goes out
            raise _unavailable(self.provider.failure)
        if self.provider.ready:
            _require_chat_template(self.provider.get())
        arrived = time.monotonic()
        ticket = await self.queue.enter()
        try:
            conversation = self.store.checkout(request.history, owner, session_id)
        except BaseException:
            self.queue.leave(ticket)
            raise
        turn = Turn(conversation, arrived, self.metrics)
        thread = threading.Thread(target=self._run, args=(turn, request, ticket), name=f"turn-{conversation.id}",
                                  daemon=True)
        _turn_threads.add(thread)
        thread.start()
        return turn

    def _run(self, turn: Turn, request: ChatRequest, ticket: Ticket) -> None:
        conversation = turn.conversation
        try:
            try:
                loaded = self.provider.get()
            except RuntimeError as err:  # loading failed while the turn waited: no turn can run
                raise _unavailable(str(err)) from None
            _require_chat_template(loaded)
            if conversation.session is None:
                conversation.session = self._new_session(loaded.model, loaded.tokenizer, request.history)
            session = conversation.session
            before = session.stats()
            finish = self._generate(turn, session, request)
            after = session.stats()
            self._count(before, after)
            if turn.cancelled.is_set() and (session.finish_reason == "stopped" or not after.generated):
                # Nobody reads the reply, and a client coming back sends a history this
                # conversation no longer holds (it ends with a cut reply, or the session
                # took back a turn stopped before its first token): let it go now.
                self.metrics.cancelled.labels("decode" if after.generated else "prefill").inc()
                self.store.checkin(conversation, None)
                return
            reply = Message("assistant", session.messages[-1]["content"])
            self.store.checkin(conversation, request.messages + (reply,), after)
            # A stop string closed the stream: the tokens sampled past it are not the reply's.
            completion = after.generated - after.untaken
            turn.emit(Finished(finish, Usage(after.tokens - after.generated, completion, before.fed),
                               h2o_report(conversation.id, after)))
        except Exception as err:
            self.store.checkin(conversation, None)
            error = _as_api_error(err)
            if error.status == 500:  # the server's fault: its operator needs the traceback
                log.error("h2o-chat: the reply of API conversation %s failed (answered 500)", conversation.id,
                          exc_info=err)
            turn.emit(_Failed(error))
        finally:
            self.queue.leave(ticket)

    def _generate(self, turn: Turn, session: ChatSession, request: ChatRequest) -> str:
        """Stream the reply into ``turn``; its finish reason."""
        message = request.messages[-1]
        stops = StopMatcher(request.stop)
        stream = session.send(message.content, pin=message.pin, stop=turn.cancelled,
                              max_new_tokens=request.max_tokens, temperature=request.temperature,
                              top_p=request.top_p, seed=request.seed, min_new_tokens=request.min_tokens)
        turn.emit(_Accepted())
        try:
            for chunk in stream:
                if text := stops.feed(chunk):
                    turn.emit(Delta(text))
                if stops.stopped:
                    break
        finally:
            stream.close()  # the session records the reply so far
        if stops.stopped:
            session.took_text(stops.through)
        if text := stops.flush():
            turn.emit(Delta(text))
        if session.finish_reason == "stopped" and not (stops.stopped or turn.cancelled.is_set()):
            # Neither a stop string nor the client: the server, stopping, ended its worker.
            # Ending it as "stop" would let the client take a cut reply for a whole one.
            raise APIError(503, "the server is shutting down: this reply was cut short; send the request "
                                "again once the server is back", code="server_shutting_down")
        return "length" if session.finish_reason == "length" else "stop"

    def _new_session(self, model, tokenizer, history: tuple[Message, ...]) -> ChatSession:
        cache = self.config.cache
        system = history[0].content if history and history[0].role == "system" else None
        turns = history[1:] if system is not None else history
        session = chat_session(model, tokenizer, cache, system_prompt=system,
                               history=[{"role": m.role, "content": m.content} for m in turns],
                               limits=InputLimits.of(self.config.server), memory=self.provider.memory)
        for index, message in enumerate(turns):
            if message.pin:  # its own tokens, not yet fed: nothing evicted, and never pinned twice
                session.pin_history(index)
        return session

    def _count(self, before: SessionStats, after: SessionStats) -> None:
        metrics = self.metrics
        metrics.generated_tokens.inc(after.generated)
        # What was fed of the prompt: all of it, unless the turn stopped during its prefill
        # (none, when a session took back a turn whose prompt it had begun to read, and
        # emptied its cache to read the conversation again on the next turn).
        metrics.prefill_tokens.inc(max(0, min(after.fed, after.tokens - after.generated) - before.fed))
        metrics.cached_tokens.inc(before.fed)
        evicted = [s.cache.seen - s.cache.held for s in (before, after)]
        metrics.evicted_tokens.inc(max(0, evicted[1] - evicted[0]))


def h2o_report(session_id: str, stats: SessionStats) -> dict[str, Any]:
    """The response's ``h2o`` object: what the bounded cache holds after the turn."""
    cache = stats.cache
    return {"session_id": session_id, "tokens_seen": cache.seen, "slots_held": cache.held,
            "budget": cache.budget, "evicted": cache.seen - cache.held, "pinned": cache.pinned,
            "kv_bytes": cache.kv_bytes, "held_bytes": cache.held_bytes, "budget_bytes": cache.budget_bytes,
            "key_bits": cache.key_bits, "value_bits": cache.value_bits, "exact_window": cache.exact_window,
            "policy": cache.policy,
            "turn_starts": cache.turn_starts}


def _require_chat_template(loaded: LoadedModel) -> None:
    """A model without a chat template serves stories on the page, never a chat: the
    server's fault (503), not the request's (it was a 400 naming the messages)."""
    if loaded.tokenizer.chat_template is None:
        raise _unavailable(f"the model {loaded.name} has no chat template, which chat completions need: "
                           "serve a chat (instruct) model, or write stories on the page")


def _unavailable(why: str) -> APIError:
    """The model failed to load, or the server's cache settings do not fit it: the
    server's fault, whatever the request."""
    return APIError(503, why, code="model_unavailable")


def _as_api_error(err: BaseException) -> APIError:
    if isinstance(err, APIError):
        return err
    if isinstance(err, CacheMemoryFull) and err.now:  # other conversations hold the room
        return APIError(503, str(err), param=err.field, code="cache_memory_full", headers={"Retry-After": "5"})
    if isinstance(err, InputError):  # the session's own checks refused it
        return APIError(400, str(err), param=err.field, code="invalid_value")
    if isinstance(err, ValueError):
        return APIError(400, str(err), param="messages", code="invalid_value")
    return APIError(500, f"the reply failed: {type(err).__name__}: {err}", code="generation_failed")

