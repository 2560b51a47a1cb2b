"""The MFU denominator: cheap on any host in any precision, and never inflated by load (issues 29, 33)."""

import functools
import json
import time

import pytest
import torch
from test_schedules_train import small_trainer

from mlmlab.train import launch, mfu

SLOW_BF16_FLOPS = 0.5e9  # bf16 matmuls on an AVX2-only AMD EPYC: 0.4-0.7 GFLOP/s


@pytest.fixture
def slow_bf16_matmuls(monkeypatch):
    """bf16 ``@`` takes as long as on a CPU without bf16 units; fp32 keeps this host's speed."""
    fast = torch.Tensor.__matmul__

    def matmul(a, b):
        if a.dtype == torch.bfloat16:
            time.sleep(2 * a.shape[0] * a.shape[1] * b.shape[1] / SLOW_BF16_FLOPS)
        return fast(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", matmul)


def timed(function, spent: list):
    """``function``, adding each call's seconds to ``spent``."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    return wrapper


def test_a_bf16_trainer_times_its_peak_in_seconds_on_a_cpu_without_bf16_units(
    tmp_path, monkeypatch, slow_bf16_matmuls, capsys
):
    """A fixed 2048^2 bf16 matmul took ~40 s there, several per trainer: 22 minutes for one test."""
    spent = []
    monkeypatch.setattr(mfu, "peak_matmul_flops", timed(mfu.peak_matmul_flops, spent))
    monkeypatch.setattr(launch, "peak_matmul_flops", timed(launch.peak_matmul_flops, spent))
    monkeypatch.setattr(launch, "cpu_bf16_speedup", functools.cache(launch.time_bf16_speedup))
    trainer = small_trainer(tmp_path, "bf16", "train.precision=bf16")
    assert len(spent) >= 3 and sum(spent) < 3.0  # the run's peak, and the bf16 and fp32 timings of the note
    assert trainer.peak.flops < 2 * SLOW_BF16_FLOPS  # the slow rate, not fp32's
    note = [line for line in capsys.readouterr().err.splitlines() if "bf16 matmuls ran at" in line]
    assert len(note) == 1 and "x slower than in fp32" in note[0], note


def test_no_speed_note_where_bf16_is_faster_or_in_fp32(monkeypatch, capsys):
    from mlmlab.config import load_config

    for speedup, precision in ((6.3, "bf16"), (1.2, "bf16"), (0.01, "fp32")):
        monkeypatch.setattr(launch, "cpu_bf16_speedup", lambda s=speedup: s)
        cfg = load_config("tiny", [f"train.precision={precision}"])
        used = launch.resolve_precision(precision)
        launch.say_precision(launch.make_accelerator(cfg, used), cfg, used)
        said = capsys.readouterr().err
        assert f"precision {precision} (train.precision={precision})" in said and "bf16 matmuls ran at" not in said


def test_the_peak_costs_under_a_second_and_is_a_plausible_rate():
    start = time.perf_counter()
    peak = mfu.peak_matmul_flops("cpu", torch.float32)
    assert time.perf_counter() - start < 1.0
    assert 1e8 < peak < 1e14  # FLOP/s of a CPU, not of a timer glitch


def test_a_peak_timed_under_load_is_timed_again_so_mfu_stays_at_most_one(monkeypatch):
    timings = iter([1e9, 4e9, 3e9])  # at start-up another job shared the cores; then it had gone
    monkeypatch.setattr(mfu, "peak_matmul_flops", lambda device, dtype: next(timings))
    peak = mfu.MeasuredPeak("cpu", torch.float32, processes=2, refresh_seconds=3600)
    assert peak.flops == 2e9
    assert peak.covering(5e9) == 8e9  # training outran the peak: timed again, and the better timing kept
    assert peak.covering(9e9) == 9e9  # above every timing: the peak is at least what training reached
    assert mfu.rates(100, 9e9, 1.0, peak.covering(9e9))["mfu"] == 1.0


def test_the_peak_is_timed_again_as_the_run_goes_and_keeps_the_best(monkeypatch):
    timings = iter([1e9, 3e9, 2e9])
    monkeypatch.setattr(mfu, "peak_matmul_flops", lambda device, dtype: next(timings))
    peak = mfu.MeasuredPeak("cpu", torch.float32, refresh_seconds=0.0)
    peak.refresh_if_due()
    peak.refresh_if_due()
    assert peak.flops == 3e9


def test_training_under_a_slow_start_up_peak_logs_mfu_at_most_one(tmp_path, monkeypatch):
    """A peak timed far too low at start-up (a loaded host) must not show that many times the utilisation.

    The timings are fixed, not measured: a real re-timing on a host this suite shares with other jobs
    can itself come out low, which is the condition under test, not a failure of it."""
    calls = []
    device_peak = 1e12  # above any rate this small run trains at on a CPU

    def loaded_at_first(device, dtype):
        calls.append(dtype)
        return 1e6 if len(calls) == 1 else device_peak

    monkeypatch.setattr(mfu, "peak_matmul_flops", loaded_at_first)
    trainer = small_trainer(
        tmp_path, "run", "train.max_steps=4", "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0"
    )
    summary = trainer.train()
    lines = [json.loads(line) for line in trainer.metrics.path.read_text().splitlines()]
    lines = [line for line in lines if "mfu" in line]
    assert len(lines) == 4 and all(0 < line["mfu"] <= 1 for line in lines)
    assert len(calls) >= 2  # training outran the start-up figure, so the peak was timed again
    assert 0 < summary["mfu"] <= 1 and summary["peak_flops"] == device_peak


def test_timing_the_peak_draws_nothing_from_torchs_global_rng():
    """Its random operands come from a generator of their own: the global one feeds dropout (bitwise resume)."""
    before = torch.get_rng_state()
    assert mfu.peak_matmul_flops("cpu", torch.float32, seconds=0.05) > 0
    assert torch.equal(torch.get_rng_state(), before)
