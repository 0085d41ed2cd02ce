"""What the compare view's fidelity gauge costs: ``python -m tools.measure_fidelity_cost
[runs] [tokens]``.

Each run resets the compare view and sends the same greedy prompt through its real
handler (in process, no browser), then reads the bounded side's decode rate off its gauge
(its own steps only, shadow included when on) and times the whole turn (both sides);
gauge on and off alternate, so a neighbour's load on a shared machine hits both.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as app.py: see the README

import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import gradio as gr  # noqa: E402

from h2o_chat.config import AppConfig  # noqa: E402
from h2o_chat.ui.compare_tab import CompareTab  # noqa: E402
from h2o_chat.runtime import ModelProvider  # noqa: E402
from h2o_chat.ui.settings import Settings  # noqa: E402

PROMPT = "Write a long story about a dragon who guards a library."


class CompareView:
    """The compare tab's components and handlers, driven like the page drives them:
    ``values`` holds what the page would send (each component's current value)."""

    def __init__(self, provider: ModelProvider, config: AppConfig | None = None) -> None:
        config = config or AppConfig()
        with gr.Blocks():
            self.settings = Settings(config)
            self.tab = CompareTab(provider, self.settings, config)
        tab = self.tab
        self.values = {c: c.value for c in (*self.settings.components, *tab.map.pickers,
                                            tab.map.live, tab.fidelity.enabled, tab.swap.signal)}
        self.values[tab.state] = None

    def set(self, **settings) -> None:
        """Set controls by attribute name: a setting (``heavy=8``) or ``fidelity``/``live``."""
        for name, value in settings.items():
            component = {"fidelity": self.tab.fidelity.enabled, "live": self.tab.map.live}.get(name)
            self.values[component or getattr(self.settings, name)] = value

    def send(self, text: str) -> list[dict]:
        """Every update of one turn; the state is kept for the next."""
        updates = list(self._updates(text))
        self.values[self.tab.state] = next(u[self.tab.state] for u in updates if self.tab.state in u)
        return updates

    def _updates(self, text: str) -> Iterator[dict]:
        yield from self.tab.on_send(self.values | {self.tab.text: text})

    def reset(self) -> dict:
        update = self.tab.on_reset(self.values)
        self.values[self.tab.state] = None
        return update

    @property
    def state(self):
        return self.values[self.tab.state]


def bounded_rate(updates: list[dict], view: CompareView) -> float:
    """The bounded side's decode rate shown on its gauge at the end of the turn."""
    gauge = [u[view.tab.bounded_gauge] for u in updates if view.tab.bounded_gauge in u][-1]
    return float(re.search(r'data-tps="([\d.]+)"', gauge).group(1))


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 160
    from h2o_chat import load_model

    provider = ModelProvider(load_model, "SmolLM2").start()
    provider.get()
    view = CompareView(provider)
    view.set(temperature=0, max_new_tokens=tokens)
    rates: dict[bool, list[float]] = {True: [], False: []}
    turns: dict[bool, list[float]] = {True: [], False: []}
    for run in range(2 * runs):
        on = run % 2 == 0
        view.reset()
        view.set(fidelity=on)
        started = time.perf_counter()
        updates = view.send(PROMPT)
        turns[on].append(time.perf_counter() - started)
        rates[on].append(bounded_rate(updates, view))
        print(f"run {run + 1}: fidelity gauge {'on ' if on else 'off'} {rates[on][-1]:.2f} tokens/s "
              f"(bounded side), turn {turns[on][-1]:.1f} s (both sides)", flush=True)
    for on in (True, False):
        values = rates[on]
        print(f"fidelity gauge {'on ' if on else 'off'}: median {statistics.median(values):.2f} tokens/s, "
              f"min {min(values):.2f}, max {max(values):.2f} over {len(values)} runs; "
              f"turn median {statistics.median(turns[on]):.1f} s")
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"bounded side's slowdown with the gauge (medians): {100 * (1 - on / off):.1f}%; whole turn "
          f"{statistics.median(turns[True]) / statistics.median(turns[False]):.2f}x as long")


if __name__ == "__main__":
    main()
