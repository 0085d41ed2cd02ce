"""Evaluation data from ``shared/data`` (see its README): deterministic selections.

The folder is ``$H2O_CHAT_DATA`` if set, else ``../shared/data`` relative to the repository
root. Passages are contiguous token windows that start at an article title (WikiText-2) or
a chapter heading (Pride and Prejudice); the articles/chapters long enough are taken at
evenly spaced indices, so a selection depends only on the files, the tokenizer and ``n``.
The ``eval`` and ``tune`` splits take interleaved indices, so tuning never sees the
passages the comparisons report.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

WIKITEXT = "wikitext2/wiki.test.raw"
BOOK = "books/pride_and_prejudice.txt"
XSUM = "xsum/xsum_0shot.jsonl"
MT_BENCH = "mt_bench/question.jsonl"

# " = Title = " (one '=' each side) starts a WikiText article; " = = Section = = " does not.
_WIKI_TITLE = re.compile(r"^ = [^=].* = $", re.MULTILINE)
_CHAPTER = re.compile(r"^Chapter \d+", re.MULTILINE)


def data_dir() -> Path:
    root = os.environ.get("H2O_CHAT_DATA")
    return Path(root).expanduser() if root else REPO_ROOT.parent / "shared" / "data"


def data_file(name: str) -> Path:
    path = data_dir() / name
    if not path.is_file():
        raise FileNotFoundError(
            f"benchmark data {path} is missing: the benchmarks read shared/data next to the "
            "repository (or set H2O_CHAT_DATA to a folder with the same layout)"
        )
    return path


@dataclass
class Passage:
    source: str  # "wikitext2" or "book"
    title: str
    start_char: int
    ids: list[int] = field(repr=False)


def section_starts(text: str, pattern: re.Pattern) -> list[tuple[int, str]]:
    """(character offset, heading) of every match of ``pattern``, in order."""
    return [(m.start(), m.group(0).strip()) for m in pattern.finditer(text)]


def spread(count: int, n: int, split: str = "eval") -> list[int]:
    """``n`` evenly spaced indices out of ``count``; ``eval`` and ``tune`` are disjoint
    whenever ``count >= 2 * n``."""
    if n < 1 or count < 1:
        return []
    if split not in ("eval", "tune"):
        raise ValueError(f"split {split!r}: must be eval or tune")
    shift = 0.25 if split == "eval" else 0.75
    picked = sorted({min(count - 1, int((i + shift) * count / n)) for i in range(n)})
    return picked


def select_passages(
    text: str, pattern: re.Pattern, tokenizer, n: int, length: int, source: str, split: str = "eval"
) -> list[Passage]:
    """``n`` windows of ``length`` tokens starting at headings whose own section holds at
    least ``length`` tokens (so a passage is one article/chapter, not a splice)."""
    starts = section_starts(text, pattern)
    bounds = [(s, title, starts[i + 1][0] if i + 1 < len(starts) else len(text))
              for i, (s, title) in enumerate(starts)]
    # Cheap character filter first (>= 3 characters per token is safe for English BPE).
    bounds = [b for b in bounds if b[2] - b[0] >= 3 * length]
    long_enough = []
    for start, title, end in bounds:
        ids = tokenizer(text[start:end], add_special_tokens=False).input_ids
        if len(ids) >= length:
            long_enough.append(Passage(source, title, start, ids[:length]))
    if len(long_enough) < n:
        raise ValueError(f"only {len(long_enough)} {source} sections have {length} tokens; asked for {n}")
    return [long_enough[i] for i in spread(len(long_enough), n, split)]


def read_text(name: str) -> str:
    # Text mode turns WikiText's CRLF into LF, as the data README notes.
    return data_file(name).read_text(encoding="utf-8")


def wikitext_passages(tokenizer, n: int, length: int, split: str = "eval") -> list[Passage]:
    return select_passages(read_text(WIKITEXT), _WIKI_TITLE, tokenizer, n, length, "wikitext2", split)


def book_passages(tokenizer, n: int, length: int, split: str = "eval") -> list[Passage]:
    return select_passages(read_text(BOOK), _CHAPTER, tokenizer, n, length, "book", split)


def passages(tokenizer, n_per_source: int, length: int, split: str = "eval") -> list[Passage]:
    """``n_per_source`` WikiText-2 passages then as many book passages, ``length`` tokens each."""
    return (wikitext_passages(tokenizer, n_per_source, length, split)
            + book_passages(tokenizer, n_per_source, length, split))


def xsum_articles(n: int) -> list[dict]:
    """The first ``n`` lines of the H2O paper's XSUM 0-shot file: ``article`` (the prompt)
    and ``summary_gt`` (the reference summary)."""
    rows = []
    with data_file(XSUM).open(encoding="utf-8") as f:
        for line in f:
            if len(rows) == n:
                break
            rows.append(json.loads(line))
    return rows


def mt_bench_questions(n: int | None = None) -> list[dict]:
    """MT-Bench questions in file order, each with two user ``turns``."""
    with data_file(MT_BENCH).open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows if n is None else rows[:n]
