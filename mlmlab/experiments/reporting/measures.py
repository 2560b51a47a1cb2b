"""The figures a report compares, each a path into a result row, and which of them a study's rows carry.

Losses are compared in nats (log perplexity), overall and per frequency bucket: a difference of
1e5 in a rare bucket's perplexity is unreadable, a difference in nats is a ratio of perplexities.
"""

import math
from dataclasses import dataclass

from mlmlab.experiments.gates import row_value


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


def metrics_of(rows: list[dict]) -> list[Metric]:
    """Perplexity and loss in nats, overall and per frequency bucket, accuracies, GLUE average and per task."""
    eval_keys = [key for row in rows for key in row["eval"]]
    buckets = list(dict.fromkeys(k for k in eval_keys if k.startswith("perplexity_freq_")))
    metrics = [Metric("perplexity", ("eval", "perplexity"), True)]
    metrics += [Metric(f"ppl freq {key.removeprefix('perplexity_freq_')}", ("eval", key), True) for key in buckets]
    # mlm_loss is log(perplexity); older rows without it get the same number from the perplexity
    metrics.append(
        Metric("MLM loss (nats)", ("eval", "mlm_loss"), True)
        if "mlm_loss" in eval_keys
        else Metric("MLM loss (nats)", ("eval", "perplexity"), True, log=True)
    )
    metrics += [
        Metric(f"loss freq {key.removeprefix('perplexity_freq_')} (nats)", ("eval", key), True, log=True)
        for key in buckets
    ]
    metrics += [Metric(name, ("eval", name), False) for name in ("mlm_accuracy", "nsp_accuracy") if name in eval_keys]
    held_out = list(
        dict.fromkeys(
            name for row in rows for name, report in (row.get("eval_data") or {}).items() if "mlm_loss" in report
        )
    )
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
        metrics += [
            Metric(f"recalibrated loss{where} (nats)", (*RECALIBRATED, f"mlm_loss{name}"), True),
            Metric(f"raw loss{where}, scored half (nats)", (*RECALIBRATED, f"raw_mlm_loss{name}"), True),
        ]
    return metrics


def probe_metrics(rows: list[dict]) -> list[Metric]:
    """Each frozen linear probe's dev score and its gain over a random-init encoder (x100), and the mean gain."""
    tasks = list(dict.fromkeys(t for row in rows for t in row_value_dict(row, ("probe", "tasks"))))
    metrics = []
    for task in tasks:
        metrics += [
            Metric(f"probe {task}", ("probe", "tasks", task, "score"), False, 100.0),
            Metric(f"probe {task} gain", ("probe", "tasks", task, "gain"), False, 100.0),
        ]
    return metrics + ([Metric("probe avg gain", ("probe", "average_gain"), False, 100.0)] if tasks else [])


def row_value_dict(row: dict, path: tuple) -> dict:
    """The mapping at ``path`` of a row ({} when missing or not a mapping)."""
    value = row
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, dict) else {}


def by_seed(rows: list[dict], metric: Metric) -> dict[int, float]:
    """Each seed's value; a missing one (NaN) and a non-finite one (a diverged run: report.py flags it) left out."""
    values = {row["seed"]: metric.value(row) for row in rows}
    return {seed: value for seed, value in values.items() if math.isfinite(value)}


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
