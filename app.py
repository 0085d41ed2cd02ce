"""Start the h2o-chat web app: ``python app.py [--config PATH] [--host H] [--port N] ...``.

Settings come from the YAML config (default ``configs/default.yaml``); flags override it.
The page (at ``/``) opens at once and shows the model loading in the background; the
OpenAI-compatible API is under ``/v1`` on the same port.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys
from pathlib import Path

# Set before gradio is imported: no usage reporting or version check calls from a local app.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Set before torch is imported. Idle OpenMP threads otherwise spin, and beside the web
# server's threads (and anything else on a small CPU) spinning threads stall each other:
# on the 2-core dev machine under load, decoding fell from ~12 to ~1 token/s.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from h2o_chat.config import POLICIES, STORAGE_BITS, ConfigError, load_config  # noqa: E402
from h2o_chat.loading import EMBEDDED_GGUF, load_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description="Start the h2o-chat web app: chat, story and compare views.")
    parser.add_argument("--config", type=Path, default=None,
                        help="YAML config file (default: configs/default.yaml)")
    parser.add_argument("--host", help="address to listen on (default from the config: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default from the config: 7860)")
    parser.add_argument("--share", action="store_true", default=None,
                        help="also ask Gradio for a public share link")
    parser.add_argument("--policy", help=f"cache policy: {', '.join(POLICIES)}")
    parser.add_argument("--heavy", type=int, help="heavy-hitter slots")
    parser.add_argument("--recent", type=int, help="recent-window slots")
    parser.add_argument("--sink", type=int, help="attention-sink slots")
    parser.add_argument("--rolling", action="store_true", default=None,
                        help="rolling positions: cached tokens at their rank in the cache")
    bits = ", ".join(map(str, STORAGE_BITS))
    parser.add_argument("--key-bits", type=int, help=f"storage bits of cached keys: {bits}")
    parser.add_argument("--value-bits", type=int, help=f"storage bits of cached values: {bits}")
    parser.add_argument("--exact-window", type=int,
                        help="newest tokens also kept as the model gave them beside 8- or 4-bit slots (0: none)")
    parser.add_argument("--budget-mb", type=float,
                        help="cache budget per conversation in MB (replaces --heavy and --recent)")
    args = parser.parse_args(argv)
    if args.budget_mb is not None and (args.heavy is not None or args.recent is not None):
        # The budget decides both counts: the ones given would be dropped without a word.
        parser.error("--budget-mb sets the heavy and recent slots itself: give it or --heavy/--recent, not both")
    return args


def overrides(args: argparse.Namespace) -> dict:
    """The flags given, as a nested dict like the config file."""
    sections = {"server": ("host", "port", "share"),
                "cache": ("policy", "heavy", "recent", "sink", "rolling", "key_bits", "value_bits", "exact_window",
                          "budget_mb")}
    return {
        section: values
        for section, keys in sections.items()
        if (values := {k: getattr(args, k) for k in keys if getattr(args, k) is not None})
    }


def load_for_serving(model_config) -> tuple:
    """The model and its tokenizer (``load_model``), then what the process holds by now
    (the model, torch, transformers, the page's and API's code: it lives as long as the
    process) moved out of the garbage collector's view. A full collection walked it in
    150-190 ms on the 2-core machine, stopping every reply meanwhile; the app runs one
    whenever a tab closes and whenever the cache memory is short."""
    loaded = load_model(model_config)
    gc.collect()  # what is garbage now is not kept for ever
    gc.freeze()
    # Frozen objects are skipped by the collection at exit too: extensions that count what
    # outlives the interpreter (Triton's nanobind bindings) would print hundreds of leaks.
    atexit.register(gc.unfreeze)
    return loaded


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        config = load_config(args.config, overrides(args))
    except ConfigError as err:
        sys.exit(f"error: {err}")

    from h2o_chat.admission import Admission
    from h2o_chat.api.server import create_app, listen, serve
    from h2o_chat.ui.app import build_app
    from h2o_chat.runtime import ModelProvider

    try:
        sock = listen(config.server)
    except ConfigError as err:
        sys.exit(f"error: {err}")

    model_id = config.model.source or Path(EMBEDDED_GGUF).stem  # as API clients name it
    name = config.model.source or f"{model_id} (embedded)"
    provider = ModelProvider(lambda: load_for_serving(config.model), name,
                             Admission(config.server.max_concurrent_generations), config.cache,
                             config.server.max_cache_mb).start()
    app = create_app(provider, model_id, config, build_app(provider, config))
    print(f"h2o-chat: loading {name} in the background; the page works meanwhile.", flush=True)
    try:
        serve(app, config.server, sock)
    except KeyboardInterrupt:  # Ctrl-C, once the server has shut down: an ordinary end
        pass
    # Whether uvicorn re-raised the Ctrl-C or returned after its own shutdown.
    print("h2o-chat: stopped.", flush=True)


if __name__ == "__main__":
    main()
