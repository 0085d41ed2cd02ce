"""Where a piece of text lies in a conversation's tokens, for pinning it.

Users copy text from the rendered conversation, whose spaces rarely match how the
tokenizer split or merged them, so matching ignores whitespace. A pin covers whole
tokens: the span is the shortest run of tokens covering the matched characters.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import shorten
from ..inputs import is_blank


def decode(tokenizer, ids: Sequence[int]) -> str:
    """The exact text of ``ids``, special tokens and spacing as they are."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def require_text(text: object) -> None:
    """ValueError unless ``text`` has something to pin."""
    if is_blank(str(text)):
        raise ValueError("nothing to pin: the text is empty")


def find_span(tokenizer, tokens: Sequence[int], text: str, near: int | None = None) -> tuple[int, int]:
    """The token span ``[start, end)`` of ``text``'s last occurrence in ``tokens`` (the one
    starting closest to token ``near``, if given); ValueError if it does not occur."""
    require_text(text)
    needle = "".join(str(text).split())
    firsts, pieces = token_pieces(tokenizer, tokens)
    chars, owner = [], []  # the conversation's non-space characters, and their piece
    for index, piece in enumerate(pieces):
        for char in piece:
            if not char.isspace():
                chars.append(char)
                owner.append(index)
    haystack = "".join(chars)
    found, at = [], haystack.find(needle)
    while at >= 0:
        found.append(at)
        at = haystack.find(needle, at + 1)
    if not found:
        raise ValueError(f"{shorten(text)!r} does not occur in the conversation "
                         "(whitespace is ignored; case and punctuation must match)")
    spans = [(firsts[owner[at]], firsts[owner[at + len(needle) - 1] + 1]) for at in found]
    if near is None:
        return spans[-1]
    return min(reversed(spans), key=lambda span: abs(span[0] - near))


def token_pieces(tokenizer, tokens: Sequence[int],
                 singles: Sequence[str] | None = None) -> tuple[list[int], list[str]]:
    """The text of ``tokens`` cut at the token boundaries a pin can start or end at:
    ``firsts[i]`` is the first token of ``pieces[i]``, plus a final entry, the token
    count. A character whose bytes are split over tokens stays whole in one piece.
    ``singles``: each token's text decoded alone, where the caller has them."""
    if singles is None:
        singles = tokenizer.batch_decode([[t] for t in tokens], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
    firsts, pieces, group = [], [], 0
    for index, piece in enumerate(singles):
        group += 1
        if group > 1 or piece.endswith("\ufffd"):
            piece = decode(tokenizer, tokens[index + 1 - group : index + 1])
            # UTF-8 needs at most 4 bytes: a longer run is not a split character.
            if piece.endswith("\ufffd") and group < 4 and index + 1 < len(singles):
                continue
        firsts.append(index + 1 - group)
        pieces.append(piece)
        group = 0
    return firsts + [len(tokens)], pieces
