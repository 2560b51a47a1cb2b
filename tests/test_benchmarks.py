"""The benchmark scripts still run and print what the benchmarks page quotes (no timing is checked here).

Nothing else imports them, so a change to what they import broke profile_step.py unseen once.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, SAMPLE
from test_experiments import first_documents
from transformers import BertForMaskedLM, BertForPreTraining, ModernBertForMaskedLM, RobertaForMaskedLM

from mlmlab.model.architectures import architecture_of
from mlmlab.model.pretraining import IGNORE_INDEX, pretraining_loss

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


def test_throughput_takes_roberta_tiny_against_its_anchor():
    out = run_benchmark("throughput.py", "--presets", "roberta-tiny", "--steps", "1", "--rounds", "1", *TINY_RUN)
    assert re.search(r"^roberta-tiny on cpu: measured matmul peak", out, re.M), out
    arms = re.findall(r"^  (\S+) +\d+ +[\d.]+% +(?:float32|bfloat16) +[\d.]+%$", out, re.M)
    assert arms == ["hf-naive", "hf-sparse", "mlmlab-unbucketed", "mlmlab", "hf-sparse-recipe", "mlmlab-as-shipped"]
    for line in ("same recipe", "transformers' defaults"):
        assert re.search(rf"^roberta-tiny vs hf-sparse, {line}: \d+\.\d\dx \(dropout [\d.]+, ", out, re.M), out


def load_benchmark(script: str):
    """A benchmark script as a module (nothing imports them: they are not a package)."""
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), ROOT / "benchmarks" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "preset, overrides, anchor_class",
    [
        ("tiny", [], BertForPreTraining),
        ("tiny", ["data.objective=mlm"], BertForMaskedLM),
        ("roberta-tiny", [], RobertaForMaskedLM),
        ("modernbert-tiny", [], ModernBertForMaskedLM),
    ],
    ids=["bert-nsp", "bert-mlm", "roberta", "modernbert"],
)
def test_the_anchors_score_the_runs_batch_as_mlmlab_does(tmp_path, preset, overrides, anchor_class):
    """The transformers arms are the architecture's own class on mlmlab's config, fed the run's batch (the same
    examples, padded with the tokenizer's pad id, masked with its mask token, never at a special token); given
    mlmlab's weights, the full head (hf-naive), the sparse head (hf-sparse) and mlmlab's sparse loss agree on it.

    RoBERTa counts positions from past the padding id, so a batch padded with another id, or a BERT class on
    RoBERTa's config, would put its tokens at other positions than mlmlab's model does.
    """
    throughput = load_benchmark("throughput.py")
    # Unbucketed batches of 8, so that rows differ in length and the batch holds padding
    settings = ["model.dropout=0.0", "train.precision=fp32", "data.loader_workers=0", "data.bucket_batches=0"]
    trainer = throughput.make_trainer(
        preset, SimpleNamespace(batch_size=8, seq=32), str(tmp_path), settings + overrides
    )
    naive, sparse = (throughput.HFArm(trainer, sparse=flag) for flag in (False, True))
    assert type(sparse.model) is anchor_class and type(naive.model) is anchor_class
    lacks = tuple(architecture_of(trainer.model).optional_parts)  # a BertForMaskedLM has no pooler or NSP head
    for arm in (naive, sparse):
        loaded = arm.model.load_state_dict(trainer.model.state_dict(), strict=False)
        assert not loaded.missing_keys and all(key.startswith(lacks) for key in loaded.unexpected_keys), loaded
    tokenizer = trainer.tokenizer
    sparse.collator.generator = torch.Generator().manual_seed(0)  # the collator's draws, not the global RNG's
    loader = trainer.batches()  # mlmlab's own loader, on the same plan
    for _ in range(50):  # batch by batch the same examples, up to one that holds padding
        batch, loaded = sparse.next_batch(), next(loader)
        labels = batch["labels"]  # (B, T)
        selected = labels != IGNORE_INDEX  # (B, T)
        assert torch.equal(torch.where(selected, labels, batch["input_ids"]), loaded["input_ids"])
        assert torch.equal(batch["attention_mask"], loaded["attention_mask"])
        if not batch["attention_mask"].all():
            break
    padding = batch["attention_mask"] == 0  # (B, T)
    assert padding.any() and (batch["input_ids"][padding] == tokenizer.pad_token_id).all()
    assert not torch.isin(labels[selected], torch.tensor(tokenizer.all_special_ids)).any()
    assert (batch["input_ids"][selected] == tokenizer.mask_token_id).any()

    expected = pretraining_loss(trainer.model, {"token_type_ids": None, **batch}, use_nsp=naive.nsp)["loss"]
    torch.testing.assert_close(sparse._sparse_loss(batch)[0], expected)
    torch.testing.assert_close(naive._full_loss(batch)[0], expected)


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


def test_time_to_a_loss_is_interpolated_between_the_evaluations_around_the_crossing():
    time_to_loss = load_benchmark("time_to_loss.py")
    curve = [
        {"train_seconds": 0.0, "mlm_loss": 10.0},
        {"train_seconds": 10.0, "mlm_loss": 8.0},
        {"train_seconds": 20.0, "mlm_loss": 6.0},
        {"train_seconds": 30.0, "mlm_loss": 7.0},  # a rise after the crossing does not move it
    ]
    assert time_to_loss.time_to(curve, 7.0) == 15.0
    assert time_to_loss.time_to(curve, 6.0) == 20.0
    assert time_to_loss.time_to(curve, 11.0) == 0.0  # reached before any training
    assert time_to_loss.time_to(curve, 5.0) is None
    # the evaluations the crossing lies between, whatever the curve did in between them
    assert [p["train_seconds"] for p in time_to_loss.crossing(curve, 7.0)] == [10.0, 20.0]
    assert [p["train_seconds"] for p in time_to_loss.crossing(curve, 11.0)] == [0.0, 0.0]
    assert time_to_loss.crossing(curve, 5.0) is None
    assert time_to_loss.loss_at(curve, 5.0) == 9.0
    assert time_to_loss.loss_at(curve, 40.0) == 7.0  # past the last evaluation: the last one's


def test_time_to_loss_times_every_arm_on_the_same_masks_with_evaluations_off_the_clock(tmp_path):
    minutes = 0.02
    out = run_benchmark(
        "time_to_loss.py",
        *("--anchor-minutes", str(minutes), "--eval-every-seconds", "0.3", "--arm-eval-every-seconds", "0.1"),
        *("--eval-batches", "1"),
        *(
            "--corpus",
            str(first_documents(SAMPLE / "train.txt.gz", 150, tmp_path / "corpus.txt")),
            "--out",
            str(tmp_path / "out"),
        ),
    )
    reached = rf"(\d+\.\d\dx|not reached in {minutes:g} min|reached at its first evaluation)"
    assert re.fullmatch(
        rf"time to the anchor's final held-out loss: recommended recipe {reached}, anchor's recipe {reached}",
        out.strip().splitlines()[-1],
    ), out
    assert re.search(r"^host: CPU .*; torch .*, threads \d+$", out, re.M), out
    between = r"(never|reached it untrained|\d+\.\d\d-\d+\.\d\d min \(\d+\.\d\d(x or more|-\d+\.\d\dx)\))"
    assert re.fullmatch(
        rf"evaluations around the crossing of the anchor's final loss: recommended recipe {between}, "
        rf"anchor's recipe {between}",
        out.strip().splitlines()[-2],
    ), out
    result = json.loads((tmp_path / "out" / "time_to_loss.json").read_text())
    arms = result["arms"]
    assert list(arms) == ["anchor", "anchor-recipe", "recommended"]
    # One evaluator for all: the same held-out blocks under the same masks (hashed afresh for each arm), and the
    # same number of targets at every evaluation of every arm
    held_out = [arm["held_out"] for arm in arms.values()]
    assert held_out[0]["blocks"] == 32 and held_out == [held_out[0]] * 3
    assert len({point["masked_tokens"] for arm in arms.values() for point in arm["evaluations"]}) == 1
    assert [arm["precision"] for arm in arms.values()][:2] == ["float32", "float32"]
    for name, arm in arms.items():
        points = arm["evaluations"]
        stamps = [point["train_seconds"] for point in points]
        assert stamps[0] == 0.0 and stamps == sorted(stamps) and len(points) >= 2, name
        spent = 0.0  # the evaluations so far: in the wall time, not in the training time
        for point in points:
            assert abs(point["wall_seconds"] - point["train_seconds"] - spent) < 1e-6, (name, point)
            spent += point["eval_seconds"]
        assert abs(arm["eval_seconds"] - spent) < 1e-6 and arm["trained_seconds"] == stamps[-1]
        every = result["eval_every_seconds" if name == "anchor" else "arm_eval_every_seconds"]
        assert all(b - a >= every for a, b in zip(stamps, stamps[1:-1])), name  # the last one: when training ended
    assert arms["anchor"]["trained_seconds"] >= minutes * 60  # the anchor trains its whole budget
    final = result["anchor_losses"]["100%"]
    assert final == arms["anchor"]["evaluations"][-1]["mlm_loss"]
    for name in ("anchor-recipe", "recommended"):  # each trains until it reaches the anchor's loss, or its budget
        reached = arms[name]["evaluations"][-1]["mlm_loss"] <= final
        assert reached == (arms[name]["times_to"]["100%"] is not None), name
        if reached:  # the interpolated time lies between the evaluations around the crossing
            before, after = arms[name]["final_loss_between"]
            assert before <= arms[name]["times_to"]["100%"] <= after, name
    assert (tmp_path / "out" / "time_to_loss.png").read_bytes().startswith(b"\x89PNG")


def test_time_to_loss_refuses_a_budget_of_nothing_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "time_to_loss.py", "--anchor-minutes", "0", "--out", str(tmp_path / "out")],
        cwd=ROOT / "benchmarks",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "time_to_loss.py: error: --anchor-minutes=0.0 must be positive and finite; use e.g. --anchor-minutes=60"
    ]
    assert not (tmp_path / "out").exists()
