"""Time to quality: the training wall time each mlmlab recipe takes to reach the held-out MLM loss that each of two
transformers recipes (the anchors) reaches in ``--anchor-minutes``, all arms trained one after another in this process
on this host.

Arms, each on the same corpus and tokenizer (default: the sample bundled with mlmlab and its vocabulary):

- ``modernbert-anchor``: transformers at its best for this job, the strongest anchor: ``transformers.Trainer`` +
  ``DataCollatorForLanguageModeling`` at the recommended recipe's mask rate (30%, 80/10/10) +
  ``ModernBertForMaskedLM`` at fast-tiny's shape (layers, width, heads, GeGLU width, vocabulary and positions) with
  every other setting transformers' ModernBERT default (no dropout, its attention windows and RoPE bases) and its
  sparse prediction head on (``sparse_prediction=True``, which the pinned transformers 5.24 has: the head only on
  the masked positions), bf16 (``TrainingArguments(bf16=True)``) exactly where mlmlab's ``train.precision=auto``
  picks bf16, run_mlm's ``group_texts`` blocks of 128, and the recommended recipe's LR, AdamW settings, batch and LR
  schedule. Its recipe is fast-tiny's: against it, the recommended arm is mlmlab's engine at the anchor's own recipe.
- ``anchor``: HF's run_mlm recipe as a user runs it: the same ``Trainer`` and collator at 15% + ``BertForMaskedLM``
  at mlmlab's tiny size, transformers' default dropout (0.1) and precision (fp32), the same ``group_texts`` blocks
  (each line of text tokenized with its special tokens, concatenated, cut into blocks of 128). Its optimizer
  settings, batch and LR schedule are mlmlab's BERT-tiny values (run_mlm's default LR of 5e-5 would be a straw man at
  this size: it barely moves a tiny model in an hour).
- ``anchor-recipe``: mlmlab's engine at the BERT anchor's recipe: ``--config tiny`` with MLM only on packed blocks,
  dropout 0.1, 15% dynamic masking, fp32.
- ``recommended``: ``--config fast-tiny``, the recipe mlmlab's studies back (mlmlab/configs/fast-tiny.yaml says
  which study backs each choice).

Each anchor trains for ``--anchor-minutes`` M. Each mlmlab arm trains until its held-out loss reaches both anchors'
final ones, or for M minutes (``train.max_minutes``: its LR schedule spans M minutes whenever it stops).

The clock: each arm's training wall time, from the start of its training (after data preparation and model set-up)
to each evaluation, less the time spent evaluating. Every arm is evaluated at time 0, then every
``--eval-every-seconds`` (the anchors) or ``--arm-eval-every-seconds`` (the mlmlab arms, 6 times as often by default:
an arm that reaches the target within one anchor interval would otherwise have its time read off a single straight
line from the untrained model's loss), and at the end of its training, by mlmlab's own held-out evaluator
(``evaluate_mlm``) on the same held-out blocks under the same fixed uniform 15% masks, whatever trained the model.
The anchors' LR schedule is mlmlab's time-budget schedule (``train.max_minutes``: warmup over steps, then hold, then
decay over the last 20% of the time) on that clock; run_mlm's step schedules need a step count, which M minutes hold
only in hindsight.

The time at which an arm reaches a loss is linearly interpolated between the two evaluations around the crossing.
The script prints, per anchor, its held-out loss at 25%, 50% and 100% of its budget and every arm's time to each,
and each arm's evaluation time it did not count; then, per anchor, the evaluations around each mlmlab arm's crossing
of the anchor's final loss (the range its ratio is known to lie in, whatever the curve did between them); then one
line per anchor, the strongest first: the anchor's time to its final loss over each mlmlab arm's. That ratio is read
only against an anchor that has left the unigram plateau (its final held-out MLM accuracy above
``LEFT_PLATEAU_ACCURACY``): a plateau loss is reached early by any recipe that leaves the plateau, so against an
anchor still on it the line says so instead. It writes a plot of held-out loss against training wall time
(time_to_loss.png) and every curve (time_to_loss.json) to ``--out``.

    python benchmarks/time_to_loss.py                        # M = 60 minutes: up to four hours in all
    python benchmarks/time_to_loss.py --anchor-minutes 10 --eval-every-seconds 20
    python benchmarks/time_to_loss.py --corpus ../shared/data/enwiki_sample/train.txt.gz \\
        --valid-corpus ../shared/data/enwiki_sample/valid.txt.gz --tokenizer docs/glue-tiny-wp8k/vocab.txt
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile
from itertools import chain
from pathlib import Path

import torch
import transformers
from torch.optim.lr_scheduler import LambdaLR
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    ModernBertConfig,
    ModernBertForMaskedLM,
    PrinterCallback,
    TrainerCallback,
    TrainingArguments,
)

from mlmlab import choices
from mlmlab.config import POSITIVE, Config, at_least, from_dict, number_argument, read_yaml, set_dotted
from mlmlab.data.corpus import read_paragraph_documents
from mlmlab.data.resolve import SAMPLE_TRAIN, prepare_datasets
from mlmlab.errors import UserError
from mlmlab.evaluate.perplexity import evaluate_mlm, evaluated_batches, fixed_mask_batches
from mlmlab.masking.evaluation import EVAL_RATE, EVAL_SEED
from mlmlab.masking.select import token_info_for
from mlmlab.model.pretraining import padded_vocab_size
from mlmlab.train.launch import PRECISIONS, Precision, release_other_precision, resolve_precision
from mlmlab.train.loop import Trainer
from mlmlab.train.optim import lr_factor
from mlmlab.utils.allocator import reexec_with_malloc_tuning
from mlmlab.utils.devices import clock, compute_device, describe_cpu
from mlmlab.utils.files import building, require_output

DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "time_to_loss"
EVALUATIONS_PER_BUDGET = 20  # --eval-every-seconds' default: this many evaluations over an anchor's budget
# --arm-eval-every-seconds' default: the mlmlab arms are evaluated this many times as often as the anchors. At one
# evaluation every 3 minutes fast-tiny passed a 60-minute anchor's loss within its first interval (6.14 against 6.58
# at 3.00 minutes), which brackets its ratio only as 20x or more. Their evaluations cost 4-8 s (the BERT anchor's 33 s).
ARM_EVALUATIONS_PER_ANCHOR_INTERVAL = 6
MILESTONES = (0.25, 0.5, 1.0)  # shares of an anchor's budget whose held-out loss every arm is timed to
LINES_PER_MAP = 1000  # run_mlm groups the lines of each of datasets.map's batches, 1,000 by default
# Each arm: a preset and the settings that make it the arm. run_mlm's recipe is the BERT anchor's and the engine's
# arm's; the recommended recipe is the ModernBERT anchor's and its own arm's.
RUN_MLM_SETTINGS = {"data.objective": choices.MLM, "model.dropout": 0.1, "train.precision": choices.FP32}
ANCHORS = {"modernbert-anchor": ("fast-tiny", {}), "anchor": ("tiny", RUN_MLM_SETTINGS)}  # the strongest first
MLMLAB_ARMS = {"anchor-recipe": ("tiny", RUN_MLM_SETTINGS), "recommended": ("fast-tiny", {})}
LABELS = {
    "modernbert-anchor": "ModernBERT anchor (transformers)",
    "anchor": "BERT anchor (transformers, run_mlm)",
    "anchor-recipe": "mlmlab, run_mlm's recipe (tiny)",
    "recommended": "mlmlab, recommended recipe (fast-tiny)",
}
LABEL_WIDTH = max(map(len, LABELS.values()))
RATIO_LABELS = {"recommended": "recommended recipe", "anchor-recipe": "run_mlm's recipe"}  # the ratio lines' order
ANCHOR_NAMES = {"modernbert-anchor": "the ModernBERT anchor", "anchor": "the run_mlm BERT anchor"}
# An anchor whose final held-out MLM accuracy is above this has left the unigram plateau, and only then is a ratio
# read against its loss. The plateau predicts every target as a frequent token: its accuracy is about 0.15 with an
# 8k vocabulary (arch-plateau-wp8k) and the BERT anchors that ended on it scored 0.142-0.150; rate-schedule-v4's gate
# for "learned past the plateau" was 0.25 (its runs ended at 0.33-0.38). 0.20 is clear of the plateau's spread.
LEFT_PLATEAU_ACCURACY = 0.20
# Each anchor's transformers classes, and the settings it takes beyond its shape: the rest are transformers' defaults.
# ModernBERT's sparse prediction runs its head on the masked positions only, as mlmlab's; transformers 5.24 has it.
ANCHOR_MODELS = {
    choices.BERT: (BertConfig, BertForMaskedLM, {}),
    choices.MODERNBERT: (ModernBertConfig, ModernBertForMaskedLM, {"sparse_prediction": True}),
}
NEVER = 10**9  # an anchor's step budget: its callback stops it on time instead


def arm_config(preset: str, settings: dict, args, run_dir: Path) -> Config:
    """``preset`` with the arm's ``settings``, the benchmark's data and its time budget."""
    tree = read_yaml(preset)
    data = {"data.corpus": args.corpus, "data.valid_corpus": args.valid_corpus, "data.tokenizer": args.tokenizer}
    budget = {
        "train.max_minutes": args.anchor_minutes,
        "train.eval_every": 0,  # the benchmark evaluates, at wall-clock intervals
        "train.save_every": 0,
        "train.report_to": "none",
        "train.out_dir": str(run_dir),
    }
    for key, value in {**settings, **{k: v for k, v in data.items() if v}, **budget}.items():
        set_dotted(tree, key, value)
    return from_dict(tree)


class HeldOut:
    """The one held-out evaluation of every arm: mlmlab's evaluate_mlm on the same blocks under the fixed masks."""

    def __init__(self, store, tokenizer, cfg: Config, max_batches: int | None):
        self.store, self.info = store, token_info_for(tokenizer, cfg.masking.mask_unk)
        self.batch_size, self.max_batches = cfg.train.eval_batch_size, max_batches

    def evaluate(self, model) -> dict:
        device = next(model.parameters()).device
        return evaluate_mlm(
            model, self.store, self.info, batch_size=self.batch_size, max_batches=self.max_batches, device=device
        )

    def describe(self) -> dict:
        """What was evaluated: the prepared set, its blocks, the masks' seed and rate, and a hash of the masked
        blocks themselves (ids and labels), computed afresh."""
        digest = hashlib.sha256()
        for batch in fixed_mask_batches(self.store, self.info, self.batch_size, self.max_batches, "cpu"):
            digest.update(batch["input_ids"].numpy().tobytes() + batch["labels"].numpy().tobytes())
        batches = evaluated_batches(len(self.store), self.batch_size, self.max_batches)
        return {
            "dataset": self.store.meta["hash"][:16],
            "blocks": min(batches * self.batch_size, len(self.store)),
            "mask_seed": EVAL_SEED,
            "mask_rate": EVAL_RATE,
            "masks_sha256": digest.hexdigest(),
        }


class Curve:
    """One arm's held-out loss against its training wall time: the time since ``start``, less its evaluations'."""

    def __init__(self, held_out: HeldOut, every_seconds: float, target: float | None = None):
        self.held_out, self.every_seconds, self.target = held_out, every_seconds, target
        self.points: list[dict] = []
        self.eval_seconds = 0.0  # spent evaluating: not training time
        self._started = None
        self.device = compute_device()

    def start(self, model) -> None:
        """The clock starts at the untrained model's evaluation, its first point."""
        self.evaluate(model, step=0)

    def training_seconds(self) -> float:
        return 0.0 if self._started is None else clock(self.device) - self._started - self.eval_seconds

    def after_step(self, model, step: int, final: bool) -> bool:
        """An evaluation when one is due (and after the arm's last step); whether the target loss is reached."""
        if final or self.training_seconds() >= self.points[-1]["train_seconds"] + self.every_seconds:
            self.evaluate(model, step)
        return self.target is not None and self.points[-1]["mlm_loss"] <= self.target

    def evaluate(self, model, step: int) -> None:
        now = clock(self.device)
        self._started = now if self._started is None else self._started
        stamp = now - self._started - self.eval_seconds
        figures = self.held_out.evaluate(model)
        spent = clock(self.device) - now
        self.points.append(
            {
                "step": step,
                "train_seconds": stamp,
                "wall_seconds": now - self._started,  # = train_seconds + every earlier evaluation's eval_seconds
                "eval_seconds": spent,
                **{key: figures[key] for key in ("mlm_loss", "mlm_accuracy", "masked_tokens")},
            }
        )
        self.eval_seconds += spent


def anchor_blocks(corpus: list, tokenizer, block_size: int) -> list[dict]:
    """run_mlm's training set without --line_by_line: each line of text (here each paragraph mlmlab's corpus reader
    yields) tokenized with its special tokens, then each batch of lines concatenated and cut into blocks of
    ``block_size``, the batch's remainder dropped (its ``group_texts``)."""
    lines = [paragraph for document in read_paragraph_documents(corpus) for paragraph in document]
    blocks = []
    for first in range(0, len(lines), LINES_PER_MAP):
        encoded = tokenizer(lines[first : first + LINES_PER_MAP], return_special_tokens_mask=True)
        grouped = group_texts({key: encoded[key] for key in encoded.keys()}, block_size)
        blocks += [dict(zip(grouped, values)) for values in zip(*grouped.values())]
    return blocks


def group_texts(examples: dict, block_size: int) -> dict:
    """run_mlm's group_texts: every field's lists concatenated and cut into blocks of ``block_size``."""
    concatenated = {key: list(chain(*examples[key])) for key in examples}
    total = len(concatenated["input_ids"]) // block_size * block_size
    return {key: [ids[i : i + block_size] for i in range(0, total, block_size)] for key, ids in concatenated.items()}


def anchor_model(cfg: Config, tokenizer) -> BertForMaskedLM | ModernBertForMaskedLM:
    """transformers' masked-LM class of the preset's architecture at the preset's shape, every other setting and the
    initialisation transformers' defaults (BERT: dropout 0.1; ModernBERT: no dropout) and the anchor's own settings
    (``ANCHOR_MODELS``)."""
    m = cfg.model
    config_class, model_class, settings = ANCHOR_MODELS[m.architecture]
    # Token ids as a user sets them for a vocabulary of their own (ModernBERT's defaults are ids of its 50k one);
    # the masked LM reads only the padding id
    tokens = {"pad_token_id": tokenizer.pad_token_id}
    if m.architecture == choices.MODERNBERT:
        tokens |= {
            "cls_token_id": tokenizer.cls_token_id,
            "bos_token_id": tokenizer.cls_token_id,
            "sep_token_id": tokenizer.sep_token_id,
            "eos_token_id": tokenizer.sep_token_id,
        }
    return model_class(
        config_class(
            vocab_size=padded_vocab_size(len(tokenizer), m.pad_vocab_multiple),  # mlmlab's rows, so the same size
            hidden_size=m.hidden_size,
            num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads,
            intermediate_size=m.intermediate_size,
            max_position_embeddings=m.max_position_embeddings,
            **tokens,
            **settings,
        )
    )


class TimeBudgetLR:
    """mlmlab's LR factor under a time budget (optim.lr_factor), for LambdaLR's step: progress is the share of
    ``budget_seconds`` the curve's clock has spent; warmup ends where mlmlab's does, at step warmup_steps."""

    def __init__(self, train, curve: Curve, budget_seconds: float):
        self.train, self.curve, self.budget_seconds = train, curve, budget_seconds
        self.warmup_end_progress = 0.0

    def __call__(self, step: int) -> float:
        t = self.train
        progress = min(1.0, self.curve.training_seconds() / self.budget_seconds)
        if step == t.warmup_steps:
            self.warmup_end_progress = progress
        return lr_factor(step, t.warmup_steps, progress, self.warmup_end_progress, t.decay_fraction, t.lr_schedule)


class TimeBudgetTrainer(transformers.Trainer):
    """transformers' Trainer with its LR schedule replaced by mlmlab's time-budget one; nothing else changed."""

    def __init__(self, *args, lr_lambda: TimeBudgetLR, **kwargs):
        super().__init__(*args, **kwargs)
        self.lr_lambda = lr_lambda

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            self.lr_scheduler = LambdaLR(optimizer or self.optimizer, self.lr_lambda)
        return self.lr_scheduler


class WallClockEvaluation(TrainerCallback):
    """The anchor's evaluations at wall-clock intervals on its curve's clock, and its stop when the budget is spent."""

    def __init__(self, curve: Curve, budget_seconds: float):
        self.curve, self.budget_seconds = curve, budget_seconds

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.curve.start(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        spent = self.curve.training_seconds() >= self.budget_seconds
        self.curve.after_step(model, state.global_step, final=spent)
        control.should_training_stop = spent


def run_anchor(cfg: Config, tokenizer, held_out: HeldOut, args, folder: Path) -> dict:
    """An anchor trained for the budget on the preset ``cfg``'s recipe; its curve, steps and precision."""
    t, budget = cfg.train, args.anchor_minutes * 60
    curve = Curve(held_out, args.eval_every_seconds)
    corpus = list(cfg.data.corpus) or [SAMPLE_TRAIN]
    # bf16 exactly where mlmlab's train.precision would train in it (auto: where this host's bf16 matmuls pay)
    precision = resolve_precision(t.precision)
    release_other_precision(precision.accelerate)  # the other anchor's Trainer may have built another precision
    training_args = TrainingArguments(
        output_dir=str(folder),
        per_device_train_batch_size=t.batch_size,
        learning_rate=t.lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_eps,
        max_grad_norm=t.max_grad_norm,
        bf16=precision.name == choices.BF16,
        use_cpu=compute_device().type == "cpu",  # transformers refuses bf16 on a CPU unless told it is one
        max_steps=NEVER,
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = TimeBudgetTrainer(
        model=anchor_model(cfg, tokenizer),
        args=training_args,
        train_dataset=anchor_blocks(corpus, tokenizer, cfg.data.max_seq_length),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=cfg.masking.rate),
        processing_class=tokenizer,
        callbacks=[WallClockEvaluation(curve, budget)],
        lr_lambda=TimeBudgetLR(t, curve, budget),
    )
    trainer.remove_callback(PrinterCallback)  # its end-of-training dict on stdout, before the table
    # read now: the next Accelerator's changes it
    trained_in = precision_name(next(p for p in PRECISIONS if p.accelerate == trainer.accelerator.mixed_precision))
    trainer.train()
    return summary(curve, trained_in, trainer.state.global_step)


def run_mlmlab(cfg: Config, held_out: HeldOut, every_seconds: float, target: float) -> dict:
    """An mlmlab arm trained until its held-out loss reaches ``target`` or its time budget is spent."""
    curve = Curve(held_out, every_seconds, target)
    trainer = Trainer(
        cfg,
        evaluator=None,
        show_progress=False,
        on_step_end=lambda run: curve.after_step(run.model, run.state.step, final=run.progress() >= 1.0),
    )
    if trainer.valid_store.meta["hash"] != held_out.store.meta["hash"]:
        trainer.close()
        raise UserError(
            f"the {cfg.model.architecture} arm prepared other held-out blocks than the anchors' (another tokenizer "
            "or length?); every arm must be evaluated on the same ones"
        )
    curve.start(trainer.model)
    trainer.train()
    return summary(curve, precision_name(trainer.precision), trainer.state.step)


def precision_name(precision: Precision) -> str:
    """The dtype an arm's matmuls ran in under ``precision`` (a Trainer's, resolved): "float32" or "bfloat16"."""
    return str(precision.dtype).removeprefix("torch.")


def summary(curve: Curve, precision: str, steps: int) -> dict:
    return {
        "precision": precision,
        "steps": steps,
        "trained_seconds": curve.points[-1]["train_seconds"],
        "eval_seconds": curve.eval_seconds,
        "held_out": curve.held_out.describe(),
        "evaluations": curve.points,
    }


def crossing(points: list[dict], target: float) -> tuple[dict, dict] | None:
    """The evaluations around the curve's first crossing of ``target``: the last above it and the first at or below
    it (the first evaluation twice if it starts there); None if no evaluation reached it."""
    for before, point in zip([points[0], *points], points):
        if point["mlm_loss"] <= target:
            return before, point
    return None


def time_to(points: list[dict], target: float) -> float | None:
    """The training seconds at which the curve first reaches ``target``: linearly interpolated between the two
    evaluations around the crossing; None if no evaluation reached it."""
    around = crossing(points, target)
    if around is None:
        return None
    before, point = around
    if before is point:
        return point["train_seconds"]
    drop = (before["mlm_loss"] - target) / (before["mlm_loss"] - point["mlm_loss"])
    return before["train_seconds"] + drop * (point["train_seconds"] - before["train_seconds"])


def loss_at(points: list[dict], seconds: float) -> float:
    """The curve's loss at ``seconds`` of training, linearly interpolated between evaluations; past the last
    evaluation, the last one's."""
    for before, point in zip(points, points[1:]):
        if point["train_seconds"] >= seconds:
            share = (seconds - before["train_seconds"]) / (point["train_seconds"] - before["train_seconds"])
            return before["mlm_loss"] + share * (point["mlm_loss"] - before["mlm_loss"])
    return points[-1]["mlm_loss"]


def milestones(anchor: list[dict], budget_seconds: float) -> dict:
    """{"25%": the anchor's loss at 25% of its budget, ...} from its evaluations; 100% is its final evaluation's."""
    return {
        f"{share:.0%}": loss_at(anchor, share * budget_seconds) if share < 1 else anchor[-1]["mlm_loss"]
        for share in MILESTONES
    }


def with_times(result: dict) -> dict:
    """``result`` with each anchor's milestone losses, and every arm's times to them and evaluations around its
    crossing of each anchor's final loss."""
    arms, budget = result["arms"], result["anchor_minutes"] * 60
    result["anchor_losses"] = {anchor: milestones(arms[anchor]["evaluations"], budget) for anchor in ANCHORS}
    for arm in arms.values():
        points = arm["evaluations"]
        arm["times_to"], arm["final_loss_between"] = {}, {}
        for anchor, losses in result["anchor_losses"].items():
            arm["times_to"][anchor] = {share: time_to(points, loss) for share, loss in losses.items()}
            around = crossing(points, losses["100%"])
            arm["final_loss_between"][anchor] = None if around is None else [p["train_seconds"] for p in around]
    return result


def final_accuracy(arm: dict) -> float:
    return arm["evaluations"][-1]["mlm_accuracy"]


def ratio_text(name: str, anchor: str, arms: dict, minutes: float) -> str:
    anchor_time, arm_time = arms[anchor]["times_to"][anchor]["100%"], arms[name]["times_to"][anchor]["100%"]
    if arm_time is None:
        return f"not reached in {minutes:g} min"
    return f"{anchor_time / arm_time:.2f}x" if arm_time > 0 else "reached at its first evaluation"


def ratio_line(anchor: str, arms: dict, minutes: float) -> str:
    """The anchor's time to its final loss over each mlmlab arm's, or, where the anchor ended on the plateau, why
    there is no ratio."""
    accuracy = final_accuracy(arms[anchor])
    if accuracy <= LEFT_PLATEAU_ACCURACY:
        return (
            f"{ANCHOR_NAMES[anchor]} has not left the unigram plateau (held-out MLM accuracy {accuracy:.3f}, not above "
            f"{LEFT_PLATEAU_ACCURACY:.2f}): no ratio is read against its loss"
        )
    return f"time to {ANCHOR_NAMES[anchor]}'s final held-out loss: " + ", ".join(
        f"{label} {ratio_text(name, anchor, arms, minutes)}" for name, label in RATIO_LABELS.items()
    )


def bracket_text(name: str, anchor: str, arms: dict) -> str:
    """The evaluations around an mlmlab arm's crossing of an anchor's final loss, and the ratios they allow."""
    between, anchor_time = arms[name]["final_loss_between"][anchor], arms[anchor]["times_to"][anchor]["100%"]
    label = RATIO_LABELS[name]
    if between is None:
        return f"{label} never"
    before, after = between
    if after == 0:
        return f"{label} reached it untrained"
    ratios = (
        f"{anchor_time / after:.2f}x or more"
        if before == 0
        else f"{anchor_time / after:.2f}-{anchor_time / before:.2f}x"
    )
    return f"{label} {before / 60:.2f}-{after / 60:.2f} min ({ratios})"


def report(result: dict) -> str:
    """The printed tables, then per anchor the evaluations around the crossings, then its ratio line, last."""
    arms, minutes = result["arms"], result["anchor_minutes"]
    held_out = arms["anchor"]["held_out"]
    lines = [
        f"host: {result['host']}; torch {result['torch']}, transformers {result['transformers']}, "
        f"threads {result['threads']}",
        f"held-out: {held_out['blocks']} blocks (prepared set {held_out['dataset']}), fixed uniform "
        f"{held_out['mask_rate']:.0%} masks (seed {held_out['mask_seed']}), the same for every arm",
        "times: training wall time, evaluations excluded, linearly interpolated between evaluations every "
        f"{result['eval_every_seconds']:g} s (anchors) and {result['arm_eval_every_seconds']:g} s (mlmlab arms)",
        f"{'arm':<{LABEL_WIDTH}} {'precision':>9} {'steps':>7} {'trained':>9} {'evaluating':>11}",
    ]
    for name, arm in arms.items():
        lines.append(
            f"{LABELS[name]:<{LABEL_WIDTH}} {arm['precision']:>9} {arm['steps']:>7} "
            f"{arm['trained_seconds'] / 60:>5.2f} min {arm['eval_seconds']:>9.1f} s"
        )
    for anchor, targets in result["anchor_losses"].items():
        lines += milestone_table(anchor, targets, arms, minutes)
    lines += [
        f"evaluations around the crossing of {ANCHOR_NAMES[anchor]}'s final loss: "
        + ", ".join(bracket_text(name, anchor, arms) for name in RATIO_LABELS)
        for anchor in ANCHORS
    ]
    lines += [ratio_line(anchor, arms, minutes) for anchor in ANCHORS]
    return "\n".join(lines)


def milestone_table(anchor: str, targets: dict, arms: dict, minutes: float) -> list[str]:
    """The anchor's held-out loss at its milestones and final accuracy, then every arm's time to each milestone."""
    losses = ", ".join(f"{loss:.3f} at {share}" for share, loss in targets.items())
    lines = [
        f"{ANCHOR_NAMES[anchor]}'s held-out loss: {losses} of its {minutes:g} minutes; final MLM accuracy "
        f"{final_accuracy(arms[anchor]):.3f}",
        f"  {'time to it':<{LABEL_WIDTH}}" + "".join(f" {'to ' + share:>9}" for share in targets),
    ]
    for name, arm in arms.items():
        times = [arm["times_to"][anchor][share] for share in targets]
        lines.append(
            f"  {LABELS[name]:<{LABEL_WIDTH}}"
            + "".join(f" {'never' if s is None else f'{s / 60:.2f} min':>9}" for s in times)
        )
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, arm in result["arms"].items():
        points = arm["evaluations"]
        minutes = [p["train_seconds"] / 60 for p in points]
        ax.plot(minutes, [p["mlm_loss"] for p in points], marker=".", label=f"{LABELS[name]}, {arm['precision']}")
    for anchor, style in zip(ANCHORS, ("--", ":")):
        final = result["anchor_losses"][anchor]["100%"]
        ax.axhline(final, color="grey", linestyle=style, linewidth=0.8, label=f"{ANCHOR_NAMES[anchor]}'s final")
    ax.set_xlabel("training wall time (minutes; evaluations excluded)")
    ax.set_ylabel("held-out MLM loss (fixed uniform 15% masks)")
    ax.set_title(result["host"], fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(result: dict, out: Path) -> None:
    """time_to_loss.json and time_to_loss.png, published together: never half a set."""
    with building(out, replace=True) as staging:
        (staging / "time_to_loss.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        plot(result, staging / "time_to_loss.png")


def benchmark(args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        engine = arm_config(*MLMLAB_ARMS["anchor-recipe"], args, Path(folder) / "anchor-recipe")
        _, valid_store, tokenizer = prepare_datasets(engine.data)
        held_out = HeldOut(valid_store, tokenizer, engine, args.eval_batches)
        arms = {}
        for name, (preset, settings) in ANCHORS.items():
            cfg = arm_config(preset, settings, args, Path(folder) / name)
            arms[name] = run_anchor(cfg, tokenizer, held_out, args, Path(folder) / name)
        target = min(arms[anchor]["evaluations"][-1]["mlm_loss"] for anchor in ANCHORS)  # reaching it reaches both
        for name, (preset, settings) in MLMLAB_ARMS.items():
            cfg = arm_config(preset, settings, args, Path(folder) / name)
            arms[name] = run_mlmlab(cfg, held_out, args.arm_eval_every_seconds, target)
    result = {
        "host": describe_cpu() if compute_device().type == "cpu" else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "anchor_minutes": args.anchor_minutes,
        "eval_every_seconds": args.eval_every_seconds,
        "arm_eval_every_seconds": args.arm_eval_every_seconds,
        "left_plateau_accuracy": LEFT_PLATEAU_ACCURACY,
        "arms": arms,
    }
    return with_times(result)


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--anchor-minutes",
        type=number_argument("--anchor-minutes", float, POSITIVE, 60),
        default=60.0,
        help="each anchor's training wall time, and each mlmlab arm's longest (default 60)",
    )
    parser.add_argument(
        "--eval-every-seconds",
        type=number_argument("--eval-every-seconds", float, POSITIVE, 180),
        help=f"training seconds between the anchors' evaluations (default: their budget / {EVALUATIONS_PER_BUDGET})",
    )
    parser.add_argument(
        "--arm-eval-every-seconds",
        type=number_argument("--arm-eval-every-seconds", float, POSITIVE, 30),
        help="training seconds between the mlmlab arms' evaluations (default: --eval-every-seconds / "
        f"{ARM_EVALUATIONS_PER_ANCHOR_INTERVAL})",
    )
    parser.add_argument(
        "--eval-batches",
        type=number_argument("--eval-batches", int, at_least(1), 20),
        help="held-out batches of 32 blocks per evaluation (default: every block of the held-out set)",
    )
    parser.add_argument("--corpus", nargs="+", help="training text (default: the sample bundled with mlmlab)")
    parser.add_argument("--valid-corpus", nargs="+", help="held-out text (default: the bundled validation sample)")
    parser.add_argument("--tokenizer", help="as data.tokenizer (default: the bundled BERT uncased vocabulary)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--no-malloc-tuning", action="store_true", help="glibc's allocator defaults for every arm")
    args = parser.parse_args(argv)
    if args.eval_every_seconds is None:
        args.eval_every_seconds = args.anchor_minutes * 60 / EVALUATIONS_PER_BUDGET
    if args.arm_eval_every_seconds is None:
        args.arm_eval_every_seconds = args.eval_every_seconds / ARM_EVALUATIONS_PER_ANCHOR_INTERVAL
    require_output(args.out, "--out", folder=True)
    return args


def main(argv=None) -> int:
    try:
        args = parse_arguments(argv)
        if not args.no_malloc_tuning and argv is None:  # measured under the allocator settings of the mlmlab command
            reexec_with_malloc_tuning([sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # mlmlab's loader forks a worker
        transformers.logging.disable_progress_bar()  # the arms' model folders' "Writing model shards" bars
        transformers.logging.set_verbosity_error()  # the tokenizer's "longer than the maximum" before group_texts
        result = benchmark(args)
        write_outputs(result, args.out)
    except UserError as err:
        print(f"time_to_loss.py: error: {err}", file=sys.stderr)
        return 2
    print(report(result))
    print(f"curves and plot: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
