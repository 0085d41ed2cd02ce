"""Peak memory of refusing (or resuming) files: run in a subprocess by test_hostile.py.

    python -m tests.measure_input_memory session|conversation FILE...

Loads the embedded model (weights paged in), then for each file resets the kernel's peak-RSS mark, reads
the file as the app does and prints one JSON line per file: its size, the peak RSS
growth over the RSS before (both in bytes) and the error's type and field, if refused.
"""

import gc
import json
import sys
from pathlib import Path

from h2o_chat import make_cache
from h2o_chat.inputs import InputError
from h2o_chat.loading import load_model
from h2o_chat.sessions.files import load_session, model_identity
from h2o_chat.sessions.transcripts import read_transcript


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main(kind: str, paths: list[str]) -> None:
    model, tokenizer = load_model()
    # A serving process has its weights paged in (by its first turn); the fingerprint
    # that every resume computes first touches them all.
    model_identity(model)
    for path in paths:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # the peak mark (VmHWM) := now
        before = _status_bytes("VmRSS")
        refused = None
        try:
            if kind == "session":
                cache = make_cache(model, "h2o", heavy=16, recent=16, sink=4)
                load_session(path, model, tokenizer, cache)
            else:
                read_transcript(Path(path).read_bytes())
        except InputError as err:
            refused = [type(err).__name__, err.field]
        growth = _status_bytes("VmHWM") - before
        print(json.dumps({"path": path, "size": Path(path).stat().st_size, "growth": growth,
                          "refused": refused}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
