"""The GPU check (python -m h2o_chat.bench gpu) in its CPU variant, so it cannot rot
between runs on a GPU: its correctness checks pass, its tables have every row, and its
tolerance tells bfloat16 rounding from a cache that forgets."""

import json

import pytest
import torch

from h2o_chat.bench import gpu, gpu_checks, gpu_models, step
from h2o_chat.bench.__main__ import main
from h2o_chat.engine.build import make_cache

CHECKS = ["rounding of bfloat16 measured", "h2o (budget above the context) equals sdpa",
          "batched rows equal each row alone", "a captured step equals an eager one",
          "kept positions equal the CPU rule for the same scores", "the fused decode attention equals the reference",
          "seeded draws on the device equal the host's", "memory freed between runs"]
CACHES = ["full", "h2o 20%", "h2o 20% K8/V4", "h2o 20% K4/V4 +16 exact"]
SEARCHED = CACHES[: gpu.LARGEST_SEARCHED]  # the caches whose largest batch is searched


def test_tiny_check_on_cpu_passes_and_fills_its_tables(tmp_path):
    assert main(["gpu", "--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu.json").read_text())
    plan = gpu.PLANS["tiny"]
    assert result["passed"] is True and result["device"] == "cpu" and result["skipped"] == []
    (model,) = result["models"]
    assert model["model"] == "tiny" and model["dtype"] == "torch.bfloat16"
    assert model["fused_norms"] == 2 * 2 + 1  # the model runs as the app's would: two a layer, the final one
    assert model["fused_attentions"] == model["fused_mlps"] == 2
    assert [c["name"] for c in model["checks"]] == CHECKS
    # The rounding is a measurement: no verdict; nor the fused kernel's, which a CPU has
    # not (its fallback is the reference itself), nor the draws', whose device is the host.
    # Every other check passed.
    assert [c["passed"] for c in model["checks"]] == [None] + [True] * 4 + [None, None, True], model["checks"]
    draws = next(c for c in model["checks"] if c["name"] == CHECKS[6])["details"]
    drawn = gpu_checks.DRAW_INDICES * gpu_checks.DRAW_ROWS
    assert draws == {"same": drawn, "draws": drawn}
    positions = next(c for c in model["checks"] if c["name"] == CHECKS[4])["details"]
    assert positions["chunk"][0] == positions["chunk"][1] > 0
    assert positions["decode_step"][0] == positions["decode_step"][1] > 0
    batched = next(c for c in model["checks"] if c["name"] == CHECKS[2])["details"]
    assert batched["same_position_sets"] == batched["position_sets"] > 0  # no near-ties in this run

    assert [(r["history"], r["cache"]) for r in model["decode"]] == [
        (plan.history, name) for name in [*CACHES, "stock DynamicCache"]]
    assert all(r["decode_tok_s"] > 0 and r["peak_mb"] > 0 for r in model["decode"])
    for row in model["decode"]:  # a bounded cache holds its budget, the full one everything
        if row["cache"].startswith("h2o"):
            assert row["held"] == int(plan.history * plan.share)
        elif row["cache"] == "full":  # three steps to warm up, then the timed ones
            assert row["held"] == plan.history + 3 + plan.repeats * plan.decode_tokens
    assert [(r["conversations"], r["cache"]) for r in model["serving"]] == [
        (n, name) for name in CACHES for n in plan.batches]
    for row in model["serving"]:
        one = next(r for r in model["serving"] if r["cache"] == row["cache"] and r["conversations"] == 1)
        assert row["aggregate_tok_s"] == pytest.approx(row["per_row_tok_s"] * row["conversations"])
        assert row["scheduled_tok_s"] > 0  # the same rows on through the app's scheduler, read as turns read
        if row["cache"] == "full":  # unlike histories: the later rows read fewer tokens
            many = row["conversations"] > 1
            assert not many or one["kv_held_mb"] < row["kv_held_mb"] < one["kv_held_mb"] * row["conversations"]
        else:  # every bounded row holds its budget
            assert row["kv_mb"] == pytest.approx(one["kv_mb"] * row["conversations"])
    assert [(r["cache"], r["conversations"]) for r in model["step_costs"]] == [
        (name, n) for name in CACHES for n in (plan.batches[0], plan.batches[-1])]
    assert all(r["ops"] > 0 and r["host_reads"] >= 0 for r in model["step_costs"])
    for cost in model["step_costs"]:  # where a step's time goes: on the CPU its operations' own
        names, spent = zip(*cost["heaviest"])
        assert len(names) == step.HEAVIEST and all(name.startswith("aten::") for name in names), names
        assert list(spent) == sorted(spent, reverse=True) and spent[-1] >= 0
    largest = {r["cache"]: r for r in model["largest_batch"]}
    assert list(largest) == SEARCHED == CACHES[:3]
    for row in largest.values():  # projected from the bytes, run up to the cap
        assert row["projected"] == int(plan.memory_mb * gpu.MB * gpu.MEMORY_MARGIN
                                       // (row["conversation_mb"] * gpu.MB + row["step_mb_per_row"] * gpu.MB))
        assert row["confirmed"] == min(row["projected"], plan.max_rows)
        assert row["step_cost"]["ops"] > 0 and len(row["step_cost"]["heaviest"]) == step.HEAVIEST
    # Smaller conversations fit more of them: the paper's throughput argument.
    assert largest["full"]["projected"] < largest["h2o 20%"]["projected"] < largest["h2o 20% K8/V4"]["projected"]
    assert [(r["chunk"], r["cache"]) for r in model["prefill"]] == [
        (chunk, name) for chunk in plan.prefill_chunks for name in CACHES[:2]]
    # The kernels alone: on the CPU only the torch path each replaces runs, and is timed.
    assert [(r["what"], r["path"]) for r in model["kernels"]] == [
        ("attention, float", "torch"), ("attention, float", "sdpa, no scores"), ("attention, K8/V4", "torch"),
        ("eviction, every layer", "torch")]
    assert all(r["ms"] > 0 and r["rows"] == plan.kernel_rows and r["slots"] == int(plan.history * plan.share)
               for r in model["kernels"])
    assert [(r["path"], r["rows"]) for r in model["draws"]] == [
        (path, rows) for rows in sorted({1, gpu.TIMED_DRAW_ROWS, plan.kernel_rows}) for path in ("greedy", "unseeded", "seeded")]
    assert all(r["ms"] > 0 and r["vocab"] == gpu_models.SHAPES["tiny"].vocab for r in model["draws"])

    # The app's loader reads back a saved model: on the CPU its one placement, the same logits.
    assert result["loading_branches"] == [{"branch": "model.device cpu", "ran": True, "why_not": None}]
    (loaded,) = result["loading"]
    assert loaded["passed"] and loaded["details"]["gap"] == 0.0 and loaded["details"]["held"] == 24
    page = (tmp_path / "gpu.md").read_text()
    assert "| kept positions equal the CPU rule for the same scores | pass |" in page
    assert "| rounding of bfloat16 measured | measured |" in page
    assert page.count("| heaviest: operations, ms |") == 2  # the step costs and the largest batches
    assert ", 5 RMS norms fused, 2 attentions and 2 MLPs with stacked projections" in page
    assert "| loads and decodes: model.device cpu | pass |" in page
    for count in plan.batches:  # each quantized design against float h2o, with its target
        assert f"- h2o 20% K8/V4 / h2o 20% at {count} conversations: " in page
        assert f"- h2o 20% K4/V4 +16 exact / h2o 20% at {count} conversations: " in page
    assert page.count("(target >= 0.8x)") == page.count("(target >= 0.9x)") == len(plan.batches)
    assert (f"- {plan.batches[-1]} conversations through the scheduler, a reader per row, against the step alone: "
            "full ") in page
    assert "FAIL" not in page and "not run: they need CUDA" in page
    assert list(model["part_seconds"]) == [
        "the correctness checks", *(f"decode, {name}" for name in [*CACHES, "stock DynamicCache"]),
        *(f"serving, {name}" for name in CACHES), "prefill", "the kernels alone", "the draws alone"]
    assert all(seconds >= 0 for seconds in model["part_seconds"].values()) and "Seconds by part: " in page


def fail_for(cache_name: str, real):
    """``real`` (a part of the check taking the cache's name second), raising for one cache:
    a stand-in for a kernel that does not build on a GPU for one storage design."""
    def part(model, name, *args, **kwargs):
        if name == cache_name:
            raise RuntimeError(f"injected failure for {name}")
        return real(model, name, *args, **kwargs)
    return part


def test_a_part_that_raises_fails_the_check_and_the_rest_still_runs(tmp_path, monkeypatch):
    """One design's error (on a GPU: a kernel that does not build there) costs that design's
    rows only: a lent machine's minutes cannot rerun the parts after it."""
    monkeypatch.setattr(gpu, "serve", fail_for("h2o 20% K8/V4", gpu.serve))
    monkeypatch.setattr(gpu, "decode_row", fail_for("h2o 20% K4/V4 +16 exact", gpu.decode_row))
    def raising(*args):
        raise ValueError("injected check failure")

    monkeypatch.setattr(gpu_checks, "batched_rows_equal_alone", raising)
    assert main(["gpu", "--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 1
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["complete"] is True and result["passed"] is False
    (model,) = result["models"]
    checks = {c["name"]: c for c in model["checks"]}
    assert [c["name"] for c in model["checks"]] == [
        *CHECKS[:-1], "decode, h2o 20% K4/V4 +16 exact ran to its end", "serving, h2o 20% K8/V4 ran to its end",
        "memory freed between runs"]
    batched = checks["batched rows equal each row alone"]
    assert batched["passed"] is False
    assert batched["measured"].startswith("raised ValueError: injected check failure (test_gpu_check.py:")
    assert "Traceback" in batched["details"]["traceback"]
    # The checks after the one that raised ran, and passed.
    assert [checks[name]["passed"] for name in CHECKS[3:5]] == [True, True]
    serving = checks["serving, h2o 20% K8/V4 ran to its end"]
    assert serving["passed"] is False and "RuntimeError: injected failure for h2o 20% K8/V4" in serving["measured"]
    # Every other cache's rows are there, the failed ones' are not; the parts after them ran.
    assert [r["cache"] for r in model["decode"]] == [*CACHES[:3], "stock DynamicCache"]
    assert {r["cache"] for r in model["serving"]} == {CACHES[0], CACHES[1], CACHES[3]}
    assert [r["cache"] for r in model["largest_batch"]] == CACHES[:2]
    assert model["prefill"] and model["kernels"] and result["loading"][0]["passed"]
    assert checks["memory freed between runs"]["passed"] is True  # a part that raised leaks nothing
    page = (tmp_path / "gpu.md").read_text()
    assert "| serving, h2o 20% K8/V4 ran to its end | FAIL | raised RuntimeError: injected failure" in page
    assert "- h2o 20% K4/V4 +16 exact / h2o 20% at 4 conversations: " in page
    assert "- h2o 20% K8/V4 / h2o 20% at" not in page and "ended before the check did" not in page


def test_a_largest_batch_whose_step_cannot_be_profiled_keeps_its_measurement(tmp_path, monkeypatch):
    """The profile of a largest batch's step is a diagnostic: where the profiler fails (on
    a GPU: its tracing library), the batch's size and rate stay, with the error shown."""
    searching = []
    real_search, real_profile = gpu.largest_batch, gpu.profile_step

    def search(*args, **kwargs):
        searching.append(True)
        try:
            return real_search(*args, **kwargs)
        finally:
            searching.pop()

    def profile(*args):
        if searching:
            raise RuntimeError("injected profiler failure")
        return real_profile(*args)

    monkeypatch.setattr(gpu, "largest_batch", search)
    monkeypatch.setattr(gpu, "profile_step", profile)
    assert main(["gpu", "--device", "cpu", "--tiny", "--gpu-parts", "serving,largest", "--out", str(tmp_path)]) == 0
    (model,) = json.loads((tmp_path / "gpu.json").read_text())["models"]
    assert [r["cache"] for r in model["largest_batch"]] == SEARCHED
    for row in model["largest_batch"]:
        assert row["confirmed"] > 0 and row["aggregate_tok_s"] > 0
        assert row["step_cost"] == {"error": "RuntimeError: injected profiler failure"}
    assert all(cost["heaviest"] for cost in model["step_costs"])  # the sweep's own profiles ran
    page = (tmp_path / "gpu.md").read_text()
    assert page.count("| not profiled: RuntimeError: injected profiler failure |") == len(SEARCHED)


def test_a_run_cut_short_leaves_what_it_measured_on_disk(tmp_path, monkeypatch):
    """Each finished part is written at once: a run stopped by its time limit (here an
    interrupt in the kernels' part, which no part catches) leaves the parts before it."""
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu.gpu_kernels, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["gpu", "--device", "cpu", "--tiny", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["complete"] is False and result["passed"] is True
    (model,) = result["models"]
    assert [c["name"] for c in model["checks"]] == CHECKS[:-1]
    assert len(model["decode"]) == len(CACHES) + 1 and model["prefill"] and model["kernels"] == model["draws"] == []
    assert {r["cache"] for r in model["serving"]} == set(CACHES) and len(model["largest_batch"]) == 3
    page = (tmp_path / "gpu.md").read_text()
    assert "**Written while the run went on: it ended before the check did**" in page
    assert "| full |" in page and "Loading a saved model" not in page


def test_only_the_parts_asked_for_run(tmp_path, capsys):
    """A short device time may take only what a target needs (8B: one conversation)."""
    assert main(["gpu", "--device", "cpu", "--tiny", "--gpu-parts", "checks,decode", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["parts"] == ["checks", "decode"] and result["complete"] and result["passed"]
    (model,) = result["models"]
    assert [c["name"] for c in model["checks"]] == CHECKS
    assert [r["cache"] for r in model["decode"]] == [*CACHES, "stock DynamicCache"]
    assert model["serving"] == model["largest_batch"] == model["prefill"] == model["kernels"] == model["draws"] == []
    assert result["loading"] == result["loading_branches"] == []
    page = (tmp_path / "gpu.md").read_text()
    assert "Parts run: checks, decode (of checks, decode, serving, largest, prefill, kernels, loading)." in page
    assert "Loading a saved model" not in page and "they need CUDA" not in page
    # Serving without the largest batch's search.
    assert main(["gpu", "--device", "cpu", "--tiny", "--gpu-parts", "serving", "--out", str(tmp_path)]) == 0
    (model,) = json.loads((tmp_path / "gpu.json").read_text())["models"]
    assert len(model["serving"]) == len(CACHES) * len(gpu.PLANS["tiny"].batches) and model["largest_batch"] == []
    assert [c["name"] for c in model["checks"]] == ["memory freed between runs"]
    with pytest.raises(SystemExit) as exit_:
        main(["gpu", "--device", "cpu", "--tiny", "--gpu-parts", "decode,speed", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--gpu-parts: unknown ['speed']; choose from checks, decode, serving, largest" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["gpu", "--device", "cpu", "--tiny", "--gpu-parts", " , ", "--out", str(tmp_path)])
    assert "--gpu-parts: no part named; choose from checks, decode" in capsys.readouterr().err


@pytest.mark.parametrize("after_runs, passed", [
    ((64, 64, 64), True),  # the first run's workspaces stay, nothing after: freed
    ((64, 64 + 8, 64 + 4), True),  # within the limit
    ((64, 64 + 16, 64 + 32), False),  # each run leaves more: a leak
    ((0, 0, 96), False),  # the last, largest run leaves its memory
])
def test_memory_freed_counts_from_where_the_first_run_left_it(monkeypatch, after_runs, passed):
    """On CUDA the allocator's bytes after each run, against those after the first (MiB;
    torch's allocator stood in for by the figures: the CPU has none)."""
    readings = iter([0, *after_runs])
    monkeypatch.setattr(gpu, "in_use", lambda device: next(readings) * gpu.MB)
    freed = gpu.Freed(torch.device("cuda"))
    for _ in after_runs:
        freed.settle()
    check = freed.check()
    assert check.passed is passed
    assert check.details["first_run_bytes"] == after_runs[0] * gpu.MB
    assert check.details["leftover_bytes"] == max(after_runs) * gpu.MB - after_runs[0] * gpu.MB
    assert f"the first run kept {after_runs[0]:.1f} MiB (first use)" in check.measured


@pytest.fixture(scope="module")
def tiny_bf16():
    return gpu_models.build(gpu_models.SHAPES["tiny"], torch.device("cpu"))


def test_tolerance_tells_rounding_from_forgetting(tiny_bf16):
    """The h2o-equals-sdpa check would fail on a cache that forgot a tenth of the tokens."""
    context, cpu = 90, torch.device("cpu")
    ids = gpu_checks.random_ids(tiny_bf16, context + 4, cpu, seed=1)
    tolerance = gpu_checks.NOISE_FACTOR * gpu_checks.rounding_noise(tiny_bf16, ids, context, 32)
    assert gpu_checks.h2o_equals_sdpa(tiny_bf16, ids, context, 32, tolerance).passed
    forgetting, full = make_cache(tiny_bf16, "h2o", **gpu_checks.h2o_budgets(81)), make_cache(tiny_bf16, "full")
    gaps = []
    with torch.inference_mode():
        for cache in (forgetting, full):  # evicts 9 tokens after the last chunk
            for piece in ids[:, :context].split(32, dim=1):
                tiny_bf16(piece, past_key_values=cache)
        for token in ids[:, context:].split(1, dim=1):
            gaps.append(gpu_checks.logits_gap(tiny_bf16(token, past_key_values=forgetting).logits,
                                              tiny_bf16(token, past_key_values=full).logits))
    assert max(gaps) > 3 * tolerance


def test_parameters_in_float32_and_back_is_exact(tiny_bf16):
    before = {name: p.clone() for name, p in tiny_bf16.named_parameters()}
    with gpu_checks.parameters_in(tiny_bf16, torch.float32):
        assert all(p.dtype == torch.float32 for p in tiny_bf16.parameters())
    for name, param in tiny_bf16.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param, before[name])


@pytest.mark.parametrize("name, shown", [
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<c10::BFloat16>, "
     "std::array<char*, 2> >(int, at::native::CUDAFunctorOnSelf_add<c10::BFloat16>, std::array<char*, 2>)",
     "vectorized_elementwise_kernel<4, CUDAFunctorOnSelf_add<BFloat16>, array<char*, 2> >"[:64]),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(float*, float const*, int)",
     "cunn_SoftMaxForward<4, float, float, float>"),
    ("_attend", "_attend"),
    ("Memcpy DtoH (Device -> Pinned)", "Memcpy DtoH")])
def test_a_kernel_is_named_by_what_it_does_without_its_parameters(name, shown):
    assert step.kernel_name(name) == shown
