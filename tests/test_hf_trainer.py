"""mlmlab's masks in transformers' own Trainer: BertForMaskedLM on WordPiece with whole words, ModernBertForMaskedLM on
byte-level BPE with spans under a decaying rate, a few steps each with MaskingCollator and MaskingCallback.

Every batch the model is given is recorded (a forward pre-hook) with the Trainer's step at that moment: each
sequence's target count is exactly round(rate x eligible) at that step's rate (a decaying schedule included; whole
words: whole words only), no special token is ever a target or a replacement, and a Trainer resumed from its
checkpoint is given the same batches, masks included, as the run that went on.
"""

import numpy as np
import pytest
import torch
from conftest import SAMPLE, tiny_encoder
from transformers import (
    BertConfig,
    BertForMaskedLM,
    ModernBertConfig,
    ModernBertForMaskedLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from mlmlab import choices
from mlmlab.config import MaskingConfig
from mlmlab.data.tokenizer import load_tokenizer
from mlmlab.masking.collator import MaskingCallback, MaskingCollator
from mlmlab.masking.schedules import rate_at
from mlmlab.masking.select import continuation_table, token_info_for
from mlmlab.model.pretraining import IGNORE_INDEX

EXAMPLES, BATCH, STEPS, SAVED_AT = 24, 8, 6, 4  # 3 steps an epoch: the resumed run starts in the second epoch


def tiny_bert(tokenizer):
    return BertForMaskedLM(BertConfig(**tiny_encoder(tokenizer)))


def tiny_modernbert(tokenizer):
    ids = dict(bos_token_id=None, eos_token_id=None, cls_token_id=None, sep_token_id=None)  # its 50k vocabulary's
    return ModernBertForMaskedLM(ModernBertConfig(**tiny_encoder(tokenizer, num_hidden_layers=2), **ids))


CASES = {  # each setting once, as the suite's time allows: WordPiece and BPE, whole words and spans, both encoders
    "BERT, WordPiece, whole words": ("wordpiece", tiny_bert, {"whole_word": True, "rate": 0.2}),
    "ModernBERT, BPE, spans, rate decay": (
        "bpe",
        tiny_modernbert,
        {"strategy": choices.SPAN, "rate_schedule": choices.LINEAR_DECAY, "rate_start": 0.4},
    ),
}


@pytest.fixture(scope="module")
def tokenizers(bert_tokenizer):
    return {"wordpiece": bert_tokenizer, "bpe": load_tokenizer(SAMPLE / "bpe-8k")}


class Recorder(TrainerCallback):
    """The batches the model is given, in order, each with the optimizer steps done when it was."""

    def __init__(self, model):
        self.batches, self.step = [], None
        model.register_forward_pre_hook(self.record, with_kwargs=True)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step

    def record(self, module, args, kwargs):
        if module.training:
            self.batches.append({"step": self.step, **{k: kwargs[k].clone() for k in ("input_ids", "labels")}})


def train(tmp_path, tokenizer, make_model, masking, sample_paragraphs, resume: bool = False) -> Recorder:
    torch.manual_seed(0)
    model = make_model(tokenizer)
    data = [
        {"input_ids": tokenizer(text, truncation=True, max_length=48)["input_ids"], "example_id": i}
        for i, text in enumerate(sample_paragraphs[:EXAMPLES])
    ]
    collator = MaskingCollator(tokenizer, masking)
    recorder = Recorder(model)
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=SAVED_AT,
        report_to="none",
        logging_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        remove_unused_columns=False,  # the Trainer drops fields its model does not take: example_id among them
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=collator,
        callbacks=[MaskingCallback(collator), recorder],
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "hf" / f"checkpoint-{SAVED_AT}") if resume else None)
    return recorder


def check_masks(batch: dict, tokenizer, masking: dict) -> None:
    """Exact counts at the step's rate (whole words: whole words), no special token targeted or inserted."""
    info = token_info_for(tokenizer)
    labels, shown = batch["labels"], batch["input_ids"]  # (B, T) each
    selected = labels != IGNORE_INDEX
    original = torch.where(selected, labels, shown)
    specials = torch.tensor(info.special_ids)
    eligible = ~torch.isin(original, specials)  # padding is a special token too
    assert not (selected & ~eligible).any(), "a special token was selected"
    changed = shown != original
    assert not (changed & ~selected).any(), "a position that is no target was changed"
    inserted = shown[changed & (shown != info.mask_id)]
    assert not torch.isin(inserted, specials).any(), "a special token was inserted"
    if masking.get("whole_word"):
        continues = continuation_table(tokenizer)[original] & eligible  # (B, T)
        previous = torch.nn.functional.pad(selected[:, :-1], (1, 0))
        assert not (continues & (selected != previous)).any(), "a word was split"
        return
    rate = rate_at(MaskingConfig(**masking), batch["step"] / STEPS)  # the progress mlmlab's loop gives the step
    expected = np.round(np.float32(rate) * eligible.sum(dim=1).numpy().astype(np.float32))
    assert (selected.sum(dim=1).numpy() == expected).all(), (batch["step"], rate)


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_trainer_trains_on_mlmlab_masks_and_resumes_them(tmp_path, tokenizers, sample_paragraphs, case):
    kind, make_model, masking = CASES[case]
    tokenizer = tokenizers[kind]
    whole = train(tmp_path, tokenizer, make_model, masking, sample_paragraphs)
    assert [batch["step"] for batch in whole.batches] == list(range(STEPS))
    for batch in whole.batches:
        check_masks(batch, tokenizer, masking)
    resumed = train(tmp_path, tokenizer, make_model, masking, sample_paragraphs, resume=True)
    assert [batch["step"] for batch in resumed.batches] == list(range(SAVED_AT, STEPS))
    for went_on, again in zip(whole.batches[SAVED_AT:], resumed.batches, strict=True):
        assert torch.equal(went_on["input_ids"], again["input_ids"])
        assert torch.equal(went_on["labels"], again["labels"])
