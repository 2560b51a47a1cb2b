"""The run's metrics: one JSON line per record in metrics.jsonl, the same numbers in TensorBoard.

Only the main process writes; the others hold a writer that does nothing, so callers
need not ask which process they are. Whoever reads the file (a resume, export, a study's
dry run and report) reads it through metrics_lines.
"""

from collections.abc import Callable
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from mlmlab.errors import UserError
from mlmlab.train.mfu import MeasuredPeak, rates
from mlmlab.train.run_state import TrainerState
from mlmlab.utils import jsonio
from mlmlab.utils.files import write_text_atomically

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True, trackers: Callable | None = None):
        """A run's metrics; a metrics.jsonl already there is checked at once, before a resume's slow set-up.

        ``trackers``: called with each record's scalars and its step (accelerate's ``Accelerator.log``).
        """
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.enabled = enabled
        self._with_tensorboard, self._trackers = tensorboard, trackers
        self._tensorboard = None  # opened on the first record
        _refuse_damage(self.path, self._lines()[:-1])

    def drop_after(self, step: int, evaluation_too: bool = False) -> None:
        """Forget records of steps after ``step``, which a resumed run redoes, and a last line cut short by a kill.

        ``evaluation_too``: also the evaluation at ``step`` itself (a finished run, rerun, evaluates
        again: its final evaluation is replaced rather than repeated). Rewritten in one rename, so a
        kill meanwhile leaves the file as it was.
        """
        lines = self._lines()
        if lines:  # jsonio.dumps wrote each line, so dumping the record read back gives the same line
            kept = [record for _, record in lines if record is not None and _kept(record, step, evaluation_too)]
            write_text_atomically(self.path, "".join(jsonio.dumps(record) + "\n" for record in kept))

    def _lines(self) -> list[tuple[int, dict | None]]:
        """metrics_lines of the file this process writes; none for another process."""
        return metrics_lines(self.run_dir) if self.enabled else []

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(jsonio.dumps(record) + "\n")
        scalars = dict(_flat_scalars(record))
        if self._with_tensorboard:
            self._write_tensorboard(scalars, record["step"])
        if self._trackers is not None:
            self._trackers(scalars, step=record["step"])

    def _write_tensorboard(self, scalars: dict, step: int) -> None:
        if self._tensorboard is None:
            self._tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))
        for name, value in scalars.items():
            self._tensorboard.add_scalar(name, value, step)
        self._tensorboard.flush()


def _kept(record: dict, step: int, evaluation_too: bool) -> bool:
    recorded = record.get("step", step + 1)
    return recorded < step or (recorded == step and not (evaluation_too and "eval" in record))


def metrics_lines(run_dir: Path) -> list[tuple[int, dict | None]]:
    """(line number, record) of every line of a run's metrics.jsonl, the record None where the line holds none (cut
    short by a kill, or damaged since); an empty list before the run's first record."""
    path = Path(run_dir) / METRICS_FILE
    return jsonio.json_lines(path.read_text(encoding="utf-8", errors="replace")) if path.is_file() else []


def metrics_records(run_dir: Path) -> list[dict]:
    """A run's logged records in order; lines that hold none are left out."""
    return [record for _, record in metrics_lines(run_dir) if record is not None]


def _refuse_damage(path: Path, lines: list[tuple[int, dict | None]]) -> None:
    """A kill mid-write damages only the last line; any other was damaged since, and is not ours to drop unseen."""
    damaged = [number for number, record in lines if record is None]
    if damaged:
        raise UserError(
            f"{path}: line {damaged[0]} is not a metrics record (damaged after it was written); repair or "
            "delete that line, then run the command again"
        )


def _flat_scalars(record: dict, prefix: str = ""):
    """(name, value) for every number in a (nested) metrics record, except the step itself."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from _flat_scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            yield prefix + key, value


def run_summary(state: TrainerState, peak: MeasuredPeak, accelerator, final_eval: dict, run_dir: Path) -> dict:
    """What a finished run returns and writes to summary.json; MFU is of ``peak_flops``, the peak it was read
    against."""
    speed = rates(state.tokens, state.flops, state.seconds, peak.covering(state.flops / max(state.seconds, 1e-9)))
    return {
        "steps": state.step,
        "tokens_seen": state.tokens,
        "train_seconds": state.seconds,
        "wall_seconds": state.elapsed,
        **speed,
        "peak_flops": peak.flops,
        "eval": final_eval,
        "distributed": accelerator.distributed_type.value,
        "processes": accelerator.num_processes,
        "run_dir": str(run_dir),
    }
