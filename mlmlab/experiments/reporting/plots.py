"""The report's PNG plots (matplotlib, written to files only)."""

import math
from pathlib import Path

import numpy as np

from mlmlab.experiments.reporting.curves import flops_seen, mask_share_keys, mean_curve, progress_of, sequences_seen
from mlmlab.experiments.reporting.measures import by_seed, downstream_metrics, loss_metric, run_points
from mlmlab.masking.strategies import STRATEGY_ENTRIES

BUCKETS_PNG = "perplexity_buckets.png"
CURVES_PNG = "loss_curves.png"
MASK_SHARE_PNG = "mask_share.png"
ADAPT_FACTOR_PNG = "mask_a.png"
SCORES_PNG = "glue_vs_mlm_loss.png"
PLOTS = (BUCKETS_PNG, CURVES_PNG, MASK_SHARE_PNG, ADAPT_FACTOR_PNG, SCORES_PNG)  # every file a report may write


def scored(rows: list[dict]) -> bool:
    """Whether the arm's masking strategy weights by a scorer (its entry says; unknown here: no)."""
    entry = STRATEGY_ENTRIES.get((rows[0].get("config") or {}).get("masking", {}).get("strategy"))
    return entry is not None and entry.scored


def write_plots(groups, baseline, metrics, curves, out: Path) -> list[str]:
    """PNG files written to ``out`` (names); ``curves`` as read_curves gives them."""
    # Here, not at the top: the backend must be chosen before pyplot is first imported.
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    images = [
        bucket_bars(plt, groups, [m for m in metrics if m.label.startswith("ppl") or m.label == "perplexity"], out)
    ]
    if curves:
        images.append(loss_curves(plt, curves, out))
        adaptive = {arm: runs for arm, runs in curves.items() if scored(groups[arm])}
        if adaptive:
            if mask_share_keys(adaptive):  # uniform masking's shares are the corpus's: nothing to plot without ADM
                baseline_runs = {baseline: curves[baseline]} if baseline in curves else {}
                images.append(mask_share_curves(plt, {**baseline_runs, **adaptive}, out))
            images.append(adapt_factor_curves(plt, adaptive, out))
    if downstream_metrics(metrics):
        images.append(scores_against_loss(plt, groups, metrics, out))
    for stale in set(PLOTS) - set(images):  # an earlier report's plot that this one does not show would mislead
        (out / stale).unlink(missing_ok=True)
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
    return save(plt, fig, out, BUCKETS_PNG)


def loss_curves(plt, curves, out: Path) -> str:
    """Training loss and held-out MLM loss against sequences seen, and the held-out loss against estimated training
    FLOPs: the compute-matched reading of an arm whose scorer or mask rate costs more per step."""
    fig, (train_ax, valid_ax, flops_ax) = plt.subplots(1, 3, figsize=(16, 4))
    for arm, runs in curves.items():
        train_ax.plot(*mean_curve(runs, lambda r: r.get("loss"), sequences_seen), label=arm, lw=1)
        valid_ax.plot(*mean_curve(runs, held_out_loss, sequences_seen), marker="o", label=arm, lw=1)
        flops_ax.plot(*mean_curve(runs, held_out_loss, flops_seen), marker="o", ms=3, label=arm, lw=1)
    train_ax.set(title="training loss (MLM + NSP, mean over seeds)", xlabel="sequences seen", ylabel="loss")
    valid_ax.set(title="validation MLM loss (fixed uniform masks)", xlabel="sequences seen", ylabel="loss")
    flops_ax.set(
        title="validation MLM loss at equal compute", xlabel="estimated training FLOPs (scorer included)", ylabel="loss"
    )
    valid_ax.legend(fontsize=7)
    return save(plt, fig, out, CURVES_PNG)


def held_out_loss(record: dict) -> float | None:
    return record.get("eval", {}).get("mlm_loss")


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
    return save(plt, fig, out, MASK_SHARE_PNG)


def adapt_factor_curves(plt, curves, out: Path) -> str:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for arm, runs in curves.items():
        ax.plot(*mean_curve(runs, lambda r: r.get("mask_a"), progress_of), label=arm, lw=1)
    ax.set(title="ADM adapt factor a", xlabel="training progress", ylabel="a")
    ax.legend(fontsize=7)
    return save(plt, fig, out, ADAPT_FACTOR_PNG)


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
    return save(plt, fig, out, SCORES_PNG)
