"""One worker per model runs every forward pass and samples every token: each step
feeds the next token of every conversation that is decoding as one batch (continuous
batching), and one piece of each prompt in between (the pieces of several prompts in one
pass), so a long paste delays the others by about one piece, never by the whole paste.

A caller (a session) hands the worker a ``Generation`` (see ``generation``) and reads the
token ids it samples; the worker feeds each sampled token back in its next step, so no
token waits for its caller. Conversations join and leave a batch at any step, since a
batch is simply the generations running when a step starts. Each conversation's cache
stays its own object, with its own scores, evictions, pins, positions and policy; during
a turn it lies in a row of the decode step's pools (see ``engine.step``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import threading
import time
import weakref
from collections.abc import Iterator

import torch
from transformers.cache_utils import Cache

from .engine.pieces import PiecesCache
from .engine.step import DecodeStep
from .generation import Generation
from .sampling import draw_tokens

# A prompt is fed at most this many tokens per step, so a conversation that arrives
# while a long paste is being read waits for one piece, not a whole chunk. On the 2-core
# development machine 64-token pieces cost about what whole 256-token chunks cost.
PREFILL_PIECE = 64
# Prompts fed pieces in one pass, at most: eight 64-token pieces took 1.36-1.48 s packed
# in one pass and 1.66-1.78 s in passes of their own (one thread, the embedded model),
# while decoding rows wait for the pass.
PROMPT_ROWS = 8
# A reader of a generation's stream (a turn's thread) is woken at most once in this many
# seconds per row of the pass that drew its token, up to WAKE_MAX_S (the longest it
# waits while tokens come); tokens drawn meanwhile reach it with the next. A wake-up
# takes the interpreter's lock from the worker, which it needs between its kernels: a
# chat's reader, decoding and streaming its text, cost the worker 60-150 us a wake-up
# with steps of 6-36 ms (16-128 rows of a tiny model with SmolLM2's tokenizer). At 1.5
# ms a row the readers slowed those steps by 8-10%, at 0.3 ms by 23-34% and woken on
# every token by 22-41% ("Readers" in docs/benchmarks.md). A text then comes at least
# every 100 ms, and for a few rows about every token.
WAKE_PER_ROW_S = 0.0015
WAKE_MAX_S = 0.1


class TakeTurns:
    """Every caller runs its own forward passes in its own thread, one pass at a time per
    model: what the app did before batching, kept to measure batching against and as the
    reference a batched reply must equal."""

    def __init__(self, model) -> None:
        self.model = model
        self._lock = threading.Lock()

    def generate(self, generation: Generation) -> Iterator[int]:
        """``BatchScheduler.generate``, one whole chunk per pass: a stop takes effect
        between chunks."""
        try:
            while not generation.done.is_set():
                with self._lock, torch.inference_mode(), generation.lock:
                    if generation.stopping:
                        generation.end("stopped")
                        break
                    end = generation.chunk_end
                    ids = torch.tensor([generation.tokens[generation.fed : end]], device=self.model.device)
                    try:
                        logits = forward_one(self.model, generation.cache, ids)[None]
                    except BaseException as err:  # the caller puts its cache back in step
                        generation.end("failed", err)
                    else:
                        settle_pass([generation], [end], logits)
                yield from generation.ready()
        finally:
            if not generation.done.is_set():  # closed early
                generation.end("stopped")
        yield from generation.ready()


class BatchScheduler:
    """The worker that owns ``model``'s forward passes (see the module docstring).

    ``gather_s``: a generation arriving while none waits holds its first step this long
    for others arriving with it, so turns started together run together from their first
    piece (batched rows round differently than one row alone). The rows already running
    go on meanwhile. Zero by default: tests use it to make batches reproducible.
    ``step``: the decode step to run (default: one with CUDA graphs where the model is on
    CUDA, see ``engine.step``). ``wake_per_row_s`` and ``wake_max_s``: how often a
    decoding row's reader is woken at most (see ``WAKE_PER_ROW_S``)."""

    def __init__(self, model, gather_s: float = 0.0, max_batch: int = 64,
                 prefill_piece: int = PREFILL_PIECE, step: DecodeStep | None = None,
                 wake_per_row_s: float = WAKE_PER_ROW_S, wake_max_s: float = WAKE_MAX_S) -> None:
        # Weak: the scheduler is kept per model in a weak dictionary, which a strong
        # reference back would keep alive for ever.
        self._model = weakref.ref(model)
        self.gather_s, self.max_batch, self.prefill_piece = gather_s, max_batch, prefill_piece
        self.wake_per_row_s, self.wake_max_s = wake_per_row_s, wake_max_s
        self._arriving: list[Generation] = []
        self._arrived_at = 0.0  # when the first of them arrived
        self._running: list[Generation] = []
        self._changed = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False  # see ``close``
        # Holds the caches of the rows decoding as rows of its pools: each leaves as its
        # generation ends, so between turns a cache owns its memory.
        self._step = step or DecodeStep()
        self.steps = 0  # forward steps run, for stats
        self.batched_rows = 0  # decode rows run in batches of more than one
        self.batched_pieces = 0  # prompt pieces fed in passes of more than one

    def generate(self, generation: Generation) -> Iterator[int]:
        """Run ``generation`` (see ``Generation.stream`` for what comes out)."""
        with self._changed:
            if self._ending:  # no worker will run it: its caller must not wait for ever
                generation.end("stopped")
                return generation.stream()
            if not self._arriving:
                self._arrived_at = time.monotonic()
            self._arriving.append(generation)
            self._start_worker()
            self._changed.notify_all()
        return generation.stream()

    @property
    def spare_bytes(self) -> int:
        """Bytes the decode step's pools hold beyond their rows' caches (spare rows and
        slots), as of its last step: the cache memory's ledger counts them too."""
        return self._step.spare_bytes

    def close(self) -> None:
        """Stop the worker after its step under way, its generations ending as stopped,
        and wait for it; generations asked for afterwards end at once. A scheduler made
        for one run (a benchmark's) then holds nothing of it: a worker between two steps
        still holds the generations of the last."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if self._worker is not None:
            self._worker.join()

    @property
    def _ending(self) -> bool:
        return self._closed or _exiting.is_set()

    def load(self) -> int:
        """Generations under way now (arriving or running)."""
        with self._changed:
            return len(self._arriving) + len(self._running)

    # ---- the worker -----------------------------------------------------------------------

    def _start_worker(self) -> None:
        if self._worker is None:
            # A daemon, holding the scheduler weakly: it ends with the process, and a
            # scheduler nobody uses any more can be freed with its model.
            self._worker = threading.Thread(target=_work, args=(weakref.ref(self),),
                                            name="h2o-chat-scheduler", daemon=True)
            self._worker.start()
            _workers.add(self)  # stopped and joined at exit (``stop_workers``)

    def _next_step(self, timeout: float) -> list[Generation] | None:
        """The generations of the next step; None when none came within ``timeout``."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._arriving or self._running or self._ending,
                                          timeout=timeout):
                return None
            if self._arriving:
                due = self._arrived_at + self.gather_s
                if not self._running:  # nothing else to do meanwhile
                    while not self._ending and (left := due - time.monotonic()) > 0:
                        self._changed.wait(left)
                if time.monotonic() >= due:
                    self._running += self._arriving
                    self._arriving = []
            return list(self._running)

    def _stop_all(self) -> None:
        """End every generation as stopped: the workers are told to stop (``stop_workers``)."""
        with self._changed:
            generations, self._arriving, self._running = self._arriving + self._running, [], []
        with torch.inference_mode():
            for generation in generations:
                if not generation.done.is_set():
                    _give_up(generation)

    def _run(self, generations: list[Generation]) -> None:
        model = self._model()  # alive: every caller holds it
        try:
            with torch.inference_mode():
                for generation in generations:
                    if generation.stopping:
                        _give_up(generation)
                # Chosen before any runs: a generation that ends in this step lets go of
                # its token list, which its caller may then change.
                decode, prompts = [], []
                for generation in generations:
                    if not generation.done.is_set():
                        (decode if generation.is_decode else prompts).append(generation)
                del decode[self.max_batch :]
                for start in range(0, len(prompts), PROMPT_ROWS):
                    self._feed_pieces(model, prompts[start : start + PROMPT_ROWS])
                if decode:
                    self._decode(model, decode)
        except BaseException as err:  # a bug here must not leave its callers waiting for ever
            for generation in generations:
                if not generation.done.is_set():
                    generation.end("failed", err)
        self.steps += 1
        with self._changed:
            self._running = [g for g in self._running if not g.done.is_set()]

    def _feed_pieces(self, model, prompts: list[Generation]) -> None:
        """Feed the next piece of each of ``prompts``' chunks, in one pass. A cache evicts
        only after its chunk's last piece, so pieces keep what one pass would."""
        ends = [min(prompt.chunk_end, prompt.fed + self.prefill_piece) for prompt in prompts]
        parts = [prompt.fed > prompt.chunk_start or end < prompt.chunk_end for prompt, end in zip(prompts, ends)]
        with _holding(prompts):
            try:
                for prompt, part in zip(prompts, parts):
                    if part:
                        prompt.cache.hold_eviction(True)
                pieces = [prompt.tokens[prompt.fed : end] for prompt, end in zip(prompts, ends)]
                if len(prompts) == 1:
                    logits = forward_one(model, prompts[0].cache, torch.tensor(pieces, device=model.device))[None]
                else:
                    logits = forward_pieces(model, [prompt.cache for prompt in prompts], pieces)
                    self.batched_pieces += len(prompts)
                for prompt, end, part in zip(prompts, ends, parts):
                    if part and end == prompt.chunk_end:
                        prompt.cache.hold_eviction(False)
            except BaseException as err:  # reported to the callers; the worker carries on
                for prompt in prompts:
                    prompt.end("failed", err)
                return
            settle_pass(prompts, ends, logits)

    def _decode(self, model, rows: list[Generation]) -> None:
        """One pass for the next token of every row, then every row's next token drawn at
        once. Rows whose cache cannot be a row of the decode step decode alone."""
        with _holding(rows):
            stepped, alone = self._step.partition([row.cache for row in rows])
            stepped, alone = [rows[i] for i in stepped], [rows[i] for i in alone]
            for row in stepped:  # its cache joins the step's pools now, until its turn ends
                if row.on_end is None:
                    row.on_end = functools.partial(self._step.release, row.cache)
            passes = [(stepped, self._step)] if stepped else []
            passes += [([row], _alone) for row in alone]
            for generations, step in passes:
                try:
                    logits = step(model, [g.cache for g in generations], [g.tokens[g.fed] for g in generations])
                except BaseException as err:  # every row's cache is for its caller to put back
                    for generation in generations:
                        generation.end("failed", err)
                    continue
                if len(generations) > 1:
                    self.batched_rows += len(generations)
                quiet_s = min(self.wake_per_row_s * len(generations), self.wake_max_s)
                settle_pass(generations, [g.fed + 1 for g in generations], logits, quiet_s)


def _work(scheduler_ref: weakref.ref) -> None:
    while (scheduler := scheduler_ref()) is not None:
        step = scheduler._next_step(timeout=1.0)
        if scheduler._ending:
            scheduler._stop_all()
            return
        if step:
            scheduler._run(step)
        # Neither held while idle: the scheduler can be freed, and so can the caches of
        # the turns just ended, which the server counts until they are.
        del scheduler, step


@contextlib.contextmanager
def _holding(generations: list[Generation]) -> Iterator[None]:
    """Every one of ``generations``' locks held: taken at every step for every row, at a
    fifth of what ``ExitStack`` costs a lock (0.05 against 0.27 ms for 512 rows)."""
    held = 0
    try:
        for generation in generations:
            generation.lock.acquire()
            held += 1
        yield
    finally:
        for generation in generations[:held]:
            generation.lock.release()


def _give_up(generation: Generation) -> None:
    """End a stopped generation with what it has fed so far."""
    with generation.lock:
        try:
            if generation.fed > generation.chunk_start:
                # Pieces went in with eviction held: bring the cache to its budget.
                generation.cache.hold_eviction(False)
        except BaseException as err:
            generation.end("failed", err)
            return
        generation.end("stopped")


def forward_one(model, cache: Cache, ids: torch.Tensor) -> torch.Tensor:
    """One conversation's forward pass: the logits of the last of ``ids``, ``(vocab,)``."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


def _alone(model, caches: list[Cache], tokens: list[int]) -> torch.Tensor:
    """A decode step of one cache on its own: its logits as ``(1, vocab)``."""
    return forward_one(model, caches[0], torch.tensor([tokens], device=model.device))[None]


def settle_pass(generations: list[Generation], ends: list[int], logits: torch.Tensor,
                quiet_s: float = 0.0) -> None:
    """After a pass that fed ``generations[i]`` up to ``ends[i]``, row ``i`` of ``logits``
    predicting what follows: each takes the pass, and the tokens due are drawn at once
    (each reader woken for its token unless it was less than ``quiet_s`` ago)."""
    due: list[tuple[int, Generation]] = []
    draws = []
    for row, (generation, end) in enumerate(zip(generations, ends, strict=True)):
        try:
            draw = generation.fed_to(end, logits, row)
        except BaseException as err:
            generation.end("failed", err)
            continue
        if draw is not None:
            due.append((row, generation))
            draws.append(draw)
    if not due:
        return
    try:
        tokens = draw_tokens(logits, [row for row, _ in due], draws)
    except BaseException as err:
        for _, generation in due:
            generation.end("failed", err)
        return
    for (_, generation), token in zip(due, tokens):
        try:
            generation.take(token, quiet_s)
        except BaseException as err:
            generation.end("failed", err)


def forward_pieces(model, caches: list[Cache], pieces: list[list[int]]) -> list[torch.Tensor]:
    """One pass feeding several conversations a piece of their prompts: ``pieces[r]`` go
    to ``caches[r]`` at that cache's own next positions. The pieces are packed one after
    another in one batch row, since a prompt's pass costs about its token count on a CPU
    (padding rows to the longest piece computed up to 40% padding in a serving run); each
    row's attention runs over its own cache and its own tokens (``engine.pieces``).
    The logits of each row's last token, ``(rows, vocab)``."""
    ids = torch.tensor([[token for piece in pieces for token in piece]], device=model.device)
    positions = torch.cat([torch.arange(len(piece), device=model.device) + cache.get_seq_length()
                           for cache, piece in zip(caches, pieces)])[None]
    lasts = torch.tensor(list(itertools.accumulate(len(piece) for piece in pieces)), device=model.device) - 1
    batch = PiecesCache(caches, [len(piece) for piece in pieces])
    out = model(input_ids=ids, position_ids=positions, past_key_values=batch, use_cache=True, logits_to_keep=lasts)
    return out.logits[0]


_schedulers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_schedulers_guard = threading.Lock()


def scheduler_for(model) -> BatchScheduler:
    """The one scheduler of ``model``, shared by every session on it."""
    with _schedulers_guard:
        scheduler = _schedulers.get(model)
        if scheduler is None:
            scheduler = _schedulers[model] = BatchScheduler(model)
        return scheduler


# Set to stop: every worker ends what it runs and returns (``stop_workers``).
_exiting = threading.Event()
_workers: weakref.WeakSet[BatchScheduler] = weakref.WeakSet()


@atexit.register
def stop_workers() -> None:
    """Stop every worker after its step under way, its generations ending as stopped,
    and wait for it; generations asked for afterwards end at once. Called at exit (once
    the program's own threads have ended) and when the server is told to stop. A daemon
    worker still running as the interpreter finalized took the GIL back inside torch
    (freeing a tensor); Python ends such a thread with pthread_exit, whose unwinding
    through torch's C++ frame aborted the process ("terminate called without an active
    exception", exit status 134)."""
    _exiting.set()
    for scheduler in list(_workers):
        scheduler.close()
