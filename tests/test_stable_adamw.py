"""train.optimizer=stable-adamw: AdamW with update clipping per tensor, against optimi's formulation written out
here."""

import pytest
import torch

from mlmlab import choices
from mlmlab.config import load_config
from mlmlab.errors import UserError
from mlmlab.train.optim import build_optimizer, parameter_groups
from mlmlab.train.stable_adamw import StableAdamW

BETAS, EPS, LR = (0.9, 0.98), 1e-6, 1e-2


def _debiased(beta: float, step: int) -> float:
    """optimi's debias_beta: the bias correction folded into the beta, so the averages are the corrected moments."""
    return (beta**step - beta) / (beta**step - 1)


def optimi_step(param, grad, moments, step, weight_decay) -> float:
    """One StableAdamW step as optimi writes it (its _single_param_stableadamw, fp32); the update's RMS."""
    mean, second = moments
    mean.lerp_(grad, 1 - _debiased(BETAS[0], step))
    second.mul_(_debiased(BETAS[1], step)).addcmul_(grad, grad, value=1 - _debiased(BETAS[1], step))
    rms = grad.pow(2).div(second.maximum(torch.tensor(EPS * EPS))).mean().sqrt().item()
    lr = LR / max(1.0, rms)
    param.mul_(1 - lr * weight_decay)
    param.addcdiv_(mean, second.sqrt() + EPS, value=-lr)
    return rms


def gradients(step: int, shape) -> torch.Tensor:
    """Small noisy gradients, with a spike (50x) every fifth step: the steps update clipping is for."""
    generator = torch.Generator().manual_seed(step)
    return torch.randn(shape, generator=generator, dtype=torch.float64) * (50.0 if step % 5 == 0 else 1.0)


def test_it_takes_optimis_steps_and_clips_the_spikes():
    torch.manual_seed(0)
    weights = torch.randn(16, 8, dtype=torch.float64)
    ours = torch.nn.Parameter(weights.clone())
    optimizer = StableAdamW([ours], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.1)
    theirs, moments, clipped = weights.clone(), (torch.zeros_like(weights), torch.zeros_like(weights)), []
    for step in range(1, 21):
        ours.grad = gradients(step, weights.shape)
        optimizer.step()
        rms = optimi_step(theirs, gradients(step, weights.shape), moments, step, weight_decay=0.1)
        clipped.append(rms > 1)
        torch.testing.assert_close(ours.detach(), theirs, rtol=1e-12, atol=1e-12)
    assert sum(clipped) >= 3  # the spikes were clipped: the comparison covers the clipped branch


def test_without_spikes_it_is_torch_adamw():
    """A gradient within its running scale (here: the same each step, so the RMS is 1) takes AdamW's step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    twin = torch.nn.Linear(8, 4)
    twin.load_state_dict(model.state_dict())
    ours = StableAdamW(parameter_groups(model, 0.01), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.01)
    adamw = torch.optim.AdamW(parameter_groups(twin, 0.01), lr=LR, betas=BETAS, eps=EPS)
    grads = [torch.randn_like(p) for p in model.parameters()]
    for _ in range(10):
        for net, optimizer in (model, ours), (twin, adamw):
            for param, grad in zip(net.parameters(), grads):
                param.grad = grad.clone()
            optimizer.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # and its state is AdamW's, under the same names: a resume may switch between the two
    assert set(ours.state[model.weight]) == set(adamw.state[twin.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    torch.testing.assert_close(ours.state[model.weight]["exp_avg_sq"], adamw.state[twin.weight]["exp_avg_sq"])


def test_the_config_chooses_it_and_refuses_an_unknown_one():
    model = torch.nn.Linear(4, 4)
    cfg = load_config("tiny", ["train.optimizer=stable-adamw", "train.max_grad_norm=0"])
    assert isinstance(build_optimizer(model, cfg.train, torch.device("cpu")), StableAdamW)
    assert isinstance(build_optimizer(model, load_config("tiny", []).train, torch.device("cpu")), torch.optim.AdamW)
    with pytest.raises(UserError, match="train.optimizer='lamb' is unknown; choose adamw or stable-adamw"):
        load_config("tiny", ["train.optimizer=lamb"])
    with pytest.raises(UserError, match="train.max_grad_norm"):
        load_config("tiny", ["train.max_grad_norm=-1"])
    assert choices.STABLE_ADAMW in choices.OPTIMIZERS
