"""Reading a study's results.jsonl: one rule for which rows count, for the runner (which runs are
finished) and the report (what is compared) alike. A row the runner writes is one JSON line; a line
cut short by a crash, or one lacking a field every row has, is no row: its run reruns, and the report
says which lines it ignored."""

from pathlib import Path

from mlmlab.utils.jsonio import json_lines

RESULTS_FILE = "results.jsonl"
# Beside results.jsonl: the question, arms, budgets and decision rule, written before the first row and never after
# (every row records its sha256; the runner refuses a row once it changed).
PREREGISTRATION = "preregistration.md"
PREREGISTRATION_SHA256 = "preregistration_sha256"  # the row field that records it (None: the study had none)
# The row field that records what the study file fixed for its rows (arms, budgets, seeds, screen, rule, gates; see
# running/identity.py): rows compared under one rule are one study's only while these stay as the first row's.
STUDY_IDENTITY = "study_identity"
ROW_FIELDS = ("key", "arm", "seed", "eval")  # every row the runner writes has them


def read_rows(results: Path) -> tuple[list[dict], list[int]]:
    """The complete rows in file order (none when the file does not exist), and the numbers of the lines ignored.

    A run has one row: a later row of the same key (the runner's completion of a row that lacked a measurement)
    replaces the earlier one, where the earlier one stood."""
    if not results.is_file():
        return [], []
    rows, ignored = {}, []
    for number, row in json_lines(results.read_text(encoding="utf-8", errors="replace")):
        if is_complete(row):
            rows[row["key"]] = row  # a dict keeps the first position of a key and the last value
        else:
            ignored.append(number)
    return list(rows.values()), ignored


def is_complete(row: dict | None) -> bool:
    """Whether a line is a row the runner wrote whole: every field, an evaluation among them (a hand-edited
    ``eval: null`` is no result to compare)."""
    return row is not None and all(field in row for field in ROW_FIELDS) and isinstance(row["eval"], dict)
