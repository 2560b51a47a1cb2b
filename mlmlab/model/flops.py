"""Matmul FLOPs of the model: the one count that training's MFU and a study's budgets share.

2 FLOPs per multiply-add of every matmul; embeddings, LayerNorm, softmax and the NSP head
are negligible and left out. Per sequence of T tokens, H hidden, V (padded) vocabulary:

- encoder forward: its architecture's (``forward_flops`` on each adapter in architectures/)
- MLM head on one position: 2 H^2 + 2 H V  (the transform dense, then the vocabulary projection)
- training = 3x the forward (backward = 2x forward)
"""

from mlmlab.config import ModelConfig
from mlmlab.model.architectures import architecture_named

TRAINING_PASSES = 3  # forward + backward, the backward costing two forwards


def encoder_forward_flops(model: ModelConfig, seq):
    """Forward FLOPs of the encoder on sequences of ``seq`` tokens (a number, or an array/tensor of lengths)."""
    return architecture_named(model.architecture).forward_flops(model, seq)


def head_flops(model: ModelConfig, vocab: int, positions):
    """Forward FLOPs of the MLM head on ``positions`` positions."""
    h = model.hidden_size
    return positions * (2 * h * h + 2 * h * vocab)
