"""Stop strings on streamed text: text that may be the start of one is held back until
it is known not to be, so a client never sees a stop string or a piece of it."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""  # text held back: a suffix that some stop string starts with
        self.passed = 0  # characters of the reply before ``pending``: let out
        self.stopped = False
        self.through: int | None = None  # once stopped: the reply's characters to the stop string's end

    def feed(self, chunk: str) -> str:
        """The text that can go out now; after a stop string, ``stopped`` is True and the
        text from it on is dropped. The stop string that ends first in the reply's text
        wins, so what goes out does not depend on how the text was cut into chunks."""
        if self.stopped:
            return ""
        text = self.pending + chunk
        found = [(at + len(stop), at) for stop in self.stops if (at := text.find(stop)) >= 0]
        if found:
            end, at = min(found)
            self.stopped, self.pending, self.through = True, "", self.passed + end
            return text[:at]
        keep = max((size for stop in self.stops for size in range(1, min(len(stop), len(text) + 1))
                    if text.endswith(stop[:size])), default=0)
        self.pending = text[len(text) - keep :]
        self.passed += len(text) - keep
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What was held back, once the reply ended without completing a stop string."""
        text, self.pending = self.pending, ""
        return text
