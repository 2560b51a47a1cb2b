"""AdamW with decoupled weight decay, and the learning-rate schedule as a pure function."""

import torch
from torch import nn

from mlmlab.config import TrainConfig


def lr_factor(step: int, warmup_steps: int, progress: float, warmup_end_progress: float) -> float:
    """Linear warmup to 1 over ``warmup_steps``, then linear decay to 0 at progress 1.

    ``progress`` is the share of the budget spent: steps for a step budget, seconds for
    ``train.max_minutes`` (cramming's budget-defined schedule). The decay starts where
    warmup ended, ``warmup_end_progress``; for a step budget this is warmup/total and
    the schedule is the usual (total - step) / (total - warmup).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (1.0 - progress) / max(1e-12, 1.0 - warmup_end_progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and LayerNorm weights get none (BERT, AdamW paper)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "LayerNorm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        parameter_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        # One fused kernel over all parameters: ~3.5x faster than foreach on CPU (measured on the
        # tiny preset, 20 -> 5.6 ms), the standard choice on CUDA.
        fused=device.type in ("cpu", "cuda"),
    )
