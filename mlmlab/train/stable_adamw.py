"""StableAdamW: AdamW with Adafactor's update clipping per tensor, ModernBERT's optimizer (``train.optimizer``).

Wortsman et al. 2023 (arXiv:2304.13013), as ModernBERT trained with it (optimi's StableAdamW,
Warner et al. 2024): each tensor's step size is lr / max(1, RMS), where RMS is the root mean
square over the tensor of g_t / sqrt(max(v̂_t, eps²)), the current gradient against its bias-
corrected second moment (the current gradient included). While gradients stay within their own
running scale, RMS ≤ 1 and the step is AdamW's; a spike in one tensor shrinks that tensor's step
(and its weight decay, which is scaled by the clipped LR as in optimi) instead of every tensor's,
as global gradient clipping would.

torch has no such optimizer, and optimi adds a dependency for ten lines. Its moments are torch
AdamW's, under the same names and with the same bias correction (optimi folds the correction
into the betas, the same quantities up to rounding), so a resume that switches between
``adamw`` and ``stable-adamw`` carries the moments over with their meaning.
"""

import torch


class StableAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)

    def _update(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        if not state:  # torch AdamW's state: a float step count, two moments of the parameter's shape
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        (beta1, beta2), eps, grad = group["betas"], group["eps"], param.grad
        state["step"] += 1
        step = state["step"].item()
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        second = exp_avg_sq / (1 - beta2**step)  # v̂_t, the parameter's shape
        rms = (grad.square() / second.clamp_min(eps * eps)).mean().sqrt()  # 0-d: no host sync per tensor
        lr = group["lr"] / rms.clamp_min(1.0)  # 0-d
        if group["weight_decay"]:
            param.mul_(1 - lr * group["weight_decay"])
        param.sub_(exp_avg / (second.sqrt_() + eps) * (lr / (1 - beta1**step)))
