"""Training budgets of a study: FLOPs per step from the model config, and matching arms.

FLOPs are mlmlab/model/flops.py's model of the matmuls:

- a training step: 3x the forward (backward = 2x forward) of the encoder + the sparse head on the
  ~rate * T selected positions (mean rate over training, so a 30%->15% decay costs more)
- the masking strategy's extra passes, per step on average, as its entry prices them
  (masking/scorers.py for ADM's scorers: entropy / max_prob = one forward with the full head on
  every position; grad_norm = forward + backward of a 15%-masked copy; both on ``score_fraction``
  of the rows every ``score_every`` steps; loss_ema / context / frequency = table lookups, ~0)

"token-matched": every arm trains on as many sequences as the reference (the baseline arm).
"compute-matched": every arm spends the reference's FLOPs, scorer included, so an arm whose
scorer adds passes gets fewer steps. Either way warmup keeps its share of the run.
"""

import dataclasses
from functools import lru_cache

import numpy as np

from mlmlab import choices
from mlmlab.config import Config
from mlmlab.data.resolve import tokenizer_dir_for
from mlmlab.data.tokenizer import load_tokenizer
from mlmlab.masking.evaluation import EVAL_RATE
from mlmlab.masking.schedules import rate_at
from mlmlab.masking.strategies import strategy_entry
from mlmlab.model.flops import TRAINING_PASSES, encoder_forward_flops, head_flops
from mlmlab.model.pretraining import padded_vocab_size
from mlmlab.train.optim import full_batches_until, micro_batches_at

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
    return len(load_tokenizer(tokenizer_dir_for(tokenizer_setting)))


def mean_mask_rate(cfg: Config) -> float:
    """The mask rate averaged over training (the rate schedule is a pure function of progress)."""
    return float(np.mean([rate_at(cfg.masking, p) for p in np.linspace(0.0, 1.0, 101)]))


def sequences_per_step(cfg: Config) -> int:
    """Sequences per optimizer step on one process (batch_size x grad_accum); with N processes multiply by N."""
    return cfg.train.batch_size * cfg.train.grad_accum


def batch_shares(cfg: Config, last_step: int) -> np.ndarray:
    """(last_step,) steps 1 .. last_step, each as a share of the full global batch: 1 after any batch warmup."""
    steps = np.arange(1, last_step + 1)
    return micro_batches_at(cfg.train, steps) / cfg.train.grad_accum


def full_batch_steps(cfg: Config) -> float:
    """The run's optimizer steps counted in full global batches: fewer than max_steps if the batch warms up."""
    return full_batches_until(cfg.train, cfg.train.max_steps)


def steps_holding(cfg: Config, full_steps: float) -> int:
    """The optimizer steps of ``cfg`` that hold ``full_steps`` full global batches, its batch warmup counted."""
    warmup = batch_shares(cfg, cfg.train.batch_warmup_steps).cumsum()  # (batch_warmup_steps,)
    within = warmup[-1] if len(warmup) else 0.0
    if full_steps <= within:
        return int(np.searchsorted(warmup, full_steps)) + 1
    return cfg.train.batch_warmup_steps + round(full_steps - within)


def step_flops(cfg: Config, rate: float | None = None) -> dict:
    """{"train", "scorer", "total"}: estimated FLOPs of one optimizer step (global batch, one process) at mask
    rate ``rate`` (default: the run's mean rate)."""
    model, seq = cfg.model, cfg.data.max_seq_length
    vocab = padded_vocab_size(vocab_size_for(cfg.data.tokenizer), model.pad_vocab_multiple)
    encoder = encoder_forward_flops(model, seq)
    rate = mean_mask_rate(cfg) if rate is None else rate
    train = TRAINING_PASSES * (encoder + head_flops(model, vocab, rate * seq))
    scorer = scorer_flops(cfg, encoder, vocab)
    batch = sequences_per_step(cfg)
    return {"train": batch * train, "scorer": batch * scorer, "total": batch * (train + scorer)}


def flops_until(cfg: Config, steps: int) -> float:
    """Estimated FLOPs of a run's first ``steps`` optimizer steps, each at its own step's mask rate: steps x
    step_flops would take the whole run's mean rate, and a decaying rate spends more per step early on."""
    return float(flops_curve(cfg, steps)[steps])


def flops_curve(cfg: Config, last_step: int) -> np.ndarray:
    """(last_step + 1,) flops_until(cfg, s) for s = 0 .. last_step, from one pass over the steps' mask rates.
    Exact for the FLOP model, which is linear in the rate: a step at rate r costs fixed + r * per_rate."""
    rates = np.array([rate_at(cfg.masking, step / cfg.train.max_steps) for step in range(last_step)])  # (S,)
    fixed = step_flops(cfg, 0.0)["total"]
    per_rate = step_flops(cfg, 1.0)["total"] - fixed
    per_step = fixed + per_rate * rates  # (S,) full-batch steps
    if cfg.train.batch_warmup_steps:
        per_step = per_step * batch_shares(cfg, last_step)
    return np.concatenate(([0.0], np.cumsum(per_step)))  # (S + 1,)


def scorer_flops(cfg: Config, encoder: float, vocab: int) -> float:
    """Average extra FLOPs per sequence per step the masking strategy spends (ADM: scoring positions)."""
    return strategy_entry(cfg.masking.strategy).extra_flops(cfg, encoder, vocab)


def matched_steps(cfg: Config, reference: Config, mode: str) -> int:
    """max_steps that gives ``cfg`` the reference's sequences (token-matched) or FLOPs (compute-matched)."""
    if mode == choices.TOKEN_MATCHED:
        target, per_step = full_batch_steps(reference) * sequences_per_step(reference), sequences_per_step(cfg)
    else:
        target, per_step = full_batch_steps(reference) * step_flops(reference)["total"], step_flops(cfg)["total"]
    return max(1, steps_holding(cfg, target / per_step))


def apply_budget(cfg: Config, reference: Config, mode: str) -> Config:
    """``cfg`` with max_steps matched to the reference, and warmup scaled to keep its share of the run."""
    steps = matched_steps(cfg, reference, mode)
    warmup = round(cfg.train.warmup_steps * steps / cfg.train.max_steps)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=steps, warmup_steps=warmup))


def evaluation_count(cfg: Config) -> int:
    """Held-out evaluations of a run: every eval_every steps before the last, and the final one."""
    t = cfg.train
    return (t.max_steps - 1) // t.eval_every + 1 if t.eval_every else 1


def eval_flops(cfg: Config) -> float:
    """Forward passes of the held-out evaluations, eval_batches each: an upper bound where the
    valid split has fewer batches (the dry run's --time-steps counts the batches that exist)."""
    t = cfg.train
    vocab = padded_vocab_size(vocab_size_for(cfg.data.tokenizer), cfg.model.pad_vocab_multiple)
    seq = cfg.data.max_seq_length
    per_sequence = encoder_forward_flops(cfg.model, seq) + head_flops(cfg.model, vocab, EVAL_RATE * seq)
    return evaluation_count(cfg) * t.eval_batches * t.eval_batch_size * per_sequence


def gpu_hours(flops: float) -> float:
    return flops / (H100_PEAK_FLOPS * ASSUMED_MFU) / 3600


def cpu_hours(flops: float) -> float:
    return flops / CPU_FLOPS / 3600


def run_cost(cfg: Config) -> dict:
    """Estimated cost of one run of ``cfg`` as configured (GLUE fine-tuning and probes: running/downstream.py)."""
    flops = step_flops(cfg)
    steps = cfg.train.max_steps
    total = full_batch_steps(cfg) * flops["total"]
    return {
        "steps": steps,
        "sequences_per_step": sequences_per_step(cfg),
        # sequence slots, padding included
        "tokens": full_batch_steps(cfg) * sequences_per_step(cfg) * cfg.data.max_seq_length,
        "flops": total,
        "flops_per_step": flops["total"],
        "scorer_share": flops["scorer"] / flops["total"],
        "gpu_hours": gpu_hours(total),
        "cpu_hours": cpu_hours(total + eval_flops(cfg)),
    }
