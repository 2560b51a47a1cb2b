"""The GPU paths' checks, for the few minutes a GPU is lent: one command, a line per check, exit 1 if any failed.

Not part of the suite (it has no GPU): `python tests/gpu_check.py --out DIR`. Each check runs the real
command (`python -m mlmlab.cli ...`) on the bundled sample, on whatever device torch sees, so the same
script also runs here on a CPU (slowly: `--steps 4` checks that it works). On a GPU it checks what a CPU
cannot: bf16 autocast and TF32 as the log says, the fused levers against eager, ModernBERT, the ADM
scorer, export and fill-mask on the device, and it reports (does not require) whether a resumed run is
bitwise the uninterrupted one there, with and without train.deterministic (float atomics may differ:
docs/scale-out.md), the base preset's throughput and the fused levers against eager.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from test_distributed import forget_last_checkpoint, weights

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def pretrain(out: Path, steps: int, *overrides: str, config: str = "tiny") -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "mlmlab.cli",
        "pretrain",
        "--config",
        config,
        "--no-progress",
        f"train.out_dir={out}",
        f"train.max_steps={steps}",
        f"train.warmup_steps={max(steps // 10, 1)}",
        "train.log_every=1",
        f"train.eval_every={steps}",
        "train.eval_batches=5",
        *overrides,
    ]
    return subprocess.run(command, env=ENV, capture_output=True, text=True, cwd=ROOT)


def failure(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    return f"exit {result.returncode}: {lines[-1] if lines else 'nothing on stderr'}"


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def trained(result: subprocess.CompletedProcess, run_dir: Path, *said: str) -> str:
    """'' if the run ended well, its loss fell and its log says each of ``said``; else what went wrong."""
    if result.returncode != 0:
        return failure(result)
    missing = [text for text in said if text not in result.stderr]
    if missing:
        return f"the log does not say {missing}"
    first, last = losses(run_dir)[0], losses(run_dir)[-1]
    return "" if last < first else f"the loss did not fall: {first:.3f} -> {last:.3f}"


def check_auto_precision(out: Path, steps: int, cuda: bool) -> str:
    said = ("precision bf16 (train.precision=auto)", "TF32 matmuls on") if cuda else ()
    return trained(pretrain(out / "auto", steps), out / "auto", *said)


def check_fp32_means_no_tf32(out: Path, steps: int, cuda: bool) -> str:
    said = ("precision fp32", "TF32 matmuls off") if cuda else ()
    return trained(pretrain(out / "fp32", steps, "train.precision=fp32"), out / "fp32", *said)


def check_fused_levers_follow_eager(out: Path, steps: int, cuda: bool) -> str:
    """train.fused_head and train.fused_qkv against check_fp32_means_no_tf32's run: the same seed and batches."""
    fused = pretrain(out / "fused", steps, "train.precision=fp32", "train.fused_head=true", "train.fused_qkv=true")
    problem = trained(fused, out / "fused")
    if problem:
        return problem
    eager, levered = losses(out / "fp32"), losses(out / "fused")
    worst = max(abs(a - b) / abs(a) for a, b in zip(eager, levered))
    return "" if worst < 1e-3 else f"the fused run's loss left the eager one's by {worst:.1e} (relative)"


def check_modernbert(out: Path, steps: int, cuda: bool) -> str:
    return trained(pretrain(out / "modernbert", steps, config="modernbert-tiny"), out / "modernbert")


def check_adm_entropy_scorer(out: Path, steps: int, cuda: bool) -> str:
    run = pretrain(out / "adm", steps, "masking.strategy=adaptive", "masking.scorer=entropy")
    return trained(run, out / "adm")


def check_export_and_fill_mask(out: Path, steps: int, cuda: bool) -> str:
    model = out / "auto" / "model"
    evaluated = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlmlab.cli",
            "evaluate",
            "--model",
            str(model),
            "--data",
            "mlmlab/resources/sample/valid.txt.gz",
            "--max-batches",
            "5",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if evaluated.returncode != 0:
        return "evaluate: " + failure(evaluated)
    from transformers import logging, pipeline

    logging.set_verbosity_error()  # the pipeline's report of the NSP head it leaves out
    fill = pipeline("fill-mask", model=str(model), device=0 if cuda else -1)
    guesses = fill("the capital of france is [MASK].")
    return "" if len(guesses) == 5 else f"fill-mask gave {guesses}"


def report_resume_equality(out: Path, steps: int, cuda: bool) -> str:
    """Information, not a failure: a resume from the middle checkpoint against the run that went straight on."""
    return _report_resume(out / "resume", steps)


def report_deterministic_resume_equality(out: Path, steps: int, cuda: bool) -> str:
    """Information: the same with train.deterministic=true, which should make the two equal to the bit."""
    return _report_resume(out / "resume-deterministic", steps, "train.deterministic=true")


def _report_resume(run_dir: Path, steps: int, *overrides: str) -> str:
    half = max(steps // 2, 1)
    settings = (f"train.save_every={half}", "train.keep_last=2", "train.precision=fp32", *overrides)
    first = pretrain(run_dir, steps, *settings)
    if first.returncode != 0:
        return failure(first)
    straight = weights(run_dir)
    forget_last_checkpoint(run_dir)
    second = pretrain(run_dir, steps, *settings)
    if second.returncode != 0:
        return "resume: " + failure(second)
    resumed = weights(run_dir)
    worst = max((resumed[name] - tensor).abs().max().item() for name, tensor in straight.items())
    warned = sorted({line for line in first.stderr.splitlines() if "does not have a deterministic" in line})
    print(
        f"  {' '.join(overrides) or 'default'}: resumed run's weights differ from the straight run's by at most "
        f"{worst:.3g}" + (f"; torch warned: {warned}" if warned else "")
    )
    return ""


def report_base_throughput(out: Path, steps: int, cuda: bool) -> str:
    """Information: the base preset (BERT-base, batch 256 x 512, auto precision) trained for a few steps; the
    median tokens/s and MFU of its second half."""
    if not cuda:
        print("  not run: BERT-base is for a GPU")
        return ""
    run = pretrain(out / "base", steps, config="base")
    if run.returncode != 0:
        return failure(run)
    rows = [json.loads(line) for line in (out / "base" / "metrics.jsonl").read_text().splitlines()]
    timed = [row for row in rows if "tokens_per_s" in row]
    second_half = timed[len(timed) // 2 :]
    tokens_per_s, mfu = (statistics.median(row[key] for row in second_half) for key in ("tokens_per_s", "mfu"))
    print(
        f"  base: {tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%} (medians of steps {second_half[0]['step']}-"
        f"{second_half[-1]['step']})"
    )
    return ""


def median_rate(run_dir: Path) -> float:
    """The median tokens/s of a run's second half of logged steps."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [row["tokens_per_s"] for row in rows if "tokens_per_s" in row]
    return statistics.median(timed[len(timed) // 2 :])


def report_lever_ab(out: Path, steps: int, cuda: bool) -> str:
    """Information: each fused lever against the eager step, interleaved (eager and each lever, twice over), on
    full-length batches (MLM blocks packed to max_seq_length: the bundled sample's NSP pairs are mostly short,
    and on short batches a GPU step's fixed costs hide the matmuls). The base preset on a GPU, tiny here."""
    preset, packed = ("base" if cuda else "tiny"), "data.objective=mlm"
    levers = {
        "eager": [],
        "train.fused_qkv=true": ["train.fused_qkv=true"],
        "train.fused_head=true": ["train.fused_head=true"],
    }
    rates = {name: [] for name in levers}
    for repeat in range(2):
        for name, overrides in levers.items():
            run_dir = out / f"ab-{len(rates[name])}-{name.replace('=', '-')}"
            run = pretrain(run_dir, steps, packed, *overrides, config=preset)
            if run.returncode != 0:
                return f"{name}: " + failure(run)
            rates[name].append(median_rate(run_dir))
    eager = statistics.median(rates["eager"])
    for name, measured in rates.items():
        runs = " / ".join(f"{rate:,.0f}" for rate in measured)
        print(
            f"  {preset}, packed MLM blocks: {name}: {runs} tokens/s"
            + ("" if name == "eager" else f", {statistics.median(measured) / eager:.2f}x eager")
        )
    return ""


CHECKS = [
    check_auto_precision,
    check_fp32_means_no_tf32,
    check_fused_levers_follow_eager,
    check_modernbert,
    check_adm_entropy_scorer,
    check_export_and_fill_mask,
    report_resume_equality,
    report_deterministic_resume_equality,
    report_base_throughput,
    report_lever_ab,
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the runs (emptied first)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[check.__name__ for check in CHECKS],
        metavar="CHECK",
        help="run these checks alone (check_fused_levers_follow_eager needs check_fp32_means_no_tf32's "
        "run, check_export_and_fill_mask check_auto_precision's)",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "CPU (no GPU: the CUDA-only lines are not checked)"
    print(f"gpu_check on {device}; torch {torch.__version__}, {args.steps} steps a run", flush=True)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    failed = 0
    for check in [check for check in CHECKS if not args.only or check.__name__ in args.only]:
        started = time.perf_counter()
        problem = check(args.out, args.steps, cuda)
        failed += bool(problem)
        print(
            f"{'FAIL' if problem else 'ok  '} {check.__name__} ({time.perf_counter() - started:.0f} s)"
            + (f": {problem}" if problem else ""),
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
