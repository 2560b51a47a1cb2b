"""Studies: a grid of pretraining runs, each evaluated and recorded as one row of results.jsonl.

A study file (YAML; presets in configs/studies/) holds a base run config, named arms
(dotted overrides of that base), optional grid blocks that generate arms, and seeds.
Every (seed, arm) pair is one run: train (the Trainer resumes an interrupted run from its
checkpoints), take the trainer's final held-out evaluation (fixed uniform masks, the same
for every arm), fine-tune on a GLUE subset, append one row. A run whose key is already in
results.jsonl is skipped, so rerunning an interrupted study finishes it.

    name: my-study                    # default: the file name
    preset: tiny                      # optional model/config preset the base starts from
    base: {model: {...}, train: {max_steps: 300}, ...}   # same sections as a run config
    arms:
      - {name: dynamic, masking.strategy: dynamic}
      - {name: adm, masking.strategy: adaptive, masking.scorer: entropy}
    grid:                             # optional; each block: cartesian product of `vary`
      - {prefix: adm, fixed: {masking.strategy: adaptive}, vary: {masking.a_max: [0.25, 0.5]}}
    seeds: [0, 1, 2]                  # each sets train.seed and masking.seed
    budget: token-matched             # or compute-matched (see budget.py)
    baseline: dynamic                 # the arm every other is compared with
    glue: {tasks: [RTE, MRPC], seeds: [0], learning_rates: [1.0e-4]}   # tasks: [] skips GLUE
    glue_dir: ../shared/data/glue     # skipped, with a note in the row, when absent
    out_dir: studies/my-study         # default: studies/<name>
"""

import copy
import dataclasses
import hashlib
import itertools
import json
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path


import mlmlab
from mlmlab import jsonio
from mlmlab.config import Config, read_yaml, set_dotted, config_text, from_dict, load_config, to_dict
from mlmlab.errors import UserError
from mlmlab.experiments.budget import BUDGETS, apply_budget, run_cost

STUDY_DIR = Path(__file__).resolve().parent.parent / "configs" / "studies"
STUDY_KEYS = ("name", "description", "preset", "base", "arms", "grid", "seeds", "budget", "baseline", "glue",
              "glue_dir", "out_dir")
GRID_KEYS = ("prefix", "fixed", "vary")
# Set by the study itself (seeds, budget, run folders), never by an arm.
RESERVED = {"train.seed": "seeds:", "masking.seed": "seeds:", "train.out_dir": "the study's out_dir",
            "train.max_steps": "base: (the budget derives every arm's steps from it)"}
ARM_NAME = re.compile(r"^[A-Za-z0-9._=+-]+$")  # names become folder names
RESULTS_FILE = "results.jsonl"


@dataclass(frozen=True)
class GlueSettings:
    """Arguments of evaluate.glue.run_glue; None keeps that module's per-task default."""

    tasks: list = field(default_factory=list)  # empty: no GLUE
    seeds: list = field(default_factory=lambda: [0])
    learning_rates: list | None = None
    epochs: int | None = None
    batch_size: int | None = None
    max_length: int | None = None
    max_train_examples: int | None = None  # fine-tune on the first N examples only (CPU budgets)


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: dict  # dotted key -> value, over the study's base


@dataclass
class Study:
    name: str
    source: str  # as given on the command line: the report repeats it in its commands
    base: dict  # the full config tree every arm starts from
    arms: list[Arm]
    seeds: list[int]
    budget: str
    baseline: str
    glue: GlueSettings
    glue_dir: str
    out_dir: str


@dataclass(frozen=True)
class Run:
    index: int  # position in the study's run order (seed-major), which --shard partitions
    arm: Arm
    seed: int
    config: Config  # resolved: budget applied, seeds set, train.out_dir = the run folder
    cost: dict  # budget.run_cost
    config_hash: str  # of the config without its folder
    key: str  # arm/seed/hash of (config, GLUE settings): a row with this key means "done"


# ----- reading a study ---------------------------------------------------------------------
def study_path(source: str) -> Path:
    path = Path(source)
    if path.is_file():
        return path
    preset = STUDY_DIR / f"{source}.yaml"
    if preset.is_file():
        return preset
    names = ", ".join(sorted(p.stem for p in STUDY_DIR.glob("*.yaml")))
    raise UserError(f"no study file or study preset named {source!r}; presets: {names}")


def load_study(source: str, out_dir: str | None = None) -> Study:
    path = study_path(source)
    tree = read_yaml(str(path))
    if not isinstance(tree, dict):
        raise UserError(f"{path} must be a mapping with keys {', '.join(STUDY_KEYS)}")
    _refuse_unknown(tree, STUDY_KEYS, f"study key in {path.name}")
    name = str(tree.get("name") or path.stem)
    arms = [_named_arm(item) for item in _list(tree, "arms")]
    arms += [arm for block in _list(tree, "grid") for arm in grid_arms(block)]
    study = Study(
        name=name, source=source, base=_base_tree(tree), arms=arms, seeds=_seeds(tree.get("seeds", [0])),
        budget=tree.get("budget", "token-matched"), baseline=tree.get("baseline", "dynamic"),
        glue=_glue_settings(tree.get("glue") or {}), glue_dir=str(tree.get("glue_dir") or ""),
        out_dir=out_dir or str(tree.get("out_dir") or f"studies/{name}"),
    )
    _check_study(study)
    return study


def _refuse_unknown(mapping: dict, valid, what: str) -> None:
    unknown = sorted(set(mapping) - set(valid), key=str)
    if unknown:
        raise UserError(f"unknown {what} {unknown[0]!r}; valid keys: {', '.join(valid)}")


def _list(tree: dict, key: str) -> list:
    value = tree.get(key) or []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise UserError(f"study key '{key}' must be a list of mappings")
    return value


def _named_arm(item: dict) -> Arm:
    overrides = {k: v for k, v in item.items() if k != "name"}
    if "name" not in item:
        raise UserError(f"an arm has no name: {overrides}; add name: <arm name>")
    return Arm(str(item["name"]), overrides)


def grid_arms(block: dict) -> list[Arm]:
    """One arm per combination of the block's `vary` values, named prefix-key=value-..."""
    _refuse_unknown(block, GRID_KEYS, "grid block key")
    vary, fixed = block.get("vary") or {}, block.get("fixed") or {}
    if not isinstance(vary, dict) or not vary or not all(isinstance(v, list) and v for v in vary.values()):
        raise UserError("a grid block needs vary: {section.key: [value, ...], ...} with non-empty lists")
    if not isinstance(fixed, dict):
        raise UserError("a grid block's fixed: must map section.key to a value")
    arms = []
    for values in itertools.product(*vary.values()):
        chosen = dict(zip(vary, values))
        label = "-".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in chosen.items())
        name = f"{block['prefix']}-{label}" if block.get("prefix") else label
        arms.append(Arm(name, {**fixed, **chosen}))
    return arms


def _base_tree(tree: dict) -> dict:
    """Defaults < preset < base: as a full config tree that arms override."""
    base = tree.get("base") or {}
    if not isinstance(base, dict) or not all(isinstance(v, dict) for v in base.values()):
        raise UserError("study key 'base' must map sections (model, data, masking, train) to mappings")
    full = to_dict(load_config(tree.get("preset")))
    for section, values in base.items():
        for key, value in values.items():
            _check_reserved(f"{section}.{key}", "base", allow_steps=True)
            set_dotted(full, f"{section}.{key}", value)
    return full


def _check_reserved(key: str, where: str, allow_steps: bool = False) -> None:
    if key in RESERVED and not (allow_steps and key == "train.max_steps"):
        raise UserError(f"{where} sets {key}, which the study sets itself from {RESERVED[key]}; remove it")


def _seeds(value) -> list[int]:
    integers = isinstance(value, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in value)
    if not integers or not value or len(set(value)) != len(value):
        raise UserError(f"study key 'seeds' must be a non-empty list of distinct integers, got {value!r}")
    return value


def _glue_settings(value) -> GlueSettings:
    if not isinstance(value, dict):
        raise UserError("study key 'glue' must be a mapping, e.g. {tasks: [RTE, MRPC], seeds: [0]}")
    _refuse_unknown(value, [f.name for f in dataclasses.fields(GlueSettings)], "glue key")
    try:  # YAML 1.1 reads 1e-4 (no dot) as a string
        rates = value.get("learning_rates")
        settings = GlueSettings(**{**value, "learning_rates": None if rates is None else [float(r) for r in rates]})
    except (TypeError, ValueError):
        raise UserError(f"glue learning_rates must be a list of numbers, got {value.get('learning_rates')!r}") from None
    if settings.tasks:
        from mlmlab.evaluate.glue import resolve_task_names

        resolve_task_names(settings.tasks)  # unknown task names fail now, not after hours of training
    return settings


def _check_study(study: Study) -> None:
    if study.budget not in BUDGETS:
        raise UserError(f"study budget {study.budget!r} is unknown; choose {' or '.join(BUDGETS)}")
    if not study.arms:
        raise UserError("the study has no arms; add arms: [{name: dynamic, masking.strategy: dynamic}, ...]")
    names = [arm.name for arm in study.arms]
    for arm in study.arms:
        if not ARM_NAME.match(arm.name):
            raise UserError(f"arm name {arm.name!r} may use only letters, digits and . _ = + - (it names a folder)")
        if names.count(arm.name) > 1:
            raise UserError(f"two arms are named {arm.name!r}; arm names must be unique")
        for key in arm.overrides:
            _check_reserved(key, f"arm {arm.name!r}")
    if study.baseline not in names:
        raise UserError(f"baseline {study.baseline!r} is not an arm; arms: {', '.join(names)}")


# ----- from a study to runs ----------------------------------------------------------------
def arm_config(study: Study, arm: Arm) -> Config:
    """The arm's validated config before seeds and budget: base + the arm's dotted overrides."""
    tree = copy.deepcopy(study.base)
    try:
        for key, value in arm.overrides.items():
            set_dotted(tree, key, value)
        return from_dict(tree)
    except UserError as err:
        raise UserError(f"arm {arm.name!r}: {err}") from None


def plan_runs(study: Study) -> list[Run]:
    """Every run of the study, seed-major (so an interrupted study has all arms of its first seeds)."""
    configs = {arm.name: arm_config(study, arm) for arm in study.arms}
    _refuse_duplicate_arms(configs)
    reference = configs[study.baseline]
    budgeted = {name: apply_budget(cfg, reference, study.budget) for name, cfg in configs.items()}
    pairs = [(seed, arm) for seed in study.seeds for arm in study.arms]
    return [_run(study, index, arm, seed, budgeted[arm.name]) for index, (seed, arm) in enumerate(pairs)]


def _refuse_duplicate_arms(configs: dict[str, Config]) -> None:
    """Two arms with one config would spend the compute twice and split one result in two."""
    seen = {}
    for name, cfg in configs.items():
        text = config_text(cfg)
        if text in seen:
            raise UserError(f"arms {seen[text]!r} and {name!r} resolve to the same config; drop one")
        seen[text] = name


def _run(study: Study, index: int, arm: Arm, seed: int, cfg: Config) -> Run:
    cfg = dataclasses.replace(cfg, masking=dataclasses.replace(cfg.masking, seed=seed),
                              train=dataclasses.replace(cfg.train, seed=seed, out_dir=""))
    key = f"{arm.name}/seed{seed}/{config_hash(cfg, study.glue)}"
    run_dir = Path(study.out_dir) / "runs" / arm.name / f"seed{seed}"
    placed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(run_dir)))
    return Run(index, arm, seed, placed, run_cost(cfg), config_hash(cfg), key)


def config_hash(cfg: Config, glue: GlueSettings | None = None) -> str:
    """Hash of what determines a run's results: the config (without its folder) and the GLUE settings."""
    text = config_text(cfg) + (json.dumps(dataclasses.asdict(glue), sort_keys=True) if glue else "")
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def parse_shard(text: str | None) -> tuple[int, int]:
    """"i/n" -> (i, n): this machine runs the runs whose index % n == i (i counts from 0)."""
    if text is None:
        return 0, 1
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match or not int(match[1]) < int(match[2]):
        raise UserError(f"--shard {text!r} must be i/n with 0 <= i < n, e.g. --shard 0/4")
    return int(match[1]), int(match[2])


def shard_runs(runs: list[Run], shard: tuple[int, int]) -> list[Run]:
    i, n = shard
    return [run for run in runs if run.index % n == i]


# ----- running -----------------------------------------------------------------------------
def finished_keys(results: Path) -> set[str]:
    """Keys of the rows already written; a line cut short by a crash is ignored (that run reruns)."""
    if not results.is_file():
        return set()
    keys = set()
    for line in results.read_text().splitlines():
        try:
            keys.add(json.loads(line)["key"])
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return keys


def train_run(cfg: Config, progress: bool) -> tuple[dict, float]:
    """Train (or resume) one run: the trainer's summary and the seconds spent scoring for ADM."""
    from mlmlab.train.loop import Trainer

    trainer = Trainer(cfg, progress=progress)
    summary = trainer.train()
    return summary, float(getattr(trainer.strategy, "score_seconds_total", 0.0))


def glue_for(run: Run, study: Study, progress: bool) -> dict:
    """GLUE dev scores of the run's model, or {"skipped": why}."""
    settings = study.glue
    if not settings.tasks:
        return {"skipped": "no GLUE tasks in the study"}
    if not Path(study.glue_dir).is_dir():
        return {"skipped": f"glue_dir {study.glue_dir!r} not found"}
    from mlmlab.evaluate.glue import run_glue

    run_dir = Path(run.config.train.out_dir)
    options = {k: v for k, v in dataclasses.asdict(settings).items() if k not in ("tasks", "seeds") and v is not None}
    result = run_glue(run_dir / "model", settings.tasks, study.glue_dir, run_dir / "glue", seeds=settings.seeds,
                      progress=progress, **options)
    tasks = {name: {"score": task["score"], "dev": task["dev"]}
             for name, task in result["tasks"].items() if task["status"] == "ok"}
    missing = [name for name, task in result["tasks"].items() if task["status"] != "ok"]
    return {"average": result["average"], "tasks": tasks, **({"missing": missing} if missing else {})}


def make_row(run: Run, study: Study, summary: dict, scorer_seconds: float, glue: dict, train_started: float) -> dict:
    cfg = run.config
    return {
        "key": run.key,
        "study": study.name,
        "study_source": study.source,
        "out_dir": study.out_dir,
        "arm": run.arm.name,
        "arm_index": [arm.name for arm in study.arms].index(run.arm.name),
        "overrides": run.arm.overrides,
        "seed": run.seed,
        "baseline": study.baseline,
        "budget": study.budget,
        **{k: run.cost[k] for k in ("steps", "global_batch", "flops", "flops_per_step", "scorer_share")},
        "tokens_seen": summary["tokens_seen"],  # non-padding tokens actually trained on
        "train_seconds": summary["train_seconds"],  # scoring included (it happens inside the step)
        "scorer_seconds": scorer_seconds,
        "wall_seconds": time.time() - train_started,  # training, evaluation, checkpoints and GLUE
        "eval": summary["eval"],
        "glue": glue,
        "run_dir": str(Path(cfg.train.out_dir).relative_to(study.out_dir)),  # relative to results.jsonl
        "config_hash": run.config_hash,
        "config": to_dict(cfg),
        "mlmlab_version": mlmlab.__version__,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def execute(run: Run, study: Study, results: Path, progress: bool) -> dict:
    started = time.time()
    summary, scorer_seconds = train_run(run.config, progress)
    row = make_row(run, study, summary, scorer_seconds, glue_for(run, study, progress), started)
    with open(results, "a") as handle:
        # One write per row, so concurrent shards never interleave.
        handle.write(jsonio.dumps(row) + "\n")
    return row


def run_study(study: Study, shard: tuple[int, int] = (0, 1), progress: bool = True, log=print) -> list[dict]:
    """Run this shard's unfinished runs; return the rows written."""
    runs = shard_runs(plan_runs(study), shard)
    results = Path(study.out_dir) / RESULTS_FILE
    results.parent.mkdir(parents=True, exist_ok=True)
    done = finished_keys(results)
    rows = []
    for number, run in enumerate(runs, 1):
        label = f"[{number}/{len(runs)}] {run.arm.name} seed {run.seed}"
        if run.key in done:
            log(f"{label}: already in {results}, skipped")
            continue
        log(f"{label}: {run.cost['steps']} steps of batch {run.cost['global_batch']} -> {run.config.train.out_dir}")
        row = execute(run, study, results, progress)
        glue = row["glue"].get("average")
        log(f"{label}: perplexity {row['eval']['perplexity']:.2f}"
            + (f", GLUE {100 * glue:.1f}" if glue is not None else f" ({row['glue'].get('skipped', 'GLUE incomplete')})")
            + f", {row['wall_seconds'] / 60:.1f} min")
        rows.append(row)
    log(f"{len(rows)} runs finished, {len(runs) - len(rows)} skipped; results in {results}")
    return rows


def dry_run_text(study: Study, shard: tuple[int, int] = (0, 1)) -> str:
    """Every arm's config validated and its estimated cost, without training."""
    runs = plan_runs(study)
    mine = shard_runs(runs, shard)
    lines = [f"study {study.name}: {len(study.arms)} arms x {len(study.seeds)} seeds = {len(runs)} runs "
             f"({len(mine)} in shard {shard[0]}/{shard[1]}), budget {study.budget}, baseline {study.baseline}",
             f"{'arm':<34} {'steps':>9} {'batch':>6} {'tokens':>10} {'FLOPs':>9} {'scorer':>7} {'GPU-h':>9} {'CPU-h':>9}"]
    for run in runs[: len(study.arms)]:  # the first seed's runs: one per arm
        c = run.cost
        lines.append(f"{run.arm.name:<34} {c['steps']:>9} {c['global_batch']:>6} {c['tokens']:>10.3g} "
                     f"{c['flops']:>9.3g} {100 * c['scorer_share']:>6.1f}% {c['gpu_hours']:>9.3g} {c['cpu_hours']:>9.3g}")
    total = sum(run.cost["flops"] for run in mine)
    gpu, cpu = (sum(run.cost[k] for run in mine) for k in ("gpu_hours", "cpu_hours"))
    lines += [
        f"this shard: {total:.3g} training FLOPs, {gpu:.3g} GPU-hours or {cpu:.3g} CPU-hours (all seeds); "
        "GLUE fine-tuning not included",
        "assumptions: GPU-hours at 40% MFU of an H100 SXM's ~989 TFLOP/s dense bf16 peak (~396 TFLOP/s achieved); "
        "CPU-hours (training + evaluation) at ~50 GFLOP/s (a tiny-preset step, batch 32 x 128, takes ~0.5 s on 2 idle cores); "
        "FLOPs estimated from the model config (mlmlab/experiments/budget.py)",
        "global batch per optimizer step = train.batch_size x train.grad_accum x processes; the table counts "
        "one process, so with N processes divide train.grad_accum by N to keep the batch",
    ]
    return "\n".join(lines)
