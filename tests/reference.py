"""Reference implementations that library code must agree with (tests) or beat (benchmarks/masking.py)."""

import torch

from mlmlab.masking.scorers import unwrap
from mlmlab.model import encode, eval_mode


def naive_entropy_scores(model, batch, eligible, vocab_size: int) -> torch.Tensor:
    """The entropy scorer written plainly: the full (B, T, V) softmax at once, which the library chunks."""
    model = unwrap(model)
    with torch.no_grad(), eval_mode(model):
        hidden, _ = encode(model, batch)  # (B, T, H)
        logits = model.cls.predictions(hidden)[..., :vocab_size].float()  # (B, T, V)
        probs = torch.softmax(logits, dim=-1)
        entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(dim=-1)  # (B, T)
    return torch.where(eligible, entropy, torch.zeros_like(entropy))
