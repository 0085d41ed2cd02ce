"""Expected user errors (an empty message, a bad setting, a turn already running): one
warning toast naming the problem, and the page left as it was.

A ``gr.Error`` would mark every output of the event as failed (a red pill over each, one
of them swallowing clicks on the message box) and print a traceback in the server log;
a refusal is neither a failure of the app nor news to its operator.
"""

from __future__ import annotations

import functools
import html
import inspect
import re
from collections.abc import Callable

import gradio as gr


class Refusal(Exception):
    """A request the app declines; the message is shown to the user as it is."""


def warn(message: str) -> None:
    """The one toast of a refusal (Gradio renders its text as HTML)."""
    gr.Warning(html.escape(message))


def markdown_literal(text: str) -> str:
    """``text`` shown as written in Markdown (one line): a refused file's name such as
    ``my _notes_ [v2](x).txt`` came out in italics, with a link, and "<a 31-digit
    number>" as an HTML link. Only what starts a span is escaped (an underscore inside a
    word, as in ``server.max_page_conversations``, starts none)."""
    return _MARKDOWN_SPECIAL.sub(r"\\\g<0>", text)


_MARKDOWN_SPECIAL = re.compile(r"[\\`*\[\]<>~&]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")


def refusing(handler: Callable, output: gr.components.Component) -> Callable:
    """``handler`` (a function or generator) with a ``Refusal`` turned into a warning and
    an update that leaves ``output`` (any output of the event) unchanged. The wrapper
    keeps the handler's signature, which Gradio reads to pass event data."""
    unchanged = {output: gr.skip()}

    if inspect.isgeneratorfunction(handler):
        @functools.wraps(handler)
        def generator(*args, **kwargs):
            try:
                yield from handler(*args, **kwargs)
            except Refusal as refusal:
                warn(str(refusal))
                yield unchanged
        return generator

    @functools.wraps(handler)
    def function(*args, **kwargs):
        try:
            return handler(*args, **kwargs)
        except Refusal as refusal:
            warn(str(refusal))
            return unchanged
    return function
