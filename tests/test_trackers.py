"""train.report_to: the same scalars as metrics.jsonl reach accelerate's trackers, run with the real libraries
(W&B offline, MLflow on a local file store); a tracker whose library is missing is refused before training."""

import importlib.util
import json
import subprocess

import pytest
from test_pretrain import _command

from mlmlab import choices
from mlmlab.config import config_hash, load_config
from mlmlab.errors import UserError
from mlmlab.evaluate.perplexity import evaluate_mlm
from mlmlab.train.loop import Trainer
from mlmlab.train.metrics import metrics_records


def _train(tmp_path, report_to: str, steps: int = 3) -> tuple:
    run_dir = tmp_path / "project" / "tiny-run"
    cfg = load_config(
        "tiny",
        [
            f"train.out_dir={run_dir}",
            f"train.report_to={report_to}",
            f"train.max_steps={steps}",
            "train.warmup_steps=1",
            "train.log_every=1",
            "train.eval_every=2",
            "train.eval_batches=1",
            "train.save_every=0",
            "train.batch_size=4",
            "data.loader_workers=0",
        ],
    )
    Trainer(cfg, evaluator=evaluate_mlm, show_progress=False).train()
    return run_dir, metrics_records(run_dir)


def without_wandb_login(monkeypatch) -> None:
    """No W&B login anywhere it looks, and its in-process settings (an offline run's, earlier) forgotten."""
    import wandb

    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent/netrc")
    monkeypatch.setenv("WANDB_CONFIG_DIR", "/nonexistent/wandb")
    wandb.teardown()


def _logged_losses(records: list[dict]) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in records if "loss" in record}


def test_wandb_offline_and_mlflow_receive_every_scalar_of_metrics_jsonl_and_the_config(tmp_path, monkeypatch):
    import mlflow  # the test extra installs mlflow-skinny and wandb: this test runs the real libraries

    store = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store: mlflow-skinny has no SQL backend
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir, records = _train(tmp_path, "wandb,mlflow")
    losses = _logged_losses(records)
    evaluated = [record["eval"]["mlm_loss"] for record in records if "eval" in record]
    assert len(losses) == 3 and len(evaluated) == 2

    client = mlflow.MlflowClient(store)
    (experiment,) = [e for e in client.search_experiments() if e.name == "project"]  # the run folder's parent
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tiny-run"
    history = {metric.step: metric.value for metric in client.get_metric_history(run.info.run_id, "loss")}
    assert history == pytest.approx(losses, rel=1e-6)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "eval/mlm_loss")] == pytest.approx(evaluated)
    assert run.data.params["train.report_to"] == "wandb,mlflow" and run.data.params["model.hidden_size"] == "128"

    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    # W&B keeps no Python reader of its offline log; each history value is stored as its JSON text, in the clear
    stored = log.read_bytes()
    for value in [*losses.values(), *evaluated]:
        assert json.dumps(value).encode() in stored, value
    assert b"eval/mlm_loss" in stored and b"train.report_to" in stored and b"wandb,mlflow" in stored
    assert not (run_dir / "tensorboard").exists()  # named trackers replace the default, not add to it


def test_tensorboard_named_beside_another_tracker_is_written_too(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir, _ = _train(tmp_path, "tensorboard,wandb", steps=2)
    assert any((run_dir / "tensorboard").iterdir()) and any((run_dir / "wandb").glob("offline-run-*"))


def test_none_writes_only_metrics_jsonl(tmp_path):
    run_dir, records = _train(tmp_path, "none", steps=2)
    assert len(_logged_losses(records)) == 2 and not (run_dir / "tensorboard").exists()


def test_a_tracker_whose_library_is_missing_is_refused_in_one_line_before_the_run_folder_exists(tmp_path):
    missing = next(name for name in ("comet_ml", "swanlab", "clearml") if importlib.util.find_spec(name) is None)
    result = subprocess.run(
        _command(tmp_path / "run", 2) + [f"train.report_to=tensorboard,{missing}"], capture_output=True, text=True
    )
    assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"pip install {missing}" in result.stderr and "train.report_to" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "report_to, message",
    [("wandb,tensorbord", "train.report_to='tensorbord' is unknown"), ("none,wandb", "names 'none' beside trackers")],
)
def test_an_unknown_or_contradictory_report_to_is_a_config_error(report_to, message):
    with pytest.raises(UserError, match=message):
        load_config("tiny", [f"train.report_to={report_to}"])


def test_where_a_run_reports_is_not_part_of_its_identity():
    """Adding a tracker to an interrupted run resumes it in its own default folder."""
    plain, tracked = (load_config("tiny", [f"train.report_to={names}"]) for names in ("tensorboard", "mlflow,wandb"))
    assert config_hash(plain) == config_hash(tracked) != config_hash(load_config("tiny", ["train.seed=1"]))


def test_a_tracker_that_cannot_start_is_one_line_naming_it_and_the_variable_that_fixes_it(tmp_path, monkeypatch):
    """W&B with no login: before, accelerate's tracker raised AttributeError over this line as the run closed."""
    without_wandb_login(monkeypatch)
    with pytest.raises(UserError, match="train.report_to: wandb did not start") as refused:
        _train(tmp_path, "wandb", steps=2)
    assert "\n" not in str(refused.value) and "WANDB_MODE=offline" in str(refused.value)


@pytest.mark.parametrize("allowed", ["false", None])
def test_an_mlflow_store_the_extra_cannot_write_is_refused_before_training(tmp_path, monkeypatch, allowed):
    """mlflow-skinny refused its default store with "Model registry functionality is unavailable", and a file store
    with advice to migrate to the SQL store it lacks."""
    from mlmlab.train import trackers

    monkeypatch.setattr(trackers, "sql_store_installed", lambda: False)  # the [mlflow] extra: mlflow-skinny
    if allowed is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", allowed)
    with pytest.raises(UserError, match="cannot write; set MLFLOW_TRACKING_URI to a server") as refused:
        _train(tmp_path, "mlflow", steps=2)
    assert "MLFLOW_ALLOW_FILE_STORE=true" in str(refused.value)
    assert not (tmp_path / "project").exists()  # refused before the run folder was made


def test_the_tracker_names_are_accelerates():
    from accelerate.utils import LoggerType

    assert set(choices.ACCELERATE_TRACKERS) == {t.value for t in LoggerType} - {"all", choices.TENSORBOARD}


@pytest.mark.parametrize("wandb_dir", ["", "elsewhere"], ids=["WANDB_DIR unset", "WANDB_DIR set"])
def test_wandb_writes_where_wandb_dir_says_else_in_the_run_folder(tmp_path, monkeypatch, wandb_dir):
    """wandb.init gets dir=<run folder> only where the user's WANDB_DIR is unset (no network: wandb.init is a
    stand-in that records what it is given)."""
    from unittest import mock

    import wandb
    from accelerate import Accelerator

    from mlmlab.config import Config
    from mlmlab.train.trackers import finish_trackers, start_trackers

    if wandb_dir:
        monkeypatch.setenv("WANDB_DIR", str(tmp_path / wandb_dir))
    else:
        monkeypatch.delenv("WANDB_DIR", raising=False)
    init = mock.MagicMock()
    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(wandb, "config", mock.MagicMock())
    accelerator = Accelerator(log_with="wandb", cpu=True)
    start_trackers(accelerator, tmp_path / "project" / "run", Config())
    finish_trackers(accelerator)
    (call,) = init.call_args_list
    assert call.kwargs["project"] == "project" and call.kwargs["name"] == "run"
    if wandb_dir:
        assert "dir" not in call.kwargs  # W&B reads WANDB_DIR itself
    else:
        assert call.kwargs["dir"] == str((tmp_path / "project" / "run").resolve())
