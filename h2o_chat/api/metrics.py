"""Prometheus metrics of the API, in a registry of its own (one per server, so two
servers in one process, as in tests, never share counters)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from h2o_chat.admission import Admission
from h2o_chat.cache_memory import CacheMemory
from h2o_chat.scheduler import BatchScheduler

from .conversations import Conversation

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: a token takes ~0.1 s on a small CPU; a long prefill or queue wait, minutes.
_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _ConversationCollector(Collector):
    """KV memory of the kept conversations, read at scrape time from the stats each
    recorded after its last turn (a busy cache is never read mid-forward)."""

    def __init__(self, conversations: Callable[[], list[Conversation]]) -> None:
        self._conversations = conversations

    def collect(self) -> Iterator[GaugeMetricFamily]:
        conversations = self._conversations()
        stats = [c.stats.cache for c in conversations if c.stats is not None]
        yield GaugeMetricFamily("h2o_chat_api_conversations", "API conversations kept with their caches",
                                value=len(conversations))
        yield GaugeMetricFamily("h2o_chat_kv_bytes_allocated",
                                "Bytes of the KV tensors of the kept API conversations, as allocated",
                                value=sum(s.kv_bytes for s in stats))
        yield GaugeMetricFamily("h2o_chat_kv_bytes_held",
                                "Bytes of the KV slots in use in the kept API conversations",
                                value=sum(s.held_bytes for s in stats))


class _SchedulerCollector(Collector):
    """The model's scheduler, which runs the page's and the API's forward passes: steps
    run, decode rows run in batches of more than one, and its load now."""

    def __init__(self, scheduler: Callable[[], BatchScheduler | None]) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        scheduler = self._scheduler()
        if scheduler is None:  # the model is still loading
            return
        yield CounterMetricFamily("h2o_chat_forward_steps", "Forward passes the model's scheduler ran",
                                  value=scheduler.steps)
        yield CounterMetricFamily("h2o_chat_batched_decode_rows",
                                  "Decode rows run in batches of two or more conversations",
                                  value=scheduler.batched_rows)
        yield GaugeMetricFamily("h2o_chat_scheduler_turns", "Replies (page and API) generating now",
                                value=scheduler.load())


class _AdmissionCollector(Collector):
    """The model's one admission: turns of the page and the API together."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def collect(self) -> Iterator[GaugeMetricFamily]:
        running, waiting = self._admission.load()
        yield GaugeMetricFamily("h2o_chat_generations_running", "Turns holding a generation slot, page "
                                "and API together (at most server.max_concurrent_generations)", value=running)
        # The page's queue lets in at most as many page turns as there are slots: a page
        # turn behind other page turns waits there (its position shown on the page), not here.
        yield GaugeMetricFamily("h2o_chat_generations_waiting", "Turns waiting for a generation slot "
                                "held by another door's turn, page and API together (a page turn "
                                "behind other page turns waits in the page's queue)", value=waiting)


class Metrics:
    """``conversations`` lists the kept API conversations; ``scheduler`` gives the model's
    scheduler, None while the model loads; ``admission`` is the model's one admission and
    ``memory`` the ledger of its caches' bytes."""

    def __init__(self, conversations: Callable[[], list[Conversation]],
                 scheduler: Callable[[], BatchScheduler | None], admission: Admission,
                 memory: CacheMemory) -> None:
        self.registry = registry = CollectorRegistry()
        Gauge("h2o_chat_cache_memory_bytes", "Bytes every conversation's caches hold, page and API: at "
              "rest what they hold, during a turn the most they may reach, with the decode step's spare "
              "rows (at most server.max_cache_mb)",
              registry=registry).set_function(lambda: memory.held)
        self.requests = Counter("h2o_chat_requests", "API requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=registry)
        self.generated_tokens = Counter("h2o_chat_generated_tokens", "Tokens generated",
                                        registry=registry)
        self.prefill_tokens = Counter("h2o_chat_prefill_tokens", "Prompt tokens fed to the model",
                                      registry=registry)
        self.cached_tokens = Counter("h2o_chat_cached_prompt_tokens",
                                     "Prompt tokens a kept conversation's cache had already seen",
                                     registry=registry)
        self.evicted_tokens = Counter("h2o_chat_evicted_tokens",
                                      "Tokens the bounded caches evicted during API turns",
                                      registry=registry)
        self.cancelled = Counter("h2o_chat_cancelled_turns", "API turns stopped because their client "
                                 "left, by the stage they had reached: queued, prefill, decode",
                                 ["stage"], registry=registry)
        for stage in ("queued", "prefill", "decode"):  # shown at 0 before the first
            self.cancelled.labels(stage)
        self.refused = Counter("h2o_chat_refused_requests", "Requests refused before any route ran, "
                               "by why: forbidden_host (a Host the server does not answer to) or "
                               "forbidden_origin (a web page on another origin) or duplicate_header (two of a "
                               "header those checks read) or server_busy (the bodies being read at their "
                               "limit, server.max_body_memory_mb)", ["code"], registry=registry)
        for code in ("forbidden_host", "forbidden_origin", "duplicate_header", "server_busy"):
            self.refused.labels(code)
        self.request_body_bytes = Gauge("h2o_chat_request_body_bytes", "Bytes of the request bodies being "
                                        "received now, page and API (uploads, streamed to disk, aside): "
                                        "at most server.max_body_memory_mb", registry=registry)
        self.active = Gauge("h2o_chat_active_generations", "API turns generating now", registry=registry)
        self.queued = Gauge("h2o_chat_queued_requests", "API requests waiting for a generation slot",
                            registry=registry)
        self.latency = Histogram("h2o_chat_request_seconds", "Chat completion time, from arrival to "
                                 "the last token", buckets=_BUCKETS, registry=registry)
        self.ttft = Histogram("h2o_chat_time_to_first_token_seconds", "Time from arrival to the first "
                              "text of the reply", buckets=_BUCKETS, registry=registry)
        registry.register(_ConversationCollector(conversations))
        registry.register(_SchedulerCollector(scheduler))
        registry.register(_AdmissionCollector(admission))

    def render(self) -> bytes:
        return generate_latest(self.registry)
