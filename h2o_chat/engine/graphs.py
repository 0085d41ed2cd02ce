"""CUDA graphs of the decode step: launched once as a whole instead of kernel by kernel.

A decode step of a small model on a GPU is hundreds of small kernels, each costing more
to launch from Python than to run. A step's device work (``step._run``) depends only on
its plan tensor and on buffers that stay put for as long as its key does (the pools'
generation, the padded batch size): so the first step of a key runs eagerly (which also
warms up what kernels need on first use), the next one is captured, and every later one
copies its plan into the captured input and replays.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Graphs kept at once; each holds the memory of one step's activations.
KEPT = 24

_streams = threading.local()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's side stream on ``device``, where steps warm up and are captured. One
    per thread and device rather than one per decode step: on an H200 every dropped step
    left 64-96 MiB allocated with all of its own objects collected, most likely the
    matrix libraries' workspaces, which torch allocates per stream and keeps. A thread
    captures one graph at a time, so its steps can share one."""
    streams = getattr(_streams, "by_device", None)
    if streams is None:
        streams = _streams.by_device = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    plan: torch.Tensor  # the static input the graph reads
    logits: torch.Tensor  # the static output it writes


class StepGraphs:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._captured: OrderedDict[tuple, _Captured] = OrderedDict()
        self._warm: set[tuple] = set()
        self._stream = capture_stream(device)
        self.captures = self.replays = 0  # for the GPU check's table
        # Why capturing failed, once it did: every step runs eagerly from then on.
        self.failure: str | None = None

    def run(self, key: tuple, plan: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``step(plan on the device)``: eagerly the first time ``key`` comes, captured the
        second, replayed from then on. The logits returned by a replay are the graph's own
        buffer: read them before the next step."""
        captured = self._captured.get(key)
        if self.failure is not None:
            return step(plan.to(self.device))
        if captured is None and key not in self._warm:
            # The eager run that warms up what the kernels need on first use (libraries'
            # handles and workspaces), on the stream the capture will use.
            self._warm.add(key)
            current = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                logits = step(plan.to(self.device))
            current.wait_stream(self._stream)
            return logits
        if captured is None:
            try:
                captured = self._capture(key, plan, step)
            except Exception as err:  # a model whose forward cannot be captured still decodes
                self.failure = f"{type(err).__name__}: {err}"
                return step(plan.to(self.device))
        self._captured.move_to_end(key)
        captured.plan.copy_(plan, non_blocking=True)
        captured.graph.replay()
        self.replays += 1
        return captured.logits

    def _capture(self, key: tuple, plan: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor]) -> _Captured:
        self._forget_stale(key)
        static = plan.to(self.device)
        graph = torch.cuda.CUDAGraph()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        # Other threads (a page reading a cache's stats) may use the GPU meanwhile.
        with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
            logits = step(static)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        captured = self._captured[key] = _Captured(graph, static, logits)
        self.captures += 1
        return captured

    def forget(self, serial: int) -> None:
        """Drop every graph over the pool ``serial`` (it emptied: its buffers are gone)."""
        for key in [key for key in self._captured if any(part[0] == serial for part in key)]:
            del self._captured[key]
        self._warm = {key for key in self._warm if all(part[0] != serial for part in key)}

    def _forget_stale(self, key: tuple) -> None:
        """Drop graphs over buffers since replaced (a pool's older generation) and the
        least recently used beyond ``KEPT``."""
        current = {(serial, generation) for serial, generation, *_ in key}
        serials = {serial for serial, _ in current}
        for old in list(self._captured):
            if any(serial in serials and (serial, generation) not in current for serial, generation, *_ in old):
                del self._captured[old]
        while len(self._captured) >= KEPT:
            self._captured.popitem(last=False)
