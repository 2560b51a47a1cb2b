"""Nothing lost and nothing silently wrong when processes meet or are stopped.

A stop signal to the whole process group (``timeout``, a scheduler's preemption, Ctrl-C) with
loader workers; a crash while metrics.jsonl is rewritten; two writers of one folder; a damaged
metrics line; a finished run rerun. Each test failed before: a traceback and no checkpoint, a cut
metrics.jsonl, two runs mixed in one folder, a line dropped unseen, an evaluation line repeated.
"""

import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import SAMPLE
from safetensors.torch import load_file
from test_hostile_inputs import (  # noqa: F401 (world: a fixture)
    copy_of,
    export_argv,
    filled_part_way,
    glue_argv,
    moved_run,
    pretrain_argv,
    probe_argv,
    world,
)

from mlmlab.cli import main
from mlmlab.errors import UserError
from mlmlab.experiments.running.runner import results_lock
from mlmlab.train import run_folder
from mlmlab.train.metrics import MetricsWriter
from mlmlab.utils import files
from mlmlab.utils.files import lock_beside, lock_folder, refuse_results_of_another_model, staging_folder

pytestmark = pytest.mark.usefixtures("no_progress_bars")

# Long enough to be stopped halfway; a loader worker in the process group; dropout on, so a bitwise
# resume needs its generator restored too; no checkpoint but the one the stop writes.
STOPPABLE = ["data.loader_workers=1", "train.max_steps=40", "train.save_every=1000", "model.dropout=0.1"]


def command(out_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "mlmlab.cli", *pretrain_argv(out_dir, *overrides)]


def records(run: Path) -> list[dict]:
    """metrics.jsonl's records; a last line cut short by a kill is left out."""
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found


def last_step(run: Path) -> int:
    return max((record["step"] for record in records(run)), default=0)


def fingerprint(folder: Path) -> dict:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error_line(err: str) -> str:
    err = err.strip()
    assert err.startswith("mlmlab: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


# ----- item 0: a stop signal to the whole process group -------------------------------------
@pytest.fixture(scope="module")
def straight_weights(tmp_path_factory) -> dict:
    run = tmp_path_factory.mktemp("straight") / "run"
    subprocess.run(command(run, *STOPPABLE), check=True, capture_output=True)
    return load_file(run / "model" / "model.safetensors")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_the_process_group_saves_the_step_reached_and_resumes_bitwise(
    straight_weights, tmp_path, signum
):
    """Before, the loader worker died of it first: a traceback (SIGTERM) or an exit (SIGINT), and no checkpoint."""
    run = tmp_path / "run"
    job = subprocess.Popen(
        command(run, *STOPPABLE), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )  # its own process group, as a job under timeout or a scheduler
    while last_step(run) < 2 and job.poll() is None:
        time.sleep(0.02)
    assert job.poll() is None, job.communicate()[1][-3000:]
    os.killpg(job.pid, signum)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 128 + signum and "Traceback" not in err, err[-3000:]
    saved = run_folder.latest(run)
    assert saved is not None and not (run / "model").exists(), "no checkpoint, or the run finished before the signal"
    assert run_folder.step_of(saved) == last_step(run) >= 2  # the step reached: none lost
    resumed = subprocess.run(command(run, *STOPPABLE), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    weights = load_file(run / "model" / "model.safetensors")
    assert all(torch.equal(straight_weights[name], weights[name]) for name in straight_weights)


def children(pid: int) -> list[str]:
    return (
        Path(f"/proc/{pid}/task/{pid}/children").read_text().split() if Path(f"/proc/{pid}/task/{pid}").exists() else []
    )


def test_a_stop_signal_to_the_process_group_during_prepare_stops_it_cleanly(world, tmp_path):
    """Its pool workers let the job's SIGTERM pass; the main process stops them and its staging folder goes."""
    out = tmp_path / "prepared"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlmlab.cli",
            "prepare",
            "--corpus",
            str(SAMPLE / "train.txt.gz"),
            "--tokenizer",
            str(world.tokenizer),
            "--out",
            str(out),
            "--workers",
            "2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    while len(children(job.pid)) < 2 and job.poll() is None:
        time.sleep(0.01)
    assert job.poll() is None, job.communicate()[1][-3000:]
    os.killpg(job.pid, signal.SIGTERM)
    _, err = job.communicate(timeout=60)  # until every process holding its stderr is gone
    assert job.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "mlmlab: interrupted by SIGTERM", err[-3000:]  # after any progress output
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


# ----- item 1: metrics.jsonl on resume ------------------------------------------------------
def test_a_crash_while_metrics_jsonl_is_rewritten_leaves_it_whole(world, tmp_path):
    """Before, the resume truncated the file and wrote it back: a crash in between left it cut (or empty)."""
    run = moved_run(world, tmp_path)
    metrics = (run / "metrics.jsonl").read_bytes()
    # The rewrite dies at 64 bytes (the file-size limit), as a kill would have stopped it.
    crash = (
        "import resource, sys; from mlmlab.train.metrics import MetricsWriter; "
        "writer = MetricsWriter(sys.argv[1], True); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64)); writer.drop_after(2)"
    )
    crashed = subprocess.run([sys.executable, "-c", crash, str(run)], capture_output=True, text=True)
    assert crashed.returncode != 0, "the rewrite did not reach the file-size limit"
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert main(pretrain_argv(run)) == 0  # the rerun also removes the dead writer's staging file
    assert not list(run.glob(".tmp-*"))


def test_a_resume_writes_the_records_it_keeps_back_byte_for_byte(tmp_path):
    """drop_after writes the records it read back through jsonio again: each must come out as the line it was."""
    writer = MetricsWriter(tmp_path, enabled=True)
    for record in [
        {"step": 1, "loss": 0.1 + 0.2, "lr": 1e-05, "eval": {"perplexity": 1234.5678901234567, "x": None}},
        {"step": 2, "loss": 1 / 3, "note": 'caf\u00e9 "quoted"', "flags": [True, 3, -0.0]},
        {"step": 3, "loss": 7.25},
    ]:
        writer.write(record)
    written = (tmp_path / "metrics.jsonl").read_bytes()
    writer.drop_after(2)
    assert (tmp_path / "metrics.jsonl").read_bytes() == b"".join(written.splitlines(keepends=True)[:2])


def test_a_damaged_metrics_line_before_the_last_stops_the_resume(world, tmp_path, capsys):
    """Before, it was dropped unseen along with the steps the resume redoes."""
    run = moved_run(world, tmp_path)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][: len(lines[1]) // 2]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    before = fingerprint(run)
    capsys.readouterr()
    assert main(pretrain_argv(run, "train.max_steps=6", "--resume", "auto")) == 2
    assert "metrics.jsonl: line 2 is not a metrics record" in one_error_line(capsys.readouterr().err)
    assert fingerprint(run) == before


def test_a_finished_run_rerun_records_its_final_evaluation_once(world, tmp_path):
    """Before, each rerun of the same command appended another copy of it."""
    run = moved_run(world, tmp_path)
    assert main(pretrain_argv(run)) == 0  # the same command: the finished run resumes at its last step
    assert [record["step"] for record in records(run) if "eval" in record] == [4]
    assert [record["step"] for record in records(run) if "loss" in record] == [1, 2, 3, 4]


def test_a_run_folder_moved_elsewhere_resumes_where_it_now_is(world, tmp_path):
    """Its config.yaml still names the old folder; before, the move was refused as "a different config"."""
    run = copy_of(world.run, tmp_path)
    assert main(pretrain_argv(run)) == 0
    assert [record["step"] for record in records(run) if "eval" in record] == [4]
    assert f"out_dir: {run}" in (run / "config.yaml").read_text()  # recorded where it now lives


# ----- item 2: one writer per folder --------------------------------------------------------
def test_two_pretrains_on_one_folder_one_trains_and_the_other_is_refused(tmp_path):
    """Before, both trained: every step twice in metrics.jsonl, and model/ from either run."""
    run = tmp_path / "race"
    jobs = [
        subprocess.Popen(
            command(run, "train.max_steps=20"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    errors = [job.communicate(timeout=300)[1] for job in jobs]
    codes = [job.returncode for job in jobs]
    assert sorted(codes) == [0, 2], errors
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    refusal = one_error_line(errors[loser])
    assert f"the run folder {run} is being written" in refusal and f"(pid {jobs[winner].pid} on host " in refusal
    assert [record["step"] for record in records(run) if "loss" in record] == list(range(1, 21))
    assert json.loads((run / "summary.json").read_text())["steps"] == 20
    assert run_folder.verify(run_folder.latest(run)) is None


# Each: the command line of a second writer, and the lock a first writer holds.
def busy_run(world, tmp):
    run = moved_run(world, tmp)
    return pretrain_argv(run), run_folder.lock_run(run)


def busy_glue_out(world, tmp):
    argv = glue_argv(world.model, copy_of(world.glue, tmp))
    return argv, lock_folder(Path(argv[argv.index("--out") + 1]), "GLUE's --out", "")


def busy_probe_out(world, tmp):
    out = tmp / "probe-out"
    argv = ["probe", "--model", str(world.model), "--task", "SST-2", "--data-dir", str(world.glue), "--out", str(out)]
    return argv, lock_folder(out, "probe's --out", "")


def busy_export_out(world, tmp):
    return ["export", str(world.run), "--out", str(tmp / "exported")], lock_beside(tmp / "exported", "--out", "")


@pytest.mark.parametrize(
    "busy", [busy_run, busy_glue_out, busy_probe_out, busy_export_out], ids=["pretrain", "glue", "probe", "export"]
)
def test_a_second_writer_is_refused_naming_the_first(world, tmp_path, capsys, busy):
    argv, held = busy(world, tmp_path)  # this process stands for the first writer
    with held:
        capsys.readouterr()
        assert main(argv) == 2
        refusal = one_error_line(capsys.readouterr().err)
    assert f"is being written by another mlmlab process (pid {os.getpid()} on host {socket.gethostname()})" in refusal


def test_a_study_shard_has_one_writer_while_shards_write_side_by_side(tmp_path):
    study = SimpleNamespace(out_dir=str(tmp_path))  # all the lock reads of a study
    with results_lock(study, (0, 2)), results_lock(study, (1, 2)):
        with pytest.raises(UserError, match=r"results.jsonl \(shard 0/2\) is being written by another mlmlab process"):
            results_lock(study, (0, 2))


def test_a_resume_keeps_the_staging_folder_of_a_live_writer(world, tmp_path):
    """Before, it deleted every partial checkpoint, a concurrent writer's included."""
    run = moved_run(world, tmp_path)
    live = staging_folder(run / "ckpt-00000009")  # this process's: alive
    dead_pid = int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    )
    dead = live.with_name(live.name.replace(f"-{os.getpid()}-", f"-{dead_pid}-"))
    dead.mkdir()
    assert main(pretrain_argv(run, "train.max_steps=5", "--resume", "auto")) == 0
    assert live.is_dir() and not dead.exists()


# ----- outputs written whole: a write the disk refuses part-way leaves the previous state -------
def staged_leftovers(folder: Path) -> list[str]:
    return [path.name for path in folder.iterdir() if path.name.startswith(".tmp-")]


def test_a_checkpoint_the_disk_refuses_part_way_leaves_the_last_one_and_the_rerun_resumes(
    world, tmp_path, capsys, monkeypatch
):
    """Before, torch's writer reported the full disk as "RuntimeError: [enforce fail at inline_container.cc]"."""
    run = moved_run(world, tmp_path)
    argv = pretrain_argv(run, "train.max_steps=6", "--resume", "auto")
    filled_part_way("training_state.pt")(monkeypatch)
    assert main(argv) == 2
    refusal = one_error_line(capsys.readouterr().err.strip().splitlines()[-1])
    assert "ckpt-00000004 is kept intact" in refusal and "free space" in refusal
    assert run_folder.latest(run).name == "ckpt-00000004" and not staged_leftovers(run)
    monkeypatch.undo()  # space freed
    assert main(argv) == 0
    assert (
        run_folder.latest(run).name == "ckpt-00000006" and json.loads((run / "summary.json").read_text())["steps"] == 6
    )


def test_an_export_the_disk_refuses_part_way_leaves_no_half_folder_and_the_rerun_exports(
    world, tmp_path, capsys, monkeypatch
):
    """Before, export copied straight into --out: a third of model.safetensors stayed, and the next export refused
    the half folder."""
    argv = export_argv(world, tmp_path)
    filled_part_way("model.safetensors")(monkeypatch)
    assert main(argv) == 2
    one_error_line(capsys.readouterr().err)
    assert sorted(path.name for path in tmp_path.iterdir()) == []  # no --out, no staging folder, no lock file
    monkeypatch.undo()
    assert main(argv) == 0
    exported = tmp_path / "exported"
    assert (exported / "model.safetensors").read_bytes() == (world.model / "model.safetensors").read_bytes()


# ----- a results folder holds one model's results ----------------------------------------------
@pytest.mark.parametrize("command", ["probe", "glue"])
def test_a_results_folder_of_another_model_is_refused_and_the_same_models_rerun_replaces(
    world, tmp_path, capsys, command
):
    """Before, a second model's probe or GLUE into a finished --out replaced its results without a word."""
    other_model = copy_of(world.model, tmp_path)  # the same weights under another folder: another model's results
    out = tmp_path / "results"

    def argv(model: Path) -> list[str]:
        if command == "probe":
            return probe_argv(model, world.glue, out)
        return [*glue_argv(model, world.glue)[:-2], "--out", str(out)]

    assert main(argv(other_model)) == 0
    before = fingerprint(out)
    capsys.readouterr()
    assert main(argv(world.model)) == 2
    refusal = one_error_line(capsys.readouterr().err)
    assert f"already holds results of the model {other_model}" in refusal and "give --out a new folder" in refusal
    assert fingerprint(out) == before
    assert main(argv(other_model)) == 0  # the same model again: its rerun replaces its results


@pytest.mark.parametrize(
    "recorded, model, out, same",
    [
        ("old/study/runs/a/seed0/model", "new/study/runs/a/seed0/model", "new/study/runs/a/seed0/glue", True),
        ("old/study/runs/a/seed0/model", "new/study/runs/b/seed0/model", "new/study/runs/a/seed0/glue", False),
        ("x/m/model", "y/m/model", "z/out", False),  # results apart from the model: only its own path is it
    ],
)
def test_results_moved_together_with_their_model_are_still_its_own(tmp_path, recorded, model, out, same):
    """A study folder moved elsewhere reruns a row's missing measurement into its runs' glue/ beside model/."""
    results = tmp_path / out
    results.mkdir(parents=True)
    (results / "glue_results.json").write_text(json.dumps({"model_dir": str(tmp_path / recorded)}))
    if same:
        refuse_results_of_another_model(results, "glue_results.json", tmp_path / model)
    else:
        with pytest.raises(UserError, match="already holds results of the model"):
            refuse_results_of_another_model(results, "glue_results.json", tmp_path / model)


# ----- lock files: none left beside an output --------------------------------------------------
def exported_beside(world, tmp: Path) -> tuple[list[str], Path]:
    return export_argv(world, tmp), tmp


def evaluated_to_json(world, tmp: Path) -> tuple[list[str], Path]:
    argv = ["evaluate", "--model", str(world.model), "--data", str(world.data), "--max-batches", "1"]
    return [*argv, "--json", str(tmp / "x.json")], tmp


def probed_into(world, tmp: Path) -> tuple[list[str], Path]:
    return probe_argv(world.model, world.glue, tmp / "out"), tmp / "out"


def trained_in(world, tmp: Path) -> tuple[list[str], Path]:
    run = moved_run(world, tmp)
    return pretrain_argv(run, "train.max_steps=5", "--resume", "auto"), run


@pytest.mark.parametrize("command", [exported_beside, evaluated_to_json, probed_into, trained_in])
def test_no_lock_file_is_left_beside_an_output(world, tmp_path, capsys, command):
    """Before, `.x.json.lock`, `.exported.lock` and the folders' `.lock` stayed after the command."""
    argv, folder = command(world, tmp_path)
    assert main(argv) == 0
    assert [path.name for path in folder.iterdir() if path.name.endswith(".lock")] == []


def test_a_writer_that_locked_a_released_lock_file_locks_again_and_is_refused_by_its_new_holder(tmp_path, monkeypatch):
    """Release deletes the lock file: a writer that had opened it before must not take it as its own."""
    target = tmp_path / "out"
    first = lock_beside(target, "--out", "")
    stale = open(first.path, "a+", encoding="utf-8")  # opened by a second writer before the first released
    first.release()
    assert not first.path.exists()
    with lock_beside(target, "--out", ""):  # a third writer: a new lock file under the name
        opened = iter([stale])
        real = files._lock_file_handle
        monkeypatch.setattr(files, "_lock_file_handle", lambda path, instead: next(opened, None) or real(path, instead))
        with pytest.raises(UserError, match=r"--out is being written by another mlmlab process \(pid "):
            lock_beside(target, "--out", "")


# ----- a real full disk: a small tmpfs ---------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A real 64 MB file system (tmpfs), mounted for the test and unmounted after it."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode:  # not root, or a container without CAP_SYS_ADMIN; the part-way injections above still run
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or 'mount failed'})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill_leaving(disk: Path, free: int) -> Path:
    """A file that fills ``disk`` up to ``free`` bytes left."""
    stats = os.statvfs(disk)
    filler = disk / "filler"
    with open(filler, "wb") as handle:
        handle.truncate(0)
        handle.write(bytes(stats.f_bavail * stats.f_frsize - free))
    return filler


def checkpoint_sizes(run: Path) -> dict[str, int]:
    saved = run_folder.latest(run)
    model = sum(path.stat().st_size for path in (saved / "model").rglob("*") if path.is_file())
    return {
        "weights": (saved / "model" / "model.safetensors").stat().st_size,
        "model": model,
        "state": (saved / run_folder.STATE_TENSORS_FILE).stat().st_size,
    }


FULL_DISKS = {  # what fills the disk: the free space left before it, and what the line must say
    "weights (safetensors' writer)": (lambda size: size["weights"] // 2, "checkpoint ckpt-00000006"),
    "training state (torch's writer)": (lambda size: size["model"] + size["state"] // 2, "checkpoint ckpt-00000006"),
    "export (shutil's copy)": (lambda size: size["weights"] // 2, "the model folder"),
}


@pytest.mark.parametrize("fills", list(FULL_DISKS))
def test_a_real_full_disk_is_one_line_keeps_what_was_written_and_the_rerun_finishes(world, small_disk, capsys, fills):
    """Before: torch's "RuntimeError: [enforce fail at inline_container.cc]", safetensors' SafetensorError, and
    shutil.Error with a half-copied model folder, each a traceback."""
    free, what = FULL_DISKS[fills]
    if fills.startswith("export"):
        argv, leftovers_in = export_argv(world, small_disk), small_disk
    else:
        run = moved_run(world, small_disk)
        argv, leftovers_in = pretrain_argv(run, "train.max_steps=6", "--resume", "auto"), run
    filler = fill_leaving(small_disk, free(checkpoint_sizes(world.run)))
    capsys.readouterr()
    assert main(argv) == 2
    refusal = one_error_line(capsys.readouterr().err.strip().splitlines()[-1])
    assert what in refusal and "No space left on device" in refusal and "free space" in refusal
    assert not staged_leftovers(leftovers_in) and not (small_disk / "exported").exists()
    if not fills.startswith("export"):
        assert "ckpt-00000004 is kept intact" in refusal and run_folder.latest(run).name == "ckpt-00000004"
    filler.unlink()  # space freed: the same command finishes
    assert main(argv) == 0


# ----- mlmlab evaluate measures what the run measured ---------------------------------------
@pytest.fixture(scope="module")
def bert_mlm_run(tmp_path_factory) -> tuple[Path, str]:
    """A BERT trained 2 steps on packed blocks (data.objective=mlm) of 64 tokens: its run folder, and the
    "mlmlab evaluate" line of what pretrain printed next."""
    run = tmp_path_factory.mktemp("bert-mlm") / "run"
    with pytest.MonkeyPatch.context() as patch:
        printed = []
        patch.setattr("builtins.print", lambda *args, **kwargs: printed.append(" ".join(map(str, args))))
        assert main(pretrain_argv(run, "data.objective=mlm", "data.max_seq_length=64", "train.max_steps=2")) == 0
    hint = next(line.strip() for text in printed for line in text.splitlines() if "mlmlab evaluate" in line)
    return run, hint


def evaluated(argv: list[str], out: Path) -> dict:
    assert main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_the_evaluate_command_pretrain_suggests_gives_the_runs_own_held_out_figure(bert_mlm_run, tmp_path):
    """Before, it prepared NSP pairs of 128 tokens from the text: another figure over other targets."""
    run, hint = bert_mlm_run
    report = evaluated(shlex.split(hint)[1:], tmp_path / "eval.json")
    own = json.loads((run / "summary.json").read_text())["eval"]
    assert report["objective"] == "mlm" and report["masked_tokens"] == own["masked_tokens"]
    assert report["mlm_loss"] == pytest.approx(own["mlm_loss"], abs=1e-4)


def test_a_model_folder_that_predates_the_record_follows_its_runs_config(bert_mlm_run, tmp_path):
    run = copy_of(bert_mlm_run[0], tmp_path)
    config = json.loads((run / "model" / "config.json").read_text())
    del config["held_out_form"]
    (run / "model" / "config.json").write_text(json.dumps(config))
    argv = ["evaluate", "--model", str(run / "model"), "--data", str(SAMPLE / "valid.txt.gz"), "--max-batches", "2"]
    report = evaluated(argv, tmp_path / "eval.json")
    own = json.loads((run / "summary.json").read_text())["eval"]
    assert report["mlm_loss"] == pytest.approx(own["mlm_loss"], abs=1e-4)


def test_evaluate_refuses_a_prepared_folder_of_the_other_objective(world, bert_mlm_run, capsys):
    """world.data holds NSP pairs; the model trained on packed blocks. Before, it was measured on them unsaid."""
    capsys.readouterr()
    assert main(["evaluate", "--model", str(bert_mlm_run[0] / "model"), "--data", str(world.data)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "objective 'nsp'" in err and "data.objective=mlm" in err
