"""Schedules of training progress: ADM's adapt factor ``a`` and the mask rate.

Like nanoGPT's ``get_lr(it)`` these are pure functions of ``progress`` = step /
total_steps (clamped to [0, 1]), each tested. Every adapt-factor shape f rises from
f(0) = 0 to f(1) = 1 except ``constant`` (f = 1 throughout); ``a = a_max * f``, so
values always lie in [0, a_max].
"""

import math

from mlmlab import choices

_EXP_SHARPNESS = 5.0  # exponential: (e^{5p} - 1) / (e^5 - 1), flat early, steep late
_SIGMOID_SLOPE = 10.0  # sigmoid: logistic centred at p = 0.5, rescaled to hit 0 and 1 exactly


def _clamp(progress: float) -> float:
    return min(max(float(progress), 0.0), 1.0)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _sigmoid_ramp(p: float) -> float:
    """Logistic centred at p = 0.5, rescaled to hit 0 and 1 exactly."""
    lo, hi = _sigmoid(-_SIGMOID_SLOPE / 2), _sigmoid(_SIGMOID_SLOPE / 2)
    return min(max((_sigmoid(_SIGMOID_SLOPE * (p - 0.5)) - lo) / (hi - lo), 0.0), 1.0)


_ADAPT_SHAPES = {
    choices.QUADRATIC: lambda p: p * p,  # the seed's choice: adapt_factor = progress ** 2
    choices.LINEAR: lambda p: p,
    choices.COSINE: lambda p: 0.5 * (1.0 - math.cos(math.pi * p)),  # half-cosine ramp
    choices.EXPONENTIAL: lambda p: math.expm1(_EXP_SHARPNESS * p) / math.expm1(_EXP_SHARPNESS),
    choices.SIGMOID: _sigmoid_ramp,
    choices.CONSTANT: lambda p: 1.0,
}


def adapt_shape(kind: str, progress: float) -> float:
    """f(progress) in [0, 1] for one of choices.ADAPT_SCHEDULES."""
    if kind not in _ADAPT_SHAPES:
        raise ValueError(f"unknown adapt schedule {kind!r}; choose {choices.listed(choices.ADAPT_SCHEDULES)}")
    return _ADAPT_SHAPES[kind](_clamp(progress))


def adapt_factor(kind: str, progress: float, a_max: float) -> float:
    """ADM's a = a_max * f(progress): 0 gives uniform (dynamic) masking, 1 pure score weighting."""
    return a_max * adapt_shape(kind, progress)


def mask_rate(kind: str, progress: float, rate: float, rate_start: float) -> float:
    """Share of eligible positions to select at this progress."""
    if kind == choices.CONSTANT:
        return rate
    if kind == choices.LINEAR_DECAY:  # Ankner et al. 2024: start high (0.30), end at the target rate
        p = _clamp(progress)
        return rate_start + (rate - rate_start) * p
    raise ValueError(f"unknown rate schedule {kind!r}; choose {choices.listed(choices.RATE_SCHEDULES)}")


def rate_at(cfg, progress: float) -> float:
    """The mask rate a MaskingConfig asks for at this progress."""
    return mask_rate(cfg.rate_schedule, progress, cfg.rate, cfg.rate_start)
