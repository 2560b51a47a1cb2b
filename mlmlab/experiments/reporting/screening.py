"""A study's screen in its report (experiments/screen.py): the pick by the study's own rule, every screened arm
against the first candidate and the baseline on the screen's seeds, and the pick on the fresh seeds alone.

A screen runs each arm on few seeds (two, say): one paired t-interval per arm would rest on one degree of
freedom. The screen's intervals pool instead: against a reference, each arm's paired differences over the
screen's seeds give a variance with n - 1 degrees of freedom, and the pooled variance (weighted by them) serves
every arm, with their summed degrees of freedom. Descriptive throughout: the rule's call is its contrasts'.
"""

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from mlmlab.errors import UserError
from mlmlab.experiments.reporting.measures import Metric, by_seed
from mlmlab.experiments.reporting.statistics import compare_by_seed
from mlmlab.experiments.screen import SELECTED, Screen, screen_means, screen_pick
from mlmlab.experiments.study import Study, load_study
from mlmlab.utils import markdown


def study_of(rows: list[dict]) -> Study | None:
    """The study file the rows came from, where their study_source is one and still loads; else None."""
    sources = {row.get("study_source") for row in rows} - {None}
    if len(sources) != 1:
        return None
    try:
        return load_study(sources.pop())
    except (UserError, OSError):
        return None


def resolve_pick(rule: dict, rows: list[dict]) -> dict:
    """The rule with screen.selected in its contrasts replaced by the screen's pick, once the screen has made it."""
    study = study_of(rows)
    if study is None or study.screen is None:
        return rule
    pick = screen_pick(study.screen, rows, rule["metric"], rule["lower_is_better"])
    if pick is None:
        return rule
    contrasts = [[pick if name == SELECTED else name for name in pair] for pair in rule["contrasts"]]
    return {**rule, "contrasts": contrasts}


@dataclass
class Pooled:
    """Differences from a reference over the screen's seeds, each arm's interval from their pooled variance."""

    diffs: dict  # arm -> {seed: arm - reference}
    sd: float  # pooled sd of one paired difference (NaN: no arm has two seeds)
    df: int  # its degrees of freedom: the arms' n - 1 summed

    def interval(self, arm: str) -> tuple[float, float, float]:
        """(mean difference, low, high): mean ± t(0.975, df) · sd / √n."""
        values = list(self.diffs[arm].values())
        mean = float(np.mean(values)) if values else math.nan
        if not self.df or not values:
            return mean, math.nan, math.nan
        half = float(stats.t.ppf(0.975, self.df)) * self.sd / math.sqrt(len(values))
        return mean, mean - half, mean + half


def pooled(groups, reference: str, arms: list[str], seeds, metric: Metric, pooled_over: list[str]) -> Pooled:
    """Each of ``arms`` minus ``reference`` on ``seeds``, the variance pooled over the arms of ``pooled_over``."""
    base = {seed: value for seed, value in by_seed(groups.get(reference, []), metric).items() if seed in seeds}
    diffs = {}
    for arm in arms:
        values = by_seed(groups.get(arm, []), metric)
        diffs[arm] = {seed: values[seed] - base[seed] for seed in sorted(set(values) & set(base))}
    pool = [list(diffs[arm].values()) for arm in pooled_over if len(diffs.get(arm, {})) >= 2]
    df = sum(len(values) - 1 for values in pool)
    squares = sum(float(np.var(values, ddof=1)) * (len(values) - 1) for values in pool)
    return Pooled(diffs, math.sqrt(squares / df) if df else math.nan, df)


def screen_section(rows: list[dict], groups, baseline: str, rule: dict | None) -> list[str]:
    """The screen: each arm's mean on the screen's seeds, its difference from the first candidate and from the
    baseline with pooled intervals, the pick, and the pick against the baseline on the seeds past the screen's."""
    study = study_of(rows)
    if study is None or study.screen is None or rule is None:
        return []
    screen, metric = study.screen, Metric(rule["metric"], tuple(rule["metric"].split(".")), rule["lower_is_better"])
    reference = screen.candidates[0]
    arms = [arm.name for arm in study.arms if arm.name in groups]
    others = [arm for arm in screen.candidates if arm != reference]
    against_reference = pooled(groups, reference, arms, screen.seeds, metric, others)
    against_baseline = pooled(groups, baseline, arms, screen.seeds, metric, list(screen.candidates))
    pick = screen_pick(screen, rows, rule["metric"], rule["lower_is_better"])
    means = screen_means(screen, rows, rule["metric"]) or {}
    body = [screen_row(arm, groups, screen, metric, against_reference, against_baseline) for arm in arms]
    return (
        [
            f"## Screen (descriptive): every arm on seeds {list(screen.seeds)}",
            "",
            pick_text(screen, pick, means, metric),
            "",
            f"Δ against {reference} (the first candidate) and against {baseline}, over the screen's seeds; each "
            "interval is mean ± t(0.975, df) · s / √n, s the sd of one paired difference pooled over the "
            f"candidates' differences from that reference (s = {format_sd(against_reference)} against {reference}, "
            f"{format_sd(against_baseline)} against {baseline}). Two seeds a screen arm: no call is made here.",
            "",
        ]
        + markdown.table(
            [
                "arm",
                f"mean {metric.label} (seeds {', '.join(map(str, screen.seeds))})",
                f"Δ vs {reference} [pooled 95%]",
                "per seed",
                f"Δ vs {baseline} [pooled 95%]",
                "per seed",
            ],
            body,
        )
        + [""]
        + fresh_seeds_lines(screen, groups, baseline, pick, metric)
    )


def screen_row(arm: str, groups, screen: Screen, metric: Metric, *references: Pooled) -> list[str]:
    values = [value for seed, value in by_seed(groups[arm], metric).items() if seed in screen.seeds]
    cells = [arm, f"{np.mean(values):.4f}" if values else "–"]
    for reference in references:
        mean, low, high = reference.interval(arm)
        per_seed = ", ".join(f"{diff:+.3f}" for diff in reference.diffs[arm].values())
        cells += ["–" if math.isnan(mean) else f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]", per_seed or "–"]
    return cells


def pick_text(screen: Screen, pick: str | None, means: dict, metric: Metric) -> str:
    rule = (
        f"The pick (the study's rule): the candidate with the {'lowest' if metric.lower_is_better else 'highest'} "
        f"mean {metric.label} over seeds {list(screen.seeds)}, a tie to the first listed"
    )
    if pick is None:
        return f"{rule}; not made yet: not every candidate's screen runs are in."
    return f"{rule}: **{pick}** ({means[pick]:.4f}); it and {', '.join(screen.confirm)} run every seed."


def fresh_seeds_lines(screen: Screen, groups, baseline: str, pick: str | None, metric: Metric) -> list[str]:
    """The pick against the baseline on the seeds past the screen's alone: the screen's seeds chose the pick, so
    they favour it; these did not."""
    if pick is None:
        return []

    def fresh(arm: str) -> dict:
        return {seed: value for seed, value in by_seed(groups.get(arm, []), metric).items() if seed not in screen.seeds}

    comparison = compare_by_seed(fresh(pick), fresh(baseline))
    if comparison is None:
        return [f"The pick on the seeds past the screen's: none in yet ({pick} − {baseline}).", ""]
    interval = "" if math.isnan(comparison.low) else f" [{comparison.low:+.3f}, {comparison.high:+.3f}]"
    return [
        f"The pick on the seeds past the screen's alone (they did not choose it): {pick} − {baseline} "
        f"{comparison.diff:+.3f}{interval} over {comparison.n} paired seeds (95% t-interval).",
        "",
    ]


def format_sd(result: Pooled) -> str:
    return "–" if math.isnan(result.sd) else f"{result.sd:.3f} ({result.df} df)"
