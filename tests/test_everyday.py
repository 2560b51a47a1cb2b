"""As a new user meets mlmlab: progress on every long command, defaults that cannot silently
misfire, cost estimates that count GLUE and probes, `mlmlab config`, and the small things (a pipe
closed early, which model a GLUE table names, which files a tokenizer read)."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import SHARED_DATA
from test_hostile_inputs import CORPUS, glue_argv, pretrain_argv, world  # noqa: F401 (world: a fixture)

from mlmlab.cli import build_parser, main, masking_of, parse_arguments
from mlmlab.config import Config, TrainConfig
from mlmlab.evaluate.glue import format_glue_table
from mlmlab.train.optim import learning_rate, resume_lr_note, training_progress

pytestmark = pytest.mark.usefixtures("no_progress_bars")  # transformers' own bars, not mlmlab's
GLUE_DIR = SHARED_DATA / "glue"
needs_glue = pytest.mark.shared_data("glue")


# ----- item 2: progress on stderr, off with --no-progress ----------------------------------------
def as_terminal(monkeypatch):
    """stderr (capsys's, once the test runs) as a terminal, where the bars are drawn (progress.py)."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)


def long_commands(w, tmp: Path) -> dict[str, list[str]]:
    return {
        "prepare": [
            "prepare",
            "--corpus",
            str(CORPUS),
            "--tokenizer",
            str(w.tokenizer),
            "--out",
            str(tmp / "data"),
            "--workers",
            "1",
        ],
        "evaluate": ["evaluate", "--model", str(w.model), "--data", str(w.data), "--max-batches", "2"],
        "glue": glue_argv(w.model, w.glue),
    }


@pytest.mark.parametrize(
    "command, shown", [("prepare", "prepare: "), ("evaluate", "evaluate: 100%"), ("glue", "glue SST-2 lr=5e-05 seed=0")]
)
def test_long_commands_show_progress_on_stderr_and_not_with_no_progress(
    world, tmp_path, capsys, monkeypatch, command, shown
):
    as_terminal(monkeypatch)
    argv = long_commands(world, tmp_path / "a")[command]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert shown in captured.err and shown not in captured.out
    if command == "glue":
        assert "epoch=1/1" in captured.err  # the epoch beside the run's bar
    assert main([*long_commands(world, tmp_path / "b")[command], "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_pretrain_says_where_it_prepares_its_data(tmp_path, capsys, monkeypatch):  # a line: in logs too, no terminal
    monkeypatch.setenv("MLMLAB_CACHE", str(tmp_path / "cache"))
    argv = [arg for arg in pretrain_argv(tmp_path / "run", "train.max_steps=2") if arg != "--no-progress"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"preparing {CORPUS} into {tmp_path / 'cache'}" in err and "(the cache; MLMLAB_CACHE moves it)" in err


def test_pretrain_into_a_log_file_writes_a_line_at_each_evaluation(tmp_path, capsys, monkeypatch):
    """stderr not a terminal (nohup, a scheduler's log): no bar, so each held-out evaluation is a line with the time
    left; --no-progress writes none."""
    monkeypatch.setenv("MLMLAB_CACHE", str(tmp_path / "cache"))
    overrides = ("train.eval_every=2", "train.eval_batches=1")
    assert main([arg for arg in pretrain_argv(tmp_path / "a", *overrides) if arg != "--no-progress"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert len(lines) == 1, lines  # step 2; step 4 is the final evaluation, which the command's summary reports
    assert re.fullmatch(
        r"step 2/4 \(50%\): loss \d+\.\d{3}; held-out MLM loss \d+\.\d{3}, accuracy 0\.\d{3}; "
        r"about \d+ min left",
        lines[0],
    ), lines[0]
    assert main(pretrain_argv(tmp_path / "b", *overrides)) == 0
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]


def test_every_long_command_takes_no_progress_and_mask_names_training_progress_apart():
    parser = build_parser()
    for command in ("tokenizer", "prepare", "pretrain", "evaluate", "glue", "probe", "study"):
        action = next(
            a for a in parser._subparsers._group_actions[0].choices[command]._actions if a.dest == "no_progress"
        )
        assert action.option_strings == ["--no-progress"], command
    mask = parser.parse_args(["mask", "a b c", "--training-progress", "0.5"])
    assert mask.training_progress == 0.5 and not hasattr(mask, "progress")


# ----- item 4: defaults that cannot silently misfire ---------------------------------------------
def test_warmup_that_takes_the_whole_step_budget_is_refused(tmp_path, capsys):
    assert main(pretrain_argv(tmp_path / "run", "train.max_steps=5", "train.warmup_steps=5")) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlmlab: error: train.warmup_steps=5 takes all of train.max_steps=5") and err.count("\n") == 1
    assert "train.warmup_steps=0" in err and not (tmp_path / "run" / "config.yaml").exists()


def test_a_time_budget_keeps_any_warmup(tmp_path):
    assert (
        main(pretrain_argv(tmp_path / "run", "train.max_steps=5", "train.warmup_steps=100", "train.max_minutes=0.002"))
        == 0
    )


def test_a_study_arm_whose_warmup_takes_its_budget_is_refused_at_the_dry_run(tmp_path, capsys):
    study = {
        "base": {"train": {"max_steps": 50}},
        "arms": [{"name": "dynamic"}],
        "seeds": [0],
        "out_dir": str(tmp_path / "out"),
    }
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    assert main(["study", str(tmp_path / "study.yaml"), "--dry-run"]) == 2
    assert "arm 'dynamic': train.warmup_steps=100 takes all of train.max_steps=50" in capsys.readouterr().err


def test_extending_a_finished_run_says_the_lr_jumps_back_and_how_to_continue_the_decay(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(pretrain_argv(run, "train.max_steps=6", "train.save_every=0")) == 0  # step 5 decays: 5/6 > 1 - 0.2
    capsys.readouterr()
    assert main(pretrain_argv(run, "train.max_steps=12", "train.save_every=0", "--resume", "auto")) == 0
    out = capsys.readouterr().err
    assert (
        "resumed at step 6 with another LR schedule (train.max_steps 6 -> 12): the last step's LR was 0.000833, "
        "the next is 0.001, back at the peak"
    ) in out
    assert (
        "to continue decaying from 0.000833 to 0 at step 12 instead, resume with train.lr=0.00167 "
        "train.warmup_steps=0 train.decay_fraction=1.0" in out
    )


def test_the_settings_the_resume_line_gives_continue_the_decay():
    before, after = TrainConfig(max_steps=10, warmup_steps=1), TrainConfig(max_steps=30, warmup_steps=1)
    state = type("State", (), {"step": 10, "seconds": 0.0, "warmup_end_progress": 0.0})()
    note = resume_lr_note(before, after, state)
    overrides = dict(item.split("=") for item in note.split("resume with ")[1].split())
    continued = TrainConfig(max_steps=30, lr=float(overrides["train.lr"]), warmup_steps=0, decay_fraction=1.0)
    lrs = [learning_rate(continued, step, training_progress(continued, step, 0.0), 0.0) for step in range(10, 30)]
    last = learning_rate(before, 9, training_progress(before, 9, 0.0), 0.0)
    assert lrs[0] == pytest.approx(last, rel=1e-2) and lrs == sorted(lrs, reverse=True) and lrs[-1] < last / 10
    assert resume_lr_note(after, after, state) is None  # an unchanged schedule says nothing


def jsonl(path: Path, column: str, documents: int = 60) -> Path:
    lines = [
        json.dumps({column: f"Document {d} opens here. It says {d} twice, {d}. Then it ends."})
        for d in range(documents)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_validation_text_has_a_column_of_its_own(tmp_path):
    train, valid = jsonl(tmp_path / "train.jsonl", "body"), jsonl(tmp_path / "valid.jsonl", "text")
    assert (
        main(
            pretrain_argv(
                tmp_path / "run",
                "train.max_steps=2",
                f"data.corpus={train}",
                f"data.valid_corpus={valid}",
                "data.text_column=body",
                "data.valid_text_column=text",
            )
        )
        == 0
    )


def test_a_wrong_validation_column_is_refused_before_anything_is_prepared(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLMLAB_CACHE", str(tmp_path / "cache"))
    train, valid = jsonl(tmp_path / "train.jsonl", "body"), jsonl(tmp_path / "valid.jsonl", "text")
    assert (
        main(
            pretrain_argv(
                tmp_path / "run", f"data.corpus={train}", f"data.valid_corpus={valid}", "data.text_column=body"
            )
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "valid.jsonl has no 'body' field (its fields: text); name the right one with data.valid_text_column" in err
    assert not (tmp_path / "cache").exists()  # the training set was not prepared first


def test_an_empty_validation_column_keeps_every_prepared_hash():
    from mlmlab.data.resolve import dataset_hashes

    data = Config().data
    assert dataset_hashes(data) == dataset_hashes(dataclasses.replace(data, valid_text_column=data.text_column))


# ----- item 6: the dry run counts GLUE and probes, and says how far its FLOPs are from the time ---
@needs_glue
def test_the_dry_run_counts_glue_and_probes_and_compares_its_flops_with_the_timed_probe(tmp_path, capsys):
    study = {
        "base": {
            "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
            "data": {"loader_workers": 0},
            "train": {"batch_size": 8, "max_steps": 20, "warmup_steps": 2},
        },
        "arms": [{"name": "dynamic"}],
        "seeds": [0],
        "glue_dir": str(GLUE_DIR),
        "out_dir": str(tmp_path / "out"),
        "glue": {"tasks": ["WNLI"], "seeds": [0], "max_train_examples": 64, "epochs": 1},
        "probe": {"tasks": ["WNLI"]},
    }
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    assert main(["study", str(tmp_path / "study.yaml"), "--dry-run", "--no-progress"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith("dynamic "))
    assert float(row[-2]) > 0 and float(row[-1]) > 0  # GLUE FLOPs, probe FLOPs per run
    assert "GLUE WNLI: every training row" in out and "probes WNLI" in out
    assert main(["study", str(tmp_path / "study.yaml"), "--dry-run", "--time-steps", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    timed = next(line.split() for line in out.splitlines() if line.startswith("  dynamic"))
    assert float(timed[3].rstrip("x")) > 0  # the step's time against its FLOP estimate
    ratios = dict(
        part.split() for part in out.split("timed / FLOP estimate over the arms: ")[1].splitlines()[0].split(", ")
    )
    assert set(ratios) == {"training", "GLUE", "probes", "all"} and all(
        float(r.rstrip("x")) > 0 for r in ratios.values()
    )


# ----- item 7: mlmlab config ----------------------------------------------------------------------
def test_config_lists_every_key_with_its_default_and_comment(capsys):
    assert main(["config", "tiny", "train.lr=2e-3"]) == 0
    out = capsys.readouterr().out
    for section in dataclasses.fields(Config):
        for field in dataclasses.fields(section.type):
            assert f"\n{section.name}.{field.name} = " in f"\n{out}", f"{section.name}.{field.name}"
    assert "train.lr = 0.002" in out and "# [default 0.001] small models tolerate a high LR" in out
    assert "model.hidden_size = 128" in out and "tiny by default: runs on a laptop CPU in minutes" in out
    assert "Hidden states (BERT's hidden_dropout_prob, 0.1)" in out  # a comment above its field


# ----- the small ones --------------------------------------------------------------------------
def test_dump_into_a_pipe_closed_early_exits_cleanly(world):
    dump = subprocess.Popen(
        [sys.executable, "-m", "mlmlab.cli", "dump", "--data", str(world.data), "-n", "900"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert json.loads(dump.stdout.readline())["index"] == 0
    dump.stdout.close()  # as `| head -1` does
    assert dump.wait(timeout=120) == 0
    assert dump.stderr.read() == b""


def test_the_glue_table_names_the_model_by_its_path():
    results = {"model_dir": "runs/tiny-a/model", "init": "pretrained", "seeds": [0], "tasks": {}, "average": None}
    assert "| runs/tiny-a/model | pretrained |" in format_glue_table(results)


def test_a_tokenizer_trained_on_a_folder_says_which_files_it_read(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a.txt", "b.txt", "c.txt", "d.txt"):
        (corpus / name).write_text(f"The {name} file has a sentence.\nAnd another one here.\n")
    assert (
        main(
            [
                "tokenizer",
                "--corpus",
                str(corpus),
                "--vocab-size",
                "120",
                "--out",
                str(tmp_path / "tok"),
                "--no-progress",
            ]
        )
        == 0
    )
    assert (
        f"trained on 4 files: {corpus / 'a.txt'}, {corpus / 'b.txt'}, {corpus / 'c.txt'} and 1 more"
        in capsys.readouterr().out
    )


def test_the_masking_seed_is_named_apart_from_prepares_seed(capsys):
    """dump and mask take masking.seed as pretrain does (or, for one more release, as --mask-seed): prepare's --seed
    makes the instances themselves."""
    parser = build_parser()
    for argv in (["dump", "--data", "d", "masking.seed=3"], ["mask", "a b", "--mask-seed", "3"]):
        parsed = parse_arguments(parser, argv)
        assert masking_of(parsed).seed == 3 and not hasattr(parsed, "seed")
    assert "--mask-seed is masking.seed=3 now" in capsys.readouterr().err


def test_the_study_command_keeps_its_former_name_for_the_commands_old_reports_print():
    parser = build_parser()
    assert parser.parse_args(["experiment", "x"]).func is parser.parse_args(["study", "x"]).func
