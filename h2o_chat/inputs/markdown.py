"""Text from outside read as Markdown, its raw HTML kept from acting.

The chat boxes render messages as Markdown, and the Markdown export quotes them: a
message's own Markdown (emphasis, lists, code) stays, but a tag CommonMark passes through
as HTML must not act (a typed ``<div>`` hid the rest of the message; ``</blockquote>``
would close the export's quote of it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from markdown_it import MarkdownIt

_COMMONMARK = MarkdownIt("commonmark")
# What CommonMark reads as the start of raw HTML: a tag, an end tag, a comment, a
# declaration or CDATA, a processing instruction.
_MARKUP_START = re.compile(r"<(?=[A-Za-z/!?])")
_READINGS = 4
_NEWLINE = re.compile(r"(\r\n?|\n)")  # the line ends CommonMark counts lines by


def split_lines(text: str) -> list[str]:
    """``text``'s lines as CommonMark counts them (a lone carriage return ends one too)."""
    return _NEWLINE.split(text)[::2]


def disarm_html(text: str, lt: str) -> str:
    """``text`` with ``lt`` for each ``<`` that starts markup on the lines CommonMark
    reads as raw HTML; other lines, code spans and code blocks among them, keep theirs.
    ``lt`` must not start markup itself (``&lt;``, or ``<`` and an invisible character)."""
    if not _MARKUP_START.search(text):
        return text  # most messages: nothing to parse
    pieces = _NEWLINE.split(text)
    lines = pieces[::2]
    # A changed line can regroup those around it (an HTML block ends, a paragraph takes
    # its place), so the text is read again until no line is HTML. Random mixes of tags,
    # fences and indents settled within 4 readings; a text that takes more (a
    # reading of 100,000 characters takes about 0.3 s) gets every ``<`` replaced.
    for _ in range(_READINGS):
        html = _html_lines(_COMMONMARK.parse("\n".join(lines)))
        if not html:
            pieces[::2] = lines
            return "".join(pieces)
        for index in html:
            lines[index] = _MARKUP_START.sub(lt, lines[index])
    return _MARKUP_START.sub(lt, text)


def _html_lines(tokens: Iterable) -> set[int]:
    lines = set()
    for token in tokens:
        raw_inline = any(child.type == "html_inline" for child in token.children or ())
        if token.map and (token.type == "html_block" or raw_inline):
            lines.update(range(*token.map))
    return lines
