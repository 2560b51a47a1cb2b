"""Recompute rate-schedule-v4's pre-registered reading from its rows, without mlmlab.

    python studies/rate-schedule-v4/recompute.py

Written apart from mlmlab's report (json, math and scipy only, nothing imported from mlmlab) so
that the report's decision table can be checked against a second implementation of the rule in
preregistration.md: the four primary contrasts (paired by seed, 95% t-interval, Holm over the
four, |mean Δ| ≥ 0.01), the validity gate, the detectable effects, the descriptive steps to
5.8 and 4.5 nats (per seed), and every arm's paired difference from dynamic in the overall,
per-bucket, prior-free and WikiText-103 losses and the MLM accuracy. Prints markdown; compare it
cell by cell with report.md. Not recomputed here: the loss at dynamic's FLOPs (it needs the FLOP
model of each step's mask rate), the probes and the bootstrap ranges.
"""

import hashlib
import json
import math
from pathlib import Path

from scipy import optimize, stats

HERE = Path(__file__).resolve().parent
CONTRASTS = [
    ("ankner-decay", "constant-22.5"),
    ("ankner-decay-cm", "dynamic"),
    ("constant-30", "dynamic"),
    ("adm-entropy", "dynamic"),
]
ALPHA, MIN_EFFECT, POWER = 0.05, 0.01, 0.8
GATE_ACCURACY, PLATEAU, LOWER_TARGET, ESCAPE_BY = 0.25, 5.8, 4.5, 2000


def load_rows() -> list[dict]:
    rows = [json.loads(line) for line in (HERE / "results.jsonl").read_text().splitlines() if line.strip()]
    digest = hashlib.sha256((HERE / "preregistration.md").read_bytes()).hexdigest()
    stale = [row["key"] for row in rows if row.get("preregistration_sha256") != digest]
    if stale:
        raise SystemExit(f"rows recorded under another preregistration.md: {stale}")
    return rows


def runs_by_arm(rows: list[dict]) -> dict[str, dict[int, dict]]:
    """arm -> seed -> its row (the last row of a run wins, as a rerun appends)."""
    runs: dict[str, dict[int, dict]] = {}
    for row in rows:
        runs.setdefault(row["arm"], {})[row["seed"]] = row
    return runs


def final_loss(rows: list[dict]) -> dict[str, dict[int, float]]:
    """arm -> seed -> final held-out MLM loss."""
    return {
        arm: {seed: row["eval"]["mlm_loss"] for seed, row in seeds.items()} for arm, seeds in runs_by_arm(rows).items()
    }


def eval_curve(row: dict) -> list[tuple[int, float]]:
    lines = (HERE / row["run_dir"] / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [(r["step"], r["eval"]["mlm_loss"]) for r in records if "eval" in r]


def first_below(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, loss in curve if loss < target), None)


def paired(arm: dict[int, float], reference: dict[int, float]) -> list[float]:
    return [arm[seed] - reference[seed] for seed in sorted(arm.keys() & reference.keys())]


def t_test(deltas: list[float]) -> tuple[float, float, float, float]:
    """mean, sd, 95% half-width, two-sided p of a one-sample t-test of the paired differences."""
    n = len(deltas)
    mean = sum(deltas) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in deltas) / (n - 1))
    se = sd / math.sqrt(n)
    half = stats.t.ppf(0.975, n - 1) * se
    p = 2 * stats.t.sf(abs(mean) / se, n - 1) if se > 0 else (0.0 if mean else 1.0)
    return mean, sd, half, p


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (monotone, capped at 1)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def detectable(sd: float, n: int, alpha: float) -> float:
    """Least true mean difference a two-sided paired t-test finds with 80% power (noncentral t)."""
    df, se = n - 1, sd / math.sqrt(n)
    critical = stats.t.ppf(1 - alpha / 2, df)

    def power(effect: float) -> float:
        shift = effect / se
        wrong_side = stats.nct.cdf(-critical, df, shift)  # scipy gives NaN where it is vanishingly small
        return stats.nct.sf(critical, df, shift) + (0.0 if math.isnan(wrong_side) else wrong_side)

    return optimize.brentq(lambda effect: power(effect) - POWER, 1e-12, (critical + 10) * se)


def call(mean: float, p: float, arm: str) -> str:
    if p < ALPHA and abs(mean) >= MIN_EFFECT:
        return f"{arm} better" if mean < 0 else f"{arm} worse"
    return "inconclusive"


def gate(rows: list[dict]) -> list[str]:
    dynamic = [row for row in rows if row["arm"] == "dynamic"]
    accuracy = sum(row["eval"]["mlm_accuracy"] for row in dynamic) / len(dynamic)
    late = [row["seed"] for row in dynamic if (first_below(eval_curve(row), PLATEAU) or math.inf) > ESCAPE_BY]
    return [
        f"Gate: dynamic mean MLM accuracy {accuracy:.4f} over {len(dynamic)} seeds "
        f"({'held' if accuracy >= GATE_ACCURACY else 'FAILED'}, threshold {GATE_ACCURACY}); "
        f"dynamic seeds not below {PLATEAU} nats by step {ESCAPE_BY}: {late or 'none'}",
        "",
    ]


def contrast_table(losses: dict[str, dict[int, float]]) -> list[str]:
    found = [(arm, ref, paired(losses.get(arm, {}), losses.get(ref, {}))) for arm, ref in CONTRASTS]
    tested = [(arm, ref, t_test(deltas), len(deltas)) for arm, ref, deltas in found if len(deltas) >= 2]
    adjusted = holm([result[3] for _, _, result, _ in tested]) if tested else []
    lines = [
        "| contrast | paired seeds | Δ [95% t-interval] | paired sd | detectable 5% | detectable 1.25% | p | "
        "p (Holm) | call (unadjusted) | call (Holm) |",
        "|" + "---|" * 10,
    ]
    for (arm, ref, (mean, sd, half, p), n), p_holm in zip(tested, adjusted):
        lines.append(
            f"| {arm} − {ref} | {n} | {mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}] | {sd:.3g} | "
            f"{detectable(sd, n, ALPHA):.3g} | {detectable(sd, n, ALPHA / len(CONTRASTS)):.3g} | "
            f"{p:.3g} | {p_holm:.3g} | {call(mean, p, arm)} | **{call(mean, p_holm, arm)}** |"
        )
    missing = [f"{arm} − {ref}" for arm, ref, deltas in found if len(deltas) < 2]
    if missing:
        lines += [
            "",
            f"Not yet testable (fewer than 2 paired seeds): {', '.join(missing)}; "
            f"Holm above adjusts over the {len(tested)} testable contrasts only.",
        ]
    return lines + [""]


def arm_table(rows: list[dict]) -> list[str]:
    lines = [
        "| arm | seeds | mean MLM loss | min–max | steps to 5.8 by seed | steps to 4.5 by seed |",
        "|" + "---|" * 6,
    ]
    for arm, seeds in runs_by_arm(rows).items():
        runs = [seeds[seed] for seed in sorted(seeds)]
        losses = [row["eval"]["mlm_loss"] for row in runs]
        curves = [eval_curve(row) for row in runs]
        to_plateau = [first_below(curve, PLATEAU) for curve in curves]
        to_lower = [first_below(curve, LOWER_TARGET) for curve in curves]
        lines.append(
            f"| {arm} | {len(runs)} | {sum(losses) / len(losses):.4f} | {min(losses):.3f}–{max(losses):.3f} | "
            f"{steps_by_seed(to_plateau)} | {steps_by_seed(to_lower)} |"
        )
    return lines + [""]


BUCKETS = ("0_100", "100_300", "300_1000", "1000_3000", "3000_rest")
# (column, figure of a row): the report's "difference from dynamic" columns, each read straight from the row
FIGURES = [("MLM loss", lambda row: row["eval"]["mlm_loss"])]
FIGURES += [
    (f"loss {bucket}", lambda row, b=bucket: math.log(row["eval"][f"perplexity_freq_{b}"])) for bucket in BUCKETS
]
FIGURES += [
    ("prior-free loss", lambda row: row["eval"]["recalibrated"]["mlm_loss"]),
    ("prior-free loss 3000_rest", lambda row: row["eval"]["recalibrated"]["mlm_loss_freq_3000_rest"]),
    ("WikiText-103 loss", lambda row: row["eval_data"]["wikitext103-valid"]["mlm_loss"]),
    ("MLM accuracy", lambda row: row["eval"]["mlm_accuracy"]),
]


def differences_table(rows: list[dict]) -> list[str]:
    """Every arm − dynamic, paired by seed: mean [95% t-interval], * where it excludes 0 (descriptive)."""
    runs = runs_by_arm(rows)
    lines = ["| arm | " + " | ".join(name for name, _ in FIGURES) + " |", "|" + "---|" * (len(FIGURES) + 1)]
    for arm, seeds in runs.items():
        if arm == "dynamic":
            continue
        cells = []
        for _, figure in FIGURES:
            deltas = paired(
                {s: figure(r) for s, r in seeds.items()}, {s: figure(r) for s, r in runs["dynamic"].items()}
            )
            mean, _, half, _ = t_test(deltas)
            star = " *" if abs(mean) > half else ""
            cells.append(f"{mean:+.3g} [{mean - half:+.3g}, {mean + half:+.3g}]{star}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines + [""]


def steps_by_seed(steps: list[int | None]) -> str:
    return " / ".join("never" if step is None else str(step) for step in steps) + f" (mean {mean_steps(steps)})"


def mean_steps(steps: list[int | None]) -> str:
    reached = [s for s in steps if s is not None]
    text = f"{sum(reached) / len(reached):,.0f}" if reached else "never"
    return text + (f" ({len(steps) - len(reached)} never)" if len(reached) < len(steps) else "")


def main() -> None:
    rows = load_rows()
    print(
        "\n".join(
            ["# rate-schedule-v4, recomputed without mlmlab", ""]
            + gate(rows)
            + contrast_table(final_loss(rows))
            + arm_table(rows)
            + ["Every arm − dynamic, paired by seed (descriptive):", ""]
            + differences_table(rows)
        )
    )


if __name__ == "__main__":
    main()
