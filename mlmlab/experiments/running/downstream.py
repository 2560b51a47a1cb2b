"""A run's GLUE fine-tuning and frozen probes in a study's cost: FLOPs counted from the task files, seconds timed here.

Pretraining's FLOP model leaves them out, yet GLUE took 15 minutes per run in a 4-arm CPU study.
What they cost is set by the tasks' files and the study's settings, so the dry run
reads them, with each arm's tokenizer:

- FLOPs (every dry run): per task, the rows a run fine-tunes on (the training file, or the
  max_train_examples sample; every epoch, learning rate and seed), each a training pass
  (TRAINING_PASSES forwards) at its batch's padded length, as glue.collate pads a batch to its
  longest row (one epoch's order drawn as train_model draws it); the dev rows each run predicts;
  and every split a probe reads, once per encoder (pretrained and random init), in the
  length-sorted batches of linear_probe.split_features. The probes' regressions are no matmul of
  the model: only the timing counts them.
- Seconds (``--time-steps N``): per task, N fine-tuning steps after probe.WARMUP_STEPS, and
  probe.TIMED_EVAL_BATCHES batches of dev rows and of every probe split, timed here on a
  random-init model of the arm's architecture (a forward costs the same whatever the weights),
  then scaled by the task's steps and rows. The probes' fits are timed on that sample and scaled
  by the training rows, a rough figure: lbfgs's iterations vary with the data.
"""

import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mlmlab.config import Config, ModelConfig
from mlmlab.data.resolve import tokenizer_dir_for
from mlmlab.data.tokenizer import load_tokenizer
from mlmlab.evaluate.glue import (
    EVAL_BATCH_SIZE,
    EncodedSplit,
    encode,
    glue_lengths,
    load_model,
    predict,
    refuse_inputs_past_positions,
    train_model,
)
from mlmlab.evaluate.glue_data import TASKS, TRAIN_FILE, missing_files, read_labeled
from mlmlab.evaluate.glue_settings import FineTuneSettings
from mlmlab.evaluate.linear_probe import RANDOM_INIT, load_encoder, probe_lengths, probe_task, read_task, split_features
from mlmlab.experiments.running.timing import TIMED_EVAL_BATCHES, WARMUP_STEPS
from mlmlab.experiments.study import Study
from mlmlab.model.flops import TRAINING_PASSES, encoder_forward_flops
from mlmlab.model.pretraining import build_model
from mlmlab.train.init import resolve_init
from mlmlab.utils.devices import clock, compute_device
from mlmlab.utils.progress import progress_bar

# Each probe task is fitted on the features of the pretrained encoder and of each random-init draw (run_probes).
# Random-init features are kept per process and shared by runs of one model config, so counting them for every
# run is an upper bound.


@dataclass(frozen=True)
class TaskWork:
    """What one GLUE task, or one probe task, asks of a run's encoder."""

    name: str
    runs: int  # GLUE: fine-tuning runs (learning rates x seeds); probes: the encoders whose features are fitted
    steps: int  # GLUE: fine-tuning steps per run; probes: 0
    trained_rows: int  # GLUE: rows through those steps (every epoch)
    trained_length: float  # their mean tokens, each padded to its batch's longest
    forward_rows: int  # rows through forward passes only: GLUE's dev predictions, every split of a probe
    forward_length: float
    fit_rows: int = 0  # probes: the training rows of each regression

    def flops(self, model: ModelConfig) -> float:
        trained = TRAINING_PASSES * self.trained_rows * encoder_forward_flops(model, self.trained_length)
        return self.runs * (trained + self.forward_rows * encoder_forward_flops(model, self.forward_length))


@dataclass(frozen=True)
class Downstream:
    """A study's GLUE and probe tasks as one tokenizer reads them."""

    glue: list[TaskWork]
    probes: list[TaskWork]

    def flops(self, model: ModelConfig) -> dict:
        """{"glue", "probes"}: FLOPs per run of a model of this config."""
        return {
            "glue": sum(work.flops(model) for work in self.glue),
            "probes": sum(work.flops(model) for work in self.probes),
        }


def downstream_work(study: Study, tokenizer_setting: str) -> Downstream:
    """The study's GLUE tasks (those with files in glue_dir, as a run skips the others) and probe tasks."""
    if not Path(study.glue_dir or "").is_dir():  # a run refuses to start then (runner.py): nothing to count
        return Downstream([], [])
    tokenizer = load_tokenizer(tokenizer_dir_for(tokenizer_setting))
    return Downstream(glue_work(study, tokenizer), probe_work(study, tokenizer))


def glue_settings(study: Study) -> dict[str, FineTuneSettings]:
    """Each GLUE task's fine-tuning settings as the study's runs get them (runner.glue_for)."""
    return study.glue.per_task() if study.glue.tasks else {}


def check_positions(study: Study, arm_configs: dict[str, Config]) -> None:
    """Every arm's model must take the inputs its runs' GLUE tasks and probes will read (the check glue and probe
    make), before the first run: else each run trains, then fails at GLUE, and every rerun trains it again."""
    glue, probes = glue_lengths(glue_settings(study)), probe_lengths(study.probe.tasks if study.probe else [])
    for arm, cfg in arm_configs.items() if glue or probes else ():
        positions = resolve_init(cfg).model.max_position_embeddings  # train.init's folder's, where it names one
        model, more = f"arm {arm}'s model", f"give arm {arm} a model of more positions (model.max_position_embeddings)"
        refuse_inputs_past_positions(glue, model, positions, f"set glue: {{max_length: {positions}}}, or {more}")
        refuse_inputs_past_positions(
            probes, model, positions, f"a probe reads its task's GLUE length; {more}, or leave the task out of probe"
        )


def glue_work(study: Study, tokenizer) -> list[TaskWork]:
    data_dir, works = Path(study.glue_dir), []
    for name, settings in glue_settings(study).items():
        task, folder = TASKS[name], data_dir / name
        if missing_files(task, data_dir):
            continue
        train = row_lengths(
            encode(
                read_labeled(task, folder / TRAIN_FILE, study.glue.max_train_examples), tokenizer, settings.max_length
            )
        )
        devs = [
            row_lengths(encode(read_labeled(task, folder / file), tokenizer, settings.max_length))
            for file in task.dev_files.values()
        ]
        epoch_order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0)).numpy()
        dev_tokens = sum(padded_tokens(dev, np.arange(len(dev)), EVAL_BATCH_SIZE) for dev in devs)  # file order
        dev_rows = sum(map(len, devs))
        works.append(
            TaskWork(
                name,
                runs=len(settings.learning_rates) * len(study.glue.seeds),
                steps=settings.epochs * math.ceil(len(train) / settings.batch_size),
                trained_rows=settings.epochs * len(train),
                trained_length=padded_tokens(train, epoch_order, settings.batch_size) / len(train),
                forward_rows=dev_rows,
                forward_length=dev_tokens / dev_rows,
            )
        )
    return works


def probe_work(study: Study, tokenizer) -> list[TaskWork]:
    works = []
    for name in study.probe.tasks if study.probe else ():
        splits = {
            split: row_lengths(encoded)
            for split, encoded in read_task(TASKS[name], Path(study.glue_dir), tokenizer).splits.items()
        }
        rows = sum(map(len, splits.values()))
        tokens = sum(
            padded_tokens(lengths, np.argsort(lengths, kind="stable"), EVAL_BATCH_SIZE) for lengths in splits.values()
        )
        works.append(
            TaskWork(
                name,
                runs=1 + study.probe.random_inits,
                steps=0,
                trained_rows=0,
                trained_length=0.0,
                forward_rows=rows,
                forward_length=tokens / rows,
                fit_rows=len(splits["train"]),
            )
        )
    return works


def row_lengths(split: EncodedSplit) -> np.ndarray:
    return np.array([len(ids) for ids in split.features["input_ids"]])


def padded_tokens(lengths: np.ndarray, order: np.ndarray, batch_size: int) -> int:
    """Tokens of the batches of ``batch_size`` rows taken in ``order``, each padded to its longest row."""
    return int(
        sum(
            lengths[order[start : start + batch_size]].max() * len(order[start : start + batch_size])
            for start in range(0, len(order), batch_size)
        )
    )


# ----- timed here ------------------------------------------------------------------------------
def timed_downstream(cfg: Config, study: Study, work: Downstream, steps: int, show_progress: bool) -> dict:
    """{"glue", "probes"}: seconds per run of ``cfg``'s GLUE fine-tuning and probes, timed here on samples."""
    tokenizer, device = load_tokenizer(tokenizer_dir_for(cfg.data.tokenizer)), compute_device()
    tasks = len(work.glue) + len(work.probes)
    with (
        tempfile.TemporaryDirectory() as folder,
        progress_bar("time GLUE and probes", tasks, show_progress, unit="task") as bar,
    ):
        write_model_config(resolve_init(cfg).model, tokenizer, Path(folder))
        seconds = {"glue": 0.0, "probes": 0.0}
        settings = glue_settings(study)
        for task_work in work.glue:
            seconds["glue"] += timed_glue_task(
                Path(folder), task_work, settings[task_work.name], study, tokenizer, steps, device
            )
            bar.update()
        for task_work in work.probes:
            seconds["probes"] += timed_probe_task(Path(folder), task_work, study, tokenizer, device)
            bar.update()
    return seconds


def write_model_config(model: ModelConfig, tokenizer, folder: Path) -> None:
    """config.json of a model of this config: what glue.load_model and linear_probe.load_encoder build from."""
    with torch.random.fork_rng(devices=[]):  # building initialises weights from the global generator
        build_model(model, len(tokenizer), tokenizer.pad_token_id).config.save_pretrained(folder)


def timed_glue_task(
    folder: Path, work: TaskWork, settings: FineTuneSettings, study: Study, tokenizer, steps: int, device
) -> float:
    """Seconds of the task's fine-tuning runs (steps and dev predictions) in one study run."""
    task, batch = TASKS[work.name], settings.batch_size
    sample = encode(
        read_labeled(task, Path(study.glue_dir) / task.name / TRAIN_FILE, (WARMUP_STEPS + steps) * batch),
        tokenizer,
        settings.max_length,
    )
    warm_rows = min(WARMUP_STEPS * batch, len(sample) // 2)  # a small file still leaves rows to time
    one_epoch = dataclasses.replace(settings, epochs=1)
    with torch.random.fork_rng(devices=[]):  # weights from the global generator: handed back untouched
        model = load_model(folder, task, RANDOM_INIT, settings.dropout).to(device)
    train_model(model, rows_of(sample, slice(0, warm_rows)), one_epoch, settings.learning_rates[0], 0, device)
    timed = rows_of(sample, slice(warm_rows, None))
    start = clock(device)
    train_model(model, timed, one_epoch, settings.learning_rates[0], 0, device)
    step_seconds = (clock(device) - start) / math.ceil(len(timed) / batch)
    dev_file = Path(study.glue_dir) / task.name / next(iter(task.dev_files.values()))
    dev = encode(read_labeled(task, dev_file, TIMED_EVAL_BATCHES * EVAL_BATCH_SIZE), tokenizer, settings.max_length)
    start = clock(device)
    predict(model, dev, task, device)
    row_seconds = (clock(device) - start) / len(dev)
    return work.runs * (work.steps * step_seconds + work.forward_rows * row_seconds)


def timed_probe_task(folder: Path, work: TaskWork, study: Study, tokenizer, device) -> float:
    """Seconds of the task's probes (every encoder's features, their fits) in one study run."""
    sample = read_task(TASKS[work.name], Path(study.glue_dir), tokenizer, max_rows=TIMED_EVAL_BATCHES * EVAL_BATCH_SIZE)
    encoder = load_encoder(folder, RANDOM_INIT, study.probe.seed, device)
    split_features(encoder, sample.splits["train"], device, "", False)  # warm-up: thread pools, allocator
    start = clock(device)
    features = {split: split_features(encoder, encoded, device, "", False) for split, encoded in sample.splits.items()}
    row_seconds = (clock(device) - start) / sum(map(len, sample.splits.values()))
    start = time.perf_counter()
    probe_task(sample, features, study.probe.pooling, study.probe.seed)
    fit_seconds = (time.perf_counter() - start) * work.fit_rows / len(sample.splits["train"])
    return work.runs * (work.forward_rows * row_seconds + fit_seconds)


def rows_of(split: EncodedSplit, rows: slice) -> EncodedSplit:
    return EncodedSplit(
        {key: values[rows] for key, values in split.features.items()}, split.labels[rows], None, split.pad_token_id
    )
