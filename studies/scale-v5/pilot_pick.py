"""Read scale-v5's pilot by its pre-registered rule, without mlmlab.

    python studies/scale-v5/pilot_pick.py

preregistration.md's pilot rule: among the LRs whose run is below 5.8 nats by step 2,000 (3,000 steps before
the end of 5,000), the study takes the one that ends lowest at step 5,000; an LR within 0.02 nats of a lower LR
does not displace it. A pick at the edge of the grid (5e-4 or 2e-3) asks for the next LR beyond it (2.5e-4 or
3e-3) and the rule is applied again over all four. If no LR is below 5.8 by step 2,000, the budget doubles and
the pilot reruns. Prints each LR's final loss, its loss at step 2,000 and first step below 5.8, then what the rule
says: the LR, the run it still needs, or the doubled budget. (At a doubled budget the step to pass 5.8 by is
5,000; this script reads the 5,000-step pilot.)
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
PILOT = HERE / "pilot"
PLATEAU, BY_STEP = 5.8, 2000
DISPLACE_NATS = 0.02  # a higher LR must end lower by more than this to displace a lower one
BEYOND_EDGE = {5.0e-4: 2.5e-4, 2.0e-3: 3.0e-3}  # the next LR past each edge of the grid


def pilot_runs() -> dict[float, dict]:
    """LR -> {"final": final held-out loss, "curve": [(step, held-out loss)]} of each finished pilot run."""
    path = PILOT / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    runs = {}
    for row in rows:
        records = (PILOT / row["run_dir"] / "metrics.jsonl").read_text().splitlines()
        curve = [(r["step"], r["eval"]["mlm_loss"]) for r in map(json.loads, records) if "eval" in r]
        runs[row["config"]["train"]["lr"]] = {"final": row["eval"]["mlm_loss"], "curve": curve}
    return runs


def first_below(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, loss in curve if loss < target), None)


def left_plateau_in_time(run: dict) -> bool:
    step = first_below(run["curve"], PLATEAU)
    return step is not None and step <= BY_STEP


def pick(runs: dict[float, dict]) -> float | None:
    """The rule's LR among those that left the plateau in time, or None if none did."""
    eligible = sorted(lr for lr, run in runs.items() if left_plateau_in_time(run))
    chosen = None
    for lr in eligible:  # from the lowest LR up: a higher one displaces only by more than DISPLACE_NATS
        if chosen is None or runs[lr]["final"] < runs[chosen]["final"] - DISPLACE_NATS:
            chosen = lr
    return chosen


def main() -> None:
    runs = pilot_runs()
    print("| LR | final held-out MLM loss | at step 2,000 | first eval below 5.8 |")
    print("|---|---|---|---|")
    for lr, run in sorted(runs.items()):
        at_2000 = dict(run["curve"]).get(BY_STEP)
        shown = f"{at_2000:.3f}" if at_2000 is not None else "–"
        print(f"| {lr:g} | {run['final']:.3f} | {shown} | step {first_below(run['curve'], PLATEAU) or 'never'} |")
    missing = [lr for lr in (5.0e-4, 1.0e-3, 2.0e-3) if lr not in runs]
    if missing:
        print(f"\nNo pick yet: the pilot's LRs {', '.join(f'{lr:g}' for lr in missing)} have not run.")
        return
    chosen = pick(runs)
    if chosen is None:
        print("\nNo LR is below 5.8 nats by step 2,000: the budget becomes 10,000 steps and the pilot reruns.")
    elif chosen in BEYOND_EDGE and BEYOND_EDGE[chosen] not in runs:
        print(f"\nThe pick {chosen:g} is at the grid's edge: run LR {BEYOND_EDGE[chosen]:g} too, then read again.")
    else:
        print(f"\nThe study's LR: {chosen:g}.")


if __name__ == "__main__":
    main()
