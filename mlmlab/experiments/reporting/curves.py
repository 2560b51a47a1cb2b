"""Runs' logged records (metrics.jsonl) as curves: a value per step, against sequences seen or training progress."""

import json
import math
from collections import defaultdict
from functools import lru_cache

import numpy as np

from mlmlab.config import from_dict
from mlmlab.errors import UserError
from mlmlab.experiments.budget import flops_curve


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


def flops_seen(row: dict, record: dict) -> float:
    return flops_at(row, record["step"])


def flops_at(row: dict, steps: int) -> float:
    """The row's run's estimated FLOPs over its first ``steps`` steps, from the config it recorded; from its FLOPs
    per step (the run's mean mask rate) where that config or its tokenizer cannot be loaded here."""
    try:
        config_json = json.dumps(row["config"], sort_keys=True)
        return float(_recorded_flops_curve(config_json, max(steps, row.get("steps", steps)))[steps])
    except (KeyError, UserError):
        return steps * row.get("flops_per_step", math.nan)


@lru_cache(maxsize=64)
def _recorded_flops_curve(config_json: str, last_step: int) -> np.ndarray:
    """budget.flops_curve of a recorded config, once per run config: a curve asks for every evaluation's step."""
    return flops_curve(from_dict(json.loads(config_json)), last_step)


def progress_of(row: dict, record: dict) -> float:
    return record["step"] / max(row.get("steps", 1), 1)


def mask_share_keys(curves) -> list[str]:
    """The runs' mask_share_freq_* record keys, most frequent bucket first."""
    return sorted(
        {
            k
            for runs in curves.values()
            for _, records in runs
            for r in records
            for k in r
            if k.startswith("mask_share_freq_")
        },
        key=lambda k: int(k.split("_")[3]),
    )


def steps_to_target(row: dict, records: list[dict], key: str, target: float) -> int | None:
    """The first evaluation step at which the run's held-out ``key`` fell below ``target`` (None: never)."""
    reached = [
        record["step"]
        for record in records
        if isinstance(record.get("eval"), dict) and (record["eval"].get(key) or math.inf) < target
    ]
    return min(reached, default=None)


def last_eval_within(row: dict, records: list[dict], key: str, flops: float) -> tuple[int, float] | None:
    """(step, held-out ``key``) of the run's last evaluation whose estimated FLOPs up to it are within ``flops``
    (None: not even the first)."""
    within = [
        (record["step"], record["eval"][key])
        for record in records
        if isinstance(record.get("eval"), dict)
        and record["eval"].get(key) is not None
        and flops_at(row, record["step"]) <= flops
    ]
    return max(within, default=None)
