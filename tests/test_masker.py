"""The Masker: a step's micro-batches masked in one call, and each one's result observed with its own scores."""

import pytest
import torch

from mlmlab.config import MaskingConfig, ModelConfig
from mlmlab.masking import scorers
from mlmlab.masking.masker import Masker
from mlmlab.masking.select import IGNORE_INDEX, eligible_positions
from mlmlab.masking.strategies import normalise
from mlmlab.model.pretraining import build_model, pretraining_loss

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, dropout=0.0)
SCORE_KEYS = ("mask_score_selected", "mask_score_eligible", "mask_scored_steps")


def adm_entropy(**overrides) -> MaskingConfig:
    return MaskingConfig(**{"strategy": "adaptive", "scorer": "entropy", "adapt_schedule": "constant", **overrides})


def real_batch(tokenizer, paragraphs: list[str], first_example: int) -> dict:
    """[CLS] text [SEP] sequences of real text, padded to the longest, with their example ids."""
    enc = tokenizer(paragraphs, truncation=True, max_length=32, padding=True, return_tensors="pt")
    return {**enc, "example_ids": torch.arange(len(paragraphs)) + first_example}


@pytest.fixture(scope="module")
def model(bert_tokenizer):
    """A tiny model whose predictions differ by position: a fresh one's are all near uniform (every entropy score
    within 1e-5 of 1), so a score read off the wrong position would look right."""
    torch.manual_seed(0)  # test only: the library never touches the global RNG
    model = build_model(TINY, len(bert_tokenizer), bert_tokenizer.pad_token_id).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(100)  # tied to the output layer: peaked logits
    return model


def test_each_micro_batch_is_observed_with_its_own_scores(bert_tokenizer, sample_paragraphs, model):
    """grad_accum = 2: one step's masks and score stats are those of its two micro-batches masked one per step."""
    batches = [real_batch(bert_tokenizer, sample_paragraphs[i : i + 6], i) for i in (0, 6)]
    together = Masker(adm_entropy(), bert_tokenizer, token_counts=None)
    masked = together.mask_step([(0, batch) for batch in batches], model, progress=0.5, step=1)
    together.learn_step(masked, [pretraining_loss(model, m) for m in masked])
    apart = Masker(adm_entropy(), bert_tokenizer, token_counts=None)
    for batch, reference in zip(batches, masked):
        [alone] = apart.mask_step([(0, batch)], model, progress=0.5, step=1)
        assert torch.equal(alone["input_ids"], reference["input_ids"]) and torch.equal(
            alone["labels"], reference["labels"]
        )
        apart.learn_step([alone], [pretraining_loss(model, alone)])
    got, expected = together.stats(), apart.stats()
    assert {key: got[key] for key in SCORE_KEYS} == {key: expected[key] for key in SCORE_KEYS}
    assert got["mask_scored_steps"] == 1  # one optimizer step, however many micro-batches it has


def test_scored_steps_count_optimizer_steps_not_micro_batches(bert_tokenizer, sample_paragraphs, model):
    """grad_accum = 2 over two steps: mask_scored_steps says 2 (it counted the 4 micro-batches before)."""
    batches = [real_batch(bert_tokenizer, sample_paragraphs[i : i + 6], i) for i in (0, 6)]
    masker = Masker(adm_entropy(), bert_tokenizer, token_counts=None)
    for step in (1, 2):
        masked = masker.mask_step([(0, batch) for batch in batches], model, progress=0.5, step=step)
        masker.learn_step(masked, [pretraining_loss(model, m) for m in masked])
    assert masker.stats()["mask_scored_steps"] == 2


def test_score_stats_describe_the_scored_sequences(bert_tokenizer, sample_paragraphs, model):
    """score_fraction < 1: the selected positions' mean score is over the scored sequences, wherever they are."""
    batch = real_batch(bert_tokenizer, sample_paragraphs[:16], 0)
    masker = Masker(adm_entropy(score_fraction=0.5), bert_tokenizer, token_counts=None)
    [masked] = masker.mask_step([(3, batch)], model, progress=0.5, step=1)
    masker.learn_step([masked], [pretraining_loss(model, masked)])
    scored = masker.strategy._scored_rows(batch, 3)  # (B,)
    assert 0 < int(scored.sum()) < len(scored) and not scored[: int(scored.sum())].all()  # not the leading rows
    rows = {key: value[scored] for key, value in batch.items()}
    eligible = eligible_positions(rows["input_ids"], masker.info.special_ids)  # (S, T)
    scores = normalise(scorers.entropy_scores(model, rows, eligible, len(bert_tokenizer)), eligible, "mean")  # (S, T)
    selected = (masked["labels"] != IGNORE_INDEX)[scored]  # (S, T)
    stats = masker.stats()
    assert stats["mask_score_selected"] == pytest.approx(float(scores[selected].mean()), rel=1e-4)
    assert stats["mask_score_eligible"] == pytest.approx(float(scores[eligible].mean()), rel=1e-4)
