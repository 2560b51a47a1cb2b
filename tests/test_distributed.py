"""Two CPU processes (gloo, via torchrun) follow the same loss trajectory as one process."""

import json
import subprocess
import sys

import pytest

COMMON = ["--no-progress", "train.max_steps=4", "train.log_every=1", "train.eval_every=0", "train.save_every=0",
          "train.eval_batches=1", "model.dropout=0.0", "data.loader_workers=0", "train.warmup_steps=2"]


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["tokens"]) for r in records if "loss" in r]


def test_two_processes_equal_one_with_the_same_global_batch(tmp_path):
    # Dropout off: each rank draws its own dropout masks, which no split could reproduce.
    single = subprocess.run([sys.executable, "-m", "mlmlab.cli", "pretrain", *COMMON, "train.batch_size=8",
                             f"train.out_dir={tmp_path / 'one'}"], capture_output=True, text=True)
    assert single.returncode == 0, single.stderr[-2000:]
    double = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "mlmlab.cli",
                             "pretrain", *COMMON, "train.batch_size=4", f"train.out_dir={tmp_path / 'two'}"],
                            capture_output=True, text=True)
    assert double.returncode == 0, double.stderr[-2000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == len(two) == 4, "each process must log once per step, only the main one"
    for (step, loss, norm, tokens), (step2, loss2, norm2, tokens2) in zip(one, two):
        assert step == step2 and tokens == tokens2
        assert loss2 == pytest.approx(loss, rel=1e-5) and norm2 == pytest.approx(norm, rel=1e-4)
