"""A study file: reading and validating it, before anything trains.

A study file (YAML; presets in configs/studies/) holds a base run config, named arms
(dotted overrides of that base), optional grid blocks that generate arms, and seeds.

    name: my-study                    # default: the file name
    preset: tiny                      # optional model/config preset the base starts from
    base: {model: {...}, train: {max_steps: 300}, ...}   # same sections as a run config
    pinned: {model: {dropout: 0.1}}   # like base, for keys fixed after runs finished: see below
    arms:
      - {name: dynamic, masking.strategy: dynamic}
      - {name: adm, masking.strategy: adaptive, masking.scorer: entropy}
    grid:                             # optional; each block: cartesian product of `vary`
      - {prefix: adm, fixed: {masking.strategy: adaptive}, vary: {masking.a_max: [0.25, 0.5]}}
    seeds: [0, 1, 2]                  # each sets train.seed and masking.seed
    budget: token-matched             # or compute-matched (see budget.py)
    baseline: dynamic                 # the arm every other is compared with
    glue: {tasks: [RTE, MRPC], seeds: [0], learning_rates: [1.0e-4]}   # tasks: [] skips GLUE
    glue_dir: ../shared/data/glue     # the runner refuses to start without it when glue tasks are set
    probe: {tasks: [SST-2, MRPC, CoLA], pooling: mean}   # frozen linear probes after GLUE (glue_dir's files)
    eval_data: {wikitext103-valid: ../shared/data/wikitext103_eval/wiki.valid.tokens}  # more held-out sets
    gates:                            # validity gates: checked on one arm's runs before any other arm runs
      arm: dynamic
      min: {eval.mlm_accuracy: 0.14, probe.tasks.SST-2.gain: 0.03}   # row paths -> least mean over seeds
    decision:                         # the rule written before the runs; the report applies it to every arm
      metric: eval.mlm_loss           # a row path; Δ = arm − baseline, paired by seed, 95% t-interval
      lower_is_better: true
      min_effect: 0.01                # a win or a loss needs |mean Δ| at least this, and the interval off 0
      guard: {glue.tasks.STS-B.dev.pearson: 0.01}   # a win may not lower these by more (mean Δ, row units)
      contrasts: [[decay, constant-22.5], [constant-30, dynamic]]   # optional: the primary contrasts, Holm over them
    screen: {seeds: [0, 1], candidates: [adm, decay], confirm: [dynamic]}   # optional: experiments/screen.py
    out_dir: studies/my-study         # default: studies/<name>; its preregistration.md is hashed into every row

An arm may also set ``budget:`` (token-matched or compute-matched) for itself, e.g. to run a
costly scorer once more at the baseline's FLOPs.

``pinned:`` is for a study that is under way when an mlmlab default (or a preset) changes
under it: the runner refuses to run beside finished runs made with the old value, and
pinning the old value here restores it without changing any run's key (running/identity.py: keys
are made of what the preset and base set, so a value added to base would change every key
and every finished run would look foreign). The runner still checks each pinned value
against the finished runs' recorded configs.
"""

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from mlmlab import choices
from mlmlab.config import NON_NEGATIVE, SEEDS, check_range, load_config, read_yaml, set_dotted, to_dict
from mlmlab.errors import UserError
from mlmlab.evaluate import linear_probe, perplexity
from mlmlab.evaluate.glue_data import TASKS
from mlmlab.evaluate.glue_settings import GlueSettings, resolve_task_names
from mlmlab.experiments.screen import SELECTED, Screen, read_screen
from mlmlab.masking.strategies import refuse_other_strategies_settings

STUDY_DIR = Path(__file__).resolve().parent.parent / "configs" / "studies"
STUDY_KEYS = (
    "name",
    "description",
    "preset",
    "base",
    "pinned",
    "arms",
    "grid",
    "seeds",
    "budget",
    "baseline",
    "glue",
    "glue_dir",
    "probe",
    "eval_data",
    "gates",
    "decision",
    "screen",
    "out_dir",
)
GATE_KEYS = ("arm", "min")
GRID_KEYS = ("prefix", "fixed", "vary")
# Set by the study itself (seeds, budget, run folders), never by an arm.
RESERVED = {
    "train.seed": "seeds:",
    "masking.seed": "seeds:",
    "train.out_dir": "the study's out_dir",
    "train.max_steps": "base: (the budget derives every arm's steps from it)",
}
ARM_NAME = re.compile(r"^[A-Za-z0-9._=+-]+$")  # names become folder names
ROW_NUMBERS = ("steps", "tokens_seen", "flops", "train_seconds", "scorer_seconds", "wall_seconds")
ROW_PATHS = (
    "row paths: eval.<figure> (mlm_loss, perplexity, mlm_accuracy, nsp_accuracy, perplexity_freq_<bucket>), "
    "eval_data.<name>.<figure>, glue.average, glue.tasks.<task>.dev.<metric> of the study's GLUE tasks, "
    "probe.average_gain, probe.tasks.<task>.<metric, random_init_<metric>, score or gain> of its probe tasks, "
    + ", ".join(ROW_NUMBERS)
)


@dataclass(frozen=True)
class ProbeSettings:
    """Arguments of evaluate.linear_probe.run_probes; one pooling, as a row holds one set of figures."""

    tasks: list = field(default_factory=lambda: list(linear_probe.DEFAULT_TASKS))  # canonical names once read
    pooling: str = choices.MEAN_POOLING
    seed: int = 0  # the random-init baseline's weights and the training rows held out to choose C
    random_inits: int = 1  # random-init draws the baseline averages (seeds seed, seed + 1, ...)


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: dict  # dotted key -> value, over the study's base
    budget: str | None = None  # None: the study's


@dataclass(frozen=True)
class Gates:
    """Validity gates: least means over the seeds of ``arm`` of row values (dotted paths into a result row)."""

    arm: str
    minimum: dict  # e.g. {"eval.mlm_accuracy": 0.14}


@dataclass(frozen=True)
class Decision:
    """The pre-registered decision rule: what makes an arm win or lose against the baseline."""

    metric: str  # dotted path into a result row, e.g. "eval.mlm_loss"
    lower_is_better: bool = True
    min_effect: float = 0.0  # the least |mean paired difference| that counts as a win or a loss
    guard: dict = field(default_factory=dict)  # row path -> the most a win may lower it (mean paired difference)
    target: float | None = None  # held-out value of an eval.* metric that counts as "left the plateau": steps to it
    lower_target: float | None = None  # a second, lower value of the same metric: steps to it too (descriptive)
    # The primary contrasts, [arm, reference] pairs, a reference other than the baseline allowed; when set, Holm's
    # adjustment runs over these (not over every arm against the baseline) and the rest is descriptive.
    contrasts: list = field(default_factory=list)


@dataclass
class Study:
    name: str
    source: str  # as given on the command line: the report repeats it in its commands
    base: dict  # the full config tree every arm starts from
    explicit: frozenset  # dotted keys the preset or base set, pinned ones aside: a run's identity (running/identity.py)
    arms: list[Arm]
    seeds: list[int]
    budget: str
    baseline: str
    glue: GlueSettings
    glue_dir: str
    probe: ProbeSettings | None  # None: no probes
    eval_data: dict  # name -> path(s) of further held-out data, evaluated after each run
    gates: Gates | None
    decision: Decision | None
    out_dir: str
    screen: Screen | None = None  # a screen and its confirmation (experiments/screen.py); None: every arm every seed


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
    seeds = _seeds(tree.get("seeds", [0]))
    study = Study(
        name=name,
        source=source,
        base=_base_tree(tree),
        explicit=_explicit_keys(tree),
        arms=arms,
        seeds=seeds,
        budget=tree.get("budget", choices.TOKEN_MATCHED),
        baseline=tree.get("baseline", choices.DYNAMIC),
        glue=_glue_settings(tree.get("glue") or {}),
        glue_dir=str(tree.get("glue_dir") or ""),
        probe=_probe_settings(tree.get("probe")),
        eval_data=_eval_data(tree.get("eval_data") or {}),
        gates=_gates(tree.get("gates")),
        decision=_decision(tree.get("decision")),
        out_dir=out_dir or str(tree.get("out_dir") or f"studies/{name}"),
        screen=read_screen(tree.get("screen"), [arm.name for arm in arms], seeds),
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
    overrides = {k: v for k, v in item.items() if k not in ("name", "budget")}
    if "name" not in item:
        raise UserError(f"an arm has no name: {overrides}; add name: <arm name>")
    return Arm(str(item["name"]), overrides, item.get("budget"))


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


def _sections(tree: dict, name: str) -> dict:
    """Study key ``name`` (base or pinned) as {dotted key: value}, after checking its shape."""
    layer = tree.get(name) or {}
    if not isinstance(layer, dict) or not all(isinstance(v, dict) for v in layer.values()):
        raise UserError(f"study key '{name}' must map sections (model, data, masking, train) to mappings")
    return {f"{section}.{key}": value for section, values in layer.items() for key, value in values.items()}


def _base_tree(tree: dict) -> dict:
    """Defaults < preset < base and pinned: as a full config tree that arms override."""
    base, pinned = _sections(tree, "base"), _sections(tree, "pinned")
    both = sorted(base.keys() & pinned.keys())
    if both:
        raise UserError(f"{both[0]} is set in both base: and pinned:; keep it in one of them")
    full = to_dict(load_config(tree.get("preset")))
    for where, layer in (("base", base), ("pinned", pinned)):
        for key, value in layer.items():
            _check_reserved(key, where, allow_steps=True)
            set_dotted(full, key, value)
    return full


def _explicit_keys(tree: dict) -> frozenset:
    """The dotted keys that the study's preset and base set (not those left at mlmlab's defaults, nor pinned)."""
    preset = read_yaml(tree["preset"]) if tree.get("preset") else {}
    preset_keys = {f"{section}.{key}" for section, values in preset.items() for key in values}
    return frozenset((preset_keys | _sections(tree, "base").keys()) - _sections(tree, "pinned").keys())


def _eval_data(value) -> dict:
    if not isinstance(value, dict) or not all(isinstance(v, (str, list)) for v in value.values()):
        raise UserError(
            "study key 'eval_data' must map names to held-out data paths, "
            "e.g. {wikitext103-valid: ../shared/data/wikitext103_eval/wiki.valid.tokens}"
        )
    return {str(name): [paths] if isinstance(paths, str) else list(paths) for name, paths in value.items()}


def _gates(value) -> Gates | None:
    if value is None:
        return None
    minimum = value.get("min") if isinstance(value, dict) else None
    if not isinstance(minimum, dict) or not minimum or "arm" not in value:
        raise UserError(
            "study key 'gates' must be {arm: NAME, min: {row.path: least mean, ...}}, "
            "e.g. {arm: dynamic, min: {eval.mlm_accuracy: 0.14}}"
        )
    _refuse_unknown(value, GATE_KEYS, "gates key")
    try:
        bounds = {str(path): float(least) for path, least in minimum.items()}
    except (TypeError, ValueError):
        bounds = {}
    if not bounds or not all(map(math.isfinite, bounds.values())):  # a NaN bound would fail its gate, silently
        raise UserError(f"gates min: values must be finite numbers, got {minimum!r}")
    return Gates(str(value["arm"]), bounds)


def _decision(value) -> Decision | None:
    if value is None:
        return None
    example = "e.g. {metric: eval.mlm_loss, min_effect: 0.01, guard: {glue.tasks.STS-B.dev.pearson: 0.01}}"
    if not isinstance(value, dict) or not isinstance(value.get("metric"), str):
        raise UserError(f"study key 'decision' must be a mapping with a metric (a row path), {example}")
    _refuse_unknown(value, [f.name for f in dataclasses.fields(Decision)], "decision key")
    guard, min_effect, lower = (
        value.get("guard") or {},
        value.get("min_effect", 0.0),
        value.get("lower_is_better", True),
    )
    if (
        not isinstance(guard, dict)
        or not isinstance(lower, bool)
        or not all(_non_negative_number(v) for v in [min_effect, *guard.values()])
    ):
        raise UserError(
            "decision: min_effect and the guard's tolerances must be numbers >= 0 (finite), guard a mapping of "
            f"row paths, lower_is_better true or false; {example}"
        )
    target = value.get("target")
    if target is not None and not (_non_negative_number(target) and value["metric"].startswith("eval.")):
        raise UserError(
            f"decision: target must be a finite number >= 0 and the metric an eval.* figure (steps to "
            f"target are read from the runs' held-out evaluations); {example}"
        )
    lower_target = value.get("lower_target")
    if lower_target is not None and not (
        target is not None and _non_negative_number(lower_target) and (lower_target < target) == lower
    ):
        raise UserError(
            f"decision: lower_target must be a finite number >= 0 past target (below it where lower is "
            f"better), beside a target; {example}"
        )
    return Decision(
        value["metric"],
        lower,
        float(min_effect),
        {str(path): float(tol) for path, tol in guard.items()},
        None if target is None else float(target),
        None if lower_target is None else float(lower_target),
        _contrasts(value.get("contrasts") or []),
    )


def _contrasts(value) -> list[list[str]]:
    """decision.contrasts: [[arm, reference], ...], checked against the study's arms in _check_study."""
    if not isinstance(value, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and all(isinstance(name, str) for name in pair) and pair[0] != pair[1]
        for pair in value
    ):
        raise UserError(
            "decision: contrasts must be a list of [arm, reference] pairs of two different arm names, "
            "e.g. [[ankner-decay, constant-22.5], [constant-30, dynamic]]"
        )
    return [list(pair) for pair in value]


def _non_negative_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and NON_NEGATIVE.admits(value)


def _check_reserved(key: str, where: str, allow_steps: bool = False) -> None:
    if key in RESERVED and not (allow_steps and key == "train.max_steps"):
        raise UserError(f"{where} sets {key}, which the study sets itself from {RESERVED[key]}; remove it")


def _seeds(value) -> list[int]:
    integers = isinstance(value, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in value)
    if not integers or not value or len(set(value)) != len(value):
        raise UserError(f"study key 'seeds' must be a non-empty list of distinct integers, got {value!r}")
    for seed in value:  # each becomes train.seed and masking.seed: refused now, not when its run starts
        check_range("seeds", seed, SEEDS, 0)
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
    if settings.tasks:  # a bad setting fails now, not after hours of pretraining
        try:
            settings.per_task()
        except UserError as err:
            raise UserError(f"study key 'glue': {err}") from None
    return settings


def _probe_settings(value) -> ProbeSettings | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise UserError("study key 'probe' must be a mapping, e.g. {tasks: [SST-2, MRPC, CoLA], pooling: mean}")
    _refuse_unknown(value, [f.name for f in dataclasses.fields(ProbeSettings)], "probe key")
    settings = ProbeSettings(**value)
    try:  # a bad setting fails now, not after hours of pretraining
        names = linear_probe.checked_arguments(settings.tasks, [settings.pooling], settings.seed, settings.random_inits)
    except UserError as err:
        raise UserError(f"study key 'probe': {err} (one pooling per study)") from None
    return dataclasses.replace(settings, tasks=names)


def _check_study(study: Study) -> None:
    if study.budget not in choices.BUDGETS:
        raise UserError(f"study budget {study.budget!r} is unknown; choose {choices.listed(choices.BUDGETS)}")
    if not study.arms:
        raise UserError("the study has no arms; add arms: [{name: dynamic, masking.strategy: dynamic}, ...]")
    names = [arm.name for arm in study.arms]
    for arm in study.arms:
        if arm.budget is not None and arm.budget not in choices.BUDGETS:
            raise UserError(
                f"arm {arm.name!r}: budget {arm.budget!r} is unknown; choose {choices.listed(choices.BUDGETS)}"
            )
        if not ARM_NAME.match(arm.name):
            raise UserError(f"arm name {arm.name!r} may use only letters, digits and . _ = + - (it names a folder)")
        if names.count(arm.name) > 1:
            raise UserError(f"two arms are named {arm.name!r}; arm names must be unique")
        for key in arm.overrides:
            _check_reserved(key, f"arm {arm.name!r}")
        # An arm's own keys only: the base carries one arm's settings beside the others' (an ADM arm's a_max under a
        # dynamic arm), which are records of the shared setting, not choices the dynamic arm made.
        strategy = arm.overrides.get("masking.strategy", study.base["masking"]["strategy"])
        refuse_other_strategies_settings(strategy, arm.overrides, f"arm {arm.name!r}: ")
    if study.baseline not in names:
        raise UserError(f"baseline {study.baseline!r} is not an arm; arms: {', '.join(names)}")
    if study.gates is not None and study.gates.arm not in names:
        raise UserError(f"gates arm {study.gates.arm!r} is not an arm; arms: {', '.join(names)}")
    for name in [name for pair in (study.decision.contrasts if study.decision else []) for name in pair]:
        if name == SELECTED and study.screen is None:
            raise UserError(f"decision contrast names {SELECTED}, but the study has no screen: block to pick it")
        if name not in names and name != SELECTED:
            raise UserError(f"decision contrast names {name!r}, which is not an arm; arms: {', '.join(names)}")
    if study.screen is not None and study.decision is None:
        raise UserError("a screen: picks by the decision metric; add decision: {metric: eval.mlm_loss}")
    _check_row_paths(study)


def _check_row_paths(study: Study) -> None:
    """Gates and the decision read rows by path: a typo would read NaN and fail a gate or decide nothing, silently."""
    named = {
        "gates min": list(study.gates.minimum) if study.gates else [],
        "decision metric": [study.decision.metric] if study.decision else [],
        "decision guard": list(study.decision.guard) if study.decision else [],
    }
    for where, paths in named.items():
        for path in paths:
            if not _is_row_path(path.split("."), study):
                raise UserError(f"{where} names {path!r}, which no result row of this study has; {ROW_PATHS}")


def _is_row_path(parts: list[str], study: Study) -> bool:
    def figure(name: str) -> bool:
        return name in perplexity.FIGURES or name.startswith(perplexity.BUCKET_FIGURES)

    tasks = resolve_task_names(study.glue.tasks) if study.glue.tasks else []
    match parts:
        case [number] if number in ROW_NUMBERS:
            return True
        case ["eval", name]:
            return figure(name)
        case ["eval_data", data, name]:
            return data in study.eval_data and figure(name)
        case ["glue", "average"]:
            return bool(tasks)
        case ["glue", "tasks", task, "score"]:
            return task in tasks
        case ["glue", "tasks", task, "dev", metric]:
            return task in tasks and metric in TASKS[task].metric_names
        case ["probe", "average_gain" | "seconds"]:
            return study.probe is not None
        case ["probe", "tasks", task, figure]:
            probed = study.probe.tasks if study.probe else []
            return task in probed and figure in linear_probe.figure_names(TASKS[task])
    return False
