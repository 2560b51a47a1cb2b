"""One run on a CPU host: one process on every core, or one DDP process per core (torchrun, gloo)?

Two independent 1-thread runs side by side trained 1.32-1.43x the tokens/s of one 2-thread run
(``benchmarks/parallel_runs.sh``, tiny, 2026-12-02), 1.03x for an ADM run of the 8k vocabulary
(2026-12-04, after glibc's page faults were fixed): whether a step keeps two threads busy depends on
the model and the host. DDP splits one run the same way at the cost of a gradient all-reduce per step. Arms, each the
same
config, data and global batch (``train.batch_size`` is split over the DDP processes):

- ``threads``: ``mlmlab pretrain``, one process, torch's default threads (one per core);
- ``ddp``: ``mlmlab pretrain --processes N`` (torchrun, ``OMP_NUM_THREADS`` = cores / N).

Arms alternate round by round (these machines swing +-30% between runs); each run's tokens/s is
the median over its logged windows after the warm-up steps (metrics.jsonl counts every process's
tokens over the main process's step time). Idle machine only.

    python benchmarks/cpu_processes.py                         # tiny, 2 processes
    python benchmarks/cpu_processes.py --config mini --steps 120 --rounds 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mlmlab.utils.devices import available_cores, describe_cpu


def run_arm(arm: str, args, out_dir: Path) -> float:
    """Train one short run of ``arm``; its median tokens/s after the warm-up."""
    processes = args.processes if arm == "ddp" else 1  # --processes splits the batch and shares out the cores
    command = [
        sys.executable,
        "-m",
        "mlmlab.cli",
        "pretrain",
        "--config",
        args.config,
        "--no-progress",
        "--processes",
        str(processes),
        f"train.max_steps={args.steps}",
        "train.eval_every=0",
        "train.save_every=0",
        f"train.log_every={args.log_every}",
        f"train.out_dir={out_dir}",
        *args.set,
        f"train.batch_size={args.batch_size}",
    ]
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    done = subprocess.run(
        command, env={**env, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if done.returncode:
        sys.exit(f"the {arm} arm failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(row["tokens_per_s"] for row in rows if "tokens_per_s" in row and row["step"] > args.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for both arms")
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch, split over DDP processes")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=50, help="steps left out of the median")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.batch_size % args.processes:
        parser.error(f"--batch-size {args.batch_size} does not split over {args.processes} processes")
    cores = available_cores()
    print(f"host: {describe_cpu()}; {cores} cores; {args.config}, global batch {args.batch_size}")
    speeds = {"threads": [], "ddp": []}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for arm in speeds:
                speed = run_arm(arm, args, Path(scratch) / f"{arm}-{round_}")
                speeds[arm].append(speed)
                print(f"round {round_ + 1} {arm}: {speed:,.0f} tokens/s", flush=True)
    threads, ddp = statistics.median(speeds["threads"]), statistics.median(speeds["ddp"])
    print(
        f"{args.config}: {args.processes} DDP processes x {max(cores // args.processes, 1)} thread(s) "
        f"vs 1 process x {cores} threads: {ddp / threads:.2f}x ({ddp:,.0f} vs {threads:,.0f} tokens/s)"
    )


if __name__ == "__main__":
    main()
