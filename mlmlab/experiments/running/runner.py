"""Running a study: every (seed, arm) pair is one run, evaluated and recorded as one row of results.jsonl.

Each run trains (the Trainer resumes an interrupted run from its checkpoints), takes the
trainer's final held-out evaluation (fixed uniform masks, the same for every arm),
fine-tunes on a GLUE subset, runs the study's frozen linear probes and appends one row.
A run whose key is already in results.jsonl is skipped, so rerunning an interrupted
study finishes it. The study file itself is read by ``experiments/study.py``.
"""

import copy
import dataclasses
import hashlib
import json
import math
import re
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

import torch

import mlmlab
from mlmlab.config import Config, DataConfig, config_hash, config_text, from_dict, set_dotted, to_dict
from mlmlab.data.resolve import check_held_out_data, dataset_hashes
from mlmlab.errors import UserError
from mlmlab.evaluate.glue import run_glue
from mlmlab.evaluate.glue_settings import resolve_task_names
from mlmlab.evaluate.held_out import evaluate_model
from mlmlab.evaluate.linear_probe import check_task_files, run_probes
from mlmlab.evaluate.perplexity import evaluate_mlm
from mlmlab.evaluate.recalibrate import recalibrated_loss
from mlmlab.experiments.budget import apply_budget, run_cost
from mlmlab.experiments.gates import describe, gate_results
from mlmlab.experiments.results import PREREGISTRATION, PREREGISTRATION_SHA256, RESULTS_FILE, STUDY_IDENTITY, read_rows
from mlmlab.experiments.running.downstream import check_positions
from mlmlab.experiments.running.identity import (
    config_changes,
    identity_changes,
    identity_hash,
    settings_of,
    study_identity,
)
from mlmlab.experiments.screen import screen_pick
from mlmlab.experiments.study import Arm, Study
from mlmlab.model.architectures import check_config
from mlmlab.model.folder import is_model_folder, load_pretrained
from mlmlab.train.loop import Trainer
from mlmlab.train.optim import refuse_warmup_without_decay
from mlmlab.train.run_folder import complete_checkpoints, step_of
from mlmlab.utils import jsonio
from mlmlab.utils.allocator import release_freed_memory
from mlmlab.utils.files import WriterLock


@dataclass(frozen=True)
class Run:
    index: int  # position in the study's run order (seed-major), which --shard partitions
    arm: Arm
    seed: int
    config: Config  # resolved: budget applied, seeds set, train.out_dir = the run folder
    cost: dict  # budget.run_cost
    config_hash: str  # of the whole config without its folder
    datasets: dict  # {"train": hash, "valid": hash} of the prepared data
    key: str  # arm/seed/identity.identity_hash: a row with this key means "done"


# ----- from a study to runs ----------------------------------------------------------------
def arm_config(study: Study, arm: Arm) -> Config:
    """The arm's validated config before seeds and budget: base + the arm's dotted overrides."""
    tree = copy.deepcopy(study.base)
    try:
        for key, value in arm.overrides.items():
            set_dotted(tree, key, value)
        cfg = from_dict(tree)
        check_config(cfg)
        return cfg
    except UserError as err:
        raise UserError(f"arm {arm.name!r}: {err}") from None


def plan_runs(study: Study) -> list[Run]:
    """Every run of the study, seed-major (so an interrupted study has all arms of its first seeds)."""
    configs = {arm.name: arm_config(study, arm) for arm in study.arms}
    reference = configs[study.baseline]
    budgeted = {arm.name: apply_budget(configs[arm.name], reference, arm.budget or study.budget) for arm in study.arms}
    _refuse_duplicate_arms(budgeted)
    for name, cfg in budgeted.items():  # what each run's Trainer would refuse, refused before the first one trains
        try:
            refuse_warmup_without_decay(cfg.train)
        except UserError as err:
            raise UserError(f"arm {name!r}: {err}") from None
    pairs = [
        (seed, arm) for seed in seed_order(study) for arm in study.arms if runs_seed(study, arm.name, seed) is not False
    ]
    return [_run(study, index, arm, seed, budgeted[arm.name]) for index, (seed, arm) in enumerate(pairs)]


def seed_order(study: Study) -> list[int]:
    """The study's seeds, a screen's first: the pick is known once they are in."""
    screen = study.screen.seeds if study.screen else ()
    return [seed for seed in study.seeds if seed in screen] + [seed for seed in study.seeds if seed not in screen]


def runs_seed(study: Study, arm: str, seed: int) -> bool | None:
    """Whether ``arm`` runs ``seed``: every arm every seed without a screen; None where the screen's pick decides."""
    return True if study.screen is None else study.screen.runs_seed(arm, seed)


def waits_on_screen(run: Run, study: Study, rows: list[dict]) -> str | None:
    """Why ``run`` does not run now (a candidate's seed past the screen's), or None when it runs."""
    if runs_seed(study, run.arm.name, run.seed) is not None:
        return None
    pick = screen_pick(study.screen, rows, study.decision.metric, study.decision.lower_is_better)
    if pick is None:
        return "waits on the screen: the pick among its candidates is made once all their screen runs are in"
    return None if pick == run.arm.name else f"not run: the screen picked {pick}"


def runs_to_cost(runs: list[Run], study: Study, rows: list[dict]) -> list[Run]:
    """The runs that will run: a candidate's seeds past the screen's only for the pick, or, before it is known,
    for the dearest candidate (a dry run's upper bound)."""
    waiting = [run for run in runs if waits_on_screen(run, study, rows) is not None]
    if not waiting or screen_pick(study.screen, rows, study.decision.metric, study.decision.lower_is_better):
        return [run for run in runs if run not in waiting]
    dearest = max(waiting, key=lambda run: run.cost["flops"]).arm.name
    return [run for run in runs if run not in waiting or run.arm.name == dearest]


@lru_cache(maxsize=None)
def _dataset_hashes(data_json: str, init: str) -> dict:
    """Arms mostly share one data section: hash its corpus files once per process."""
    return dataset_hashes(DataConfig(**json.loads(data_json)), model_dir=init)


def _refuse_duplicate_arms(configs: dict[str, Config]) -> None:
    """Two arms with one config would spend the compute twice and split one result in two."""
    seen = {}
    for name, cfg in configs.items():
        text = config_text(cfg)
        if text in seen:
            raise UserError(f"arms {seen[text]!r} and {name!r} resolve to the same config; drop one")
        seen[text] = name


def _run(study: Study, index: int, arm: Arm, seed: int, cfg: Config) -> Run:
    cfg = dataclasses.replace(
        cfg,
        masking=dataclasses.replace(cfg.masking, seed=seed),
        train=dataclasses.replace(cfg.train, seed=seed, out_dir=""),
    )
    datasets = _dataset_hashes(json.dumps(dataclasses.asdict(cfg.data), sort_keys=True), cfg.train.init)
    identity = identity_hash(cfg, study.explicit | set(arm.overrides), datasets, settings_of(study))
    run_dir = Path(study.out_dir) / "runs" / arm.name / f"seed{seed}"
    placed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(run_dir)))
    return Run(index, arm, seed, placed, run_cost(cfg), config_hash(cfg), datasets, f"{arm.name}/seed{seed}/{identity}")


def parse_shard(text: str | None) -> tuple[int, int]:
    """ "i/n" -> (i, n): this machine runs the runs whose index % n == i (i counts from 0)."""
    if text is None:
        return 0, 1
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match or not int(match[1]) < int(match[2]):
        raise UserError(f"--shard {text!r} must be i/n with 0 <= i < n, e.g. --shard 0/4")
    return int(match[1]), int(match[2])


def parse_only(specs: list[str] | None, study: Study) -> tuple[tuple[str, int | None], ...]:
    """--only values, "ARM" (its every seed) or "ARM/seedN", as (arm, seed or None); an arm or seed the study
    lacks is a UserError naming what it has."""
    arms = [arm.name for arm in study.arms]
    chosen = []
    for spec in specs or ():
        match = re.fullmatch(r"(.*?)(?:/seed(\d+))?", spec.strip())
        arm, seed = match[1], None if match[2] is None else int(match[2])
        if arm not in arms:
            raise UserError(f"--only {spec!r}: the study has no arm {arm!r}; its arms are {', '.join(arms)}")
        if seed is not None and seed not in study.seeds:
            raise UserError(
                f"--only {spec!r}: the study has no seed {seed}; its seeds are "
                f"{', '.join(map(str, study.seeds))} (ARM/seedN)"
            )
        chosen.append((arm, seed))
    return tuple(chosen)


def only_runs(runs: list[Run], only: tuple[tuple[str, int | None], ...]) -> list[Run]:
    """The runs --only names, in their order; all of them when it names none."""
    return [
        run for run in runs if not only or any(run.arm.name == arm and seed in (None, run.seed) for arm, seed in only)
    ]


def shard_runs(runs: list[Run], shard: tuple[int, int], gate_arm: str | None = None) -> list[Run]:
    """This shard's runs, in the order they run: every n-th of the study's order, the gate arm's runs first
    (then seed-major), so that every shard holds a share of the gate arm. By index alone, a study of 6 arms
    in 2 shards put each dynamic run in shard 0, and shard 1 waited on gates it could not help pass."""
    i, n = shard
    return sorted(runs, key=lambda run: run.arm.name != gate_arm)[i::n]


# ----- running -----------------------------------------------------------------------------
def finished_rows(results: Path) -> list[dict]:
    """The rows already written; a line cut short by a crash is ignored (that run reruns)."""
    return read_rows(results)[0]


def refuse_incomparable(runs: list[Run], rows: list[dict]) -> None:
    """Stop before a new run would sit beside finished ones made with other settings or data (identity.py)."""
    planned = {(run.arm.name, run.seed): run for run in runs}
    for row in rows:
        run = planned.get((row.get("arm"), row.get("seed")))
        if run is None:  # an arm the study no longer has, or another shard's seed
            continue
        if "datasets" not in row and row["key"] != run.key:  # written before keys held the data's hashes
            raise UserError(
                f"{row['arm']} seed {row['seed']} in results.jsonl was written by an mlmlab older than run keys with "
                "data hashes (2026-11-30), so no run can be matched to it; rerun the study into a new folder: "
                f"mlmlab study {row.get('study_source', 'STUDY')} --out {row.get('out_dir', 'studies/STUDY')}-rerun"
            )
        changes = config_changes(row.get("config") or {}, to_dict(run.config))
        if row.get("datasets") not in (None, run.datasets):
            changes.append(f"prepared data {row['datasets']} -> {run.datasets}")
        if changes:
            raise UserError(
                f"{row['arm']} seed {row['seed']} in results.jsonl was made with other settings or data than this "
                f"study now gives ({'; '.join(changes[:3])}); set the old values under the study's pinned: (it keeps "
                "run keys) so old and new runs stay comparable, or start a new study with --out"
            )
        if row["key"] != run.key:
            raise UserError(
                f"{row['arm']} seed {row['seed']} in results.jsonl has another key than this study now gives it "
                "(its preset or base gained or lost a key, or its GLUE, probe or eval_data settings changed); a key "
                "that only restates the finished runs' value belongs under pinned:, anything else needs a new study "
                "(--out)"
            )


def preregistration_sha256(study: Study) -> str | None:
    """The sha256 of the study folder's preregistration.md, or None where it has none."""
    path = Path(study.out_dir) / PREREGISTRATION
    if path.is_dir():  # not "gone", nor absent: a folder stands where the file was
        raise UserError(
            f"{path} is a folder, not the pre-registration file; put the file back (git checkout -- {path})"
        )
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def study_record(study: Study, rows: list[dict]) -> dict:
    """What the next row records of its study, refused where ``rows`` (those already in results.jsonl) recorded
    otherwise: the study's identity and its pre-registration's hash."""
    identity = check_study_identity(study, rows)
    return {STUDY_IDENTITY: identity, PREREGISTRATION_SHA256: check_preregistration(study, rows)}


def check_study_identity(study: Study, rows: list[dict]) -> dict:
    """The study's identity for the next row (identity.study_identity), refused where the rows are another study's
    or recorded another identity: rows are compared under one rule only while the arms, seeds, budgets, screen,
    rule and gates they were made under stay as they were. Compared with the rows that record it (rows of an mlmlab
    from before it was recorded stand beside later ones)."""
    results = Path(study.out_dir) / RESULTS_FILE
    other = next((row["study"] for row in rows if row.get("study", study.name) != study.name), None)
    if other is not None:
        raise UserError(
            f"{results} holds rows of study {other!r}, not of {study.name!r} (the study file's name:, or its file's "
            "name): two studies' rows would be compared as one; give this study its own folder (--out), or name it "
            "as its rows do"
        )
    current = study_identity(study)
    recorded = next((row[STUDY_IDENTITY] for row in rows if row.get(STUDY_IDENTITY)), None)
    if recorded is not None and recorded["sha256"] != current["sha256"]:
        raise UserError(
            f"the study file's {' and '.join(identity_changes(recorded, current))} changed since the first row of "
            f"{results} was made: its rows are one study's only while these stay as they were; restore them "
            f"(git diff {study.source}) and write afterthoughts in the study's README.md, or start a new study with "
            "--out"
        )
    return current


def check_preregistration(study: Study, rows: list[dict]) -> str | None:
    """The pre-registration's hash for the next row, refused once it differs from the first row's: a rule written
    before the runs is only that while it cannot move under them (corrections go in the study's README.md). A
    pre-registration that appears after rows that recorded none is refused too: it was written after results."""
    current = preregistration_sha256(study)
    recorded = next((row[PREREGISTRATION_SHA256] for row in rows if row.get(PREREGISTRATION_SHA256)), None)
    path = Path(study.out_dir) / PREREGISTRATION
    if recorded is None and current is not None and rows:
        raise UserError(
            f"{path} appeared after the study's first rows, which record no pre-registration: a rule written after "
            "results is not a pre-registration; move it into the study's README.md as an afterthought, or start a "
            "new study with --out whose pre-registration comes before its first row"
        )
    if recorded is not None and current != recorded:
        now = "is gone" if current is None else f"hashes to {current[:12]}"
        raise UserError(
            f"{path} {now}, not {recorded[:12]} as the study's first row recorded: a pre-registration "
            f"never changes once runs are in; restore it (git checkout -- {path}) and write corrections "
            "in the study's README.md"
        )
    return current


def train_run(cfg: Config, show_progress: bool) -> tuple[dict, float, float]:
    """Train (or resume) one run: the trainer's summary, its final held-out evaluation with the prior-free
    loss added (eval.recalibrated), the seconds spent scoring for ADM, and the seconds the prior-free loss took
    (after training: not in the summary's wall_seconds)."""
    trainer = Trainer(cfg, evaluator=evaluate_mlm, show_progress=show_progress)
    summary = trainer.train()
    trained = time.perf_counter()
    model, _ = load_pretrained(Path(cfg.train.out_dir) / "model")  # the saved model: whole on every process
    summary["eval"]["recalibrated"] = recalibrated_loss(
        model,
        trainer.valid_store,
        trainer.masker.info,
        batch_size=cfg.train.eval_batch_size,
        max_batches=cfg.train.eval_batches,
        token_counts=trainer.train_store.token_counts,
        freq_cuts=cfg.masking.freq_cuts,
    )
    scorer_seconds = float(getattr(trainer.masker.strategy, "score_seconds_total", 0.0))
    return summary, scorer_seconds, time.perf_counter() - trained


def glue_for(run: Run, study: Study, show_progress: bool) -> dict:
    """GLUE dev scores of the run's model, or {"skipped": why}."""
    settings = study.glue
    if not settings.tasks:
        return {"skipped": "no GLUE tasks in the study"}
    run_dir = Path(run.config.train.out_dir)
    result = run_glue(run_dir / "model", settings, study.glue_dir, run_dir / "glue", show_progress=show_progress)
    tasks = {
        name: {"score": task["score"], "dev": task["dev"]}
        for name, task in result["tasks"].items()
        if task["status"] == "ok"
    }
    missing = [name for name, task in result["tasks"].items() if task["status"] != "ok"]
    if missing:  # an average over the other tasks is another figure than the study's: none, and the row is unfinished
        return {"average": None, "tasks": tasks, "missing": missing}
    return {"average": result["average"], "tasks": tasks}


def probe_for(run: Run, study: Study, show_progress: bool) -> dict:
    """The study's linear probes of the run's model: {"pooling", "tasks", "average_gain", "seconds"}, or {"skipped"}."""
    settings = study.probe
    if settings is None:
        return {"skipped": "no probe block in the study"}
    run_dir = Path(run.config.train.out_dir)
    result = run_probes(
        run_dir / "model",
        settings.tasks,
        study.glue_dir,
        poolings=[settings.pooling],
        seed=settings.seed,
        random_inits=settings.random_inits,
        out_dir=run_dir / "probe",
        show_progress=show_progress,
    )
    return {"pooling": settings.pooling, **result["poolings"][settings.pooling], "seconds": result["seconds"]}


def held_out_reports(run: Run, study: Study, show_progress: bool) -> dict:
    """The study's further held-out sets (eval_data), each evaluated with the same fixed masks as training's."""
    cfg, reports = run.config, {}
    for name, paths in study.eval_data.items():  # check_study_inputs found every path before the first run
        reports[name] = evaluate_model(
            Path(cfg.train.out_dir) / "model",
            paths,
            batch_size=cfg.train.eval_batch_size,
            max_seq_length=cfg.data.max_seq_length,
            freq_cuts=cfg.masking.freq_cuts,
            recalibrate=True,
            show_progress=show_progress,
        )
    return reports


def make_row(
    run: Run,
    study: Study,
    summary: dict,
    scorer_seconds: float,
    evaluations: dict,
    evaluation_seconds: float,
    record: dict,
) -> dict:
    """The run's row; ``record``: what it records of its study (study_record)."""
    cfg = run.config
    return {
        "key": run.key,
        "study": study.name,
        STUDY_IDENTITY: record[STUDY_IDENTITY],
        "study_source": study.source,
        "out_dir": study.out_dir,
        "arm": run.arm.name,
        "arm_index": [arm.name for arm in study.arms].index(run.arm.name),
        "overrides": run.arm.overrides,
        "seed": run.seed,
        "baseline": study.baseline,
        "budget": run.arm.budget or study.budget,
        **{k: run.cost[k] for k in ("steps", "sequences_per_step", "flops", "flops_per_step", "scorer_share")},
        "tokens_seen": summary["tokens_seen"],  # non-padding tokens actually trained on
        "train_seconds": summary["train_seconds"],  # scoring included (it happens inside the step)
        "scorer_seconds": scorer_seconds,
        # Training (every process that worked on the run: resumes count), then the prior-free loss, the held-out
        # sets, GLUE and probes.
        "wall_seconds": summary["wall_seconds"] + evaluation_seconds,
        "torch_threads": torch.get_num_threads(),  # the seconds above depend on it (and on runs sharing the cores)
        "eval": summary["eval"],
        **evaluations,  # "eval_data", "glue" and "probe"
        "run_dir": str(Path(cfg.train.out_dir).relative_to(study.out_dir)),  # relative to results.jsonl
        "config_hash": run.config_hash,
        "datasets": run.datasets,
        "gates": {"arm": study.gates.arm, "min": study.gates.minimum} if study.gates else None,
        "decision": dataclasses.asdict(study.decision) if study.decision else None,  # the report applies it
        PREREGISTRATION_SHA256: record[PREREGISTRATION_SHA256],  # of preregistration.md as the run ended
        "config": to_dict(cfg),
        "mlmlab_version": mlmlab.__version__,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


# A trained run's measurements of its model folder, by the row key each fills, in their order (probes after GLUE).
MEASUREMENTS = {"eval_data": held_out_reports, "glue": glue_for, "probe": probe_for}


def execute(run: Run, study: Study, results: Path, show_progress: bool) -> dict:
    summary, scorer_seconds, refit_seconds = train_run(run.config, show_progress)
    trained = time.perf_counter()
    evaluations = {key: measure(run, study, show_progress) for key, measure in MEASUREMENTS.items()}
    record = study_record(study, finished_rows(results))  # the rows may have moved while this run trained
    evaluation_seconds = refit_seconds + time.perf_counter() - trained
    row = make_row(run, study, summary, scorer_seconds, evaluations, evaluation_seconds, record)
    append_row(results, row)
    return row


def missing_measurements(row: dict, study: Study) -> list[str]:
    """The row keys (eval_data, glue, probe) of the measurements the study asks for that ``row`` lacks, in whole or
    in part: a set or task skipped, missing or never measured (a row written before the study asked for it)."""
    held_out = row.get("eval_data") or {}
    glue, probe = row.get("glue") or {}, row.get("probe") or {}
    lacking = {
        "eval_data": any("mlm_loss" not in (held_out.get(name) or {}) for name in study.eval_data),
        "glue": bool(study.glue.tasks)
        and (
            glue.get("average") is None or bool(set(resolve_task_names(study.glue.tasks)) - set(glue.get("tasks", {})))
        ),
        "probe": study.probe is not None and probe.get("average_gain") is None,
    }
    return [key for key in MEASUREMENTS if lacking[key]]


def complete_row(run: Run, study: Study, results: Path, row: dict, lacking: list[str], show_progress: bool) -> dict:
    """``row`` with the measurements it lacks taken from the run's model folder (no training), appended as the run's
    row: the last row of a key is the one that counts (results.read_rows)."""
    started = time.perf_counter()
    evaluations = {key: MEASUREMENTS[key](run, study, show_progress) for key in lacking}
    study_record(study, finished_rows(results))
    completed = {
        **row,
        **evaluations,
        "wall_seconds": row["wall_seconds"] + time.perf_counter() - started,
        "completed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    append_row(results, completed)
    return completed


def append_row(results: Path, row: dict) -> None:
    """One write per row, so shards appending to one local file never interleave; after a line cut short
    (a crash mid-write) the row starts a new line, or it would be lost with the cut one."""
    line = (jsonio.dumps(row) + "\n").encode()
    with open(results, "ab+") as handle:  # appends go to the end whatever was read
        size = handle.seek(0, 2)
        if size:
            handle.seek(size - 1)
            if handle.read(1) != b"\n":
                line = b"\n" + line
        handle.write(line)


def run_study(
    study: Study,
    shard: tuple[int, int] = (0, 1),
    show_progress: bool = True,
    log=print,
    only: tuple[tuple[str, int | None], ...] = (),
    time_limit: float = 0.0,
) -> list[dict]:
    """Run this shard's unfinished runs (of those ``only`` names: parse_only), the gate arm's first; return the
    rows written. ``time_limit`` > 0: minutes from now in which a run must finish to be started (not_in_time).

    One process per shard of a study folder: shards append to one results.jsonl side by side, but
    another process on the same shard (another study, or the same one started twice) is refused; two
    that reach the same run are kept apart by the run folder's own lock.
    """
    deadline = time.monotonic() + 60 * time_limit if time_limit > 0 else math.inf
    with results_lock(study, shard, only):
        return _run_shard(study, shard, only, deadline, show_progress, log)


def results_lock(study: Study, shard: tuple[int, int], only: tuple[tuple[str, int | None], ...] = ()) -> WriterLock:
    i, n = shard
    results = Path(study.out_dir) / RESULTS_FILE
    named = "".join(f".{arm}" + ("" if seed is None else f"-seed{seed}") for arm, seed in only)
    return WriterLock(
        results.parent / f".{RESULTS_FILE}.shard-{i}-of-{n}{named}.lock",
        f"{results} (shard {i}/{n})",
        "give this study another --out",
    )


def _run_shard(
    study: Study, shard: tuple[int, int], only: tuple, deadline: float, show_progress: bool, log
) -> list[dict]:
    planned = plan_runs(study)
    check_study_inputs(study, planned)
    results = Path(study.out_dir) / RESULTS_FILE
    results.parent.mkdir(parents=True, exist_ok=True)
    refuse_incomparable(planned, finished_rows(results))
    gate_arm = study.gates.arm if study.gates else None
    runs = only_runs(shard_runs(planned, shard, gate_arm), only)
    rows = []
    for number, run in enumerate(runs, 1):
        label = f"[{number}/{len(runs)}] {run.arm.name} seed {run.seed}"
        finished = finished_rows(results)  # read anew before each run: other shards append to it
        done = next((row for row in finished if row["key"] == run.key), None)
        lacking = missing_measurements(done, study) if done is not None else []
        if done is not None and not lacking:
            log(f"{label}: already in {results}, skipped")
            continue
        study_record(study, finished)
        release_freed_memory()  # what the runs before this one freed: the tuned heap would keep it (allocator.py)
        model = Path(run.config.train.out_dir) / "model"
        if lacking and is_model_folder(model):
            log(f"{label}: its row lacks {', '.join(lacking)}; measuring it on {model} (no training)")
            rows.append(complete_row(run, study, results, done, lacking, show_progress))
            continue
        if gate_arm is not None and run.arm.name != gate_arm:
            check_gates(study, planned, finished, log)
        if waiting := waits_on_screen(run, study, finished):
            log(f"{label}: {waiting}")
            continue
        too_long = not_in_time(run, finished, deadline)
        if too_long:
            log(f"{label}: not started, {too_long}")
            continue
        log(
            f"{label}: {run.cost['steps']} steps of batch {run.cost['sequences_per_step']} "
            f"-> {run.config.train.out_dir}"
        )
        row = execute(run, study, results, show_progress)
        glue, gain = row["glue"].get("average"), row["probe"].get("average_gain")
        log(
            f"{label}: perplexity {row['eval']['perplexity']:.2f}"
            + (
                f", GLUE {100 * glue:.1f}"
                if glue is not None
                else f" ({row['glue'].get('skipped', 'GLUE incomplete')})"
            )
            + (f", probe gain {100 * gain:+.1f}" if gain is not None else "")
            + f", {row['wall_seconds'] / 60:.1f} min"
        )
        if lacking := missing_measurements(row, study):
            log(f"{label}: its row lacks {', '.join(lacking)} (see the row); a rerun measures it without training")
        rows.append(row)
    log(f"{len(rows)} runs finished, {len(runs) - len(rows)} skipped; results in {results}")
    return rows


def not_in_time(run: Run, rows: list[dict], deadline: float) -> str:
    """Why ``run`` would not finish before ``deadline`` (time.monotonic()), or "": it would, or nothing says how long
    it takes (no finished run in the study). A run cut short loses what its checkpoints do not hold, and all of it on
    a machine that is not there next time: a walltime-limited job on a cluster or a session of a few hours needs
    this. The estimate, less what the run's checkpoint has done, is expected_seconds'."""
    expected = expected_seconds(run, rows)
    left = deadline - time.monotonic()
    if expected is None or math.isinf(left):
        return ""
    seconds, basis = expected
    saved = complete_checkpoints(Path(run.config.train.out_dir), check=False)
    done = step_of(saved[-1]) / run.cost["steps"] if saved else 0.0
    needed = seconds * (1 - done)
    if needed <= left:
        return ""
    return (
        f"~{needed / 60:.0f} min ({basis}"
        + (f", less the {done:.0%} its checkpoint holds" if done else "")
        + f") and {max(left, 0) / 60:.0f} min left of --time-limit"
    )


def expected_seconds(run: Run, rows: list[dict]) -> tuple[float, str] | None:
    """(seconds, what they are based on) that ``run`` should take from start to row, or None: no run finished.
    Its arm's finished runs if any (their median wall time); else its FLOPs at the median seconds per FLOP of the
    study's finished runs (the arm's scorer passes counted: an ADM arm's first run is not started in a
    dynamic run's time)."""
    walls = [row["wall_seconds"] for row in rows if row.get("arm") == run.arm.name and "wall_seconds" in row]
    if walls:
        return statistics.median(walls), f"the median of its arm's {len(walls)} finished runs"
    paces = [row["wall_seconds"] / row["flops"] for row in rows if "wall_seconds" in row and row.get("flops")]
    if paces:
        return (
            statistics.median(paces) * run.cost["flops"],
            f"its {run.cost['flops']:.3g} FLOPs at the median pace of the study's {len(paces)} finished runs",
        )
    return None


def check_study_inputs(study: Study, planned: list[Run]) -> None:
    """Every file the study names (GLUE and probe tasks' train and dev files, further held-out sets), before any
    training: a row lacking one of its measurements would count as finished, and a rerun would never add it."""
    check_positions(study, {run.arm.name: run.config for run in planned})
    for what, tasks, drop in (
        ("fine-tunes on", resolve_task_names(study.glue.tasks) if study.glue.tasks else [], "glue: {tasks: []}"),
        ("probes", study.probe.tasks if study.probe else [], "drop probe:"),
    ):
        if not tasks:
            continue
        if not (study.glue_dir and Path(study.glue_dir).is_dir()):
            raise UserError(
                f"the study {what} {', '.join(tasks)} but glue_dir {study.glue_dir!r} is not a folder; set "
                f"glue_dir to the folder holding the tasks' folders (SST-2/, ...), or {drop}"
            )
        check_task_files(tasks, Path(study.glue_dir))
    for name, paths in study.eval_data.items():
        try:
            check_held_out_data(paths, {run.config.data.objective for run in planned})
        except UserError as err:
            raise UserError(
                f"the study's eval_data {name!r}: {err} (paths are relative to where the command runs); fix it, or "
                "remove the set before the first run"
            ) from None


def check_gates(study: Study, planned: list[Run], rows: list[dict], log=print) -> None:
    """Refuse to run other arms until every run of the gate arm is in and its means pass the gates."""
    gate_keys = {run.key for run in planned if run.arm.name == study.gates.arm}
    gate_rows = [row for row in rows if row["key"] in gate_keys]
    if len(gate_rows) < len(gate_keys):
        raise UserError(
            f"the validity gates need every run of arm {study.gates.arm!r} first ({len(gate_rows)} of "
            f"{len(gate_keys)} are in); run the shard(s) that hold them"
        )
    results = gate_results(study.gates.minimum, gate_rows)
    if any(math.isnan(result["mean"]) for result in results):
        raise UserError(
            f"validity gates of {study.gates.arm} cannot be checked: {describe(results)} in its rows "
            "(GLUE or a held-out set was skipped); see the rows' glue and eval_data entries"
        )
    if not all(result["held"] for result in results):
        raise UserError(
            f"validity gates failed on {study.gates.arm} (means of {len(gate_rows)} seeds): "
            f"{describe(results)}; raise the budget (base train.max_steps) in a new study out_dir"
        )
    log(f"validity gates held on {study.gates.arm}: {describe(results)}")
