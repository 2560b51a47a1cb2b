"""Recompute seed-ablations-v5's pre-registered reading from its rows, without mlmlab.

    python studies/seed-ablations-v5/recompute.py

A second implementation of preregistration.md's rules (json, math and scipy only; nothing imported from
mlmlab), to check report.md cell by cell and to give the claims table its verdicts: the validity gate, the
screen's pick, the primary contrast (pick − dynamic over seeds 0-5, 95% paired t-interval, p, the call), the
pick on the fresh seeds 2-5 alone, the screen's differences from adm-entropy and from dynamic with the pooled
intervals, and each claim's verdict by the rule written before the runs. Works on a partial study: what is
not in yet is said so. Prints markdown.
"""

import hashlib
import json
import math
from pathlib import Path

from scipy import optimize, stats

HERE = Path(__file__).resolve().parent
SCREEN_SEEDS, ALL_SEEDS = (0, 1), (0, 1, 2, 3, 4, 5)
DEFAULT, BASELINE = "adm-entropy", "dynamic"
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
BATCH16 = ("dynamic-batch16", "adm-batch16")
ALPHA, MIN_EFFECT, POWER = 0.05, 0.01, 0.8
GATE_ACCURACY, PLATEAU, LOWER_TARGET = 0.25, 5.8, 4.5
ESCAPE_BY = {"dynamic": 2000, "dynamic-batch16": 4000}  # the same tokens: 3,000 batch-32 steps before the end
DIVERGE_RISE, DIVERGE_WITHIN = 0.05, 2500  # claim 6: a held-out rise of more than this, within these steps
FREQUENT = "0_100"  # claim 4's "basic learning": the 100 most frequent ids


def load_rows() -> list[dict]:
    path = HERE / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
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


def values(runs, arm: str, figure, seeds=ALL_SEEDS) -> dict[int, float]:
    return {seed: figure(row) for seed, row in runs.get(arm, {}).items() if seed in seeds}


def final_loss(row: dict) -> float:
    return row["eval"]["mlm_loss"]


def probe_gain(row: dict) -> float:
    return row["probe"]["average_gain"]


def frequent_loss(row: dict) -> float:
    return math.log(row["eval"][f"perplexity_freq_{FREQUENT}"])


def eval_curve(row: dict) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (HERE / row["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval"]["mlm_loss"]) for r in records if "eval" in r]


def first_below(curve, target: float) -> int | None:
    return next((step for step, loss in curve if loss < target), None)


def largest_rise(curve, within: int | None = None) -> float:
    """The largest increase of held-out loss between two consecutive evaluations (inf: a non-finite loss)."""
    points = [(step, loss) for step, loss in curve if within is None or step <= within]
    if any(not math.isfinite(loss) for _, loss in points):
        return math.inf
    return max([0.0] + [b - a for (_, a), (_, b) in zip(points, points[1:])])  # 0: it never rose


def paired(arm: dict[int, float], reference: dict[int, float]) -> dict[int, float]:
    return {seed: arm[seed] - reference[seed] for seed in sorted(arm.keys() & reference.keys())}


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def t_test(deltas: list[float]) -> tuple[float, float, float, float]:
    """mean, sd, 95% half-width, two-sided p of a one-sample t-test of the paired differences."""
    n = len(deltas)
    m = mean(deltas)
    sd = math.sqrt(sum((d - m) ** 2 for d in deltas) / (n - 1))
    se = sd / math.sqrt(n)
    half = stats.t.ppf(0.975, n - 1) * se
    p = 2 * stats.t.sf(abs(m) / se, n - 1) if se > 0 else (0.0 if m else 1.0)
    return m, sd, half, p


def detectable(sd: float, n: int, alpha: float) -> float:
    df, se = n - 1, sd / math.sqrt(n)
    critical = stats.t.ppf(1 - alpha / 2, df)

    def power(effect: float) -> float:
        shift = effect / se
        wrong_side = stats.nct.cdf(-critical, df, shift)
        return stats.nct.sf(critical, df, shift) + (0.0 if math.isnan(wrong_side) else wrong_side)

    return optimize.brentq(lambda effect: power(effect) - POWER, 1e-12, (critical + 10) * se)


def pick(runs) -> str | None:
    """The pre-registered rule: lowest mean final loss over seeds 0 and 1 among the candidates; a tie to the first
    listed; a non-finite mean never; None until every candidate's two screen runs are in."""
    means = []
    for index, arm in enumerate(CANDIDATES):
        losses = values(runs, arm, final_loss, SCREEN_SEEDS)
        if set(losses) != set(SCREEN_SEEDS):
            return None
        means.append((mean(losses.values()), index, arm))
    finite = [item for item in means if math.isfinite(item[0])]
    return min(finite)[2] if finite else None


def pooled_sd(runs, reference: str, arms, figure) -> tuple[float, int]:
    """The sd of one paired difference from ``reference`` over the screen's seeds, pooled over ``arms``."""
    squares, df = 0.0, 0
    for arm in arms:
        deltas = list(
            paired(values(runs, arm, figure, SCREEN_SEEDS), values(runs, reference, figure, SCREEN_SEEDS)).values()
        )
        if len(deltas) >= 2:
            m = mean(deltas)
            squares += sum((d - m) ** 2 for d in deltas)
            df += len(deltas) - 1
    return (math.sqrt(squares / df), df) if df else (math.nan, 0)


def screen_interval(deltas: dict[int, float], sd: float, df: int, scale: float = 1.0) -> tuple[float, float]:
    """(mean, half-width): mean ± t(0.975, df) · sd · scale / √n, the preregistration's screen interval."""
    if not deltas or not df:
        return mean(deltas.values()), math.nan
    return mean(deltas.values()), stats.t.ppf(0.975, df) * sd * scale / math.sqrt(len(deltas))


def told_apart(m: float, half: float) -> int:
    """+1 or -1 where the interval excludes 0 and |mean| >= the least effect; 0 otherwise (NaN: not measured)."""
    if math.isnan(half) or abs(m) < MIN_EFFECT or abs(m) <= half:
        return 0
    return 1 if m > 0 else -1


def fmt(m: float, half: float) -> str:
    if math.isnan(m):
        return "–"
    return f"{m:+.3f}" if math.isnan(half) else f"{m:+.3f} [{m - half:+.3f}, {m + half:+.3f}]"


def gate(runs) -> list[str]:
    dynamic = runs.get(BASELINE, {})
    accuracy = mean(row["eval"]["mlm_accuracy"] for row in dynamic.values())
    late = [
        f"{arm} seed {seed}"
        for arm, by in ESCAPE_BY.items()
        for seed, row in sorted(runs.get(arm, {}).items())
        if (first_below(eval_curve(row), PLATEAU) or math.inf) > by
    ]
    held = "held" if accuracy >= GATE_ACCURACY else "FAILED"
    return [
        f"Gate: dynamic mean MLM accuracy {accuracy:.4f} over {len(dynamic)} of 6 seeds ({held}, threshold "
        f"{GATE_ACCURACY}); baseline runs not below {PLATEAU} nats 3,000 batch-32 steps' tokens before the end: "
        f"{', '.join(late) or 'none'}",
        "",
    ]


def primary(runs, chosen: str | None) -> list[str]:
    if chosen is None:
        return ["Primary contrast: the screen has not picked yet (not every candidate's seeds 0 and 1 are in).", ""]
    lines = [f"Pick (lowest mean final loss over seeds 0 and 1 among the candidates): **{chosen}**", ""]
    for label, seeds in (("six seeds (the rule)", ALL_SEEDS), ("fresh seeds 2-5 alone", (2, 3, 4, 5))):
        deltas = list(
            paired(values(runs, chosen, final_loss, seeds), values(runs, BASELINE, final_loss, seeds)).values()
        )
        if len(deltas) < 2:
            lines.append(f"- {chosen} − dynamic, {label}: {len(deltas)} paired seeds in, no interval yet")
            continue
        m, sd, half, p = t_test(deltas)
        called = ("better" if m < 0 else "worse") if p < ALPHA and abs(m) >= MIN_EFFECT else "inconclusive"
        lines.append(
            f"- {chosen} − dynamic, {label}: {fmt(m, half)} over {len(deltas)} paired seeds, paired sd {sd:.3g}, "
            f"detectable at 5% {detectable(sd, len(deltas), ALPHA):.3g}, p {p:.3g}: **{called}**"
        )
    return lines + [""]


def screen_table(runs) -> list[str]:
    others = [arm for arm in CANDIDATES if arm != DEFAULT]
    sd_default, df_default = pooled_sd(runs, DEFAULT, others, final_loss)
    sd_base, df_base = pooled_sd(runs, BASELINE, CANDIDATES, final_loss)
    lines = [
        f"Pooled sd of one paired difference: {sd_default:.4g} ({df_default} df) against {DEFAULT}, "
        f"{sd_base:.4g} ({df_base} df) against {BASELINE}.",
        "",
        "| arm | mean loss (seeds 0, 1) | D vs adm-entropy [pooled 95%] | per seed | Δ vs dynamic [pooled 95%] | "
        "per seed | largest held-out rise (by seed) |",
        "|" + "---|" * 7,
    ]
    for arm in CANDIDATES + BATCH16:
        if arm not in runs:
            continue
        loss = values(runs, arm, final_loss, SCREEN_SEEDS)
        rises = " / ".join(
            f"{largest_rise(eval_curve(runs[arm][s])):.3f}" for s in sorted(runs[arm]) if s in SCREEN_SEEDS
        )
        cells = [arm, f"{mean(loss.values()):.4f}"]
        for reference, sd, df in ((DEFAULT, sd_default, df_default), (BASELINE, sd_base, df_base)):
            deltas = paired(loss, values(runs, reference, final_loss, SCREEN_SEEDS))
            cells += [fmt(*screen_interval(deltas, sd, df)), ", ".join(f"{d:+.3f}" for d in deltas.values()) or "–"]
        lines.append("| " + " | ".join(cells + [rises]) + " |")
    return lines + [""]


def d_against_default(runs, arm: str, figure=final_loss) -> tuple[float, float]:
    others = [a for a in CANDIDATES if a != DEFAULT]
    sd, df = pooled_sd(runs, DEFAULT, others, figure)
    deltas = paired(values(runs, arm, figure, SCREEN_SEEDS), values(runs, DEFAULT, figure, SCREEN_SEEDS))
    return screen_interval(deltas, sd, df)


def verdict(supported: bool, contradicted: bool, measured: bool = True) -> str:
    if not measured:
        return "not in yet"
    return "supported" if supported else "contradicted" if contradicted else "not told apart at this power"


def claims(runs, chosen: str | None) -> list[str]:
    have = lambda *arms: all(set(SCREEN_SEEDS) <= set(runs.get(arm, {})) for arm in arms)  # noqa: E731
    rows = []
    # 1. scorer
    ds = {arm: d_against_default(runs, arm) for arm in ("adm-max-prob", "adm-grad-norm")}
    signs = [told_apart(*d) for d in ds.values()]
    rows.append(
        (
            "1. Entropy the most stable scorer",
            "; ".join(f"{arm} {fmt(*d)}" for arm, d in ds.items()),
            verdict(all(s == 1 for s in signs), any(s == -1 for s in signs), have(DEFAULT, *ds)),
        )
    )
    # 2. adaptive policy against dynamic: the primary contrast
    if chosen is not None and len(paired(values(runs, chosen, final_loss), values(runs, BASELINE, final_loss))) == 6:
        m, _, half, p = t_test(
            list(paired(values(runs, chosen, final_loss), values(runs, BASELINE, final_loss)).values())
        )
        sign = (1 if m > 0 else -1) if p < ALPHA and abs(m) >= MIN_EFFECT else 0
        rows.append(
            (
                "2. ADM beats dynamic (the pick, six seeds)",
                f"{chosen} − dynamic {fmt(m, half)}",
                verdict(sign == -1, sign == 1),
            )
        )
    else:
        rows.append(("2. ADM beats dynamic (the pick, six seeds)", "–", "not in yet"))
    # 3. progress function
    ds = {arm: d_against_default(runs, arm) for arm in ("adm-linear", "adm-cosine", "adm-exponential")}
    signs = [told_apart(*d) for d in ds.values()]
    rows.append(
        (
            "3. Quadratic the most balanced progress function",
            "; ".join(f"{arm} {fmt(*d)}" for arm, d in ds.items()),
            verdict(all(s == 1 for s in signs), any(s == -1 for s in signs), have(DEFAULT, *ds)),
        )
    )
    # 4. a_max
    ds = {arm: d_against_default(runs, arm) for arm in ("adm-a_max-0.25", "adm-a_max-0.5")}
    frequent = {arm: d_against_default(runs, arm, frequent_loss) for arm in ds}
    signs = [told_apart(*d) for d in ds.values()]
    rows.append(
        (
            "4. A too-high a_max neglects basic learning",
            "; ".join(f"{arm} {fmt(*d)} (100 most frequent ids {fmt(*frequent[arm])})" for arm, d in ds.items()),
            verdict(-1 in signs and 1 not in signs, all(s == 1 for s in signs), have(DEFAULT, *ds)),
        )
    )
    # 5. batch size: (adm-batch16 - dynamic-batch16) - (adm-entropy - dynamic), interval I ± t · s
    gap16 = paired(
        values(runs, "adm-batch16", final_loss, SCREEN_SEEDS), values(runs, "dynamic-batch16", final_loss, SCREEN_SEEDS)
    )
    gap32 = paired(values(runs, DEFAULT, final_loss, SCREEN_SEEDS), values(runs, BASELINE, final_loss, SCREEN_SEEDS))
    interaction = paired(gap16, gap32)
    sd, df = pooled_sd(runs, DEFAULT, [a for a in CANDIDATES if a != DEFAULT], final_loss)
    m, half = screen_interval(interaction, sd, df, scale=math.sqrt(2))  # each I_s is two paired differences
    rows.append(
        (
            "5. Small batches make ADM unstable",
            f"I = {fmt(m, half)} (gap at batch 16 {fmt(mean(gap16.values()), math.nan)}, at 32 "
            f"{fmt(mean(gap32.values()), math.nan)})",
            verdict(told_apart(m, half) == 1, told_apart(m, half) == -1, have(DEFAULT, BASELINE, *BATCH16)),
        )
    )
    # 6. failure case
    constant = runs.get("adm-constant", {})
    rises = [largest_rise(eval_curve(row), DIVERGE_WITHIN) for seed, row in constant.items() if seed in SCREEN_SEEDS]
    diverged = any(rise > DIVERGE_RISE for rise in rises)
    rows.append(
        (
            "6a. A too-fast rise: perplexity diverges early",
            "largest rise within step 2,500: " + (" / ".join(f"{rise:.3f}" for rise in rises) or "–"),
            verdict(diverged, not diverged, have("adm-constant")),
        )
    )
    gain = d_against_default(runs, "adm-constant", probe_gain)
    sign = told_apart(*gain)
    loss = d_against_default(runs, "adm-constant")
    rows.append(
        (
            "6b. A too-fast rise: downstream falls",
            f"probe gain {fmt(*gain)} (final loss {fmt(*loss)})",
            verdict(sign == -1, sign == 1, have(DEFAULT, "adm-constant")),
        )
    )
    lines = ["| claim | measured (D = arm − adm-entropy, seeds 0 and 1, pooled 95%) | verdict |", "|---|---|---|"]
    return lines + [f"| {a} | {b} | {c} |" for a, b, c in rows] + [""]


def main() -> None:
    runs = runs_by_arm(load_rows())
    chosen = pick(runs)
    out = ["# seed-ablations-v5, recomputed without mlmlab", ""]
    out += gate(runs) + primary(runs, chosen)
    out += ["## Screen (descriptive)", ""] + screen_table(runs)
    out += ["## The proposal's claims", ""] + claims(runs, chosen)
    print("\n".join(out))


if __name__ == "__main__":
    main()
