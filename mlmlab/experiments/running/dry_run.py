"""``mlmlab study --dry-run``: every arm's config validated and what the runs left would cost, training nothing.

The cost is estimated from FLOPs (budget.py, downstream.py) and, with ``--time-steps``, also timed here on
a few real steps of each arm (timing.py); each run left is listed with where it stands.
"""

import dataclasses
import json
from pathlib import Path

from mlmlab.experiments.budget import ASSUMED_MFU, CPU_FLOPS, H100_PEAK_FLOPS, cpu_hours, gpu_hours
from mlmlab.experiments.results import RESULTS_FILE
from mlmlab.experiments.running.downstream import (
    Downstream,
    check_positions,
    downstream_work,
    glue_settings,
    timed_downstream,
)
from mlmlab.experiments.running.runner import (
    Run,
    finished_rows,
    missing_measurements,
    only_runs,
    plan_runs,
    refuse_incomparable,
    runs_to_cost,
    shard_runs,
)
from mlmlab.experiments.running.timing import WARMUP_STEPS, run_minutes, timed_run
from mlmlab.experiments.study import Study
from mlmlab.train.metrics import metrics_records
from mlmlab.train.run_folder import complete_checkpoints, step_of
from mlmlab.utils.files import live_holder


def dry_run_text(
    study: Study,
    shard: tuple[int, int] = (0, 1),
    timed_steps: int | None = None,
    show_progress: bool = False,
    only: tuple[tuple[str, int | None], ...] = (),
) -> str:
    """Every arm's config validated and its estimated cost, GLUE and probes included; with ``timed_steps`` (None: not
    timed), each arm's cost timed here too (``show_progress``: bars on stderr). The runs left: this shard's, of those
    ``only`` names."""
    runs = plan_runs(study)
    check_positions(study, {run.arm.name: run.config for run in runs})  # as a run checks it before the first one
    mine = only_runs(shard_runs(runs, shard, study.gates.arm if study.gates else None), only)
    arm_runs = runs[: len(study.arms)]  # the first seed's runs: one per arm
    work = {setting: downstream_work(study, setting) for setting in {run.config.data.tokenizer for run in arm_runs}}
    downstream = {run.arm.name: work[run.config.data.tokenizer].flops(run.config.model) for run in arm_runs}
    planned = (
        f"{len(study.arms)} arms x {len(study.seeds)} seeds = {len(runs)} runs"
        if study.screen is None
        else f"{len(study.arms)} arms on screen seeds {list(study.screen.seeds)}, then "
        f"{', '.join(study.screen.confirm)} and the pick on the rest of seeds {study.seeds}: {len(runs)} runs planned"
    )
    lines = [
        f"study {study.name}: {planned} ({len(mine)} in shard {shard[0]}/{shard[1]}), budget {study.budget}, "
        f"baseline {study.baseline}",
        f"{'arm':<34} {'steps':>9} {'batch':>6} {'tokens':>10} {'FLOPs':>9} {'scorer':>7} {'GPU-h':>9} "
        f"{'CPU-h':>9} {'GLUE FLOPs':>10} {'probe FLOPs':>11}",
    ]
    for run in arm_runs:
        c, d = run.cost, downstream[run.arm.name]
        lines.append(
            f"{run.arm.name:<34} {c['steps']:>9} {c['sequences_per_step']:>6} {c['tokens']:>10.3g} "
            f"{c['flops']:>9.3g} {100 * c['scorer_share']:>6.1f}% {c['gpu_hours']:>9.3g} {c['cpu_hours']:>9.3g} "
            f"{d['glue']:>10.3g} {d['probes']:>11.3g}"
        )
    rows = finished_rows(Path(study.out_dir) / RESULTS_FILE)
    refuse_incomparable(runs, rows)  # what the study itself would refuse, said before its cost
    finished = {row["key"] for row in rows}
    left = runs_to_cost([run for run in mine if run.key not in finished], study, rows)
    if timed_steps:
        lines += probed_cost_lines(study, arm_runs, left, timed_steps, work, downstream, show_progress)
    trained = sum(run.cost["flops"] for run in left)
    evaluated = sum(sum(downstream[run.arm.name].values()) for run in left)
    gpu = sum(run.cost["gpu_hours"] for run in left) + gpu_hours(evaluated)
    cpu = sum(run.cost["cpu_hours"] for run in left) + cpu_hours(evaluated)
    lines += [
        f"this shard: {sum(run.key in finished for run in mine)} of its {len(mine)} runs already in "
        f"{Path(study.out_dir) / RESULTS_FILE}{screen_note(study, mine, left, finished)}; "
        f"the {len(left)} left: {trained:.3g} training FLOPs and {evaluated:.3g} of GLUE fine-tuning and probes, "
        f"{gpu:.3g} GPU-hours or {cpu:.3g} CPU-hours",
        f"assumptions: GPU-hours at {ASSUMED_MFU:.0%} MFU of an H100 SXM's ~{H100_PEAK_FLOPS / 1e12:.0f} TFLOP/s dense "
        f"bf16 peak (~{ASSUMED_MFU * H100_PEAK_FLOPS / 1e12:.0f} TFLOP/s achieved); CPU-hours (training + evaluation) "
        f"at ~{CPU_FLOPS / 1e9:.0f} GFLOP/s (a tiny-preset step, batch 32 x 128, takes ~0.5 s on 2 idle cores); "
        "FLOPs estimated from the model config (mlmlab/experiments/budget.py)",
        downstream_note(study, work),
        "global batch per optimizer step = train.batch_size x train.grad_accum x processes; the table counts "
        "one process, so with N processes divide train.grad_accum by N to keep the batch",
    ]
    lacking = [(row, missing_measurements(row, study)) for row in rows if row["key"] in {run.key for run in mine}]
    return "\n".join(
        lines
        + [f"left: {run.arm.name} seed {run.seed} ({run_state(run)})" for run in left]
        + [
            f"to measure: {row['arm']} seed {row['seed']} lacks {', '.join(missing)} (measured on its model folder, "
            "no training)"
            for row, missing in lacking
            if missing
        ]
    )


def screen_note(study: Study, mine: list[Run], left: list[Run], finished: set) -> str:
    """What the runs left leave out: a screen's confirmation seeds of every candidate but one (the pick, or the
    dearest while none is picked)."""
    dropped = len(mine) - len(left) - sum(run.key in finished for run in mine)
    return f" ({dropped} confirmation runs of candidates other than the screen's pick not counted)" if dropped else ""


def downstream_note(study: Study, work: dict[str, Downstream]) -> str:
    """What the GLUE and probe FLOPs count, and what they leave out."""
    if not (study.glue.tasks or study.probe):
        return "GLUE and probes: none in this study"
    if not Path(study.glue_dir or "").is_dir():
        return (
            f"GLUE and probes: not counted, glue_dir {study.glue_dir!r} is not a folder (a run would refuse to start)"
        )
    counted = next(iter(work.values()))
    skipped = [name for name in glue_settings(study) if name not in {task.name for task in counted.glue}]
    parts = (
        [
            f"GLUE {', '.join(task.name for task in counted.glue)}: every training row of every epoch, learning "
            "rate and seed, padded as its batch is, and the dev predictions"
        ]
        if counted.glue
        else []
    )
    parts += (
        [
            f"probes {', '.join(task.name for task in counted.probes)}: every split's features, for the "
            "pretrained and each random-init encoder (the regressions are timed only with --time-steps)"
        ]
        if counted.probes
        else []
    )
    parts += [f"GLUE tasks skipped, their files absent: {', '.join(skipped)}"] if skipped else []
    return (
        f"GLUE and probes per run: FLOPs counted from the task files in {study.glue_dir} with each arm's tokenizer "
        f"(mlmlab/experiments/running/downstream.py); {'; '.join(parts)}"
    )


def run_state(run: Run) -> str:
    """Where a run left to do stands: training now (the process its folder's lock names is alive), its newest
    checkpoint (not verified here), or not started."""
    folder = Path(run.config.train.out_dir)
    pid = live_holder(folder)
    if pid is not None:
        return f"training in pid {pid}, logged step {logged_step(folder)} of {run.cost['steps']}"
    saved = complete_checkpoints(folder, check=False)
    return f"resumes from its checkpoint at step {step_of(saved[-1])}" if saved else "not started"


def logged_step(folder: Path) -> int:
    """The step of the last record in a run's metrics.jsonl (0 before the first)."""
    records = metrics_records(folder)
    return records[-1].get("step", 0) if records else 0


def probed_cost_lines(
    study: Study,
    arm_runs: list[Run],
    left: list[Run],
    steps: int,
    work: dict[str, Downstream],
    downstream: dict[str, dict],
    show_progress: bool,
) -> list[str]:
    """Each arm's minutes per run, timed on this machine, beside the FLOP estimate; the total of the runs left."""
    lines = [
        f"timed here: {steps} steps per arm after {WARMUP_STEPS} warm-up steps, and {steps} fine-tuning steps and "
        "a few batches of each GLUE and probe task (experiments/running/downstream.py); minutes per run, training "
        "with its held-out evaluations; vs FLOPs: timed / the FLOP estimate at the CPU rate above",
        f"  {'arm':<30} {'s/step':>8} {'vs first':>10} {'vs FLOPs':>9} {'train':>8} {'GLUE':>8} {'probes':>8} "
        f"{'min/run':>8}",
    ]
    timed, estimated, first, by_model = {}, {}, None, {}
    for run in arm_runs:
        cfg, name = run.config, run.arm.name
        probed = timed_run(cfg, steps, show_progress, name)
        first = first or probed["step_seconds"]
        model_key = (json.dumps(dataclasses.asdict(cfg.model), sort_keys=True), cfg.data.tokenizer, cfg.train.init)
        if model_key not in by_model:  # GLUE and probes cost the same for arms of one model and tokenizer
            by_model[model_key] = timed_downstream(cfg, study, work[cfg.data.tokenizer], steps, show_progress)
        seconds = by_model[model_key]
        timed[name] = {
            "train": run_minutes(cfg, probed),
            "glue": seconds["glue"] / 60,
            "probes": seconds["probes"] / 60,
        }
        estimated[name] = {
            "train": 60 * run.cost["cpu_hours"],
            **{part: 60 * cpu_hours(flops) for part, flops in downstream[name].items()},
        }
        step_estimate = run.cost["flops_per_step"] / CPU_FLOPS
        lines.append(
            f"  {name:<30} {probed['step_seconds']:>8.3f} {probed['step_seconds'] / first:>9.2f}x "
            f"{probed['step_seconds'] / step_estimate:>8.1f}x {timed[name]['train']:>8.2f} "
            f"{timed[name]['glue']:>8.2f} {timed[name]['probes']:>8.2f} {sum(timed[name].values()):>8.2f}"
        )
    hours = sum(sum(timed[run.arm.name].values()) for run in left) / 60
    lines.append(
        f"this shard's runs left, timed: {hours:.2f} CPU-hours of training, evaluation, GLUE and probes (a "
        f"shared machine runs slower); timed / FLOP estimate over the arms: {flop_ratios(timed, estimated)}"
    )
    return lines


def flop_ratios(timed: dict[str, dict], estimated: dict[str, dict]) -> str:
    """ "training 11.2x, GLUE 3.1x, probes 2.0x, all 8.0x": how far the FLOP estimate is from the timed probe."""
    parts = {"training": "train", "GLUE": "glue", "probes": "probes"}
    ratios = []
    for label, part in [*parts.items(), ("all", None)]:
        numerator = sum(times[part] if part else sum(times.values()) for times in timed.values())
        denominator = sum(costs[part] if part else sum(costs.values()) for costs in estimated.values())
        ratios.append(f"{label} {numerator / denominator:.1f}x" if denominator else f"{label} -")
    return ", ".join(ratios)
