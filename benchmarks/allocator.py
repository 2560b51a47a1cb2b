"""glibc's allocator settings: a training run's speed against its resident memory, every arm in one interleaved run.

The ``mlmlab`` command re-executes itself under ``MALLOC_TUNING`` (``mlmlab/utils/allocator.py``): the heap kept
(trim threshold 4 GiB, 1 GiB top pad) and no mmap at all, because glibc's page faults cost up to half a step. A kept
heap is never handed back, so resident memory can grow as a run goes on. Each arm here trains the same short run
(``mlmlab pretrain``, evaluations and checkpoints off) in its own process under one set of allocator variables, with
nothing else set: the command's own re-execution is skipped (``mlmlab.cli.main`` called with its arguments), so an arm
with no variables runs under glibc's true defaults, whose mmap threshold adapts (any variable set by hand fixes it).

Arms:

- ``command``: ``MALLOC_TUNING``, what the ``mlmlab`` command applies; the baseline of every ratio;
- ``glibc``: no variable set;
- ``trim-256m``: no mmap, as the command, but the heap trimmed once 256 MiB at its top are free (64 MiB kept);
- ``--arm NAME KEY=VALUE ...``: any other set.

Per arm: tokens/s (the median of metrics.jsonl's logged windows past the warm-up), the training process's resident
memory (``VmRSS`` sampled every half second; its loader worker, a separate process, not counted) at its peak and at
half the run's wall time, and its minor page faults per step (its start-up's included). Arms alternate round by
round (these machines swing +-30% between runs); each prints its median over rounds and its ratio to ``command``'s.
Idle machine only.

    python benchmarks/allocator.py                                   # fast-tiny, 300 steps, 2 rounds
    python benchmarks/allocator.py --config modernbert-tiny --steps 600 --arm arena-1 MALLOC_ARENA_MAX=1 \\
        MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=1073741824
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlmlab.train.metrics import metrics_records
from mlmlab.utils.allocator import MALLOC_TUNING
from mlmlab.utils.devices import describe_cpu

ARMS = {
    "command": MALLOC_TUNING,
    "glibc": {},
    "trim-256m": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(256 << 20), "MALLOC_TOP_PAD_": str(64 << 20)},
}
# Calling main with its arguments skips the command's re-execution under MALLOC_TUNING (cli.py).
TRAIN = "import sys; from mlmlab.cli import main; sys.exit(main(sys.argv[1:]))"
SAMPLE_SECONDS = 0.5
GB = 1 << 30


def resident_bytes(pid: int) -> int | None:
    """The process's VmRSS; None once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((line for line in status.splitlines() if line.startswith("VmRSS:")), None)
    return int(line.split()[1]) * 1024 if line else None


def minor_faults(pid: int) -> int | None:
    """The process's minor page faults so far (/proc/PID/stat's 10th field); None once it has exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[7])  # fields after the command name start at the 3rd


def train_command(args, out_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-c",
        TRAIN,
        "pretrain",
        "--config",
        args.config,
        "--no-progress",
        f"train.max_steps={args.steps}",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.save_every=0",
        f"train.log_every={args.log_every}",
        f"train.out_dir={out_dir}",
        *args.set,
    ]


def run_arm(name: str, settings: dict, args, out_dir: Path) -> dict:
    """Train one short run under ``settings``; its speed, memory and faults."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    env.update(settings, HF_HUB_OFFLINE="1")
    out_dir.mkdir(parents=True)
    log = out_dir / "stderr.txt"  # a file, not a pipe: a full pipe nobody reads would stall the run
    started = time.monotonic()
    with open(log, "w") as stderr:
        process = subprocess.Popen(train_command(args, out_dir), env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        samples, faults = [], 0  # samples: (seconds since start, VmRSS bytes)
        while process.poll() is None:
            rss, seen = resident_bytes(process.pid), minor_faults(process.pid)
            if rss is not None:
                samples.append((time.monotonic() - started, rss))
                faults = seen if seen is not None else faults
            time.sleep(SAMPLE_SECONDS)
    if process.returncode:
        sys.exit(f"the {name} arm failed:\n{log.read_text()[-3000:]}")
    return measure(samples, faults, args, out_dir)


def measure(samples: list, faults: int, args, out_dir: Path) -> dict:
    rows = metrics_records(out_dir)
    speeds = [row["tokens_per_s"] for row in rows if "tokens_per_s" in row and row["step"] > args.warmup]
    if not speeds or not samples:
        sys.exit(f"no step past the warm-up was logged: raise --steps above --warmup {args.warmup}")
    half_time = samples[-1][0] / 2
    return {
        "tokens_per_s": statistics.median(speeds),
        "peak_gb": max(rss for _, rss in samples) / GB,
        "half_gb": next(rss for seconds, rss in samples if seconds >= half_time) / GB,
        "faults_per_step": faults / args.steps,
    }


def summarise(results: list[dict]) -> dict:
    return {key: statistics.median(result[key] for result in results) for key in results[0]}


def print_table(arms: dict, results: dict) -> None:
    medians = {name: summarise(runs) for name, runs in results.items()}
    base = medians["command"]
    print("| arm | settings | tokens/s (rounds) | peak GB (rounds) | GB at half the run | minor faults a step |")
    print("|---|---|---|---|---|---|")
    for name, settings in arms.items():
        runs, middle = results[name], medians[name]
        described = " ".join(f"{key}={value}" for key, value in settings.items()) or "none"
        speeds = " / ".join(f"{run['tokens_per_s']:,.0f}" for run in runs)
        peaks = " / ".join(f"{run['peak_gb']:.2f}" for run in runs)
        half, faults = f"{middle['half_gb']:.2f}", f"{middle['faults_per_step']:,.0f}"
        print(f"| {name} | {described} | {speeds} | {peaks} | {half} | {faults} |")
    for name in [name for name in arms if name != "command"]:
        middle = medians[name]
        print(
            f"{name} vs command: {middle['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s, "
            f"{middle['peak_gb'] / base['peak_gb']:.2f}x peak resident memory (medians over rounds)"
        )


def parse_arms(extra: list[list[str]]) -> dict:
    arms = dict(ARMS)
    for name, *pairs in extra:
        if not pairs or any("=" not in pair for pair in pairs):
            sys.exit(f"--arm {name}: give the arm's variables as KEY=VALUE after its name")
        arms[name] = dict(pair.split("=", 1) for pair in pairs)
    return arms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="fast-tiny")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every arm")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the median")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arm", nargs="+", action="append", default=[], metavar="NAME KEY=VALUE")
    args = parser.parse_args()
    arms = parse_arms(args.arm)
    print(f"host: {describe_cpu()}; {args.config}, {args.steps} steps, {args.rounds} rounds")
    results = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for name, settings in arms.items():
                out_dir = Path(scratch) / f"{name}-{round_index}"
                results[name].append(run_arm(name, settings, args, out_dir))
    print_table(arms, results)


if __name__ == "__main__":
    main()
