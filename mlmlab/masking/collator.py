"""mlmlab's masks in another training loop: a collator for transformers' ``Trainer`` (or any loop that batches lists
of tokenized examples), and the ``TrainerCallback`` that tells it where training stands.

The collator pads a list of examples as mlmlab's loader does (data/loader.collate) and masks the batch through the
``Masker`` a training step calls (masker.py), so its masks are the training step's for the same settings, example
and epoch: a pure function of (seed, example id, epoch key, position), whatever the batch, its padding, the
DataLoader's workers or the resume point. Each example names its id in ``example_id`` (an integer that stays with
the example: its index in the dataset, ``dataset.map(..., with_indices=True)``).

Two things come from outside a batch: the epoch (dynamic masks change with it, static ones cycle
masking.dupe_factor keys) and, under masking.rate_schedule=linear_decay, the optimizer step the batch trains.
``MaskingCallback`` reads both from the Trainer's state; another loop calls ``set_epoch`` and ``set_step``. A step's
batches are counted from the last ``set_step`` (grad_accum per optimizer step), because the Trainer collates one
batch ahead of the step it trains (accelerate prefetches): the step a batch trains is then still right.

ADM (masking.strategy=adaptive) scores every batch with the model being trained, inside mlmlab's training step: a
collator has no model, so it is refused.
"""

import math
from pathlib import Path

import torch
from transformers import TrainerCallback

from mlmlab import choices
from mlmlab.config import Config, MaskingConfig, from_dict
from mlmlab.data.loader import collate
from mlmlab.data.store import TokenStore
from mlmlab.errors import UserError
from mlmlab.masking.masker import Masker
from mlmlab.masking.strategies import strategy_entry

EXAMPLE_ID = "example_id"  # the field of each example that holds its id
# What the collator returns besides input_ids, attention_mask and labels, when the examples carry them.
PASSED_ON = ("token_type_ids", "next_sentence_label")


def masking_settings(masking: MaskingConfig | dict | None) -> MaskingConfig:
    """A MaskingConfig checked as a config's masking section is: from one, from a dict of its keys, or the
    defaults; a bad value is the config's one-line UserError naming masking.<key>."""
    if masking is None or isinstance(masking, dict):
        return from_dict({"masking": masking or {}}).masking
    if not isinstance(masking, MaskingConfig):
        raise UserError(f"masking= takes a MaskingConfig or a dict of its keys, not a {type(masking).__name__}")
    return Config(masking=masking).masking  # Config validates every section


def refuse_outside_the_loop(cfg: MaskingConfig) -> None:
    """A strategy whose weights need the model being trained cannot mask in a collator: one line on what to use."""
    if strategy_entry(cfg.strategy).scored:
        raise UserError(
            f"masking.strategy={cfg.strategy} weighs each batch by the model being trained, which a collator does "
            "not have; train it in mlmlab's own loop (mlmlab.pretrain(config), or `mlmlab pretrain`), or give the "
            f"collator a strategy that needs no model: {choices.listed(names_without_a_model())}"
        )


def names_without_a_model() -> list[str]:
    return [name for name in choices.STRATEGIES if not strategy_entry(name).scored]


class MaskingCollator:
    """Pads a list of tokenized examples and masks them exactly as mlmlab's training step does.

    ``tokenizer``: a fast tokenizer (``PreTrainedTokenizerFast``; its special tokens are never selected, its
    word boundaries make whole words and spans). ``masking``: the masking section of an mlmlab config, as a
    ``MaskingConfig`` or a dict of its keys (``{"strategy": "span", "rate": 0.3}``), checked as a config is.
    ``corpus``: for masking.strategy=pmi only, the prepared training data (a folder `mlmlab prepare` wrote, or a
    TokenStore) whose n-grams are masked.

    Each example: ``input_ids``, an integer ``example_id``, optionally ``attention_mask``, ``token_type_ids``,
    ``next_sentence_label``. Returns ``input_ids`` (masked), ``attention_mask`` and ``labels`` (the original ids
    at the selected positions, -100 elsewhere) as (B, T) tensors, plus ``token_type_ids`` and
    ``next_sentence_label`` when the examples carry them: what transformers' ``Trainer`` hands a masked LM.
    """

    def __init__(self, tokenizer, masking: MaskingConfig | dict | None = None, *, corpus=None):
        self.cfg = masking_settings(masking)
        refuse_outside_the_loop(self.cfg)
        if not hasattr(tokenizer, "backend_tokenizer"):
            raise UserError(
                f"MaskingCollator needs a fast tokenizer (PreTrainedTokenizerFast), got {type(tokenizer).__name__}; "
                "load it with AutoTokenizer.from_pretrained(...)"
            )
        self.pad_id = tokenizer.pad_token_id
        store = TokenStore(corpus) if isinstance(corpus, (str, Path)) else corpus
        self.masker = Masker(self.cfg, tokenizer, token_counts=None, corpus=store)
        self.epoch, self.total_steps = 0, None
        self.set_step(0)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next batches belong to (from 0): dynamic masks change with it."""
        self.epoch = int(epoch)

    def set_step(self, step: int, total_steps: int | None = None, grad_accum: int = 1) -> None:
        """The optimizer steps done before the next batch; the batches collated from here on train the steps
        after it, ``grad_accum`` batches each. ``total_steps``: the run's, for masking.rate_schedule=linear_decay
        (its rate follows step / total_steps, as in mlmlab's loop)."""
        self.step, self.grad_accum, self.collated = int(step), max(int(grad_accum), 1), 0
        if total_steps is not None:
            self.total_steps = int(total_steps)

    def __call__(self, examples: list[dict]) -> dict:
        ids = [example_id(example) for example in examples]
        batch = collate(examples, ids, self.pad_id)
        step = self._batch_step()
        masked, _ = self.masker.mask(batch, self.epoch, None, progress=self._progress(step), step=step + 1)
        out = {key: masked[key] for key in ("input_ids", "attention_mask", "labels")}
        out.update({key: masked[key] for key in PASSED_ON if key in examples[0] and key in masked})
        return out

    def _batch_step(self) -> int:
        """The optimizer steps done before the step this batch trains. Under a DataLoader's workers each process
        collates every num_workers-th batch (torch hands them out in turn), each counting its own."""
        info = torch.utils.data.get_worker_info()
        index = self.collated * info.num_workers + info.id if info is not None else self.collated
        self.collated += 1
        return self.step + index // self.grad_accum

    def _progress(self, step: int) -> float:
        """Training progress at ``step``, as the rate schedule reads it; constant rates read none."""
        if self.cfg.rate_schedule == choices.CONSTANT:
            return 0.0
        if not self.total_steps:
            raise UserError(
                f"masking.rate_schedule={self.cfg.rate_schedule} follows training progress, and the collator does "
                "not know the run's length: add MaskingCallback(collator) to the Trainer's callbacks, or call "
                "collator.set_step(step, total_steps) before each step"
            )
        return min(step / self.total_steps, 1.0)


def example_id(example: dict) -> int:
    """The example's ``example_id``, or a one-line UserError saying how to give one."""
    if EXAMPLE_ID not in example:
        raise UserError(
            f"an example has no '{EXAMPLE_ID}' (its fields: {', '.join(example) or 'none'}); masks are a function of "
            f"the example's id: give each one its index (dataset.map(lambda e, i: {{'{EXAMPLE_ID}': i}}, "
            "with_indices=True)), and keep the column: TrainingArguments(remove_unused_columns=False)"
        )
    value = example[EXAMPLE_ID]
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserError(f"'{EXAMPLE_ID}' {value!r} is not a whole number of at least 0; give each example its index")
    return value


class MaskingCallback(TrainerCallback):
    """Tells a MaskingCollator where transformers' Trainer stands: the epoch, the steps done, the run's length and
    its gradient accumulation, at the start of training (a resumed one too) and of every epoch.

    ``Trainer(..., data_collator=collator, callbacks=[MaskingCallback(collator)])``.
    """

    def __init__(self, collator: MaskingCollator):
        self.collator = collator

    def on_train_begin(self, args, state, control, **kwargs):
        if args.dataloader_num_workers > 0 and args.dataloader_persistent_workers:
            raise UserError(
                "dataloader_persistent_workers=True keeps each worker's copy of the collator from one epoch to the "
                "next, so the epoch never reaches it; set dataloader_persistent_workers=False"
            )
        self._follow(args, state)

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._follow(args, state)

    def _follow(self, args, state) -> None:
        # state.epoch is fractional (epochs done); a hair under a whole number is float error, not a part epoch
        self.collator.set_epoch(math.floor((state.epoch or 0.0) + 1e-9))
        self.collator.set_step(state.global_step, state.max_steps, args.gradient_accumulation_steps)
