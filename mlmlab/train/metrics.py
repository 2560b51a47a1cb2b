"""The run's metrics: one JSON line per record in metrics.jsonl, the same numbers in TensorBoard.

Only the main process writes; the others hold a writer that does nothing, so callers
need not ask which process they are.
"""

import json
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from mlmlab import jsonio

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.enabled = enabled
        self._tensorboard = None  # opened on the first record

    def drop_after(self, step: int) -> None:
        """Forget records of steps after ``step``: a resumed run redoes them; so is a line cut short by a kill."""
        if self.enabled and self.path.exists():
            records = [(line, _record(line)) for line in self.path.read_text().splitlines()]
            kept = [line for line, record in records if record is not None and record.get("step", step + 1) <= step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(jsonio.dumps(record) + "\n")
        if self._tensorboard is None:
            self._tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))
        for name, value in _flat_scalars(record):
            self._tensorboard.add_scalar(name, value, record["step"])
        self._tensorboard.flush()


def _record(line: str) -> dict | None:
    """A metrics line as a dict; None for a partial line (the process was killed while writing it)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _flat_scalars(record: dict, prefix: str = ""):
    """(name, value) for every number in a (nested) metrics record, except the step itself."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from _flat_scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            yield prefix + key, value
