"""report.md and plots of a study, from its results.jsonl alone.

Tables come from the rows only; the curves (losses, masked share per frequency bucket, ADM's
a) also read the metrics.jsonl files the rows name, and are skipped with a note when those
are missing. Each arm is compared with the baseline by a paired bootstrap over seeds (the
seed fixes the initial weights and data order, so seed s of an arm and seed s of the
baseline differ only by the masking): the 95% interval of the mean difference. An interval
that contains 0 is reported as "no significant difference".
"""

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlmlab.errors import UserError

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0  # a fixed generator, so the intervals are the same every time the report is made
FEW_SEEDS = 5  # below this, say how often sign-consistent differences arise by chance


@dataclass
class Comparison:
    diff: float  # mean over paired seeds of (arm - baseline)
    low: float
    high: float
    n: int  # paired seeds

    @property
    def significant(self) -> bool:
        return self.n >= 2 and not self.low <= 0.0 <= self.high


@dataclass(frozen=True)
class Metric:
    label: str
    path: tuple  # keys into a row
    lower_is_better: bool
    scale: float = 1.0  # display factor (GLUE scores as percentages)

    def value(self, row: dict) -> float:
        value = row
        for key in self.path:
            if not isinstance(value, dict) or key not in value:
                return math.nan
            value = value[key]
        return math.nan if value is None else float(value) * self.scale


# ----- reading rows ------------------------------------------------------------------------
def load_rows(path: Path) -> tuple[list[dict], list[str]]:
    """The rows, the latest per (arm, seed) (a rerun with a changed config supersedes), and notes."""
    if not path.is_file():
        raise UserError(f"{path} does not exist; pass the results.jsonl an `mlmlab experiment` wrote")
    rows, notes = [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            row["arm"], row["seed"], row["eval"]
        except (json.JSONDecodeError, KeyError, TypeError):
            notes.append(f"line {number} of {path.name} is not a complete result row and was ignored")
            continue
        rows.append(row)
    latest = {(row["arm"], row["seed"]): row for row in rows}
    if len(latest) < len(rows):
        notes.append(f"{len(rows) - len(latest)} rows superseded by a later row of the same arm and seed")
    if not latest:
        raise UserError(f"{path} holds no result rows")
    return list(latest.values()), notes


def group_by_arm(rows: list[dict], baseline: str) -> dict[str, list[dict]]:
    """Rows per arm: the baseline first, then the study's arm order."""
    groups = defaultdict(list)
    for row in sorted(rows, key=lambda r: (r["arm"] != baseline, r.get("arm_index", 0), r["arm"], r["seed"])):
        groups[row["arm"]].append(row)
    return dict(groups)


def choose_baseline(rows: list[dict]) -> str:
    names = [row.get("baseline", "dynamic") for row in rows]
    return max(set(names), key=names.count)


def metrics_of(rows: list[dict]) -> list[Metric]:
    """Perplexity overall and per frequency bucket, accuracies, GLUE average and per task, as present."""
    eval_keys = [key for row in rows for key in row["eval"]]
    buckets = list(dict.fromkeys(k for k in eval_keys if k.startswith("perplexity_freq_")))
    metrics = [Metric("perplexity", ("eval", "perplexity"), True)]
    metrics += [Metric(f"ppl freq {key.removeprefix('perplexity_freq_')}", ("eval", key), True) for key in buckets]
    metrics += [Metric(name, ("eval", name), False) for name in ("mlm_accuracy", "nsp_accuracy") if name in eval_keys]
    tasks = list(dict.fromkeys(t for row in rows for t in (row.get("glue") or {}).get("tasks", {})))
    if tasks:
        metrics.append(Metric("GLUE avg", ("glue", "average"), False, 100.0))
        metrics += [Metric(f"GLUE {task}", ("glue", "tasks", task, "score"), False, 100.0) for task in tasks]
    return metrics


# ----- statistics --------------------------------------------------------------------------
def by_seed(rows: list[dict], metric: Metric) -> dict[int, float]:
    values = {row["seed"]: metric.value(row) for row in rows}
    return {seed: value for seed, value in values.items() if not math.isnan(value)}


def mean_std(values: dict[int, float]) -> str:
    if not values:
        return "–"
    data = np.array(list(values.values()))
    std = f" ± {data.std(ddof=1):.3g}" if len(data) > 1 else ""
    return f"{data.mean():.4g}{std} (n={len(data)})"


def paired_bootstrap(arm: dict[int, float], baseline: dict[int, float]) -> Comparison | None:
    """95% percentile interval of the mean paired difference, resampling seeds with replacement."""
    seeds = sorted(set(arm) & set(baseline))
    if not seeds:
        return None
    diffs = np.array([arm[s] - baseline[s] for s in seeds])
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    means = diffs[rng.integers(0, len(diffs), size=(BOOTSTRAP_RESAMPLES, len(diffs)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return Comparison(float(diffs.mean()), float(low), float(high), len(seeds))


def format_delta(comparison: Comparison | None) -> str:
    if comparison is None:
        return "–"
    if comparison.n < 2:
        return f"{comparison.diff:+.3g} (1 seed, no CI)"
    mark = " *" if comparison.significant else ""
    return f"{comparison.diff:+.3g} [{comparison.low:+.3g}, {comparison.high:+.3g}]{mark}"


def verdict(arm: str, baseline: str, metric: Metric, comparison: Comparison | None) -> str:
    """One honest sentence: "no significant difference" whenever the interval contains 0."""
    head = f"{arm} vs {baseline}, {metric.label}:"
    if comparison is None:
        return f"{head} no seeds in common, no comparison."
    if comparison.n < 2:
        return f"{head} cannot be assessed from 1 paired seed (Δ = {comparison.diff:+.3g}, no interval)."
    c = comparison
    interval = f"Δ = {c.diff:+.3g}, 95% CI [{c.low:+.3g}, {c.high:+.3g}], {c.n} paired seeds"
    if not comparison.significant:
        return f"{head} no significant difference ({interval})."
    better = (comparison.diff < 0) == metric.lower_is_better
    direction = "lower" if comparison.diff < 0 else "higher"
    sentence = f"{head} {direction}, i.e. {'better' if better else 'worse'} ({interval})."
    if comparison.n < FEW_SEEDS:
        chance = 2 / 2 ** comparison.n
        sentence += (f" With {comparison.n} seeds the bootstrap interval excludes 0 whenever all paired differences "
                     f"share a sign, which happens by chance {chance:.0%} of the time with no effect: suggestive only.")
    return sentence


# ----- plots -------------------------------------------------------------------------------
def read_curves(groups, results_dir: Path) -> tuple[dict[str, list[tuple[dict, list[dict]]]], list[str]]:
    """Per arm: (row, metrics records) of every run whose metrics.jsonl exists; and the missing paths."""
    curves, missing = defaultdict(list), []
    for arm, rows in groups.items():
        for row in rows:
            path = results_dir / row.get("run_dir", "?") / "metrics.jsonl"
            if path.is_file():
                records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                curves[arm].append((row, records))
            else:
                missing.append(str(path))
    return dict(curves), missing


def mean_curve(runs: list[tuple[dict, list[dict]]], value, x) -> tuple[list[float], list[float]]:
    """Mean over seeds at each step of value(record) (None = no point), plotted against x(row, record)."""
    points = defaultdict(list)
    for row, records in runs:
        for record in records:
            y = value(record)
            if y is not None and math.isfinite(y):
                points[x(row, record)].append(y)
    xs = sorted(points)
    return xs, [float(np.mean(points[k])) for k in xs]


def sequences_seen(row: dict, record: dict) -> float:
    return record["step"] * row.get("global_batch", 1)


def progress(row: dict, record: dict) -> float:
    return record["step"] / max(row.get("steps", 1), 1)


def is_adaptive(rows: list[dict]) -> bool:
    return (rows[0].get("config") or {}).get("masking", {}).get("strategy") == "adaptive"


def write_plots(groups, baseline, metrics, results_dir: Path, out: Path) -> tuple[list[str], list[str]]:
    """PNG files written to ``out`` (names) and notes about what could not be drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    images = [bucket_bars(plt, groups, [m for m in metrics if m.label.startswith("ppl") or m.label == "perplexity"], out)]
    curves, missing = read_curves(groups, results_dir)
    notes = [f"curve plots skipped for {len(missing)} runs whose metrics.jsonl is missing (e.g. {missing[0]}); "
             "the tables come from results.jsonl alone"] if missing else []
    if curves:
        images.append(loss_curves(plt, curves, out))
        compared = {arm: runs for arm, runs in curves.items() if arm == baseline or is_adaptive(groups[arm])}
        images.append(mask_share_curves(plt, compared, out))
        adaptive = {arm: runs for arm, runs in curves.items() if is_adaptive(groups[arm])}
        if adaptive:
            images.append(adapt_factor_curves(plt, adaptive, out))
    return images, notes


def save(plt, fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def bucket_bars(plt, groups, metrics, out: Path) -> str:
    """Perplexity overall and per frequency bucket: mean ± std over seeds, one bar per arm."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        stats = [list(by_seed(rows, metric).values()) for rows in groups.values()]
        means = [np.mean(v) if v else math.nan for v in stats]
        stds = [np.std(v, ddof=1) if len(v) > 1 else 0.0 for v in stats]
        ax.bar(range(len(groups)), means, yerr=stds, capsize=3, color="tab:blue")
        ax.set_xticks(range(len(groups)), list(groups), rotation=60, ha="right", fontsize=7)
        ax.set_title(metric.label, fontsize=9)
    axes[0][0].set_ylabel("perplexity (mean ± std over seeds)")
    return save(plt, fig, out, "perplexity_buckets.png")


def loss_curves(plt, curves, out: Path) -> str:
    fig, (train_ax, valid_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, runs in curves.items():
        train_ax.plot(*mean_curve(runs, lambda r: r.get("loss"), sequences_seen), label=arm, lw=1)
        valid_ax.plot(*mean_curve(runs, lambda r: r.get("eval", {}).get("mlm_loss"), sequences_seen),
                      marker="o", label=arm, lw=1)
    train_ax.set(title="training loss (MLM + NSP, mean over seeds)", xlabel="sequences seen", ylabel="loss")
    valid_ax.set(title="validation MLM loss (fixed uniform masks)", xlabel="sequences seen", ylabel="loss")
    valid_ax.legend(fontsize=7)
    return save(plt, fig, out, "loss_curves.png")


def mask_share_curves(plt, curves, out: Path) -> str:
    """Share of the selected tokens in each frequency bucket over training: ADM arms vs the baseline."""
    keys = sorted({k for runs in curves.values() for _, records in runs for r in records for k in r
                   if k.startswith("mask_share_freq_")}, key=lambda k: int(k.split("_")[3]))
    fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(4.5 * max(len(keys), 1), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for arm, runs in curves.items():
            ax.plot(*mean_curve(runs, lambda r, key=key: r.get(key), progress), label=arm, lw=1)
        ax.set(title=f"masked share, frequency rank {key.removeprefix('mask_share_freq_')}", xlabel="training progress")
    axes[0][0].set_ylabel("share of masked tokens")
    axes[0][-1].legend(fontsize=7)
    return save(plt, fig, out, "mask_share.png")


def adapt_factor_curves(plt, curves, out: Path) -> str:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for arm, runs in curves.items():
        ax.plot(*mean_curve(runs, lambda r: r.get("mask_a"), progress), label=arm, lw=1)
    ax.set(title="ADM adapt factor a", xlabel="training progress", ylabel="a")
    ax.legend(fontsize=7)
    return save(plt, fig, out, "mask_a.png")


# ----- markdown ----------------------------------------------------------------------------
def table(header: list[str], body: list[list[str]]) -> list[str]:
    row = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    return [row(header), row(["---"] * len(header)), *(row(cells) for cells in body), ""]


def masking_label(row: dict) -> str:
    m = (row.get("config") or {}).get("masking", {})
    if not m:
        return "?"
    if m["strategy"] == "adaptive":
        label = f"ADM {m['scorer']}, a={m['a_max']:g}·{m['adapt_schedule']}"
        label += f", every {m['score_every']} steps" if m["score_every"] > 1 else ""
        label += f", {m['score_fraction']:g} of rows" if m["score_fraction"] < 1 else ""
    else:
        label = m["strategy"]
    if m["rate_schedule"] == "linear_decay":
        label += f", rate {m['rate_start']:g}→{m['rate']:g}"
    return label


def commands(rows: list[dict], results: Path, out: Path) -> list[str]:
    studies = dict.fromkeys((row.get("study_source", "?"), row.get("out_dir", str(results.parent))) for row in rows)
    lines = [f"    mlmlab experiment {source} --out {out_dir}" for source, out_dir in studies]
    return lines + [f"    mlmlab report {results} --out {out}"]


def summary_section(groups, baseline, metrics) -> list[str]:
    """The seed's comparison: baseline, then each arm; perplexity, rare-token perplexity, GLUE."""
    chosen = [metrics[0]] + [m for m in metrics if m.label.startswith("ppl freq")][-1:]
    chosen += [m for m in metrics if m.label == "GLUE avg"]
    header = ["arm", "masking"] + [h for m in chosen for h in (m.label, f"Δ {m.label} [95% CI]")]
    body, sentences = [], []
    base_rows = groups.get(baseline, [])
    for arm, rows in groups.items():
        cells = [arm + (" (baseline)" if arm == baseline else ""), masking_label(rows[0])]
        for metric in chosen:
            comparison = paired_bootstrap(by_seed(rows, metric), by_seed(base_rows, metric)) if arm != baseline else None
            cells += [mean_std(by_seed(rows, metric)), "" if arm == baseline else format_delta(comparison)]
            if arm != baseline and base_rows:
                sentences.append(f"- {verdict(arm, baseline, metric, comparison)}")
        body.append(cells)
    return ["## Summary in the seed's shape: the baseline, then each arm", ""] + table(header, body) + sentences + [""]


def metric_table(title: str, groups, baseline, metrics) -> list[str]:
    if not metrics:
        return []
    header = ["arm"] + [m.label for m in metrics]
    values = [[arm] + [mean_std(by_seed(rows, m)) for m in metrics] for arm, rows in groups.items()]
    deltas = [[arm] + [format_delta(paired_bootstrap(by_seed(rows, m), by_seed(groups[baseline], m))) for m in metrics]
              for arm, rows in groups.items() if arm != baseline and baseline in groups]
    lines = [f"## {title}", "", "Mean ± std over seeds:", ""] + table(header, values)
    if deltas:
        lines += [f"Difference from {baseline} (paired over seeds), 95% bootstrap CI; * = CI excludes 0:", ""]
        lines += table(header, deltas)
    return lines


def cost_section(groups) -> list[str]:
    header = ["arm", "budget", "steps", "batch", "tokens seen", "est. FLOPs", "scorer share of FLOPs",
              "train s", "scorer s", "wall s (incl. eval, GLUE)"]
    body = []
    for arm, rows in groups.items():
        mean = lambda key: np.mean([row.get(key, math.nan) for row in rows])  # noqa: E731
        body.append([arm, rows[0].get("budget", "?"), f"{mean('steps'):.0f}", f"{mean('global_batch'):.0f}",
                     f"{mean('tokens_seen'):.3g}", f"{mean('flops'):.3g}", f"{100 * mean('scorer_share'):.1f}%",
                     f"{mean('train_seconds'):.0f}", f"{mean('scorer_seconds'):.1f}", f"{mean('wall_seconds'):.0f}"])
    return ["## Budget and cost (means over seeds)", ""] + table(header, body)


def glue_notes(rows: list[dict]) -> list[str]:
    skipped = sorted({row["glue"]["skipped"] for row in rows if "skipped" in (row.get("glue") or {})})
    return [f"GLUE skipped: {reason}." for reason in skipped]


def write_report(results: Path, out: Path) -> Path:
    """Write report.md and the PNG plots to ``out``; returns the report's path."""
    rows, notes = load_rows(results)
    baseline = choose_baseline(rows)
    groups = group_by_arm(rows, baseline)
    metrics = metrics_of(rows)
    if baseline not in groups:
        notes.append(f"the baseline arm {baseline!r} has no rows: no differences can be computed")
    out.mkdir(parents=True, exist_ok=True)
    images, plot_notes = write_plots(groups, baseline, metrics, results.parent, out)
    studies = ", ".join(sorted({row.get("study", "?") for row in rows}))
    seeds = sorted({row["seed"] for row in rows})
    lines = [f"# Study {studies}: masking strategies against {baseline}", "",
             "Every number below is reproduced by (the experiment skips runs already in results.jsonl):", "",
             *commands(rows, results, out), "",
             f"{len(rows)} runs, {len(groups)} arms, seeds {seeds}; mlmlab "
             f"{', '.join(sorted({str(row.get('mlmlab_version')) for row in rows}))}.", ""]
    lines += summary_section(groups, baseline, metrics)
    lines += metric_table("Held-out perplexity, overall and per frequency bucket",
                          groups, baseline, [m for m in metrics if "ppl" in m.label or m.label == "perplexity"])
    lines += metric_table("Held-out MLM and NSP accuracy", groups, baseline,
                          [m for m in metrics if m.label.endswith("accuracy")])
    glue = [m for m in metrics if m.label.startswith("GLUE")]
    lines += metric_table("GLUE dev scores (x100; median over fine-tuning seeds, then over pretraining seeds "
                          "as mean ± std)", groups, baseline, glue) + glue_notes(rows) + [""]
    lines += cost_section(groups)
    lines += ["## Plots", ""] + [f"![{name}]({name})" for name in images] + [""]
    lines += ["## How to read this", "",
              "- Perplexity is exp(mean cross-entropy) on the held-out sample under the same fixed uniform 15% masks "
              "for every arm; frequency buckets are ranks of the target token in the pretraining corpus "
              "(0_1000 = the 1000 most frequent ids).",
              f"- Δ = arm − baseline, averaged over seeds both have; the 95% CI is a percentile bootstrap "
              f"({BOOTSTRAP_RESAMPLES} resamples of the paired seeds, generator seed {BOOTSTRAP_SEED}). "
              "Lower perplexity is better; higher accuracy and GLUE are better.",
              "- FLOPs are estimates from the model config (mlmlab/experiments/budget.py), scorer passes included.",
              *[f"- Note: {note}" for note in notes + plot_notes], ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
