"""Result files: JSON (with the machine), markdown tables and matplotlib PNGs.

Every comparison writes ``<name>.json`` (all numbers, the configuration and the machine),
``<name>.md`` (the tables) and ``<name>*.png`` into the results folder; ``index.md``
concatenates the markdown of every comparison present in the folder.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

import torch
import transformers

from h2o_chat.config import POLICIES

ORDER = list(POLICIES)  # tables list the policies in this order
COLORS = dict(zip(POLICIES, ["black", "tab:red", "tab:blue", "tab:green"]))


def pyplot():
    """matplotlib's pyplot on its file-only backend, imported when a plot is drawn: the
    GPU check draws none, and the GPU machine it is carried to may lack matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    return plt


def perplexity_bars(records: list[dict], path, xlabel: str, xmin: float | None = None) -> None:
    """One bar per design of ``records`` (besides ``full``): its perplexity over the full
    cache's, every passage pooled."""
    plt = pyplot()
    pooled = {r["policy"]: r for r in records if r["set"] == "all"}
    full = pooled.pop("full")["ppl"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(list(pooled), [r["ppl"] / full for r in pooled.values()])
    ax.axvline(1, color="black", lw=0.8)
    ax.set(xlabel=xlabel, xlim=(xmin, None))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def designs_against_full(records: list[dict]) -> list[tuple[dict, list[float]]]:
    """Per design of a study's ``records`` besides ``full``, in order: its record over
    every passage and its perplexity over the full cache's on WikiText-2, the book and
    both."""
    pooled = {(r["policy"], r["set"]): r for r in records if not r["per_passage"]}
    labels = [label for label in dict.fromkeys(label for label, _ in pooled) if label != "full"]
    return [(pooled[(label, "all")], [pooled[(label, s)]["ppl"] / pooled[("full", s)]["ppl"]
                                      for s in ("wikitext2", "book", "all")]) for label in labels]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import psutil

    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "loadavg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def machine_line(info: dict) -> str:
    return (f"Machine: {info['cpu']}, {info['physical_cores']} cores ({info['logical_cpus']} logical), "
            f"{info['torch_threads']} torch threads, {info['memory_gb']} GB; torch {info['torch']}, "
            f"transformers {info['transformers']}; load average at start {info.get('loadavg_start')}, "
            f"at end {info.get('loadavg')}." + (f" GPU: {info['gpu']}." if info.get("gpu") else ""))


def write_json(out: Path, name: str, result: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    result = dict(result)
    result.setdefault("machine", machine_info())
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    return path


def fmt(value, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_markdown(out: Path, name: str, title: str, body: str, machine: dict) -> Path:
    path = out / f"{name}.md"
    path.write_text(f"## {title}\n\n{machine_line(machine)}\n\n{body}\n")
    write_index(out)
    return path


def write_index(out: Path) -> None:
    """``index.md``: every page in ``out``, the comparisons in the order they run, then
    any other page (a named run of one) by name."""
    order = ["streaming", "streaming-10", "streaming-sweep", "continuation", "tuning", "xsum", "speed", "speed-8k",
             "long_chat", "rolling", "rolling-full", "serve", "serve-8x2048-quiet", "step", "equal_bytes",
             "storage_designs", "tier_study", "budget_shapes", "peer", "gpu"]
    pages = {path.stem for path in out.glob("*.md")} - {"index"}
    names = [n for n in order if n in pages] + sorted(pages - set(order))
    parts = [(out / f"{n}.md").read_text() for n in names]
    (out / "index.md").write_text("# h2o-chat benchmark results\n\n" + "\n".join(parts))


def _policy_key(label: str) -> tuple:
    base = label.split()[0]
    return (ORDER.index(base) if base in ORDER else len(ORDER), label)


def _budget_key(rec: dict) -> tuple:
    return (rec["slots"] is not None, rec["slots"] or 0)


# ---- comparisons 1, 2 and the tuning study -------------------------------------------------


def quality_tables(records: list[dict], phase: str, sets=("wikitext2", "book", "all")) -> str:
    recs = [r for r in records if r["phase"] == phase and not r["per_passage"]]
    full = {r["set"]: r for r in recs if r["policy"] == "full"}
    blocks = []
    for s in sets:
        rows = []
        for r in sorted((r for r in recs if r["set"] == s), key=lambda r: (_budget_key(r), _policy_key(r["policy"]))):
            delta = r["ppl"] / full[s]["ppl"] - 1 if s in full else None
            rows.append([r["budget"], r["slots"], r["policy"], r["ppl"],
                         None if delta is None else f"{delta:+.1%}", f"{r['top1']:.1%}", r["kl"]])
        if rows:
            blocks.append(f"**{s}**\n\n" + md_table(
                ["budget", "slots", "policy", "ppl", "vs full", "top-1 agree", "KL(full‖policy)"], rows))
    return "\n\n".join(blocks)


def per_passage_table(records: list[dict], phase: str, budget: str) -> str:
    recs = [r for r in records if r["phase"] == phase and r["per_passage"] and r["budget"] in (budget, "full")]
    names = sorted({r["set"] for r in recs})
    policies = sorted({r["policy"] for r in recs}, key=_policy_key)
    table = {(r["set"], r["policy"]): r["ppl"] for r in recs}
    rows = [[n] + [table.get((n, p)) for p in policies] for n in names]
    return md_table(["passage"] + [f"ppl {p}" for p in policies], rows)


def quality_plot(records: list[dict], phase: str, path: Path, title: str) -> None:
    plt = pyplot()
    recs = [r for r in records if r["phase"] == phase and not r["per_passage"]]
    sets = [s for s in ("wikitext2", "book", "all") if any(r["set"] == s for r in recs)]
    fig, axes = plt.subplots(2, len(sets), figsize=(4.2 * len(sets), 6.4), squeeze=False)
    for col, s in enumerate(sets):
        full = next((r for r in recs if r["set"] == s and r["policy"] == "full"), None)
        for row, metric in enumerate(("ppl", "kl")):
            ax = axes[row][col]
            for policy in sorted({r["policy"] for r in recs if r["policy"] != "full"}, key=_policy_key):
                pts = sorted((r["slots"], r[metric]) for r in recs if r["set"] == s and r["policy"] == policy)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=policy,
                        color=COLORS.get(policy.split()[0]) if policy in COLORS else None)
            if full is not None and metric == "ppl":
                ax.axhline(full["ppl"], color="black", ls="--", label="full")
            ax.set_xscale("log")
            ax.set_xlabel("cache budget (slots per layer and head)")
            ax.set_ylabel("perplexity" if metric == "ppl" else "KL(full‖policy), nats")
            ax.set_title(f"{s}")
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def target_check(records: list[dict], phase: str, budget: str = "20%", h2o_label: str = "h2o") -> list[str]:
    """The issue's quality target per passage set: h2o ppl within 3% of full and below
    recent and sink at ``budget``."""
    lines = []
    recs = [r for r in records if r["phase"] == phase and not r["per_passage"]]
    for s in ("wikitext2", "book"):
        get = {r["policy"]: r for r in recs if r["set"] == s and r["budget"] in (budget, "full")}
        if not {"full", h2o_label} <= set(get):
            continue
        h, f = get[h2o_label]["ppl"], get["full"]["ppl"]
        others = {p: get[p]["ppl"] for p in ("recent", "sink") if p in get}
        within = h / f - 1 <= 0.03
        below = all(h < v for v in others.values())
        lines.append(
            f"- {s}, {budget}: {h2o_label} ppl {h:.3f} vs full {f:.3f} ({h / f - 1:+.1%}; target ≤ +3%: "
            f"{'met' if within else 'MISSED'}); vs " + ", ".join(f"{p} {v:.3f}" for p, v in others.items())
            + f" (target below both: {'met' if below else 'MISSED'})")
    return lines


# ---- comparison 3 ------------------------------------------------------------------------


def xsum_markdown(result: dict) -> str:
    rows = []
    full = result["summary"].get("full", {})
    for label, s in sorted(result["summary"].items(), key=lambda kv: _policy_key(kv[0])):
        ratio = s["rougeL"] / full["rougeL"] if full.get("rougeL") else None
        rows.append([label, s["budget"], s["rouge1"], s["rouge2"], s["rougeL"],
                     None if ratio is None else f"{ratio:.3f}", s["n"], s["mean_new_tokens"]])
    return md_table(["policy", "budget", "ROUGE-1", "ROUGE-2", "ROUGE-L", "ROUGE-L / full", "articles",
                     "tokens out (mean)"], rows)


def xsum_plot(result: dict, path: Path) -> None:
    plt = pyplot()
    labels = sorted(result["summary"], key=_policy_key)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / 3
    for i, metric in enumerate(("rouge1", "rouge2", "rougeL")):
        ax.bar([x + i * width for x in range(len(labels))], [result["summary"][l][metric] for l in labels],
               width, label=metric)
    ax.set_xticks([x + width for x in range(len(labels))], labels, rotation=15, fontsize=8)
    ax.set_ylabel("F1")
    ax.set_title(f"XSUM 0-shot, {result['config']['articles']} articles, budget = 20% of the prompt")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---- comparison 4 ------------------------------------------------------------------------


def speed_markdown(result: dict) -> str:
    rows = []
    for r in result["summary"]:
        rows.append([r["context"], r["config"], r["slots"], r["prefill_s"], r["decode_tok_s"],
                     f"{r['decode_tok_s_min']:.1f}–{r['decode_tok_s_max']:.1f}", r.get("decode_vs_full"),
                     r.get("prefill_vs_full"), r["held_mb"], r["kv_mb"], r["peak_rss_mb"], r["rss_growth_mb"]])
    return md_table(["context", "config", "slots", "prefill s", "decode tok/s (median)", "range",
                     "decode × full", "prefill × full", "KV MB in use", "KV MB allocated", "peak RSS MB",
                     "RSS growth MB"], rows)


def speed_plot(result: dict, path: Path) -> None:
    plt = pyplot()
    configs = list(dict.fromkeys(r["config"] for r in result["summary"]))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for config in configs:
        pts = [r for r in result["summary"] if r["config"] == config]
        ctx = [r["context"] for r in pts]
        color = "black" if config.startswith("full") else None
        axes[0].errorbar(ctx, [r["decode_tok_s"] for r in pts],
                         yerr=[[r["decode_tok_s"] - r["decode_tok_s_min"] for r in pts],
                               [r["decode_tok_s_max"] - r["decode_tok_s"] for r in pts]],
                         fmt="o-", label=config, color=color, capsize=3)
        axes[1].plot(ctx, [r["prefill_s"] for r in pts], "o-", label=config, color=color)
        axes[2].plot(ctx, [r["kv_mb"] for r in pts], "o-", label=config, color=color)
    for ax, ylabel in zip(axes, ("decode tokens/s (median, min–max)", "prefill seconds",
                                 "KV cache MB allocated")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---- comparison 5 ------------------------------------------------------------------------


def chat_markdown(result: dict) -> str:
    rows = []
    for run in result["runs"]:
        turns = run["turns"]
        after = [t for t in turns if t["budget"] is not None and t["seen"] >= (t["budget"] or 0)]
        held_after = [t["held"] for t in after] or [None]
        probes, nll = {}, {}
        for p in run["probes"]:
            probes.setdefault(p["after_turns"], {})[p.get("kind", "fact")] = p["recalled"]
            if "answer_nll" in p:
                nll.setdefault(p["after_turns"], []).append(p["answer_nll"])
        rows.append([
            run["label"], run["budget"], len(turns), turns[0]["held"], turns[-1]["held"],
            None if held_after == [None] else f"{min(held_after)}–{max(held_after)}",
            turns[0]["held_bytes"] / 2**20, turns[-1]["held_bytes"] / 2**20, turns[-1]["kv_bytes"] / 2**20,
            turns[-1]["seen"],
            statistics.mean(t["seconds"] for t in turns), turns[-1]["seconds"],
            "; ".join(f"{k}: " + " ".join(f"{kind} {'yes' if ok else 'no'}" for kind, ok in probes[k].items())
                      for k in sorted(probes)),
            " / ".join(f"{statistics.mean(nll[k]):.2f}" for k in sorted(nll)) or None,
        ])
    table = md_table(["run", "budget", "turns", "slots after turn 0", "slots at end", "slots once full (min–max)",
                      "KV MB in use turn 0", "in use at end", "allocated at end", "tokens seen", "s/turn (mean)",
                      "s last turn", "recalled after N turns", "answer NLL after N turns (nats/token, name+code)"],
                     rows)
    callbacks = result.get("callbacks") or {}
    if not callbacks:
        return table
    after = result["config"]["callback_after"]
    rows = [[label] + [f"{statistics.mean(q['nll'][i] for q in per_question):.3f}" for i in range(len(after))]
            for label, per_question in callbacks.items()]
    heading = "**Callbacks** (second turns asked about the first; the reference answer's NLL, nats/token):"
    return f"{table}\n\n{heading}\n\n" + md_table(["run"] + [f"after {k} turns" for k in after], rows)


def chat_plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for run in result["runs"]:
        x = [t["turn"] for t in run["turns"]]
        axes[0].plot(x, [t["held_bytes"] / 2**20 for t in run["turns"]], label=run["label"])
        axes[1].plot(x, [t["seconds"] for t in run["turns"]], label=run["label"])
    axes[0].set_ylabel("KV cache MB in use after the turn")
    axes[1].set_ylabel("seconds per turn")
    for ax in axes:
        ax.set_xlabel("turn")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---- tuning study ------------------------------------------------------------------------


def tuning_tables(records: list[dict]) -> str:
    """Per phase and budget: each variant's perplexity per passage set and pooled top-1/KL,
    ranked by pooled perplexity."""
    blocks = []
    for phase in dict.fromkeys(r["phase"] for r in records):
        recs = [r for r in records if r["phase"] == phase and not r["per_passage"]]
        full = {r["set"]: r["ppl"] for r in recs if r["policy"] == "full"}
        for budget in dict.fromkeys(r["budget"] for r in recs if r["policy"] != "full"):
            by = {}
            for r in recs:
                if r["budget"] == budget:
                    by.setdefault(r["policy"], {})[r["set"]] = r
            rows = []
            for label, sets in sorted(by.items(), key=lambda kv: kv[1]["all"]["ppl"]):
                rows.append([label] + [f"{sets[s]['ppl']:.3f} ({sets[s]['ppl'] / full[s] - 1:+.1%})"
                                       for s in ("wikitext2", "book", "all")]
                            + [f"{sets['all']['top1']:.1%}", sets["all"]["kl"]])
            slots = next(r["slots"] for r in recs if r["budget"] == budget)
            blocks.append(
                f"**{phase}, budget {budget} ({slots} slots)**; full: "
                + ", ".join(f"{s} {full[s]:.3f}" for s in ("wikitext2", "book", "all")) + "\n\n"
                + md_table(["variant", "ppl wikitext2 (vs full)", "ppl book", "ppl all", "top-1", "KL"], rows))
    return "\n\n".join(blocks)


def tuning_plot(records: list[dict], path: Path) -> None:
    plt = pyplot()
    phases = list(dict.fromkeys(r["phase"] for r in records))
    recs = [r for r in records if not r["per_passage"] and r["set"] == "all" and r["policy"] != "full"]
    budgets = list(dict.fromkeys(r["budget"] for r in recs))
    fig, axes = plt.subplots(len(phases), len(budgets), figsize=(6 * len(budgets), 3.6 * len(phases)), squeeze=False)
    for i, phase in enumerate(phases):
        full = next(r["ppl"] for r in records if r["phase"] == phase and r["set"] == "all" and r["policy"] == "full")
        for j, budget in enumerate(budgets):
            pts = sorted((r for r in recs if r["phase"] == phase and r["budget"] == budget), key=lambda r: r["ppl"])
            ax = axes[i][j]
            ax.barh([r["policy"] for r in pts], [r["ppl"] / full - 1 for r in pts],
                    color=["tab:green" if r["kind"] == "sink" else "tab:red" for r in pts])
            ax.invert_yaxis()
            ax.set_xlabel("perplexity / full − 1 (all passages)")
            ax.set_title(f"{phase}, budget {budget}")
            ax.tick_params(axis="y", labelsize=7)
            ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---- comparison 6: position rolling -------------------------------------------------------


def rolling_markdown(result: dict) -> str:
    """Perplexity per window for every run, then each run pooled inside and past the
    model's trained context."""
    from .rolling import past_trained

    cfg, runs = result["config"], result["runs"]
    trained = cfg["trained_context"]
    rows = []
    for i, w in enumerate(runs[0]["windows"]):
        where = "past" if w["end"] > trained else "inside"
        rows.append([f"{w['start']}–{w['end']}", where] + [f"{run['windows'][i]['ppl']:.2f}" for run in runs])
    table = md_table(["tokens", "trained context"] + [r["label"] for r in runs], rows)
    pooled = past_trained(result)
    summary = md_table(
        ["run", f"ppl inside (< {trained})", f"ppl past {trained}", "past / inside", "ppl all"],
        [[r["label"], pooled[r["label"]]["inside"], pooled[r["label"]]["past"],
          None if pooled[r["label"]]["past"] is None else f"{pooled[r['label']]['past'] / pooled[r['label']]['inside']:.3f}",
          r["ppl"]] for r in runs])
    policies = {r["policy"]: r.get("variant") for r in runs if r.get("variant")}
    described = ", ".join(f"{p} = {v['sink']} sink + {v['heavy']} heavy + {v['recent']} recent" for p, v in policies.items())
    return (f"*{cfg['source']}* from {cfg['start']}, {cfg['tokens']} tokens streamed in chunks of {cfg['chunk']} "
            f"tokens through {cfg['budget']} slots ({described}; at most {cfg['budget']} + {cfg['chunk']} during a "
            f"forward pass); perplexity per {cfg['window']}-token window. The model's trained context is {trained}. "
            "Absolute: keys keep their token position. Rolling: keys at their rank in the cache, queries right "
            "after, so no query–key distance exceeds budget + chunk. Full: every token kept, absolute positions "
            f"(fed in {cfg['full_chunk']}-token chunks; it never evicts).\n\n" + table
            + "\n\nPooled over the windows inside and past the trained context:\n\n" + summary)


def rolling_plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for run in result["runs"]:
        x = [(w["start"] + w["end"]) / 2 for w in run["windows"]]
        ax.plot(x, [w["ppl"] for w in run["windows"]], marker="s" if run["mode"] == "rolling" else "o",
                ls="--" if run["mode"] == "absolute" and run["policy"] != "full" else "-",
                color=COLORS.get(run["policy"]), label=run["label"], alpha=0.85)
    ax.axvline(result["config"]["trained_context"], color="gray", ls=":", label="trained context")
    cfg = result["config"]
    ax.set_xlabel("token of the book (window centre)")
    ax.set_ylabel(f"perplexity per {cfg['window']}-token window")
    # Log scale: past the trained context absolute positions grow ppl tenfold or more,
    # which would flatten the differences inside it.
    ax.set_yscale("log")
    ax.set_title(f"Absolute vs rolled positions: {cfg['budget']} slots, chunks of {cfg['chunk']} tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
