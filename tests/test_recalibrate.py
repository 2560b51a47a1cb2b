"""The prior-free held-out loss: refitting the output bias removes a shifted prior, and only that."""

import numpy as np
import pytest
import torch
from test_schedules_train import small_trainer

from mlmlab.evaluate import recalibrate
from mlmlab.evaluate.recalibrate import recalibrated_loss, refit_bias


def test_with_uninformative_features_and_ample_targets_the_refit_bias_is_their_log_frequency():
    """Features that say nothing leave only the bias: its likelihood optimum is the target frequencies
    (with 1,000 targets per id the shrinkage towards the corpus prior is negligible)."""
    targets = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3]).repeat(1000)
    weight = torch.randn(5, 4, dtype=torch.float64)
    corpus = np.array([10.0, 20.0, 30.0, 40.0, 50.0])  # another prior than the targets': the data must win
    bias = refit_bias(torch.zeros(len(targets), 4, dtype=torch.float64), targets, weight, corpus)
    frequencies = torch.bincount(targets, minlength=5).double() / len(targets)
    assert torch.allclose(bias.softmax(0)[:4], frequencies[:4], atol=2e-3)
    assert bias.softmax(0)[4] < 2e-3  # never a target: pushed down, not to -inf
    assert torch.isfinite(bias).all()


def test_an_id_without_fit_targets_takes_its_rank_bins_level_not_minus_infinity():
    """Per-id maximum likelihood would send an id absent from the fit half to -inf: ~20 nats wherever it is a
    target in the scored half. Shrunk, a rare id lands near rare ids that were targets."""
    vocab = 64
    corpus = np.arange(vocab, 0, -1).astype(float)  # id 0 most frequent
    targets = torch.cat([torch.arange(40), torch.arange(40), torch.arange(42, 64)])  # ids 40, 41 never
    weight = torch.zeros(vocab, 4, dtype=torch.float64)
    bias = refit_bias(torch.zeros(len(targets), 4, dtype=torch.float64), targets, weight, corpus)
    assert bias[40] > bias[:40].min() - 3 and bias[41] > bias[:40].min() - 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    # LR rising by 1e-5 a step, as the default 100-step warmup to 1e-3 did when it took all 30 (now refused)
    trainer = small_trainer(
        tmp_path_factory.mktemp("recal"),
        "run",
        "train.max_steps=30",
        "train.warmup_steps=29",
        "train.lr=3e-4",
        "train.eval_every=0",
    )
    trainer.train()
    return trainer


def evaluate(trainer) -> dict:
    return recalibrated_loss(
        trainer.model,
        trainer.valid_store,
        trainer.masker.info,
        batch_size=16,
        max_batches=6,
        token_counts=trainer.train_store.token_counts,
        freq_cuts=(100, 1000),
    )


def test_a_per_token_bias_offset_raises_the_raw_loss_and_leaves_the_recalibrated_one(trained):
    before = evaluate(trained)
    bias = trained.model.get_output_embeddings().bias
    saved = bias.detach().clone()
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            bias += 2.0 * torch.randn(bias.shape, generator=generator)  # a prior shifted token by token
        after = evaluate(trained)
    finally:
        with torch.no_grad():
            bias.copy_(saved)
    assert after["raw_mlm_loss"] > before["raw_mlm_loss"] + 0.5
    assert after["mlm_loss"] == pytest.approx(before["mlm_loss"], abs=1e-4)
    for name in ("0_100", "100_1000", "1000_rest"):
        assert after[f"mlm_loss_freq_{name}"] == pytest.approx(before[f"mlm_loss_freq_{name}"], abs=1e-3)


def test_the_refit_fits_one_half_and_scores_the_other(trained):
    report = evaluate(trained)
    assert report["scored_targets"] > 0 and report["fit_targets"] > 0
    assert report["scored_targets"] == sum(
        report[f"scored_targets_freq_{name}"] for name in ("0_100", "100_1000", "1000_rest")
    )
    # 30 steps at a warming-up LR leave the model near uniform over 30k ids (raw ~10.3 nats = log 30k): the bias that
    # the refit gives it, the corpus prior and what the fit half adds, scores the other half far better.
    assert report["mlm_loss"] < report["raw_mlm_loss"] - 1.0


def direct_objective(features, targets, weight, bias):
    """The fit half's objective from its definition, in float64: mean cross-entropy, gradient, Hessian diagonal."""
    probabilities = (features.double() @ weight.double().T + bias).softmax(1)  # (n, V)
    n = len(targets)
    loss = -probabilities.log().gather(1, targets[:, None]).mean().item()
    counts = torch.bincount(targets, minlength=weight.shape[0]).double()
    return loss, (probabilities.sum(0) - counts) / n, (probabilities.sum(0) - probabilities.square().sum(0)) / n


@pytest.mark.parametrize("cache_bytes", [0, 2**30], ids=["recomputed", "cached"])
def test_the_objective_from_kept_exponentials_is_the_softmax_cross_entropy_at_any_bias(monkeypatch, cache_bytes):
    """The objective reuses exp(logits - row max) across biases (and recomputes chunks past its memory budget): at a
    bias spread over 60 nats, as a shrunk rare id's can be, it must still be the cross-entropy, its gradient and
    curvature, across several chunks."""
    monkeypatch.setattr(recalibrate, "ROWS_PER_CHUNK", 64)
    monkeypatch.setattr(recalibrate, "CACHE_BYTES", cache_bytes)
    generator = torch.Generator().manual_seed(0)
    vocab, hidden, n = 300, 16, 200
    features = torch.randn(n, hidden, generator=generator, dtype=torch.float64)
    weight = 2 * torch.randn(vocab, hidden, generator=generator, dtype=torch.float64)  # logits spread ~ ±30
    targets = torch.randint(vocab, (n,), generator=generator)
    fit = recalibrate._FitHalf(features, targets, weight)
    for spread in (0.0, 5.0, 60.0):
        bias = spread * torch.rand(vocab, generator=generator, dtype=torch.float64) - spread / 2
        loss, gradient, curvature = fit.objective(bias)
        expected_loss, expected_gradient, expected_curvature = direct_objective(features, targets, weight, bias)
        assert loss == pytest.approx(expected_loss, rel=1e-5)
        assert torch.allclose(gradient, expected_gradient, atol=1e-7, rtol=1e-4)
        assert torch.allclose(curvature, expected_curvature, atol=1e-7, rtol=1e-4)
    assert len(fit._chunks) == (0 if cache_bytes == 0 else 4)
