"""Frozen linear probes: a downstream measure that still ranks weak encoders.

Fine-tuning a weak encoder on a small GLUE task splits models into groups by chance
(studies/adm-study-wp8k-9k: STS-B near 0.2, 0.4 or 0.7 per model). A linear probe reads what
the frozen encoder already holds, with nothing left to chance but a fixed seed:

1. Features, computed once per split with the frozen encoder (eval mode, no gradients,
   length-sorted batches): the mean of the final hidden states over the real tokens
   ([CLS] and [SEP] included, padding not) and the final hidden state at [CLS].
2. A scikit-learn LogisticRegression (Ridge for a regression task such as STS-B) on
   standardised features (the scaler fit on training rows only). Its regularisation C
   (Ridge: alpha = 1/C) is chosen on a fixed 20% of the training set after fitting on
   the other 80%; then it is refit on the whole training set and scored once on the GLUE
   dev set. Dev labels play no part in any choice.
3. The same for a random-init encoder of the same config.json and vocabulary (weights
   drawn by transformers from ``seed``): every figure has its baseline, and
   gain = pretrained - random init in the task's score (GLUE's rule: the mean of the
   task's metrics), on the 0-1 scale evaluate.glue uses. One draw is noisy: a random encoder
   is a bag of its random input embeddings, and over six init seeds a tiny one's SST-2 probe
   spread by a standard deviation of 1.3-1.5 points (studies/arch-plateau-wp8k). Runs of one
   config share the draw, so their gains still compare; across architectures, ``random_inits``
   = N averages the baseline over the draws of seeds seed .. seed + N - 1.

SST-2 trains on a fixed 8,000-row sample of its 67k training rows (glue_data.subsample's
fixed seed, the same rows for every model), every other task on all of its rows; the dev
sets are whole. On a tiny model this takes minutes on a CPU, most of it the random-init
features, which are kept for the process's later models of the same config and seed.

Usage::

    mlmlab probe --model runs/x/model --data-dir ../shared/data/glue --task SST-2 MRPC CoLA --out runs/x/probe

or in a study file, after GLUE on each finished run (the study's glue_dir holds the data)::

    probe: {tasks: [SST-2, MRPC, CoLA], pooling: mean}

which puts ``row["probe"] = {"pooling", "tasks": {task: {<metric>, random_init_<metric>, score,
random_init_score, gain, C, random_init_C, train_examples, dev_examples}}, "average_gain", "seconds"}``
in the study's result rows (gates and decision guards read e.g. ``probe.tasks.SST-2.gain``).
"""

import functools
import hashlib
import json
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning, UndefinedMetricWarning
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from mlmlab import choices
from mlmlab.config import SEEDS, check_range
from mlmlab.errors import UserError, writes_of
from mlmlab.evaluate.glue import (
    EVAL_BATCH_SIZE,
    EncodedSplit,
    check_arguments,
    collate,
    compute_metrics,
    encode,
    load_model,
    nan_as_worst,
    percent,
    refuse_inputs_past_positions,
    task_score,
)
from mlmlab.evaluate.glue_data import TASKS, TRAIN_FILE, GlueTask, missing_files, read_labeled
from mlmlab.evaluate.glue_settings import TASK_SETTINGS, resolve_task_names
from mlmlab.model.architectures import token_positions
from mlmlab.model.folder import load_any_tokenizer, read_config
from mlmlab.utils import jsonio, markdown
from mlmlab.utils.devices import compute_device
from mlmlab.utils.files import lock_folder, refuse_results_of_another_model, write_text_atomically
from mlmlab.utils.progress import progress_bar

DEFAULT_TASKS = ("SST-2", "MRPC", "CoLA")
TRAIN_SAMPLES = {"SST-2": 8000}  # a fixed sample of SST-2's 67k rows keeps its features to a minute on a CPU
SELECTION_SHARE = 0.2  # of the training rows: held out to choose the regularisation
STRENGTHS = tuple(float(c) for c in 10.0 ** np.arange(-4, 3))  # C, ascending: 1e-4 (strongest) .. 100
MAX_ITERATIONS = 2000  # lbfgs; weak regularisation on separable features may still stop here (see quiet_sklearn)
PRETRAINED, RANDOM_INIT = "pretrained", "random"  # evaluate.glue.load_model's init values
HEAD_TASK = TASKS["SST-2"]  # load_model builds a classifier for some task; the probe drops it and keeps the encoder
SELECTION_NOTE = (
    "Probes are logistic regressions (ridge for regression tasks) on standardised frozen features; C is chosen on a "
    f"fixed {SELECTION_SHARE:.0%} of the training rows, the probe refit on all of them and scored once on the dev set."
)
MAX_CACHED_SPLITS = 24  # random-init features kept per process: every split of a few configs

Features = dict[str, np.ndarray]  # pooling -> (N, H) float32, in file order

# Random-init features depend only on the config, the seed and the tokens, which is what
# random_init_key hashes: a study's runs mostly share all three, so each is computed once.
_RANDOM_INIT_FEATURES: dict[str, Features] = {}


@dataclass(frozen=True)
class TaskData:
    task: GlueTask
    splits: dict[str, EncodedSplit]  # "train", then the task's dev split names ("dev"; MNLI's matched, mismatched)

    @property
    def dev_names(self) -> list[str]:
        return [name for name in self.splits if name != "train"]


def run_probes(
    model_dir,
    tasks: Sequence[str] | None,
    data_dir,
    *,
    poolings: Sequence[str] = (choices.MEAN_POOLING,),
    seed: int = 0,
    random_inits: int = 1,
    out_dir=None,
    show_progress: bool = True,
) -> dict:
    """Probe ``model_dir`` and its random-init twin on each task (None: DEFAULT_TASKS) for each pooling.

    ``random_inits``: the random-init baseline is the mean over that many draws (seeds seed, seed + 1, ...);
    the C-selection split stays ``seed``'s for every draw.

    Returns {"model_dir", "seed", "random_inits", "selection", "strengths", "train_samples", "poolings": {pooling:
    {"tasks": {task: figures}, "average_gain"}}, "seconds"}; with ``out_dir`` also writes it to
    probe_results.json and probe_results.md there. Every argument and file is checked first.
    """
    # --out is this process's from the first check on: two probes writing one folder would mix their files.
    with (
        nullcontext()
        if out_dir is None
        else lock_folder(Path(out_dir), f"the probe output folder {out_dir}", "give --out another folder")
    ):
        if out_dir is not None:
            refuse_results_of_another_model(Path(out_dir), "probe_results.json", Path(model_dir))
        results = probe_all(model_dir, tasks, data_dir, poolings, seed, random_inits, show_progress)
        if out_dir is not None:
            write_probe_results(results, Path(out_dir))
    return results


def probe_all(
    model_dir,
    tasks: Sequence[str] | None,
    data_dir,
    poolings: Sequence[str],
    seed: int,
    random_inits: int,
    show_progress: bool,
) -> dict:
    """run_probes' results, nothing written."""
    started = time.perf_counter()
    model_dir, data_dir = Path(model_dir), Path(data_dir)
    names = checked_arguments(tasks or DEFAULT_TASKS, poolings, seed, random_inits)
    check_arguments(model_dir, data_dir, PRETRAINED)
    refuse_inputs_past_positions(
        probe_lengths(names),
        f"the model in {model_dir}",
        token_positions(read_config(model_dir)),
        "a probe reads its task's GLUE length; probe a model with that many positions, or leave the task out",
    )
    check_task_files(names, data_dir)
    tokenizer = load_any_tokenizer(model_dir)
    data = {name: read_task(TASKS[name], data_dir, tokenizer) for name in names}  # every file read before any forward
    device = compute_device()
    pretrained = encoder_features(model_dir, PRETRAINED, data, seed, device, show_progress)
    draws = [
        encoder_features(model_dir, RANDOM_INIT, data, seed + draw, device, show_progress)
        for draw in range(random_inits)
    ]
    # The fits are small (N x H) products: BLAS and OpenMP threads only busy-wait on each other and on
    # torch's; one thread fit SST-2's probes 30x faster on a busy 2-core machine (13 s -> 0.4 s a fit).
    with threadpool_limits(limits=1):
        pooled = {pooling: pooling_results(pooling, data, pretrained, draws, seed) for pooling in poolings}
    results = {
        "model_dir": str(model_dir),
        "seed": seed,
        "random_inits": random_inits,
        "selection": SELECTION_NOTE,
        "strengths": list(STRENGTHS),
        "train_samples": {name: TRAIN_SAMPLES[name] for name in names if name in TRAIN_SAMPLES},
        "poolings": pooled,
    }
    results["seconds"] = time.perf_counter() - started
    return results


def checked_arguments(tasks, poolings, seed, random_inits: int = 1) -> list[str]:
    """The canonical task names, or a UserError naming the bad argument (also what a study checks when read)."""
    names = resolve_task_names(tasks)
    known = not isinstance(poolings, str) and all(pooling in choices.POOLINGS for pooling in poolings)
    if not known or not poolings or len(set(poolings)) != len(poolings):
        raise UserError(f"pooling {poolings!r} must name some of {choices.listed(choices.POOLINGS)}, each once")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UserError(f"probe seed {seed!r} must be an integer >= 0")
    check_range("probe seed", seed, SEEDS, 0)
    if not isinstance(random_inits, int) or isinstance(random_inits, bool) or random_inits < 1:
        raise UserError(f"probe random_inits {random_inits!r} must be an integer >= 1 (the random-init draws averaged)")
    if seed + random_inits - 1 > SEEDS.high:  # the draws' seeds are seed .. seed + random_inits - 1
        raise UserError(
            f"probe seed {seed} with random_inits {random_inits} draws seeds up to {seed + random_inits - 1}, past "
            f"{SEEDS.high:.0f} (seeds are 32-bit); lower the seed or the random-init draws"
        )
    return names


def probe_length(name: str) -> int:
    """A probe reads its task's inputs as GLUE fine-tuning does by default: cut at the task's max_length."""
    return TASK_SETTINGS[name].max_length


def probe_lengths(names: list[str]) -> dict[str, int]:
    """What probing feeds the model: {"the SST-2 probe": its inputs' longest length in tokens, ...}."""
    return {f"the {name} probe": probe_length(name) for name in names}


def check_task_files(names: list[str], data_dir: Path) -> None:
    """Every task's train and dev files, or a UserError naming the first missing one (nothing is skipped)."""
    missing = [path for name in names for path in missing_files(TASKS[name], data_dir)]
    if missing:
        raise UserError(
            f"{data_dir / missing[0]} is missing; a probe or GLUE fine-tuning needs each task's train and "
            "dev files, as in the glue_data folder holding CoLA/, SST-2/, ... (pass it as --data-dir)"
        )


def read_task(task: GlueTask, data_dir: Path, tokenizer, max_rows: int | None = None) -> TaskData:
    """The task's training rows (SST-2: the fixed sample) and dev sets, tokenized as GLUE fine-tuning does;
    ``max_rows``: a fixed random sample of at most that many rows of each (what a study's dry run times)."""
    folder, max_length = data_dir / task.name, probe_length(task.name)
    train_rows = min((n for n in (TRAIN_SAMPLES.get(task.name), max_rows) if n is not None), default=None)
    splits = {"train": encode(read_labeled(task, folder / TRAIN_FILE, train_rows), tokenizer, max_length)}
    splits |= {
        split: encode(read_labeled(task, folder / name, max_rows), tokenizer, max_length)
        for split, name in task.dev_files.items()
    }
    return TaskData(task, splits)


# ---------------------------------------------------------------- features


def load_encoder(model_dir: Path, init: str, seed: int, device: torch.device) -> torch.nn.Module:
    """The frozen encoder of ``model_dir`` (init="pretrained") or of its config with weights drawn from ``seed``.

    glue.load_model refuses a checkpoint that lacks encoder weights; its classifier head is dropped.
    """
    # transformers draws initial weights from torch's global RNG and takes no generator; the fork
    # hands the caller's RNG states back untouched (manual_seed reseeds every GPU's too).
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        torch.manual_seed(seed)  # rng-ok: transformers draws init weights from the global RNG; forked above
        model = load_model(model_dir, HEAD_TASK, init, dropout=0.0)
    return model.base_model.to(device).eval()


def encoder_features(
    model_dir: Path, init: str, data: dict[str, TaskData], seed: int, device: torch.device, show_progress: bool
) -> dict[str, dict[str, Features]]:
    """task -> split -> Features of one encoder; random-init features come from the process's cache when there."""
    encoder = functools.cache(lambda: load_encoder(model_dir, init, seed, device))  # not loaded if all is cached
    config = read_config(model_dir)
    features = {}
    for name, task_data in data.items():
        features[name] = {}
        for split_name, split in task_data.splits.items():
            label = f"{name} {split_name} ({init})"
            key = random_init_key(config, seed, split) if init == RANDOM_INIT else None
            features[name][split_name] = cached(
                key, lambda: split_features(encoder(), split, device, label, show_progress)
            )
    return features


def random_init_key(config: dict, seed: int, split: EncodedSplit) -> str:
    """All that random-init features depend on: the architecture (config.json), the seed and the token ids."""
    text = json.dumps({"config": config, "seed": seed, "tokens": split.features}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def cached(key: str | None, compute: Callable[[], Features]) -> Features:
    """compute(), or what it gave for ``key`` earlier in this process (key None: not kept)."""
    if key is None:
        return compute()
    if key not in _RANDOM_INIT_FEATURES:
        if len(_RANDOM_INIT_FEATURES) >= MAX_CACHED_SPLITS:
            _RANDOM_INIT_FEATURES.pop(next(iter(_RANDOM_INIT_FEATURES)))  # the oldest
        _RANDOM_INIT_FEATURES[key] = compute()
    return _RANDOM_INIT_FEATURES[key]


@torch.inference_mode()
def split_features(
    encoder: torch.nn.Module, split: EncodedSplit, device: torch.device, label: str, show_progress: bool
) -> Features:
    """Every pooling of every example of ``split``, in file order, from one forward pass per batch."""
    order = np.argsort([len(ids) for ids in split.features["input_ids"]], kind="stable")  # little padding per batch
    pooled = {pooling: [] for pooling in choices.POOLINGS}
    with progress_bar(f"probe {label}", len(split), show_progress, unit="ex") as bar:
        for start in range(0, len(split), EVAL_BATCH_SIZE):
            rows = order[start : start + EVAL_BATCH_SIZE].tolist()
            batch = collate(split, rows, device)
            hidden = encoder(**batch).last_hidden_state  # (B, T, H)
            real = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
            pooled[choices.MEAN_POOLING].append((hidden * real).sum(dim=1) / real.sum(dim=1))  # (B, H)
            pooled[choices.CLS_POOLING].append(hidden[:, 0])  # (B, H)
            bar.update(len(rows))
    file_order = np.argsort(order)  # row i of the sorted features is example order[i]
    return {pooling: torch.cat(parts).float().cpu().numpy()[file_order] for pooling, parts in pooled.items()}


# ---------------------------------------------------------------- probes


def pooling_results(pooling: str, data: dict[str, TaskData], pretrained: dict, draws: list[dict], seed: int) -> dict:
    """{"tasks": {task: figures}, "average_gain"} of one pooling; ``draws``: each random-init encoder's features."""
    tasks = {}
    for name, task_data in data.items():
        tasks[name] = task_figures(
            task_data,
            probe_task(task_data, pretrained[name], pooling, seed),
            [probe_task(task_data, features[name], pooling, seed) for features in draws],
        )
    return {"tasks": tasks, "average_gain": float(np.mean([figures["gain"] for figures in tasks.values()]))}


def task_figures(task_data: TaskData, pretrained: dict, draws: list[dict]) -> dict:
    """The row's figures of one task: metrics, their random-init twins (the draws' means), scores, gain, chosen C
    (random init: the first draw's) and sizes; with several draws also each draw's score and their sd."""
    random_metrics = {name: float(np.mean([draw["metrics"][name] for draw in draws])) for name in draws[0]["metrics"]}
    random_score = task_score(random_metrics)  # the mean of the draws' scores: a score is its metrics' mean
    spread = {}
    if len(draws) > 1:
        draw_scores = [draw["score"] for draw in draws]
        spread = {"random_init_scores": draw_scores, "random_init_sd": float(np.std(draw_scores, ddof=1))}
    return {
        **pretrained["metrics"],
        **{f"random_init_{name}": value for name, value in random_metrics.items()},
        "score": pretrained["score"],
        "random_init_score": random_score,
        "gain": pretrained["score"] - random_score,
        "C": pretrained["strength"],
        "random_init_C": draws[0]["strength"],
        **spread,
        "train_examples": len(task_data.splits["train"]),
        "dev_examples": sum(len(task_data.splits[name]) for name in task_data.dev_names),
    }


def figure_names(task: GlueTask) -> tuple[str, ...]:
    """The keys task_figures gives ``task``: what a study's row paths may name under probe.tasks.<task>."""
    metrics = task.metric_names
    return (
        *metrics,
        *(f"random_init_{name}" for name in metrics),
        "score",
        "random_init_score",
        "gain",
        "C",
        "random_init_C",
        "train_examples",
        "dev_examples",
    )


def probe_task(task_data: TaskData, features: dict[str, Features], pooling: str, seed: int) -> dict:
    """{"metrics", "score", "strength"}: the dev scores of a probe whose C was chosen on the training rows."""
    task, splits = task_data.task, task_data.splits
    train_x, train_y = features["train"][pooling], np.asarray(splits["train"].labels)
    strength = chosen_strength(task, train_x, train_y, seed)
    probe = fitted(task, train_x, train_y, strength)
    metrics = {}
    for name in task_data.dev_names:  # suffixes as glue.dev_metrics gives them (MNLI's two dev sets)
        suffix = f"_{name}" if len(task_data.dev_names) > 1 else ""
        with quiet_sklearn():
            values = compute_metrics(task, splits[name].labels, probe.predict(features[name][pooling]))
        metrics |= {f"{metric}{suffix}": value for metric, value in values.items()}
    return {"metrics": metrics, "score": task_score(metrics), "strength": strength}


def chosen_strength(task: GlueTask, x: np.ndarray, y: np.ndarray, seed: int) -> float:
    """The C whose probe, fit on 80% of the training rows, scores best on the other 20% (ties: the smaller C)."""
    fit_rows, held_rows = selection_split(len(y), seed)
    scores = {}
    for strength in STRENGTHS:
        probe = fitted(task, x[fit_rows], y[fit_rows], strength)
        with quiet_sklearn():
            scores[strength] = task_score(compute_metrics(task, y[held_rows], probe.predict(x[held_rows])))
    return max(STRENGTHS, key=lambda strength: nan_as_worst(scores[strength]))  # max keeps the first of equals


def selection_split(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(fit rows, held-out rows) of the training set: a fixed random SELECTION_SHARE held out."""
    order = np.random.default_rng(seed).permutation(count)
    held = max(1, round(SELECTION_SHARE * count))
    return order[held:], order[:held]


def fitted(task: GlueTask, x: np.ndarray, y: np.ndarray, strength: float):
    """Standardise (fit on these rows), then logistic regression with C = strength, or ridge with alpha = 1/strength."""
    if task.is_regression:
        head = Ridge(alpha=1.0 / strength)
    else:
        head = LogisticRegression(C=strength, max_iter=MAX_ITERATIONS)
    with quiet_sklearn():
        return make_pipeline(StandardScaler(), head).fit(x, y)


@contextmanager
def quiet_sklearn():
    """Two expected warnings off: the weakest regularisation on separable features stops at MAX_ITERATIONS
    (the held-out split judges the result as it is), and F1 of a constant prediction is defined as 0."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("ignore", UndefinedMetricWarning)
        yield


# ---------------------------------------------------------------- outputs


def write_probe_results(results: dict, out_dir: Path) -> None:
    """Each file whole or as before (a study's row reads the JSON)."""
    with writes_of(f"the probe results to {out_dir}", "the results written there before are kept"):
        write_text_atomically(out_dir / "probe_results.json", jsonio.dumps(results, indent=2) + "\n")
        write_text_atomically(out_dir / "probe_results.md", format_probe_table(results))


def format_probe_table(results: dict) -> str:
    """Markdown: one row per task and pooling (dev score x100, pretrained and random init, gain), then notes."""
    body = []
    for pooling, pooled in results["poolings"].items():
        for name, figures in pooled["tasks"].items():
            body.append(
                [
                    name,
                    pooling,
                    score_name(TASKS[name]),
                    percent(figures["score"]),
                    random_init_cell(figures),
                    points(figures["gain"]),
                ]
            )
        body.append(["average", pooling, "", "", "", points(pooled["average_gain"])])
    lines = markdown.table(["Task", "Pooling", "Score", "Pretrained", "Random init", "Gain"], body)
    lines.append(
        f"{Path(results['model_dir']).name}: GLUE dev scores x100; random init = the same config.json with "
        f"{drawn_weights(results['seed'], results['random_inits'])}; gain = pretrained - random init. "
        f"{results['selection']}"
    )
    for name, rows in results["train_samples"].items():
        lines.append(
            f"{name} trains on a fixed sample of at most {rows} training rows (the same rows for every model)."
        )
    lines.append(f"Took {results['seconds'] / 60:.1f} min.")
    return "\n".join(lines) + "\n"


def drawn_weights(seed: int, draws: int) -> str:
    if draws == 1:
        return f"weights drawn from seed {seed}"
    return f"weights drawn from seeds {seed}-{seed + draws - 1}, the mean of the {draws} probes (± their sd)"


def random_init_cell(figures: dict) -> str:
    cell = percent(figures["random_init_score"])
    return cell if "random_init_sd" not in figures else f"{cell} ± {100 * figures['random_init_sd']:.1f}"


def score_name(task: GlueTask) -> str:
    names = task.metric_names
    return names[0] if len(names) == 1 else f"mean of {', '.join(names)}"


def points(value: float) -> str:
    return "n/a" if np.isnan(value) else f"{100 * value:+.1f}"
