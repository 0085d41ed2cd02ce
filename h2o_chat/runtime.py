"""The model's owner: the one model instance the page's sessions and the API's requests
share, loaded in the background, with the one admission every turn on it takes. Both
doors get it; it knows nothing of either."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .admission import Admission
from .cache_memory import MB, CacheMemory
from .config import CacheConfig, ConfigError, ServerConfig
from .engine.build import cache_from_config
from .scheduler import scheduler_for


class UnfitSettings(RuntimeError):
    """The model loaded, but the server's cache settings make no cache it can hold."""


@dataclass(frozen=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    name: str
    layers: int
    kv_heads: int
    load_seconds: float
    memory: CacheMemory  # what every conversation's caches on it hold, under the server's limit


class ModelProvider:
    """Loads the model once, in a background thread, so the page opens while it loads;
    handlers call ``get()``, which waits for it. ``admission`` bounds the turns generating
    at once on the model, over the page and the API together. ``cache``, the server's
    cache settings, is checked against the model as soon as it is loaded: settings it
    cannot hold (a budget past its context) make the model unavailable, with the
    config's message, rather than every turn failing. ``memory`` counts the bytes every
    conversation's caches hold, page and API together, under ``server.max_cache_mb``."""

    def __init__(self, loader: Callable[[], tuple[Any, Any]], name: str,
                 admission: Admission | None = None, cache: CacheConfig | None = None,
                 max_cache_mb: int = ServerConfig.max_cache_mb) -> None:
        self._loader, self._name, self._cache = loader, name, cache
        self.admission = admission or Admission(ServerConfig.max_concurrent_generations)
        self.memory = CacheMemory(max_cache_mb * MB)
        self._done = threading.Event()
        self._loaded: LoadedModel | None = None
        self._error: BaseException | None = None
        self._started = 0.0

    def start(self) -> ModelProvider:
        self._started = time.monotonic()
        threading.Thread(target=self._load, name="model-loader", daemon=True).start()
        return self

    def _load(self) -> None:
        try:
            model, tokenizer = self._loader()
            self._check_settings(model)
            scheduler = scheduler_for(model)
            self.memory.add_overhead(lambda: scheduler.spare_bytes)
            config = model.config.get_text_config(decoder=True)
            self._loaded = LoadedModel(
                model=model,
                tokenizer=tokenizer,
                name=self._name,
                layers=config.num_hidden_layers,
                kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                load_seconds=time.monotonic() - self._started,
                memory=self.memory,
            )
        except BaseException as err:  # shown on the page and raised to every handler
            self._error = err
            print(f"h2o-chat: {self.failure}", file=sys.stderr, flush=True)
        finally:
            self._done.set()

    def _check_settings(self, model: Any) -> None:
        """``UnfitSettings`` if the server's cache settings make no cache ``model`` can hold."""
        if self._cache is not None:
            try:
                cache_from_config(model, self._cache)
            except ConfigError as err:
                raise UnfitSettings(f"the server's cache settings do not fit the model: {err}; change them "
                                    "in the config file or on the command line and restart the app") from None

    @property
    def ready(self) -> bool:
        return self._loaded is not None

    @property
    def error(self) -> BaseException | None:
        """Why the model cannot serve; None while loading or once loaded."""
        return self._error

    @property
    def failure(self) -> str | None:
        """``error`` in words for the page, ``/health`` and every refused turn; None if
        there is none."""
        if self._error is None:
            return None
        if isinstance(self._error, UnfitSettings):
            return str(self._error)
        # Named, since the libraries' own messages rarely say which model or setting.
        return f"the model {self._name} (model.source) failed to load: {self._error}"

    @property
    def loaded_model(self) -> Any | None:
        """The model once loaded, without waiting (None while loading or after a failure)."""
        return None if self._loaded is None else self._loaded.model

    def get(self) -> LoadedModel:
        """The loaded model, waiting for it if needed; RuntimeError if loading failed."""
        self._done.wait()
        if self._loaded is None:
            raise RuntimeError(self.failure)
        return self._loaded

    @property
    def loading_seconds(self) -> float:
        """Seconds since loading began (how long a page has been waiting)."""
        return time.monotonic() - self._started
