"""A story session: free-form continuation of a text, no chat template."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch

from ..cache_memory import CacheMemory
from ..config import CacheConfig
from ..engine.cache import H2OCache
from ..sampling import Sampling
from ..inputs import InputError, InputLimits, check_story_turn, check_system_prompt
from ..scheduler import BatchScheduler, TakeTurns
from .base import Session


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
        memory: CacheMemory | None = None,
    ) -> None:
        super().__init__(model, tokenizer, cache, prefill_chunk_size, limits, runner, memory)
        # The blank line that sets the bible off from the story (``bible_prefix``) is not
        # the writer's: the limit counts what they wrote.
        check_system_prompt(bible.removesuffix("\n\n"), self.limits, "the story bible")
        # A story has no end of turn: an end-of-sequence token would stop the continuation
        # short and land in the text, so each continuation is max_new_tokens of story.
        self._never_sampled = torch.tensor(sorted(self.eos_ids))
        self.tokens = self._encode(bible) if bible else []
        self.bible_tokens = len(self.tokens)
        if self.tokens:
            self.cache.protect(0, self.bible_tokens)
            self._fixed_pins[(0, self.bible_tokens)] = "story bible"

    @property
    def text(self) -> str:
        """The story after the bible, up to its last whole character (see ``complete_text``)."""
        return self.complete_text(self.tokens[self.bible_tokens :])

    def send(self, text: str = "", pin: bool = False, stop: threading.Event | None = None,
             **sampling) -> Iterator[str]:
        """Append ``text`` (may be empty) to the story and stream its continuation;
        ``pin`` pins ``text``'s tokens; ``stop`` as in ``ChatSession.send``."""
        check_story_turn(text, len(self.decode(self.tokens)), self.limits)
        if not self.tokens and not text:
            raise InputError("the story is empty: write a beginning to continue from", "the new story text")
        if pin and not text:
            raise InputError("nothing to pin: no new text to append", "the new story text")
        sampling = Sampling(**sampling)
        new_tokens = len(self._encode(text)) if text else 0
        self.check_room(new_tokens, "this text and its continuation" if text else "a continuation")
        self.check_memory(new_tokens, sampling.max_new_tokens, new_tokens if pin else 0)
        return self._turn(text, sampling, pin, stop)

    def _turn(self, text: str, sampling: Sampling, pin: bool = False,
              stop: threading.Event | None = None) -> Iterator[str]:
        with self._turn_lock:
            new_tokens = self._encode(text) if text else []
            yield from self._generate(new_tokens, sampling, [(0, len(new_tokens))] if pin else (), stop=stop)
