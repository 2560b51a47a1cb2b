"""The study's pre-registered decision rule, as its rows record it, applied to an arm's paired comparisons:
win, lose, inconclusive or no call, and when a gain in the rarest bucket is only a prior shift."""

from mlmlab.experiments.reporting.measures import Metric
from mlmlab.experiments.reporting.statistics import Comparison

WIN, LOSE, INCONCLUSIVE, NO_CALL = "win", "lose", "inconclusive", "no call"


def decide(rule: dict, primary: Comparison | None, guards: dict[str, Comparison | None]) -> tuple[str, str]:
    """The rule's call on one arm (win, lose, inconclusive, no call) and why, from its paired comparisons."""
    if primary is None or primary.n < 2:
        return NO_CALL, "fewer than 2 seeds paired with the reference arm"
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
    failed = [
        guard_failure(path, c, rule["guard"][path])
        for path, c in guards.items()
        if c is None or c.diff < -rule["guard"][path]
    ]
    if failed:
        return INCONCLUSIVE, "better, but a guard failed: " + "; ".join(failed)
    held = ", every guard held" if rule["guard"] else ""  # a rule without guards has none to hold
    return WIN, f"better: the interval excludes 0, the mean reaches the least effect{held}"


def guard_failure(path: str, comparison: Comparison | None, tolerance: float) -> str:
    return f"{path} not measured" if comparison is None else f"{path} fell by {-comparison.diff:.3g} > {tolerance:g}"


def holm_call(call: str, adjusted_p: float) -> str:
    """The same call with the arms' p-values adjusted together (Holm): a win or a loss stands only below 0.05."""
    return call if call not in (WIN, LOSE) or adjusted_p < 0.05 else INCONCLUSIVE


def holm_family_open(held: str, p: float, tested: int, family: int, members: str) -> str:
    """What a Holm win or loss says while the family's untested members may still undo it ("" where they cannot).

    Adjusted p-values only grow as members join, so an inconclusive Holm call stays one; a win or a loss is final
    once every member is tested, or where even the whole family's largest factor (family x p) keeps it below 0.05.
    """
    still_open = held in (WIN, LOSE) and tested < family and family * p >= 0.05
    return f" (provisional: Holm over {tested} of {family} {members})" if still_open else ""


def prior_shift(
    primary: Comparison | None, rarest: Comparison | None, lower_is_better: bool, recalibrated_call: str | None = None
) -> bool:
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
    text = (
        f"An arm **wins** if the 95% paired t-interval of Δ {rule['metric']} lies {side} 0, |mean Δ| ≥ "
        f"{rule['min_effect']:g}{guards}; it **loses** if the interval lies {other} 0 and |mean Δ| ≥ "
        f"{rule['min_effect']:g}; anything else is **inconclusive**. The Holm column makes the same call with "
        "the arms' p-values adjusted together (Holm's step-down, 5% for any false call across the arms)."
    )
    if rarest is not None:
        unexplained = (
            "the prior-free loss (bias refitted) is not a win"
            if recalibrated is not None
            else "there is no significant overall gain"
        )
        text += (
            f" A significant gain in the rarest frequency bucket ({rarest.label}) where {unexplained} is "
            "called a **prior shift**."
        )
    return text
