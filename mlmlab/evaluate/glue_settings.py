"""GLUE fine-tuning settings, defined once: each task's recipe, and what a run chooses over it.

``mlmlab glue``'s options and a study's ``glue:`` block are both a ``GlueSettings`` and take
their defaults from it (tests/test_glue.py holds them to it). Apart from glue.py so that the
command line reads them without importing transformers.

Defaults follow cramming's "GLUE-sane" spirit (one small recipe for every task, a few
seeds, no per-task tuning) scaled down so that the tiny preset runs on a laptop CPU.
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from mlmlab.config import BELOW_ONE, POSITIVE, SEEDS, at_least, check_range
from mlmlab.errors import UserError
from mlmlab.evaluate.glue_data import TASKS


@dataclass(frozen=True)
class FineTuneSettings:
    """One task's fine-tuning recipe."""

    learning_rates: tuple[float, ...]  # the grid searched; each is run with every seed
    epochs: int
    batch_size: int
    max_length: int  # longer inputs are truncated (longest segment first); batches pad to their longest
    warmup_ratio: float = 0.1  # linear warmup over this fraction of steps, then linear decay to zero (BERT)
    weight_decay: float = 0.01  # AdamW decay, not applied to biases and LayerNorm weights (BERT)
    # Hidden and attention dropout while fine-tuning (BERT's 0.1), whatever the model was pretrained
    # with: mlmlab pretrains without dropout by default, and GLUE should compare pretrained models,
    # not fine-tuning recipes.
    dropout: float = 0.1


# Small tasks (<10k examples) get batch 16 and 5 epochs as in cramming; large ones 2 epochs
# at batch 32, which keeps SST-2 to minutes on a CPU. RTE gets 3 epochs: its long pairs make
# an epoch cost about twice MRPC's. Two learning rates: tiny models want the higher one,
# base-size ones the lower.
LEARNING_RATES = (5e-5, 1e-4)
TASK_SETTINGS: dict[str, FineTuneSettings] = {
    "CoLA": FineTuneSettings(LEARNING_RATES, epochs=5, batch_size=16, max_length=128),
    "SST-2": FineTuneSettings(LEARNING_RATES, epochs=2, batch_size=32, max_length=64),  # short sentences
    "MRPC": FineTuneSettings(LEARNING_RATES, epochs=5, batch_size=16, max_length=128),
    "STS-B": FineTuneSettings(LEARNING_RATES, epochs=5, batch_size=16, max_length=128),
    "QQP": FineTuneSettings(LEARNING_RATES, epochs=2, batch_size=32, max_length=128),
    "MNLI": FineTuneSettings(LEARNING_RATES, epochs=2, batch_size=32, max_length=128),
    "QNLI": FineTuneSettings(LEARNING_RATES, epochs=2, batch_size=32, max_length=128),
    "RTE": FineTuneSettings(LEARNING_RATES, epochs=3, batch_size=16, max_length=128),
    "WNLI": FineTuneSettings(LEARNING_RATES, epochs=5, batch_size=16, max_length=128),
}


@dataclass(frozen=True)
class GlueSettings:
    """The tasks to fine-tune on and the settings that override every task's own (None keeps the task's)."""

    # Task names in any case, or "all"; empty: none (a study that runs no GLUE). `mlmlab glue --task`
    # defaults to all instead: fine-tuning is what the command is run for.
    tasks: Sequence[str] | str = ()
    # One seed, as a study has always defaulted to: a study's run keys hold its GLUE seeds
    # (experiments/running/identity.py), and those of the studies that run no GLUE (adm-study-v3,
    # arch-plateau-wp8k) were made with [0]; another default would make their finished runs look
    # foreign. A median over seeds asks for them: --seeds 0 1 2 (three times the cost).
    seeds: Sequence[int] = (0,)
    learning_rates: Sequence[float] | None = None
    epochs: int | None = None
    batch_size: int | None = None
    max_length: int | None = None
    max_train_examples: int | None = None  # fine-tune on a fixed random sample of N examples (CPU budgets)
    dropout: float | None = None  # hidden and attention dropout while fine-tuning (the tasks': BERT's 0.1)

    def per_task(self) -> dict[str, FineTuneSettings]:
        """Each task's fine-tuning settings with these overrides applied, or a UserError naming the bad setting.

        Also what a study checks when it is read, so a bad setting fails before hours of pretraining.
        """
        self._check_seeds()
        self._check_numbers()
        overrides = {
            "learning_rates": None if self.learning_rates is None else tuple(self.learning_rates),
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "max_length": self.max_length,
            "dropout": self.dropout,
        }
        return {name: with_overrides(TASK_SETTINGS[name], overrides) for name in resolve_task_names(self.tasks)}

    def _check_seeds(self) -> None:
        seeds = self.seeds
        if not isinstance(seeds, (list, tuple)) or not seeds or not all(_is_int(seed) for seed in seeds):
            raise UserError(f"seeds {seeds!r} must be a non-empty list of integers, e.g. --seeds 0 1 2")
        for seed in seeds:  # transformers.set_seed seeds numpy, which takes only 32-bit seeds
            check_range("seeds", seed, SEEDS, 0)

    def _check_numbers(self) -> None:
        counts = {
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "max_length": self.max_length,
            "max_train_examples": self.max_train_examples,
        }
        for name, value in counts.items():
            if value is not None and not _is_int(value):
                raise UserError(f"{name}={value!r} must be a whole number >= 1")
            check_range(name, value, at_least(1), 1)  # 0, or 10**30, as a config's counts are refused
        rates = self.learning_rates
        if rates is not None and (not isinstance(rates, (list, tuple)) or not all(_is_number(lr) for lr in rates)):
            raise UserError(f"learning_rates {rates!r} must be a list of positive numbers")
        for learning_rate in rates or ():  # an infinite one trained to a constant prediction, reported as a score
            check_range("learning_rates", learning_rate, POSITIVE, 1e-4)
        if self.dropout is not None and not _is_number(self.dropout):
            raise UserError(f"dropout={self.dropout!r} must be a number; BERT fine-tunes with 0.1")
        check_range("dropout", self.dropout, BELOW_ONE, 0.1)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def resolve_task_names(tasks) -> list[str]:
    """Canonical names in GLUE order; accepts "all", a name, or names in any case, with or without the hyphen."""
    if isinstance(tasks, str):
        tasks = list(TASKS) if tasks.lower() == "all" else [tasks]
    by_key = {name.lower().replace("-", ""): name for name in TASKS}
    unknown = [name for name in tasks if name.lower().replace("-", "") not in by_key]
    if unknown or not tasks:
        raise UserError(
            f"unknown GLUE task(s) {', '.join(unknown) or '(none given)'}; use 'all' or some of {', '.join(TASKS)}"
        )
    wanted = {by_key[name.lower().replace("-", "")] for name in tasks}
    return [name for name in TASKS if name in wanted]


def with_overrides(settings: FineTuneSettings, overrides: dict) -> FineTuneSettings:
    chosen = {field: value for field, value in overrides.items() if value is not None}
    settings = dataclasses.replace(settings, **chosen)
    if not settings.learning_rates or settings.epochs < 1 or settings.batch_size < 1 or settings.max_length < 8:
        raise UserError(
            f"fine-tuning settings {settings} are invalid; give at least one learning rate, "
            "epochs and batch_size >= 1 and max_length >= 8"
        )
    return settings
