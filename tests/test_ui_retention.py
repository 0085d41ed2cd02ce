"""The retention map's data and HTML, checked against the cache's own stats."""

import math
import re

import numpy as np
import pytest
import torch

from h2o_chat import make_cache
from h2o_chat.ui import retention

from .helpers import feed


@pytest.fixture
def bounded(tiny_model):
    """A tiny-model cache past its budget (4 sink + 6 heavy + 6 recent) with [0, 3) pinned."""
    torch.manual_seed(1)
    cache = make_cache(tiny_model, "h2o", heavy=6, recent=6, sink=4)
    cache.protect(0, 3)
    feed(tiny_model, cache, torch.randint(0, 128, (1, 40)), 7)
    return cache


def test_hold_counts_match_the_cache(bounded):
    stats = bounded.stats()
    held = retention.hold_matrix(stats, 42, kv_heads=2)  # 2 tokens not fed yet
    assert held.shape == (3, 2, 42)
    counts, total = retention.hold_counts(held)
    assert total == 6
    expected = np.zeros(42, dtype=int)
    for layer in stats.layers:
        for head in layer.positions[0]:
            expected[head.numpy()] += 1
    assert np.array_equal(counts, expected)
    assert counts.sum() == sum(layer.held for layer in stats.layers) * 2
    assert (counts[:3] == 6).all()  # pinned: every layer and head
    assert (counts[-6 - 2 : -2] == 6).all()  # the recent window
    assert (counts[40:] == 0).all() and (counts[3:34] < 6).any()
    # One layer and head: exactly the positions that pair holds.
    one = retention.select(held, layer=1, head=0)
    counts_one, total_one = retention.hold_counts(one)
    assert total_one == 1
    assert counts_one.nonzero()[0].tolist() == stats.layers[1].positions[0, 0].sort().values.tolist()


def test_hold_matrix_refuses_fewer_tokens_than_seen(bounded):
    with pytest.raises(ValueError, match="seen"):
        retention.hold_matrix(bounded.stats(), 10, kv_heads=2)


def test_heat_rows_average_heads_and_downsample_keeps_means(bounded):
    held = retention.hold_matrix(bounded.stats(), 40, kv_heads=2)
    rows = retention.heat_rows(held)
    assert rows.shape == (3, 40)
    assert np.array_equal(rows, held.mean(1))
    assert np.array_equal(retention.heat_rows(held, head=1), held[:, 1].astype(float))
    small = retention.downsample(rows, max_columns=7)  # bins of 6, the last of 4
    assert small.shape == (3, 7)
    assert np.allclose(small[:, 0], rows[:, :6].mean(1))
    assert np.allclose(small[:, -1], rows[:, 36:].mean(1))
    assert retention.downsample(rows, max_columns=40) is rows


_RUN = re.compile(r'<span class="(\w+)" title="#(\d+)(?:–(\d+))?: ([^"]*)">([^<]*)</span>')


def _runs(page: str) -> list[tuple[str, int, int, str, str]]:
    """The token map's spans: class, first and last position, title text, token text."""
    return [(cls, int(first), int(last or first), title, text)
            for cls, first, last, title, text in _RUN.findall(page)]


def _classes(page: str) -> dict[int, str]:
    """The class each position is drawn with, runs spread out again."""
    return {pos: cls for cls, first, last, _, _ in _runs(page) for pos in range(first, last + 1)}


def _one_class(count: int, total: int, fed: bool) -> str:
    """A token's class as the map drew it with one span per token."""
    if not fed:
        return "pd"
    return "ev" if count == 0 else f"k{math.ceil(count * retention.LEVELS / total)}"


def test_token_map_runs_draw_each_token_as_one_span_per_token_did(bounded):
    stats = bounded.stats()
    held = retention.hold_matrix(stats, 42, kv_heads=2)
    counts, total = retention.hold_counts(held)
    pieces = [f"<t{i}>" for i in range(42)]
    page = retention.token_map_html(pieces, counts, total, seen=stats.seen)
    runs = _runs(page)
    assert _classes(page) == {pos: _one_class(int(counts[pos]), total, pos < stats.seen)
                              for pos in range(42)}
    assert len(runs) < 42  # runs of equal state share a span
    assert all(a[0] != b[0] for a, b in zip(runs, runs[1:]))  # and each run is maximal
    assert "".join(text for *_, text in runs) == "".join(f"&lt;t{i}&gt;" for i in range(42))
    for cls, first, last, title, _ in runs:  # the title gives the run's counts
        run = counts[first : last + 1]
        if cls.startswith("k"):
            low, high = int(run.min()), int(run.max())
            assert title == f"kept by {low if low == high else f'{low}–{high}'} of {total} pairs"
    newest = retention.token_map_html(pieces, counts, total, seen=40, max_tokens=10,
                                      note=" while it streams")
    assert sorted(_classes(newest)) == list(range(32, 42))
    assert "newest 10 of 42 tokens while it streams" in newest
    assert newest.count("<div") == page.count("<div") == 3  # the same blocks either way


def test_token_states_round_up_and_mark_unfed_tokens():
    states = retention.token_states(np.array([0, 1, 5, 6, 60, 0]), total=60, seen=5)
    assert states.tolist() == [0, 1, 1, 1, retention.LEVELS, retention.LEVELS + 1]


def test_heatmap_png_is_one_pixel_per_layer_and_column(bounded):
    from io import BytesIO

    from PIL import Image

    rows = retention.heat_rows(retention.hold_matrix(bounded.stats(), 40, kv_heads=2))
    image = Image.open(BytesIO(retention.heatmap_png(rows)))
    assert image.size == (40, 3)
    assert image.getpixel((0, 0)) == (29, 78, 216, 255)  # pinned: held by all
    evicted = [x for x in range(40) if rows[0, x] == 0]
    assert evicted and all(image.getpixel((x, 0))[3] == 0 for x in evicted)  # see-through
    titles = [f"row {i}" for i in range(3)]
    page = retention.heatmap_html(rows, selected_layer=2, caption="all heads", row_titles=titles)
    assert page.count("data:image/png;base64,") == 1
    assert re.findall(r'<li( class="sel")? data-layer="(\d)" title="([^"]*)"', page) == [
        ("", "0", "row 0"), ("", "1", "row 1"), (' class="sel"', "2", "row 2")]
    assert "nothing" in retention.heatmap_html(rows[:, :0], None, "", [])


def test_maps_html_renders_the_picked_layer_and_head(bounded):
    stats = bounded.stats()
    pieces = [f"t{i}" for i in range(41)]
    token_map, heat_map = retention.maps_html(pieces, stats, kv_heads=2, layer=1, head=0)
    kept = set(stats.layers[1].positions[0, 0].tolist())
    classes = _classes(token_map)
    assert {pos for pos, cls in classes.items() if cls == "k10"} == kept  # 1 of 1 pair holds it
    assert {pos for pos, cls in classes.items() if cls == "ev"} == set(range(40)) - kept
    assert classes[40] == "pd"
    assert "KV head 0" in heat_map and "layer 1 outlined" in heat_map
    assert f'title="layer 1, KV head 0: keeps {len(kept)} of 40 positions, {40 - len(kept)} evicted"' in heat_map
    assert heat_map.count("<li") == 3 and 'data-layer="1" title=' in heat_map


def test_layer_rows_count_what_each_layer_keeps(bounded):
    stats = bounded.stats()
    held = retention.hold_matrix(stats, 40, kv_heads=2)
    rows = retention.layer_rows(held, None, stats.seen)
    assert len(rows) == 3
    for index, (line, layer) in enumerate(zip(rows, stats.layers)):
        anywhere = len(set(layer.positions[0].flatten().tolist()))
        assert line == (f"layer {index}, all 2 KV heads: each keeps "
                        f"{layer.held} of 40 positions ({40 - layer.held} evicted); "
                        f"{anywhere} kept by at least one head")


def test_blocks_note_names_only_the_blocks_the_settings_have():
    h2o = {"policy": "h2o", "heavy": 6, "recent": 6, "sink": 4}
    both = retention.blocks_note(h2o, pinned=3, evicted=True)
    assert "left: the first 4 tokens" in both and "3 pinned tokens" in both
    assert "right: the recent window, the newest 6 tokens" in both and "heavy hitters" in both
    assert "pinned" not in retention.blocks_note(h2o, pinned=0, evicted=True)
    window = retention.blocks_note({"policy": "recent", "recent": 8}, pinned=0, evicted=True)
    assert "left" not in window and "newest 8 tokens" in window and "heavy" not in window
    assert retention.blocks_note(h2o, pinned=3, evicted=False).startswith("Nothing evicted yet")


def test_maps_html_says_nothing_is_evicted_before_the_budget_fills(tiny_model):
    cache = make_cache(tiny_model, "h2o", heavy=6, recent=6, sink=4)
    feed(tiny_model, cache, torch.randint(0, 128, (1, 10)), 5)
    _, heat_map = retention.maps_html([f"t{i}" for i in range(10)], cache.stats(), 2, None, None)
    assert "Nothing evicted yet" in heat_map and "Solid block" not in heat_map


def test_the_map_shows_the_budget_by_turn(tiny_model):
    """A turns cache: one part per turn (what comes before the first one too), each titled
    with its positions and the slots it holds, which add up to what the cache holds."""
    cache = make_cache(tiny_model, "turns", heavy=12, recent=4, sink=2)
    starts = (20, 45, 70)
    for start in starts:
        cache.mark_turn(start)
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (1, 90))
    for begin, end in zip((0, *starts), (*starts, 90)):
        feed(tiny_model, cache, ids[:, begin:end], end - begin)
    stats = cache.stats()
    _, heat = retention.maps_html(["x"] * 90, stats, 2, None, None)
    titles = re.findall(r'class="tshare t\d" style="flex-grow:[\d.]+" title="([^"]+)"', heat)
    assert [t.split(",")[0] for t in titles] == ["before the first turn", "turn 1", "turn 2", "turn 3"]
    assert titles[1].startswith("turn 1, tokens #20–44: ") and titles[3].startswith("turn 3, tokens #70–89: ")
    slots = [float(re.search(r": ([\d.]+) slots per layer", t)[1]) for t in titles]
    assert sum(slots) == pytest.approx(stats.held, abs=0.2)
    first = np.mean([((layer.positions >= 20) & (layer.positions < 45)).sum(-1).float().mean().item()
                     for layer in stats.layers])
    assert slots[1] == pytest.approx(first, abs=0.05)
    assert "Budget by turn" in heat
    plain = make_cache(tiny_model, "h2o", heavy=12, recent=4, sink=2)
    feed(tiny_model, plain, ids, 30)
    assert "Budget by turn" not in retention.maps_html(["x"] * 90, plain.stats(), 2, None, None)[1]


def test_the_budget_by_turn_names_the_pinned_slots_its_shares_are_of(tiny_model):
    # The gauge says "budget 16 + 3 pinned"; the turns' shares, of all 19 slots, were
    # titled "of the budget", which a reader takes for the 16.
    cache = make_cache(tiny_model, "turns", heavy=10, recent=4, sink=2)
    cache.protect(0, 3)
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (1, 60))
    for begin, end in ((0, 20), (20, 40), (40, 60)):
        if begin:
            cache.mark_turn(begin)
        feed(tiny_model, cache, ids[:, begin:end], end - begin)
    stats = cache.stats()
    assert (stats.budget, stats.pinned) == (19, 3)
    _, heat = retention.maps_html(["x"] * 60, stats, 2, None, None)
    titles = re.findall(r'class="tshare t\d" style="flex-grow:[\d.]+" title="([^"]+)"', heat)
    assert len(titles) == 3
    for title in titles:
        slots, share = re.search(r": ([\d.]+) slots per layer and KV head, (\d+)% of the 19 slots held "
                                 r"at most \(budget 16 \+ 3 pinned\)$", title).groups()
        assert abs(int(share) - 100 * float(slots) / 19) <= 1
    plain = make_cache(tiny_model, "turns", heavy=10, recent=4, sink=2)
    plain.mark_turn(20)
    feed(tiny_model, plain, ids[:, :20], 20)
    feed(tiny_model, plain, ids[:, 20:40], 20)
    _, heat = retention.maps_html(["x"] * 40, plain.stats(), 2, None, None)
    assert "% of the budget" in heat


def test_a_character_split_over_tokens_shows_whole_in_the_map(smollm):
    """QA: decoded token by token, each part of a split character showed U+FFFD (an
    emoji as "��"); in a run of a text's tokens it shows whole, on its first token."""
    _, tokenizer = smollm
    text = "I ❤ 東京 🎉 – ok, «là»"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = retention.token_pieces(tokenizer)
    assert any("\ufffd" in piece for piece in pieces(ids))  # the text does split characters
    shown = pieces.in_text(ids)
    assert len(shown) == len(ids) and "".join(shown) == text
    assert "\ufffd" not in "".join(shown)
