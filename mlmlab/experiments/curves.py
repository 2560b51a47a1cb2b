"""Runs' logged records (metrics.jsonl) as curves: a value per step, against sequences seen or training progress."""

import math
from collections import defaultdict

import numpy as np


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


def mask_share_keys(curves) -> list[str]:
    """The runs' mask_share_freq_* record keys, most frequent bucket first."""
    return sorted({k for runs in curves.values() for _, records in runs for r in records for k in r
                   if k.startswith("mask_share_freq_")}, key=lambda k: int(k.split("_")[3]))


def steps_to_target(row: dict, records: list[dict], key: str, target: float) -> int | None:
    """The first evaluation step at which the run's held-out ``key`` fell below ``target`` (None: never)."""
    reached = [record["step"] for record in records
               if isinstance(record.get("eval"), dict) and (record["eval"].get(key) or math.inf) < target]
    return min(reached, default=None)
