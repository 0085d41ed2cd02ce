"""What several test modules share: feeding a model, injecting failures, session checks,
and the path of the shipped text excerpt."""

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from h2o_chat import make_cache

# Tests read only the data the project ships (see tests/data/README.md).
BOOK_EXCERPT = Path(__file__).resolve().parent / "data" / "pride_and_prejudice_ch1-6.txt"
GREEDY = dict(temperature=0, max_new_tokens=24)


def feed(model, cache, ids, chunk):
    """Feed ``ids`` through ``model`` in chunks; return the logits of every token."""
    with torch.no_grad():
        return torch.cat(
            [model(c, past_key_values=cache, use_cache=True).logits for c in ids.split(chunk, dim=1)], dim=1
        )


def fail_next_update(layer) -> None:
    """Make ``layer``'s next ``update`` raise once, so a forward pass fails after the
    layers before it took the new tokens."""
    update = layer.update

    def failing_update(*args, **kwargs):
        layer.update = update
        raise RuntimeError("injected failure")

    layer.update = failing_update


def fail_next_forward(module) -> None:
    """Make ``module``'s next forward raise once: for a decoder layer, a forward pass fails
    after the layers before it took the new tokens, however its cache takes them (rows of
    a pool take them without their layers' ``update``)."""

    def failing_forward(*args, **kwargs):
        del module.forward  # back to the class's
        raise RuntimeError("injected failure")

    module.forward = failing_forward


def record_slots_attended(cache) -> list[int]:
    """A list that fills, per attention call of layer 0, with the slots attention sees."""
    sizes = []
    layer = cache.layers[0]
    update = layer.update

    def spy(*args, **kwargs):
        keys, values = update(*args, **kwargs)
        sizes.append(keys.shape[-2])
        return keys, values

    layer.update = spy
    return sizes


def h2o(model, heavy=48, recent=48, sink=4):
    return make_cache(model, "h2o", heavy=heavy, recent=recent, sink=sink)


def assert_consistent(session):
    """Cache and history agree: the cache saw exactly ``tokens[:fed]``."""
    stats = session.stats()
    assert stats.cache.seen == session.fed <= len(session.tokens)
    assert len(session.tokens) - session.fed <= 1  # at most the last sampled token waits


def assert_at_rest_within_budget(session):
    stats = session.stats().cache
    assert all(layer.held <= stats.budget for layer in stats.layers), (stats.budget, stats.held)


def together(*calls: Callable[[], None]) -> None:
    """Run ``calls`` at once, each in a thread of its own, and wait for all of them."""
    threads = [threading.Thread(target=call) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
