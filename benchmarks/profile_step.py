"""Where a training step's time goes: torch.profiler over mlmlab's step and the hf-sparse anchor's.

The arms are throughput.py's: by default its same-recipe pair (hf-sparse-recipe and
mlmlab-as-shipped, both at mlmlab's defaults), so a gap in its "vs hf-sparse, same recipe"
line can be traced here; `--arms hf-sparse mlmlab` profiles the pair at transformers' defaults
(dropout 0.1). For each: the operators it spends its CPU time in, and the time of mlmlab's
phases outside the model (masking, the step's bookkeeping, gradient clipping, the optimizer), and how often a step
reads a
tensor's value on the host; on a GPU also its kernels and the share of the wall time they kept it busy.
The profiler sees this process only: a loader worker's time (mlmlab as shipped) is not in it;
throughput.py's `--lever data.loader_workers=0` measures what the worker costs.

    python benchmarks/profile_step.py                  # tiny, 10 profiled steps per arm
    python benchmarks/profile_step.py --preset mini --rows 30
"""

import argparse
import functools
import os
import sys
import tempfile

import torch
from throughput import build_arms, describe_environment, time_arm
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from mlmlab.utils.allocator import reexec_with_malloc_tuning
from mlmlab.utils.devices import clock

SAME_RECIPE = ("hf-sparse-recipe", "mlmlab-as-shipped")


def label_phases(trainer) -> None:
    """Wrap mlmlab's phase methods in profiler ranges named "phase: ..." (each timed as a whole, operators
    inside included)."""
    phases = {
        "masking": (trainer.masker, "mask_step"),
        "optimizer update": (trainer, "_apply_update"),
        "strategy.observe": (trainer.masker.strategy, "observe"),
    }
    for label, (owner, method) in phases.items():
        setattr(owner, method, _in_range(f"phase: {label}", getattr(owner, method)))


def _in_range(label: str, function):
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        with record_function(label):
            return function(*args, **kwargs)

    return wrapped


def profiled(step, steps: int, device: torch.device):
    """The profile of ``steps`` calls of ``step`` (the GPU's kernels too, on a GPU) and their wall seconds."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = clock(device)
        for _ in range(steps):
            step()
        seconds = clock(device) - start
    return prof, seconds


def waits_line(averages, seconds: float, steps: int, device: torch.device) -> str:
    """How often a step reads a tensor's value on the host (each .item(), int() or float() of a tensor is one
    aten::_local_scalar_dense: on a GPU each waits for every kernel launched before it, so the host cannot run
    ahead; on a CPU some are kernels' own, fused AdamW reading each parameter's step count) and, on a GPU, the
    share of the profiled wall time its kernels kept the device busy."""
    reads = sum(event.count for event in averages if event.key == "aten::_local_scalar_dense") / steps
    line = f"  {reads:.0f} host reads of a tensor's value per step"
    if device.type == "cuda":
        kernels = sum(event.self_device_time_total for event in averages if event.device_type == DeviceType.CUDA)
        line += f"; GPU kernels {kernels / 1e6 / seconds:.0%} of the profiled wall time (summed kernel time)"
    return line


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument(
        "--arms",
        nargs="+",
        default=SAME_RECIPE,
        choices=("hf-naive", "hf-sparse", "mlmlab-unbucketed", "mlmlab", *SAME_RECIPE),
    )
    parser.add_argument(
        "--no-malloc-tuning",
        action="store_true",
        help="profile without the glibc settings the mlmlab command and throughput.py apply",
    )
    args = parser.parse_args(argv)
    if not args.no_malloc_tuning:  # else its page faults would be profiled that neither measures
        reexec_with_malloc_tuning([sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    args.set, args.lever = [], []
    print(describe_environment())
    with tempfile.TemporaryDirectory() as folder:
        arms, trainers = build_arms(args.preset, args, folder)
        for name in args.arms:
            if not name.startswith("hf-"):
                label_phases(trainers[name])
        for name in args.arms:
            device = trainers[name].accelerator.device
            time_arm(arms[name], args.warmup, device)
            prof, seconds = profiled(arms[name], args.steps, device)
            averages = prof.key_averages()
            total = sum(event.self_cpu_time_total for event in averages) / 1e3 / args.steps
            print(f"\n{name}: {total:.1f} ms of operator self time per step")
            for event in averages:
                if event.key.startswith("phase: "):
                    print(f"  {event.key:<32} {event.cpu_time_total / 1e3 / args.steps:8.2f} ms per step")
            print(waits_line(averages, seconds, args.steps, device))
            print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
            if device.type == "cuda":
                print(averages.table(sort_by="self_device_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
