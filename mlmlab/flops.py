"""Matmul FLOPs of the model: the one count that training's MFU and a study's budgets share.

2 FLOPs per multiply-add of every matmul; embeddings, LayerNorm, softmax and the NSP head
are negligible and left out. Per sequence of T tokens, H hidden, I intermediate, L
layers, V (padded) vocabulary:

- BERT encoder forward: L * T * (8 H^2 + 4 H I + 4 T H)  (Q, K, V, output projections; FFN; QK^T and AV)
- ModernBERT encoder forward: L * T * (8 H^2 + 6 H I) + 4 H * (attended pairs of every layer):
  its GeGLU MLP has three H x I matrices (two in, one out); a global layer attends T^2 (query,
  key) pairs, a local one only the pairs at most local_attention // 2 apart
- MLM head on one position: 2 H^2 + 2 H V  (the transform dense, then the vocabulary projection)
- training = 3x the forward (backward = 2x forward)
"""

import math

from mlmlab import choices
from mlmlab.config import ModelConfig

TRAINING_PASSES = 3  # forward + backward, the backward costing two forwards


def encoder_forward_flops(model: ModelConfig, seq):
    """Forward FLOPs of the encoder on sequences of ``seq`` tokens (a number, or an array/tensor of lengths)."""
    if model.architecture == choices.MODERNBERT:
        return _modernbert_forward_flops(model, seq)
    h, i = model.hidden_size, model.intermediate_size
    return model.num_layers * seq * (8 * h * h + 4 * h * i + 4 * seq * h)


def _modernbert_forward_flops(model: ModelConfig, seq):
    h, i, layers = model.hidden_size, model.intermediate_size, model.num_layers
    global_layers = math.ceil(layers / model.global_attention_every)  # layers 0, n, 2n, ...
    pairs = global_layers * seq * seq + (layers - global_layers) * local_attention_pairs(seq, model.local_attention // 2)
    return layers * seq * (8 * h * h + 6 * h * i) + 4 * h * pairs


def local_attention_pairs(seq, reach: int):
    """(query, key) pairs of a sequence of ``seq`` tokens at most ``reach`` positions apart.

    Each distance d = 1..m (m = min(reach, seq - 1)) has seq - d pairs in either direction,
    besides the seq pairs of a token with itself: seq + 2 (m seq - m (m + 1) / 2).
    """
    gap = seq - 1
    nearest = (gap + reach - abs(gap - reach)) / 2  # min(seq - 1, reach), for numbers, arrays and tensors alike
    return seq + 2 * nearest * seq - nearest * (nearest + 1)


def head_flops(model: ModelConfig, vocab: int, positions):
    """Forward FLOPs of the MLM head on ``positions`` positions."""
    h = model.hidden_size
    return positions * (2 * h * h + 2 * h * vocab)
