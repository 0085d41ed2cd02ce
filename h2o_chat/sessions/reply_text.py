"""A streamed reply's text, token by token, from the newest tokens alone.

Decoding the whole reply again for each token it gains costs its length every time: the
embedded model's tokenizer took 0.36 ms for 1,024 tokens and 1.2 ms for 4,096 on the
development machine, in the thread that streams the reply, holding the interpreter's
lock that the decode step's worker needs too. Sixty-four such replies on a GPU spend
more time each step decoding text than the step itself takes. So each new token's text
is decoded from a window: the tokens since the last point where the text was whole
characters, behind the tokens from the point before as context (a tokenizer may drop a
leading space at the start of what it decodes, or join a token to the one before). The
window's text must begin with the context's own: where it does not, the whole reply is
decoded, as before. So the text is what decoding everything gives, wherever that only
grows: bytes that never make a character (SentencePiece's byte fallback turns a whole
run of byte tokens into replacement characters once one of them is invalid, text that
went out included) are replacement characters from where they start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# What a tokenizer decodes the bytes of a character cut short to.
REPLACEMENT = "\ufffd"


class ReplyText:
    """The text of ``tokens`` and of each token added after them, up to the last whole
    character (a trailing replacement character is a character whose bytes are not all
    there yet): ``decode(every token).removesuffix(REPLACEMENT)`` (see the module
    docstring for bytes that never make a character). ``text`` is what went out so far;
    ``grow`` returns what goes out next."""

    def __init__(self, decode: Callable[[Sequence[int]], str], tokens: Sequence[int]) -> None:
        self._decode = decode
        self._tokens = list(tokens)
        self.text = ""
        # The last point where the text was whole characters: its token count (None: none
        # yet), the window's first token, the window's text up to there, and ``text``'s
        # length there.
        self._whole: int | None = None
        self._start, self._context, self._text_at_whole = 0, "", 0
        self._mark(decode(self._tokens))

    def grow(self, tokens: Sequence[int]) -> str:
        """Add ``tokens``; the text they complete (empty while a character is still cut)."""
        self._tokens += tokens
        window = None if self._whole is None else self._decode(self._tokens[self._start :])
        if window is not None and window.startswith(self._context):
            decoded = self.text[: self._text_at_whole] + window[len(self._context) :]
        else:  # no whole point yet, or a tokenizer that decodes a window otherwise
            decoded = self._decode(self._tokens)
        return self._mark(decoded)

    def _mark(self, decoded: str) -> str:
        """Take ``decoded``, the text of every token; where it ends in whole characters, the
        next windows start at the last such point before this one."""
        complete = decoded.removesuffix(REPLACEMENT)
        new = complete[len(self.text) :] if len(complete) > len(self.text) else ""
        if new:
            self.text = complete
        whole = len(self._tokens)
        if decoded == complete == self.text and whole != self._whole:
            # The window starts at the whole point before (the first: at the start), where
            # no character is cut: a run of byte tokens decodes as one (SentencePiece's
            # byte fallback), and one cut inside a character turns every byte of it into
            # a replacement character.
            self._start = 0 if self._whole is None else self._whole
            self._whole, self._text_at_whole = whole, len(self.text)
            self._context = self._decode(self._tokens[self._start : whole])
        return new
