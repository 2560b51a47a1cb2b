"""Where a training step's time goes: torch.profiler over mlmlab's step and the hf-sparse anchor's.

The arms are throughput.py's: by default its same-recipe pair (hf-sparse-recipe and
mlmlab-as-shipped, both at mlmlab's defaults), so a gap in its "vs hf-sparse, same recipe"
line can be traced here; `--arms hf-sparse mlmlab` profiles the pair at transformers' defaults
(dropout 0.1). For each: the operators it spends its CPU time in, and the time of mlmlab's
phases outside the model (masking, the step's bookkeeping, gradient clipping, the optimizer).
The profiler sees this process only: a loader worker's time (mlmlab as shipped) is not in it;
throughput.py's `--lever data.loader_workers=0` measures what the worker costs.

    python benchmarks/profile_step.py                  # tiny, 10 profiled steps per arm
    python benchmarks/profile_step.py --preset mini --rows 30
"""

import argparse
import functools
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from mlmlab.utils.devices import describe_cpu
from throughput import build_arms, time_arm


SAME_RECIPE = ("hf-sparse-recipe", "mlmlab-as-shipped")


def label_phases(trainer) -> None:
    """Wrap mlmlab's phase methods in profiler ranges named "phase: ..." (each timed as a whole, operators
    inside included)."""
    phases = {"masking": (trainer.masker, "mask_step"), "optimizer update": (trainer, "_apply_update"),
              "strategy.observe": (trainer.masker.strategy, "observe")}
    for label, (owner, method) in phases.items():
        setattr(owner, method, _in_range(f"phase: {label}", getattr(owner, method)))


def _in_range(label: str, function):
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        with record_function(label):
            return function(*args, **kwargs)
    return wrapped


def profiled(step, steps: int):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return prof


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--arms", nargs="+", default=SAME_RECIPE,
                        choices=("hf-naive", "hf-sparse", "mlmlab-unbucketed", "mlmlab", *SAME_RECIPE))
    args = parser.parse_args(argv)
    args.set, args.lever = [], []
    print(f"{describe_cpu()}; torch {torch.__version__}, threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as folder:
        arms, trainers = build_arms(args.preset, args, folder)
        for name in args.arms:
            if not name.startswith("hf-"):
                label_phases(trainers[name])
        for name in args.arms:
            time_arm(arms[name], args.warmup, trainers[name].accelerator.device)
            prof = profiled(arms[name], args.steps)
            averages = prof.key_averages()
            total = sum(event.self_cpu_time_total for event in averages) / 1e3 / args.steps
            print(f"\n{name}: {total:.1f} ms of operator self time per step")
            for event in averages:
                if event.key.startswith("phase: "):
                    print(f"  {event.key:<32} {event.cpu_time_total / 1e3 / args.steps:8.2f} ms per step")
            print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
