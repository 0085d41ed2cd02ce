"""The benchmark code computes what it claims: metrics on known distributions, policy
variants against the engine's own rules, batched side-by-side runs against runs alone,
budgets respected. The benchmarks themselves are commands (python -m h2o_chat.bench)."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h2o_chat import make_cache
from h2o_chat.bench import data, metrics, report
from h2o_chat.bench.speed import decode_stepped, prefill
from h2o_chat.bench.streaming import budget_slots, continue_pass, reference_logprobs, stream_pass
from h2o_chat.bench.variants import MixedPolicy, Variant, bench_cache, h2o_split, standard_variants


# ---- metrics -----------------------------------------------------------------------------


def test_perplexity_of_uniform_distribution_is_vocab_size():
    logits = torch.zeros(5, 7, 32)  # uniform over 32 tokens
    targets = torch.randint(0, 32, (5, 7))
    nll, agree, kl = metrics.token_metrics(logits, targets, torch.log_softmax(logits, -1))
    assert metrics.perplexity(nll) == pytest.approx(32.0, rel=1e-6)
    assert torch.all(kl.abs() < 1e-6)


def test_perplexity_of_known_probabilities():
    # The target gets probability 0.5 and 0.25: ppl = exp(-(ln .5 + ln .25) / 2) = sqrt(8).
    probs = torch.tensor([[0.5, 0.5, 0.0 + 1e-30], [0.25, 0.5, 0.25]])
    nll, _, _ = metrics.token_metrics(probs.log(), torch.tensor([0, 2]), probs.log())
    assert metrics.perplexity(nll) == pytest.approx(math.sqrt(8), rel=1e-5)


def test_kl_of_known_distributions_and_identical_runs():
    p = torch.tensor([[0.5, 0.5]])
    q = torch.tensor([[0.9, 0.1]])
    _, agree, kl = metrics.token_metrics(q.log(), torch.tensor([0]), p.log())
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert float(kl) == pytest.approx(expected, rel=1e-5)
    logits = torch.randn(4, 9, 50)
    _, agree, kl = metrics.token_metrics(logits, torch.zeros(4, 9, dtype=torch.long), torch.log_softmax(logits, -1))
    assert torch.all(kl.abs() < 1e-5) and bool(agree.all())
    summary = metrics.summarize(torch.zeros(3), agree[0, :3], kl[0, :3])
    assert summary["ppl"] == 1.0 and summary["top1"] == 1.0 and summary["tokens"] == 3


def test_kl_ignores_zero_probability_reference_tokens():
    ref = torch.tensor([[1.0, 0.0]]).log()  # log 0 = -inf must not give NaN
    _, _, kl = metrics.token_metrics(torch.tensor([[0.0, 0.0]]), torch.tensor([0]), ref)
    assert float(kl) == pytest.approx(math.log(2), rel=1e-6)


# ---- variants against the engine ---------------------------------------------------------


def feed(model, cache, ids, chunk):
    with torch.no_grad():
        return torch.cat([model(c, past_key_values=cache, use_cache=True).logits for c in ids.split(chunk, 1)], 1)


def positions(cache):
    return [layer.positions for layer in cache.stats().layers]


@pytest.mark.parametrize(
    "variant, policy, budgets",
    [
        (Variant("h", "h2o", heavy=8, recent=6, sink=2), "h2o", dict(heavy=8, recent=6, sink=2)),
        (Variant("r", "recent", recent=10), "recent", dict(recent=10)),
        (Variant("s", "sink", sink=3, recent=7), "sink", dict(sink=3, recent=7)),
    ],
)
def test_variant_equals_engine_policy(tiny_model, variant, policy, budgets):
    ids = torch.randint(0, 128, (2, 70))
    ours, engine = bench_cache(tiny_model, [variant], rows=2), make_cache(tiny_model, policy, **budgets)
    ours_logits, engine_logits = feed(tiny_model, ours, ids, 5), feed(tiny_model, engine, ids, 5)
    torch.testing.assert_close(ours_logits, engine_logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(positions(ours), positions(engine)):
        assert torch.equal(a, b)


def test_variant_equals_engine_with_protected_span(tiny_model):
    ids = torch.randint(0, 128, (1, 60))
    ours = bench_cache(tiny_model, [Variant("h", "h2o", heavy=6, recent=6, sink=1)])
    engine = make_cache(tiny_model, "h2o", heavy=6, recent=6, sink=1)
    for cache in (ours, engine):
        cache.protect(10, 20)
    feed(tiny_model, ours, ids, 7), feed(tiny_model, engine, ids, 7)
    for a, b in zip(positions(ours), positions(engine)):
        assert torch.equal(a, b)


def test_mixed_batch_rows_equal_each_variant_alone(tiny_model):
    torch.manual_seed(7)
    ids = torch.randint(0, 128, (2, 64))
    variants = [
        h2o_split("paper", 16),
        Variant("mean", "h2o", heavy=6, recent=6, sink=4, norm="mean"),
        Variant("decay", "h2o", heavy=6, recent=6, sink=4, decay=0.9),
        Variant("sink", "sink", sink=4, recent=12),
    ]
    mixed = bench_cache(tiny_model, variants, rows=2)
    mixed_logits = feed(tiny_model, mixed, ids.repeat(4, 1), 1)
    for k, variant in enumerate(variants):
        alone = bench_cache(tiny_model, [variant], rows=2)
        torch.testing.assert_close(mixed_logits[2 * k : 2 * k + 2], feed(tiny_model, alone, ids, 1), rtol=1e-4, atol=1e-4)
        for a, b in zip(positions(mixed), positions(alone)):
            assert torch.equal(a[2 * k : 2 * k + 2], b)
    assert mixed.stats().held == 16


def test_mean_normalisation_changes_the_choice():
    from h2o_chat.engine.selection import kept_slots, middle_slots, ranking_key

    scores = torch.tensor([[[3.0, 1.0, 0.9, 1.5, 0.1]]])
    pos = torch.arange(5)[None, None]
    pinned = torch.zeros_like(pos, dtype=torch.bool)

    def kept(variant):
        policy = variant.policy
        key = ranking_key(policy.ranking, scores, pos, seen=5)
        middle = middle_slots(pos, pinned, 0, 4)  # nothing pinned, no sink, the last one recent
        return kept_slots(key, pos, pinned, middle, variant.capacity).flatten().nonzero().flatten().tolist()

    assert kept(Variant("raw", "h2o", heavy=1, recent=1)) == [0, 4]  # the largest sum: the oldest slot
    assert kept(Variant("mean", "h2o", heavy=1, recent=1, norm="mean")) == [3, 4]  # per query: 1.5/2 beats 3/5
    with pytest.raises(ValueError, match="share a capacity"):
        MixedPolicy([Variant("a", "recent", recent=3), Variant("b", "recent", recent=4)])


def test_standard_variants_share_the_budget():
    for slots in (64, 154, 307):
        assert {v.capacity for v in standard_variants(slots)} == {slots}
    assert budget_slots(0.2, 1536) == 307 and budget_slots(64, 1536) == 64


# ---- the streaming passes ----------------------------------------------------------------


def test_full_policy_streamed_agrees_with_its_one_shot_reference(tiny_model):
    ids = torch.randint(0, 128, (2, 50))
    ref = reference_logprobs(tiny_model, ids, chunk=17)
    nll, agree, kl = stream_pass(tiny_model, make_cache(tiny_model, "full"), ids, ref, prefill=4)
    assert bool(agree.all()) and float(kl.abs().max()) < 1e-5
    expected = -ref[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(nll, expected, rtol=1e-4, atol=1e-4)


def test_stream_pass_respects_budget_and_differs_from_full(tiny_model):
    ids = torch.randint(0, 128, (1, 80))
    ref = reference_logprobs(tiny_model, ids)
    cache = bench_cache(tiny_model, standard_variants(12), rows=1)
    nll, agree, kl = stream_pass(tiny_model, cache, ids.repeat(3, 1), ref, prefill=8)
    stats = cache.stats()
    assert stats.held == 12 and all(layer.held == 12 for layer in stats.layers) and stats.seen == 79
    assert float(kl[:, :11].abs().max()) < 1e-4  # before the budget fills nothing differs
    assert float(kl[:, 12:].mean()) > 0


def test_continue_pass_scores_the_continuation(tiny_model):
    ids = torch.randint(0, 128, (1, 60))
    ref = reference_logprobs(tiny_model, ids)
    nll, agree, kl = continue_pass(tiny_model, make_cache(tiny_model, "full"), ids, ref, context=40, chunk=16)
    assert nll.shape == (1, 20) and bool(agree.all()) and float(kl.abs().max()) < 1e-5


# ---- data selection and report -----------------------------------------------------------


def test_spread_is_deterministic_and_splits_are_disjoint():
    assert data.spread(10, 3) == data.spread(10, 3)
    assert not set(data.spread(10, 3, "eval")) & set(data.spread(10, 3, "tune"))
    assert len(data.spread(10, 3)) == 3 and max(data.spread(10, 3, "tune")) < 10


def test_select_passages_takes_whole_sections():
    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return type("E", (), {"input_ids": [ord(c) for c in text]})()

    text = "".join(f"Chapter {i}\n" + ("x" * (10 if i % 2 else 400)) + "\n" for i in range(8))
    chosen = data.select_passages(text, re.compile(r"^Chapter \d+", re.M), Tok(), 2, 100, "book")
    assert [p.title for p in chosen] == ["Chapter 0", "Chapter 4"]
    assert all(len(p.ids) == 100 for p in chosen)


def test_report_writes_json_markdown_and_machine(tmp_path):
    info = report.machine_info()
    assert info["torch_threads"] >= 1 and "cpu" in info
    path = report.write_json(tmp_path, "demo", {"records": [{"a": 1}]})
    assert path.exists() and '"machine"' in path.read_text()
    table = report.md_table(["x", "y"], [[1, 0.12345], ["a", None]])
    assert table.splitlines()[0] == "| x | y |" and "0.1235" in table


def test_the_index_collects_every_page_in_the_folder(tmp_path):
    """QA: after `step` or `storage` alone, index.md held only its heading."""
    machine = report.machine_info()
    for name in ("storage_designs", "step", "a_named_run"):
        report.write_markdown(tmp_path, name, f"title of {name}", f"body of {name}", machine)
    index = (tmp_path / "index.md").read_text()
    assert [index.index(f"body of {n}") for n in ("step", "storage_designs", "a_named_run")] == sorted(
        index.index(f"body of {n}") for n in ("step", "storage_designs", "a_named_run"))


@pytest.mark.parametrize("argv, message", [
    (["speed", "--contexts", "-64"], "--contexts '-64': must be a comma list of whole numbers from 1"),
    (["xsum", "--articles", "-1"], "--articles -1: must be a whole number from 1"),
    (["speed", "--decode-tokens", "0"], "--decode-tokens 0: must be a whole number from 1"),
    (["serve", "--paste-tokens", "-1"], "--paste-tokens -1: must be a whole number from 0"),
    (["serve", "--serve-configs", "2by256"], "--serve-configs '2by256': must be a comma list of "
                                             "CONVERSATIONSxHISTORY pairs of whole numbers from 1, e.g. 4x2048"),
    (["serve", "--serve-turns", "3"], "--serve-turns 3: must be 1 or 2"),
    (["continuation", "--budgets", "abc"], "--budgets 'abc': must be a comma list of fractions above 0"),
    (["bytes", "--shares", "0,0.2"], "--shares '0,0.2': must be a comma list of shares above 0 and at most 1"),
    (["xsum", "--variant", "foo"], "--variant 'foo': must be norm:heavy share:sink"),
    (["readers", "--reader-rows", "16,0"], "--reader-rows '16,0': must be a comma list of whole numbers from 1"),
    (["churn", "--churn-rows", "x"], "--churn-rows 'x': must be a comma list of whole numbers from 1"),
    (["churn", "--churn-passes", "0"], "--churn-passes 0: must be a whole number from 1"),
])
def test_a_value_no_comparison_can_run_with_is_refused_in_one_line(argv, message, capsys):
    """Before anything loads (QA: these ended after the model loaded in a traceback, and
    `--contexts -64` and `--articles -1` started runs of hours without a word)."""
    from h2o_chat.bench.__main__ import parse_args

    with pytest.raises(SystemExit) as ended:
        parse_args(argv)
    assert ended.value.code == 2 and f"error: {message}" in capsys.readouterr().err


def test_missing_data_ends_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    from h2o_chat.bench.__main__ import main

    monkeypatch.setenv("H2O_CHAT_DATA", str(tmp_path / "nowhere"))
    threads = torch.get_num_threads()  # the run sets its own; the tests after it keep theirs
    try:
        assert main(["xsum", "--articles", "1", "--threads", "1", "--out", str(tmp_path / "out")]) == 2
    finally:
        torch.set_num_threads(threads)
    said = capsys.readouterr().err.strip().splitlines()
    assert said[-1].endswith(f"error: xsum: benchmark data {tmp_path / 'nowhere' / data.XSUM} is missing: the "
                             "benchmarks read shared/data next to the repository (or set H2O_CHAT_DATA to a folder "
                             "with the same layout)")
    assert "Traceback" not in "\n".join(said)


def test_xsum_budgets_are_the_papers_ratios():
    from h2o_chat.bench.xsum import xsum_variants

    variants = {v.label: v for v in xsum_variants(500)}
    assert variants["h2o"].heavy == 50 and variants["h2o"].recent == 50 and variants["h2o"].sink == 0
    assert variants["local (recent)"].recent == 100 and variants["sink"].capacity == 100


def test_recall_probe_checks_name_and_code():
    from h2o_chat.bench.long_chat import recalled

    assert recalled("name", "Your name is Marisol Quentaro.") and not recalled("name", "You are Maria.")
    assert recalled("code", "The code is 4817.") and not recalled("code", "It is 4871.")


def test_recall_probe_scores_the_answer_like_one_plain_forward_pass(smollm):
    from h2o_chat import ChatSession
    from h2o_chat.bench.long_chat import ANSWERS, FACT, PROBES, probe

    model, tokenizer = smollm
    session = ChatSession(model, tokenizer, cache=make_cache(model, "full"))
    "".join(session.send(FACT, temperature=0, max_new_tokens=8))
    tokens_before = list(session.tokens)
    answer, nll = probe(session, PROBES["name"], ANSWERS["name"])
    assert session.tokens == tokens_before and session.cache.seen == session.fed  # probes use copies
    rendered = tokenizer.apply_chat_template(session.messages + [{"role": "user", "content": PROBES["name"]}],
                                             tokenize=False, add_generation_prompt=True)
    prompt = session.tokens[:session.fed] + session.tokens[session.fed:] + tokenizer(
        rendered[len(session.template_text):], add_special_tokens=False).input_ids
    target = tokenizer(ANSWERS["name"], add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + target[:-1]])).logits[0, len(prompt) - 1:]
    expected = metrics.token_nll(torch.log_softmax(logits.float(), -1), torch.tensor(target)).mean()
    assert nll == pytest.approx(float(expected), abs=1e-3) and answer


def test_rss_sampler_sees_an_allocation():
    # In a fresh process: in this one, earlier tests leave freed memory resident that a
    # new block may reuse without the RSS moving.
    code = """
import torch
from h2o_chat.bench.speed import RssSampler
with RssSampler() as sampler:
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    block += 1
print(sampler.peak - sampler.start)
"""
    grown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[1]).stdout
    assert int(grown) > 32 * 2**20


def test_the_stepped_decode_times_the_decode_step_and_refuses_a_cache_it_cannot_take(tiny_model):
    cache = make_cache(tiny_model, "h2o", heavy=4, recent=4, sink=2)
    with pytest.raises(ValueError, match="^the decode step cannot take this cache: its layers are not one group"):
        decode_stepped(tiny_model, cache, torch.zeros(1, 8), 3)
    logits = prefill(tiny_model, cache, torch.arange(1, 21)[None], 8)
    decode_stepped(tiny_model, cache, logits, 3)
    assert cache.get_seq_length() == 20 + 1 + 3  # the untimed joining step and the timed ones
    assert cache.stats().held == 10


# ---- position rolling (comparison 6) -------------------------------------------------------


def test_rolling_bench_scores_every_token_in_its_window(tiny_model, tmp_path):
    from h2o_chat.bench import rolling
    from h2o_chat.bench.__main__ import parse_args

    torch.manual_seed(3)
    ids = torch.randint(0, 128, (70,)).tolist()
    quiet = lambda *args: None  # noqa: E731
    with torch.no_grad():
        logits = tiny_model(torch.tensor([ids])).logits[0]  # one pass, no cache
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none")
    # Windows of 32 over 70 tokens: token 0 is never predicted, the last window is short.
    expected = [metrics.perplexity(nll[a:b]) for a, b in ((0, 31), (31, 63), (63, 69))]

    # A budget above the text: nothing is evicted, so every run (full, each policy with
    # absolute and with rolled positions) is the model's own one-pass perplexity.
    roomy = rolling.run(tiny_model, None, 70, budget=80, chunk=8, window=32, ids=ids, log=quiet)
    assert [r["label"] for r in roomy["runs"]] == ["full", "h2o absolute", "sink absolute", "h2o rolling",
                                                   "sink rolling"]
    for run in roomy["runs"]:
        assert [w["tokens"] for w in run["windows"]] == [31, 32, 6]
        assert [w["ppl"] for w in run["windows"]] == pytest.approx(expected, rel=1e-4)
        # All windows lie inside the tiny model's 4096 positions: pooled = the whole run.
        assert rolling.past_trained(roomy)[run["label"]] == {"inside": pytest.approx(run["ppl"]), "past": None}

    tight = rolling.run(tiny_model, None, 70, budget=16, chunk=8, window=32, ids=ids, full=False, log=quiet)
    runs = {r["label"]: r for r in tight["runs"]}
    assert all(r["held_at_end"] <= 16 and all(math.isfinite(w["ppl"]) for w in r["windows"]) for r in runs.values())
    assert runs["h2o rolling"]["ppl"] != pytest.approx(runs["h2o absolute"]["ppl"], rel=1e-4)
    assert tight["config"]["trained_context"] == 4096 and tight["config"]["chunk"] == 8

    report.rolling_plot(tight, tmp_path / "rolling.png")
    assert (tmp_path / "rolling.png").stat().st_size > 0
    assert "| 64–70 | inside |" in report.rolling_markdown(tight)
    # Both presets stream past the real model's 8192-token trained context.
    assert min(parse_args(["rolling", mode]).tokens for mode in ("--quick", "--full")) > 8192


def test_the_churn_bench_ends_a_reply_at_every_pass_of_the_churn_way_only():
    """Churn: one reply ends (and a waiting one takes its place) at every pass timed, with
    more rows than passes and fewer; steady: none ends while timed."""
    from h2o_chat.bench import churn

    result = churn.run([2, 24], passes=12, rounds=1, log=lambda _: None)
    assert [(r["rows"], r["way"]) for r in result["results"]] == [(n, way) for n in (2, 24) for way in churn.WAYS]
    for r in result["results"]:
        assert r["passes"] >= 12 and r["pass_ms"] > 0
        # The count of ends and of passes are read one after the other: one may be a pass ahead.
        assert abs(r["ended"] - r["passes"]) <= 1 if r["way"] == "churn" else r["ended"] == 0
    assert "| 24 | churn | " in churn.markdown(result)


def test_the_readers_bench_times_every_way_for_every_row_count(smollm):
    """Each way runs its chats to their length (a reply ending early raises), and the
    table has every row count and way, the floor at 1.00×."""
    from h2o_chat.bench import readers

    result = readers.run(smollm[1], [1, 3], rounds=1, log=lambda _: None)
    assert [(r["rows"], r["way"]) for r in result["results"]] == [(n, way) for n in (1, 3) for way in readers.WAYS]
    assert all(r["step_ms"] > 0 and len(r["times"]) == 1 for r in result["results"])
    table = readers.markdown(result)
    floor = next(iter(readers.WAYS))
    # Only the floor's own lines are sure to read 1.00×: another way may time the same.
    floor_lines = [line for line in table.splitlines() if f"| {floor} |" in line]
    assert len(floor_lines) == 2 and all(line.endswith("| 1.00× |") for line in floor_lines)
    assert all(f"| {n} | woken as the app does |" in table for n in (1, 3))
