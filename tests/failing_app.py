"""The real app (``app.py``), with a failure injected inside any reply to a message that
holds ``FAIL_MARK``: after its first chunk of text, the decode loop raises (before it,
for ``FAIL_FIRST_MARK``). No input from the page makes a turn fail, so this is how the
page's failure path is driven."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script, from tests/: the package is beside it

from h2o_chat.sessions import base  # noqa: E402

FAIL_MARK = "FAILNOW"
FAIL_FIRST_MARK = "FAILFIRST"  # the reply fails before its first token
_decode_loop = base.Session._decode_loop


def _failing_decode_loop(self, sampling):
    asked = self.decode(self.tokens[-12:])  # the turn's message and the template after it
    if FAIL_FIRST_MARK in asked:
        raise RuntimeError("injected failure before the reply")
    for count, chunk in enumerate(_decode_loop(self, sampling)):
        yield chunk
        if FAIL_MARK in asked and count == 0:
            raise RuntimeError("injected failure mid-reply")


if __name__ == "__main__":
    base.Session._decode_loop = _failing_decode_loop
    app = ROOT / "app.py"
    sys.argv = [str(app), *sys.argv[1:]]
    runpy.run_path(str(app), run_name="__main__")
