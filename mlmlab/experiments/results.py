"""Reading a study's results.jsonl: one rule for which rows count, for the runner (which runs are
finished) and the report (what is compared) alike. A row the runner writes is one JSON line; a line
cut short by a crash, or one lacking a field every row has, is no row: its run reruns, and the report
says which lines it ignored."""

import json
from pathlib import Path

RESULTS_FILE = "results.jsonl"
ROW_FIELDS = ("key", "arm", "seed", "eval")  # every row the runner writes has them


def read_rows(results: Path) -> tuple[list[dict], list[int]]:
    """The complete rows in file order (none when the file does not exist), and the numbers of the lines ignored."""
    if not results.is_file():
        return [], []
    rows, ignored = [], []
    for number, line in enumerate(results.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and all(field in row for field in ROW_FIELDS):
            rows.append(row)
        else:
            ignored.append(number)
    return rows, ignored
