"""Validity gates: a comparison of masking strategies means something only once the baseline learns.

A study names one arm (the baseline) and least values of row figures (dotted paths into a
result row, e.g. ``eval.mlm_accuracy`` or ``glue.tasks.STS-B.dev.pearson``). The means over
that arm's seeds are checked before any other arm runs, and the report states the outcome.
"""

import math

import numpy as np


def row_value(row: dict, path: str | tuple) -> float:
    """The number at a path of a row, dotted or as keys (NaN when it is missing or null: a bucket with no targets)."""
    value = row
    for key in path.split(".") if isinstance(path, str) else path:
        if not isinstance(value, dict) or key not in value:
            return math.nan
        value = value[key]
    return math.nan if value is None else float(value)


def gate_results(minimum: dict, rows: list[dict]) -> list[dict]:
    """One {"path", "mean", "least", "held"} per gate, the mean over ``rows`` (the gate arm's seeds)."""
    results = []
    for path, least in minimum.items():
        values = [row_value(row, path) for row in rows]
        # A missing (NaN) or infinite value (a diverged run) leaves the gate unmeasured: an infinite mean would hold.
        mean = float(np.mean(values)) if values and all(map(math.isfinite, values)) else math.nan
        results.append({"path": path, "mean": mean, "least": least, "held": mean >= least})
    return results


def describe(results: list[dict]) -> str:
    return "; ".join(
        f"{r['path']} not measured"
        if math.isnan(r["mean"])
        else f"{r['path']} {r['mean']:.4g} {'>=' if r['held'] else '<'} {r['least']:g}"
        for r in results
    )


def gate_outcomes(rows: list[dict], groups) -> tuple[dict | None, list[dict]]:
    """The study's validity gates as its rows recorded them (None: no gates), and each gate's outcome."""
    gates = next((row["gates"] for row in rows if row.get("gates")), None)
    return gates, gate_results(gates["min"], groups.get(gates["arm"], [])) if gates else []
