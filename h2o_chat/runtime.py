"""The model's owner: the one model instance the page's sessions and the API's requests
share, loaded in the background, with the one admission every turn on it takes. Both
doors get it; it knows nothing of either."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .admission import Admission
from .config import ServerConfig


@dataclass(frozen=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    name: str
    layers: int
    kv_heads: int
    load_seconds: float


class ModelProvider:
    """Loads the model once, in a background thread, so the page opens while it loads;
    handlers call ``get()``, which waits for it. ``admission`` bounds the turns generating
    at once on the model, over the page and the API together."""

    def __init__(self, loader: Callable[[], tuple[Any, Any]], name: str,
                 admission: Admission | None = None) -> None:
        self._loader, self._name = loader, name
        self.admission = admission or Admission(ServerConfig.max_concurrent_generations)
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
            config = model.config.get_text_config(decoder=True)
            self._loaded = LoadedModel(
                model=model,
                tokenizer=tokenizer,
                name=self._name,
                layers=config.num_hidden_layers,
                kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                load_seconds=time.monotonic() - self._started,
            )
        except BaseException as err:  # shown on the page and raised to every handler
            self._error = err
        finally:
            self._done.set()

    @property
    def ready(self) -> bool:
        return self._loaded is not None

    @property
    def error(self) -> BaseException | None:
        """Why loading failed; None while loading or once loaded."""
        return self._error

    @property
    def loaded_model(self) -> Any | None:
        """The model once loaded, without waiting (None while loading or after a failure)."""
        return None if self._loaded is None else self._loaded.model

    def get(self) -> LoadedModel:
        """The loaded model, waiting for it if needed; RuntimeError if loading failed."""
        self._done.wait()
        if self._loaded is None:
            raise RuntimeError(f"the model failed to load: {self._error}")
        return self._loaded

    @property
    def loading_seconds(self) -> float:
        """Seconds since loading began (how long a page has been waiting)."""
        return time.monotonic() - self._started
