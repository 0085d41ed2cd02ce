"""Chat and story sessions: one persistent cache per conversation, streamed text out.

A session owns a token list (the whole conversation) and a cache that has been fed a
prefix of it; ``fed`` marks where the cache stops. Each turn appends only the new tokens,
feeds what the cache has not seen yet in chunks, then decodes token by token. The last
sampled token stays unfed until the next turn, so after any stop the invariant holds:
``cache.seen == fed`` and ``tokens[:fed]`` is exactly what the cache has seen.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .engine.build import cache_from_config
from .engine.cache import CacheStats, H2OCache
from .loading import eos_token_ids
from .config import CacheConfig, ConfigError, GenerationConfig, check_field
from .inputs import (InputError, InputLimits, check_chat_turn, check_conversation, check_story_turn,
                     check_system_prompt)
from .pin_text import decode, find_span, shorten
from .scheduler import BatchScheduler, TakeTurns, scheduler_for

@dataclass
class Sampling:
    max_new_tokens: int = GenerationConfig.max_new_tokens
    temperature: float = GenerationConfig.temperature  # 0 = greedy
    top_p: float = GenerationConfig.top_p
    seed: int | None = None
    # The end-of-turn token is not sampled before this many tokens (benchmarks ask for
    # replies of an exact length; max_new_tokens makes the end never come).
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        # The same rules as the config file's generation section, so messages match; a
        # caller's values are input from outside, refused as such.
        for name in ("max_new_tokens", "temperature", "top_p", "seed"):
            try:
                setattr(self, name, check_field(f"generation.{name}", getattr(self, name)))
            except ConfigError as err:
                raise InputError(str(err), name) from None
        if not (isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens <= self.max_new_tokens):
            raise InputError(f"min_new_tokens = {self.min_new_tokens!r}: must be an integer from 0 "
                             f"to max_new_tokens ({self.max_new_tokens})", "min_new_tokens")


def sample_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """Next token from the last position's logits ``(vocab,)``: greedy or nucleus sampling."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(frozen=True)
class Pin:
    """A span of the conversation's tokens that the cache never evicts."""

    id: int
    start: int  # absolute token positions [start, end)
    end: int
    text: str  # what the tokens decode to (so far, while a pinned message is being fed)
    fixed: str | None  # why it cannot be unpinned ("system prompt", "story bible"); None: a user pin

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass
class SessionStats:
    cache: CacheStats
    tokens: int  # tokens in the conversation
    fed: int  # of which the cache has seen
    generated: int  # tokens generated in the current or last turn
    decode_tokens_per_s: float
    prefill_seconds: float


class Session:
    """What chat and story sessions share: the cache, the token list and the decode loop."""

    def __init__(
        self,
        model,
        tokenizer,
        cache: H2OCache | None = None,
        prefill_chunk_size: int = CacheConfig.prefill_chunk_size,
        limits: InputLimits | None = None,
        runner: BatchScheduler | TakeTurns | None = None,
    ) -> None:
        if prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size = {prefill_chunk_size}: must be >= 1")
        self.limits = limits or InputLimits()  # what texts and the conversation may hold
        self.model, self.tokenizer = model, tokenizer
        self.cache = cache or cache_from_config(model, CacheConfig())
        self.prefill_chunk_size = prefill_chunk_size
        self.tokens: list[int] = []
        self.fed = 0
        self._stop = threading.Event()
        self._turn_lock = threading.Lock()
        # Every forward pass goes through the model's one scheduler, which batches the
        # decode steps of all sessions on the model (TakeTurns: one pass at a time).
        self.runner = runner or scheduler_for(model)
        self.reply: list[int] = []  # tokens generated in the current or last turn
        self._decode_tokens_per_s = 0.0
        self._prefill_seconds = 0.0
        self.eos_ids = eos_token_ids(model, tokenizer)
        self._never_sampled: torch.Tensor | None = None  # token ids sampling must skip
        self._eos_tensor = torch.tensor(sorted(self.eos_ids), device=model.device)
        self._fixed_pins: dict[tuple[int, int], str] = {}  # spans pin() users cannot unpin
        self._pin_ids: dict[tuple[int, int], int] = {}  # stable ids of the cache's spans
        # Called after every forward pass, before the next, with the token list, the
        # span [start, end) of it just fed and the logits of its last token; e.g. a
        # fidelity probe feeding the same tokens to a second cache.
        self.observer: Callable[[list[int], int, int, torch.Tensor], None] | None = None

    # ---- public ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the current turn after the forward pass under way (any thread): a token
        being generated, or one chunk of the prefill (the rest stays unfed, read on the
        next send)."""
        self._stop.set()

    def prefill(self) -> None:
        """Feed the tokens the cache has not seen yet (history given to the constructor,
        a resumed file's unfed tokens) now rather than at the next send."""
        with self.between_turns("prefill"):
            self._stop.clear()  # a Stop of the last turn must not cut this short; a new one may
            if self.fed < len(self.tokens):
                self._feed_unfed()

    def stats(self) -> SessionStats:
        return SessionStats(
            cache=self.cache.stats(),
            tokens=len(self.tokens),
            fed=self.fed,
            generated=len(self.reply),
            decode_tokens_per_s=self._decode_tokens_per_s,
            prefill_seconds=self._prefill_seconds,
        )

    def restore(self, tokens: list[int], fed: int) -> None:
        """Take a saved conversation's exact tokens, of which the cache (restored by the
        caller) has seen ``tokens[:fed]``."""
        self.tokens, self.fed = tokens, fed

    # ---- pinned memory --------------------------------------------------------------------

    def pins(self) -> list[Pin]:
        """Every span the cache protects, in the order they were pinned: the system prompt
        or story bible first (``fixed``), then the user's pins."""
        pins = []
        for span in dict.fromkeys(self.cache.spans.ranges):  # unique, in order
            pin_id = self._pin_ids.setdefault(span, len(self._pin_ids) + 1)
            start, end = span
            pins.append(Pin(pin_id, start, end, self.decode(self.tokens[start:end]),
                            self._fixed_pins.get(span)))
        return pins

    def pin(self, text: str, near: int | None = None) -> Pin:
        """Pin the tokens of ``text``'s last occurrence in the conversation (the one
        starting closest to token ``near``, if given), so they are never evicted.

        Matching ignores whitespace, so text copied from the rendered conversation matches
        however the tokenizer split or merged its spaces; the span is the shortest run of
        whole tokens that covers the matched characters (it may include a few characters
        more when ``text`` starts or ends inside a token). Refused, changing nothing, when
        the cache already evicted any of those tokens from some layer or KV head.
        """
        with self.between_turns("pin"):
            start, end = find_span(self.tokenizer, self.tokens, text, near)
            shown = shorten(self.decode(self.tokens[start:end]))
            if (start, end) in self.cache.spans.ranges:
                raise ValueError(f"{shown!r} (tokens {start}..{end - 1}) is already pinned")
            lost = self.cache.evicted(start, end)
            if lost:
                raise ValueError(
                    f"cannot pin {shown!r}: {len(lost)} of its {end - start} tokens were already "
                    "evicted from the cache, and an evicted token cannot come back. Pin text "
                    "while the cache still holds it, or tick 'pin' when sending it.")
            self.cache.protect(start, end)
            return next(p for p in self.pins() if (p.start, p.end) == (start, end))

    def unpin(self, pin_id: int) -> Pin:
        """Let the cache evict the pin's tokens again (they compete on the scores they
        accumulated, so some may go at once). The system prompt and bible stay pinned."""
        with self.between_turns("unpin"):
            pin = next((p for p in self.pins() if p.id == pin_id), None)
            if pin is None:
                raise ValueError(f"there is no pin {pin_id}; pins: "
                                 f"{[p.id for p in self.pins() if not p.fixed]}")
            if pin.fixed:
                raise ValueError(f"pin {pin_id} is the {pin.fixed}: it always stays pinned")
            self.cache.unprotect(pin.start, pin.end)
            return pin

    @contextmanager
    def between_turns(self, action: str) -> Iterator[None]:
        """Hold the session still between turns, for whatever changes or reads its cache
        and history as a whole (pins, saving); RuntimeError naming ``action`` while a turn
        is running."""
        if not self._turn_lock.acquire(blocking=False):
            raise RuntimeError(f"cannot {action} while a reply is being generated: stop it first")
        try:
            yield
        finally:
            self._turn_lock.release()

    # ---- the decode loop ------------------------------------------------------------------

    def _encode(self, text: str, plain: bool = False) -> list[int]:
        """Token ids of ``text``; ``plain`` reads special-token strings as ordinary text."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=plain).input_ids

    def decode(self, ids: Sequence[int]) -> str:
        """The exact text of token ids of this conversation (special tokens included)."""
        return decode(self.tokenizer, ids)

    def _feed_unfed(self) -> torch.Tensor | None:
        """Feed every token the cache has not seen, in chunks; logits of the last one, or
        None when ``stop()`` ended the prefill between two chunks."""
        pending = torch.tensor([self.tokens[self.fed :]], device=self.model.device)
        logits = None
        for chunk in pending.split(self.prefill_chunk_size, dim=1):
            if self._stop.is_set():
                return None  # consistent as it stands: the cache saw tokens[:fed]
            try:
                logits = self.runner.forward(self.cache, chunk)
                if self.observer is not None:
                    self.observer(self.tokens, self.fed, self.fed + chunk.shape[1], logits)
            except BaseException:
                self._rebuild_cache(self.fed)
                raise
            self.fed += chunk.shape[1]
        return logits

    def _rebuild_cache(self, upto: int) -> None:
        """Refill the cache from scratch with ``tokens[:upto]``; later tokens stay unfed.

        Needed after a forward pass failed midway (some layers took the chunk, some did
        not) or to take back fed tokens: evictions cannot be undone in place.
        """
        self.cache.reset()
        self.fed = 0
        self.tokens, rest = self.tokens[:upto], self.tokens[upto:]
        try:
            if upto:
                self._feed_unfed()
        finally:
            self.tokens += rest

    def _take_back(self, length: int) -> None:
        """Forget every token from ``length`` on, from the history and the cache."""
        for span in set(self.cache.spans.ranges) - set(self._fixed_pins):
            if span[1] > length:  # a pin on the tokens taken back (pinned as sent)
                self.cache.unprotect(*span)
        if self.fed > length:
            self._rebuild_cache(length)
        del self.tokens[length:]

    def _generate(self, new_tokens: list[int], sampling: Sampling,
                  pin: tuple[int, int] | None = None) -> Iterator[str]:
        """Append ``new_tokens`` (pinning ``new_tokens[pin[0]:pin[1]]`` if given), then
        stream the decoded text of up to ``sampling.max_new_tokens`` generated tokens,
        collected in ``self.reply`` (including a final end-of-turn token). Callers hold
        ``self._turn_lock``."""
        self._stop.clear()
        length = len(self.tokens)
        self.tokens.extend(new_tokens)
        self.reply = generated = []
        try:
            if pin is not None:
                # Not fed yet, so nothing of it can have been evicted: this always works.
                self.cache.protect(length + pin[0], length + pin[1])
            with self.runner.turn():
                yield from self._decode_loop(sampling)
        except BaseException:
            if not generated:
                self._take_back(length)  # nothing came of the new tokens: forget them
            raise

    def _decode_loop(self, sampling: Sampling) -> Iterator[str]:
        generated = self.reply
        self._decode_tokens_per_s = 0.0
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
        started = time.perf_counter()
        logits = self._feed_unfed()
        self._prefill_seconds = time.perf_counter() - started
        decode_started, emitted = time.perf_counter(), ""
        for step in range(sampling.max_new_tokens):
            if step and not self._stop.is_set():
                logits = self._feed_unfed()
            if logits is None or self._stop.is_set():
                break
            never = self._eos_tensor if step < sampling.min_new_tokens else self._never_sampled
            if never is not None:
                logits = logits.index_fill(0, never, float("-inf"))
            token = sample_token(logits.cpu(), sampling, generator)
            self.tokens.append(token)
            generated.append(token)
            self._decode_tokens_per_s = step / max(time.perf_counter() - decode_started, 1e-9)
            if token in self.eos_ids:
                break
            text = self.decode(generated)
            # A multi-byte character may span tokens: wait until it is complete.
            if not text.endswith("\ufffd") and len(text) > len(emitted):
                yield text[len(emitted) :]
                emitted = text


class ChatSession(Session):
    """A multi-turn chat on one persistent cache, in the model's chat template.

    Each turn renders the conversation with the template and feeds only the text after
    what was already fed; the system prompt is protected from eviction by default.

    ``history`` (user/assistant messages, no system) starts the chat mid-conversation:
    an evicting cache cannot go back in time, so regenerating, undoing or editing a turn
    means a fresh session on the edited history. Its tokens are fed, in chunks, on the
    next ``send``.
    """

    def __init__(
        self,
        model,
        tokenizer,
        cache: H2OCache | None = None,
        system_prompt: str | None = GenerationConfig.system_prompt,
        protect_system_prompt: bool = True,
        prefill_chunk_size: int = CacheConfig.prefill_chunk_size,
        history: Sequence[Mapping[str, str]] = (),
        limits: InputLimits | None = None,
        runner: BatchScheduler | TakeTurns | None = None,
    ) -> None:
        super().__init__(model, tokenizer, cache, prefill_chunk_size, limits, runner)
        if tokenizer.chat_template is None:
            raise ValueError("this tokenizer has no chat template: use StorySession for plain text")
        system_prompt, history = check_conversation(system_prompt, history, self.limits)
        self.messages: list[dict[str, str]] = []
        self._template_text = ""  # the template text of self.tokens
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
            self._template_text = tokenizer.apply_chat_template(self.messages, tokenize=False)
            self.tokens = self._encode(self._template_text)
            if protect_system_prompt:
                self.cache.protect(0, len(self.tokens))
                self._fixed_pins[(0, len(self.tokens))] = "system prompt"
        if history:
            # Encoded apart from the system prompt, as turns are, so the protected span
            # covers exactly the system prompt's tokens.
            self._template_text, new_tokens, _ = self._render_new(self.messages + history, False)
            self.tokens += new_tokens
            self.messages += history

    @property
    def template_text(self) -> str:
        """The chat template's rendering of what ``tokens`` hold."""
        return self._template_text

    def restore(self, tokens: list[int], fed: int, template_text: str) -> None:
        """``Session.restore`` plus the chat template's text of ``tokens``."""
        with self.between_turns("restore"):
            super().restore(tokens, fed)
            self._template_text = template_text

    def send(self, text: str, pin: bool = False, **sampling) -> Iterator[str]:
        """Add a user message and stream the assistant's reply as text chunks; ``pin``
        pins the message's tokens (its content, not the template around it)."""
        if not check_chat_turn(text, self.messages, self.limits).strip():
            raise InputError("message is empty: type something to send", "the message")
        return self._turn(text, Sampling(**sampling), pin)

    def _turn(self, text: str, sampling: Sampling, pin: bool = False) -> Iterator[str]:
        with self._turn_lock:
            messages = self.messages + [{"role": "user", "content": text}]
            rendered, new_tokens, contents = self._render_new(messages, True)
            before = (self.messages, self._template_text)
            self.messages = messages + [{"role": "assistant", "content": ""}]
            self._template_text = rendered
            try:
                yield from self._generate(new_tokens, sampling, contents[-1] if pin else None)
            except BaseException:
                if not self.reply:
                    # Failed before the first token and _generate took the tokens back:
                    # the turn never happened.
                    self.messages, self._template_text = before
                    raise
                self._record_reply(rendered)
                raise
            self._record_reply(rendered)

    def _record_reply(self, rendered: str) -> None:
        """Put the reply, whole or partial (stopped, failed, abandoned), into the history."""
        reply = self.reply
        self._template_text = rendered + self.decode(reply)
        ending = 1 if reply and reply[-1] in self.eos_ids else 0
        self.messages[-1]["content"] = self.decode(reply[: len(reply) - ending])

    def _render_new(self, messages: list[dict[str, str]],
                    add_generation_prompt: bool) -> tuple[str, list[int], list[tuple[int, int]]]:
        """Render ``messages`` (the current ones plus new ones) with the chat template and
        return the text and the tokens of what follows the text already fed, and where
        each new message's content lies in those tokens.

        The new messages' contents are tokenized as plain text, so a message that
        contains the template's control tokens as text (say "<|im_end|>") cannot end a
        turn or fake a role. To tell contents from template text, the new messages are
        rendered once more with markers in place of their contents.
        """

        def render(msgs: list[dict[str, str]]) -> str:
            return self.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=add_generation_prompt
            )

        rendered = render(messages)
        if not rendered.startswith(self._template_text):
            raise RuntimeError("the chat template re-rendered earlier turns differently; cannot append")
        old = len(self.messages)
        contents = {f"\ue000{i}\ue001": m["content"] for i, m in enumerate(messages[old:])}
        marked = render(messages[:old] + [dict(m, content=mark) for m, mark in zip(messages[old:], contents)])
        pieces = _MARKER.split(marked[len(self._template_text) :])
        if "".join(contents.get(p, p) for p in pieces) != rendered[len(self._template_text) :]:
            raise RuntimeError("the chat template changes message contents (e.g. trims them); "
                               "cannot tell contents from control tokens")
        tokens, spans = [], []
        for piece in pieces:
            if piece in contents:
                content = self._encode(contents[piece], plain=True)
                spans.append((len(tokens), len(tokens) + len(content)))
                tokens += content
            else:
                tokens += self._encode(piece)
        return rendered, tokens, spans


# Private-use characters around an index: markers no real message is expected to contain.
_MARKER = re.compile(r"(\ue000\d+\ue001)")


class StorySession(Session):
    """Free-form continuation of a text (no chat template), e.g. a long story.

    ``bible`` (characters, facts) goes before the story and its tokens are never evicted,
    so the model keeps attending to it however long the story gets. ``text`` is the story
    after it.
    """

    def __init__(
        self,
        model,
        tokenizer,
        cache: H2OCache | None = None,
        bible: str = "",
        prefill_chunk_size: int = CacheConfig.prefill_chunk_size,
        limits: InputLimits | None = None,
        runner: BatchScheduler | TakeTurns | None = None,
    ) -> None:
        super().__init__(model, tokenizer, cache, prefill_chunk_size, limits, runner)
        check_system_prompt(bible, self.limits, "the story bible")
        # A story has no end of turn: an end-of-sequence token would stop the continuation
        # short and land in the text, so each continuation is max_new_tokens of story.
        self._never_sampled = self._eos_tensor
        self.tokens = self._encode(bible) if bible else []
        self.bible_tokens = len(self.tokens)
        if self.tokens:
            self.cache.protect(0, self.bible_tokens)
            self._fixed_pins[(0, self.bible_tokens)] = "story bible"

    @property
    def text(self) -> str:
        return self.decode(self.tokens[self.bible_tokens :])

    def send(self, text: str = "", pin: bool = False, **sampling) -> Iterator[str]:
        """Append ``text`` (may be empty) to the story and stream its continuation;
        ``pin`` pins ``text``'s tokens."""
        check_story_turn(text, len(self.decode(self.tokens)), self.limits)
        if not self.tokens and not text:
            raise InputError("the story is empty: write a beginning to continue from", "the new story text")
        if pin and not text:
            raise InputError("nothing to pin: no new text to append", "the new story text")
        return self._turn(text, Sampling(**sampling), pin)

    def _turn(self, text: str, sampling: Sampling, pin: bool = False) -> Iterator[str]:
        with self._turn_lock:
            new_tokens = self._encode(text) if text else []
            yield from self._generate(new_tokens, sampling, (0, len(new_tokens)) if pin else None)
