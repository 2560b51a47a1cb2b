"""End to end on the bundled Wikipedia sample: train, export, load with Auto classes, resume."""

import copy
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForMaskedLM, AutoTokenizer, BertForPreTraining

from mlmlab.config import load_config
from mlmlab.data.loader import collate
from mlmlab.masking.select import Corruption
from mlmlab.masking.strategies import mask_batch
from mlmlab.model import SparsePretraining, encode
from mlmlab.train import checkpoint
from mlmlab.train.loop import Trainer

TRAIN_STEPS = 150


def tiny_config(out_dir, *extra):
    return load_config("tiny", [f"train.out_dir={out_dir}", "train.eval_every=0", "train.save_every=0",
                                "train.eval_batches=15", "data.loader_workers=0", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained for a few minutes; its held-out metrics before and after."""
    out = tmp_path_factory.mktemp("pretrain") / "run"
    trainer = Trainer(tiny_config(out, f"train.max_steps={TRAIN_STEPS}", "train.warmup_steps=30"), progress=False)
    before = trainer.evaluate(15)
    summary = trainer.train()
    return {"before": before, "after": summary["eval"], "run_dir": out, "trainer": trainer}


def test_training_lowers_held_out_perplexity(trained):
    before, after = trained["before"], trained["after"]
    print(f"perplexity {before['perplexity']:.0f} -> {after['perplexity']:.0f}, nsp {after['nsp_accuracy']:.3f}")
    assert before["perplexity"] > 10_000  # an untrained model over a 30k vocabulary
    assert after["perplexity"] < before["perplexity"] / 5
    assert after["perplexity_freq_0_1000"] < after["perplexity_freq_1000_10000"]  # frequent ids learnt first


def test_nsp_learns_real_pairs(trained):
    """The NSP path (pair layout, token types, pooler, head, loss) learns: 32 real pairs are fitted.

    Held-out NSP accuracy stays at chance within this test's budget (and the default 800
    steps: README), because the model has not yet left the unigram plateau.
    """
    trainer = trained["trainer"]
    examples = [trainer.train_store[i] for i in range(32)]
    batch = collate(examples, list(range(32)), trainer.tokenizer.pad_token_id)
    batch = mask_batch(batch, seed=0, epoch_key=0, rate=0.15, info=trainer.info, corruption=Corruption())
    labels = batch["next_sentence_label"]
    assert 0 < labels.sum() < 32
    module = SparsePretraining(copy.deepcopy(trainer.bert).train())
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    for _ in range(60):
        result = module(**batch)
        result["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    assert result["nsp_loss"] < 0.1 and int(result["nsp_correct"]) == 32


def test_run_folder_has_config_metrics_and_checkpoint(trained):
    run = trained["run_dir"]
    assert (run / "config.yaml").is_file() and (run / "summary.json").is_file()
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in line for line in lines) and any("eval" in line for line in lines)
    assert checkpoint.latest(run).name == f"ckpt-{TRAIN_STEPS:08d}"
    summary = json.loads((run / "summary.json").read_text())
    # Model FLOPs over the measured matmul peak: a utilisation, so in (0, 1] (tiny reaches ~0.1-0.5 on CPU).
    assert 0.01 < summary["mfu"] <= 1.0 and all(0.0 < line["mfu"] <= 1.0 for line in lines if "loss" in line)


def test_export_loads_with_auto_classes_and_matches_logits(trained):
    folder = trained["run_dir"] / "model"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 30522
    auto = AutoModelForMaskedLM.from_pretrained(folder).eval()
    ours = trained["trainer"].bert.eval()
    batch = tokenizer(["The city lies on the river.", "She was born in 1990 and plays basketball."],
                      padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden, _ = encode(ours, batch)
        expected = ours.cls.predictions(hidden)  # (B, T, V)
        got = auto(**batch).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    pretraining = BertForPreTraining.from_pretrained(folder)
    assert torch.equal(pretraining.cls.seq_relationship.weight, ours.cls.seq_relationship.weight)


def _command(out_dir, steps):
    return [sys.executable, "-m", "mlmlab.cli", "pretrain", "--no-progress", f"train.out_dir={out_dir}",
            f"train.max_steps={steps}", "train.save_every=2", "train.eval_every=0", "train.eval_batches=2",
            "train.batch_size=8", "train.warmup_steps=3", "data.loader_workers=0", "train.log_every=1"]


def _newest_step(run_dir):
    found = checkpoint.complete_checkpoints(run_dir, check=False)
    return int(found[-1].name.split("-")[1]) if found else 0


def _weights(run_dir):
    return load_file(str(run_dir / "model" / "model.safetensors"))


def test_sigkill_then_resume_is_bitwise_identical(tmp_path):
    steps = 10
    subprocess.run(_command(tmp_path / "straight", steps), check=True, capture_output=True)
    killed_dir = tmp_path / "killed"
    kill_at = int(np.random.default_rng().integers(2, steps - 2) // 2 * 2) or 2
    proc = subprocess.Popen(_command(killed_dir, steps), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while _newest_step(killed_dir) < kill_at and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed_dir / "model").exists(), "the run finished before it was killed"
    resumed = subprocess.run(_command(killed_dir, steps), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout + resumed.stderr
    straight, again = _weights(tmp_path / "straight"), _weights(killed_dir)
    assert all(torch.equal(straight[name], again[name]) for name in straight)


def test_sigterm_saves_a_checkpoint(tmp_path):
    proc = subprocess.Popen(_command(tmp_path, 100000), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not (tmp_path / "metrics.jsonl").exists() and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    assert proc.returncode != 0
    saved = checkpoint.latest(tmp_path)
    assert saved is not None
    assert json.loads((saved / "trainer_state.json").read_text())["step"] >= 1


def test_corrupt_checkpoint_is_skipped(tmp_path, capsys):
    subprocess.run(_command(tmp_path, 4), check=True, capture_output=True)
    newest = checkpoint.latest(tmp_path)
    (newest / "training_state.pt").write_bytes(b"truncated")
    assert checkpoint.latest(tmp_path).name == "ckpt-00000002"
    assert "does not match its checksum" in capsys.readouterr().out
