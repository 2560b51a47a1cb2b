"""Recompute scale-v5's pre-registered reading from its rows, without mlmlab.

    python studies/scale-v5/recompute.py            # this folder's rows
    python studies/scale-v5/recompute.py FOLDER     # another folder laid out as this one (for a check)

A second implementation of preregistration.md's rules (json, math and scipy only; nothing imported from mlmlab),
to check mlmlab's report cell by cell and to give the page its "tiny against mini" table. It prints markdown:

- which rows record preregistration.md's sha256 as committed (any other row is named and left out) and which
  arms' seeds are in;
- the validity gate (dynamic's mean final MLM accuracy ≥ 0.25) and the plateau check (every dynamic seed below
  5.8 nats at least 3,000 steps before the end of its run);
- the two primary contrasts, constant-30 − dynamic and adm-best − dynamic in final eval.mlm_loss, paired by
  seed: 95% t-interval, paired sd, the least effect the seeds detect with 80% power at 5% and at Holm's first
  step (2.5%), p, p Holm-adjusted over the two, and the call with and without Holm (better or worse where the
  p-value is below 0.05 and |mean Δ| ≥ 0.01 nats, else inconclusive);
- constant-40 − dynamic and constant-40 − constant-30, descriptive, if constant-40 has rows;
- tiny against mini: each primary contrast at mini beside the same contrast at tiny, constant-30 − dynamic from
  rate-schedule-v4's rows (six seeds) and seed-ablations-v5's pick − dynamic from its rows (seeds 0-5, the pick
  by that study's rule), and mini − tiny with a Welch interval.

"Grow" and "shrink" are read on the gap's size, |mean Δ|, as the preregistration's question ("does each gap grow
or shrink") words it, and only where the Welch interval of the signed mini − tiny excludes zero: the gap grows
where |mean Δ| is larger at mini than at tiny and shrinks where it is smaller. Both contrasts may be negative
(constant-30 − dynamic is at tiny), so the sign of mini − tiny alone does not say which: −0.3 against tiny's −0.2
is a gap that grows. Where mini's mean Δ has the other sign than tiny's, the call says so beside it. Elsewhere the
gap is "not told apart between the sizes".

A partial study reads as far as its rows go: a contrast with fewer than two paired seeds says it is not in yet,
one over fewer than the four planned seeds or with Holm over fewer than its two contrasts is marked provisional
(three seeds are the whole study where the cost rule cut them: the page states which). Not recomputed: the
prior-free loss, the buckets, WikiText-103, the steps to the targets and the probes.
"""

import argparse
import hashlib
import json
import math
from pathlib import Path

from scipy import optimize, stats

HERE = Path(__file__).resolve().parent
TINY_RATE = HERE.parent / "rate-schedule-v4"  # constant-30 − dynamic at tiny, the same setting
TINY_ADM = HERE.parent / "seed-ablations-v5"  # ADM at its best at tiny: its pick − dynamic
BASELINE = "dynamic"
ARMS = ("dynamic", "constant-30", "adm-best", "constant-40")
PRIMARY = (("constant-30", BASELINE), ("adm-best", BASELINE))
DESCRIPTIVE = (("constant-40", BASELINE), ("constant-40", "constant-30"))
PLANNED_SEEDS = 4  # seeds 0-3; three where the cost rule cut them
ALPHA, MIN_EFFECT, POWER = 0.05, 0.01, 0.8
GATE_ACCURACY, PLATEAU, ESCAPE_BEFORE_END = 0.25, 5.8, 3000
TINY_SEEDS, SCREEN_SEEDS = (0, 1, 2, 3, 4, 5), (0, 1)
# seed-ablations-v5's candidates, the batch-32 ADM arms in its preregistration's order (a tie goes to the first)
CANDIDATES = (
    "adm-entropy",
    "adm-max-prob",
    "adm-grad-norm",
    "adm-linear",
    "adm-cosine",
    "adm-exponential",
    "adm-a_max-0.25",
    "adm-a_max-0.5",
    "adm-constant",
    "adm-lr-1e-3",
    "adm-lr-3e-3",
)


def load_rows(folder: Path) -> tuple[list[dict], list[dict]]:
    """(rows recording the sha256 of the folder's preregistration.md as committed, every other row)."""
    path = folder / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    digest = hashlib.sha256((folder / "preregistration.md").read_bytes()).hexdigest()
    kept = [row for row in rows if row.get("preregistration_sha256") == digest]
    return kept, [row for row in rows if row.get("preregistration_sha256") != digest]


def provenance(name: str, kept: list[dict], stale: list[dict]) -> str:
    line = f"{name}: {len(kept)} of {len(kept) + len(stale)} rows record its preregistration.md's sha256 as committed"
    if stale:
        line += f"; left out, recorded under another preregistration.md: {', '.join(r['key'] for r in stale)}"
    return line


def runs_by_arm(rows: list[dict]) -> dict[str, dict[int, dict]]:
    """arm -> seed -> its row (the last row of a run wins, as a rerun appends)."""
    runs: dict[str, dict[int, dict]] = {}
    for row in rows:
        runs.setdefault(row["arm"], {})[row["seed"]] = row
    return runs


def final_losses(runs, arm: str, seeds=None) -> dict[int, float]:
    return {seed: row["eval"]["mlm_loss"] for seed, row in runs.get(arm, {}).items() if seeds is None or seed in seeds}


def paired(arm: dict[int, float], reference: dict[int, float]) -> dict[int, float]:
    return {seed: arm[seed] - reference[seed] for seed in sorted(arm.keys() & reference.keys())}


def eval_curve(folder: Path, row: dict) -> list[tuple[int, float]] | None:
    """(step, held-out loss) of the run's periodic evaluations; None where its metrics.jsonl is not in."""
    path = folder / row["run_dir"] / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["step"], r["eval"]["mlm_loss"]) for r in records if "eval" in r]


def first_below(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, loss in curve if loss < target), None)


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def variance(xs: list[float]) -> float:
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def t_test(deltas: list[float]) -> tuple[float, float, float, float]:
    """mean, sd, 95% half-width, two-sided p of a one-sample t-test of the paired differences."""
    n, m, sd = len(deltas), mean(deltas), math.sqrt(variance(deltas))
    se = sd / math.sqrt(n)
    half = stats.t.ppf(0.975, n - 1) * se
    p = 2 * stats.t.sf(abs(m) / se, n - 1) if se > 0 else (0.0 if m else 1.0)
    return m, sd, half, p


def welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """mean(a) − mean(b), its 95% half-width and the Welch–Satterthwaite degrees of freedom (unpaired samples)."""
    va, vb = variance(a) / len(a), variance(b) / len(b)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return mean(a) - mean(b), stats.t.ppf(0.975, df) * math.sqrt(va + vb), df


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (monotone, capped at 1); NaN: not tested, left out of the count."""
    tested = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    adjusted, running = [math.nan] * len(p_values), 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - rank) * p))
        adjusted[i] = running
    return adjusted


def detectable(sd: float, n: int, alpha: float) -> float:
    """Least true mean difference a two-sided paired t-test finds with 80% power (noncentral t); NaN: no spread."""
    if not sd > 0:
        return math.nan
    df, se = n - 1, sd / math.sqrt(n)
    critical = stats.t.ppf(1 - alpha / 2, df)

    def power(effect: float) -> float:
        shift = effect / se
        wrong_side = stats.nct.cdf(-critical, df, shift)  # scipy gives NaN where it is vanishingly small
        return stats.nct.sf(critical, df, shift) + (0.0 if math.isnan(wrong_side) else wrong_side)

    enough = (critical + 10) * se
    while power(enough) < POWER:  # two seeds' t has tails heavy enough to need more
        enough *= 2
    return optimize.brentq(lambda effect: power(effect) - POWER, 1e-12, enough)


def call(m: float, p: float, arm: str) -> str:
    if p < ALPHA and abs(m) >= MIN_EFFECT:
        return f"{arm} better" if m < 0 else f"{arm} worse"
    return "inconclusive"


def fmt(m: float, half: float) -> str:
    return f"{m:+.3f} [{m - half:+.3f}, {m + half:+.3f}]"


def seeds_text(seeds) -> str:
    return ", ".join(str(seed) for seed in sorted(seeds)) or "none"


def rows_in(runs) -> list[str]:
    lines = ["| arm | seeds in | mean final loss | mean MLM accuracy |", "|---|---|---|---|"]
    for arm in ARMS + tuple(sorted(set(runs) - set(ARMS))):
        by_seed = runs.get(arm, {})
        if not by_seed:
            lines.append(f"| {arm} | not in yet | – | – |")
            continue
        accuracy = mean(row["eval"]["mlm_accuracy"] for row in by_seed.values())
        name = arm if arm in ARMS else f"{arm} (not an arm of the preregistration)"
        lines.append(
            f"| {name} | {seeds_text(by_seed)} | {mean(final_losses(runs, arm).values()):.4f} | {accuracy:.4f} |"
        )
    return lines + [""]


def gate(runs) -> tuple[list[str], bool]:
    """The gate's lines and whether it failed (not before dynamic has a row)."""
    dynamic = runs.get(BASELINE, {})
    if not dynamic:
        return ["Gate: dynamic has no rows yet (its mean final MLM accuracy must reach 0.25).", ""], False
    accuracy = mean(row["eval"]["mlm_accuracy"] for row in dynamic.values())
    held = accuracy >= GATE_ACCURACY
    line = (
        f"Gate: dynamic's mean final MLM accuracy {accuracy:.4f} over seeds {seeds_text(dynamic)} "
        f"({'held' if held else 'FAILED'}; least {GATE_ACCURACY})."
    )
    return [line, ""], not held


def plateau_check(folder: Path, runs) -> list[str]:
    """Every dynamic seed below 5.8 nats at least 3,000 steps before the end of its run (row["steps"])."""
    dynamic = runs.get(BASELINE, {})
    if not dynamic:
        return []
    reached, late, missing = [], [], []
    for seed, row in sorted(dynamic.items()):
        curve = eval_curve(folder, row)
        if curve is None:
            missing.append(f"seed {seed}")
            continue
        step, by = first_below(curve, PLATEAU), row["steps"] - ESCAPE_BEFORE_END
        reached.append(f"seed {seed} {'never' if step is None else f'at step {step:,}'} (by {by:,})")
        if step is None or step > by:
            late.append(f"seed {seed}")
    lines = [f"Plateau check, first evaluation below {PLATEAU} nats: {'; '.join(reached) or '–'}."]
    if missing:
        lines.append(f"Not checked, its metrics.jsonl not in yet: dynamic {', '.join(missing)}.")
    if late:
        lines.append(
            f"Not below {PLATEAU} nats {ESCAPE_BEFORE_END:,} steps before the end: dynamic {', '.join(late)}. Every "
            "contrast may be measuring when runs left the plateau."
        )
    return lines + [""]


def primary(runs, gate_failed: bool) -> list[str]:
    found = {pair: paired(final_losses(runs, pair[0]), final_losses(runs, pair[1])) for pair in PRIMARY}
    tests = {pair: t_test(list(deltas.values())) if len(deltas) >= 2 else None for pair, deltas in found.items()}
    adjusted = dict(zip(found, holm([test[3] if test else math.nan for test in tests.values()])))
    tested = sum(test is not None for test in tests.values())
    strictest = ALPHA / len(PRIMARY)  # Holm's first step: what the smaller p-value must pass
    lines = [
        f"Δ = arm − dynamic in final eval.mlm_loss (nats), paired by seed. The rule's call (Holm over the "
        f"{len(PRIMARY)} contrasts): better or worse where the Holm-adjusted p is below {ALPHA} and |mean Δ| ≥ "
        f"{MIN_EFFECT}, else inconclusive. The unadjusted call is beside it, not the rule's.",
        "",
    ]
    if gate_failed:
        lines += ["The validity gate failed: these calls are not conclusions.", ""]
    lines += [
        f"| contrast | paired seeds | Δ [95% t-interval] | paired sd | detectable at 5% | detectable at "
        f"{100 * strictest:g}% (Holm's first step) | p | p (Holm) | call (unadjusted) | call (Holm: the rule) |",
        "|" + "---|" * 10,
    ]
    for (arm, reference), deltas in found.items():
        test, n = tests[(arm, reference)], len(deltas)
        if test is None:
            lines.append(f"| {arm} − {reference} | {n} | not in yet (fewer than 2 paired seeds) |" + " – |" * 7)
            continue
        m, sd, half, p = test
        note = f" (provisional: {n} of {PLANNED_SEEDS} seeds)" if n < PLANNED_SEEDS else ""
        holm_note = f" (provisional: Holm over {tested} of {len(PRIMARY)})" if tested < len(PRIMARY) else ""
        lines.append(
            f"| {arm} − {reference} | {n} ({seeds_text(deltas)}) | {fmt(m, half)} | {sd:.3g} | "
            f"{detectable(sd, n, ALPHA):.3g} | {detectable(sd, n, strictest):.3g} | {p:.3g} | "
            f"{adjusted[(arm, reference)]:.3g} | {call(m, p, arm)}{note} | "
            f"**{call(m, adjusted[(arm, reference)], arm)}{note}{holm_note}** |"
        )
    return lines + [""]


def descriptive(runs) -> list[str]:
    if "constant-40" not in runs:
        return ["constant-40 has no rows: not in yet, or dropped by the cost rule (the page states which).", ""]
    lines = ["| contrast | paired seeds | Δ [95% t-interval] | p (unadjusted) |", "|---|---|---|---|"]
    for arm, reference in DESCRIPTIVE:
        deltas = paired(final_losses(runs, arm), final_losses(runs, reference))
        if len(deltas) < 2:
            lines.append(f"| {arm} − {reference} | {len(deltas)} | not in yet (fewer than 2 paired seeds) | – |")
            continue
        m, _, half, p = t_test(list(deltas.values()))
        lines.append(f"| {arm} − {reference} | {len(deltas)} ({seeds_text(deltas)}) | {fmt(m, half)} | {p:.3g} |")
    return lines + [""]


def tiny_pick(runs) -> tuple[str | None, list[str]]:
    """seed-ablations-v5's rule: the candidate with the lowest mean final loss over seeds 0 and 1, a tie to the
    first listed, a non-finite mean never; (None, the screen runs not in yet) until every candidate has both."""
    missing = [f"{arm} seed {s}" for arm in CANDIDATES for s in SCREEN_SEEDS if s not in runs.get(arm, {})]
    if missing:
        return None, missing
    means = [(mean(final_losses(runs, arm, SCREEN_SEEDS).values()), index, arm) for index, arm in enumerate(CANDIDATES)]
    finite = [item for item in means if math.isfinite(item[0])]
    return (min(finite)[2] if finite else None), []


def size_call(tiny: float, mini: float, difference: float, half: float) -> str:
    """The gap's change in size, |mean Δ|, said only where the Welch interval of mini − tiny excludes zero."""
    if abs(difference) <= half:
        return "not told apart between the sizes"
    size = "grow" if abs(mini) > abs(tiny) else "shrink"
    return size + (" (mini's mean Δ has the other sign)" if (mini > 0) != (tiny > 0) else "")


def tiny_against_mini(runs) -> list[str]:
    rate_kept, rate_stale = load_rows(TINY_RATE)
    adm_kept, adm_stale = load_rows(TINY_ADM)
    rate_runs, adm_runs = runs_by_arm(rate_kept), runs_by_arm(adm_kept)
    pick, screen_missing = tiny_pick(adm_runs)
    tiny_rate = paired(
        final_losses(rate_runs, "constant-30", TINY_SEEDS), final_losses(rate_runs, BASELINE, TINY_SEEDS)
    )
    tiny_adm = (
        paired(final_losses(adm_runs, pick, TINY_SEEDS), final_losses(adm_runs, BASELINE, TINY_SEEDS)) if pick else {}
    )
    tiny = {
        PRIMARY[0]: ("rate-schedule-v4", tiny_rate),
        PRIMARY[1]: (f"seed-ablations-v5's pick, {pick}" if pick else "seed-ablations-v5's pick", tiny_adm),
    }
    lines = [
        provenance("rate-schedule-v4", rate_kept, rate_stale),
        "",
        provenance("seed-ablations-v5", adm_kept, adm_stale),
    ]
    if pick is None:
        lines += ["", f"seed-ablations-v5's screen has not picked yet; not in yet: {', '.join(screen_missing)}."]
    lines += [
        "",
        "| contrast | tiny: Δ [95% t-interval] (seeds) | mini: Δ [95% t-interval] (seeds) | mini − tiny [95% Welch] "
        "(df) | the gap |",
        "|---|---|---|---|---|",
    ]
    for (arm, reference), (source, tiny_deltas) in tiny.items():
        mini_deltas = paired(final_losses(runs, arm), final_losses(runs, reference))
        lines.append(f"| {arm} − {reference} | " + " | ".join(size_cells(source, tiny_deltas, mini_deltas)) + " |")
    return lines + [
        "",
        "The gap is its size, |mean Δ|: it grows where the Welch interval of mini − tiny excludes zero and |mean Δ| "
        "is larger at mini, shrinks where that interval excludes zero and |mean Δ| is smaller; otherwise it is not "
        "told apart between the sizes. Tiny's figures come from other hosts and another study's rows: a difference "
        "of sizes is read beside that caveat.",
        "",
    ]


def size_cells(source: str, tiny: dict[int, float], mini: dict[int, float]) -> list[str]:
    """The table's cells after the contrast: tiny, mini, mini − tiny, the gap's call."""
    cells = []
    for deltas, planned, label in ((tiny, len(TINY_SEEDS), source), (mini, PLANNED_SEEDS, "scale-v5")):
        if len(deltas) < 2:
            cells.append(f"not in yet ({len(deltas)} paired seeds; {label})")
            continue
        m, _, half, _ = t_test(list(deltas.values()))
        note = f"; provisional, {len(deltas)} of {planned} seeds" if len(deltas) < planned else ""
        cells.append(f"{fmt(m, half)} ({seeds_text(deltas)}; {label}{note})")
    if min(len(tiny), len(mini)) < 2:
        return cells + ["–", "not in yet"]
    difference, half, df = welch(list(mini.values()), list(tiny.values()))
    gap = size_call(mean(tiny.values()), mean(mini.values()), difference, half)
    return cells + [f"{fmt(difference, half)} ({df:.1f})", gap]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", nargs="?", type=Path, default=HERE, help="the study's folder (default: this one)")
    folder = parser.parse_args().study.resolve()
    if not (folder / "preregistration.md").is_file():
        raise SystemExit(f"{folder} is no study folder: it has no preregistration.md")
    kept, stale = load_rows(folder)
    runs = runs_by_arm(kept)
    gate_lines, gate_failed = gate(runs)
    out = ["# scale-v5, recomputed without mlmlab", "", provenance(folder.name, kept, stale), ""]
    out += ["## Rows in", ""] + rows_in(runs)
    out += ["## Validity", ""] + gate_lines + plateau_check(folder, runs)
    out += ["## Primary contrasts", ""] + primary(runs, gate_failed)
    out += ["## constant-40 (descriptive)", ""] + descriptive(runs)
    out += ["## Tiny against mini (descriptive)", ""] + tiny_against_mini(runs)
    print("\n".join(out))


if __name__ == "__main__":
    main()
