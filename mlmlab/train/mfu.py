"""Model FLOPs utilisation: the matmul FLOPs training needs, over what this device can do.

The numerator counts only the model's own work (mlmlab/flops.py's FLOP model on the
real, unpadded tokens and the positions the MLM head projects); padding, the ADM scorer's
extra passes and recomputation are not model FLOPs. The denominator is measured, not taken
from a spec sheet: the best dense-matmul rate of this device at the training precision,
reported as "of measured matmul peak". Training and the throughput benchmark measure it
with matmuls of one size per device type (peak_matmul_size).
"""

import torch

from mlmlab.config import ModelConfig
from mlmlab.devices import clock
from mlmlab.flops import TRAINING_PASSES, encoder_forward_flops, head_flops


def matmul_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype the matmuls run in under accelerate's ``mixed_precision`` ("no", "bf16", "fp16")."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)


def peak_matmul_size(device: torch.device | str) -> int:
    """Square matmuls big enough to reach the device's dense peak.

    2048^2 saturates a few CPU cores. A GPU needs at least 8192^2: smaller ones leave it
    partly idle, under-measure the peak and so inflate MFU several times.
    """
    return 8192 if torch.device(device).type == "cuda" else 2048


def peak_matmul_flops(device: torch.device | str, dtype: torch.dtype = torch.float32, repeats: int = 5,
                      rounds: int = 4) -> float:
    """Best-case dense matmul FLOP/s of ``device``: the MFU denominator.

    The best of ``rounds`` timings of ``repeats`` matmuls: a shared machine only ever makes
    a round slower, so the fastest one is the closest to the device's peak. The operands
    are constants, not random: drawing them would advance torch's global RNG and shift
    dropout, breaking bitwise resume. GEMM speed does not depend on the values.
    """
    size = peak_matmul_size(device)
    a = torch.ones(size, size, device=device, dtype=dtype)
    for _ in range(3):  # warm-up: thread pools, kernel selection
        a @ a
    best = float("inf")
    for _ in range(rounds):
        start = clock(device)
        for _ in range(repeats):
            a @ a
        best = min(best, clock(device) - start)
    return 2 * size**3 * repeats / best


def training_flops(model: ModelConfig, vocab: int, attention_mask: torch.Tensor, head_positions: int) -> torch.Tensor:
    """Matmul FLOPs of forward + backward (3x forward) of one batch, as a 0-dim tensor.

    attention_mask: (B, T). Each row's real tokens go through the encoder (attention is
    quadratic in the row's own length); the MLM head runs on ``head_positions`` positions.
    A tensor on the mask's device, so the training step adds it to its sums without a sync.
    """
    lengths = attention_mask.sum(1).double()  # (B,)
    return TRAINING_PASSES * (encoder_forward_flops(model, lengths).sum() + head_flops(model, vocab, head_positions))


def rates(tokens: int, flops: float, seconds: float, peak_flops: float) -> dict:
    """tokens/s and MFU over ``seconds``; ``peak_flops`` summed over the processes that did the work."""
    seconds = max(seconds, 1e-9)
    return {"tokens_per_s": tokens / seconds, "mfu": flops / seconds / peak_flops}
