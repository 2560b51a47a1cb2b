"""Read fast-tiny-sweep's pick from its rows by the pre-registered rule, without mlmlab.

    python studies/fast-tiny-sweep/pick.py

preregistration.md's decision rule: each cell's score is its mean final held-out MLM loss over seeds 0-2; the
lowest wins, except that every cell within 0.01 nats of it ties with it and among the tied the lower LR, then
the lower rate, is the pick; a cell with a non-finite loss in any seed is never picked. Prints each cell's
seeds, mean, accuracy and steps as markdown, then the pick. On a partial sweep it says what is missing and
picks nothing. ``pick(rows)`` is what the docs' check of the preset reads.
"""

import hashlib
import json
import math
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEEDS = (0, 1, 2)
LRS, RATES = (0.001, 0.002, 0.003), (0.15, 0.3, 0.4)
TIE_NATS = 0.01  # the least effect mlmlab's studies count


def cell_name(lr: float, rate: float) -> str:
    return f"lr={lr}-rate={rate}"


CELLS = {cell_name(lr, rate): (lr, rate) for lr in LRS for rate in RATES}


def load_rows() -> list[dict]:
    rows = [json.loads(line) for line in (HERE / "results.jsonl").read_text().splitlines() if line.strip()]
    digest = hashlib.sha256((HERE / "preregistration.md").read_bytes()).hexdigest()
    stale = [row["key"] for row in rows if row.get("preregistration_sha256") != digest]
    if stale:
        raise SystemExit(f"rows recorded under another preregistration.md: {stale}")
    return rows


def losses_by_cell(rows: list[dict]) -> dict[str, dict[int, float]]:
    """cell -> seed -> final held-out MLM loss (a rerun's row, appended later, wins)."""
    cells: dict[str, dict[int, float]] = {}
    for row in rows:
        cells.setdefault(row["arm"], {})[row["seed"]] = row["eval"]["mlm_loss"]
    return cells


def missing_runs(cells: dict[str, dict[int, float]]) -> list[str]:
    return [f"{cell} seed {seed}" for cell in CELLS for seed in SEEDS if seed not in cells.get(cell, {})]


def pick(rows: list[dict]) -> tuple[float, float]:
    """The (LR, rate) the rule picks from a complete sweep's rows."""
    cells = losses_by_cell(rows)
    if missing := missing_runs(cells):
        raise ValueError(f"the sweep is not complete: {', '.join(missing)} missing")
    scores = {
        cell: sum(losses[seed] for seed in SEEDS) / len(SEEDS)
        for cell, losses in cells.items()
        if all(math.isfinite(losses[seed]) for seed in SEEDS)
    }
    lowest = min(scores.values())
    tied = [cell for cell, score in scores.items() if score <= lowest + TIE_NATS]
    return min(CELLS[cell] for cell in tied)  # the lower LR, then the lower rate


def main() -> None:
    rows = load_rows()
    cells = losses_by_cell(rows)
    print("| cell | seed 0 | seed 1 | seed 2 | mean | mean accuracy |")
    print("|---|---|---|---|---|---|")
    for cell in CELLS:
        losses = cells.get(cell, {})
        shown = [f"{losses[seed]:.3f}" if seed in losses else "–" for seed in SEEDS]
        mean = f"{sum(losses.values()) / len(losses):.3f}" if losses else "–"
        accuracies = [row["eval"]["mlm_accuracy"] for row in rows if row["arm"] == cell]
        accuracy = f"{sum(accuracies) / len(accuracies):.3f}" if accuracies else "–"
        print(f"| {cell} | {' | '.join(shown)} | {mean} | {accuracy} |")
    if missing := missing_runs(cells):
        print(f"\nNo pick yet: {len(missing)} runs missing ({', '.join(missing)}).")
        return
    lr, rate = pick(rows)
    print(f"\nThe pick: {cell_name(lr, rate)} (LR {lr}, rate {rate}); {len(rows)} rows.")


if __name__ == "__main__":
    main()
