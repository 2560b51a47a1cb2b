"""train.report_to: where a run's metrics go besides metrics.jsonl.

"tensorboard" is mlmlab's own writer (metrics.py: one folder per run, flushed at every record). Every other name is
one of accelerate's trackers (W&B, MLflow, trackio, Aim, Comet, DVCLive, SwanLab, ClearML): accelerate starts it and
is fed the same scalars as metrics.jsonl, under the same names, plus the resolved config. The tracker libraries are
extras, imported only when named; where each writes is the library's own setting (WANDB_MODE=offline, WANDB_DIR,
MLFLOW_TRACKING_URI, ...), documented in docs/running.md; W&B's folder is the run folder only where WANDB_DIR is unset.
"""

import importlib.util
import os
from pathlib import Path
from urllib.parse import urlparse

from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType

from mlmlab import choices
from mlmlab.config import Config, flat_keys, report_targets, to_dict
from mlmlab.errors import UserError

# trackers with a pip extra of their own name (pyproject.toml); the rest are installed by their own name
EXTRAS = ("wandb", "mlflow")
# What makes a tracker start, said when it does not: the library's own variables (docs/running.md)
STARTS_WITH = {
    "wandb": "set WANDB_MODE=offline (a local run, no login; `wandb sync` uploads it) or WANDB_API_KEY",
    "mlflow": "set MLFLOW_TRACKING_URI to a server (http://host:5000)",
}
# The [mlflow] extra is mlflow-skinny, which has no SQL store: mlflow's default (sqlite:///mlflow.db) refuses with
# "Model registry functionality is unavailable", and a file store refuses unless MLFLOW_ALLOW_FILE_STORE=true
# (mlflow-skinny 3.18) with advice to migrate to the SQL store it lacks.
MLFLOW_SKINNY_STORE = (
    "set MLFLOW_TRACKING_URI to a server (http://host:5000), or to a folder (file:./mlruns) with "
    "MLFLOW_ALLOW_FILE_STORE=true; or pip install mlflow, whose SQL store is the default"
)


def accelerate_trackers(report_to: str) -> list[str]:
    """The names accelerate starts (all but TensorBoard and none); each library checked before training starts."""
    names = [name for name in report_targets(report_to) if name in choices.ACCELERATE_TRACKERS]
    for name in names:
        _refuse_missing_library(name)
    if "mlflow" in names:
        _refuse_a_store_mlflow_skinny_lacks()
    return names


def sql_store_installed() -> bool:
    """Whether MLflow's SQL stores can work: the full mlflow installs SQLAlchemy, mlflow-skinny does not."""
    return importlib.util.find_spec("sqlalchemy") is not None


def _refuse_a_store_mlflow_skinny_lacks() -> None:
    """Before training: an MLflow store that mlflow-skinny cannot write (MLFLOW_SKINNY_STORE's comment)."""
    if sql_store_installed():
        return
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    scheme = urlparse(uri).scheme if uri else "sqlite"  # mlflow's default store
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1")
    if scheme in ("sqlite", "postgresql", "mysql", "mssql") or (scheme in ("", "file") and not allowed):
        store = uri or "its default, sqlite:///mlflow.db"
        raise UserError(
            f"train.report_to names mlflow, and MLflow's store ({store}) is one the [mlflow] extra (mlflow-skinny) "
            f"cannot write; {MLFLOW_SKINNY_STORE}"
        )


def _refuse_missing_library(name: str) -> None:
    if LoggerType(name) not in get_available_trackers():
        install = f'pip install -e ".[{name}]"' if name in EXTRAS else f"pip install {name}"
        raise UserError(
            f"train.report_to names {name}, but its library is not installed; run {install}, "
            f"or leave {name} out of train.report_to"
        )


def start_trackers(accelerator, run_dir: Path, cfg: Config) -> None:
    """Start the accelerate trackers of ``accelerator`` (main process only; none named: nothing happens).

    The project is the run folder's parent folder and the run its folder, as the user sees them on disk (a study's
    run: the arm, and seed<N>). A resumed run starts a new tracker run of the same name from the step it resumed at:
    trackers cannot forget the steps the resume redoes, as metrics.jsonl does.
    """
    if not accelerator.log_with:
        return
    run_dir = Path(run_dir).resolve()
    init_kwargs = {
        "wandb": {"name": run_dir.name, **wandb_folder(run_dir)},
        "mlflow": {"run_name": run_dir.name},
        "trackio": {"name": run_dir.name},
    }
    # one level of scalars, which every tracker stores (MLflow's params are flat strings); a mixture as its text
    config = {key: value if _scalar(value) else str(value) for key, value in flat_keys(to_dict(cfg)).items()}
    try:
        accelerator.init_trackers(run_dir.parent.name, config=config, init_kwargs=init_kwargs)
    except Exception as err:  # each library raises its own types; its own words say what went wrong
        # None of them is finished by close(): one that never started has no run to finish (accelerate's W&B
        # tracker then raised AttributeError over this line), and one that did is closed by its library at exit.
        accelerator.trackers.clear()
        names = [str(name) for name in accelerator.log_with]
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        fixes = [STARTS_WITH[name] for name in names if name in STARTS_WITH] or ["fix its settings"]
        raise UserError(
            f"train.report_to: {', '.join(names)} did not start ({reason}); {'; '.join(fixes)}, or leave it out of "
            "train.report_to"
        ) from err


def wandb_folder(run_dir: Path) -> dict:
    """W&B's ``dir``: the run folder, unless the user's WANDB_DIR says where W&B writes (its own setting wins)."""
    return {} if os.environ.get("WANDB_DIR") else {"dir": str(run_dir)}


def _scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def finish_trackers(accelerator) -> None:
    """Close each tracker's run (W&B's written out). Not accelerate's end_training: it also destroys the process
    group, which a study's next run in this process, or a DDP test's next trainer, still needs."""
    for tracker in accelerator.trackers:
        tracker.finish()
    accelerator.trackers.clear()
