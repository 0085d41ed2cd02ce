"""The HTTP API served for real (uvicorn on a free port, in this process, on the
session's SmolLM2) for the API tests, which talk to it with clients nobody here wrote:
the ``openai`` package and ``httpx``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import uvicorn
from openai import OpenAI

from h2o_chat import ChatSession, make_cache
from h2o_chat.admission import Admission
from h2o_chat.api.routes import create_api
from h2o_chat.api.server import uvicorn_config
from h2o_chat.config import AppConfig, load_config
from h2o_chat.runtime import ModelProvider

from .browser_support import free_port

MODEL_ID = "SmolLM2-test"
# A small budget, so a few turns already evict: sink 4 + heavy 24 + recent 24.
CACHE = {"policy": "h2o", "heavy": 24, "recent": 24, "sink": 4}


def api_config(**server) -> AppConfig:
    return load_config(None, {"cache": CACHE, "server": server} if server else {"cache": CACHE})


@contextmanager
def serving(model_and_tokenizer, config: AppConfig) -> Iterator[str]:
    """The API on a free port; yields its base URL (``http://127.0.0.1:PORT``)."""
    provider = ModelProvider(lambda: model_and_tokenizer, MODEL_ID,
                             Admission(config.server.max_concurrent_generations), config.cache,
                             config.server.max_cache_mb).start()
    try:
        provider.get()
    except RuntimeError:
        pass  # settings the model cannot hold: the server says so, on /health and to every turn
    port = free_port()
    server = uvicorn.Server(uvicorn_config(create_api(provider, MODEL_ID, config),
                                           replace(config.server, host="127.0.0.1", port=port)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the API server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def client(url: str, key: str = "unused") -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)


def reference_session(model_and_tokenizer, config: AppConfig) -> ChatSession:
    """The same conversation through the Python API, on the same cache settings."""
    model, tokenizer = model_and_tokenizer
    return ChatSession(model, tokenizer, cache=make_cache(model, **CACHE),
                       system_prompt=config.generation.system_prompt)
