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

from mlmlab.data.resolve import tokenizer_dir_for
from mlmlab.data.tokenizer import load_tokenizer
from mlmlab.model.architecture import attention_dropout
from mlmlab.model.architectures import architecture_of, saved_settings
from mlmlab.model.pretraining import IGNORE_INDEX, build_model, pretraining_loss

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


def test_profile_step_profiles_fast_tiny_in_bf16_beside_fp32_against_each_ones_peak():
    """fast-tiny's step in bf16 and the same step in fp32 (a lever arm): each one's MFU against the measured peak
    of its own precision, and its operator time split into matmuls, attention and the rest, the rest's top listed."""
    out = run_benchmark(
        "profile_step.py",
        *("--preset", "fast-tiny", "--arms", "mlmlab-as-shipped", "--set", "train.precision=bf16"),
        *("--lever", "train.precision=fp32", "--steps", "1", "--rows", "3", "--by-shape", *TINY_RUN),
    )
    assert re.search(r"^measured matmul peak: bfloat16 [\d.]+ TFLOP/s, float32 [\d.]+ TFLOP/s$", out, re.M), out
    arms = re.findall(r"^(\S+): [\d.]+ ms of operator self time per step\n  \d+ tokens/s, (\w+): MFU", out, re.M)
    assert arms == [("mlmlab-as-shipped", "bfloat16"), ("mlmlab+precision=fp32", "float32")], out
    assert len(re.findall(r"MFU [\d.]+% of the measured (bfloat16|float32) matmul peak \(", out)) == 2
    split = r"^  operator self time per step: matmuls [\d.]+ ms \(\d+%\), attention kernels [\d.]+ ms \(\d+%\), "
    assert len(re.findall(split + r"everything else [\d.]+ ms \(\d+%\)$", out, re.M)) == 2, out
    listed = out.split("everything else, by self time:")[1]
    assert "aten::mm " not in listed.split("Self CPU time total")[0]  # the matmuls are not among the rest
    assert out.count("Input Shapes") == 2, out  # --by-shape: each arm's operators by the shapes they work on


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
    lines = out.strip().splitlines()
    reached = rf"(\d+\.\d\dx|not reached in {minutes:g} min|reached at its first evaluation)"
    for line, anchor in zip(lines[-2:], ("the ModernBERT anchor", "the run_mlm BERT anchor")):
        # One line per anchor, the strongest first: its ratios, or (a 1.2-second anchor stays on the plateau) why not
        assert re.fullmatch(
            rf"time to {anchor}'s final held-out loss: recommended recipe {reached}, run_mlm's recipe {reached}", line
        ) or re.fullmatch(
            rf"{anchor} has not left the unigram plateau \(held-out MLM accuracy 0\.\d\d\d, not above 0\.20\): "
            "no ratio is read against its loss",
            line,
        ), out
    assert re.search(r"^host: CPU .*; torch .*, threads \d+$", out, re.M), out
    between = r"(never|reached it untrained|\d+\.\d\d-\d+\.\d\d min \(\d+\.\d\d(x or more|-\d+\.\d\dx)\))"
    for line, anchor in zip(lines[-4:-2], ("the ModernBERT anchor", "the run_mlm BERT anchor")):
        assert re.fullmatch(
            rf"evaluations around the crossing of {anchor}'s final loss: recommended recipe {between}, "
            rf"run_mlm's recipe {between}",
            line,
        ), out
    result = json.loads((tmp_path / "out" / "time_to_loss.json").read_text())
    arms = result["arms"]
    assert list(arms) == ["modernbert-anchor", "anchor", "anchor-recipe", "recommended"]
    # One evaluator for all: the same held-out blocks under the same masks (hashed afresh for each arm), and the
    # same number of targets at every evaluation of every arm
    held_out = [arm["held_out"] for arm in arms.values()]
    assert held_out[0]["blocks"] == 32 and held_out == [held_out[0]] * 4
    assert len({point["masked_tokens"] for arm in arms.values() for point in arm["evaluations"]}) == 1
    # run_mlm's recipe in fp32 in both engines; the ModernBERT anchor in what train.precision=auto picks, as fast-tiny
    assert arms["anchor"]["precision"] == arms["anchor-recipe"]["precision"] == "float32"
    assert arms["modernbert-anchor"]["precision"] == arms["recommended"]["precision"]
    for name, arm in arms.items():
        points = arm["evaluations"]
        stamps = [point["train_seconds"] for point in points]
        assert stamps[0] == 0.0 and stamps == sorted(stamps) and len(points) >= 2, name
        spent = 0.0  # the evaluations so far: in the wall time, not in the training time
        for point in points:
            assert abs(point["wall_seconds"] - point["train_seconds"] - spent) < 1e-6, (name, point)
            spent += point["eval_seconds"]
        assert abs(arm["eval_seconds"] - spent) < 1e-6 and arm["trained_seconds"] == stamps[-1]
        anchor = name.endswith("anchor")
        every = result["eval_every_seconds" if anchor else "arm_eval_every_seconds"]
        assert all(b - a >= every for a, b in zip(stamps, stamps[1:-1])), name  # the last one: when training ended
    finals = {}
    for anchor in ("modernbert-anchor", "anchor"):
        assert arms[anchor]["trained_seconds"] >= minutes * 60  # an anchor trains its whole budget
        finals[anchor] = result["anchor_losses"][anchor]["100%"]
        assert finals[anchor] == arms[anchor]["evaluations"][-1]["mlm_loss"]
    for name in ("anchor-recipe", "recommended"):  # each trains until it reaches both anchors' losses, or its budget
        points = arms[name]["evaluations"]
        assert points[-1]["mlm_loss"] <= min(finals.values()) or arms[name]["trained_seconds"] >= minutes * 60, name
        for anchor, final in finals.items():
            reached = min(point["mlm_loss"] for point in points) <= final
            assert reached == (arms[name]["times_to"][anchor]["100%"] is not None), (name, anchor)
            if reached:  # the interpolated time lies between the evaluations around the crossing
                before, after = arms[name]["final_loss_between"][anchor]
                assert before <= arms[name]["times_to"][anchor]["100%"] <= after, (name, anchor)
    assert (tmp_path / "out" / "time_to_loss.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("anchor", ["modernbert-anchor", "anchor"])
def test_each_anchor_is_its_presets_network_in_transformers_defaults(tmp_path, anchor):
    """An anchor is transformers' masked-LM class at its preset's shape, every other setting transformers' default:
    where those shape training (dropout, attention, ModernBERT's windows and RoPE bases) they are the preset's, so the
    anchor and the mlmlab arm of its recipe train the same network (mlmlab's weights load into it, none missing)."""
    time_to_loss = load_benchmark("time_to_loss.py")
    preset, settings = time_to_loss.ANCHORS[anchor]
    args = SimpleNamespace(corpus=None, valid_corpus=None, tokenizer=None, anchor_minutes=1.0)
    cfg = time_to_loss.arm_config(preset, settings, args, tmp_path)
    tokenizer = load_tokenizer(tokenizer_dir_for(cfg.data.tokenizer))
    model = time_to_loss.anchor_model(cfg, tokenizer)
    ours = build_model(cfg.model, len(tokenizer), tokenizer.pad_token_id)
    architecture = architecture_of(ours)
    assert type(model) is {"modernbert-anchor": ModernBertForMaskedLM, "anchor": BertForMaskedLM}[anchor]
    loaded = model.load_state_dict(ours.state_dict(), strict=False)
    assert not loaded.missing_keys and all(
        key.startswith(tuple(architecture.optional_parts)) for key in loaded.unexpected_keys
    )
    theirs, mine = (saved_settings(m.config.to_dict()) for m in (model, ours))
    # transformers keeps ModernBERT's global layers as layer_types unless given global_attn_every_n_layers
    assert {k: v for k, v in theirs.items() if v is not None} == {
        k: v for k, v in mine.items() if theirs[k] is not None
    }
    assert getattr(model.config, "layer_types", None) == getattr(ours.config, "layer_types", None)
    dropouts = architecture.dropout_settings(cfg.model.dropout, attention_dropout(cfg.model))
    assert {key: model.config.to_dict()[key] for key in dropouts} == dropouts
    assert model.config._attn_implementation == ours.config._attn_implementation
    # The ModernBERT anchor's head runs on the masked positions only (transformers' option), as mlmlab's does
    assert getattr(model.config, "sparse_prediction", False) == (anchor == "modernbert-anchor")


def synthetic_arm(losses: list[float], accuracy: float) -> dict:
    """An arm's record as time_to_loss.py keeps it: evaluations a minute apart, the last at ``accuracy``."""
    points = [
        {"step": 10 * i, "train_seconds": 60.0 * i, "mlm_loss": loss, "mlm_accuracy": 0.1}
        for i, loss in enumerate(losses)
    ]
    points[-1]["mlm_accuracy"] = accuracy
    held_out = {"blocks": 32, "dataset": "0" * 16, "mask_seed": 0, "mask_rate": 0.15}
    return {
        "precision": "float32",
        "steps": points[-1]["step"],
        "trained_seconds": points[-1]["train_seconds"],
        "eval_seconds": 1.0,
        "held_out": held_out,
        "evaluations": points,
    }


def test_time_to_loss_reads_a_ratio_only_against_an_anchor_past_the_plateau():
    """The same arms against two anchors: a ratio against the one that ended above the plateau's accuracy, and the
    line that says why there is none against the one that ended on it."""
    time_to_loss = load_benchmark("time_to_loss.py")
    result = {
        "host": "CPU test",
        "torch": "x",
        "transformers": "y",
        "threads": 2,
        "anchor_minutes": 4.0,
        "eval_every_seconds": 60.0,
        "arm_eval_every_seconds": 60.0,
        "arms": {
            "modernbert-anchor": synthetic_arm([9.0, 7.0, 6.0, 5.0, 4.0], accuracy=0.31),  # 4.0 at 4 min
            "anchor": synthetic_arm([9.0, 8.0, 7.0, 6.8, 6.6], accuracy=time_to_loss.LEFT_PLATEAU_ACCURACY),
            "anchor-recipe": synthetic_arm([9.0, 6.0, 4.0], accuracy=0.30),  # 4.0 at 2 min: 2x
            "recommended": synthetic_arm([9.0, 4.0], accuracy=0.30),  # 4.0 at 1 min: 4x
        },
    }
    lines = time_to_loss.report(time_to_loss.with_times(result)).splitlines()
    assert lines[-2] == (
        "time to the ModernBERT anchor's final held-out loss: recommended recipe 4.00x, run_mlm's recipe 2.00x"
    )
    assert lines[-1] == (
        "the run_mlm BERT anchor has not left the unigram plateau (held-out MLM accuracy 0.200, not above 0.20): "
        "no ratio is read against its loss"
    )
    # The times stay in the record whatever the line says: the BERT anchor's 6.6 lies 2.4/5 of the way from 9.0 to 4.0
    assert result["arms"]["recommended"]["times_to"]["anchor"]["100%"] == pytest.approx(60 * 2.4 / 5)


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


def test_allocator_benchmark_measures_one_arm_in_its_own_process(tmp_path):
    allocator = load_benchmark("allocator.py")
    args = SimpleNamespace(
        config="tiny",
        steps=4,
        warmup=1,
        log_every=1,
        set=["train.batch_size=2", "data.max_seq_length=32", "train.warmup_steps=1"],
    )
    measured = allocator.run_arm("command", allocator.ARMS["command"], args, tmp_path / "command")
    assert measured["tokens_per_s"] > 0
    assert measured["peak_gb"] >= measured["half_gb"] > 0.05  # torch alone is resident past 50 MB
    assert measured["faults_per_step"] > 0
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(exited.stdout)
    assert allocator.resident_bytes(pid) is None and allocator.minor_faults(pid) is None
    assert allocator.resident_bytes(os.getpid()) > 0
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        allocator.parse_arms([["arena-1", "MALLOC_ARENA_MAX"]])
    assert allocator.parse_arms([["arena-1", "MALLOC_ARENA_MAX=1"]])["arena-1"] == {"MALLOC_ARENA_MAX": "1"}
