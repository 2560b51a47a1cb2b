"""The shared selection mechanism: counts, 80/10/10, specials, labels, determinism (unit strategies too)."""

import pytest
import torch
from conftest import PMI_TEST_VOCAB
from torch.utils.data import DataLoader

from mlmlab import choices
from mlmlab.config import Config, MaskingConfig, ModelConfig
from mlmlab.data.loader import collate
from mlmlab.masking.masker import Masker
from mlmlab.masking.select import (
    IGNORE_INDEX,
    Corruption,
    count_to_select,
    eligible_positions,
    mask_batch,
    select_and_corrupt,
    token_info_for,
)
from mlmlab.model.pretraining import SparsePretraining, build_model

SEQ = 128


def real_batch(tokenizer, paragraphs, count):
    """(count, SEQ) [CLS] text [SEP] sequences of real Wikipedia text, padded."""
    enc = tokenizer(paragraphs[:count], truncation=True, max_length=SEQ, padding="max_length", return_tensors="pt")
    return enc["input_ids"]


def test_exact_counts_8010_10_specials_and_labels(bert_tokenizer, sample_paragraphs):
    info = token_info_for(bert_tokenizer)
    once = real_batch(bert_tokenizer, sample_paragraphs, 4000)  # (N, T)
    ids = torch.cat([once, once])  # every paragraph in two epochs: (2N, T)
    example_ids = torch.arange(len(once)).repeat(2)
    epochs = torch.arange(2).repeat_interleave(len(once))
    masked, labels, selected = select_and_corrupt(
        ids, example_ids, epochs, seed=3, rate=0.15, info=info, corruption=Corruption()
    )
    eligible = eligible_positions(ids, info.special_ids)
    assert selected.sum() >= 100_000
    assert torch.equal(selected.sum(1), count_to_select(eligible, 0.15))
    assert torch.equal(count_to_select(eligible, 0.15), torch.round(0.15 * eligible.sum(1)).long().clamp(min=1))
    special = torch.tensor(info.special_ids)
    assert not torch.isin(ids[selected], special).any(), "a special token was selected"
    assert torch.equal(labels[selected], ids[selected]) and (labels[~selected] == IGNORE_INDEX).all()
    assert torch.equal(masked[~selected], ids[~selected])
    shown, original = masked[selected], ids[selected]
    n = len(shown)
    as_mask = (shown == info.mask_id).float().sum() / n
    unchanged = (shown == original).float().sum() / n
    random = 1 - as_mask - unchanged
    assert abs(as_mask - 0.8) < 0.01 and abs(random - 0.1) < 0.01 and abs(unchanged - 0.1) < 0.01
    replaced = shown[(shown != info.mask_id) & (shown != original)]
    assert not torch.isin(replaced, special).any(), "a special token was inserted"
    vocab = bert_tokenizer.convert_ids_to_tokens(replaced.unique().tolist())
    assert not any(tok.startswith("[unused") for tok in vocab)


def test_loss_counts_only_selected_positions(bert_tokenizer, sample_paragraphs):
    info = token_info_for(bert_tokenizer)
    ids = real_batch(bert_tokenizer, sample_paragraphs, 4)
    batch = {
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
        "token_type_ids": torch.zeros_like(ids),
        "example_ids": torch.arange(4),
    }
    masked = mask_batch(batch, seed=1, epoch_key=0, rate=0.15, info=info, corruption=Corruption())
    bert = build_model(
        ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), len(bert_tokenizer), 0
    ).eval()
    module = SparsePretraining(bert, use_nsp=False)
    sparse = module(**masked)["mlm_loss"]
    # Per-position CE of the full head against the original ids everywhere.
    logits = bert(
        input_ids=masked["input_ids"], attention_mask=masked["attention_mask"], token_type_ids=masked["token_type_ids"]
    ).prediction_logits  # (B, T, V)
    per_position = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids, reduction="none")  # (B, T)
    selected = masked["labels"] != IGNORE_INDEX
    torch.testing.assert_close(sparse, per_position[selected].mean(), rtol=1e-5, atol=1e-5)
    # Changing the label of an unselected position leaves the loss where it was ...
    unselected = (~selected & (masked["attention_mask"] == 1)).nonzero()[0]
    relabelled = masked["labels"].clone()
    relabelled[tuple(unselected)] = IGNORE_INDEX
    assert torch.equal(module(**{**masked, "labels": relabelled})["mlm_loss"], sparse)
    # ... while counting that position (a real label there) moves it.
    relabelled[tuple(unselected)] = ids[tuple(unselected)]
    assert not torch.equal(module(**{**masked, "labels": relabelled})["mlm_loss"], sparse)


class _Examples(torch.utils.data.Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        n = int((self.ids[i] != 0).sum())
        return {
            "input_ids": self.ids[i][:n].numpy(),
            "token_type_ids": torch.zeros(n, dtype=torch.long).numpy(),
            "next_sentence_label": 0,
            "index": i,
        }


def _masks_via_loader(dataset, mask, batch_size, workers, epoch):
    """{example index: (masked ids, labels)} of ``mask(batch, epoch)`` over the loader's batches."""
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=lambda ex: collate(ex, [e["index"] for e in ex], 0),
    )
    rows = {}
    for batch in loader:
        masked = mask(batch, epoch)
        for row, index in enumerate(batch["example_ids"].tolist()):
            n = int(batch["attention_mask"][row].sum())
            rows[index] = (masked["input_ids"][row, :n].tolist(), masked["labels"][row, :n].tolist())
    return rows


def _masking(strategy, tokenizer, store):
    """mask(batch, epoch) of ``strategy``: the shared mask_batch (dynamic), or a training step's Masker."""
    if strategy == choices.DYNAMIC:
        info = token_info_for(tokenizer)
        return lambda batch, epoch: mask_batch(
            batch, seed=11, epoch_key=epoch, rate=0.15, info=info, corruption=Corruption()
        )
    cfg = Config(masking=MaskingConfig(strategy=strategy, seed=11, pmi_vocab_size=PMI_TEST_VOCAB)).masking
    masker = Masker(cfg, tokenizer, None, corpus=store)
    return lambda batch, epoch: masker.mask(batch, epoch, None, progress=0.0, step=1)[0]


@pytest.mark.parametrize("strategy", [choices.DYNAMIC, choices.SPAN, choices.PMI])
def test_masks_independent_of_workers_and_batch_size(strategy, bert_tokenizer, sample_paragraphs, sample_store):
    mask = _masking(strategy, bert_tokenizer, sample_store)
    dataset = _Examples(real_batch(bert_tokenizer, sample_paragraphs[:40], 40))
    reference = _masks_via_loader(dataset, mask, batch_size=8, workers=0, epoch=0)
    assert _masks_via_loader(dataset, mask, batch_size=8, workers=2, epoch=0) == reference
    assert _masks_via_loader(dataset, mask, batch_size=5, workers=0, epoch=0) == reference
    next_epoch = _masks_via_loader(dataset, mask, batch_size=8, workers=0, epoch=1)
    assert sum(next_epoch[i] != reference[i] for i in reference) >= 39  # new masks every epoch
