"""Model FLOPs utilisation: the matmul FLOPs training needs, over what this device can do.

The numerator counts only the model's own work (mlmlab/model/flops.py's FLOP model on the
real, unpadded tokens and the positions the MLM head projects); padding, the ADM scorer's
extra passes and recomputation are not model FLOPs. The denominator is measured, not taken
from a spec sheet: the best dense-matmul rate of this device at the training precision,
reported as "of measured matmul peak" (peak_matmul_flops; MeasuredPeak keeps a run's).
"""

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from mlmlab.config import ModelConfig
from mlmlab.model.flops import TRAINING_PASSES, encoder_forward_flops, head_flops
from mlmlab.utils.devices import clock


def peak_matmul_size(device: torch.device | str) -> int:
    """The largest square matmul a peak measurement grows to.

    2048^2 saturates a few CPU cores. A GPU needs at least 8192^2: smaller ones leave it
    partly idle, under-measure the peak and so inflate MFU several times.
    """
    return 8192 if torch.device(device).type == "cuda" else 2048


# A matmul this long is big enough that call overheads no longer count (256^2 fp32 on 2 cores: ~0.3 ms).
BIG_ENOUGH_SECONDS = 0.01
FIRST_SIZE = 256


def peak_matmul_flops(
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    seconds: float = 0.25,
    big_enough: float = BIG_ENOUGH_SECONDS,
) -> float:
    """Best-case dense matmul FLOP/s of ``device`` in ``dtype``: the MFU denominator, in about ``seconds``.

    The square size doubles from 256 until one matmul takes ``big_enough`` seconds (or reaches
    peak_matmul_size), then that matmul repeats until ``seconds`` have passed; the fastest one
    counts, since a shared machine only ever makes a matmul slower. A fixed 2048^2 cost 17 GFLOP
    a matmul: ~40 s in bf16 on a CPU without bf16 units; this costs ``seconds`` plus at
    most two matmuls of the chosen size on any host, in any precision. The operands are random, from
    a generator of their own (torch's global RNG feeds dropout: drawing from it would break bitwise
    resume): a GPU multiplies constant matrices faster than real ones (less power, higher clocks), so
    a peak timed on ones would be too high and every MFU too low.
    """
    deadline = time.perf_counter() + seconds
    size, best = FIRST_SIZE, 0.0
    while True:
        operand = _random_square(device, dtype, size)
        rate, took = _time_matmul(operand, warm_up=True)
        best = max(best, rate)
        if took >= big_enough or size >= peak_matmul_size(device) or time.perf_counter() >= deadline:
            break
        size *= 2
    while time.perf_counter() < deadline:  # the same operand again: drawing it anew would only spend the time
        best = max(best, _time_matmul(operand)[0])
    return best


def _random_square(device, dtype: torch.dtype, size: int) -> torch.Tensor:
    """(size, size) standard normal values from a generator of its own, not torch's global one."""
    return torch.randn(size, size, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(0))


def _time_matmul(a: torch.Tensor, warm_up: bool = False) -> tuple[float, float]:
    """(FLOP/s, seconds) of one a @ a; ``warm_up``: one untimed first (thread pools, kernel choice)."""
    if warm_up:
        a @ a
    start = clock(a.device)
    a @ a
    took = max(clock(a.device) - start, 1e-9)
    return 2 * a.shape[0] ** 3 / took, took


class MeasuredPeak:
    """A run's MFU denominator: the best matmul rate measured so far, times the process count.

    Timed at start-up, again every ``refresh_seconds``, and at once whenever training itself
    goes faster than it: a peak timed while another job shared the cores is too low and would
    inflate MFU for the whole run (70-100% on a loaded host). The best of several
    timings is the closest to the device's own; and since a step cannot run its matmuls faster
    than the device can, a rate above every timing raises the peak to it, so MFU never exceeds 1.
    """

    def __init__(
        self, device: torch.device | str, dtype: torch.dtype, processes: int = 1, refresh_seconds: float = 300.0
    ):
        self.device, self.dtype, self.processes, self.refresh_seconds = device, dtype, processes, refresh_seconds
        self.flops = 0.0
        self.measure()

    def measure(self) -> None:
        self.flops = max(self.flops, self.processes * peak_matmul_flops(self.device, self.dtype))
        self._measured_at = time.monotonic()

    def refresh_if_due(self) -> None:
        if time.monotonic() - self._measured_at >= self.refresh_seconds:
            self.measure()

    def covering(self, achieved_flops: float) -> float:
        """The peak to divide ``achieved_flops`` (FLOP/s of training) by: never below it."""
        if achieved_flops > self.flops:
            self.measure()
            self.flops = max(self.flops, achieved_flops)
        return self.flops


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


@dataclass
class SpeedWindow:
    """Tokens, FLOPs and seconds since the last log record: what its tokens/s and MFU are over."""

    tokens: int = 0
    flops: float = 0.0
    seconds: float = 0.0

    def add(self, out: dict, seconds: float) -> None:
        self.tokens += out.get("tokens", 0)
        self.flops += out.get("flops", 0.0)
        self.seconds += seconds

    def rates(self, peak: MeasuredPeak) -> dict:
        return rates(self.tokens, self.flops, self.seconds, peak.covering(self.flops / max(self.seconds, 1e-9)))

    def show(self, bar: tqdm, loss: float, peak: MeasuredPeak) -> None:
        """One more step on the progress bar, with its loss and the window's speed."""
        speed = self.rates(peak)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{speed['tokens_per_s']:.0f}", mfu=f"{speed['mfu']:.0%}")
