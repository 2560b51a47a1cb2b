"""mlmlab.MaskingCollator: the masks of mlmlab's own training step, in another loop's batches.

Equality is checked against what a real mlmlab Trainer fed its model: every masked micro-batch of a few training
steps is recorded, and the collator, given the same examples (unpadded, with their store ids as example_id), the
epoch and the step, must return the same input_ids and labels bit for bit.
"""

import numpy as np
import pytest
import torch
from conftest import PMI_TEST_VOCAB, TINY_MODEL

from mlmlab import choices
from mlmlab.config import MaskingConfig, load_config
from mlmlab.data.loader import LoaderPosition
from mlmlab.data.tokenizer import load_tokenizer
from mlmlab.errors import UserError
from mlmlab.masking.collator import MaskingCallback, MaskingCollator
from mlmlab.masking.masker import Masker
from mlmlab.model.pretraining import IGNORE_INDEX
from mlmlab.train.loop import Trainer

STEPS = 2
SETTINGS = {
    "dynamic": {},
    "static": {"masking.strategy": choices.STATIC, "masking.dupe_factor": 2},
    "whole words": {"masking.whole_word": True},
    "span": {"masking.strategy": choices.SPAN},
    "pmi": {"masking.strategy": choices.PMI, "masking.pmi_vocab_size": PMI_TEST_VOCAB},
    "rate decay": {"masking.rate_schedule": choices.LINEAR_DECAY, "masking.seed": 7},
}


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A tiny mlmlab run on the bundled sample as a default run prepares it (the data and its n-gram vocabulary
    are the suite's shared ones), not trained yet."""
    cfg = load_config(
        None,
        [
            *TINY_MODEL,
            f"train.out_dir={tmp_path_factory.mktemp('collator') / 'run'}",
            "train.max_steps=10",
            "train.warmup_steps=1",
            "train.batch_size=4",
            "train.eval_every=0",
            "train.save_every=0",
            "data.loader_workers=0",
        ],
    )
    return Trainer(cfg, evaluator=None, show_progress=False)


def training_step_masks(trainer: Trainer, masking: MaskingConfig, epoch: int) -> list[dict]:
    """STEPS of the trainer's own training step from the start of ``epoch``, masked by ``masking``: each
    micro-batch's (unmasked batch, masked batch, step, epoch)."""
    trainer.masker = Masker(masking, trainer.tokenizer, trainer.train_store.token_counts, corpus=trainer.train_store)
    trainer.state.step, trainer.state.position = 0, LoaderPosition(epoch=epoch)
    seen, mask_step = [], trainer.masker.mask_step

    def recording(micro, model, *, progress, step):
        masked = mask_step(micro, model, progress=progress, step=step)
        seen.extend({"batch": b, "masked": m, "step": step, "epoch": e} for (e, b), m in zip(micro, masked))
        return masked

    trainer.masker.mask_step = recording
    batches = trainer.batches()
    for _ in range(STEPS):
        trainer.train_step(batches)
        trainer.state.advance(0.0, trainer.cfg.train)
    return seen


def unpadded_examples(batch: dict) -> list[dict]:
    """The batch's rows as a tokenizer would give them (NSP pairs: with their label), each with its store id as
    example_id."""
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    return [
        {
            "input_ids": batch["input_ids"][row, :n].tolist(),
            "token_type_ids": batch["token_type_ids"][row, :n].tolist(),
            "next_sentence_label": int(batch["next_sentence_label"][row]),
            "example_id": int(batch["example_ids"][row]),
        }
        for row, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_collator_masks_as_mlmlabs_training_step(trainer, name):
    epoch = 3  # past static's 2 keys: its masks cycle, dynamic ones do not
    masking = {key.removeprefix("masking."): value for key, value in SETTINGS[name].items()}
    seen = training_step_masks(trainer, MaskingConfig(**masking), epoch)
    collator = MaskingCollator(trainer.tokenizer, masking, corpus=trainer.train_store)
    assert len(seen) == STEPS
    for record in seen:
        collator.set_epoch(record["epoch"])
        collator.set_step(record["step"] - 1, total_steps=trainer.cfg.train.max_steps)
        out = collator(unpadded_examples(record["batch"]))
        assert torch.equal(out["input_ids"], record["masked"]["input_ids"]), record["step"]
        assert torch.equal(out["labels"], record["masked"]["labels"]), record["step"]
        assert torch.equal(out["attention_mask"], record["masked"]["attention_mask"])
        assert torch.equal(out["next_sentence_label"], record["masked"]["next_sentence_label"])
        assert (out["labels"] != IGNORE_INDEX).any()
    assert {record["epoch"] for record in seen} == {epoch}


def test_masks_do_not_depend_on_the_batch_or_its_padding(bert_tokenizer, sample_paragraphs):
    examples = [
        {"input_ids": bert_tokenizer(text, truncation=True, max_length=48)["input_ids"], "example_id": 100 + i}
        for i, text in enumerate(sample_paragraphs[:6])
    ]
    collator = MaskingCollator(bert_tokenizer, {"rate": 0.3})
    together = collator(examples)
    for row, example in enumerate(examples):
        alone = collator([example])
        n = len(example["input_ids"])
        assert torch.equal(alone["labels"][0], together["labels"][row, :n])
        assert (together["labels"][row, n:] == IGNORE_INDEX).all()
    collator.set_epoch(1)
    assert not torch.equal(collator(examples)["labels"], together["labels"])  # dynamic: a new epoch, new masks


def test_the_callback_follows_the_trainers_epoch_and_counts_a_steps_micro_batches(bert_tokenizer):
    from types import SimpleNamespace

    collator = MaskingCollator(bert_tokenizer, {"rate_schedule": choices.LINEAR_DECAY})
    args = SimpleNamespace(gradient_accumulation_steps=2, dataloader_num_workers=0, dataloader_persistent_workers=False)
    MaskingCallback(collator).on_epoch_begin(args, SimpleNamespace(epoch=2.75, global_step=5, max_steps=10), None)
    assert collator.epoch == 2 and collator.total_steps == 10
    assert [collator._batch_step() for _ in range(5)] == [5, 5, 6, 6, 7]  # two micro-batches a step
    state = SimpleNamespace(epoch=2.9999999999999996, global_step=6, max_steps=10)  # 3, less float error
    MaskingCallback(collator).on_epoch_begin(args, state, None)
    assert collator.epoch == 3 and collator._batch_step() == 6
    args.dataloader_num_workers, args.dataloader_persistent_workers = 2, True
    with pytest.raises(UserError, match="dataloader_persistent_workers=False"):
        MaskingCallback(collator).on_train_begin(args, state, None)


REFUSALS = [
    ({"strategy": choices.ADAPTIVE}, "weighs each batch by the model being trained.*mlmlab.pretrain"),
    ({"rate": 1.5}, r"masking.rate=1.5 must be within \(0, 1\)"),
    ({"strategy": "bogus"}, "masking.strategy='bogus' is unknown"),
    ({"rates": 0.2}, "unknown config key 'masking.rates'"),
    (MaskingConfig(mask_prob=0.9, random_prob=0.2), "exceeds 1"),
    ({"strategy": choices.PMI}, "needs corpus="),
]


@pytest.mark.parametrize("masking, words", REFUSALS, ids=[words.split()[0] for _, words in REFUSALS])
def test_what_the_collator_cannot_do_is_refused_in_one_line(bert_tokenizer, masking, words):
    with pytest.raises((UserError, ValueError), match=words) as refused:
        MaskingCollator(bert_tokenizer, masking)
    assert "\n" not in str(refused.value)


def test_an_example_without_an_id_or_a_schedule_without_a_length_is_refused_in_one_line(bert_tokenizer):
    with pytest.raises(UserError, match="remove_unused_columns=False") as refused:
        MaskingCollator(bert_tokenizer)([{"input_ids": [2, 5, 3]}])
    assert "\n" not in str(refused.value)
    decaying = MaskingCollator(bert_tokenizer, {"rate_schedule": choices.LINEAR_DECAY})
    with pytest.raises(UserError, match=r"MaskingCallback\(collator\)"):
        decaying([{"input_ids": [2, 5, 3], "example_id": 0}])
    with pytest.raises(UserError, match="not a whole number"):
        MaskingCollator(bert_tokenizer)([{"input_ids": [2, 5, 3], "example_id": -1}])


def test_a_slow_tokenizer_is_refused_naming_the_fast_one():
    slow = type("SlowTokenizer", (), {"pad_token_id": 0})()  # what a tokenizer without a tokenizers backend lacks
    with pytest.raises(UserError, match="fast tokenizer"):
        MaskingCollator(slow)


def bundled_bpe():
    from conftest import SAMPLE

    return load_tokenizer(SAMPLE / "bpe-8k")


def test_rows_are_their_examples_order_free_and_ids_keep_their_masks(sample_paragraphs):
    tokenizer = bundled_bpe()
    examples = [
        {"input_ids": tokenizer(text, truncation=True, max_length=40)["input_ids"], "example_id": i}
        for i, text in enumerate(sample_paragraphs[:4])
    ]
    collator = MaskingCollator(tokenizer, {"strategy": choices.SPAN})
    forward, backward = collator(examples), collator(examples[::-1])
    assert torch.equal(forward["labels"], backward["labels"].flip(0))
    assert "token_type_ids" not in forward  # the examples carry none: a ModernBERT's forward takes none
    counts = (forward["labels"] != IGNORE_INDEX).sum(dim=1).numpy()
    eligible = np.array([len(e["input_ids"]) - 2 for e in examples])  # <s> ... </s>
    expected = np.round(np.float32(0.15) * eligible.astype(np.float32))  # k = round(rate x eligible), as float32
    assert (counts == expected).all()
