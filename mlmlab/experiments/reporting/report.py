"""report.md and plots of a study, from its results.jsonl alone.

Tables come from the rows only; the curves (losses, masked share per frequency bucket, ADM's
a) also read the metrics.jsonl files the rows name, and are skipped with a note when those
are missing. Each arm is compared with the baseline seed by seed (statistics.py): the paired
t-interval is the primary interval, the bootstrap a secondary column, labelled "range" below
FEW_SEEDS seeds. A t-interval that contains 0 is reported as "no significant difference"; an arm
that ran the baseline's computation again as "identical by construction", not as a null. The
figures compared are in measures.py, the study's decision rule in decision.py, the plots in plots.py.
"""

import json
import logging
import math
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from scipy import stats

from mlmlab import choices
from mlmlab.errors import UserError
from mlmlab.experiments.gates import gate_outcomes, row_value
from mlmlab.experiments.reporting.curves import (
    flops_at,
    last_eval_within,
    last_per_x,
    mask_share_keys,
    progress_of,
    row_sequences_per_step,
    steps_to_target,
)
from mlmlab.experiments.reporting.decision import LOSE, WIN, decide, holm_call, holm_family_open, prior_shift, rule_text
from mlmlab.experiments.reporting.measures import (
    Metric,
    by_seed,
    downstream_metrics,
    loss_metric,
    metrics_of,
    probe_metrics,
    recalibrated_metrics,
    run_points,
)
from mlmlab.experiments.reporting.plots import write_plots
from mlmlab.experiments.reporting.screening import resolve_pick, screen_section, study_of
from mlmlab.experiments.reporting.statistics import (
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    FEW_SEEDS,
    Comparison,
    compare,
    compare_by_seed,
    detectable_effect,
    holm,
)
from mlmlab.experiments.results import PREREGISTRATION_SHA256, STUDY_IDENTITY, read_rows
from mlmlab.masking.strategies import STRATEGY_ENTRIES
from mlmlab.train.metrics import METRICS_FILE, metrics_lines
from mlmlab.utils import markdown
from mlmlab.utils.files import write_text_atomically

log = logging.getLogger(__name__)

MIN_CORRELATION_RUNS = 4  # fewer runs give no rank correlation worth printing (3 points: 6 orders in all)
LATE_PROGRESS = 0.9  # "late in training": ADM weights the scores more as training progresses


# ----- reading rows and curves -------------------------------------------------------------
def load_rows(path: Path) -> tuple[list[dict], list[str]]:
    """The rows, the latest per (arm, seed) (a duplicate, e.g. from a results file merged twice, counts once), and
    notes."""
    if not path.is_file():
        raise UserError(f"{path} does not exist; pass the results.jsonl an `mlmlab study` wrote")
    rows, ignored = read_rows(path)
    notes = [
        skipped(f"line {number} of {path.name} is not a complete result row and was ignored") for number in ignored
    ]
    latest = {(row["arm"], row["seed"]): row for row in rows}
    if len(latest) < len(rows):
        notes.append(f"{len(rows) - len(latest)} rows superseded by a later row of the same arm and seed")
    if not latest:
        raise UserError(f"{path} holds no result rows")
    return list(latest.values()), notes


def mixed_studies(rows: list[dict]) -> list[str]:
    """What makes ``rows`` more than one study's, each in words (none: one study's): two studies, two versions of one
    study file's arms, seeds, budgets, screen, rule or gates, two pre-registrations (a hash beside "none": written
    after the first rows), two decision rules. Each is compared among the rows that record it; study names only where
    a row records its study's identity, so rows written before identities were report as they did (a shipped study
    that took its baseline's rows from another)."""
    identified = [row for row in rows if row.get(STUDY_IDENTITY)]
    names = {str(row["study"]) for row in rows if "study" in row} if identified else set()
    versions = {row[STUDY_IDENTITY]["sha256"] for row in identified}
    preregistrations = {row[PREREGISTRATION_SHA256] or "none" for row in rows if PREREGISTRATION_SHA256 in row}
    rules = {json.dumps(row["decision"], sort_keys=True) for row in rows if "decision" in row}
    described = (
        (names, f"studies {', '.join(sorted(names))}"),
        (versions, f"{len(versions)} versions of the study file's arms, seeds, budgets, screen, rule or gates"),
        (preregistrations, f"pre-registrations {', '.join(sorted(sha[:12] for sha in preregistrations))}"),
        (rules, f"{len(rules)} decision rules"),
    )
    return [words for values, words in described if len(values) > 1]


def check_one_study(path: Path, descriptive: bool) -> list[str]:
    """mixed_studies of every row of ``path`` (before a later row of the same arm and seed hides another study's),
    refused in one line unless the report is ``descriptive``."""
    mixed = mixed_studies(read_rows(path)[0])
    if mixed and not descriptive:
        raise UserError(
            f"{path} holds rows of more than one study ({'; '.join(mixed)}): no one rule applies to them, and their "
            "seeds would be paired across studies; report each study's rows from its own results.jsonl, or pass "
            "--mixed descriptive to compare them with no rule applied"
        )
    return mixed


def descriptive_banner(mixed: list[str]) -> list[str]:
    """The top of a report asked to be descriptive (--mixed descriptive): what it applied (nothing) and why."""
    rows = f"rows of more than one study ({'; '.join(mixed)})" if mixed else "one study's rows"
    return [
        f"**Descriptive only (--mixed descriptive): no decision rule was applied.** These are {rows}; no validity "
        "gate or decision rule is applied and no call is made, and seeds are paired wherever rows share an arm and "
        "a seed, whichever study they come from.",
        "",
    ]


def skipped(note: str) -> str:
    """Warn on stderr of one item the report leaves out, as it reads it; the note, for report.md too."""
    log.warning("mlmlab: warning: %s", note)
    return note


def group_by_arm(rows: list[dict], baseline: str) -> dict[str, list[dict]]:
    """Rows per arm: the baseline first, then the study's arm order."""
    groups = defaultdict(list)
    for row in sorted(rows, key=lambda r: (r["arm"] != baseline, r.get("arm_index", 0), r["arm"], r["seed"])):
        groups[row["arm"]].append(row)
    return dict(groups)


def choose_baseline(rows: list[dict]) -> str:
    names = [row.get("baseline", choices.DYNAMIC) for row in rows]
    return max(set(names), key=names.count)


def read_curves(groups, results_dir: Path) -> tuple[dict[str, list[tuple[dict, list[dict]]]], list[str]]:
    """Per arm: (row, metrics records) of every run whose metrics.jsonl exists; and the missing paths."""
    curves, missing = defaultdict(list), []
    for arm, rows in groups.items():
        for row in rows:
            run_dir = results_dir / row.get("run_dir", "?")
            path = run_dir / METRICS_FILE
            if path.is_file():
                lines = metrics_lines(run_dir)
                for number in (number for number, record in lines if record is None):
                    skipped(f"line {number} of {path} is not a metrics record (cut short or damaged) and was ignored")
                curves[arm].append((row, [record for _, record in lines if record is not None]))
            else:
                missing.append(str(path))
    return dict(curves), missing


# ----- differences in words ----------------------------------------------------------------
def mean_std(values: dict[int, float]) -> str:
    if not values:
        return "–"
    data = np.array(list(values.values()))
    std = f" ± {data.std(ddof=1):.3g}" if len(data) > 1 else ""
    return f"{data.mean():.4g}{std} (n={len(data)})"


def boot_label(comparisons) -> str:
    """The bootstrap column's name: below FEW_SEEDS paired seeds it is a range of the differences, never a CI."""
    fewest = min((c.n for c in comparisons if c is not None), default=0)
    return "range (bootstrap)" if fewest < FEW_SEEDS else "95% bootstrap CI"


def format_delta(comparison: Comparison | None) -> str:
    """The difference with its t-interval; * = the t-interval excludes 0."""
    if comparison is None:
        return "–"
    if comparison.identical:
        return "identical by construction"
    if comparison.n < 2:
        return f"{comparison.diff:+.3g} (1 seed, no interval)"
    if comparison.all_zero:
        return "+0 (equal in every seed)"
    if not comparison.spread:
        return f"{comparison.diff:+.3g} (the same in every seed: no interval)"
    mark = " *" if comparison.significant else ""
    return f"{comparison.diff:+.3g} [{comparison.low:+.3g}, {comparison.high:+.3g}]{mark}"


def format_boot(comparison: Comparison | None) -> str:
    if comparison is None or comparison.n < 2 or comparison.identical or not comparison.spread:
        return "–"
    return f"[{comparison.boot_low:+.3g}, {comparison.boot_high:+.3g}]"


def format_p(p: float) -> str:
    return "–" if math.isnan(p) else f"{p:.2g}"


def verdict(arm: str, baseline: str, metric: Metric, comparison: Comparison | None) -> str:
    """One honest sentence: "no significant difference" whenever the t-interval contains 0."""
    head = f"{arm} vs {baseline}, {metric.label}:"
    if comparison is None:
        return f"{head} no seeds in common, no comparison."
    if comparison.identical:
        return (
            f"{arm} vs {baseline}: identical by construction. Every metric equals the baseline's in every seed, "
            "so the two arms ran the same computation; this is not a measured null."
        )
    if comparison.n < 2:
        return f"{head} cannot be assessed from 1 paired seed (Δ = {comparison.diff:+.3g}, no interval)."
    c = comparison
    if not c.spread:
        return (
            f"{head} Δ = {c.diff:+.3g} in each of {c.n} paired seeds: with no spread there is no interval, so "
            "no significance is claimed."
        )
    interval = f"Δ = {c.diff:+.3g}, 95% t-interval [{c.low:+.3g}, {c.high:+.3g}], {c.n} paired seeds"
    if not comparison.significant:
        return f"{head} no significant difference ({interval})."
    better = (comparison.diff < 0) == metric.lower_is_better
    direction = "lower" if comparison.diff < 0 else "higher"
    sentence = f"{head} {direction}, i.e. {'better' if better else 'worse'} ({interval})."
    if comparison.n < FEW_SEEDS:
        sentence += (
            f" With {comparison.n} seeds the t-interval rests on the differences being roughly normal, "
            "which so few seeds cannot check: suggestive only."
        )
    return sentence


def arm_verdicts(arm, baseline, compared: list[Metric], comparisons) -> list[str]:
    """A sentence per metric; one for the whole arm when it is the baseline's run again."""
    same = [c for c in comparisons if c is not None and c.identical]
    if same:
        return [f"- {verdict(arm, baseline, compared[0], same[0])}"]
    return [f"- {verdict(arm, baseline, m, c)}" for m, c in zip(compared, comparisons)]


# ----- the sections of report.md -----------------------------------------------------------
def masking_label(row: dict) -> str:
    m = (row.get("config") or {}).get("masking", {})
    if not m:
        return "?"
    entry = STRATEGY_ENTRIES.get(m["strategy"])  # None: a strategy registered where the study ran, not here
    label = entry.label(m) if entry else m["strategy"]
    start = m["rate_start"] if m["rate_schedule"] == choices.LINEAR_DECAY else m["rate"]
    label += f", rate {m['rate']:g}" if start == m["rate"] else f", rate {start:g}→{m['rate']:g}"
    architecture = (row["config"].get("model") or {}).get("architecture", choices.BERT)  # absent from older results
    return label if architecture == choices.BERT else f"{architecture}: {label}"


def commands(rows: list[dict], results: Path, out: Path) -> list[str]:
    # --out is where the rows are now, not the out_dir they were trained in: the runner skips the runs it finds
    # there, and a study folder may have moved since (docs/<name> -> studies/<name>).
    sources = dict.fromkeys(row.get("study_source", "?") for row in rows)
    lines = [f"    mlmlab study {source} --out {results.parent}" for source in sources]
    return lines + [f"    mlmlab report {results} --out {out}"]


def downstream_section(rows: list[dict], metrics: list[Metric]) -> list[str]:
    """Across all runs, whatever their arm: how far a lower held-out MLM loss goes with a higher GLUE score."""
    loss, body = loss_metric(metrics), []
    for score in downstream_metrics(metrics):
        points = run_points(rows, loss, score)
        if len(points) < MIN_CORRELATION_RUNS:
            body.append([score.label, str(len(points)), "too few runs", ""])
        elif any(len(set(column)) == 1 for column in zip(*points)):
            body.append([score.label, str(len(points)), "undefined (a constant column)", ""])
        else:
            rho, p = stats.spearmanr(*zip(*points))
            body.append([score.label, str(len(points)), f"{rho:+.2f}", f"{p:.2g}"])
    if not body:
        return []
    return [
        "## Pretraining loss against downstream scores",
        "",
        "Each run is one point, whatever its arm: Spearman's rank correlation between its held-out MLM loss and "
        "its GLUE dev score (negative: a lower loss goes with a higher score). An association across runs, not "
        "an effect of the masking: the runs differ in more than their loss.",
        "",
        *markdown.table(["score", "runs", "Spearman ρ with MLM loss", "p (two-sided)"], body),
    ]


def summary_columns(metrics) -> list[tuple[Metric, Metric]]:
    """(shown, compared) pairs: perplexity shown, its difference in nats; overall and the rarest bucket; GLUE."""
    ppl = [m for m in metrics if m.label == "perplexity" or m.label.startswith("ppl freq")]
    nats = [m for m in metrics if m.label.endswith("(nats)")]  # the same order: overall, then each bucket
    pairs = list(zip(ppl, nats))
    return pairs[:1] + pairs[1:][-1:] + [(m, m) for m in metrics if m.label == "GLUE avg"]


def gates_section(gates: dict | None, results: list[dict], groups) -> list[str]:
    """The study's validity gates, as its rows recorded them, and whether the gate arm's means met them."""
    if gates is None:
        return []
    arm_rows = groups.get(gates["arm"], [])
    body = [[r["path"], f"{r['least']:g}", f"{r['mean']:.4g}", "held" if r["held"] else "**failed**"] for r in results]
    held = bool(results) and all(r["held"] for r in results)
    # What the gates show is the study's to say: a gate floor need not mean the model left the unigram plateau.
    verdict = (
        "All gates held: the baseline trained as the study required, so the comparisons below count."
        if held
        else "A gate failed: the comparisons below are reported, but no conclusion is drawn from them."
    )
    return (
        [f"## Validity gates (means over the {len(arm_rows)} seeds of {gates['arm']}, fixed before the runs)", ""]
        + markdown.table(["figure", "least", "mean", "outcome"], body)
        + [verdict, ""]
    )


def decision_section(rows: list[dict], groups, baseline: str, metrics: list[Metric], gates_held: bool) -> list[str]:
    """The study's decision rule, as its rows recorded it: its named contrasts, Holm over them, where it has
    them (every arm against the baseline is then descriptive); else every arm against the baseline, Holm over
    the arms."""
    rule = decision_rule(rows)
    if rule is not None and rule.get("contrasts"):
        rule = resolve_pick(rule, rows)
        caveat = [] if gates_held else ["A validity gate failed: these calls are not conclusions.", ""]
        return contrasts_section(
            rule, groups, planned(rows)[1] | {row["seed"] for row in rows}, caveat
        ) + arms_against_baseline(rows, groups, baseline, metrics, gates_held, DESCRIPTIVE_ARMS)
    return arms_against_baseline(rows, groups, baseline, metrics, gates_held)


DECIDING_ARMS = "## Pre-registered decision (the study's rule as its rows record it, applied as written)"
DESCRIPTIVE_ARMS = (
    "## Every arm against the baseline (descriptive: the rule's calls are its contrasts above; the "
    "Holm column here adjusts over these arms)"
)


def contrasts_section(rule: dict, groups, seeds: set[int], caveat: list[str]) -> list[str]:
    """The rule's primary contrasts (arm − reference, paired by seed), Holm over them; with each, the paired sd
    and the least effect the seeds could detect, so that an inconclusive call says what it does not rule out."""
    primary = Metric(rule["metric"], tuple(rule["metric"].split(".")), rule["lower_is_better"])
    pairs = [tuple(pair) for pair in rule["contrasts"]]
    found = {pair: compare(groups.get(pair[0], []), groups.get(pair[1], []), primary) for pair in pairs}
    adjusted = dict(zip(pairs, holm([c.p if c is not None else math.nan for c in found.values()])))
    strictest = 0.05 / len(pairs)  # Holm's first step: what the smallest p-value must pass
    tested = sum(not math.isnan(p) for p in adjusted.values())
    body = []
    for (arm, reference), comparison in found.items():
        call, why = decide({**rule, "guard": {}}, comparison, {})
        held = holm_call(call, adjusted[(arm, reference)])
        n = comparison.n if comparison else 0
        provisional = f" (provisional: {n} of {len(seeds)} seeds)" if n < len(seeds) else ""
        p = comparison.p if comparison else math.nan
        holm_provisional = provisional or holm_family_open(held, p, tested, len(pairs), "contrasts")
        sd = comparison.sd if comparison else math.nan
        body.append(
            [
                f"{arm} − {reference}",
                str(n),
                format_delta(comparison),
                format_number(sd),
                format_number(detectable_effect(sd, n)),
                format_number(detectable_effect(sd, n, strictest)),
                format_p(p),
                format_p(adjusted[(arm, reference)]),
                f"{contrast_call(call, arm)}{provisional}",
                f"**{contrast_call(held, arm)}{holm_provisional}**",
                why,
            ]
        )
    header = [
        "contrast",
        "paired seeds",
        f"Δ {primary.label} [95% t-interval]",
        "paired sd",
        "detectable at 5% (80% power)",
        f"detectable at {100 * strictest:g}% (Holm's first step)",
        "p",
        "p (Holm)",
        "call (unadjusted)",
        "call (Holm: the rule)",
        "why",
    ]
    return (
        [
            DECIDING_ARMS,
            "",
            f"Each contrast is Δ = arm − reference in {primary.label}, paired by seed. The arm is **better** or "
            f"**worse** when the p-value, Holm-adjusted over these {len(pairs)} contrasts, is below 0.05 and |mean Δ| "
            f"≥ {rule['min_effect']:g}; otherwise **inconclusive**. The unadjusted call is printed beside it, not "
            'the rule\'s. "Detectable": the least true mean difference a paired t-test over these seeds finds with '
            "80% power at the observed paired sd (noncentral t).",
            "",
        ]
        + caveat
        + markdown.table(header, body)
        + [""]
    )


def contrast_call(call: str, arm: str) -> str:
    return {WIN: f"{arm} better", LOSE: f"{arm} worse"}.get(call, call)


def format_number(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.3g}"


def arms_against_baseline(
    rows: list[dict], groups, baseline: str, metrics: list[Metric], gates_held: bool, title: str = DECIDING_ARMS
) -> list[str]:
    """The rule applied to every arm against the baseline, Holm over the arms."""
    rule = decision_rule(rows)
    base_rows = groups.get(baseline, [])
    if rule is None or not base_rows or len(groups) < 2:
        return []
    primary = Metric(rule["metric"], tuple(rule["metric"].split(".")), rule["lower_is_better"])
    guards = [Metric(path, tuple(path.split(".")), False) for path in rule["guard"]]
    buckets = [m for m in metrics if m.label.startswith("loss freq") and m.path[0] == "eval"]  # frequent first
    rarest = buckets[-1] if buckets else None
    recalibrated = next((m for m in metrics if m.label == "recalibrated loss (nats)"), None)
    arms = [arm for arm in groups if arm != baseline]
    planned_arms, planned_seeds = planned(rows)
    seeds = len(planned_seeds | {row["seed"] for rows in groups.values() for row in rows})
    family = len((planned_arms | set(arms)) - {baseline})  # the arms Holm adjusts together once all are in
    mains = {arm: compare(groups[arm], base_rows, primary) for arm in arms}
    adjusted = dict(zip(arms, holm([c.p if c is not None else math.nan for c in mains.values()])))
    tested = sum(not math.isnan(p) for p in adjusted.values())
    header = ["arm", "paired seeds", f"Δ {primary.label} [95% t-interval]", "p", "p (Holm)"]
    header += [f"Δ {m.label}" for m in guards] + ([f"Δ {rarest.label}"] if rarest else [])
    header += ["Δ recalibrated loss (nats): its call, no guard"] if recalibrated else []
    header += ["call", "call (Holm)", "why"]
    body = []
    for arm in arms:
        main, checks = mains[arm], [compare(groups[arm], base_rows, m) for m in guards]
        call, why = decide(rule, main, dict(zip(rule["guard"], checks)))
        rare = compare(groups[arm], base_rows, rarest) if rarest else None
        recal = compare(groups[arm], base_rows, recalibrated) if recalibrated else None
        recal_call = decide({**rule, "guard": {}}, recal, {})[0] if recalibrated else None
        shifted = ", prior shift" if prior_shift(main, rare, rule["lower_is_better"], recal_call) else ""
        # Until every seed is in, both calls are provisional.
        provisional = f" (provisional: {main.n} of {seeds} seeds)" if main and main.n < seeds else ""
        held = holm_call(call, adjusted[arm])
        holm_provisional = provisional or holm_family_open(held, main.p if main else math.nan, tested, family, "arms")
        body.append(
            [
                arm,
                str(main.n if main else 0),
                format_delta(main),
                format_p(main.p if main else math.nan),
                format_p(adjusted[arm]),
                *map(format_delta, checks),
                *([format_delta(rare)] if rarest else []),
                *([f"{format_delta(recal)}: {recal_call}"] if recalibrated else []),
                f"**{call}{shifted}{provisional}**",
                f"**{held}{shifted}{holm_provisional}**",
                why,
            ]
        )
    caveat = [] if gates_held else ["A validity gate failed: these calls are not conclusions.", ""]
    return [title, "", rule_text(rule, rarest, recalibrated), ""] + caveat + markdown.table(header, body) + [""]


def planned(rows: list[dict]) -> tuple[set[str], set[int]]:
    """The study's arms and seeds from its study file, where the rows' study_source still loads; else none (the
    rows then say as far as they show)."""
    study = study_of(rows)
    return (set(), set()) if study is None else ({arm.name for arm in study.arms}, set(study.seeds))


def summary_section(groups, baseline, metrics) -> list[str]:
    """The seed's comparison: baseline, then each arm; perplexity with its difference in nats, GLUE."""
    pairs = summary_columns(metrics)
    base_rows = groups.get(baseline, [])
    compared = {arm: [compare(rows, base_rows, m) for _, m in pairs] for arm, rows in groups.items() if arm != baseline}
    boot = boot_label(c for cs in compared.values() for c in cs)
    header = ["arm", "masking"]
    header += [h for shown, m in pairs for h in (shown.label, f"Δ {m.label} [95% t-interval]", boot)]
    body, sentences = [], []
    for arm, rows in groups.items():
        cells = [arm + (" (baseline)" if arm == baseline else ""), masking_label(rows[0])]
        for (shown, _), c in zip(pairs, compared.get(arm, [None] * len(pairs))):
            deltas = ["", ""] if arm == baseline else [format_delta(c), format_boot(c)]
            cells += [mean_std(by_seed(rows, shown)), *deltas]
        body.append(cells)
        if arm != baseline and base_rows:
            sentences += arm_verdicts(arm, baseline, [m for _, m in pairs], compared[arm])
    return (
        ["## Summary in the seed's shape: the baseline, then each arm", ""]
        + markdown.table(header, body)
        + sentences
        + [""]
    )


def metric_table(title: str, groups, baseline, metrics, delta_metrics=None) -> list[str]:
    """Mean ± std of ``metrics``, then each arm's paired difference from the baseline in ``delta_metrics``
    (default: the same): the t-interval table first, the bootstrap second."""
    if not metrics:
        return []
    header = ["arm"] + [m.label for m in metrics]
    values = [[arm] + [mean_std(by_seed(rows, m)) for m in metrics] for arm, rows in groups.items()]
    lines = [f"## {title}", "", "Mean ± std over seeds:", ""] + markdown.table(header, values)
    delta_metrics = delta_metrics or metrics
    compared = {
        arm: [compare(rows, groups[baseline], m) for m in delta_metrics]
        for arm, rows in groups.items()
        if arm != baseline and baseline in groups
    }
    if compared:
        delta_header = ["arm"] + [m.label for m in delta_metrics]
        boot = boot_label(c for cs in compared.values() for c in cs)
        lines += [
            f"Difference from {baseline} (arm − baseline, paired by seed), 95% t-interval; "
            "* = the t-interval excludes 0:",
            "",
        ]
        lines += markdown.table(delta_header, [[arm] + [format_delta(c) for c in cs] for arm, cs in compared.items()])
        few = boot.startswith("range")  # below FEW_SEEDS the bootstrap spans the observed differences
        lines += [
            f"Secondary: {'range' if few else '95% bootstrap CI'} of the same differences (percentile bootstrap"
            + ("; with so few seeds it is not a confidence interval" if few else "")
            + "):",
            "",
        ]
        lines += markdown.table(delta_header, [[arm] + [format_boot(c) for c in cs] for arm, cs in compared.items()])
    return lines


def target_share_section(curves) -> list[str]:
    """Each arm's share of training targets per frequency bucket: the target prior it trained on.

    The number behind a "prior shift": moving targets to rare ids lowers their held-out loss by
    refitting the output bias, whatever chose the positions. Over the whole run and past
    LATE_PROGRESS of it (ADM's weight on the scores grows with progress). Mean over seeds of each
    run's mean over its logged windows (equal numbers of steps each)."""
    keys = mask_share_keys(curves)
    if not keys:
        return []
    body = []
    for arm, runs in curves.items():
        cells = [arm]
        for key in keys:
            shares = [last_per_x(row, records, lambda r, key=key: r.get(key), progress_of) for row, records in runs]
            whole = [np.mean(list(s.values())) for s in shares if s]
            late = [np.mean(tail) for s in shares if (tail := [v for at, v in s.items() if at > LATE_PROGRESS])]
            cells.append(" / ".join(f"{np.mean(part):.3f}" if part else "n/a" for part in (whole, late)))
        body.append(cells)
    header = ["arm"] + [f"freq {key.removeprefix('mask_share_freq_')}" for key in keys]
    return (
        [
            "## Where the training targets went",
            "",
            "Share of the selected (masked) training positions in each corpus-frequency bucket: over the whole "
            f"run / over its last {100 * (1 - LATE_PROGRESS):.0f}% (mean over seeds, from metrics.jsonl). Uniform "
            "masking's shares are the corpus's; an arm that moves targets to rare ids lowers their held-out loss by "
            "that alone (a prior shift).",
            "",
        ]
        + markdown.table(header, body)
        + [""]
    )


def steps_to_target_section(rows: list[dict], curves, baseline: str) -> list[str]:
    """When each run left the plateau: the first evaluation below the study's target (decision.target), in steps
    and FLOPs, so "learns faster" is measured as well as "ends lower"; Δ steps paired by seed where both reached."""
    rule = decision_rule(rows) or {}
    metric = rule.get("metric", "")
    if not metric.startswith("eval.") or not curves:
        return []
    named = (("target", "the study's decision.target"), ("lower_target", "the study's decision.lower_target"))
    return [
        line
        for field, source in named
        if rule.get(field) is not None
        for line in steps_to_table(curves, baseline, metric.removeprefix("eval."), rule[field], source)
    ]


def steps_to_table(curves, baseline: str, key: str, target: float, source: str) -> list[str]:
    """Each run's first evaluation below ``target`` in held-out ``key``, per arm, paired with the baseline's."""
    reached = {
        arm: {
            row["seed"]: (at := steps_to_target(row, records, key, target), at and flops_at(row, at))
            for row, records in runs
        }
        for arm, runs in curves.items()
    }
    base_runs = {seed: steps for seed, (steps, _) in reached.get(baseline, {}).items()}  # steps None: never
    base = {seed: steps for seed, steps in base_runs.items() if steps is not None}
    body = []
    for arm, seeds in reached.items():
        steps = {seed: at for seed, (at, _) in seeds.items() if at is not None}
        flops = [spent for at, spent in seeds.values() if at is not None]
        paired = [steps[seed] - base[seed] for seed in steps if seed in base]
        seeds_paired = f"{len(paired)} seed{'s' if len(paired) > 1 else ''}"
        delta = "" if arm == baseline or not paired else f"{np.mean(paired):+.0f} ({seeds_paired})"
        body.append(
            [
                arm,
                " / ".join(str(seeds[seed][0] or "never") for seed in sorted(seeds)),
                mean_std({s: float(v) for s, v in steps.items()}),
                f"{np.mean(flops):.3g}" if flops else "–",
                f"{len(seeds) - len(steps)} of {len(seeds)}",
                delta,
                "" if arm == baseline else earlier_seeds(steps, base_runs, seeds),
            ]
        )
    return [
        f"## Steps to target (held-out {key} below {target:g}, {source})",
        "",
        "The first evaluation step at which each run's held-out figure fell below the target, read from its "
        "metrics.jsonl (resolution: the evaluation interval); FLOPs = the run's estimated FLOPs up to that step, "
        "each step at its own mask rate (budget.flops_until).",
        "",
        *markdown.table(
            [
                "arm",
                "step per seed",
                "mean ± std",
                "mean FLOPs",
                "never reached",
                f"Δ steps vs {baseline} (paired)",
                f"seeds earlier than {baseline}",
            ],
            body,
        ),
        "",
    ]


def decision_rule(rows: list[dict]) -> dict | None:
    """The study's decision rule as its rows recorded it (None: a study without one)."""
    return next((row["decision"] for row in rows if row.get("decision")), None)


# An arm within this share of the baseline's FLOPs spent the same compute: its final figure is its matched one.
SAME_FLOPS = 0.01


def equal_flops_section(rows: list[dict], curves, baseline: str) -> list[str]:
    """Each arm that spends more FLOPs than the baseline, read at the baseline's FLOPs: its held-out figure at
    the last evaluation within the same seed's baseline run's total FLOPs, against that run's final figure."""
    metric = (decision_rule(rows) or {}).get("metric", "eval.mlm_loss")
    if not metric.startswith("eval.") or baseline not in curves:
        return []
    key = metric.removeprefix("eval.")
    base = {row["seed"]: row for row, _ in curves[baseline] if (row.get("eval") or {}).get(key) is not None}
    body = []
    for arm, runs in curves.items():
        if arm == baseline:
            continue
        spent_more = [
            (row, records)
            for row, records in runs
            if row["seed"] in base and row.get("flops", 0) > (1 + SAME_FLOPS) * base[row["seed"]]["flops"]
        ]
        matched = {
            row["seed"]: point
            for row, records in spent_more
            if (point := last_eval_within(row, records, key, base[row["seed"]]["flops"])) is not None
        }
        if not matched:
            continue
        comparison = compare_by_seed(
            {seed: value for seed, (_, value) in matched.items()}, {seed: base[seed]["eval"][key] for seed in matched}
        )
        body.append(
            [
                arm,
                " / ".join(f"{step:,}" for _, (step, _) in sorted(matched.items())),
                " / ".join(f"{value:.3f}" for _, (_, value) in sorted(matched.items())),
                format_delta(comparison),
            ]
        )
    if not body:
        return []
    return [
        f"## At {baseline}'s FLOPs: the arms that spend more, read where they had spent as much (descriptive)",
        "",
        f"Held-out {key} at each run's last evaluation whose estimated FLOPs (scorer included) are within its "
        f"seed's {baseline} run's total, against that run's final figure, paired by seed (resolution: the "
        "evaluation interval). Descriptive, not a decision: a run read mid-way has not decayed its LR, which "
        "favours the baseline; an arm with budget compute-matched is the run trained to that budget.",
        "",
        *markdown.table(["arm", "step per seed", f"{key} there", f"Δ vs {baseline}'s final [95% t-interval]"], body),
        "",
    ]


def earlier_seeds(steps: dict, base_runs: dict, seeds) -> str:
    """ "k of n": of the n seeds that both the arm and the baseline ran, the k where the arm reached the target
    at an earlier step than the baseline's run of that seed, or reached it where that run never did."""
    both = [seed for seed in seeds if seed in base_runs]
    earlier = [seed for seed in both if seed in steps and (base_runs[seed] is None or steps[seed] < base_runs[seed])]
    return f"{len(earlier)} of {len(both)}" if both else "–"


def cost_section(groups) -> list[str]:
    header = [
        "arm",
        "budget",
        "steps",
        "batch",
        "tokens seen",
        "est. FLOPs",
        "scorer share of FLOPs",
        "train s",
        "scorer s",
        "wall s (incl. eval, GLUE)",
        "torch threads",
    ]
    body = []
    for arm, rows in groups.items():
        mean = lambda key: np.mean([row.get(key, math.nan) for row in rows])  # noqa: E731
        batch = np.mean([row_sequences_per_step(row) for row in rows])
        body.append(
            [
                arm,
                rows[0].get("budget", "?"),
                f"{mean('steps'):.0f}",
                f"{batch:.0f}",
                f"{mean('tokens_seen'):.3g}",
                f"{mean('flops'):.3g}",
                f"{100 * mean('scorer_share'):.1f}%",
                f"{mean('train_seconds'):.0f}",
                f"{mean('scorer_seconds'):.1f}",
                f"{mean('wall_seconds'):.0f}",
                thread_counts(rows),
            ]
        )
    lines = ["## Budget and cost (means over seeds)", ""] + markdown.table(header, body)
    if len({row.get("torch_threads") for group in groups.values() for row in group}) > 1:
        lines += [
            "",
            'Runs were made with different torch thread counts (or, "?", before rows recorded it): '
            "seconds compare only between runs made alike; FLOPs compare across all.",
            "",
        ]
    return lines


def thread_counts(rows: list[dict]) -> str:
    """The torch thread counts an arm's runs used, e.g. "2" or "1, 2" ("?" for rows made before it was recorded)."""
    return ", ".join(sorted({str(row.get("torch_threads", "?")) for row in rows}))


def held_out_data_notes(rows: list[dict]) -> list[str]:
    """A warning for each further held-out set whose rows were evaluated on different prepared data.

    Rows record the prepared dataset's hash since WikiText's <unk> became the [UNK] id
    (2026-12-01); rows from before record none. A study whose rows all lack it is not flagged.
    """
    notes = []
    evaluated = [report for row in rows for report in (row.get("eval_data") or {}).items() if "mlm_loss" in report[1]]
    for name in dict.fromkeys(name for name, _ in evaluated):
        counts = Counter(held_out.get("dataset", "not recorded") for each, held_out in evaluated if each == name)
        if len(counts) > 1:
            kinds = ", ".join(f"{dataset} ({n} row{'s' * (n != 1)})" for dataset, n in counts.items())
            notes.append(
                f"**{name} was evaluated on different prepared data in different rows** ({kinds}): its "
                "figures compare only between rows of the same data. Rows that record none were made "
                "before 2026-12-01, when WikiText's <unk> became the [UNK] id."
            )
    return [*notes, ""] if notes else []


def non_finite_notes(rows: list[dict], metrics: list[Metric]) -> list[str]:
    """A warning for each row with an infinite figure (a diverged run, a damaged row): by_seed leaves it out of
    every comparison of that figure, which would otherwise be an infinite Δ."""
    notes = []
    for row in rows:
        bad = [metric.label for metric in metrics if math.isinf(row_value(row, metric.path))]
        if bad:
            notes.append(
                f"**{row['arm']} seed {row['seed']} has non-finite figures** ({', '.join(bad[:3])}"
                f"{', ...' if len(bad) > 3 else ''}): left out of every comparison of them, which therefore rest "
                "on the other seeds; see the run's metrics.jsonl"
            )
    return notes


def held_out_setting(row: dict) -> dict:
    """What decides which held-out targets a row's figures are over, besides its model: the prepared held-out data
    and the masked-token count its evaluated batches give (under the fixed masks, the same for every seed measured
    alike). None: not recorded (older rows)."""
    return {"valid data": (row.get("datasets") or {}).get("valid"), "masked tokens": row["eval"].get("masked_tokens")}


def measured_alike(groups: dict[str, list[dict]]) -> tuple[dict[str, list[dict]], list[str]]:
    """The arms whose rows were all measured with one held-out setting, and a warning for each other arm: its seeds
    measured different targets, so no difference of it is a difference of the masking; it is not compared."""
    kept, notes = {}, []
    for arm, rows in groups.items():
        settings = [held_out_setting(row) for row in rows]
        differing = {
            name: sorted({str(setting[name]) for setting in settings if setting[name] is not None})
            for name in settings[0]
        }
        differing = {name: values for name, values in differing.items() if len(values) > 1}
        if not differing:
            kept[arm] = rows
            continue
        kinds = "; ".join(f"{name} {' vs '.join(values)}" for name, values in differing.items())
        notes.append(
            f"**{arm}: its rows were measured with different held-out settings** ({kinds}): not compared; "
            "rerun its seeds alike (one study file, one data section) to compare it"
        )
    return kept, notes


def glue_notes(rows: list[dict]) -> list[str]:
    skipped = sorted({row["glue"]["skipped"] for row in rows if "skipped" in (row.get("glue") or {})})
    return [f"GLUE skipped: {reason}." for reason in skipped]


def bucket_example(metrics: list[Metric]) -> str:
    """ " (0_500 = the 500 most frequent ids)", from the rows' first bucket; "" without buckets."""
    first = next((m.label.removeprefix("ppl freq ") for m in metrics if m.label.startswith("ppl freq ")), None)
    return f" ({first} = the {first.split('_')[1]} most frequent ids)" if first else ""


def write_report(results: Path, out: Path, descriptive: bool = False) -> Path:
    """Write report.md and the PNG plots to ``out``; returns the report's path. Rows of more than one study
    (mixed_studies) are refused unless ``descriptive``, which applies no gate and no rule to any rows."""
    rows, notes = load_rows(results)
    mixtures = check_one_study(results, descriptive)
    if descriptive:
        rows = [{**row, "decision": None, "gates": None} for row in rows]
    baseline = choose_baseline(rows)
    groups = group_by_arm(rows, baseline)
    metrics = metrics_of(rows)
    if baseline not in groups:
        notes.append(f"the baseline arm {baseline!r} has no rows: no differences can be computed")
    out.mkdir(parents=True, exist_ok=True)
    curves, missing = read_curves(groups, results.parent)
    if missing:
        notes.append(
            f"curve plots skipped for {len(missing)} runs whose metrics.jsonl is missing (e.g. {missing[0]}), "
            "and their target shares; the other tables come from results.jsonl alone"
        )
    images = write_plots(groups, baseline, metrics, curves, out)
    groups, mixed = measured_alike(groups)
    warnings = [skipped(note) for note in mixed + non_finite_notes(rows, metrics)]
    studies = ", ".join(sorted({row.get("study", "?") for row in rows}))
    seeds = sorted({row["seed"] for row in rows})
    lines = [
        f"# Study {studies}: each arm against {baseline}",
        "",
        "Every number below is reproduced by (the experiment skips runs already in results.jsonl):",
        "",
        *commands(rows, results, out),
        "",
        f"{len(rows)} runs, {len(groups) + len(mixed)} arms, seeds {seeds}; mlmlab "
        f"{', '.join(sorted({str(row.get('mlmlab_version')) for row in rows}))}.",
        "",
        *(descriptive_banner(mixtures) if descriptive else []),
        *[f"- Warning: {warning}" for warning in warnings],
        *([""] if warnings else []),
    ]
    gates, outcomes = gate_outcomes(rows, groups)
    lines += gates_section(gates, outcomes, groups)
    gates_held = all(outcome["held"] for outcome in outcomes)
    lines += decision_section(rows, groups, baseline, metrics, gates_held)
    lines += screen_section(rows, groups, baseline, decision_rule(rows))
    lines += summary_section(groups, baseline, metrics)
    lines += metric_table(
        "Held-out perplexity, overall and per frequency bucket; differences in nats of MLM loss",
        groups,
        baseline,
        [m for m in metrics if "ppl" in m.label or m.label == "perplexity"],
        [m for m in metrics if m.label.endswith("(nats)") and m.path[0] == "eval"],
    )
    lines += steps_to_target_section(rows, curves, baseline)
    lines += equal_flops_section(rows, curves, baseline)
    recalibrated = recalibrated_metrics(rows)
    if recalibrated:
        lines += metric_table(
            "Prior-free loss: the output bias refitted on half the held-out targets, the other "
            "half scored (nats; raw = the model's own bias on the same half)",
            groups,
            baseline,
            recalibrated,
        )
    lines += target_share_section(curves)
    lines += metric_table(
        "Held-out MLM and NSP accuracy",
        groups,
        baseline,
        [m for m in metrics if m.label.endswith("accuracy") and m.path[0] == "eval"],
    )
    further = [m for m in metrics if m.path[0] == "eval_data"]
    if further:
        lines += metric_table(
            "Further held-out sets (the study's eval_data; same fixed masks)", groups, baseline, further
        ) + held_out_data_notes(rows)
    glue = [m for m in metrics if m.label.startswith("GLUE")]
    lines += (
        metric_table(
            "GLUE dev scores (x100; median over fine-tuning seeds, then over pretraining seeds as mean ± std)",
            groups,
            baseline,
            glue,
        )
        + glue_notes(rows)
        + [""]
    )
    probes = probe_metrics(rows)
    if probes:
        lines += metric_table(
            "Frozen linear probes (dev, x100; gain = pretrained − a random-init encoder of the same architecture)",
            groups,
            baseline,
            probes,
        )
    lines += downstream_section(rows, metrics)
    lines += cost_section(groups)
    lines += ["## Plots", ""] + [f"![{name}]({name})" for name in images] + [""]
    lines += [
        "## How to read this",
        "",
        "- Perplexity is exp(mean cross-entropy) on the held-out sample under the same fixed uniform 15% masks "
        "for every arm; frequency buckets are ranks of the target token in the pretraining corpus"
        f"{bucket_example(metrics)}.",
        "- Losses are compared in nats: Δ of the MLM loss (overall) and of log(perplexity) per bucket. "
        "A Δ of d nats multiplies perplexity by exp(d) (+0.01 nats ≈ +1%).",
        "- Δ = arm − baseline, averaged over the seeds both have, paired by seed. The primary interval is the "
        "95% paired t-interval over seeds (df = n − 1); verdicts and * use it. The secondary "
        f"column is a percentile bootstrap ({BOOTSTRAP_RESAMPLES} resamples of the paired seeds, generator "
        f"seed {BOOTSTRAP_SEED}); below {FEW_SEEDS} seeds it is labelled a range, since it spans little more "
        "than the observed differences (with 3 seeds, exactly their min and max). "
        "Lower perplexity and loss are better; higher accuracy and GLUE are better.",
        '- "identical by construction": every metric of the arm equals the baseline\'s in every seed, so the '
        "two arms ran the same computation; that is not a measured null.",
        "- FLOPs are estimates from the model config (mlmlab/experiments/budget.py), scorer passes included.",
        *[f"- Note: {note}" for note in notes],
        "",
    ]
    path = out / "report.md"
    write_text_atomically(path, "\n".join(lines))  # a rerun's failed write leaves the last whole report
    return path
