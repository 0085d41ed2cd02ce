"""One worker per model runs every forward pass: the next token of every conversation
that is decoding goes through the model as one batch (continuous batching), and long
prompts are fed one piece per step in between, so a long paste delays the others by
about one chunk, never by the whole paste.

Callers (sessions, the fidelity probe) keep their own state and threads: a caller hands
``forward`` one chunk of tokens for one cache and blocks until the worker has run it.
Conversations join and leave a batch at any step, since a batch is simply what is
pending when a step starts. Each conversation's cache stays its own object, with its own
scores, evictions, pins, positions and policy (see ``engine.rows``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from .engine.rows import RowsCache

# How long a step waits for the conversations still sampling their previous token to
# hand in their next one, and a conversation starting a turn for others starting theirs
# (so replies begun together run as one batch from their first token). Each caller needs
# about a millisecond between steps; a caller whose reader stalls (a slow client) costs
# the others at most this much per step.
GATHER_S = 0.004
# A prompt is fed at most this many tokens per step, so a conversation that arrives
# while a long paste is being read waits for one piece, not a whole chunk. On the 2-core
# development machine 64-token pieces cost about what whole 256-token chunks cost.
PREFILL_PIECE = 64


@dataclass
class _Request:
    cache: Cache
    ids: torch.Tensor  # (1, n) token ids
    fed: int = 0  # of which the worker has fed (a prompt goes in pieces)
    stop: threading.Event | None = None  # set: feed no further piece of a prompt
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None  # (vocab,) of the last token, once run
    error: BaseException | None = None


class TakeTurns:
    """Every caller runs its own forward pass, one at a time per model: what the app did
    before batching, kept to measure batching against."""

    def __init__(self, model) -> None:
        self.model = model
        self._lock = threading.Lock()

    @contextmanager
    def turn(self) -> Iterator[None]:
        yield

    def forward(self, cache: Cache, ids: torch.Tensor, stop: threading.Event | None = None) -> torch.Tensor:
        """``BatchScheduler.forward``, in one pass: ``stop`` cannot cut it short."""
        with self._lock, torch.inference_mode():
            return forward_one(self.model, cache, ids)


class BatchScheduler:
    """The worker that owns ``model``'s forward passes (see the module docstring)."""

    def __init__(self, model, gather_s: float = GATHER_S, max_batch: int = 64,
                 prefill_piece: int = PREFILL_PIECE) -> None:
        # Weak: the scheduler is kept per model in a weak dictionary, which a strong
        # reference back would keep alive for ever.
        self._model = weakref.ref(model)
        self.gather_s, self.max_batch, self.prefill_piece = gather_s, max_batch, prefill_piece
        self._pending: list[_Request] = []
        self._turns = 0  # callers in a turn: each will hand in requests until it ends
        self._changed = threading.Condition()
        self._worker: threading.Thread | None = None
        self.steps = 0  # forward passes run, for stats
        self.batched_rows = 0  # decode rows run in batches of more than one

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Announce a run of requests (a reply): the worker waits briefly for every
        caller in a turn before a step, so replies decoding together batch together."""
        with self._changed:
            self._turns += 1
        try:
            yield
        finally:
            with self._changed:
                self._turns -= 1
                self._changed.notify_all()

    def forward(self, cache: Cache, ids: torch.Tensor, stop: threading.Event | None = None
                ) -> torch.Tensor | None:
        """Feed ``ids`` ``(1, n)`` to ``cache`` and return the logits of the last token,
        ``(vocab,)``, once the worker has run it (alone or in a batch). None when ``stop``
        was set before the prompt's last piece: the cache then holds the pieces fed
        before (``cache.get_seq_length()`` says how far it got), evicted to its budget."""
        if ids.shape[1] < 1:  # the worker would never take it, and the caller wait for ever
            raise ValueError("forward needs at least one token")
        request = _Request(cache, ids, stop=stop)
        with self._changed:
            self._pending.append(request)
            self._start_worker()
            self._changed.notify_all()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.logits

    def load(self) -> tuple[int, int]:
        """Callers in a turn, and requests waiting for the worker now."""
        with self._changed:
            return self._turns, len(self._pending)

    # ---- the worker -----------------------------------------------------------------------

    def _start_worker(self) -> None:
        if self._worker is None:
            # A daemon, holding the scheduler weakly: it ends with the process, and a
            # scheduler nobody uses any more can be freed with its model.
            self._worker = threading.Thread(target=_work, args=(weakref.ref(self),),
                                            name="h2o-chat-scheduler", daemon=True)
            self._worker.start()

    def _next_step(self, timeout: float) -> tuple[list[_Request], list[_Request]] | None:
        """The decode rows of the next step and the prompts to feed one piece of each;
        None when nothing came within ``timeout``."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._pending, timeout=timeout):
                return None
            # A prompt not begun yet is a turn starting: give the others starting
            # theirs the whole window, so what runs together does not depend on which
            # thread got there first (batched rows compute with other rounding than one
            # row alone).
            self._changed.wait_for(lambda: len(self._pending) >= self._turns
                                   and not any(r.fed == 0 and r.ids.shape[1] > 1 for r in self._pending),
                                   timeout=self.gather_s)
            decode = [r for r in self._pending if r.ids.shape[1] == 1][: self.max_batch]
            prompts = [r for r in self._pending if r.ids.shape[1] > 1]
            taken = {id(r) for r in decode + prompts}
            self._pending = [r for r in self._pending if id(r) not in taken]
            return decode, prompts

    def _run(self, decode: list[_Request], prompts: list[_Request]) -> None:
        model = self._model()  # alive: every caller holds it
        with torch.inference_mode():
            for prompt in prompts:
                if prompt.stop is not None and prompt.stop.is_set():
                    _give_up(prompt)
                else:
                    self._feed_piece(model, prompt, min(prompt.ids.shape[1], prompt.fed + self.prefill_piece))
            if len(decode) == 1:
                _settle(decode, lambda: [forward_one(model, decode[0].cache, decode[0].ids)])
            elif decode:
                _settle(decode, lambda: forward_rows(model, [r.cache for r in decode],
                                                     torch.cat([r.ids for r in decode])))
                self.batched_rows += len(decode)
        self.steps += 1

    def _feed_piece(self, model, prompt: _Request, end: int) -> None:
        """Feed ``prompt``'s tokens up to ``end``; it is answered once fed whole. The
        cache evicts only after the last piece, so pieces keep what one pass would."""
        whole = prompt.fed == 0 and end == prompt.ids.shape[1]
        try:
            if not whole:
                prompt.cache.hold_eviction(True)
            logits = forward_one(model, prompt.cache, prompt.ids[:, prompt.fed : end])
            if not whole and end == prompt.ids.shape[1]:
                prompt.cache.hold_eviction(False)
        except BaseException as err:  # reported to the caller; the worker carries on
            prompt.error = err
            prompt.done.set()
            return
        prompt.fed = end
        if end < prompt.ids.shape[1]:
            with self._changed:
                self._pending.append(prompt)
            return
        prompt.logits = logits
        prompt.done.set()


def _work(scheduler_ref: weakref.ref) -> None:
    while (scheduler := scheduler_ref()) is not None:
        step = scheduler._next_step(timeout=1.0)
        if step is not None:
            scheduler._run(*step)
        del scheduler  # not held while idle, so it can be freed


def _give_up(prompt: _Request) -> None:
    """Answer a stopped prompt with what it has fed so far (no logits)."""
    try:
        if prompt.fed:  # pieces went in with eviction held: bring the cache to its budget
            prompt.cache.hold_eviction(False)
    except BaseException as err:
        prompt.error = err
    prompt.done.set()


def _settle(requests: list[_Request], run) -> None:
    """Run, then hand each request its logits, or the error to every one of them: a
    failed pass leaves each cache for its caller to put back in step."""
    try:
        for request, logits in zip(requests, run(), strict=True):
            request.logits = logits
    except BaseException as err:  # reported to the callers; the worker carries on
        for request in requests:
            request.error = err
    for request in requests:
        request.done.set()


def forward_one(model, cache: Cache, ids: torch.Tensor) -> torch.Tensor:
    """One conversation's forward pass: the logits of the last of ``ids``, ``(vocab,)``."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


def forward_rows(model, caches: list[Cache], ids: torch.Tensor, batched_attention: bool = True) -> list[torch.Tensor]:
    """One decode step for several conversations at once: ``ids`` ``(rows, 1)``, row r
    fed to ``caches[r]`` at that cache's own next position. The logits of each row.
    ``batched_attention`` False runs attention row by row (the benchmarks' comparison)."""
    rows = RowsCache(caches, batched_attention)
    positions = torch.tensor([[cache.get_seq_length()] for cache in caches], device=ids.device)
    out = model(input_ids=ids, position_ids=positions, past_key_values=rows, use_cache=True,
                logits_to_keep=1)
    return list(out.logits[:, -1])


_schedulers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_schedulers_guard = threading.Lock()


def scheduler_for(model) -> BatchScheduler:
    """The one scheduler of ``model``, shared by every session on it."""
    with _schedulers_guard:
        scheduler = _schedulers.get(model)
        if scheduler is None:
            scheduler = _schedulers[model] = BatchScheduler(model)
        return scheduler

