"""Studies: grid expansion, shards, budgets, resume without retraining, reports from results alone."""

import copy
import dataclasses
import gzip
import hashlib
import json
import math
import os
import re
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import ROOT, STUDY_PRESETS, corpus_folders, shipped_study
from scipy import stats
from test_hostile_inputs import study_with_its_first_row, write_glue_task, write_study_file

from mlmlab.cli import main
from mlmlab.config import ModelConfig, to_dict
from mlmlab.data.resolve import SAMPLE_VALID
from mlmlab.errors import UserError
from mlmlab.experiments import study as study_file
from mlmlab.experiments.gates import describe, gate_results
from mlmlab.experiments.reporting import report, screening
from mlmlab.experiments.reporting.curves import mean_curve, progress_of, steps_to_target
from mlmlab.experiments.reporting.decision import INCONCLUSIVE, WIN, decide
from mlmlab.experiments.reporting.measures import Metric, metrics_of
from mlmlab.experiments.reporting.statistics import compare, compare_by_seed, detectable_effect, holm
from mlmlab.experiments.running import downstream, dry_run, identity, runner
from mlmlab.experiments.screen import screen_pick

TINY_BASE = {
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
    "data": {"loader_workers": 0},
    "train": {
        "batch_size": 8,
        "max_steps": 4,
        "warmup_steps": 1,
        "log_every": 1,
        "eval_every": 2,
        "eval_batches": 2,
        "save_every": 2,
    },
}
DYNAMIC = {"name": "dynamic", "masking.strategy": "dynamic"}
ENTROPY = {"name": "adm-entropy", "masking.strategy": "adaptive", "masking.scorer": "entropy"}
DEFAULT_DROPOUT = ModelConfig().dropout


def write_study(tmp_path, **fields):
    tree = {"base": TINY_BASE, "arms": [DYNAMIC, ENTROPY], "seeds": [0], "out_dir": str(tmp_path / "out"), **fields}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return str(path)


def test_grid_expands_to_named_arms_and_seed_major_runs(tmp_path):
    grid = [
        {
            "prefix": "adm",
            "fixed": {"masking.strategy": "adaptive"},
            "vary": {"masking.scorer": ["loss_ema", "context"], "masking.a_max": [0.5, 1.0]},
        }
    ]
    study = study_file.load_study(write_study(tmp_path, grid=grid, seeds=[0, 1]))
    names = [arm.name for arm in study.arms]
    assert names == [
        "dynamic",
        "adm-entropy",
        "adm-scorer=loss_ema-a_max=0.5",
        "adm-scorer=loss_ema-a_max=1.0",
        "adm-scorer=context-a_max=0.5",
        "adm-scorer=context-a_max=1.0",
    ]
    runs = runner.plan_runs(study)
    assert [(r.seed, r.arm.name) for r in runs[:2]] == [(0, "dynamic"), (0, "adm-entropy")]
    assert len(runs) == 12 and len({r.key for r in runs}) == 12
    run = runs[-1]
    assert (run.config.masking.scorer, run.config.masking.a_max, run.config.train.seed, run.config.masking.seed) == (
        "context",
        1.0,
        1,
        1,
    )
    assert run.config.train.out_dir.endswith("runs/adm-scorer=context-a_max=1.0/seed1")


def test_shards_partition_runs_disjointly_and_completely(tmp_path):
    study = study_file.load_study(write_study(tmp_path, seeds=[0, 1, 2]))
    runs = runner.plan_runs(study)
    shards = [runner.shard_runs(runs, runner.parse_shard(f"{i}/4")) for i in range(4)]
    keys = [run.key for shard in shards for run in shard]
    assert sorted(keys) == sorted(run.key for run in runs) and len(set(keys)) == len(keys)
    for bad in ("4/4", "1", "a/b"):
        with pytest.raises(UserError, match="--shard"):
            runner.parse_shard(bad)


@pytest.mark.shared_data(*corpus_folders("adm-study-v3"))
def test_every_shard_holds_a_share_of_the_gate_arm_and_runs_it_first(monkeypatch):
    """adm-study-v3: 6 arms x 4 seeds in 2 shards. By index alone all 4 dynamic runs fell in shard 0."""
    monkeypatch.chdir(ROOT)  # the study's data paths are relative to the repository root
    study = study_file.load_study("adm-study-v3")
    runs = runner.plan_runs(study)
    shards = [runner.shard_runs(runs, (i, 2), study.gates.arm) for i in range(2)]
    assert [[(run.arm.name, run.seed) for run in shard[:2]] for shard in shards] == [
        [("dynamic", 0), ("dynamic", 2)],
        [("dynamic", 1), ("dynamic", 3)],
    ]
    assert sorted(run.key for shard in shards for run in shard) == sorted(run.key for run in runs)


def test_compute_matched_gives_the_entropy_arm_fewer_steps(tmp_path):
    base = {**TINY_BASE, "train": {**TINY_BASE["train"], "max_steps": 1000, "warmup_steps": 100}}
    runs = runner.plan_runs(study_file.load_study(write_study(tmp_path, base=base, budget="compute-matched")))
    steps = {run.arm.name: run.config.train.max_steps for run in runs}
    assert steps["dynamic"] == 1000 and steps["adm-entropy"] < 1000
    entropy = next(run for run in runs if run.arm.name == "adm-entropy")
    assert entropy.config.train.warmup_steps == round(100 * steps["adm-entropy"] / 1000)
    assert entropy.cost["flops"] == pytest.approx(runs[0].cost["flops"], rel=0.01)  # same FLOPs budget
    token = runner.plan_runs(study_file.load_study(write_study(tmp_path, base=base, budget="token-matched")))
    assert {run.config.train.max_steps for run in token} == {1000}


def test_a_token_matched_arm_with_a_batch_warmup_trains_on_the_reference_sequences():
    """The warming steps are smaller, so the arm needs more of them: as many sequences, not as many steps."""
    from mlmlab.config import load_config
    from mlmlab.experiments.budget import batch_shares, matched_steps

    reference = load_config("tiny", ["train.max_steps=1000"])
    warm = load_config(
        "tiny", ["train.max_steps=1000", "train.batch_size=8", "train.grad_accum=4", "train.batch_warmup_steps=200"]
    )
    steps = matched_steps(warm, reference, "token-matched")
    sequences = 8 * 4 * batch_shares(warm, steps).sum()  # what the loop reads: micro_batches_at per step
    assert steps > 1000 and abs(sequences - 1000 * 32) <= 32 / 2
    assert matched_steps(reference, reference, "token-matched") == 1000


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"arms": [DYNAMIC], "sedes": [0]}, ["unknown study key", "sedes"]),
        ({"arms": [DYNAMIC, {"name": "x", "masking.scorr": "entropy"}]}, ["arm 'x'", "masking.scorr"]),
        ({"arms": [DYNAMIC, {"name": "x", "train.seed": 3}]}, ["train.seed", "seeds"]),
        ({"arms": [{"name": "adm", "masking.strategy": "adaptive"}]}, ["baseline 'dynamic'"]),
        ({"arms": [DYNAMIC, {"name": "dyn2"}]}, ["same config"]),
        ({"budget": "flops"}, ["budget"]),
        ({"glue": {"tasks": ["RTE", "MNLX"]}}, ["MNLX"]),
        ({"glue": {"tasks": ["RTE"], "seeds": 3}}, ["study key 'glue'", "seeds 3"]),
        ({"glue": {"tasks": ["RTE"], "epochs": "5"}}, ["study key 'glue'", "epochs='5'"]),
        ({"glue": {"tasks": ["RTE"], "max_length": 4}}, ["study key 'glue'", "max_length >= 8"]),
        ({"pinned": {"model": 3}}, ["study key 'pinned'"]),
        ({"gates": {"arm": "dynamic", "min": {"eval.mlm_acc": 0.1}}}, ["gates min", "'eval.mlm_acc'", "row paths"]),
        ({"decision": {"metric": "glue.tasks.STS-B.dev.pearson"}}, ["decision metric", "no result row of this study"]),
        ({"decision": {"metric": "eval.mlm_loss", "guard": {"eval_data.wt.mlm_loss": 0.1}}}, ["decision guard"]),
        (
            {"decision": {"metric": "eval.mlm_loss", "contrasts": [["dynamic", "constant-30"]]}},
            ["contrast", "constant-30", "not an arm"],
        ),
        ({"decision": {"metric": "eval.mlm_loss", "contrasts": [["dynamic", "dynamic"]]}}, ["two different arm names"]),
        (
            {"decision": {"metric": "eval.mlm_loss", "target": 5.8, "lower_target": 6.0}},
            ["lower_target", "past target"],
        ),
    ],
)
def test_bad_study_files_give_one_line_errors(tmp_path, capsys, fields, words):
    source = write_study(tmp_path, **fields)
    assert main(["study", source, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlmlab: error: ") and "\n" not in err
    for word in words:
        assert word in err, err


@pytest.mark.shared_data("glue")  # its dry run prices the study's GLUE fine-tuning on the real tasks
def test_dry_run_of_roberta_base_prints_the_cost_without_training(tmp_path, capsys):
    assert main(["study", "roberta-base-adm", "--dry-run", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "GPU-hours" in out and "FLOPs" in out and "500000" in out and "8000" in out
    assert not (tmp_path / "out").exists()


def test_dry_run_probe_times_each_arm_and_extrapolates_a_run(tmp_path, capsys):
    assert main(["study", write_study(tmp_path), "--dry-run", "--time-steps", "1"]) == 0
    out = capsys.readouterr().out
    timed = [line.split() for line in out.splitlines() if line.startswith("  dynamic") or line.startswith("  adm-")]
    assert [row[0] for row in timed] == ["dynamic", "adm-entropy"] and float(timed[0][1]) > 0
    assert timed[0][2] == "1.00x" and "this shard's runs left, timed:" in out
    assert not (tmp_path / "out").exists()  # the probes leave nothing behind


def test_dry_run_counts_only_the_runs_left(tmp_path, capsys):
    source = write_study(tmp_path, seeds=[0, 1])
    runs = runner.plan_runs(study_file.load_study(source))
    (tmp_path / "out").mkdir()
    runner.append_row(tmp_path / "out" / "results.jsonl", result_row(runs[0].key, arm=runs[0].arm.name))
    (Path(runs[1].config.train.out_dir) / "ckpt-00000005").mkdir(parents=True)  # a run stopped at step 5
    training = Path(runs[2].config.train.out_dir)  # a run this process trains, by its lock file
    training.mkdir(parents=True)
    (training / ".lock").write_text(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    (training / "metrics.jsonl").write_text('{"step": 2, "loss": 9.0}\n{"step": 3, "loss": 8.5}\n')
    assert main(["study", source, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "this shard: 1 of its 4 runs already in" in out
    assert [line for line in out.splitlines() if line.startswith("left:")] == [
        "left: adm-entropy seed 0 (resumes from its checkpoint at step 5)",
        f"left: dynamic seed 1 (training in pid {os.getpid()}, logged step 3 of 4)",
        "left: adm-entropy seed 1 (not started)",
    ]
    (training / ".lock").write_text(f"pid {os.getpid()} on host another-{socket.gethostname()}\n")
    assert dry_run.run_state(runs[2]) == "not started"  # a lock naming another host says nothing of this one
    (training / ".lock").write_text(f"pid {2**30} on host {socket.gethostname()}\n")  # past any pid_max: ended
    assert dry_run.run_state(runs[2]) == "not started"


def test_only_names_an_arms_every_seed_or_one_of_them_and_the_dry_run_lists_just_those(tmp_path, capsys):
    source = write_study(tmp_path, seeds=[0, 1])
    study = study_file.load_study(source)
    runs = runner.plan_runs(study)
    chosen = runner.only_runs(runs, runner.parse_only(["adm-entropy/seed1", "dynamic"], study))
    assert [(run.arm.name, run.seed) for run in chosen] == [("dynamic", 0), ("dynamic", 1), ("adm-entropy", 1)]
    assert runner.only_runs(runs, ()) == runs
    assert main(["study", source, "--dry-run", "--only", "adm-entropy/seed1"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("left:")] == ["left: adm-entropy seed 1 (not started)"]
    for spec, message in (
        ("adm", "no arm 'adm'; its arms are dynamic, adm-entropy"),
        ("dynamic/seed7", "no seed 7; its seeds are 0, 1"),
    ):
        with pytest.raises(UserError, match=message):
            runner.parse_only([spec], study)


def test_a_time_limit_starts_only_the_runs_that_fit_by_their_arms_finished_runs(tmp_path, monkeypatch):
    """--time-limit: a run of an arm whose finished runs took 10 min is not started with 5 min left, nor is one
    whose checkpoint holds half of it with 4 min left; with 6 min left that one is. A run of an arm with none
    finished takes its FLOPs at the other arms' pace; with no finished run in the study it is started (nothing
    says how long it takes)."""
    study = study_file.load_study(write_study(tmp_path, seeds=[0, 1, 2]))
    runs = {(run.arm.name, run.seed): run for run in runner.plan_runs(study)}
    dynamic_flops, adm_flops = runs["dynamic", 0].cost["flops"], runs["adm-entropy", 0].cost["flops"]
    assert adm_flops > 1.5 * dynamic_flops  # the entropy scorer's pass over the vocabulary
    rows = [result_row(runs["dynamic", 0].key, wall_seconds=600.0, flops=dynamic_flops)]
    now = 1000.0
    monkeypatch.setattr(runner.time, "monotonic", lambda: now)
    assert runner.not_in_time(runs["dynamic", 1], rows, now + 300) == (
        "~10 min (the median of its arm's 1 finished runs) and 5 min left of --time-limit"
    )
    adm_minutes = 10 * adm_flops / dynamic_flops
    assert runner.not_in_time(runs["adm-entropy", 1], rows, now + 60 * 12) == (
        f"~{adm_minutes:.0f} min (its {adm_flops:.3g} FLOPs at the median pace of the study's 1 finished runs) "
        "and 12 min left of --time-limit"
    )
    assert runner.not_in_time(runs["adm-entropy", 1], rows, now + 60 * (adm_minutes + 1)) == ""
    assert runner.not_in_time(runs["adm-entropy", 1], [], now + 1) == ""
    assert runner.not_in_time(runs["dynamic", 1], rows, math.inf) == ""
    half = runs["dynamic", 2].cost["steps"] // 2  # 4 steps: a checkpoint at step 2
    (Path(runs["dynamic", 2].config.train.out_dir) / f"ckpt-{half:08d}").mkdir(parents=True)
    assert "~5 min (the median of its arm's 1 finished runs, less the 50% its checkpoint holds)" in runner.not_in_time(
        runs["dynamic", 2], rows, now + 240
    )
    assert runner.not_in_time(runs["dynamic", 2], rows, now + 360) == ""


def test_the_runner_says_which_runs_the_time_limit_left_unstarted(tmp_path):
    study = study_file.load_study(write_study(tmp_path, seeds=[0, 1]))
    first = runner.plan_runs(study)[0]
    (tmp_path / "out").mkdir()
    runner.append_row(
        tmp_path / "out" / "results.jsonl",
        result_row(first.key, wall_seconds=600.0, config=to_dict(first.config), datasets=first.datasets),
    )
    lines = []
    assert (
        runner.run_study(study, show_progress=False, log=lines.append, only=(("dynamic", None),), time_limit=1.0) == []
    )
    assert (
        "[2/2] dynamic seed 1: not started, ~10 min (the median of its arm's 1 finished runs) and 1 min left of "
        "--time-limit" in lines
    )


def test_a_time_limit_is_minutes_from_the_command(tmp_path, capsys):
    assert main(["study", write_study(tmp_path), "--time-limit", "-1"]) == 2
    assert "--time-limit" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name",
    [shipped_study(path.stem) for path in sorted(STUDY_PRESETS.glob("*.yaml")) if path.stem != "roberta-base-adm"],
)  # roberta-base-adm: its own test above
def test_presets_load_and_validate_every_arm(name):
    study = study_file.load_study(name)
    least_seeds = 2 if name == "quick-compare" else 3  # a study to copy in minutes; its file says a real one needs more
    assert len(study.seeds) >= least_seeds and study.baseline in [arm.name for arm in study.arms]
    runner.plan_runs(study)


def test_run_keys_follow_what_the_study_sets_not_mlmlab_defaults(tmp_path):
    """A key added to mlmlab later (or any key the study leaves at its default) does not change a run's key."""
    study = study_file.load_study(write_study(tmp_path))
    run = runner.plan_runs(study)[0]
    explicit = study.explicit | set(run.arm.overrides)
    settings = identity.settings_of(study)
    redefaulted = dataclasses.replace(run.config, model=dataclasses.replace(run.config.model, dropout=0.3))
    assert "model.dropout" not in explicit
    assert identity.identity_hash(redefaulted, explicit, run.datasets, settings) == run.key.rsplit("/", 1)[1]
    set_by_study = dataclasses.replace(run.config, train=dataclasses.replace(run.config.train, batch_size=4))
    assert identity.identity_hash(set_by_study, explicit, run.datasets, settings) != run.key.rsplit("/", 1)[1]
    assert identity.identity_hash(run.config, explicit, {"train": "other"}, settings) != run.key.rsplit("/", 1)[1]


def test_a_glue_setting_added_later_changes_no_key_until_a_study_sets_it(tmp_path, monkeypatch):
    # as if max_train_examples were a field added after the keys were made: at its default the
    # key is made of what it was made of before the field existed
    monkeypatch.setattr(identity, "KEYED_GLUE_FIELDS", identity.KEYED_GLUE_FIELDS[:-1])
    default = identity.settings_of(study_file.load_study(write_study(tmp_path)))["glue"]
    assert "max_train_examples" not in default and "epochs" in default
    sampled = write_study(tmp_path, glue={"tasks": [], "max_train_examples": 100})
    assert identity.settings_of(study_file.load_study(sampled))["glue"]["max_train_examples"] == 100


def _row_as_made(run, **changes) -> dict:
    cfg = dataclasses.replace(run.config, model=dataclasses.replace(run.config.model, **changes))
    return {"key": run.key, "arm": run.arm.name, "seed": run.seed, "config": to_dict(cfg), "datasets": run.datasets}


def test_finished_runs_made_under_other_defaults_or_data_are_refused_not_mixed(tmp_path):
    runs = runner.plan_runs(study_file.load_study(write_study(tmp_path)))
    runner.refuse_incomparable(runs, [_row_as_made(runs[0])])  # the same settings: fine
    old = _row_as_made(runs[0])
    del old["config"]["model"]["attention_dropout"]  # a key the old mlmlab did not have: fine
    runner.refuse_incomparable(runs, [old])
    with pytest.raises(UserError, match=rf"model.dropout: 0.3 -> {DEFAULT_DROPOUT}"):
        runner.refuse_incomparable(runs, [_row_as_made(runs[0], dropout=0.3)])
    with pytest.raises(UserError, match="prepared data"):
        runner.refuse_incomparable(runs, [{**_row_as_made(runs[0]), "datasets": {"train": "x", "valid": "y"}}])


def test_a_row_from_before_data_hashed_keys_is_refused_naming_the_rerun_command(tmp_path):
    runs = runner.plan_runs(study_file.load_study(write_study(tmp_path)))
    legacy = {
        **_row_as_made(runs[0]),
        "key": "dynamic/seed0/f5c36a6940e8",
        "study_source": "s.yaml",
        "out_dir": "studies/s",
    }
    del legacy["datasets"]
    with pytest.raises(
        UserError, match="older than run keys with data hashes.*mlmlab study s.yaml --out studies/s-rerun"
    ):
        runner.refuse_incomparable(runs, [legacy])


@pytest.mark.parametrize(
    "name", [shipped_study(path.parent.name) for path in sorted((ROOT / "studies").glob("*/results.jsonl"))]
)
def test_every_shipped_study_finds_its_rows_as_finished_runs(name, monkeypatch):
    """A change to a default, a key or data preparation that a shipped study did not pin would retrain its finished
    runs or refuse them; the one study from before data-hashed keys names its rerun command instead."""
    monkeypatch.chdir(ROOT)  # the studies' data paths are relative to the repository root
    study = study_file.load_study(name)
    runs, rows = runner.plan_runs(study), runner.finished_rows(Path(study.out_dir) / runner.RESULTS_FILE)
    if all("datasets" not in row for row in rows):
        with pytest.raises(UserError, match=f"--out studies/{name}-rerun"):
            runner.refuse_incomparable(runs, rows)
        return
    runner.refuse_incomparable(runs, rows)
    assert {row["key"] for row in rows} <= {run.key for run in runs}


def test_a_changed_default_is_pinned_under_pinned_without_changing_run_keys(tmp_path):
    """Finished under dropout 0.3 (then mlmlab's default, say); the default is now another."""
    finished = runner.plan_runs(study_file.load_study(write_study(tmp_path)))[0]
    row = _row_as_made(finished, dropout=0.3)
    with pytest.raises(UserError, match=rf"model.dropout: 0.3 -> {DEFAULT_DROPOUT}.*pinned:"):
        runner.refuse_incomparable([finished], [row])
    in_base = {**TINY_BASE, "model": {**TINY_BASE["model"], "dropout": 0.3}}
    rekeyed = runner.plan_runs(study_file.load_study(write_study(tmp_path, base=in_base)))
    with pytest.raises(UserError, match="another key .* pinned:"):  # base: every key changes
        runner.refuse_incomparable(rekeyed, [row])
    pinned = runner.plan_runs(study_file.load_study(write_study(tmp_path, pinned={"model": {"dropout": 0.3}})))
    assert pinned[0].config.model.dropout == 0.3 and pinned[0].key == finished.key
    runner.refuse_incomparable(pinned, [row])
    with pytest.raises(UserError, match="model.dropout is set in both base: and pinned:"):
        study_file.load_study(write_study(tmp_path, base=in_base, pinned={"model": {"dropout": 0.3}}))


def test_a_gate_on_a_figure_the_rows_lack_is_not_measured_not_failed(tmp_path):
    gates = {"arm": "dynamic", "min": {"glue.tasks.STS-B.dev.pearson": 0.35}}
    study = study_file.load_study(write_study(tmp_path, glue={"tasks": ["STS-B"]}, gates=gates))
    planned = runner.plan_runs(study)
    rows = [{"key": run.key, "glue": {"skipped": "why"}} for run in planned if run.arm.name == "dynamic"]
    with pytest.raises(UserError, match="cannot be checked: glue.tasks.STS-B.dev.pearson not measured"):
        runner.check_gates(study, planned, rows)


def test_a_study_with_glue_tasks_and_no_glue_dir_stops_before_training(tmp_path):
    for glue_dir in (None, str(tmp_path / "no-such-folder")):
        fields = {"glue": {"tasks": ["STS-B"]}, **({"glue_dir": glue_dir} if glue_dir else {})}
        with pytest.raises(UserError, match="fine-tunes on STS-B but glue_dir .* is not a folder"):
            runner.run_study(study_file.load_study(write_study(tmp_path, **fields)), log=lambda line: None)
    assert not (tmp_path / "out" / "runs").exists()


def test_a_study_whose_glue_or_probes_read_past_its_models_positions_stops_before_training(tmp_path, capsys):
    """Before, each run trained, then failed at GLUE ("index out of range" in the position embedding), and every rerun
    trained it again: the study could never finish."""
    write_glue_task(tmp_path / "glue" / "SST-2")
    short = copy.deepcopy(TINY_BASE)
    short["model"]["max_position_embeddings"], short["data"]["max_seq_length"] = 64, 64
    fields = {"base": short, "glue_dir": str(tmp_path / "glue")}
    for more, words in [
        ({"glue": {"tasks": ["SST-2", "RTE"]}}, "GLUE RTE reads inputs of up to 128 tokens"),  # RTE's default length
        ({"glue": {"tasks": ["SST-2"], "max_length": 65}}, "GLUE SST-2 reads inputs of up to 65 tokens"),
        ({"probe": {"tasks": ["SST-2", "MRPC"]}}, "the MRPC probe reads inputs of up to 128 tokens"),
    ]:
        study = study_file.load_study(write_study(tmp_path, **fields, **more))
        with pytest.raises(UserError, match=f"{words}, but arm dynamic's model takes at most 64; "):
            runner.run_study(study, log=lambda line: None)
        assert main(["study", write_study(tmp_path, **fields, **more), "--dry-run"]) == 2
        assert words in capsys.readouterr().err
    assert not (tmp_path / "out" / "runs").exists()
    fits = study_file.load_study(write_study(tmp_path, **fields, glue={"tasks": ["SST-2"]}, probe={"tasks": ["SST-2"]}))
    downstream.check_positions(fits, {run.arm.name: run.config for run in runner.plan_runs(fits)})  # SST-2 reads 64


def result_row(key: str, **fields) -> dict:
    return {"key": key, "arm": "dynamic", "seed": 0, "eval": {"mlm_loss": 5.0}, **fields}


def test_a_row_after_a_line_cut_short_is_kept(tmp_path):
    results = tmp_path / "results.jsonl"
    runner.append_row(results, result_row("a"))
    with open(results, "a") as handle:
        handle.write('{"key": "b", "cut sh')  # a crash mid-write
    runner.append_row(results, result_row("c", seed=1))
    assert [row["key"] for row in runner.finished_rows(results)] == ["a", "c"]


def test_the_runner_and_the_report_count_the_same_rows(tmp_path):
    results = tmp_path / "results.jsonl"
    without_eval = {key: value for key, value in result_row("b", seed=1).items() if key != "eval"}
    without_key = {key: value for key, value in result_row("c", seed=2).items() if key != "key"}
    for row in (result_row("a"), without_eval, without_key):
        runner.append_row(results, row)
    assert [row["key"] for row in runner.finished_rows(results)] == ["a"]  # b and c rerun ...
    rows, notes = report.load_rows(results)  # ... and are not compared meanwhile
    assert [row["key"] for row in rows] == ["a"]
    assert notes == [f"line {n} of results.jsonl is not a complete result row and was ignored" for n in (2, 3)]


def test_arms_of_other_batch_sizes_are_evaluated_on_the_same_sequences(tmp_path, monkeypatch):
    arms = [DYNAMIC, {**DYNAMIC, "name": "dynamic-b4", "train.batch_size": 4}]
    base = {**TINY_BASE, "train": {**TINY_BASE["train"], "max_steps": 2, "eval_every": 0, "eval_batch_size": 8}}
    study = study_file.load_study(write_study(tmp_path, base=base, arms=arms))
    trims = []  # the rows already written at each heap trim
    monkeypatch.setattr(
        runner,
        "release_freed_memory",
        lambda: trims.append(len(runner.finished_rows(Path(study.out_dir) / "results.jsonl"))),
    )
    rows = runner.run_study(study, show_progress=False, log=lambda line: None)
    assert [row["arm"] for row in rows] == ["dynamic", "dynamic-b4"]
    assert rows[0]["eval"]["masked_tokens"] == rows[1]["eval"]["masked_tokens"]  # 2 batches of 8 sequences each
    assert trims == [0, 1]  # before each run, after the one before it: a long study's heap does not pile up


def test_an_arm_can_run_compute_matched_beside_token_matched_arms(tmp_path):
    base = {**TINY_BASE, "train": {**TINY_BASE["train"], "max_steps": 1000, "warmup_steps": 100}}
    arms = [DYNAMIC, ENTROPY, {**ENTROPY, "name": "adm-entropy-cm", "budget": "compute-matched"}]
    runs = {
        run.arm.name: run
        for run in runner.plan_runs(study_file.load_study(write_study(tmp_path, base=base, arms=arms)))
    }
    assert runs["adm-entropy"].config.train.max_steps == 1000
    assert runs["adm-entropy-cm"].config.train.max_steps < 1000
    assert runs["adm-entropy-cm"].cost["flops"] == pytest.approx(runs["dynamic"].cost["flops"], rel=0.01)


def first_documents(corpus: Path, count: int, out: Path) -> Path:
    """The first ``count`` <doc> documents of a gzipped corpus, as a text file: a held-out set evaluated in seconds."""
    kept, closed = [], 0
    with gzip.open(corpus, "rt", encoding="utf-8") as lines:
        for line in lines:
            kept.append(line)
            closed += line.startswith("</doc>")
            if closed == count:
                break
    out.write_text("".join(kept), encoding="utf-8")
    return out


def test_gates_run_the_gate_arm_first_and_stop_the_others_when_they_fail(tmp_path):
    gates = {"arm": "dynamic", "min": {"eval.mlm_accuracy": 2.0}}  # unreachable: accuracy is at most 1
    eval_data = {"valid-again": str(first_documents(SAMPLE_VALID, 10, tmp_path / "valid-again.txt"))}
    arms = [ENTROPY, DYNAMIC]  # the gate arm is listed second and still runs first
    decision = {"metric": "eval.mlm_loss", "min_effect": 0.01}
    study = study_file.load_study(write_study(tmp_path, arms=arms, gates=gates, eval_data=eval_data, decision=decision))
    with pytest.raises(UserError, match=r"validity gates failed on dynamic .*eval.mlm_accuracy .* < 2"):
        runner.run_study(study, show_progress=False, log=lambda line: None)
    rows = runner.finished_rows(tmp_path / "out" / "results.jsonl")
    assert [row["arm"] for row in rows] == ["dynamic"]
    assert rows[0]["eval_data"]["valid-again"]["masked_tokens"] > 0  # the further held-out set was evaluated
    assert rows[0]["gates"] == {"arm": "dynamic", "min": {"eval.mlm_accuracy": 2.0}}
    assert rows[0]["decision"] == {
        "metric": "eval.mlm_loss",
        "lower_is_better": True,
        "min_effect": 0.01,
        "guard": {},
        "target": None,
        "lower_target": None,
        "contrasts": [],
    }
    text = report.write_report(tmp_path / "out" / "results.jsonl", tmp_path / "report").read_text()
    assert "Validity gates" in text and "**failed**" in text and "no conclusion is drawn" in text
    assert "valid-again MLM loss (nats)" in text


def test_interrupted_study_resumes_without_retraining(tmp_path, monkeypatch):
    study = study_file.load_study(write_study(tmp_path))
    first = runner.run_study(study, show_progress=False, log=lambda line: None)
    results = tmp_path / "out" / "results.jsonl"
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [row["arm"] for row in first] == [row["arm"] for row in rows] == ["dynamic", "adm-entropy"]
    row = rows[1]
    assert row["steps"] == 4 and row["tokens_seen"] > 0 and row["scorer_seconds"] > 0
    assert row["wall_seconds"] > row["train_seconds"] > row["scorer_seconds"]  # wall: set-up and evaluations too
    assert "perplexity_freq_0_1000" in row["eval"] and row["glue"] == {"skipped": "no GLUE tasks in the study"}
    assert (results.parent / row["run_dir"] / "metrics.jsonl").is_file()

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(runner, "train_run", no_training)
    assert runner.run_study(study, show_progress=False, log=lambda line: None) == []
    assert len(results.read_text().splitlines()) == 2

    # and the report draws its curves from the runs' metrics files
    path = report.write_report(results, tmp_path / "report")
    assert {"loss_curves.png", "mask_share.png", "mask_a.png"} <= {p.name for p in path.parent.glob("*.png")}
    assert "## Where the training targets went" in path.read_text()


def test_a_rows_wall_time_counts_the_prior_free_loss_refitted_after_training(tmp_path, monkeypatch):
    """The refit runs after the trainer's clock stops; before, a row's wall time left it out (on quick-compare's
    30k vocabulary about 110 s a run, more than its training)."""
    refit = runner.recalibrated_loss

    def slow_refit(*args, **kwargs):
        time.sleep(1.0)
        return refit(*args, **kwargs)

    monkeypatch.setattr(runner, "recalibrated_loss", slow_refit)
    study = study_file.load_study(write_study(tmp_path, arms=[DYNAMIC]))
    (row,) = runner.run_study(study, show_progress=False, log=lambda line: None)
    summary = json.loads((tmp_path / "out" / row["run_dir"] / "summary.json").read_text())
    assert row["wall_seconds"] >= summary["wall_seconds"] + 1.0


def synthetic_row(arm, seed, perplexity, rare, strategy="dynamic", glue=None):
    return {
        "key": f"{arm}/seed{seed}/x",
        "study": "synthetic",
        "study_source": "synthetic.yaml",
        "out_dir": "studies/s",
        "arm": arm,
        "arm_index": 0,
        "seed": seed,
        "baseline": "dynamic",
        "budget": "token-matched",
        "steps": 100,
        "global_batch": 32,
        "flops": 1e12,
        "scorer_share": 0.0,
        "tokens_seen": 100000,
        "train_seconds": 10.0,
        "scorer_seconds": 0.0,
        "wall_seconds": 12.0,
        "eval": {
            "mlm_loss": math.log(perplexity),
            "perplexity": perplexity,
            "perplexity_freq_0_1000": perplexity / 2,
            "perplexity_freq_10000_rest": rare,
            "nsp_accuracy": 0.6,
        },
        "glue": glue or {"skipped": "no GLUE tasks in the study"},
        "run_dir": f"runs/{arm}/seed{seed}",
        "config": {
            "masking": {
                "strategy": strategy,
                "scorer": "entropy",
                "a_max": 1.0,
                "adapt_schedule": "quadratic",
                "score_every": 1,
                "score_fraction": 1.0,
                "rate_schedule": "constant",
                "rate": 0.15,
                "rate_start": 0.3,
            }
        },
        "mlmlab_version": "0.1.0",
    }


def test_report_from_results_alone_has_tables_ci_and_honest_sentences(tmp_path, capsys):
    rows = []
    for seed, noise in zip(range(4), (1.0, -1.5, 0.5, -0.2)):
        glue = {"average": 0.6 + noise / 100, "tasks": {"RTE": {"score": 0.55, "dev": {"accuracy": 0.55}}}}
        rows.append(synthetic_row("dynamic", seed, 100 + noise, 900, glue=glue))
        rows.append(synthetic_row("adm-noisy", seed, 100 - noise, 900 + 10 * noise, "adaptive", glue=glue))
        rows.append(synthetic_row("adm-better", seed, 90 + noise / 10, 800, "adaptive", glue=glue))
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"truncated')
    assert main(["report", str(results), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert f"mlmlab study synthetic.yaml --out {tmp_path}" in text.splitlines()[4]  # where the rows are
    assert f"mlmlab report {results}" in text
    assert "| dynamic (baseline) |" in text and "95% t-interval" in text and "GLUE RTE" in text
    assert "adm-noisy vs dynamic, MLM loss (nats): no significant difference" in text
    assert "adm-better vs dynamic, MLM loss (nats): lower, i.e. better (Δ = -0.105" in text  # mean log(90/100)
    assert "4 seeds the t-interval rests on the differences being roughly normal" in text
    assert "curve plots skipped" in text and "not a complete result row" in text
    assert (tmp_path / "report" / "perplexity_buckets.png").is_file()


def test_the_masking_label_names_the_rate_and_any_architecture_but_bert():
    """Arms that differ only in their rate (bert-15, bert-30) or architecture must not share a label."""
    from mlmlab.experiments.reporting.report import masking_label

    row = synthetic_row("dynamic", 0, 100, 900)
    assert masking_label(row) == "dynamic, rate 0.15"
    row["config"]["masking"].update(rate=0.3)
    row["config"]["model"] = {"architecture": "modernbert"}
    assert masking_label(row) == "modernbert: dynamic, rate 0.3"
    row["config"]["masking"].update(rate_schedule="linear_decay", rate=0.15, rate_start=0.3)
    row["config"]["model"] = {"architecture": "bert"}
    assert masking_label(row) == "dynamic, rate 0.3→0.15"


def test_target_shares_are_plotted_only_where_an_arm_masks_adaptively(tmp_path):
    """Uniform masking's shares are the corpus's: a study without ADM gets no empty mask_share.png."""
    records = [
        {"step": 10, "loss": 7.0, "tokens_seen": 1000, "mask_share_freq_0_1000": 0.6, "mask_a": 0.5},
        {"step": 100, "loss": 6.0, "tokens_seen": 10000, "mask_share_freq_0_1000": 0.5, "mask_a": 1.0},
    ]
    for strategies, expected in (
        (["dynamic", "dynamic"], set()),
        (["dynamic", "adaptive"], {"mask_share.png", "mask_a.png"}),
    ):
        out = tmp_path / "-".join(strategies)
        rows = [synthetic_row(f"arm{i}", 0, 100, 900, strategy) for i, strategy in enumerate(strategies)]
        for row in rows:
            (out / row["run_dir"]).mkdir(parents=True)
            (out / row["run_dir"] / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (out / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        assert main(["report", str(out / "results.jsonl"), "--out", str(out)]) == 0
        assert {p.name for p in out.glob("mask_*.png")} == expected, strategies


def test_a_rerun_report_removes_its_own_plots_that_no_longer_apply_and_nothing_else(tmp_path):
    """A study folder regenerated after an ADM arm's rows left keeps no mask plot the report no longer shows."""
    rows = [synthetic_row(f"arm{i}", 0, 100, 900, strategy) for i, strategy in enumerate(["dynamic", "adaptive"])]
    for row in rows:
        (tmp_path / row["run_dir"]).mkdir(parents=True)
        (tmp_path / row["run_dir"] / "metrics.jsonl").write_text(
            json.dumps({"step": 10, "loss": 7.0, "tokens_seen": 1000, "mask_share_freq_0_1000": 0.6, "mask_a": 0.5})
            + "\n"
        )
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["report", str(results), "--out", str(tmp_path)]) == 0
    (tmp_path / "figure_of_mine.png").write_bytes(b"not the report's")
    results.write_text(json.dumps(rows[0]) + "\n")
    assert main(["report", str(results), "--out", str(tmp_path)]) == 0
    assert not list(tmp_path.glob("mask_*.png"))
    assert (tmp_path / "figure_of_mine.png").read_bytes() == b"not the report's"
    assert "mask_share.png" not in (tmp_path / "report.md").read_text()


def test_cost_table_names_each_arms_torch_threads_and_warns_when_they_differ():
    alike = {"dynamic": [dict(synthetic_row("dynamic", 0, 100, 900), torch_threads=2)]}
    assert "runs were made with different" not in "\n".join(report.cost_section(alike)).lower()
    mixed = {
        "dynamic": alike["dynamic"] + [dict(synthetic_row("dynamic", 1, 100, 900), torch_threads=1)],
        "adm": [synthetic_row("adm", 0, 100, 900)],
    }  # a row from before threads were recorded
    text = "\n".join(report.cost_section(mixed))
    assert "| 1, 2 |" in text and "| ? |" in text
    assert "seconds compare only between runs made alike" in text


def seed_rows(arm, perplexities, rare=None):
    """Rows of one arm, one per seed, with the given perplexities (and rare-bucket perplexities)."""
    rare = rare or [900.0] * len(perplexities)
    return [synthetic_row(arm, seed, p, r) for seed, (p, r) in enumerate(zip(perplexities, rare))]


def test_primary_interval_is_the_paired_t_interval_not_the_bootstrap_range():
    base, arm = seed_rows("dynamic", [100.0, 100.0, 100.0]), seed_rows("adm", [101.0, 104.0, 102.5])
    metric = Metric("perplexity", ("eval", "perplexity"), True)
    comparison = compare(arm, base, metric)
    expected = stats.ttest_rel([101.0, 104.0, 102.5], [100.0] * 3).confidence_interval(0.95)
    assert (comparison.low, comparison.high) == pytest.approx((expected.low, expected.high))
    # with 3 seeds the bootstrap is the min-max of the differences (1, 4), which excludes 0; the t-interval does not
    assert (comparison.boot_low, comparison.boot_high) == pytest.approx((1.0, 4.0))
    assert comparison.low < 0 < comparison.high and not comparison.significant
    assert "no significant difference (Δ = +2.5, 95% t-interval [-1.23, +6.23]" in report.verdict(
        "adm", "dynamic", metric, comparison
    )


def test_the_same_difference_in_every_seed_has_no_interval_and_is_not_significant():
    base, arm = seed_rows("dynamic", [100.0, 200.0, 300.0]), seed_rows("adm", [90.0, 190.0, 290.0])
    metric = Metric("perplexity", ("eval", "perplexity"), True)
    comparison = compare(arm, base, metric)
    assert comparison.diff == -10.0 and not comparison.spread and not comparison.significant
    assert report.format_delta(comparison) == "-10 (the same in every seed: no interval)"
    assert "no significance is claimed" in report.verdict("adm", "dynamic", metric, comparison)
    rule = {"lower_is_better": True, "min_effect": 0.01, "guard": {}}
    assert decide(rule, comparison, {})[0] == INCONCLUSIVE  # not a win from a zero-width interval


def test_a_wins_reason_names_guards_only_where_the_rule_has_them():
    """rate-schedule-v4's rule has no guard: its wins must not read "every guard held"."""
    comparison = compare_by_seed({0: 3.6, 1: 3.61, 2: 3.58}, {0: 3.81, 1: 3.79, 2: 3.83})
    unguarded = {"lower_is_better": True, "min_effect": 0.01, "guard": {}}
    guarded = {**unguarded, "guard": {"probe.average_gain": 0.01}}
    assert decide(unguarded, comparison, {}) == (
        WIN,
        "better: the interval excludes 0, the mean reaches the least effect",
    )
    gain = compare_by_seed({0: 0.02, 1: 0.03, 2: 0.01}, {0: 0.02, 1: 0.02, 2: 0.02})
    assert decide(guarded, comparison, {"probe.average_gain": gain})[1].endswith(", every guard held")


def test_a_final_evaluation_logged_twice_counts_once_in_the_mean_curve():
    records = [{"step": 4, "loss": 3.0}, {"step": 4, "eval": {"mlm_loss": 2.0}}, {"step": 4, "eval": {"mlm_loss": 2.0}}]
    runs = [({"steps": 4}, records), ({"steps": 4}, [{"step": 4, "eval": {"mlm_loss": 5.0}}])]
    xs, ys = mean_curve(runs, lambda r: r.get("eval", {}).get("mlm_loss"), progress_of)
    assert (xs, ys) == ([1.0], [3.5])  # (2 + 5) / 2, not (2 + 2 + 5) / 3


def test_target_shares_average_each_run_over_the_whole_run_and_its_last_tenth():
    def records(early, late):  # a share logged every 10 steps of 100; step 100 logged twice (a resumed run)
        shares = [
            {
                "step": step,
                "mask_share_freq_0_500": early if step <= 90 else late,
                "mask_share_freq_500_rest": 1 - (early if step <= 90 else late),
            }
            for step in range(10, 101, 10)
        ]
        return shares + [shares[-1], {"step": 100, "eval": {"mlm_loss": 5.0}}]

    curves = {
        "dynamic": [({"steps": 100}, records(0.6, 0.6))],
        "adm": [({"steps": 100}, records(0.6, 0.2)), ({"steps": 100}, records(0.5, 0.4))],
    }
    lines = report.target_share_section(curves)
    assert lines[0] == "## Where the training targets went"
    assert "| dynamic | 0.600 / 0.600 | 0.400 / 0.400 |" in lines
    # run 1: (9 * 0.6 + 0.2) / 10 = 0.56, late 0.2; run 2: (9 * 0.5 + 0.4) / 10 = 0.49, late 0.4
    assert "| adm | 0.525 / 0.300 | 0.475 / 0.700 |" in lines
    assert report.target_share_section({"dynamic": [({"steps": 100}, [{"step": 100, "loss": 3.0}])]}) == []
    early_only = {"dynamic": [({"steps": 100}, [{"step": 50, "mask_share_freq_0_500": 0.6}])]}
    assert "| dynamic | 0.600 / n/a |" in report.target_share_section(early_only)  # no share logged late


def test_few_seeds_label_the_bootstrap_a_range_never_a_ci(tmp_path):
    def text_for(seeds):
        rows = seed_rows("dynamic", [100.0 + s for s in range(seeds)])
        rows += seed_rows("adm", [90.0 + 2 * s * (-1) ** s for s in range(seeds)])
        results = tmp_path / f"{seeds}" / "results.jsonl"
        results.parent.mkdir()
        results.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return report.write_report(results, results.parent / "report").read_text()

    few, many = text_for(3), text_for(5)
    assert "| range (bootstrap) |" in few and "Secondary: range of the same differences" in few
    assert "95% CI" not in few and "95% bootstrap CI" not in few
    assert "| 95% bootstrap CI |" in many and "| range (bootstrap) |" not in many


def test_report_skips_a_row_without_evaluation_and_a_cut_metrics_line_with_one_warning_each(tmp_path, capsys, caplog):
    """Before: a row with eval: null and a metrics.jsonl cut mid-line each ended the report in a traceback."""
    rows = [synthetic_row(arm, seed, 100 + seed, 900) for arm in ("dynamic", "adm") for seed in range(2)]
    rows.append({**synthetic_row("adm", 2, 100, 900), "eval": None})
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for row in rows[:4]:
        metrics = results.parent / row["run_dir"] / "metrics.jsonl"
        metrics.parent.mkdir(parents=True)
        metrics.write_text('{"step": 1, "loss": 9.0}\n' + ('{"step": 2, "lo' if row is rows[0] else ""))
    assert main(["report", str(results), "--out", str(tmp_path / "report")]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "mlmlab: warning: line 5 of results.jsonl is not a complete result row and was ignored",
        f"mlmlab: warning: line 2 of {results.parent / rows[0]['run_dir'] / 'metrics.jsonl'} is not a "
        "metrics record (cut short or damaged) and was ignored",
    ]
    assert "4 runs, 2 arms" in (tmp_path / "report" / "report.md").read_text()


def test_an_arm_identical_to_the_baseline_is_reported_as_such_not_as_a_null(tmp_path):
    rows = seed_rows("dynamic", [100.0, 102.0, 101.0]) + seed_rows("static", [100.0, 102.0, 101.0])
    rows += seed_rows("adm", [95.0, 97.0, 96.0])  # same nsp_accuracy as the baseline, other metrics differ
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = report.write_report(results, tmp_path / "report").read_text()
    assert "- static vs dynamic: identical by construction." in text
    assert "| static | identical by construction |" in text
    assert "static vs dynamic, perplexity" not in text and "+0 [+0, +0]" not in text
    assert "adm vs dynamic, MLM loss (nats): lower" in text
    assert "+0 (equal in every seed)" in text  # adm's NSP: equal, but the arm is no copy of the baseline


def test_bucket_differences_are_in_nats_and_skip_empty_buckets():
    base = seed_rows("dynamic", [100.0] * 3, rare=[4e5, 3e5, 2e5])
    arm = seed_rows("adm", [100.0] * 3, rare=[2e5, 1e5, None])  # seed 2: no rare targets, stored as null
    nats = {m.label: m for m in metrics_of(base + arm)}["loss freq 10000_rest (nats)"]
    comparison = compare(arm, base, nats)
    assert comparison.n == 2  # the null seed is left out of the pairs
    assert comparison.diff == pytest.approx((math.log(2e5 / 4e5) + math.log(1e5 / 3e5)) / 2)
    assert report.format_delta(comparison).startswith("-0.896 [")


def test_the_recorded_decision_rule_is_applied_to_every_arm_as_written(tmp_path):
    """Δ MLM loss ≈ log(perplexity ratio); STS-B a guard; the rarest bucket decides what a prior shift is."""
    rule = {
        "metric": "eval.mlm_loss",
        "lower_is_better": True,
        "min_effect": 0.01,
        "guard": {"glue.tasks.STS-B.dev.pearson": 0.01},
    }

    def arm_rows(arm, factor, sts=0.40, rare=900.0, seeds=3):
        noise = (1.0, -1.0, 0.5) if arm == "dynamic" else (0.5, -0.5, 0.0)  # paired differences that vary
        return [
            dict(
                synthetic_row(
                    arm,
                    seed,
                    100 * factor * (1 + noise[seed] / 1000),
                    rare * (1 + noise[seed] / 100),
                    glue={"average": sts, "tasks": {"STS-B": {"score": sts, "dev": {"pearson": sts}}}},
                ),
                decision=rule,
            )
            for seed in range(seeds)
        ]

    rows = arm_rows("dynamic", 1.0)
    rows += arm_rows("better", 0.95) + arm_rows("worse", 1.05) + arm_rows("slightly", 0.995)
    rows += arm_rows("guarded", 0.95, sts=0.38) + arm_rows("shift", 1.0, rare=600.0)
    rows += arm_rows("partial", 0.95, seeds=2)
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = report.write_report(results, tmp_path / "report").read_text()
    assert "lies below 0, |mean Δ| ≥ 0.01, and mean Δ glue.tasks.STS-B.dev.pearson ≥ −0.01" in text
    calls = {
        line.split("|")[1].strip(): line.split("|")[-4].strip()
        for line in text.splitlines()
        if line.startswith("| ") and "**" in line
    }
    assert calls == {
        "better": "**win**",
        "worse": "**lose**",
        "slightly": "**inconclusive**",
        "guarded": "**inconclusive**",
        "shift": "**inconclusive, prior shift**",
        "partial": "**win (provisional: 2 of 3 seeds)**",
    }
    holm_calls = {
        line.split("|")[1].strip(): line.split("|")[-3].strip()
        for line in text.splitlines()
        if line.startswith("| ") and "**" in line
    }
    assert holm_calls["partial"].endswith("(provisional: 2 of 3 seeds)**")  # read from 2 seeds, as the other
    assert holm_calls["shift"] == "**inconclusive, prior shift**"
    assert "better, by less than the least effect (0.01)" in text
    assert "a guard failed: glue.tasks.STS-B.dev.pearson fell by 0.02 > 0.01" in text


def test_a_call_over_fewer_seeds_than_the_study_has_is_provisional_even_where_the_baseline_lacks_one(tmp_path):
    """The baseline's seed 2 is missing: 2 pairs are not the study's 3 seeds, though they are all its rows."""
    rule = {"metric": "eval.mlm_loss", "lower_is_better": True, "min_effect": 0.01, "guard": {}}
    rows = [dict(synthetic_row("dynamic", seed, 100.0 + seed, 900.0), decision=rule) for seed in (0, 1)]
    rows += [dict(synthetic_row("better", seed, 90.0 + seed * 1.1, 900.0), decision=rule) for seed in (0, 1, 2)]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    line = next(
        line
        for line in report.write_report(results, tmp_path / "report").read_text().splitlines()
        if line.startswith("| better")
    )
    assert line.count("(provisional: 2 of 3 seeds)") == 2  # the call and the Holm call


def test_held_out_figures_from_different_prepared_data_are_flagged_not_silently_averaged():
    def row(arm, seed, dataset=None):
        held_out = {"mlm_loss": 6.0, "mlm_accuracy": 0.15, **({"dataset": dataset} if dataset else {})}
        return {
            **synthetic_row(arm, seed, 400.0, 900.0),
            "eval_data": {"wikitext": held_out, "gone": {"skipped": "x not found"}},
        }

    old = [row("dynamic", 0), row("dynamic", 1)]
    assert report.held_out_data_notes(old) == []  # made before datasets were recorded: nothing to compare
    same = [row("dynamic", 0, "aaaa"), row("adm", 0, "aaaa")]
    assert report.held_out_data_notes(same) == []
    notes = report.held_out_data_notes([*old, row("adm", 0, "aaaa")])
    assert len(notes) == 2 and "wikitext was evaluated on different prepared data" in notes[0]
    assert "not recorded (2 rows), aaaa (1 row)" in notes[0] and "gone" not in notes[0]


def test_a_decision_rule_with_a_bad_field_is_refused_in_one_line(tmp_path):
    for decision, message in [
        ({"metric": "eval.mlm_loss", "min_effect": -0.01}, "must be numbers >= 0"),
        ({"metric": "eval.mlm_loss", "margin": 0.01}, "unknown decision key 'margin'"),
        ({"min_effect": 0.01}, "must be a mapping with a metric"),
    ]:
        with pytest.raises(UserError, match=message):
            study_file.load_study(write_study(tmp_path, decision=decision))
    study = study_file.load_study(write_study(tmp_path, decision={"metric": "eval.mlm_loss", "min_effect": 0.01}))
    assert study.decision == study_file.Decision("eval.mlm_loss", True, 0.01, {})


def test_downstream_section_ranks_runs_by_loss_against_their_glue_scores():
    def row(arm, seed, perplexity, score):
        glue = {"average": score, "tasks": {"STS-B": {"score": score, "dev": {"pearson": score}}}}
        return synthetic_row(arm, seed, perplexity, 900, glue=glue)

    ordered = [row("dynamic", 0, 100, 0.4), row("dynamic", 1, 120, 0.3), row("adm", 0, 90, 0.7), row("adm", 1, 95, 0.5)]
    text = "\n".join(report.downstream_section(ordered, metrics_of(ordered)))
    assert "| GLUE STS-B | 4 | -1.00 |" in text  # lower loss, higher score, in every pair of runs
    assert "GLUE avg" not in text  # one task: its average is the same column
    few = ordered[:3]
    assert "| GLUE STS-B | 3 | too few runs |  |" in "\n".join(report.downstream_section(few, metrics_of(few)))
    without_glue = seed_rows("dynamic", [100.0, 101.0, 102.0, 103.0])
    assert report.downstream_section(without_glue, metrics_of(without_glue)) == []


def test_holm_adjusts_the_arms_p_values_together_step_down():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.2, math.nan, 0.01]) == pytest.approx([0.2, math.nan, 0.02], nan_ok=True)
    assert holm([0.9, 0.8]) == pytest.approx([1.0, 1.0])  # 2 x 0.8 capped at 1; monotone
    base, arm = seed_rows("dynamic", [100.0, 100.0, 100.0]), seed_rows("adm", [101.0, 104.0, 102.5])
    comparison = compare(arm, base, Metric("perplexity", ("eval", "perplexity"), True))
    assert comparison.p == pytest.approx(stats.ttest_rel([101.0, 104.0, 102.5], [100.0] * 3).pvalue)


def decided_rows(arm, losses, recalibrated=None, rare=None, rule=None):
    """One row per seed with these held-out losses (and prior-free losses, rare-bucket perplexities)."""
    rows = []
    for seed, loss in enumerate(losses):
        row = synthetic_row(arm, seed, math.exp(loss), (rare or [900.0] * len(losses))[seed])
        if recalibrated is not None:
            row["eval"]["recalibrated"] = {"mlm_loss": recalibrated[seed], "raw_mlm_loss": loss}
        rows.append(
            {
                **row,
                "decision": rule
                or {"metric": "eval.mlm_loss", "lower_is_better": True, "min_effect": 0.01, "guard": {}},
            }
        )
    return rows


def decision_calls(tmp_path, rows) -> dict:
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = report.write_report(results, tmp_path / "report").read_text()
    return {
        line.split("|")[1].strip(): (line.split("|")[-4].strip(), line.split("|")[-3].strip())
        for line in text.splitlines()
        if line.startswith("| ") and "**" in line
    }


def test_a_win_that_holm_does_not_keep_is_inconclusive_in_the_holm_column(tmp_path):
    base = [6.00, 6.10, 5.90, 6.05]
    rows = decided_rows("dynamic", base)
    rows += decided_rows("strong", [b - 0.30 + d for b, d in zip(base, (0.001, -0.001, 0.002, 0.0))])
    rows += decided_rows("weak", [b - 0.05 + d for b, d in zip(base, (0.025, -0.025, 0.02, -0.015))])
    for name in ("null-a", "null-b"):
        rows += decided_rows(name, [b + d for b, d in zip(base, (0.03, -0.02, -0.01, 0.01))])
    calls = decision_calls(tmp_path, rows)
    assert calls["strong"] == ("**win**", "**win**")
    weak = compare(rows[8:12], rows[:4], Metric("l", ("eval", "mlm_loss"), True))
    assert weak.significant and 0.05 / 3 < weak.p < 0.05  # a win alone; second smallest of four p-values: x3
    assert calls["weak"] == ("**win**", "**inconclusive**")


def test_holm_calls_wait_for_the_arms_and_seeds_the_study_file_plans(tmp_path):
    """Holm over the arms tested so far is weaker than over the study's family: a win stays provisional until the
    other arms are in, unless even the whole family's factor keeps it (family x p < 0.05). Seeds too come from
    the study file, not only the rows."""
    source = write_study(
        tmp_path,
        arms=[DYNAMIC, {"name": "strong"}, {"name": "weak"}, {"name": "later"}],
        seeds=[0, 1, 2, 3],
        baseline="dynamic",
    )
    base = [6.00, 6.10, 5.90, 6.05]
    rows = decided_rows("dynamic", base)
    rows += decided_rows("strong", [b - 0.30 + d for b, d in zip(base, (0.001, -0.001, 0.002, 0.0))])
    rows += decided_rows("weak", [b - 0.05 + d for b, d in zip(base, (0.025, -0.025, 0.02, -0.015))])
    rows += decided_rows("later", base[:3])  # seeds 0-2 of 4
    weak = compare(rows[8:12], rows[:4], Metric("l", ("eval", "mlm_loss"), True))
    assert 0.05 / 3 < weak.p < 0.05  # the larger of two p-values (x1): a Holm win among the two arms tested so far
    for row in rows:
        row["study_source"] = source
    calls = decision_calls(tmp_path, [row for row in rows if row["arm"] != "later"])
    assert calls["strong"] == ("**win**", "**win**")  # 3 x p < 0.05: final whatever "later" shows
    assert calls["weak"] == ("**win**", "**win (provisional: Holm over 2 of 3 arms)**")
    calls = decision_calls(tmp_path, rows)
    assert calls["later"][0].endswith("(provisional: 3 of 4 seeds)**")


def test_a_rare_token_gain_is_a_prior_shift_unless_the_prior_free_loss_wins(tmp_path):
    base, rare_base, rare_gain = [6.0, 6.1, 5.9], [900.0, 950.0, 880.0], [600.0, 640.0, 590.0]
    rows = decided_rows("dynamic", base, recalibrated=[5.8, 5.9, 5.7], rare=rare_base)
    # worse raw loss, better rare bucket; the refitted bias leaves it no better: only its prior moved
    rows += decided_rows("shift", [6.2, 6.3, 6.1], recalibrated=[5.81, 5.89, 5.72], rare=rare_gain)
    # the same raw figures, but with the prior refitted it is better: more than a prior shift
    rows += decided_rows("learns", [6.2, 6.3, 6.1], recalibrated=[5.6, 5.72, 5.49], rare=rare_gain)
    calls = decision_calls(tmp_path, rows)
    assert calls["shift"][0] == "**lose, prior shift**"
    assert calls["learns"][0] == "**lose**"
    recalibrated = {
        line.split("|")[1].strip(): line.split("|")[-5].strip()
        for line in (tmp_path / "report" / "report.md").read_text().splitlines()
        if "**" in line
    }
    assert recalibrated["learns"].endswith(": win") and recalibrated["shift"].endswith(": inconclusive")


def test_steps_to_target_is_the_first_evaluation_below_it_in_steps_and_flops():
    records = [
        {"step": 50, "loss": 7.0},
        {"step": 100, "eval": {"mlm_loss": 6.2}},
        {"step": 200, "eval": {"mlm_loss": 5.9}},
        {"step": 300, "eval": {"mlm_loss": 5.5}},
    ]
    assert steps_to_target({}, records, "mlm_loss", 6.0) == 200
    assert steps_to_target({}, records, "mlm_loss", 5.0) is None
    rule = {"metric": "eval.mlm_loss", "lower_is_better": True, "min_effect": 0.01, "guard": {}, "target": 6.0}
    rows = [{"seed": 0, "decision": rule}]
    late = [{"step": 100, "eval": {"mlm_loss": 6.5}}, {"step": 400, "eval": {"mlm_loss": 5.8}}]
    curves = {
        "dynamic": [({"seed": 0, "flops_per_step": 1e9}, late), ({"seed": 1, "flops_per_step": 1e9}, late[:1])],
        "adm": [({"seed": 0, "flops_per_step": 2e9}, records), ({"seed": 1, "flops_per_step": 2e9}, records)],
        "same": [({"seed": 0, "flops_per_step": 1e9}, late), ({"seed": 1, "flops_per_step": 1e9}, late[:1])],
    }
    text = "\n".join(report.steps_to_target_section(rows, curves, "dynamic"))
    assert "| dynamic | 400 / never | 400 (n=1) | 4e+11 | 1 of 2 |  |  |" in text
    # seed 1: adm reached the target where dynamic never did, which counts as earlier but not in the paired Δ
    assert "| adm | 200 / 200 | 200 ± 0 (n=2) | 4e+11 | 0 of 2 | -200 (1 seed) | 2 of 2 |" in text
    assert "| same | 400 / never | 400 (n=1) | 4e+11 | 1 of 2 | +0 (1 seed) | 0 of 2 |" in text
    assert report.steps_to_target_section([{"seed": 0, "decision": {**rule, "target": None}}], curves, "dynamic") == []


def test_an_arm_that_spends_more_flops_is_read_where_it_had_spent_the_baselines():
    def run(seed, flops_per_step, losses):  # an evaluation every 100 steps, the last one the row's final figure
        records = [{"step": 100 * (i + 1), "eval": {"mlm_loss": loss}} for i, loss in enumerate(losses)]
        row = {
            "seed": seed,
            "flops_per_step": flops_per_step,
            "flops": flops_per_step * 100 * len(losses),
            "eval": {"mlm_loss": losses[-1]},
        }
        return row, records

    curves = {
        "dynamic": [run(0, 1e9, [7.0, 6.0, 5.0, 4.0]), run(1, 1e9, [7.0, 6.0, 5.0, 4.2])],
        # twice the FLOPs a step: at the baseline's 4e11 it had made 200 of its 400 steps
        "adm": [run(0, 2e9, [6.5, 5.5, 4.5, 3.5]), run(1, 2e9, [6.5, 5.3, 4.5, 3.5])],
        "same": [run(0, 1.005e9, [7.0, 6.0, 5.0, 3.0]), run(1, 1.005e9, [7.0, 6.0, 5.0, 3.0])],
    }
    text = "\n".join(report.equal_flops_section([], curves, "dynamic"))
    assert "| adm | 200 / 200 | 5.500 / 5.300 | +1.3 [-1.24, +3.84] |" in text  # Δ 1.5 and 1.1: mean 1.3
    assert "| same |" not in text  # within 1% of the baseline's FLOPs: its final figure is its matched one
    assert report.equal_flops_section([], {"dynamic": curves["dynamic"], "same": curves["same"]}, "dynamic") == []


def test_flops_to_a_step_count_each_steps_own_mask_rate():
    """A 30% -> 15% decay spends more per step early on than its mean rate says; a constant rate does not."""
    from mlmlab.config import load_config
    from mlmlab.experiments.budget import flops_until, step_flops
    from mlmlab.masking.schedules import rate_at

    constant = load_config("tiny", ["train.max_steps=1000", "masking.rate=0.225"])
    decay = load_config(
        "tiny",
        ["train.max_steps=1000", "masking.rate_schedule=linear_decay", "masking.rate_start=0.3", "masking.rate=0.15"],
    )
    assert flops_until(constant, 400) == pytest.approx(400 * step_flops(constant)["total"])
    assert step_flops(decay)["total"] == pytest.approx(step_flops(constant)["total"])  # the same mean rate
    assert flops_until(decay, 400) > 1.05 * flops_until(constant, 400)
    assert flops_until(decay, 1000) == pytest.approx(flops_until(constant, 1000), rel=1e-3)
    each_step = sum(step_flops(decay, rate_at(decay.masking, step / 1000))["total"] for step in range(400))
    assert flops_until(decay, 400) == pytest.approx(each_step, rel=1e-12)  # the curve's linear form is exact
    row = {"config": to_dict(decay), "flops_per_step": step_flops(decay)["total"]}
    assert report.flops_at(row, 400) == flops_until(decay, 400)
    assert report.flops_at({"flops_per_step": 2.0}, 400) == 800.0  # a row made before configs were recorded


def test_a_decision_target_must_be_a_number_on_an_eval_figure(tmp_path):
    decision = {"metric": "eval.mlm_loss", "min_effect": 0.01, "target": 5.5}
    assert study_file.load_study(write_study(tmp_path, decision=decision)).decision.target == 5.5
    for bad in ({**decision, "target": "low"}, {**decision, "metric": "glue.average"}):
        with pytest.raises(UserError, match="target must be a finite number"):
            study_file.load_study(write_study(tmp_path, decision=bad))


def test_the_reports_rerun_command_points_at_where_the_rows_are_now(tmp_path):
    """A study folder that moved (docs/<name> -> studies/<name>) is grown where it is, not where it was trained."""
    results = tmp_path / "studies" / "moved" / "results.jsonl"
    results.parent.mkdir(parents=True)
    runner.append_row(results, result_row("a", study_source="moved", out_dir="docs/moved"))
    lines = report.commands(report.load_rows(results)[0], results, tmp_path / "report")
    assert lines[0] == f"    mlmlab study moved --out {results.parent}"


SHIPPED_STUDIES = sorted(path.parent.name for path in (ROOT / "studies").glob("*/report.md"))


@pytest.mark.parametrize("name", SHIPPED_STUDIES)
def test_a_shipped_report_is_what_the_report_writes_from_its_rows(name, tmp_path, monkeypatch):
    """A report.md under studies/ is the current report code's output from the committed rows and metrics: a change
    to the report (or to the rows) that was not regenerated shows here, and every plot it links is shipped."""
    monkeypatch.chdir(ROOT)  # the report quotes its paths as given: relative, as the shipped ones were written
    shipped = Path("studies") / name
    written = report.write_report(shipped / "results.jsonl", tmp_path).read_text()
    expected = (shipped / "report.md").read_text()
    assert written.replace(f"--out {tmp_path}", f"--out {shipped}") == expected, (
        f"regenerate it: mlmlab report {shipped / 'results.jsonl'} --out {shipped}"
    )
    plots = sorted(path.name for path in tmp_path.glob("*.png"))
    assert plots and all(f"]({plot})" in written and (shipped / plot).is_file() for plot in plots)


def test_every_row_records_the_preregistration_and_the_runner_refuses_a_row_after_it_changed(tmp_path, monkeypatch):
    """A rule written before the runs stays that only while it cannot move under them: once the study's first
    row recorded the file's sha256, a file changed while a run trained keeps that run's row out, and a changed
    (or removed) file stops the runner before it trains, in one line."""
    study = study_file.load_study(write_study(tmp_path, seeds=[0, 1], arms=[DYNAMIC]))
    results, prereg = tmp_path / "out" / "results.jsonl", tmp_path / "out" / "preregistration.md"
    prereg.parent.mkdir()
    prereg.write_text("# Question\n\nDecision rule: ...\n")
    first = runner.run_study(study, show_progress=False, log=lambda line: None, only=(("dynamic", 0),))
    assert first[0]["preregistration_sha256"] == hashlib.sha256(prereg.read_bytes()).hexdigest()

    train_run = runner.train_run

    def editing_meanwhile(*args, **kwargs):
        prereg.write_text("# Question\n\nDecision rule, moved: ...\n")
        return train_run(*args, **kwargs)

    monkeypatch.setattr(runner, "train_run", editing_meanwhile)
    with pytest.raises(
        UserError, match="preregistration.md hashes to .*not .* as the study's first row recorded"
    ) as err:
        runner.run_study(study, show_progress=False, log=lambda line: None)
    assert "\n" not in str(err.value) and len(results.read_text().splitlines()) == 1

    def no_training(*args, **kwargs):
        raise AssertionError("a run trained under a moved pre-registration")

    monkeypatch.setattr(runner, "train_run", no_training)
    with pytest.raises(UserError, match="hashes to .*not .* as the study's first row recorded"):
        runner.run_study(study, show_progress=False, log=lambda line: None)
    prereg.unlink()
    with pytest.raises(UserError, match="preregistration.md is gone"):
        runner.run_study(study, show_progress=False, log=lambda line: None)
    assert len(results.read_text().splitlines()) == 1  # nothing appended


# ----- one study's rows: its file and its pre-registration as its first row recorded them ------------------------
def refusing_to_train(*args, **kwargs):
    raise AssertionError("a run trained though its row would be refused")


def test_a_preregistration_written_after_the_first_rows_is_refused_before_training(tmp_path, monkeypatch):
    """Before, the next run recorded its hash as if it had come before every row, and the report said nothing."""
    study = study_file.load_study(str(study_with_its_first_row(tmp_path, identity=False)))
    results, prereg = tmp_path / "out" / "results.jsonl", tmp_path / "out" / "preregistration.md"
    prereg.write_text("# Question\n\nDecision rule, written after a run: ...\n")
    monkeypatch.setattr(runner, "train_run", refusing_to_train)
    with pytest.raises(UserError, match="preregistration.md appeared after the study's first rows.*README.md"):
        runner.run_study(study, show_progress=False, log=lambda line: None)
    assert len(results.read_text().splitlines()) == 1
    sha = hashlib.sha256(prereg.read_bytes()).hexdigest()
    assert runner.study_record(study, [])["preregistration_sha256"] == sha  # before the first row: the rule


def test_a_study_file_changed_between_runs_stops_the_runner_before_it_trains(tmp_path, monkeypatch):
    """Before, an edited decision: block was accepted, and the report applied the first row's rule to every row."""
    first = study_file.load_study(str(study_with_its_first_row(tmp_path)))
    edited = study_file.load_study(str(write_study_file(tmp_path, decision={"metric": "eval.mlm_accuracy"})))
    assert [run.key for run in runner.plan_runs(edited)] == [run.key for run in runner.plan_runs(first)]  # not keys
    monkeypatch.setattr(runner, "train_run", refusing_to_train)
    with pytest.raises(UserError, match="the study file's decision rule or baseline changed since the first row"):
        runner.run_study(edited, show_progress=False, log=lambda line: None)
    assert len((tmp_path / "out" / "results.jsonl").read_text().splitlines()) == 1


RULE = {"metric": "eval.mlm_loss", "min_effect": 0.01}


@pytest.mark.parametrize(
    "edit, words",
    [
        ({"decision": {**RULE, "min_effect": 0.05}}, "decision rule or baseline"),
        ({"baseline": "adm-entropy"}, "decision rule or baseline"),
        ({"seeds": [0, 1, 2]}, "seeds"),
        (
            {"arms": [DYNAMIC, ENTROPY, {"name": "rate-30", "masking.rate": 0.3}]},
            "arms (their names, order, overrides or budgets)",
        ),
        ({"arms": [ENTROPY, DYNAMIC]}, "arms (their names, order, overrides or budgets)"),
        ({"budget": "compute-matched"}, "budget"),
        ({"screen": {"seeds": [0], "candidates": ["adm-entropy"], "confirm": ["dynamic"]}}, "screen: block"),
        ({"gates": {"arm": "dynamic", "min": {"eval.mlm_accuracy": 0.2}}}, "validity gates"),
        ({"seeds": [0, 1, 2], "decision": {**RULE, "min_effect": 0.05}}, "seeds and decision rule or baseline"),
    ],
)
def test_a_row_is_refused_where_the_study_file_changed_under_its_rows_naming_what_changed(tmp_path, edit, words):
    fields = {"seeds": [0, 1], "decision": RULE}
    first = study_file.load_study(write_study(tmp_path, **fields))
    rows = [{"key": "k", "study": first.name, "arm": "dynamic", "seed": 0, **runner.study_record(first, [])}]
    edited = study_file.load_study(write_study(tmp_path, **{**fields, **edit}))
    with pytest.raises(UserError, match=f"study file's {re.escape(words)} changed since") as err:
        runner.study_record(edited, rows)
    assert "--out" in str(err.value) and "\n" not in str(err.value)
    assert runner.study_record(first, rows) == runner.study_record(first, [])  # unchanged: accepted
    renamed = study_file.load_study(write_study(tmp_path, name="another", **fields))
    with pytest.raises(UserError, match="holds rows of study 'study', not of 'another'"):
        runner.study_record(renamed, rows)


def test_rows_from_before_study_identities_stand_beside_later_rows_of_the_same_study(tmp_path):
    """A study under way gains rows from an older checkout (no identity) and from this one, in any order."""
    study = study_file.load_study(write_study(tmp_path, seeds=[0, 1, 2], decision=RULE))
    prereg = tmp_path / "out" / "preregistration.md"
    prereg.parent.mkdir()
    prereg.write_text("# Question\n")
    sha = hashlib.sha256(prereg.read_bytes()).hexdigest()
    older = [
        {**result_row(f"dynamic/seed{seed}/x", seed=seed), "study": study.name, "preregistration_sha256": sha}
        for seed in (0, 2)
    ]
    record = runner.study_record(study, older[:1])
    assert record == {"study_identity": identity.study_identity(study), "preregistration_sha256": sha}
    rows = [older[0], {**result_row("dynamic/seed1/x", seed=1), "study": study.name, **record}, older[1]]
    assert runner.study_record(study, rows) == record
    assert report.mixed_studies(rows) == []
    assert (
        identity.study_identity(study)["parts"]["rule"]
        == identity.study_identity(
            dataclasses.replace(study, decision=dataclasses.replace(study.decision, contrasts=[]))
        )["parts"]["rule"]
    )  # a field left at its default is no part of it: one added later changes no identity


def mixed_rows(kind: str) -> list[dict]:
    """Two arms over four seeds under one rule, and then the rows of ``kind``: another study's (it ran the same arms),
    or rows with another pre-registration or rule."""
    study = {"study_identity": {"sha256": "a1", "parts": {}}, "preregistration_sha256": "a" * 64}
    rows = [
        {**row, **study}
        for row in decided_rows("dynamic", [6.0, 6.1, 5.9, 6.05]) + decided_rows("adm", [5.7, 5.8, 5.6, 5.75])
    ]
    other = {
        "study": {"study": "other", "study_identity": {"sha256": "b2", "parts": {}}},
        "pre-registration": {"preregistration_sha256": "b" * 64},
        "rule": {"decision": {**RULE, "metric": "eval.perplexity", "lower_is_better": True, "guard": {}}},
    }[kind]
    return rows + [{**row, **other, "key": f"{row['key']}-2", "seed": row["seed"] + 4} for row in rows[4:]]


@pytest.mark.parametrize(
    "kind, words",
    [
        ("study", "studies other, synthetic; 2 versions"),
        ("pre-registration", "pre-registrations aaaaaaaaaaaa, bbbbbbbbbbbb"),
        ("rule", "2 decision rules"),
    ],
)
def test_the_report_refuses_rows_of_more_than_one_study_unless_asked_to_describe_them(tmp_path, kind, words):
    """Before, it paired seeds across the two studies and applied the first row's rule to all of them."""
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in mixed_rows(kind)))
    refused = f"holds rows of more than one study \\({re.escape(words)}.*--mixed descriptive"
    with pytest.raises(UserError, match=refused):
        report.write_report(results, tmp_path / "report")
    assert not (tmp_path / "report").exists()
    assert main(["report", str(results), "--out", str(tmp_path / "report"), "--mixed", "descriptive"]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert "**Descriptive only (--mixed descriptive): no decision rule was applied.**" in text and words in text
    assert "Pre-registered decision" not in text and "**win**" not in text and "Holm" not in text


def test_rows_from_before_study_identities_report_as_they_did_though_they_name_two_studies():
    """A shipped study took its baseline's rows from another (dropout-wp8k): compared by name only beside rows
    that record their study's identity."""
    rows = decided_rows("dynamic", [6.0, 6.1]) + [{**row, "study": "other"} for row in decided_rows("adm", [5.7, 5.8])]
    assert report.mixed_studies(rows) == []
    rows[0]["study_identity"] = {"sha256": "a1", "parts": {}}
    assert report.mixed_studies(rows) == ["studies other, synthetic"]


def test_named_contrasts_are_the_rules_calls_holm_over_them_with_their_detectable_effect(tmp_path):
    """A rule with contrasts calls each arm − reference pair (a reference other than the baseline included), Holm
    over the pairs alone, and prints each pair's paired sd and the least effect its seeds could detect."""
    rule = {
        "metric": "eval.mlm_loss",
        "lower_is_better": True,
        "min_effect": 0.01,
        "guard": {},
        "contrasts": [["decay", "constant"], ["rate", "dynamic"]],
    }
    base = [4.00, 4.05, 3.98, 4.02, 4.01, 3.99]
    jitter = (0.004, -0.003, 0.002, -0.004, 0.001, 0.0)
    rows = decided_rows("dynamic", base, rule=rule)
    rows += decided_rows("constant", [b - 0.10 for b in base], rule=rule)
    rows += decided_rows("decay", [b - 0.10 + d for b, d in zip(base, jitter)], rule=rule)  # = constant: no call
    rows += decided_rows("rate", [b - 0.20 + d for b, d in zip(base, jitter)], rule=rule)  # far better than dynamic
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = report.write_report(results, tmp_path / "report").read_text()
    lines = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[1:-1]]
        for line in text.split("## Every arm against the baseline")[0].splitlines()
        if " − " in line[:30]
    }
    decay, rate = lines["decay − constant"], lines["rate − dynamic"]
    sd = float(np.std(jitter, ddof=1))
    assert float(decay[3]) == pytest.approx(sd, rel=1e-2) and decay[-2] == "**inconclusive**"
    assert rate[-2] == "**rate better**" and rate[-3] == "rate better"
    assert float(rate[4]) == pytest.approx(detectable_effect(sd, 6), rel=1e-2)
    assert float(rate[5]) == pytest.approx(detectable_effect(sd, 6, 0.025), rel=1e-2)  # Holm's first step: 0.05 / 2
    assert "## Every arm against the baseline (descriptive" in text  # the rest stays in the report, as description


def test_a_contrast_holm_keeps_only_while_its_partner_is_untested_says_so(tmp_path):
    """Holm over the named contrasts tested so far is weaker than over the rule's: a call its partner's p-value
    could still undo is provisional until that contrast is in; one that survives the whole family's factor is not."""
    rule = {
        "metric": "eval.mlm_loss",
        "lower_is_better": True,
        "min_effect": 0.01,
        "guard": {},
        "contrasts": [["weak", "dynamic"], ["later", "dynamic"]],
    }
    base = [4.00, 4.05, 3.98, 4.02, 4.01, 3.99]
    rows = decided_rows("dynamic", base, rule=rule)
    rows += decided_rows(
        "weak", [b - 0.02 + d for b, d in zip(base, (0.02, -0.02, 0.015, -0.015, 0.01, -0.01))], rule=rule
    )
    weak = compare(rows[6:12], rows[:6], Metric("l", ("eval", "mlm_loss"), True))
    assert 0.025 < weak.p < 0.05  # a Holm win alone, not beside a second contrast (x2)
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = report.write_report(results, tmp_path / "report").read_text()
    assert "| **weak better (provisional: Holm over 1 of 2 contrasts)** |" in text
    rows += decided_rows("later", [b + 0.5 for b in base[:1]], rule=rule)  # one seed: still untested
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert "Holm over 1 of 2 contrasts" in report.write_report(results, tmp_path / "report").read_text()
    strong = [row for row in rows if row["arm"] != "later"]
    for row in strong[6:]:
        row["eval"]["mlm_loss"] -= 0.2  # 2 x p < 0.05: final whatever the other contrast shows
    results.write_text("".join(json.dumps(row) + "\n" for row in strong))
    text = report.write_report(results, tmp_path / "report").read_text()
    assert "| **weak better** |" in text


def test_the_detectable_effect_is_found_with_the_stated_power():
    """At the effect it names, a paired t-test over n seeds rejects at alpha in 80% of simulated studies."""
    rng = np.random.default_rng(0)
    for n, alpha in ((6, 0.05), (6, 0.0125), (4, 0.05)):
        effect = detectable_effect(0.034, n, alpha)
        diffs = rng.normal(effect, 0.034, size=(40_000, n))
        rejected = stats.ttest_1samp(diffs, 0.0, axis=1).pvalue < alpha
        assert rejected.mean() == pytest.approx(0.8, abs=0.01), (n, alpha)
    assert math.isnan(detectable_effect(0.0, 6)) and math.isnan(detectable_effect(0.1, 1))


@pytest.mark.parametrize(
    "names, words",
    [
        (
            {"eval_data": {"wikitext": "wiki.valid.tokns"}},
            ["eval_data 'wikitext'", "wiki.valid.tokns", "does not exist"],
        ),
        ({"glue": {"tasks": ["RTE"]}}, ["RTE/dev.tsv is missing", "GLUE"]),
        ({"probe": {"tasks": ["RTE"]}}, ["RTE/dev.tsv is missing", "probe"]),
    ],
)
def test_every_input_a_study_names_is_checked_before_its_first_run(tmp_path, monkeypatch, names, words):
    """A missing held-out set or task file would leave rows without that measurement, counted as finished."""
    glue_dir = tmp_path / "glue"
    (glue_dir / "RTE").mkdir(parents=True)
    (glue_dir / "RTE" / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n")
    study = study_file.load_study(write_study(tmp_path, glue_dir=str(glue_dir), **names))

    def no_training(*args, **kwargs):
        raise AssertionError("a run trained before the study's inputs were checked")

    monkeypatch.setattr(runner, "train_run", no_training)
    with pytest.raises(UserError) as err:
        runner.run_study(study, show_progress=False, log=lambda line: None)
    assert "\n" not in str(err.value) and all(word in str(err.value) for word in words), str(err.value)
    assert not (tmp_path / "out" / "results.jsonl").exists() or not (tmp_path / "out" / "results.jsonl").read_text()


# ----- a row that lacks a measurement is not finished ---------------------------------------
@pytest.fixture(scope="module")
def lacking_glue(tmp_path_factory):
    """A one-run study (2 steps, a further held-out set, GLUE on a small SST-2 and RTE) whose RTE dev file went
    missing while it trained: (its folder, the study, what the runner said)."""
    root = tmp_path_factory.mktemp("lacking")
    write_glue_task(root / "glue" / "SST-2")
    (root / "glue" / "RTE").mkdir()
    pairs = "".join(f"{i}\ta film {i}\tit is {i % 3}\t{'not_' * (i % 2)}entailment\n" for i in range(16))
    for name in ("train.tsv", "dev.tsv"):
        (root / "glue" / "RTE" / name).write_text("index\tsentence1\tsentence2\tlabel\n" + pairs)
    base = {**TINY_BASE, "train": {**TINY_BASE["train"], "max_steps": 2, "eval_every": 0}}
    study = study_file.load_study(
        write_study(
            root,
            base=base,
            arms=[DYNAMIC],
            glue_dir=str(root / "glue"),
            glue={"tasks": ["SST-2", "RTE"], "epochs": 1, "batch_size": 8},
            eval_data={"valid-again": str(first_documents(SAMPLE_VALID, 10, root / "valid-again.txt"))},
        )
    )
    train_run, said = runner.train_run, []

    def train_then_lose_the_dev_file(*args, **kwargs):
        trained = train_run(*args, **kwargs)
        (root / "glue" / "RTE" / "dev.tsv").rename(root / "dev.tsv")
        return trained

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "train_run", train_then_lose_the_dev_file)
        runner.run_study(study, show_progress=False, log=said.append)
    return root, study, said


def no_training(*args, **kwargs):
    raise AssertionError("a run with a model folder was trained again")


def test_a_glue_task_without_its_dev_file_leaves_no_average_and_an_unfinished_row(lacking_glue):
    """Before, the row recorded the average over the other tasks and counted as finished: a rerun never scored it."""
    root, study, said = lacking_glue
    (row,) = runner.finished_rows(root / "out" / "results.jsonl")
    assert row["glue"]["average"] is None and row["glue"]["missing"] == ["RTE"]
    assert runner.missing_measurements(row, study) == ["glue"]
    assert any("lacks glue" in line and "without training" in line for line in said), said


def test_a_rerun_measures_what_a_row_lacks_on_its_model_without_training(lacking_glue, tmp_path, monkeypatch):
    root, study, _ = lacking_glue
    out = Path(shutil.copytree(root / "out", tmp_path / "out"))
    glue = Path(shutil.copytree(root / "glue", tmp_path / "glue"))
    shutil.copy(root / "dev.tsv", glue / "RTE" / "dev.tsv")  # the file is back
    study = dataclasses.replace(study, out_dir=str(out), glue_dir=str(glue))
    monkeypatch.setattr(runner, "train_run", no_training)
    said = []
    (completed,) = runner.run_study(study, show_progress=False, log=said.append)
    assert 0 <= completed["glue"]["average"] <= 1 and "missing" not in completed["glue"]
    assert len((out / "results.jsonl").read_text().splitlines()) == 2  # the first row stays, the later one counts
    rows, notes = report.load_rows(out / "results.jsonl")
    assert [row["glue"]["average"] for row in rows] == [completed["glue"]["average"]] and notes == []
    assert runner.run_study(study, show_progress=False, log=said.append) == []  # now finished


def test_a_held_out_set_a_row_recorded_as_skipped_is_measured_on_a_rerun(lacking_glue, tmp_path, monkeypatch):
    """Rows of older versions recorded a set they could not read as skipped, and counted as finished."""
    root, study, _ = lacking_glue
    out = Path(shutil.copytree(root / "out", tmp_path / "out"))
    (row,) = runner.finished_rows(out / "results.jsonl")
    runner.append_row(out / "results.jsonl", {**row, "eval_data": {"valid-again": {"skipped": "not found"}}})
    glue = Path(shutil.copytree(root / "glue", tmp_path / "glue"))
    shutil.copy(root / "dev.tsv", glue / "RTE" / "dev.tsv")
    study = dataclasses.replace(study, out_dir=str(out), glue_dir=str(glue))
    monkeypatch.setattr(runner, "train_run", no_training)
    (completed,) = runner.run_study(study, show_progress=False, log=lambda line: None)
    assert completed["eval_data"]["valid-again"]["masked_tokens"] > 0
    assert completed["eval_data"]["valid-again"]["mlm_loss"] == pytest.approx(
        row["eval_data"]["valid-again"]["mlm_loss"]
    )


@pytest.mark.parametrize(
    "names, words",
    [
        ({"glue": {"tasks": "all"}}, ["CoLA/train.tsv is missing"]),
        ({"glue": {"tasks": ["rte"]}}, ["RTE/dev.tsv is missing"]),
        ({"eval_data": {"empty": "EMPTY"}}, ["eval_data 'empty'", "holds no corpus files"]),
        ({"eval_data": {"pairs": "PAIRS"}}, ["eval_data 'pairs'", "objective 'nsp'", "data.objective=mlm"]),
    ],
)
def test_every_input_a_study_names_is_checked_as_it_will_be_read(tmp_path, monkeypatch, names, words):
    """Task names as the glue block accepts them ("all", any case) crashed the check with a KeyError; a held-out
    folder without text, or prepared as NSP pairs for arms that train on packed blocks, failed after training."""
    glue_dir = tmp_path / "glue"
    (glue_dir / "RTE").mkdir(parents=True)
    (glue_dir / "RTE" / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n")
    (tmp_path / "empty").mkdir()
    if names.get("eval_data") == {"pairs": "PAIRS"}:  # the text prepared as NSP pairs, prepare's default
        few = str(first_documents(SAMPLE_VALID, 10, tmp_path / "few.txt"))
        vocab = str(SAMPLE_VALID.parent / "vocab.txt")
        assert main(["prepare", "--corpus", few, "--tokenizer", vocab, "--out", str(tmp_path / "pairs")]) == 0
    if "eval_data" in names:
        names = {"eval_data": {name: str(tmp_path / path.lower()) for name, path in names["eval_data"].items()}}
    base = {**TINY_BASE, "data": {**TINY_BASE["data"], "objective": "mlm"}}
    study = study_file.load_study(write_study(tmp_path, base=base, glue_dir=str(glue_dir), **names))
    monkeypatch.setattr(runner, "train_run", no_training)
    with pytest.raises(UserError) as err:
        runner.run_study(study, show_progress=False, log=lambda line: None)
    assert "\n" not in str(err.value) and all(word in str(err.value) for word in words), str(err.value)


# ----- reports refuse what does not compare -------------------------------------------------
def test_an_infinite_loss_is_flagged_and_left_out_not_an_infinite_difference(tmp_path):
    """Before: "Δ = +inf in each of 2 paired seeds"."""
    rows = decided_rows("dynamic", [6.0, 6.1, 5.9]) + decided_rows("adm", [5.8, math.inf, 5.7])
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = report.write_report(results, tmp_path / "report").read_text()
    assert not re.search(r"[+-]inf|\binf\b|nan", text.replace(str(tmp_path), "")), text
    assert "- Warning: **adm seed 1 has non-finite figures** (perplexity" in text


def test_an_arm_whose_rows_were_measured_differently_gets_no_call(tmp_path):
    """Before, an arm whose seeds were measured on other held-out targets was called better, with a star."""
    arm = decided_rows("adm", [5.5, 5.6, 5.4, 5.55])
    for row in arm:
        row["eval"]["masked_tokens"] = 266
    arm[0]["eval"]["masked_tokens"] = 248  # e.g. another eval_batch_size or held-out text for this seed
    calls = decision_calls(tmp_path, decided_rows("dynamic", [6.0, 6.1, 5.9, 6.05]) + arm)
    assert "adm" not in calls
    text = (tmp_path / "report" / "report.md").read_text()
    assert "**adm: its rows were measured with different held-out settings** (masked tokens 248 vs 266)" in text
    assert "adm better" not in text and "lower, i.e. better" not in text and "] *" not in text


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--dry-run", "--time-steps", "-3"], ["--time-steps=-3", "at least 1"]),  # priced the study at 0.00 CPU-hours
        (["--dry-run", "--time-steps", "0"], ["--time-steps=0", "at least 1"]),  # timed nothing, said nothing
        (["--time-steps", "2"], ["--time-steps 2", "--dry-run"]),  # trained the whole study instead
    ],
)
def test_time_steps_that_time_nothing_are_refused_in_one_line(tmp_path, capsys, monkeypatch, argv, words):
    monkeypatch.setattr(runner, "train_run", no_training)
    assert main(["study", write_study(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlmlab: error: ") and "\n" not in err and all(word in err for word in words), err
    assert not (tmp_path / "out").exists()


def test_the_dry_run_names_a_row_that_lacks_a_measurement(lacking_glue, capsys):
    root, study, _ = lacking_glue
    text = dry_run.dry_run_text(study)
    assert "0 runs left" not in text and "to measure: dynamic seed 0 lacks glue" in text


def test_an_infinite_figure_leaves_a_gate_unmeasured_not_held():
    """Before, a diverged seed's infinite accuracy-like figure made the mean infinite, and the gate held."""
    rows = [result_row("a", eval={"mlm_accuracy": 0.3}), result_row("b", seed=1, eval={"mlm_accuracy": math.inf})]
    (result,) = gate_results({"eval.mlm_accuracy": 0.2}, rows)
    assert not result["held"] and describe([result]) == "eval.mlm_accuracy not measured"


LINEAR = {
    "name": "adm-linear",
    "masking.strategy": "adaptive",
    "masking.scorer": "entropy",
    "masking.adapt_schedule": "linear",
}
SCREEN = {"seeds": [0], "candidates": ["adm-entropy", "adm-linear"], "confirm": ["dynamic"]}


def screen_rows(losses: dict) -> list[dict]:
    return [{"arm": arm, "seed": seed, "eval": {"mlm_loss": loss}} for (arm, seed), loss in losses.items()]


def test_the_screens_pick_is_the_lowest_mean_over_its_seeds_and_waits_for_every_candidate():
    screen = study_file.Screen((0, 1), ("a", "b", "c"), ("dynamic",))
    rows = screen_rows({("a", 0): 4.0, ("a", 1): 4.2, ("b", 0): 3.9, ("b", 1): 4.1, ("c", 0): 4.5})
    assert screen_pick(screen, rows, "eval.mlm_loss", True) is None  # c's seed 1 is not in
    rows += screen_rows({("c", 1): math.nan, ("b", 2): 1.0})  # a diverged run; a confirmation seed counts for nothing
    assert screen_pick(screen, rows, "eval.mlm_loss", True) == "b"
    assert screen_pick(screen, rows, "eval.mlm_loss", False) == "a"  # higher is better; c's NaN is never picked
    tied = screen_rows({("a", 0): 4.0, ("a", 1): 4.0, ("b", 0): 4.0, ("b", 1): 4.0, ("c", 0): 5.0, ("c", 1): 5.0})
    assert screen_pick(screen, tied, "eval.mlm_loss", True) == "a"  # a tie goes to the candidate listed first


@pytest.mark.parametrize(
    "screen, words",
    [
        ({"seeds": [0], "candidates": ["adm-x"], "confirm": ["dynamic"]}, "screen names 'adm-x', which is not an arm"),
        ({"seeds": [0, 1], "candidates": ["adm-entropy"], "confirm": ["dynamic"]}, "some, not all"),
        ({"seeds": [0], "candidates": ["dynamic"], "confirm": ["dynamic"]}, "not both"),
        ({"seeds": [0], "candidates": ["adm-entropy"]}, "must map seeds, candidates, confirm"),
    ],
)
def test_a_bad_screen_block_is_refused_in_one_line(tmp_path, screen, words):
    decision = {"metric": "eval.mlm_loss"}
    with pytest.raises(UserError, match=re.escape(words)):
        study_file.load_study(write_study(tmp_path, seeds=[0, 1], screen=screen, decision=decision))


def test_a_contrast_with_the_screens_pick_needs_a_screen(tmp_path):
    decision = {"metric": "eval.mlm_loss", "contrasts": [["screen.selected", "dynamic"]]}
    with pytest.raises(UserError, match="no screen: block"):
        study_file.load_study(write_study(tmp_path, decision=decision))


def test_a_screen_runs_every_arm_on_its_seeds_then_only_the_pick_and_the_confirm_arms(tmp_path, capsys):
    decision = {"metric": "eval.mlm_loss", "contrasts": [["screen.selected", "dynamic"]]}
    path = write_study(tmp_path, arms=[DYNAMIC, ENTROPY, LINEAR], seeds=[0, 1], screen=SCREEN, decision=decision)
    study = study_file.load_study(path)
    assert [(run.arm.name, run.seed) for run in runner.plan_runs(study)] == [
        ("dynamic", 0),
        ("adm-entropy", 0),
        ("adm-linear", 0),
        ("dynamic", 1),
        ("adm-entropy", 1),
        ("adm-linear", 1),
    ]
    assert main(["study", path, "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "then dynamic and the pick on the rest of seeds [0, 1]: 6 runs planned" in said
    assert "the 5 left" in said and "1 confirmation runs of candidates other than the screen's pick not counted" in said
    log = []
    rows = runner.run_study(study, show_progress=False, log=log.append)
    pick = screen_pick(study.screen, rows, "eval.mlm_loss", True)
    other = ({"adm-entropy", "adm-linear"} - {pick}).pop()
    assert [(row["arm"], row["seed"]) for row in rows] == [
        ("dynamic", 0),
        ("adm-entropy", 0),
        ("adm-linear", 0),
        ("dynamic", 1),
        (pick, 1),
    ]  # seed-major, the screen's seed first
    assert any(line.endswith(f"{other} seed 1: not run: the screen picked {pick}") for line in log)
    text = report.write_report(tmp_path / "out" / "results.jsonl", tmp_path / "report").read_text()
    assert f"| {pick} − dynamic | 2 |" in text  # screen.selected resolved to the pick, paired over both seeds
    assert "## Screen (descriptive): every arm on seeds [0]" in text and f"**{pick}**" in text
    assert f"The pick on the seeds past the screen's alone (they did not choose it): {pick} − dynamic" in text


def test_the_screens_intervals_pool_the_candidates_paired_variances():
    """Two seeds an arm: each difference from the reference has 1 df; the pooled sd serves every arm."""
    loss = Metric("MLM loss (nats)", ("eval", "mlm_loss"), True)
    values = {"ref": [4.0, 4.2], "a": [4.1, 4.2], "b": [3.9, 4.3], "extra": [5.0, 5.1]}
    groups = {arm: screen_rows({(arm, seed): v for seed, v in enumerate(vs)}) for arm, vs in values.items()}
    result = screening.pooled(groups, "ref", ["a", "b", "extra"], (0, 1), loss, ["a", "b"])
    # differences: a (+0.1, 0.0), b (-0.1, +0.1); variances 0.005 and 0.02 with 1 df each
    assert result.df == 2 and result.sd == pytest.approx(math.sqrt((0.005 + 0.02) / 2))
    mean, low, high = result.interval("extra")  # an arm outside the pool takes its sd too
    half = stats.t.ppf(0.975, 2) * result.sd / math.sqrt(2)
    assert (mean, low, high) == pytest.approx((0.95, 0.95 - half, 0.95 + half))  # (+1.0, +0.9)
