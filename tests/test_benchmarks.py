"""The benchmark scripts still run and print what the benchmarks page quotes (no timing is checked here).

Nothing else imports them, so a change to what they import broke profile_step.py unseen once.
"""

import os
import re
import subprocess
import sys

from conftest import ROOT

TINY_RUN = ["--batch-size", "2", "--seq", "32", "--warmup", "1"]


def run_benchmark(script: str, *args: str) -> str:
    """The script's stdout; it must exit 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, script, *args], cwd=ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_throughput_prints_both_ratio_lines_and_each_lever():
    out = run_benchmark(
        "throughput.py",
        "--presets",
        "tiny",
        "--steps",
        "1",
        "--rounds",
        "1",
        *TINY_RUN,
        "--lever",
        "train.fused_head=true",
    )
    if "MALLOC_MMAP_MAX_" not in os.environ:  # measured under the allocator settings the mlmlab command applies
        assert out.splitlines()[0].endswith("MALLOC_TOP_PAD_=1073741824, MALLOC_MMAP_MAX_=0"), out.splitlines()[0]
    # The recipe's precision is auto: bf16 on a CPU with AMX, float32 on others (the eager arms are float32 anywhere).
    for line in ("same recipe", "transformers' defaults"):
        assert re.search(
            rf"^tiny vs hf-sparse, {line}: \d+\.\d\dx \(dropout [\d.]+, (float32|bfloat16); 1 thread, "
            "CPU ",
            out,
            re.M,
        )
    arms = re.findall(r"^  (\S+) +\d+ +[\d.]+% +(?:float32|bfloat16) +[\d.]+%$", out, re.M)
    assert arms == [
        "hf-naive",
        "hf-sparse",
        "mlmlab-unbucketed",
        "mlmlab",
        "hf-sparse-recipe",
        "mlmlab-as-shipped",
        "mlmlab+fused_head=true",
    ], out


def test_profile_step_profiles_the_same_recipe_pair():
    out = run_benchmark("profile_step.py", "--steps", "1", "--rows", "3", *TINY_RUN)
    if "MALLOC_MMAP_MAX_" not in os.environ:  # profiled under the allocator settings throughput.py measures with
        assert out.splitlines()[0].endswith("MALLOC_MMAP_MAX_=0"), out.splitlines()[0]
    assert re.findall(r"^(\S+): [\d.]+ ms of operator self time per step$", out, re.M) == [
        "hf-sparse-recipe",
        "mlmlab-as-shipped",
    ]
    assert re.search(r"phase: masking +[\d.]+ ms per step", out)
    # Every step reads values on the host (mlmlab's denominators and gradient norm; on a CPU fused AdamW's step counts)
    assert [int(reads) for reads in re.findall(r"^  (\d+) host reads of a tensor's value per step$", out, re.M)][1] > 0
