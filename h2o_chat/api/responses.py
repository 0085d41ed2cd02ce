"""OpenAI's response objects for chat completions, whole and as server-sent events."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from .turns import Finished, Usage

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Reply:
    """What every object of one response shares."""

    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", self.id or "chatcmpl-" + secrets.token_hex(12))
        object.__setattr__(self, "created", self.created or int(time.time()))

    def completion(self, text: str, finished: Finished) -> dict[str, Any]:
        return {**self._head("chat.completion"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": finished.finish_reason, "logprobs": None}],
                "usage": usage(finished.usage), "h2o": finished.h2o}

    def chunk(self, delta: dict[str, str], finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
                **extra}

    def usage_chunk(self, finished: Finished) -> dict[str, Any]:
        """``stream_options.include_usage``: a last chunk with no choices and the usage."""
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": usage(finished.usage)}

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None}


def usage(counts: Usage) -> dict[str, Any]:
    return {"prompt_tokens": counts.prompt_tokens, "completion_tokens": counts.completion_tokens,
            "total_tokens": counts.prompt_tokens + counts.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": counts.cached_tokens}}


def event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"
