"""The benchmarks' option values, checked: comma lists read into numbers, and whole
numbers below their least refused in one line by the command's own parser (a bad value
otherwise ended in a traceback after the model loaded, or ran for hours)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable


def flag(name: str) -> str:
    """The command-line flag of an ``argparse`` destination."""
    return "--" + name.replace("_", "-")


def refuse_below(parser: argparse.ArgumentParser, args: argparse.Namespace, names: Iterable[str],
                 least: int) -> None:
    """``parser.error`` for the first of ``names`` given below ``least``."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < least:
            parser.error(f"{flag(name)} {value}: must be a whole number from {least}")


def parse_budgets(text: str) -> list[float]:
    budgets = [float(x) if "." in x else int(x) for x in text.split(",") if x]
    if not budgets or any(b <= 0 or (isinstance(b, float) and b > 1) for b in budgets):
        raise ValueError(text)
    return budgets


def parse_counts(text: str, allow_none: bool = False) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if (not counts and not allow_none) or any(n < 1 for n in counts):
        raise ValueError(text)
    return counts


def parse_shares(text: str) -> list[float]:
    shares = [float(x) for x in text.split(",") if x.strip()]
    if not shares or any(not 0 < x <= 1 for x in shares):
        raise ValueError(text)
    return shares


def parse_serve_configs(text: str) -> list[tuple[int, int]]:
    configs = [tuple(parse_counts(c.replace("x", ","))) for c in text.split(",") if c]
    if not configs or any(len(c) != 2 for c in configs):
        raise ValueError(text)
    return configs
