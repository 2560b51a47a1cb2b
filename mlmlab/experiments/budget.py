"""Training budgets of a study: FLOPs per step from the model config, and matching arms.

FLOPs count 2 per multiply-add of every matmul (embeddings, LayerNorm, softmax and the
NSP head are negligible and left out). Per sequence of T tokens, H hidden, I
intermediate, L layers, V (padded) vocabulary:

- encoder forward: L * T * (8 H^2 + 4 H I + 4 T H)  (Q, K, V, output projections; FFN; QK^T and AV)
- MLM head on one position: 2 H^2 + 2 H V  (the transform dense, then the vocabulary projection)
- a training step: 3x the forward (backward = 2x forward) of the encoder + the sparse head on the
  ~rate * T selected positions (mean rate over training, so a 30%->15% decay costs more)
- scorer, per step on average: entropy / max_prob = one forward with the full head on every
  position; grad_norm = forward + backward of a 15%-masked copy; both on ``score_fraction`` of
  the rows every ``score_every`` steps; loss_ema / context = table lookups, ~0

"token-matched": every arm trains on as many sequences as the reference (the baseline arm).
"compute-matched": every arm spends the reference's FLOPs, scorer included, so an arm whose
scorer adds passes gets fewer steps. Either way warmup keeps its share of the run.
"""

import dataclasses
from functools import lru_cache

import numpy as np

from mlmlab.config import Config, ModelConfig
from mlmlab.masking.schedules import rate_at
from mlmlab.masking.scorers import GRAD_NORM_RATE
from mlmlab.model import padded_vocab_size

BUDGETS = ("token-matched", "compute-matched")
# Dry-run cost assumption: an H100 SXM's dense bf16 peak is ~989 TFLOP/s; 40% model-FLOPs
# utilisation is what well-tuned BERT pretraining reaches (MosaicBERT reports 30-45%).
H100_PEAK_FLOPS = 989e12
ASSUMED_MFU = 0.40
# CPU wall-time assumption: a tiny-preset step (batch 32 x 128 tokens, ~26 GFLOP by this model)
# takes ~0.5 s on 2 idle cores; the model's FLOP ratios matched measured step-time ratios
# (entropy scoring every step: 2.4x predicted, 2.3x measured).
CPU_FLOPS = 50e9


@lru_cache(maxsize=None)
def vocab_size_for(tokenizer_setting: str) -> int:
    """The tokenizer's size (data.tokenizer; empty = the bundled vocab), loaded once per setting."""
    from mlmlab.data.tokenizer import load_tokenizer
    from mlmlab.train.datasets import tokenizer_dir_for

    return len(load_tokenizer(tokenizer_dir_for(tokenizer_setting)))


def encoder_forward_flops(model: ModelConfig, seq: int) -> float:
    h, i = model.hidden_size, model.intermediate_size
    return model.num_layers * seq * (8 * h * h + 4 * h * i + 4 * seq * h)


def head_flops(model: ModelConfig, vocab: int, positions: float) -> float:
    h = model.hidden_size
    return positions * (2 * h * h + 2 * h * vocab)


def mean_mask_rate(cfg: Config) -> float:
    """The mask rate averaged over training (the rate schedule is a pure function of progress)."""
    return float(np.mean([rate_at(cfg.masking, p) for p in np.linspace(0.0, 1.0, 101)]))


def global_batch(cfg: Config) -> int:
    """Sequences per optimizer step on one process; with N processes multiply by N."""
    return cfg.train.batch_size * cfg.train.grad_accum


def step_flops(cfg: Config) -> dict:
    """{"train", "scorer", "total"}: estimated FLOPs of one optimizer step (global batch, one process)."""
    model, seq = cfg.model, cfg.data.max_seq_length
    vocab = padded_vocab_size(vocab_size_for(cfg.data.tokenizer), model.pad_vocab_multiple)
    encoder = encoder_forward_flops(model, seq)
    train = 3 * (encoder + head_flops(model, vocab, mean_mask_rate(cfg) * seq))
    scorer = scorer_flops(cfg, encoder, vocab)
    batch = global_batch(cfg)
    return {"train": batch * train, "scorer": batch * scorer, "total": batch * (train + scorer)}


def scorer_flops(cfg: Config, encoder: float, vocab: int) -> float:
    """Average extra FLOPs per sequence per step spent scoring positions for ADM."""
    m, seq = cfg.masking, cfg.data.max_seq_length
    if m.strategy != "adaptive" or m.a_max == 0.0:
        return 0.0
    share = m.score_fraction / m.score_every
    if m.scorer in ("entropy", "max_prob"):
        return share * (encoder + head_flops(cfg.model, vocab, seq))
    if m.scorer == "grad_norm":
        return share * 3 * (encoder + head_flops(cfg.model, vocab, GRAD_NORM_RATE * seq))
    return 0.0  # loss_ema / context read a table the training step keeps up to date


def matched_steps(cfg: Config, reference: Config, mode: str) -> int:
    """max_steps that gives ``cfg`` the reference's sequences (token-matched) or FLOPs (compute-matched)."""
    if mode == "token-matched":
        target, per_step = reference.train.max_steps * global_batch(reference), global_batch(cfg)
    else:
        target, per_step = reference.train.max_steps * step_flops(reference)["total"], step_flops(cfg)["total"]
    return max(1, round(target / per_step))


def apply_budget(cfg: Config, reference: Config, mode: str) -> Config:
    """``cfg`` with max_steps matched to the reference, and warmup scaled to keep its share of the run."""
    steps = matched_steps(cfg, reference, mode)
    warmup = round(cfg.train.warmup_steps * steps / cfg.train.max_steps)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=steps, warmup_steps=warmup))


def eval_flops(cfg: Config) -> float:
    """Forward passes of the held-out evaluations (every eval_every steps and at the end)."""
    t = cfg.train
    evaluations = (t.max_steps - 1) // t.eval_every + 1 if t.eval_every else 1
    vocab = padded_vocab_size(vocab_size_for(cfg.data.tokenizer), cfg.model.pad_vocab_multiple)
    seq = cfg.data.max_seq_length
    per_sequence = encoder_forward_flops(cfg.model, seq) + head_flops(cfg.model, vocab, 0.15 * seq)
    return evaluations * t.eval_batches * t.batch_size * per_sequence


def run_cost(cfg: Config) -> dict:
    """Estimated cost of one run of ``cfg`` as configured (GLUE fine-tuning not included)."""
    flops = step_flops(cfg)
    steps = cfg.train.max_steps
    total = steps * flops["total"]
    return {
        "steps": steps,
        "global_batch": global_batch(cfg),
        "tokens": steps * global_batch(cfg) * cfg.data.max_seq_length,  # sequence slots, padding included
        "flops": total,
        "flops_per_step": flops["total"],
        "scorer_share": flops["scorer"] / flops["total"],
        "gpu_hours": total / (H100_PEAK_FLOPS * ASSUMED_MFU) / 3600,
        "cpu_hours": (total + eval_flops(cfg)) / CPU_FLOPS / 3600,
    }
