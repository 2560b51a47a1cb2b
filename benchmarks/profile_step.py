"""Where a training step's time goes: torch.profiler over mlmlab's step and the hf-sparse anchor's.

The arms are throughput.py's: by default its same-recipe pair (hf-sparse-recipe and
mlmlab-as-shipped, both at mlmlab's defaults plus ``--set``), so a gap in its "vs hf-sparse, same recipe"
line can be traced here; `--arms hf-sparse mlmlab` profiles the pair at transformers' defaults
(dropout 0.1), and each ``--lever`` adds an mlmlab+<lever> arm (mlmlab-as-shipped plus the lever's overrides).
For each: its tokens/s and MFU over ``--steps`` timed steps before the profile, against the measured matmul peak
of the dtype its matmuls run in (bf16 and fp32 peaks both measured and printed); the operators it spends its CPU
time in, split into dense matmuls, attention kernels and everything else, the top of everything else on its own;
the time of mlmlab's phases outside the model (masking, the step's bookkeeping, gradient clipping, the optimizer),
and how often a step reads a tensor's value on the host; on a GPU also its kernels and the share of the wall time
they kept it busy. The profiler sees this process only: a loader worker's time (mlmlab as shipped) is not in it;
throughput.py's `--lever data.loader_workers=0` measures what the worker costs.

    python benchmarks/profile_step.py                  # tiny, 10 profiled steps per arm
    python benchmarks/profile_step.py --preset mini --rows 30
    # fast-tiny's step as shipped (bf16 where auto picks it) beside the same step in fp32
    python benchmarks/profile_step.py --preset fast-tiny --arms mlmlab-as-shipped --lever train.precision=fp32
    python benchmarks/profile_step.py --preset fast-tiny --arms mlmlab-as-shipped --by-shape   # which tensors
"""

import argparse
import functools
import os
import sys
import tempfile

import torch
from throughput import PEAK_SECONDS, add_arm_options, build_arms, describe_environment, dtype_name, lever_arm, time_arm
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, profile, record_function

from mlmlab.train.launch import Precision
from mlmlab.train.mfu import peak_matmul_flops
from mlmlab.utils.allocator import reexec_with_malloc_tuning
from mlmlab.utils.devices import clock

SAME_RECIPE = ("hf-sparse-recipe", "mlmlab-as-shipped")
# The operators that run the model's dense matmuls (forward and backward), whatever the precision; the FLOP model
# counts these and the attention kernels' products, so everything else is what keeps MFU below the matmuls' own.
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_addmm_activation"}
ATTENTION_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_efficient_attention_forward",
    "aten::_efficient_attention_backward",
}


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


def profiled(step, steps: int, device: torch.device, shapes: bool = False):
    """The profile of ``steps`` calls of ``step`` (the GPU's kernels too, on a GPU) and their wall seconds; with
    ``shapes``, each operator's input shapes recorded."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=shapes) as prof:
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


def op_split_lines(averages, steps: int, rows: int) -> list[str]:
    """Operator self time per step in dense matmuls, attention kernels and everything else, then the top of
    everything else (the casts, copies, elementwise, reduction and bookkeeping operators a step also runs)."""
    kinds = {"matmuls": MATMUL_OPS, "attention kernels": ATTENTION_OPS}
    milliseconds = {kind: 0.0 for kind in [*kinds, "everything else"]}
    others = []
    for event in averages:
        kind = next((kind for kind, ops in kinds.items() if event.key in ops), "everything else")
        milliseconds[kind] += event.self_cpu_time_total / 1e3 / steps
        if kind == "everything else":
            others.append(event)
    total = sum(milliseconds.values())
    split = ", ".join(f"{kind} {ms:.1f} ms ({ms / total:.0%})" for kind, ms in milliseconds.items())
    table = EventList(others).table(sort_by="self_cpu_time_total", row_limit=rows)
    return [f"  operator self time per step: {split}", "  everything else, by self time:", table]


def measured_peaks(device: torch.device) -> dict:
    """{dtype: the device's measured dense-matmul FLOP/s} for bf16 and fp32, as throughput.py measures them."""
    return {
        dtype: peak_matmul_flops(device, dtype, seconds=PEAK_SECONDS, big_enough=0.1)
        for dtype in (torch.bfloat16, torch.float32)
    }


def speed_line(totals: list, precision: Precision, peaks: dict) -> str:
    """An arm's tokens/s and MFU over its timed steps, of the peak of the dtype its matmuls run in."""
    tokens, _, flops, seconds = totals
    dtype = precision.dtype
    return (
        f"  {tokens / seconds:.0f} tokens/s, {dtype_name(precision)}: MFU {flops / seconds / peaks[dtype]:.1%} of "
        f"the measured {dtype_name(precision)} matmul peak ({flops / seconds / 1e12:.3f} of {peaks[dtype] / 1e12:.2f} "
        "TFLOP/s)"
    )


def profile_arm(name: str, step, trainer, peaks: dict, args) -> None:
    """One arm: warmed up, timed unprofiled for its speed, then profiled; its lines printed."""
    device = trainer.accelerator.device
    time_arm(step, args.warmup, device)
    totals = time_arm(step, args.steps, device)
    prof, seconds = profiled(step, args.steps, device, shapes=args.by_shape)
    averages = prof.key_averages()
    total = sum(event.self_cpu_time_total for event in averages) / 1e3 / args.steps
    print(f"\n{name}: {total:.1f} ms of operator self time per step")
    print(speed_line(totals, trainer.precision, peaks))
    for event in averages:
        if event.key.startswith("phase: "):
            print(f"  {event.key:<32} {event.cpu_time_total / 1e3 / args.steps:8.2f} ms per step")
    print(waits_line(averages, seconds, args.steps, device))
    print("\n".join(op_split_lines(averages, args.steps, args.rows)))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.by_shape:  # which tensors the costly operators work on: the embedding's, the head's, a weight's cast
        by_shape = prof.key_averages(group_by_input_shape=True)
        print(by_shape.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_shapes_column_width=80))
    if device.type == "cuda":
        print(averages.table(sort_by="self_device_time_total", row_limit=args.rows))


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per arm, then as many profiled")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--by-shape", action="store_true", help="also list the operators by their input shapes")
    parser.add_argument(
        "--arms",
        nargs="+",
        default=SAME_RECIPE,
        choices=("hf-naive", "hf-sparse", "mlmlab-unbucketed", "mlmlab", *SAME_RECIPE),
    )
    add_arm_options(parser, "profiled after --arms")
    parser.add_argument(
        "--no-malloc-tuning",
        action="store_true",
        help="profile without the glibc settings the mlmlab command and throughput.py apply",
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_arguments(argv)
    if not args.no_malloc_tuning:  # else its page faults would be profiled that neither measures
        reexec_with_malloc_tuning([sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    print(describe_environment())
    with tempfile.TemporaryDirectory() as folder:
        arms, trainers = build_arms(args.preset, args, folder)
        names = [*args.arms, *map(lever_arm, args.lever)]
        for name in names:
            if not name.startswith("hf-"):
                label_phases(trainers[name])
        peaks = measured_peaks(trainers[names[0]].accelerator.device)
        print(
            "measured matmul peak: "
            + ", ".join(
                f"{str(dtype).removeprefix('torch.')} {peak / 1e12:.2f} TFLOP/s" for dtype, peak in peaks.items()
            )
        )
        for name in names:
            profile_arm(name, arms[name], trainers[name], peaks, args)


if __name__ == "__main__":
    main()
