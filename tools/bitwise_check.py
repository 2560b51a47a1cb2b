"""Whether a refactor changed what training computes: the same short runs on two trees, bit for bit.

    python tools/bitwise_check.py --ref d53725a      # this tree against that commit, on this host

Trains four 50-step tiny runs (dynamic; ADM entropy scored every 2nd step; ADM context;
static masking with Ankner's linear decay and the mlm objective), the check the first
layout pass used, in a checkout of ``--ref`` and in this tree, each in a fresh
process, then compares every final weight with torch.equal and every metrics.jsonl record
apart from timings. fp32 bits depend on the CPU's kernels, so both sides run here, now:
there is no stored baseline to drift from. Exits 1 on any difference.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {
    "dynamic": ["masking.strategy=dynamic"],
    "adm-entropy": ["masking.strategy=adaptive", "masking.scorer=entropy", "masking.score_every=2"],
    "adm-context": ["masking.strategy=adaptive", "masking.scorer=context"],
    "static-decay-mlm": ["masking.strategy=static", "masking.rate_schedule=linear_decay", "data.objective=mlm"],
}
# 10 warmup steps: the default 100 would take the whole budget, which a run refuses; the LR then also decays.
COMMON = [
    "train.max_steps=50",
    "train.warmup_steps=10",
    "train.log_every=5",
    "train.eval_every=25",
    "train.eval_batches=2",
    "train.precision=fp32",
    "data.loader_workers=0",
]
TIMINGS = {"tokens_per_s", "mfu", "clock", "peak_flops"}  # and every "*seconds*" figure
ROOT = Path(__file__).resolve().parent.parent


def train_all(tree: Path, out: Path) -> None:
    """The four runs with ``tree``'s mlmlab, in one fresh process each."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "MLMLAB_CACHE": str(out / "cache")}
    for name, overrides in RUNS.items():
        code = "import sys; from mlmlab.cli import main; sys.exit(main(['pretrain', '--no-progress', *sys.argv[1:]]))"
        subprocess.run(
            [sys.executable, "-c", code, *COMMON, *overrides, f"train.out_dir={out / name}"],
            env=env,
            cwd=tree,
            check=True,
            stdout=subprocess.DEVNULL,
        )


def differences(a: Path, b: Path) -> list[str]:
    import torch
    from safetensors.torch import load_file

    found = []
    for name in RUNS:
        wa, wb = (load_file(run / name / "model" / "model.safetensors") for run in (a, b))
        found += [
            f"{name}: weight {key}"
            for key in sorted(wa.keys() | wb.keys())
            if key not in wa or key not in wb or not torch.equal(wa[key], wb[key])
        ]
        ma, mb = (metrics(run / name / "metrics.jsonl") for run in (a, b))
        if len(ma) != len(mb):
            found.append(f"{name}: metrics.jsonl has {len(ma)} vs {len(mb)} records")
        found += [
            f"{name}: metrics.jsonl step {ra.get('step')} differs in {changed_keys(ra, rb)}"
            for ra, rb in zip(ma, mb)
            if ra != rb
        ]
    return found


def metrics(path: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMINGS and "seconds" not in k}
        for line in path.read_text().splitlines()
    ]


def changed_keys(a: dict, b: dict) -> list[str]:
    return sorted(key for key in a.keys() | b.keys() if a.get(key) != b.get(key))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", required=True, help="the commit to compare this tree with")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(folder / "ref"), args.ref],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        try:
            train_all(folder / "ref", folder / "runs-ref")
            train_all(ROOT, folder / "runs-here")
            found = differences(folder / "runs-ref", folder / "runs-here")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(folder / "ref")], cwd=ROOT, check=True)
    for line in found:
        print(line)
    print(f"{len(RUNS)} runs of 50 steps: " + ("bitwise equal" if not found else f"{len(found)} differences"))
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
