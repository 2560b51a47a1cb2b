"""report.md and plots of a study, from its results.jsonl alone.

Tables come from the rows only; the curves (losses, masked share per frequency bucket, ADM's
a) also read the metrics.jsonl files the rows name, and are skipped with a note when those
are missing. Each arm is compared with the baseline seed by seed (the seed fixes the initial
weights and data order, so seed s of an arm and seed s of the baseline differ only by the
masking). The primary interval is a paired t-interval over seeds (df = n - 1); a percentile
bootstrap is printed beside it as a secondary column, labelled "range" below FEW_SEEDS seeds,
where it is little more than the min and max of the differences (with 3 seeds, exactly: an
all-minimum resample has probability 1/27 > 2.5%). A t-interval that contains 0 is reported as
"no significant difference". Losses are compared in nats (log perplexity), overall and per
frequency bucket: a difference of 1e5 in a rare bucket's perplexity is unreadable, a
difference in nats is a ratio of perplexities. An arm whose every metric equals the
baseline's in every seed ran the same computation, and is reported as such, not as a null.
"""

import logging
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats

from mlmlab import choices, markdown
from mlmlab.errors import UserError
from mlmlab.experiments.gates import gate_results, row_value
from mlmlab.experiments.results import read_rows
from mlmlab.jsonio import json_lines

log = logging.getLogger(__name__)

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0  # a fixed generator, so the intervals are the same every time the report is made
FEW_SEEDS = 5  # below this the bootstrap is a range, not a CI, and the t-interval rests on unchecked normality
MIN_CORRELATION_RUNS = 4  # fewer runs give no rank correlation worth printing (3 points: 6 orders in all)
LATE_PROGRESS = 0.9  # "late in training": ADM weights the scores more as training progresses


@dataclass
class Comparison:
    diff: float  # mean over paired seeds of (arm - baseline)
    low: float  # 95% paired t-interval: the primary interval, the one verdicts use (NaN: none, see spread)
    high: float
    n: int  # paired seeds
    boot_low: float = math.nan  # percentile bootstrap: secondary; a range, not a CI, below FEW_SEEDS
    boot_high: float = math.nan
    p: float = math.nan  # two-sided paired t-test p-value (below 0.05 exactly when the t-interval excludes 0)
    all_zero: bool = False  # every paired difference is exactly 0 in this metric
    identical: bool = False  # every metric equals the baseline's in every seed: the same run, not a null

    @property
    def spread(self) -> bool:
        """The paired differences vary between seeds: without that there is no interval to draw."""
        return not math.isnan(self.low)

    @property
    def significant(self) -> bool:
        return self.n >= 2 and not self.identical and self.spread and not self.low <= 0.0 <= self.high


@dataclass(frozen=True)
class Metric:
    label: str
    path: tuple  # keys into a row
    lower_is_better: bool
    scale: float = 1.0  # display factor (GLUE scores as percentages)
    log: bool = False  # the stored value is a perplexity; compare its log, the loss in nats

    def value(self, row: dict) -> float:
        value = row_value(row, self.path)
        return (math.log(value) if self.log else value) * self.scale


# ----- reading rows ------------------------------------------------------------------------
def load_rows(path: Path) -> tuple[list[dict], list[str]]:
    """The rows, the latest per (arm, seed) (a duplicate, e.g. from a results file merged twice, counts once), and notes."""
    if not path.is_file():
        raise UserError(f"{path} does not exist; pass the results.jsonl an `mlmlab experiment` wrote")
    rows, ignored = read_rows(path)
    notes = [skipped(f"line {number} of {path.name} is not a complete result row and was ignored")
             for number in ignored]
    latest = {(row["arm"], row["seed"]): row for row in rows}
    if len(latest) < len(rows):
        notes.append(f"{len(rows) - len(latest)} rows superseded by a later row of the same arm and seed")
    if not latest:
        raise UserError(f"{path} holds no result rows")
    return list(latest.values()), notes


def skipped(note: str) -> str:
    """Warn on stderr of one item the report leaves out, as it reads it; the note, for report.md too."""
    log.warning("mlmlab: warning: %s", note)
    return note


def group_by_arm(rows: list[dict], baseline: str) -> dict[str, list[dict]]:
    """Rows per arm: the baseline first, then the study's arm order."""
    groups = defaultdict(list)
    for row in sorted(rows, key=lambda r: (r["arm"] != baseline, r.get("arm_index", 0), r["arm"], r["seed"])):
        groups[row["arm"]].append(row)
    return dict(groups)


def choose_baseline(rows: list[dict]) -> str:
    names = [row.get("baseline", choices.DYNAMIC) for row in rows]
    return max(set(names), key=names.count)


def metrics_of(rows: list[dict]) -> list[Metric]:
    """Perplexity and loss in nats, overall and per frequency bucket, accuracies, GLUE average and per task."""
    eval_keys = [key for row in rows for key in row["eval"]]
    buckets = list(dict.fromkeys(k for k in eval_keys if k.startswith("perplexity_freq_")))
    metrics = [Metric("perplexity", ("eval", "perplexity"), True)]
    metrics += [Metric(f"ppl freq {key.removeprefix('perplexity_freq_')}", ("eval", key), True) for key in buckets]
    # mlm_loss is log(perplexity); older rows without it get the same number from the perplexity
    metrics.append(Metric("MLM loss (nats)", ("eval", "mlm_loss"), True) if "mlm_loss" in eval_keys
                   else Metric("MLM loss (nats)", ("eval", "perplexity"), True, log=True))
    metrics += [Metric(f"loss freq {key.removeprefix('perplexity_freq_')} (nats)", ("eval", key), True, log=True)
                for key in buckets]
    metrics += [Metric(name, ("eval", name), False) for name in ("mlm_accuracy", "nsp_accuracy") if name in eval_keys]
    held_out = list(dict.fromkeys(name for row in rows for name, report in (row.get("eval_data") or {}).items()
                                  if "mlm_loss" in report))
    metrics += [Metric(f"{name} MLM loss (nats)", ("eval_data", name, "mlm_loss"), True) for name in held_out]
    metrics += [Metric(f"{name} mlm_accuracy", ("eval_data", name, "mlm_accuracy"), False) for name in held_out]
    tasks = list(dict.fromkeys(t for row in rows for t in (row.get("glue") or {}).get("tasks", {})))
    if tasks:
        metrics.append(Metric("GLUE avg", ("glue", "average"), False, 100.0))
        metrics += [Metric(f"GLUE {task}", ("glue", "tasks", task, "score"), False, 100.0) for task in tasks]
    return metrics + recalibrated_metrics(rows) + probe_metrics(rows)


RECALIBRATED = ("eval", "recalibrated")  # evaluate/recalibrate.py's report in a row


def recalibrated_metrics(rows: list[dict]) -> list[Metric]:
    """The prior-free loss (output bias refitted on half the held-out targets) and the raw loss on the same
    scored half, overall and per frequency bucket, in nats."""
    keys = list(dict.fromkeys(key for row in rows for key in row_value_dict(row, RECALIBRATED)))
    buckets = [key.removeprefix("mlm_loss_freq_") for key in keys if key.startswith("mlm_loss_freq_")]
    metrics = []
    for name in ([""] if "mlm_loss" in keys else []) + [f"_freq_{bucket}" for bucket in buckets]:
        where = f" freq {name.removeprefix('_freq_')}" if name else ""
        metrics += [Metric(f"recalibrated loss{where} (nats)", (*RECALIBRATED, f"mlm_loss{name}"), True),
                    Metric(f"raw loss{where}, scored half (nats)", (*RECALIBRATED, f"raw_mlm_loss{name}"), True)]
    return metrics


def probe_metrics(rows: list[dict]) -> list[Metric]:
    """Each frozen linear probe's dev score and its gain over a random-init encoder (x100), and the mean gain."""
    tasks = list(dict.fromkeys(t for row in rows for t in row_value_dict(row, ("probe", "tasks"))))
    metrics = []
    for task in tasks:
        metrics += [Metric(f"probe {task}", ("probe", "tasks", task, "score"), False, 100.0),
                    Metric(f"probe {task} gain", ("probe", "tasks", task, "gain"), False, 100.0)]
    return metrics + ([Metric("probe avg gain", ("probe", "average_gain"), False, 100.0)] if tasks else [])


def row_value_dict(row: dict, path: tuple) -> dict:
    """The mapping at ``path`` of a row ({} when missing or not a mapping)."""
    value = row
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, dict) else {}


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


def identical_runs(rows: list[dict], base_rows: list[dict]) -> bool:
    """Every metric of the arm equals the baseline's, seed by seed. Trained floats agree to the last
    digit only when the two arms ran the same computation (static masking whose dupe_factor exceeds
    the passes made is dynamic masking), so a zero difference there is no measurement."""
    if not rows or {row["seed"] for row in rows} != {row["seed"] for row in base_rows}:
        return False
    return all(by_seed(rows, metric) == by_seed(base_rows, metric) for metric in metrics_of(rows + base_rows))


def t_interval(diffs: np.ndarray) -> tuple[float, float, float]:
    """Paired t-interval of the mean difference, df = n - 1, and its two-sided p-value."""
    mean, sem = float(diffs.mean()), float(stats.sem(diffs))
    if sem == 0.0:  # the same difference in every seed (e.g. two classifiers stuck on constant predictions):
        return math.nan, math.nan, math.nan  # no spread to estimate an interval from, so no significance either
    low, high = stats.t.interval(0.95, len(diffs) - 1, loc=mean, scale=sem)
    return float(low), float(high), float(2 * stats.t.sf(abs(mean / sem), len(diffs) - 1))


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of p-values tested together (NaN: not tested, left out of the count).

    The i-th smallest of m p-values is multiplied by m - i + 1, then made monotone: calls at 0.05
    on the adjusted values hold the chance of any false call across the arms at 5%.
    """
    tested = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    adjusted, running = [math.nan] * len(p_values), 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - rank) * p))
        adjusted[i] = running
    return adjusted


def paired_bootstrap(diffs: np.ndarray) -> tuple[float, float]:
    """Percentile interval of the mean difference, resampling seeds with replacement. Secondary:
    with few seeds it only spans the observed differences (exactly [min, max] with 3)."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    means = diffs[rng.integers(0, len(diffs), size=(BOOTSTRAP_RESAMPLES, len(diffs)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def compare(rows: list[dict], base_rows: list[dict], metric: Metric) -> Comparison | None:
    """The arm against the baseline on one metric, over the seeds both have (pairs matched by seed)."""
    arm, baseline = by_seed(rows, metric), by_seed(base_rows, metric)
    seeds = sorted(set(arm) & set(baseline))
    if not seeds:
        return None
    diffs = np.array([arm[s] - baseline[s] for s in seeds])
    identical = identical_runs(rows, base_rows)
    if len(seeds) < 2:
        return Comparison(float(diffs.mean()), math.nan, math.nan, 1, identical=identical)
    low, high, p = t_interval(diffs)
    return Comparison(float(diffs.mean()), low, high, len(seeds), *paired_bootstrap(diffs), p=p,
                      all_zero=not diffs.any(), identical=identical)


def boot_label(comparisons) -> str:
    """The bootstrap column's name: below FEW_SEEDS paired seeds it is a range of the differences, never a CI."""
    fewest = min((c.n for c in comparisons if c is not None), default=0)
    return "range (bootstrap)" if fewest < FEW_SEEDS else "95% bootstrap CI"


def format_delta(comparison: Comparison | None) -> str:
    """The difference with its t-interval; * = the t-interval excludes 0."""
    if comparison is None:
        return "–"
    if comparison.identical:
        return "identical by construction"
    if comparison.n < 2:
        return f"{comparison.diff:+.3g} (1 seed, no interval)"
    if comparison.all_zero:
        return "+0 (equal in every seed)"
    if not comparison.spread:
        return f"{comparison.diff:+.3g} (the same in every seed: no interval)"
    mark = " *" if comparison.significant else ""
    return f"{comparison.diff:+.3g} [{comparison.low:+.3g}, {comparison.high:+.3g}]{mark}"


def format_boot(comparison: Comparison | None) -> str:
    if comparison is None or comparison.n < 2 or comparison.identical or not comparison.spread:
        return "–"
    return f"[{comparison.boot_low:+.3g}, {comparison.boot_high:+.3g}]"


def verdict(arm: str, baseline: str, metric: Metric, comparison: Comparison | None) -> str:
    """One honest sentence: "no significant difference" whenever the t-interval contains 0."""
    head = f"{arm} vs {baseline}, {metric.label}:"
    if comparison is None:
        return f"{head} no seeds in common, no comparison."
    if comparison.identical:
        return (f"{arm} vs {baseline}: identical by construction. Every metric equals the baseline's in every seed, "
                "so the two arms ran the same computation; this is not a measured null.")
    if comparison.n < 2:
        return f"{head} cannot be assessed from 1 paired seed (Δ = {comparison.diff:+.3g}, no interval)."
    c = comparison
    if not c.spread:
        return (f"{head} Δ = {c.diff:+.3g} in each of {c.n} paired seeds: with no spread there is no interval, so "
                "no significance is claimed.")
    interval = f"Δ = {c.diff:+.3g}, 95% t-interval [{c.low:+.3g}, {c.high:+.3g}], {c.n} paired seeds"
    if not comparison.significant:
        return f"{head} no significant difference ({interval})."
    better = (comparison.diff < 0) == metric.lower_is_better
    direction = "lower" if comparison.diff < 0 else "higher"
    sentence = f"{head} {direction}, i.e. {'better' if better else 'worse'} ({interval})."
    if comparison.n < FEW_SEEDS:
        sentence += (f" With {comparison.n} seeds the t-interval rests on the differences being roughly normal, "
                     "which so few seeds cannot check: suggestive only.")
    return sentence


# ----- plots -------------------------------------------------------------------------------
def read_curves(groups, results_dir: Path) -> tuple[dict[str, list[tuple[dict, list[dict]]]], list[str]]:
    """Per arm: (row, metrics records) of every run whose metrics.jsonl exists; and the missing paths."""
    curves, missing = defaultdict(list), []
    for arm, rows in groups.items():
        for row in rows:
            path = results_dir / row.get("run_dir", "?") / "metrics.jsonl"
            if path.is_file():
                lines = json_lines(path.read_text(encoding="utf-8", errors="replace"))
                for number in (number for number, record in lines if record is None):
                    skipped(f"line {number} of {path} is not a metrics record (cut short or damaged) and was ignored")
                curves[arm].append((row, [record for _, record in lines if record is not None]))
            else:
                missing.append(str(path))
    return dict(curves), missing


def mean_curve(runs: list[tuple[dict, list[dict]]], value, x) -> tuple[list[float], list[float]]:
    """Mean over seeds at each step of value(record) (None = no point), plotted against x(row, record).

    One point per run and step, its last: a run resumed after its final checkpoint (stopped during
    GLUE) logs its final evaluation twice, and would count twice in the mean."""
    points = defaultdict(list)
    for row, records in runs:
        for at, y in last_per_x(row, records, value, x).items():
            points[at].append(y)
    xs = sorted(points)
    return xs, [float(np.mean(points[k])) for k in xs]


def last_per_x(row: dict, records: list[dict], value, x) -> dict[float, float]:
    """x(row, record) -> value(record) of one run, the last finite value at each x."""
    last = {}
    for record in records:
        y = value(record)
        if y is not None and math.isfinite(y):
            last[x(row, record)] = y
    return last


def sequences_seen(row: dict, record: dict) -> float:
    return record["step"] * row_sequences_per_step(row)


def row_sequences_per_step(row: dict) -> float:
    """Sequences per optimizer step of a row's run (rows written before the rename call it global_batch)."""
    return row.get("sequences_per_step", row.get("global_batch", 1))


def progress_of(row: dict, record: dict) -> float:
    return record["step"] / max(row.get("steps", 1), 1)


def is_adaptive(rows: list[dict]) -> bool:
    return (rows[0].get("config") or {}).get("masking", {}).get("strategy") == choices.ADAPTIVE


def write_plots(groups, baseline, metrics, curves, out: Path) -> list[str]:
    """PNG files written to ``out`` (names); ``curves`` as read_curves gives them."""
    # Here, not at the top: the backend must be chosen before pyplot is first imported.
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    images = [bucket_bars(plt, groups, [m for m in metrics if m.label.startswith("ppl") or m.label == "perplexity"], out)]
    if curves:
        images.append(loss_curves(plt, curves, out))
        compared = {arm: runs for arm, runs in curves.items() if arm == baseline or is_adaptive(groups[arm])}
        images.append(mask_share_curves(plt, compared, out))
        adaptive = {arm: runs for arm, runs in curves.items() if is_adaptive(groups[arm])}
        if adaptive:
            images.append(adapt_factor_curves(plt, adaptive, out))
    if downstream_metrics(metrics):
        images.append(scores_against_loss(plt, groups, metrics, out))
    return images


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
    keys = mask_share_keys(curves)
    fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(4.5 * max(len(keys), 1), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for arm, runs in curves.items():
            ax.plot(*mean_curve(runs, lambda r, key=key: r.get(key), progress_of), label=arm, lw=1)
        ax.set(title=f"masked share, frequency rank {key.removeprefix('mask_share_freq_')}", xlabel="training progress")
    axes[0][0].set_ylabel("share of masked tokens")
    axes[0][-1].legend(fontsize=7)
    return save(plt, fig, out, "mask_share.png")


def mask_share_keys(curves) -> list[str]:
    """The runs' mask_share_freq_* record keys, most frequent bucket first."""
    return sorted({k for runs in curves.values() for _, records in runs for r in records for k in r
                   if k.startswith("mask_share_freq_")}, key=lambda k: int(k.split("_")[3]))


def adapt_factor_curves(plt, curves, out: Path) -> str:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for arm, runs in curves.items():
        ax.plot(*mean_curve(runs, lambda r: r.get("mask_a"), progress_of), label=arm, lw=1)
    ax.set(title="ADM adapt factor a", xlabel="training progress", ylabel="a")
    ax.legend(fontsize=7)
    return save(plt, fig, out, "mask_a.png")


# ----- markdown ----------------------------------------------------------------------------
def scores_against_loss(plt, groups, metrics, out: Path) -> str:
    """One point per run: its held-out MLM loss against each GLUE score, coloured by arm."""
    scores, loss = downstream_metrics(metrics), loss_metric(metrics)
    fig, axes = plt.subplots(1, len(scores), figsize=(4.5 * len(scores), 3.8), squeeze=False)
    for ax, score in zip(axes[0], scores):
        for arm, rows in groups.items():
            points = run_points(rows, loss, score)
            ax.scatter([x for x, _ in points], [y for _, y in points], label=arm, s=18)
        ax.set(title=f"{score.label} against MLM loss (one point per run)", xlabel=loss.label, ylabel=score.label)
    axes[0][0].legend(fontsize=7)
    return save(plt, fig, out, "glue_vs_mlm_loss.png")


def masking_label(row: dict) -> str:
    m = (row.get("config") or {}).get("masking", {})
    if not m:
        return "?"
    if m["strategy"] == choices.ADAPTIVE:
        label = f"ADM {m['scorer']}, a={m['a_max']:g}·{m['adapt_schedule']}"
        if m["scorer"] in choices.MODEL_SCORERS:  # the cost controls apply to model passes only
            label += f", every {m['score_every']} steps" if m["score_every"] > 1 else ""
            label += f", {m['score_fraction']:g} of rows" if m["score_fraction"] < 1 else ""
        label += ", frequency-neutral" if m.get("frequency_neutral") else ""  # absent from older results
    else:
        label = m["strategy"]
    if m["rate_schedule"] == choices.LINEAR_DECAY:
        label += f", rate {m['rate_start']:g}→{m['rate']:g}"
    return label


def commands(rows: list[dict], results: Path, out: Path) -> list[str]:
    studies = dict.fromkeys((row.get("study_source", "?"), row.get("out_dir", str(results.parent))) for row in rows)
    lines = [f"    mlmlab experiment {source} --out {out_dir}" for source, out_dir in studies]
    return lines + [f"    mlmlab report {results} --out {out}"]


# ----- pretraining loss against downstream scores -----------------------------------------------
def loss_metric(metrics: list[Metric]) -> Metric:
    return next(metric for metric in metrics if metric.label == "MLM loss (nats)")


def downstream_metrics(metrics: list[Metric]) -> list[Metric]:
    """Each GLUE task's score, and their average when there are several tasks."""
    glue = [metric for metric in metrics if metric.label.startswith("GLUE ")]
    return glue if len(glue) > 2 else [metric for metric in glue if metric.label != "GLUE avg"]


def run_points(rows: list[dict], x: Metric, y: Metric) -> list[tuple[float, float]]:
    """(x, y) of every run that has both."""
    points = [(x.value(row), y.value(row)) for row in rows]
    return [(a, b) for a, b in points if not (math.isnan(a) or math.isnan(b))]


def downstream_section(rows: list[dict], metrics: list[Metric]) -> list[str]:
    """Across all runs, whatever their arm: how far a lower held-out MLM loss goes with a higher GLUE score."""
    loss, body = loss_metric(metrics), []
    for score in downstream_metrics(metrics):
        points = run_points(rows, loss, score)
        if len(points) < MIN_CORRELATION_RUNS:
            body.append([score.label, str(len(points)), "too few runs", ""])
        elif any(len(set(column)) == 1 for column in zip(*points)):
            body.append([score.label, str(len(points)), "undefined (a constant column)", ""])
        else:
            rho, p = stats.spearmanr(*zip(*points))
            body.append([score.label, str(len(points)), f"{rho:+.2f}", f"{p:.2g}"])
    if not body:
        return []
    return ["## Pretraining loss against downstream scores", "",
            "Each run is one point, whatever its arm: Spearman's rank correlation between its held-out MLM loss and "
            "its GLUE dev score (negative: a lower loss goes with a higher score). An association across runs, not "
            "an effect of the masking: the runs differ in more than their loss.", "",
            *markdown.table(["score", "runs", "Spearman ρ with MLM loss", "p (two-sided)"], body)]


def summary_columns(metrics) -> list[tuple[Metric, Metric]]:
    """(shown, compared) pairs: perplexity shown, its difference in nats; overall and the rarest bucket; GLUE."""
    ppl = [m for m in metrics if m.label == "perplexity" or m.label.startswith("ppl freq")]
    nats = [m for m in metrics if m.label.endswith("(nats)")]  # the same order: overall, then each bucket
    pairs = list(zip(ppl, nats))
    return pairs[:1] + pairs[1:][-1:] + [(m, m) for m in metrics if m.label == "GLUE avg"]


def arm_verdicts(arm, baseline, compared: list[Metric], comparisons) -> list[str]:
    """A sentence per metric; one for the whole arm when it is the baseline's run again."""
    same = [c for c in comparisons if c is not None and c.identical]
    if same:
        return [f"- {verdict(arm, baseline, compared[0], same[0])}"]
    return [f"- {verdict(arm, baseline, m, c)}" for m, c in zip(compared, comparisons)]


def gate_outcomes(rows: list[dict], groups) -> tuple[dict | None, list[dict]]:
    """The study's validity gates as its rows recorded them (None: no gates), and each gate's outcome."""
    gates = next((row["gates"] for row in rows if row.get("gates")), None)
    return gates, gate_results(gates["min"], groups.get(gates["arm"], [])) if gates else []


def gates_section(gates: dict | None, results: list[dict], groups) -> list[str]:
    """The study's validity gates, as its rows recorded them, and whether the gate arm's means met them."""
    if gates is None:
        return []
    arm_rows = groups.get(gates["arm"], [])
    body = [[r["path"], f"{r['least']:g}", f"{r['mean']:.4g}", "held" if r["held"] else "**failed**"] for r in results]
    held = bool(results) and all(r["held"] for r in results)
    # What the gates show is the study's to say: a gate floor need not mean the model left the unigram plateau.
    verdict = ("All gates held: the baseline trained as the study required, so the comparisons below count."
               if held else "A gate failed: the comparisons below are reported, but no conclusion is drawn from them.")
    return ([f"## Validity gates (means over the {len(arm_rows)} seeds of {gates['arm']}, fixed before the runs)", ""]
            + markdown.table(["figure", "least", "mean", "outcome"], body) + [verdict, ""])


# ----- the pre-registered decision -----------------------------------------------------------
WIN, LOSE, INCONCLUSIVE, NO_CALL = "win", "lose", "inconclusive", "no call"


def decide(rule: dict, primary: Comparison | None, guards: dict[str, Comparison | None]) -> tuple[str, str]:
    """The rule's call on one arm (win, lose, inconclusive, no call) and why, from its paired comparisons."""
    if primary is None or primary.n < 2:
        return NO_CALL, "fewer than 2 seeds paired with the baseline"
    if primary.identical:
        return NO_CALL, "the baseline's computation again (identical by construction)"
    if not primary.spread:
        return INCONCLUSIVE, "the same difference in every seed: no interval"
    sign = -1.0 if rule["lower_is_better"] else 1.0  # gain > 0: the arm is better
    gain, bounds = sign * primary.diff, sorted((sign * primary.low, sign * primary.high))
    if bounds[1] < 0:
        if -gain >= rule["min_effect"]:
            return LOSE, "worse: the interval excludes 0 and the mean reaches the least effect"
        return INCONCLUSIVE, f"worse, by less than the least effect ({rule['min_effect']:g})"
    if bounds[0] <= 0:
        return INCONCLUSIVE, "the interval contains 0"
    if gain < rule["min_effect"]:
        return INCONCLUSIVE, f"better, by less than the least effect ({rule['min_effect']:g})"
    failed = [guard_failure(path, c, rule["guard"][path]) for path, c in guards.items()
              if c is None or c.diff < -rule["guard"][path]]
    if failed:
        return INCONCLUSIVE, "better, but a guard failed: " + "; ".join(failed)
    return WIN, "better: the interval excludes 0, the mean reaches the least effect, every guard held"


def guard_failure(path: str, comparison: Comparison | None, tolerance: float) -> str:
    return f"{path} not measured" if comparison is None else f"{path} fell by {-comparison.diff:.3g} > {tolerance:g}"


def prior_shift(primary: Comparison | None, rarest: Comparison | None, lower_is_better: bool,
                recalibrated_call: str | None = None) -> bool:
    """A significant loss drop in the rarest frequency bucket that is no gain of the model's: moving targets
    towards rare ids refits the output prior by itself, which says nothing about masking.

    "No gain" is measured where the rows have the prior-free loss (the bias refitted, recalibrate.py):
    it is not a win there. Rows without it fall back to "no significant overall gain".
    """
    if rarest is None or not rarest.significant or rarest.diff >= 0:
        return False
    if recalibrated_call is not None:
        return recalibrated_call != WIN
    overall_gain = primary is not None and primary.significant and (primary.diff < 0) == lower_is_better
    return not overall_gain


def rule_text(rule: dict, rarest: Metric | None, recalibrated: Metric | None) -> str:
    side, other = ("below", "above") if rule["lower_is_better"] else ("above", "below")
    guards = "".join(f", and mean Δ {path} ≥ −{tol:g}" for path, tol in rule["guard"].items())
    text = (f"An arm **wins** if the 95% paired t-interval of Δ {rule['metric']} lies {side} 0, |mean Δ| ≥ "
            f"{rule['min_effect']:g}{guards}; it **loses** if the interval lies {other} 0 and |mean Δ| ≥ "
            f"{rule['min_effect']:g}; anything else is **inconclusive**. The Holm column makes the same call with "
            "the arms' p-values adjusted together (Holm's step-down, 5% for any false call across the arms).")
    if rarest is not None:
        unexplained = ("the prior-free loss (bias refitted) is not a win" if recalibrated is not None
                       else "no significant overall gain")
        text += (f" A significant gain in the rarest frequency bucket ({rarest.label}) where {unexplained} is "
                 "called a **prior shift**.")
    return text


def decision_section(rows: list[dict], groups, baseline: str, metrics: list[Metric], gates_held: bool) -> list[str]:
    """The study's decision rule, as its rows recorded it, applied to every arm against the baseline."""
    rule = next((row["decision"] for row in rows if row.get("decision")), None)
    base_rows = groups.get(baseline, [])
    if rule is None or not base_rows or len(groups) < 2:
        return []
    primary = Metric(rule["metric"], tuple(rule["metric"].split(".")), rule["lower_is_better"])
    guards = [Metric(path, tuple(path.split(".")), False) for path in rule["guard"]]
    buckets = [m for m in metrics if m.label.startswith("loss freq") and m.path[0] == "eval"]  # frequent first
    rarest = buckets[-1] if buckets else None
    recalibrated = next((m for m in metrics if m.label == "recalibrated loss (nats)"), None)
    arms = [arm for arm in groups if arm != baseline]
    mains = {arm: compare(groups[arm], base_rows, primary) for arm in arms}
    adjusted = dict(zip(arms, holm([c.p if c is not None else math.nan for c in mains.values()])))
    header = ["arm", "paired seeds", f"Δ {primary.label} [95% t-interval]", "p", "p (Holm)"]
    header += [f"Δ {m.label}" for m in guards] + ([f"Δ {rarest.label}"] if rarest else [])
    header += (["Δ recalibrated loss (nats)"] if recalibrated else []) + ["call", "call (Holm)", "why"]
    body = []
    for arm in arms:
        main, checks = mains[arm], [compare(groups[arm], base_rows, m) for m in guards]
        call, why = decide(rule, main, dict(zip(rule["guard"], checks)))
        holm_call = call if call not in (WIN, LOSE) or adjusted[arm] < 0.05 else INCONCLUSIVE
        rare = compare(groups[arm], base_rows, rarest) if rarest else None
        recal = compare(groups[arm], base_rows, recalibrated) if recalibrated else None
        recal_call = decide({**rule, "guard": {}}, recal, {})[0] if recalibrated else None
        shifted = ", prior shift" if prior_shift(main, rare, rule["lower_is_better"], recal_call) else ""
        provisional = f" (provisional: {main.n} of {len(base_rows)} seeds)" if main and main.n < len(base_rows) else ""
        body.append([arm, str(main.n if main else 0), format_delta(main), format_p(main.p if main else math.nan),
                     format_p(adjusted[arm]), *map(format_delta, checks), *([format_delta(rare)] if rarest else []),
                     *([format_delta(recal)] if recalibrated else []), f"**{call}{shifted}{provisional}**",
                     f"**{holm_call}**", why])
    caveat = [] if gates_held else ["A validity gate failed: these calls are not conclusions.", ""]
    return (["## Pre-registered decision (the study's rule as its rows record it, applied as written)", "",
             rule_text(rule, rarest, recalibrated), ""] + caveat + markdown.table(header, body) + [""])


def format_p(p: float) -> str:
    return "–" if math.isnan(p) else f"{p:.2g}"


def summary_section(groups, baseline, metrics) -> list[str]:
    """The seed's comparison: baseline, then each arm; perplexity with its difference in nats, GLUE."""
    pairs = summary_columns(metrics)
    base_rows = groups.get(baseline, [])
    compared = {arm: [compare(rows, base_rows, m) for _, m in pairs] for arm, rows in groups.items() if arm != baseline}
    boot = boot_label(c for cs in compared.values() for c in cs)
    header = ["arm", "masking"]
    header += [h for shown, m in pairs for h in (shown.label, f"Δ {m.label} [95% t-interval]", boot)]
    body, sentences = [], []
    for arm, rows in groups.items():
        cells = [arm + (" (baseline)" if arm == baseline else ""), masking_label(rows[0])]
        for (shown, _), c in zip(pairs, compared.get(arm, [None] * len(pairs))):
            deltas = ["", ""] if arm == baseline else [format_delta(c), format_boot(c)]
            cells += [mean_std(by_seed(rows, shown)), *deltas]
        body.append(cells)
        if arm != baseline and base_rows:
            sentences += arm_verdicts(arm, baseline, [m for _, m in pairs], compared[arm])
    return ["## Summary in the seed's shape: the baseline, then each arm", ""] + markdown.table(header, body) + sentences + [""]


def metric_table(title: str, groups, baseline, metrics, delta_metrics=None) -> list[str]:
    """Mean ± std of ``metrics``, then each arm's paired difference from the baseline in ``delta_metrics``
    (default: the same): the t-interval table first, the bootstrap second."""
    if not metrics:
        return []
    header = ["arm"] + [m.label for m in metrics]
    values = [[arm] + [mean_std(by_seed(rows, m)) for m in metrics] for arm, rows in groups.items()]
    lines = [f"## {title}", "", "Mean ± std over seeds:", ""] + markdown.table(header, values)
    delta_metrics = delta_metrics or metrics
    compared = {arm: [compare(rows, groups[baseline], m) for m in delta_metrics]
                for arm, rows in groups.items() if arm != baseline and baseline in groups}
    if compared:
        delta_header = ["arm"] + [m.label for m in delta_metrics]
        boot = boot_label(c for cs in compared.values() for c in cs)
        lines += [f"Difference from {baseline} (arm − baseline, paired by seed), 95% t-interval; "
                  "* = the t-interval excludes 0:", ""]
        lines += markdown.table(delta_header, [[arm] + [format_delta(c) for c in cs] for arm, cs in compared.items()])
        few = boot.startswith("range")  # below FEW_SEEDS the bootstrap spans the observed differences
        lines += [f"Secondary: {'range' if few else '95% bootstrap CI'} of the same differences (percentile bootstrap"
                  + ("; with so few seeds it is not a confidence interval" if few else "") + "):", ""]
        lines += markdown.table(delta_header, [[arm] + [format_boot(c) for c in cs] for arm, cs in compared.items()])
    return lines


def target_share_section(curves) -> list[str]:
    """Each arm's share of training targets per frequency bucket: the target prior it trained on.

    The number behind a "prior shift": moving targets to rare ids lowers their held-out loss by
    refitting the output bias, whatever chose the positions. Over the whole run and past
    LATE_PROGRESS of it (ADM's weight on the scores grows with progress). Mean over seeds of each
    run's mean over its logged windows (equal numbers of steps each)."""
    keys = mask_share_keys(curves)
    if not keys:
        return []
    body = []
    for arm, runs in curves.items():
        cells = [arm]
        for key in keys:
            shares = [last_per_x(row, records, lambda r, key=key: r.get(key), progress_of) for row, records in runs]
            whole = [np.mean(list(s.values())) for s in shares if s]
            late = [np.mean(tail) for s in shares if (tail := [v for at, v in s.items() if at > LATE_PROGRESS])]
            cells.append(" / ".join(f"{np.mean(part):.3f}" if part else "n/a" for part in (whole, late)))
        body.append(cells)
    header = ["arm"] + [f"freq {key.removeprefix('mask_share_freq_')}" for key in keys]
    return ["## Where the training targets went", "",
            "Share of the selected (masked) training positions in each corpus-frequency bucket: over the whole "
            f"run / over its last {100 * (1 - LATE_PROGRESS):.0f}% (mean over seeds, from metrics.jsonl). Uniform "
            "masking's shares are the corpus's; an arm that moves targets to rare ids lowers their held-out loss by "
            "that alone (a prior shift).", ""] + markdown.table(header, body) + [""]


def steps_to_target(row: dict, records: list[dict], key: str, target: float) -> int | None:
    """The first evaluation step at which the run's held-out ``key`` fell below ``target`` (None: never)."""
    reached = [record["step"] for record in records
               if isinstance(record.get("eval"), dict) and (record["eval"].get(key) or math.inf) < target]
    return min(reached, default=None)


def steps_to_target_section(rows: list[dict], curves, baseline: str) -> list[str]:
    """When each run left the plateau: the first evaluation below the study's target (decision.target), in steps
    and FLOPs, so "learns faster" is measured as well as "ends lower"; Δ steps paired by seed where both reached."""
    rule = next((row["decision"] for row in rows if row.get("decision")), None) or {}
    target, metric = rule.get("target"), rule.get("metric", "")
    if target is None or not metric.startswith("eval.") or not curves:
        return []
    key = metric.removeprefix("eval.")
    reached = {arm: {row["seed"]: (steps_to_target(row, records, key, target), row.get("flops_per_step", math.nan))
                     for row, records in runs} for arm, runs in curves.items()}
    base = {seed: steps for seed, (steps, _) in reached.get(baseline, {}).items() if steps is not None}
    body = []
    for arm, seeds in reached.items():
        steps = {seed: at for seed, (at, _) in seeds.items() if at is not None}
        flops = [at * per_step for at, per_step in seeds.values() if at is not None]
        paired = [steps[seed] - base[seed] for seed in steps if seed in base]
        delta = "" if arm == baseline or not paired else f"{np.mean(paired):+.0f} ({len(paired)} seeds)"
        body.append([arm, " / ".join(str(seeds[seed][0] or "never") for seed in sorted(seeds)),
                     mean_std({s: float(v) for s, v in steps.items()}), f"{np.mean(flops):.3g}" if flops else "–",
                     f"{len(seeds) - len(steps)} of {len(seeds)}", delta])
    return [f"## Steps to target (held-out {key} below {target:g}, the study's decision.target)", "",
            "The first evaluation step at which each run's held-out figure fell below the target, read from its "
            "metrics.jsonl (resolution: the evaluation interval); FLOPs = that step x the arm's FLOPs per step.", "",
            *markdown.table(["arm", "step per seed", "mean ± std", "mean FLOPs", "never reached",
                             f"Δ steps vs {baseline} (paired)"], body), ""]


def cost_section(groups) -> list[str]:
    header = ["arm", "budget", "steps", "batch", "tokens seen", "est. FLOPs", "scorer share of FLOPs",
              "train s", "scorer s", "wall s (incl. eval, GLUE)", "torch threads"]
    body = []
    for arm, rows in groups.items():
        mean = lambda key: np.mean([row.get(key, math.nan) for row in rows])  # noqa: E731
        batch = np.mean([row_sequences_per_step(row) for row in rows])
        body.append([arm, rows[0].get("budget", "?"), f"{mean('steps'):.0f}", f"{batch:.0f}",
                     f"{mean('tokens_seen'):.3g}", f"{mean('flops'):.3g}", f"{100 * mean('scorer_share'):.1f}%",
                     f"{mean('train_seconds'):.0f}", f"{mean('scorer_seconds'):.1f}", f"{mean('wall_seconds'):.0f}",
                     thread_counts(rows)])
    lines = ["## Budget and cost (means over seeds)", ""] + markdown.table(header, body)
    if len({row.get("torch_threads") for group in groups.values() for row in group}) > 1:
        lines += ["", "Runs were made with different torch thread counts (or, \"?\", before rows recorded it): "
                  "seconds compare only between runs made alike; FLOPs compare across all.", ""]
    return lines


def thread_counts(rows: list[dict]) -> str:
    """The torch thread counts an arm's runs used, e.g. "2" or "1, 2" ("?" for rows made before it was recorded)."""
    return ", ".join(sorted({str(row.get("torch_threads", "?")) for row in rows}))


def held_out_data_notes(rows: list[dict]) -> list[str]:
    """A warning for each further held-out set whose rows were evaluated on different prepared data.

    Rows record the prepared dataset's hash since WikiText's <unk> became the [UNK] id
    (2026-12-01); rows from before record none. A study whose rows all lack it is not flagged.
    """
    notes = []
    evaluated = [report for row in rows for report in (row.get("eval_data") or {}).items() if "mlm_loss" in report[1]]
    for name in dict.fromkeys(name for name, _ in evaluated):
        counts = Counter(held_out.get("dataset", "not recorded") for each, held_out in evaluated if each == name)
        if len(counts) > 1:
            kinds = ", ".join(f"{dataset} ({n} row{'s' * (n != 1)})" for dataset, n in counts.items())
            notes.append(f"**{name} was evaluated on different prepared data in different rows** ({kinds}): its "
                         "figures compare only between rows of the same data. Rows that record none were made "
                         "before 2026-12-01, when WikiText's <unk> became the [UNK] id.")
    return [*notes, ""] if notes else []


def glue_notes(rows: list[dict]) -> list[str]:
    skipped = sorted({row["glue"]["skipped"] for row in rows if "skipped" in (row.get("glue") or {})})
    return [f"GLUE skipped: {reason}." for reason in skipped]


def bucket_example(metrics: list[Metric]) -> str:
    """" (0_500 = the 500 most frequent ids)", from the rows' first bucket; "" without buckets."""
    first = next((m.label.removeprefix("ppl freq ") for m in metrics if m.label.startswith("ppl freq ")), None)
    return f" ({first} = the {first.split('_')[1]} most frequent ids)" if first else ""


def write_report(results: Path, out: Path) -> Path:
    """Write report.md and the PNG plots to ``out``; returns the report's path."""
    rows, notes = load_rows(results)
    baseline = choose_baseline(rows)
    groups = group_by_arm(rows, baseline)
    metrics = metrics_of(rows)
    if baseline not in groups:
        notes.append(f"the baseline arm {baseline!r} has no rows: no differences can be computed")
    out.mkdir(parents=True, exist_ok=True)
    curves, missing = read_curves(groups, results.parent)
    if missing:
        notes.append(f"curve plots skipped for {len(missing)} runs whose metrics.jsonl is missing (e.g. {missing[0]}), "
                     "and their target shares; the other tables come from results.jsonl alone")
    images = write_plots(groups, baseline, metrics, curves, out)
    studies = ", ".join(sorted({row.get("study", "?") for row in rows}))
    seeds = sorted({row["seed"] for row in rows})
    lines = [f"# Study {studies}: each arm against {baseline}", "",
             "Every number below is reproduced by (the experiment skips runs already in results.jsonl):", "",
             *commands(rows, results, out), "",
             f"{len(rows)} runs, {len(groups)} arms, seeds {seeds}; mlmlab "
             f"{', '.join(sorted({str(row.get('mlmlab_version')) for row in rows}))}.", ""]
    gates, outcomes = gate_outcomes(rows, groups)
    lines += gates_section(gates, outcomes, groups)
    gates_held = all(outcome["held"] for outcome in outcomes)
    lines += decision_section(rows, groups, baseline, metrics, gates_held)
    lines += summary_section(groups, baseline, metrics)
    lines += metric_table("Held-out perplexity, overall and per frequency bucket; differences in nats of MLM loss",
                          groups, baseline, [m for m in metrics if "ppl" in m.label or m.label == "perplexity"],
                          [m for m in metrics if m.label.endswith("(nats)") and m.path[0] == "eval"])
    lines += steps_to_target_section(rows, curves, baseline)
    recalibrated = recalibrated_metrics(rows)
    if recalibrated:
        lines += metric_table("Prior-free loss: the output bias refitted on half the held-out targets, the other "
                              "half scored (nats; raw = the model's own bias on the same half)", groups, baseline,
                              recalibrated)
    lines += target_share_section(curves)
    lines += metric_table("Held-out MLM and NSP accuracy", groups, baseline,
                          [m for m in metrics if m.label.endswith("accuracy") and m.path[0] == "eval"])
    further = [m for m in metrics if m.path[0] == "eval_data"]
    if further:
        lines += metric_table("Further held-out sets (the study's eval_data; same fixed masks)", groups, baseline,
                              further) + held_out_data_notes(rows)
    glue = [m for m in metrics if m.label.startswith("GLUE")]
    lines += metric_table("GLUE dev scores (x100; median over fine-tuning seeds, then over pretraining seeds "
                          "as mean ± std)", groups, baseline, glue) + glue_notes(rows) + [""]
    probes = probe_metrics(rows)
    if probes:
        lines += metric_table("Frozen linear probes (dev, x100; gain = pretrained − a random-init encoder of the same "
                              "architecture)", groups, baseline, probes)
    lines += downstream_section(rows, metrics)
    lines += cost_section(groups)
    lines += ["## Plots", ""] + [f"![{name}]({name})" for name in images] + [""]
    lines += ["## How to read this", "",
              "- Perplexity is exp(mean cross-entropy) on the held-out sample under the same fixed uniform 15% masks "
              "for every arm; frequency buckets are ranks of the target token in the pretraining corpus"
              f"{bucket_example(metrics)}.",
              "- Losses are compared in nats: Δ of the MLM loss (overall) and of log(perplexity) per bucket. "
              "A Δ of d nats multiplies perplexity by exp(d) (+0.01 nats ≈ +1%).",
              "- Δ = arm − baseline, averaged over the seeds both have, paired by seed. The primary interval is the "
              "95% paired t-interval over seeds (df = n − 1); verdicts and * use it. The secondary "
              f"column is a percentile bootstrap ({BOOTSTRAP_RESAMPLES} resamples of the paired seeds, generator "
              f"seed {BOOTSTRAP_SEED}); below {FEW_SEEDS} seeds it is labelled a range, since it spans little more "
              "than the observed differences (with 3 seeds, exactly their min and max). "
              "Lower perplexity and loss are better; higher accuracy and GLUE are better.",
              "- \"identical by construction\": every metric of the arm equals the baseline's in every seed, so the "
              "two arms ran the same computation; that is not a measured null.",
              "- FLOPs are estimates from the model config (mlmlab/experiments/budget.py), scorer passes included.",
              *[f"- Note: {note}" for note in notes], ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
