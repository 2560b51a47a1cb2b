"""GLUE fine-tuning evaluation of an mlmlab checkpoint folder.

For each task: fine-tune a fresh copy of the checkpoint for every (learning rate, seed),
score the dev set, take the median over seeds per learning rate, and choose the learning
rate with the best median. The dev set is used both to choose and to report, as is
customary for GLUE dev numbers (optimistic; the test set needs a GLUE submission). The
settings, each task's and the run's choices over them, are glue_settings.py's.
"""

import dataclasses
import math
import time
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
from transformers import AutoConfig, AutoModelForSequenceClassification

from mlmlab.errors import UserError, writes_of
from mlmlab.evaluate.glue_data import (
    TASKS,
    TRAIN_FILE,
    GlueSplit,
    GlueTask,
    missing_files,
    read_labeled,
    read_unlabeled,
)
from mlmlab.evaluate.glue_settings import FineTuneSettings, GlueSettings
from mlmlab.model.architectures import ADAPTERS, refuse_past_positions, token_positions
from mlmlab.model.architectures.bert import Bert
from mlmlab.model.folder import load_any_tokenizer, read_config, saved_weight_shapes
from mlmlab.train.optim import parameter_groups
from mlmlab.utils import jsonio, markdown
from mlmlab.utils.devices import compute_device
from mlmlab.utils.files import lock_folder, refuse_results_of_another_model, write_text_atomically
from mlmlab.utils.progress import progress_bar, say
from mlmlab.utils.restoring import restoring

SELECTION_NOTE = (
    "Dev sets are used both to choose the learning rate (best median over seeds) and to report the scores, "
    "as is customary for GLUE dev numbers; this is optimistic."
)
EVAL_BATCH_SIZE = 128  # no gradients at evaluation, so larger batches only cost activation memory
MAX_GRAD_NORM = 1.0  # as in BERT's run_classifier.py; keeps tiny random-init models from diverging

METRIC_FUNCTIONS = {
    "mcc": matthews_corrcoef,
    "accuracy": accuracy_score,
    "f1": f1_score,  # binary F1 of class id 1 ("1" = paraphrase / duplicate)
    "pearson": lambda labels, predictions: pearsonr(labels, predictions).statistic,
    "spearman": lambda labels, predictions: spearmanr(labels, predictions).statistic,
}


def run_glue(
    model_dir,
    settings: GlueSettings,
    data_dir,
    out_dir,
    *,
    init: str = "pretrained",
    write_test_predictions: bool = False,
    show_progress: bool = True,
) -> dict:
    """Fine-tune model_dir on each of ``settings.tasks`` and write glue_results.json and glue_results.md to out_dir.

    init="random" fine-tunes the same architecture from fresh weights (the baseline showing what
    pretraining bought). Tasks whose files are absent are reported with status "missing". Returns
    the dict written to glue_results.json.
    """
    model_dir, data_dir, out_dir = Path(model_dir), Path(data_dir), Path(out_dir)
    # Every argument is checked before the first task trains, not minutes later.
    check_arguments(model_dir, data_dir, init)
    per_task = settings.per_task()
    positions = token_positions(read_config(model_dir))
    refuse_inputs_past_positions(
        glue_lengths(per_task),
        f"the model in {model_dir}",
        positions,
        f"give GLUE a max_length of at most {positions} (--max-length; in a study, glue: {{max_length: {positions}}})",
    )
    refuse_all_missing(list(per_task), data_dir)
    if write_test_predictions:
        refuse_missing_tests(list(per_task), data_dir)
    context = RunContext(
        model_dir,
        load_any_tokenizer(model_dir),
        init,
        tuple(settings.seeds),
        settings.max_train_examples,
        write_test_predictions,
        show_progress,
        compute_device(),
    )
    results = {
        "model_dir": str(model_dir),
        "init": init,
        "seeds": list(settings.seeds),
        "selection": SELECTION_NOTE,
        "max_train_examples": settings.max_train_examples,
        "tasks": {},
        "average": None,
    }
    with lock_folder(out_dir, f"the GLUE output folder {out_dir}", "give --out another folder"):
        refuse_results_of_another_model(out_dir, "glue_results.json", model_dir)
        for name, task_settings in per_task.items():
            results["tasks"][name] = evaluate_task(TASKS[name], data_dir, task_settings, context, out_dir)
            results["average"] = glue_average(results["tasks"])
            write_results(results, out_dir)  # after every task, so a long run keeps what it finished
    return results


@dataclass(frozen=True)
class RunContext:
    """What every task's runs share."""

    model_dir: Path
    tokenizer: transformers.PreTrainedTokenizerBase
    init: str
    seeds: tuple[int, ...]
    max_train_examples: int | None
    write_test_predictions: bool
    show_progress: bool
    device: torch.device


def check_arguments(model_dir: Path, data_dir: Path, init: str) -> None:
    read_config(model_dir)
    if init == "pretrained":
        saved_weight_shapes(model_dir)  # a missing or truncated weights file, before any task reads data
    if not data_dir.is_dir():
        raise UserError(
            f"GLUE data folder {data_dir} does not exist; pass the glue_data folder holding CoLA/, SST-2/, ..."
        )
    if init not in ("pretrained", "random"):
        raise UserError(f"init={init!r} is not known; use 'pretrained' or 'random'")


def glue_lengths(per_task: dict[str, FineTuneSettings]) -> dict[str, int]:
    """What fine-tuning feeds the model: {"GLUE RTE": its inputs' longest length in tokens, ...}."""
    return {f"GLUE {name}": settings.max_length for name, settings in per_task.items()}


def refuse_inputs_past_positions(lengths: dict[str, int], model: str, positions: int | None, remedy: str) -> None:
    """Each of ``lengths`` (glue_lengths, probe_lengths) against ``model``'s positions (refuse_past_positions)."""
    for what, length in lengths.items():
        refuse_past_positions(f"{what} reads inputs of up to", length, model, positions, remedy)


def refuse_all_missing(names: list[str], data_dir: Path) -> None:
    """Missing tasks are skipped and reported; when every requested one is missing, nothing would run."""
    missing = {name: missing_files(TASKS[name], data_dir) for name in names}
    if all(missing.values()):
        first = next(iter(missing.values()))[0]
        raise UserError(
            f"none of the requested GLUE tasks has its files in {data_dir} (e.g. {first} is missing); "
            "pass the glue_data folder holding CoLA/, SST-2/, ... as --data-dir"
        )


def refuse_missing_tests(names: list[str], data_dir: Path) -> None:
    """--test-predictions writes a submission file per test file: a task that runs without one would write none
    unsaid. (A task without its train or dev files is skipped and reported anyway.)"""
    for name in names:
        task = TASKS[name]
        if missing_files(task, data_dir):
            continue
        absent = [f"{name}/{file}" for file in task.test_files if not (data_dir / name / file).is_file()]
        if absent:
            raise UserError(
                f"--test-predictions: {data_dir / absent[0]} is missing, so no submission file could be written for "
                f"{name}; put GLUE's test files beside its train.tsv and dev.tsv, or leave --test-predictions out"
            )


# ---------------------------------------------------------------- one task


def evaluate_task(
    task: GlueTask, data_dir: Path, settings: FineTuneSettings, context: RunContext, out_dir: Path
) -> dict:
    absent = missing_files(task, data_dir)
    if absent:
        report(context, f"{task.name}: missing {', '.join(absent)}; skipped")
        return {"status": "missing", "missing_files": absent}
    started = time.perf_counter()
    folder = data_dir / task.name
    train_split = read_labeled(task, folder / TRAIN_FILE, context.max_train_examples)
    train = encode(train_split, context.tokenizer, settings.max_length)
    devs = {
        split: encode(read_labeled(task, folder / name), context.tokenizer, settings.max_length)
        for split, name in task.dev_files.items()
    }
    tests = read_tests(task, folder, settings, context)
    runs, test_outputs = [], {}
    for learning_rate in settings.learning_rates:
        for seed in context.seeds:
            run, test_outputs[(learning_rate, seed)] = fine_tune_and_score(
                task, train, devs, tests, settings, learning_rate, seed, context
            )
            runs.append(run)
    result = summarize_task(task, settings, runs, len(train.labels), started)
    if tests:
        result["test_predictions"] = write_best_test_predictions(task, tests, runs, test_outputs, result, out_dir)
    return result


def read_tests(task: GlueTask, folder: Path, settings: FineTuneSettings, context: RunContext) -> dict:
    """Encoded test splits by file name, for the submission files; absent test files are skipped."""
    if not context.write_test_predictions:
        return {}
    return {
        name: encode(read_unlabeled(task, folder / name), context.tokenizer, settings.max_length)
        for name in task.test_files
        if (folder / name).is_file()
    }


def fine_tune_and_score(
    task: GlueTask,
    train: "EncodedSplit",
    devs: dict[str, "EncodedSplit"],
    tests: dict[str, "EncodedSplit"],
    settings: FineTuneSettings,
    learning_rate: float,
    seed: int,
    context: RunContext,
) -> tuple[dict, dict]:
    """One (learning rate, seed) run: its dev metrics, and its test predictions if any were asked for."""
    started = time.perf_counter()
    # Weight init (the classifier head; everything for init="random") and dropout draw from
    # torch's global RNG: transformers takes no generator for either, so seeding it is
    # unavoidable. Data order uses its own generator (see train_model).
    transformers.set_seed(seed)
    model = load_model(context.model_dir, task, context.init, settings.dropout).to(context.device)
    train_model(
        model,
        train,
        settings,
        learning_rate,
        seed,
        context.device,
        context.show_progress,
        desc=f"glue {task.name} lr={learning_rate:g} seed={seed}",
    )
    metrics = dev_metrics(task, model, devs, context.device)
    test_outputs = {name: predict(model, split, task, context.device) for name, split in tests.items()}
    minutes = (time.perf_counter() - started) / 60
    report(
        context,
        f"{task.name} lr={learning_rate:g} seed={seed}: "
        f"{', '.join(f'{k}={v:.4f}' for k, v in metrics.items())} ({minutes:.2f} min)",
    )
    run = {
        "learning_rate": learning_rate,
        "seed": seed,
        "metrics": metrics,
        "score": task_score(metrics),
        "minutes": minutes,
    }
    return run, test_outputs


def summarize_task(
    task: GlueTask, settings: FineTuneSettings, runs: list[dict], train_examples: int, started: float
) -> dict:
    per_lr = [median_over_seeds(task, learning_rate, runs) for learning_rate in settings.learning_rates]
    best = max(per_lr, key=lambda entry: nan_as_worst(entry["score"]))
    minutes = (time.perf_counter() - started) / 60
    return {
        "status": "ok",
        "metrics": list(task.metric_names),
        "settings": dataclasses.asdict(settings),
        "train_examples": train_examples,
        "runs": runs,
        "median_per_learning_rate": per_lr,
        "chosen_learning_rate": best["learning_rate"],
        "dev": best["metrics"],
        "score": best["score"],
        "minutes": minutes,
        "minutes_per_run": float(np.mean([run["minutes"] for run in runs])),
    }


def median_over_seeds(task: GlueTask, learning_rate: float, runs: list[dict]) -> dict:
    """Per-metric median over this learning rate's seeds; the score is the mean of those medians."""
    chosen = [run["metrics"] for run in runs if run["learning_rate"] == learning_rate]
    medians = {name: float(np.median([metrics[name] for metrics in chosen])) for name in task.metric_names}
    return {"learning_rate": learning_rate, "metrics": medians, "score": task_score(medians)}


def task_score(metrics: dict[str, float]) -> float:
    """GLUE's task score: the unweighted mean of the task's metrics (MRPC F1/acc, STS-B Pearson/Spearman)."""
    return float(np.mean(list(metrics.values())))


def nan_as_worst(value: float) -> float:
    # A constant prediction makes Pearson/Spearman undefined (NaN); it must never be chosen.
    return -math.inf if math.isnan(value) else value


def glue_average(task_results: dict[str, dict]) -> float | None:
    """Mean of the task scores over the tasks that ran; None if none did."""
    scores = [result["score"] for result in task_results.values() if result["status"] == "ok"]
    return float(np.mean(scores)) if scores else None


def report(context: RunContext, message: str) -> None:
    say(f"[glue] {message}", context.show_progress)


# ---------------------------------------------------------------- model and data


@dataclass
class EncodedSplit:
    features: dict[str, list[list[int]]]  # tokenizer outputs (input_ids, token_type_ids, attention_mask), unpadded
    labels: list[int] | list[float] | None
    indices: list[str] | None  # test index column
    pad_token_id: int

    def __len__(self) -> int:
        return len(self.features["input_ids"])


def encode(split: GlueSplit, tokenizer, max_length: int) -> EncodedSplit:
    """Tokenize once, without padding: each batch is padded to its own longest example."""
    features = tokenizer(*split.texts, truncation=True, max_length=max_length)
    return EncodedSplit(dict(features), split.labels, split.indices, tokenizer.pad_token_id)


def collate(split: EncodedSplit, rows: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    longest = max(len(split.features["input_ids"][row]) for row in rows)
    batch = {}
    for key, values in split.features.items():
        pad = split.pad_token_id if key == "input_ids" else 0  # attention_mask 0 hides the padding
        batch[key] = torch.tensor([values[row] + [pad] * (longest - len(values[row])) for row in rows])  # (B, T)
    return {key: tensor.to(device) for key, tensor in batch.items()}


def load_model(model_dir: Path, task: GlueTask, init: str, dropout: float) -> torch.nn.Module:
    num_labels = 1 if task.is_regression else len(task.labels)
    problem_type = "regression" if task.is_regression else "single_label_classification"
    config = AutoConfig.from_pretrained(model_dir, num_labels=num_labels, problem_type=problem_type)
    # The architecture's own dropout entries (other encoders, RoBERTa's say, name theirs as BERT does). BERT's
    # classifier_dropout stays unset: its head then takes hidden_dropout_prob too.
    config.update(ADAPTERS.get(config.model_type, Bert).dropout_settings(dropout, dropout))
    with quiet_transformers():
        if init == "random":
            return AutoModelForSequenceClassification.from_config(config)
        model, loading_info = AutoModelForSequenceClassification.from_pretrained(
            model_dir, config=config, output_loading_info=True
        )
    check_only_head_is_new(model_dir, loading_info["missing_keys"])
    return model


@contextmanager
def quiet_transformers():
    """Hide the load report and progress bar: a new classifier head is expected, and checked by us instead."""
    logging = transformers.logging
    with restoring(logging.get_verbosity, logging.set_verbosity, logging.ERROR), progress_bars_off():
        yield


def progress_bars_off():
    """transformers' progress bars off inside a ``with`` block, back as they were after it."""
    logging = transformers.logging
    return restoring(
        logging.is_progress_bar_enabled,
        lambda on: logging.enable_progress_bar() if on else logging.disable_progress_bar(),
        False,
    )


NEW_HEAD_PREFIXES = ("classifier.", "bert.pooler.")  # a checkpoint saved from BertForMaskedLM has no pooler


def check_only_head_is_new(model_dir: Path, missing_keys: Iterable[str]) -> None:
    # A checkpoint saved from BertForPreTraining has no classifier; anything else missing
    # means the encoder would silently be random, which would make the scores meaningless.
    not_head = sorted(key for key in missing_keys if not key.startswith(NEW_HEAD_PREFIXES))
    if not_head:
        raise UserError(
            f"{model_dir}: checkpoint lacks encoder weights ({', '.join(not_head[:3])}, ...); "
            "pass a folder saved from an mlmlab BERT model, or use init='random'"
        )


def train_model(
    model,
    train: EncodedSplit,
    settings: FineTuneSettings,
    learning_rate: float,
    seed: int,
    device,
    show_progress: bool = False,
    desc: str = "fine-tune",
) -> None:
    """AdamW with linear warmup and decay over epochs of shuffled, dynamically padded batches (a bar of the
    run's steps on stderr, its epoch beside it, with ``show_progress``)."""
    steps_per_epoch = math.ceil(len(train) / settings.batch_size)
    total_steps = steps_per_epoch * settings.epochs
    # fused AdamW: on CPU the unfused update of the 30k-row embedding costs more than the model step.
    optimizer = torch.optim.AdamW(parameter_groups(model, settings.weight_decay), lr=learning_rate, fused=True)
    scheduler = transformers.get_linear_schedule_with_warmup(
        optimizer, round(settings.warmup_ratio * total_steps), total_steps
    )
    shuffle = torch.Generator().manual_seed(seed)
    label_dtype = torch.float32 if model.config.problem_type == "regression" else torch.long
    model.train()
    with progress_bar(desc, total_steps, show_progress, unit="step") as bar:
        for epoch in range(settings.epochs):
            bar.set_postfix(epoch=f"{epoch + 1}/{settings.epochs}")
            for rows in torch.randperm(len(train), generator=shuffle).split(settings.batch_size):
                rows = rows.tolist()
                batch = collate(train, rows, device)
                labels = torch.tensor([train.labels[row] for row in rows], dtype=label_dtype, device=device)  # (B,)
                model(**batch, labels=labels).loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                bar.update()


@torch.inference_mode()
def predict(model, split: EncodedSplit, task: GlueTask, device) -> np.ndarray:
    """Class ids, or scores for regression, in file order."""
    model.eval()
    outputs = []
    for start in range(0, len(split), EVAL_BATCH_SIZE):
        rows = list(range(start, min(start + EVAL_BATCH_SIZE, len(split))))
        logits = model(**collate(split, rows, device)).logits  # (B, num_labels)
        outputs.append(logits[:, 0] if task.is_regression else logits.argmax(dim=-1))
    return torch.cat(outputs).cpu().numpy()


def dev_metrics(task: GlueTask, model, devs: dict[str, EncodedSplit], device) -> dict[str, float]:
    metrics = {}
    for split_name, split in devs.items():
        values = compute_metrics(task, split.labels, predict(model, split, task, device))
        suffix = f"_{split_name}" if len(devs) > 1 else ""
        metrics.update({f"{name}{suffix}": value for name, value in values.items()})
    return metrics


def compute_metrics(task: GlueTask, labels, predictions) -> dict[str, float]:
    """The task's dev metrics from scikit-learn / scipy, as plain floats."""
    return {name: float(METRIC_FUNCTIONS[name](labels, predictions)) for name in task.metrics}


# ---------------------------------------------------------------- outputs


def write_best_test_predictions(task, tests, runs, test_outputs, result, out_dir: Path) -> dict:
    """Submission files from the chosen learning rate's best dev run (GLUE's one-submission-per-task format)."""
    chosen_runs = [run for run in runs if run["learning_rate"] == result["chosen_learning_rate"]]
    best = max(chosen_runs, key=lambda run: nan_as_worst(run["score"]))
    folder = out_dir / "test_predictions"
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, split in tests.items():
        predictions = test_outputs[(best["learning_rate"], best["seed"])][name]
        path = folder / task.test_files[name]
        write_text_atomically(path, submission_text(task, split.indices, predictions))
        written.append(str(path))
    return {"learning_rate": best["learning_rate"], "seed": best["seed"], "files": written}


def submission_text(task: GlueTask, indices: list[str], predictions: np.ndarray) -> str:
    if task.is_regression:
        values = [f"{score:.3f}" for score in predictions]
    else:
        values = [task.labels[class_id] for class_id in predictions]
    return "index\tprediction\n" + "".join(f"{index}\t{value}\n" for index, value in zip(indices, values))


def write_results(results: dict, out_dir: Path) -> None:
    """Each file whole or as before: a study row and a reader of an earlier run's table never see half of one."""
    with writes_of(
        f"the GLUE results to {out_dir}", "the results written there before (tasks finished earlier) are kept"
    ):
        write_text_atomically(out_dir / "glue_results.json", jsonio.dumps(results, indent=2) + "\n")
        write_text_atomically(out_dir / "glue_results.md", format_glue_table(results))


def format_glue_table(results: dict) -> str:
    """Markdown: one column per task metric plus the GLUE average (x100), then per-task details and notes."""
    ran = {name: result for name, result in results["tasks"].items() if result["status"] == "ok"}
    columns = [(name, metric) for name, result in ran.items() for metric in result["metrics"]]
    header = ["Model", "init"] + [f"{name} {metric}" for name, metric in columns] + ["Average"]
    average = "–" if results["average"] is None else percent(results["average"])
    row = [results["model_dir"], results["init"]]  # the path as given: a basename is "model" for every run
    row += [percent(ran[name]["dev"][metric]) for name, metric in columns] + [average]
    lines = markdown.table(header, [row])
    lines += details_table(ran)
    lines.append(
        f"{SELECTION_NOTE} Metric values are medians over seeds {', '.join(map(str, results['seeds']))}; "
        "the average is the mean of the task scores (each the mean of the task's metrics)."
    )
    missing = [
        f"{name} ({', '.join(result['missing_files'])})"
        for name, result in results["tasks"].items()
        if result["status"] == "missing"
    ]
    if missing:
        lines.append(f"Missing (files absent, not run): {'; '.join(missing)}.")
    if results.get("max_train_examples"):
        lines.append(
            f"Trained on a fixed random sample of {results['max_train_examples']} training examples of each task "
            "(the same rows for every seed and model)."
        )
    return "\n".join(lines) + "\n"


def details_table(ran: dict[str, dict]) -> list[str]:
    body = []
    for name, result in ran.items():
        per_lr = ", ".join(
            f"{entry['learning_rate']:g}: {percent(entry['score'])}" for entry in result["median_per_learning_rate"]
        )
        settings = result["settings"]
        body.append(
            [
                name,
                per_lr,
                f"{result['chosen_learning_rate']:g}",
                str(settings["epochs"]),
                str(settings["batch_size"]),
                f"{result['minutes']:.1f}",
                f"{result['minutes_per_run']:.2f}",
            ]
        )
    return markdown.table(["Task", "score per lr (median)", "chosen lr", "epochs", "batch", "minutes", "min/run"], body)


def percent(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.1f}"
