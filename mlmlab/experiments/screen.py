"""A screen and its confirmation: many arms on a few seeds, one picked by a rule written before them, then the
pick and its references on every seed of the study.

A study file's ``screen:`` block names the seeds every arm runs (the screen's), the candidates the pick is
made among, and the arms that run every seed whatever the pick (the references of the primary contrasts).
The pick is the candidate with the best mean decision metric over the screen's seeds, taken once every
candidate's screen runs are in; a tie goes to the candidate listed first. The runner runs the pick's
remaining seeds; the report resolves ``screen.selected`` in a contrast to it. The rule is the study's, so
both read it from here.

    screen:
      seeds: [0, 1]
      candidates: [adm-entropy, adm-max-prob, adm-linear]
      confirm: [dynamic]
    decision: {metric: eval.mlm_loss, contrasts: [[screen.selected, dynamic]]}
    seeds: [0, 1, 2, 3, 4, 5]
"""

import math
from dataclasses import dataclass

import numpy as np

from mlmlab.errors import UserError
from mlmlab.experiments.gates import row_value

SELECTED = "screen.selected"  # in decision.contrasts: the screen's pick, resolved from the rows
SCREEN_KEYS = ("seeds", "candidates", "confirm")


@dataclass(frozen=True)
class Screen:
    seeds: tuple  # every arm runs these seeds
    candidates: tuple  # arm names the pick is made among
    confirm: tuple  # arm names that run every seed of the study whatever the pick

    def runs_seed(self, arm: str, seed: int) -> bool | None:
        """Whether ``arm`` runs ``seed``: True or False, or None where it depends on the pick (a candidate's
        seed past the screen's)."""
        if seed in self.seeds or arm in self.confirm:
            return True
        return None if arm in self.candidates else False


def read_screen(value, arm_names: list[str], seeds: list[int]) -> Screen | None:
    """The study file's ``screen:`` block, checked against its arms and seeds."""
    if value is None:
        return None
    example = "e.g. {seeds: [0, 1], candidates: [adm-entropy, adm-linear], confirm: [dynamic]}"
    if (
        not isinstance(value, dict)
        or set(value) - set(SCREEN_KEYS)
        or not all(isinstance(value.get(key), list) and value.get(key) for key in SCREEN_KEYS)
    ):
        raise UserError(f"study key 'screen' must map {', '.join(SCREEN_KEYS)} to non-empty lists; {example}")
    screen = Screen(tuple(value["seeds"]), tuple(map(str, value["candidates"])), tuple(map(str, value["confirm"])))
    unknown = [name for name in screen.candidates + screen.confirm if name not in arm_names]
    if unknown:
        raise UserError(f"screen names {unknown[0]!r}, which is not an arm; arms: {', '.join(arm_names)}")
    if set(screen.candidates) & set(screen.confirm):
        raise UserError("screen: an arm is a candidate or a confirm arm, not both; the pick runs every seed anyway")
    if not set(screen.seeds) < set(seeds):
        raise UserError(
            f"screen seeds {list(screen.seeds)} must be some, not all, of the study's seeds {seeds}: "
            "the rest are the confirmation's"
        )
    return screen


def screen_pick(screen: Screen, rows: list[dict], metric: str, lower_is_better: bool) -> str | None:
    """The candidate with the best mean ``metric`` over the screen's seeds; None until every candidate's screen
    runs are in. A candidate whose mean is not finite (a diverged run) is never picked."""
    means = screen_means(screen, rows, metric)
    if means is None:
        return None
    finite = [(mean if lower_is_better else -mean, index, arm) for index, (arm, mean) in enumerate(means.items())]
    finite = [item for item in finite if math.isfinite(item[0])]
    return min(finite)[2] if finite else None


def screen_means(screen: Screen, rows: list[dict], metric: str) -> dict | None:
    """{candidate: mean metric over the screen's seeds}, in the candidates' order; None while one is missing."""
    means = {}
    for arm in screen.candidates:
        values = {
            row["seed"]: row_value(row, metric) for row in rows if row["arm"] == arm and row["seed"] in screen.seeds
        }
        if set(values) != set(screen.seeds):
            return None
        means[arm] = float(np.mean(list(values.values())))
    return means
