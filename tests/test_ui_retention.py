"""The retention map's data and HTML, checked against the cache's own stats."""

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


def test_token_map_html_classes_follow_the_counts(bounded):
    stats = bounded.stats()
    held = retention.hold_matrix(stats, 42, kv_heads=2)
    counts, total = retention.hold_counts(held)
    pieces = [f"<t{i}>" for i in range(42)]
    page = retention.token_map_html(pieces, counts, total, seen=stats.seen)
    classes = re.findall(r'<span class="(\w+)" title="#(\d+): ', page)
    assert [int(pos) for _, pos in classes] == list(range(42))
    for cls, pos in classes:
        count, pos = int(counts[int(pos)]), int(pos)
        if pos >= 40:
            assert cls == "pd"
        elif count == 0:
            assert cls == "ev"
        else:
            assert cls == f"k{-(-count * retention.LEVELS // total)}"
    assert "&lt;t5&gt;" in page and "<t5>" not in page  # token text is escaped
    newest = retention.token_map_html(pieces, counts, total, seen=40, max_tokens=10)
    assert re.findall(r'title="#(\d+):', newest) == [str(i) for i in range(32, 42)]
    assert "newest 10 of 42" in newest


def test_heatmap_png_is_one_pixel_per_layer_and_column(bounded):
    from io import BytesIO

    from PIL import Image

    rows = retention.heat_rows(retention.hold_matrix(bounded.stats(), 40, kv_heads=2))
    image = Image.open(BytesIO(retention.heatmap_png(rows)))
    assert image.size == (40, 3)
    assert image.getpixel((0, 0)) == (29, 78, 216, 255)  # pinned: held by all
    evicted = [x for x in range(40) if rows[0, x] == 0]
    assert evicted and all(image.getpixel((x, 0))[3] == 0 for x in evicted)  # see-through
    page = retention.heatmap_html(rows, selected_layer=2, caption="all heads")
    assert page.count("data:image/png;base64,") == 1 and 'class="sel"' in page
    assert "nothing" in retention.heatmap_html(rows[:, :0], None, "")


def test_maps_html_renders_the_picked_layer_and_head(bounded):
    stats = bounded.stats()
    pieces = [f"t{i}" for i in range(41)]
    token_map, heat_map = retention.maps_html(pieces, stats, kv_heads=2, layer=1, head=0)
    kept = set(stats.layers[1].positions[0, 0].tolist())
    classes = dict((int(pos), cls) for cls, pos in re.findall(r'<span class="(\w+)" title="#(\d+): ', token_map))
    assert {pos for pos, cls in classes.items() if cls == "k10"} == kept  # 1 of 1 pair holds it
    assert {pos for pos, cls in classes.items() if cls == "ev"} == set(range(40)) - kept
    assert classes[40] == "pd"
    assert "KV head 0" in heat_map and "layer 1 marked" in heat_map
