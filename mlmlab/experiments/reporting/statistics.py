"""Paired comparisons of an arm with the baseline, one metric at a time, over the seeds both have.

The seed fixes the initial weights and data order, so seed s of an arm and seed s of the
baseline differ only by the masking. The primary interval is a paired t-interval over seeds
(df = n - 1); a percentile bootstrap is computed beside it as a secondary interval, a "range"
below FEW_SEEDS seeds, where it is little more than the min and max of the differences (with 3
seeds, exactly: an all-minimum resample has probability 1/27 > 2.5%). An arm whose every metric
equals the baseline's in every seed ran the same computation: its comparison says so
(``identical``), so that it is not read as a null.
"""

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

from mlmlab.experiments.reporting.measures import Metric, by_seed, metrics_of

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0  # a fixed generator, so the intervals are the same every time the report is made
FEW_SEEDS = 5  # below this the bootstrap is a range, not a CI, and the t-interval rests on unchecked normality


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
    sd: float = math.nan  # sample standard deviation of the paired differences (ddof 1): what sets the power

    @property
    def spread(self) -> bool:
        """The paired differences vary between seeds: without that there is no interval to draw."""
        return not math.isnan(self.low)

    @property
    def significant(self) -> bool:
        return self.n >= 2 and not self.identical and self.spread and not self.low <= 0.0 <= self.high


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
    return compare_by_seed(by_seed(rows, metric), by_seed(base_rows, metric), identical_runs(rows, base_rows))


def compare_by_seed(arm: dict[int, float], baseline: dict[int, float], identical: bool = False) -> Comparison | None:
    """The arm's values against the baseline's, seed -> value each, over the seeds both have."""
    seeds = sorted(set(arm) & set(baseline))
    if not seeds:
        return None
    diffs = np.array([arm[s] - baseline[s] for s in seeds])
    if len(seeds) < 2:
        return Comparison(float(diffs.mean()), math.nan, math.nan, 1, identical=identical)
    low, high, p = t_interval(diffs)
    return Comparison(
        float(diffs.mean()),
        low,
        high,
        len(seeds),
        *paired_bootstrap(diffs),
        p=p,
        all_zero=not diffs.any(),
        identical=identical,
        sd=float(diffs.std(ddof=1)),
    )


DETECTION_POWER = 0.8  # the conventional power a design is sized for


def detectable_effect(sd: float, n: int, alpha: float = 0.05, power: float = DETECTION_POWER) -> float:
    """The smallest true mean difference a two-sided paired t-test at ``alpha`` over ``n`` seeds finds with
    ``power``, at paired sd ``sd``: the noncentral t's exact power, solved for the effect (NaN below 2 seeds or
    without spread). What a null of this design can and cannot rule out."""
    if n < 2 or not sd > 0:
        return math.nan
    df, scale = n - 1, sd / math.sqrt(n)
    critical = stats.t.ppf(1 - alpha / 2, df)

    def shortfall(effect: float) -> float:
        shift = effect / scale
        wrong_side = stats.nct.cdf(-critical, df, shift)  # NaN in scipy where it is below ~1e-20
        return stats.nct.sf(critical, df, shift) + np.nan_to_num(wrong_side) - power

    enough = (critical + 8) * scale  # power there exceeds 0.8 from 3 seeds up; with 2 the t's tails need more
    while shortfall(enough) < 0:
        enough *= 2
    return float(optimize.brentq(shortfall, 0.0, enough))
