"""Reading outside documents with bounds: JSON of bounded size and depth, zip members
read with a cap, integers in a range.

Python's own errors on hostile documents (RecursionError on deep nesting, ValueError
on a 5,000-digit integer, a zip member that inflates to gigabytes) become InputError
naming the document, before anything large is allocated.
"""

from __future__ import annotations

import json
import re
import zipfile
from typing import Any

from ..config import quoted
from .limits import InputError

MAX_DEPTH = 32  # our documents nest 5 levels at most
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


class _HugeNumber(int):
    """Stands for a JSON integer too long to be a count or an id: an int beyond every range
    here (so each field's own check refuses it by name, as it would the number itself),
    which Python never converts from its digits (a 5,000-digit string is a ValueError, a
    million digits take seconds)."""

    digits: int

    def __new__(cls, text: str) -> _HugeNumber:
        number = super().__new__(cls, -10**30 if text.startswith("-") else 10**30)
        number.digits = len(text.lstrip("-"))
        return number

    def __repr__(self) -> str:
        return f"<a {self.digits:,}-digit number>"


def _integer(text: str) -> int:
    # 20 characters hold every 64-bit integer with its sign (seeds go up to 2**63 - 1).
    return int(text) if len(text) <= 20 else _HugeNumber(text)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


class _RepeatedKey(ValueError):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A key given twice is read as its last value here and as its first by some other
    # readers (a proxy, a validator): refused, as a header sent twice is.
    found = {}
    for key, value in pairs:
        if key in found:
            raise _RepeatedKey(f"the key {quoted(key)} is given twice in one object: keep one")
        found[key] = value
    return found


def read_json(data: bytes | str, what: str, max_bytes: int, max_values: int) -> Any:
    """The JSON document ``data`` (at most ``max_bytes`` long, ``max_values`` values
    besides strings, nested at most ``MAX_DEPTH`` deep); InputError naming ``what``
    otherwise.

    Parsed objects can take many times their text (``[],`` is 3 bytes, an empty list 56),
    so the values are counted on the text first: outside strings, every value but the
    last of a container is followed by a comma.
    """
    if len(data) > max_bytes:
        raise InputError(f"{what} is {len(data):,} bytes; the limit is {max_bytes:,}", what)
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if (values := _separators(raw)) > max_values:  # an upper bound: strings hold some
        values -= sum(_separators(string.group()) for string in _STRING.finditer(raw))
        if values > max_values:
            raise InputError(f"{what} holds {values:,} JSON values besides strings; the limit is "
                             f"{max_values:,}", what)
    try:
        document = json.loads(data, parse_int=_integer, parse_constant=_no_constant, object_pairs_hook=_object)
    except RecursionError:
        raise InputError(f"{what} is nested deeper than {MAX_DEPTH} levels", what) from None
    except _RepeatedKey as err:
        raise InputError(f"{what}: {err}", what) from None
    except (UnicodeDecodeError, ValueError) as err:  # JSONDecodeError is a ValueError
        raise InputError(f"{what}: invalid JSON ({err})", what) from None
    _check_depth(document, what)
    return document


def _separators(text: bytes) -> int:
    return text.count(b",") + text.count(b"[") + text.count(b"{")


def _check_depth(document: Any, what: str) -> None:
    level, depth = [document], 0
    while level:
        depth += 1
        if depth > MAX_DEPTH:
            raise InputError(f"{what} is nested deeper than {MAX_DEPTH} levels", what)
        level = [child for node in level if isinstance(node, (list, dict))
                 for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (list, dict))]


def read_member(archive: zipfile.ZipFile, name: str, max_bytes: int, what: str) -> bytes:
    """Member ``name`` of ``archive``, refused unless stored uncompressed and at most
    ``max_bytes`` long: a stored member occupies its size in the file, so reading it
    costs no more memory than the upload itself (a compressed one can inflate a
    thousandfold). Read with a cap, in case the sizes in the zip lie."""
    info = archive.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED:
        raise InputError(f"{what}: {name} is compressed; session files store their members "
                         "uncompressed, as this app writes them", what)
    if info.file_size > max_bytes:
        raise InputError(f"{what}: {name} is {info.file_size:,} bytes; the limit is {max_bytes:,}", what)
    with archive.open(info) as member:
        data = member.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputError(f"{what}: {name} is over {max_bytes:,} bytes", what)
    return data


def require_int(value: Any, field: str, low: int, high: int, why: str = "") -> int:
    """``value`` if it is an integer in ``low..high`` (a bool is not); InputError naming
    ``field`` and the range (``why`` says where the range comes from)."""
    if low > high:  # "from 78 to 77" would read as a typo: say that nothing fits
        raise InputError(f"{field} = {quoted(value)}: no value fits here: it would have to be at least {low:,} "
                         f"and at most {high:,}" + (f" ({why})" if why else ""), field)
    if type(value) is not int or not low <= value <= high:
        raise InputError(f"{field} = {quoted(value)}: must be an integer from {low:,} to {high:,}"
                         + (f" ({why})" if why else ""), field)
    return value
