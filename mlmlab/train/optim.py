"""AdamW with decoupled weight decay, and the learning-rate schedule as a pure function."""

import torch
from torch import nn

from mlmlab.config import TrainConfig


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup to 1 over ``warmup_steps``, then linear decay to 0 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


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
        fused=device.type == "cuda",  # one kernel for all parameters on GPU; unavailable on CPU
    )


def build_scheduler(optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg.warmup_steps, cfg.max_steps))
