"""A chat session: turns rendered with the model's chat template, and the builder every
door (page, compare view, API) starts a chat with."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Mapping, Sequence

from ..cache_memory import CacheMemory
from ..config import CacheConfig, GenerationConfig
from ..engine.build import cache_from_config
from ..engine.cache import H2OCache
from ..sampling import Sampling
from ..inputs import InputError, InputLimits, check_chat_turn, check_conversation, is_blank
from ..scheduler import BatchScheduler, TakeTurns
from .base import Pin, Session
from .pins import find_span, require_text


class ChatSession(Session):
    """A multi-turn chat on one persistent cache, in the model's chat template.

    Each turn renders the conversation with the template and feeds only the text after
    what was already fed; the system prompt is protected from eviction by default.

    ``system_prompt`` None leaves the system turn to the template (some templates write
    a default one, unpinned); any string, the empty one included, is the system turn.

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
        memory: CacheMemory | None = None,
    ) -> None:
        super().__init__(model, tokenizer, cache, prefill_chunk_size, limits, runner, memory)
        if tokenizer.chat_template is None:
            raise ValueError("this tokenizer has no chat template: use StorySession for plain text")
        system_prompt, history = check_conversation(system_prompt, history, self.limits)
        self.messages: list[dict[str, str]] = []
        self._template_text = ""  # the template text of self.tokens
        self._reply_start = ""  # the template text before the last reply
        self._history_spans: list[tuple[int, int]] = []  # each history message's content tokens
        if system_prompt is not None:
            self.messages.append({"role": "system", "content": system_prompt})
            self._template_text = tokenizer.apply_chat_template(self.messages, tokenize=False)
            self.tokens = self._encode(self._template_text)
            if protect_system_prompt:
                self.cache.protect(0, len(self.tokens))
                self._fixed_pins[(0, len(self.tokens))] = "system prompt"
        if history:
            # Encoded apart from the system prompt, as turns are, so the protected span
            # covers exactly the system prompt's tokens.
            self._template_text, new_tokens, contents = self._render_new(self.messages + history, False)
            self._history_spans = [(len(self.tokens) + start, len(self.tokens) + end) for start, end in contents]
            for message, (start, _) in zip(history, self._history_spans):
                if message["role"] == "user":
                    self.cache.mark_turn(start)
            self.tokens += new_tokens
            self.messages += history

    def pin_history(self, index: int) -> Pin:
        """Pin the content of message ``index`` of the ``history`` the chat started from:
        that message's own tokens, wherever else the same text occurs."""
        start, end = self._history_spans[index]
        require_text(self.decode(self.tokens[start:end]))
        return self.pin_span(start, end)

    @property
    def template_text(self) -> str:
        """The chat template's rendering of what ``tokens`` hold."""
        return self._template_text

    def restore(self, tokens: list[int], fed: int, template_text: str) -> None:
        """``Session.restore`` plus the chat template's text of ``tokens``."""
        with self.between_turns("restore"):
            super().restore(tokens, fed)
            self._template_text = template_text

    def send(self, text: str, pin: bool = False, stop: threading.Event | None = None,
             pin_parts: Sequence[str] = (), **sampling) -> Iterator[str]:
        """Add a user message and stream the assistant's reply as text chunks; ``pin``
        pins the message's tokens (its content, not the template around it), and
        ``pin_parts`` the tokens of each of these texts in it (ValueError for one it does
        not hold: matched as ``pin`` matches, its last occurrence); ``stop``,
        once set, ends the turn (set before it begins, nothing is fed). A turn stopped
        (or failed) before the reply's first token is taken back: the conversation is
        as it was before the message."""
        sampling = Sampling(**sampling)
        self.check_message(text, sampling.max_new_tokens, pin or bool(pin_parts))
        for part in pin_parts:
            find_span(self.tokenizer, self.tokenizer.encode(text, add_special_tokens=False), part)
        return self._turn(text, sampling, pin, stop, pin_parts)

    def check_message(self, text: str, reply_tokens: int = 0, pin: bool = False) -> None:
        """Refuse (InputError) a message ``send`` would refuse: empty, past the limits,
        leaving no room for a reply in the model's context, or, with a reply of
        ``reply_tokens``, more than the server's cache memory has room for now."""
        if is_blank(check_chat_turn(text, self.messages, self.limits)):
            raise InputError("message is empty: type something to send", "the message")
        if self.positions_left(0) is None and self.memory is None:
            return
        new_tokens = self._new_tokens(text)
        if self.positions_left(0) is not None:
            self.check_room(new_tokens, "this message and a reply")
        self.check_memory(new_tokens, reply_tokens, new_tokens if pin else 0)

    def message_needs(self, text: str, reply_tokens: int, pin: bool = False) -> dict[H2OCache, int]:
        """``cache_needs`` of a turn that sends ``text`` and generates up to ``reply_tokens``."""
        new_tokens = self._new_tokens(text)
        return self.cache_needs(new_tokens + reply_tokens, new_tokens if pin else 0)

    def _new_tokens(self, text: str) -> int:
        """The tokens a turn sending ``text`` appends (rendered once more in the turn:
        cheap beside it)."""
        return len(self._render_new(self.messages + [{"role": "user", "content": text}], True)[1])

    def continue_reply(self, stop: threading.Event | None = None, **sampling) -> Iterator[str]:
        """Stream more of the last reply, which max_new_tokens or ``stop()`` cut short:
        the cache holds it already, so decoding goes on after its last token (nothing is
        read again) and the chunks extend the same assistant message. Greedy, a reply cut
        and continued equals one that ran the combined length at once."""
        if not self.can_continue:
            raise InputError("nothing to continue: only a reply cut short by its token limit "
                             "(max new tokens) or by Stop can go on; send a message instead",
                             "the reply")
        sampling = Sampling(**sampling)
        self.check_room(0, "more of this reply")
        self.check_memory(0, sampling.max_new_tokens)
        return self._continue(sampling, stop)

    def _turn(self, text: str, sampling: Sampling, pin: bool = False,
              stop: threading.Event | None = None, pin_parts: Sequence[str] = ()) -> Iterator[str]:
        with self._turn_lock:
            messages = self.messages + [{"role": "user", "content": text}]
            rendered, new_tokens, contents = self._render_new(messages, True)
            first, last = contents[-1]
            pins = [(first, last)] if pin else []
            for part in pin_parts:  # found by ``send`` already, so before anything changes
                begin, end = find_span(self.tokenizer, new_tokens[first:last], part)
                pins.append((first + begin, first + end))
            before = (self.messages, self._template_text, self._reply_start)
            start = len(self.tokens)
            self.messages = messages + [{"role": "assistant", "content": ""}]
            self._template_text = self._reply_start = rendered
            # A turn begins with the user's words; the template before them ends the last.
            self.cache.mark_turn(start + first)
            try:
                yield from self._generate(new_tokens, sampling, pins, stop=stop, reply_required=True)
            finally:
                if len(self.tokens) == start:
                    # Failed or stopped before the first token, and _generate took the
                    # tokens back: the turn never happened.
                    self.messages, self._template_text, self._reply_start = before
                else:
                    self._record_reply()

    def _continue(self, sampling: Sampling, stop: threading.Event | None = None) -> Iterator[str]:
        with self._turn_lock:
            try:
                yield from self._generate([], sampling, extend=True, stop=stop)
            finally:
                self._record_reply()

    def _record_reply(self) -> None:
        """Put the reply, whole or partial (stopped, failed, abandoned), into the history.
        A reply cut inside a character keeps the text before it: the template text must
        be the template's rendering of the messages, which the next turn appends to."""
        reply = self.reply
        self._template_text = self._reply_start + self.complete_text(reply)
        ending = 1 if reply and reply[-1] in self.eos_ids else 0
        self.messages[-1]["content"] = self.complete_text(reply[: len(reply) - ending])

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


def chat_session(model, tokenizer, settings: CacheConfig, *, system_prompt: str | None,
                 history: Sequence[Mapping[str, str]] = (), limits: InputLimits | None = None,
                 cache: H2OCache | None = None, memory: CacheMemory | None = None) -> ChatSession:
    """A chat as every door starts one: on a cache of ``settings`` (or on ``cache``, e.g.
    the compare view's full one), read in ``settings``' prefill chunks, its caches
    counted in the server's ``memory``."""
    return ChatSession(model, tokenizer, cache=cache or cache_from_config(model, settings),
                       system_prompt=system_prompt, prefill_chunk_size=settings.prefill_chunk_size,
                       history=history, limits=limits, memory=memory)


# Private-use characters around an index: markers no real message is expected to contain.
_MARKER = re.compile(r"(\ue000\d+\ue001)")
