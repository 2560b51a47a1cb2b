"""GLUE task files: what each task's tsv files hold, and a strict reader for them.

The layout is the `<data_dir>/<TASK>/{train,dev,test}.tsv` folder made by GLUE's
`download_glue_data.py`. Its quirks: CoLA train/dev have no header line, MRPC files
start with a UTF-8 BOM, and quotes are literal characters (no csv quoting), so rows
are split on tabs only. Any row that does not fit raises a UserError naming the file
and line, because a silently skipped or mis-split row would change the scores.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlmlab.errors import UserError

TRAIN_FILE = "train.tsv"


@dataclass(frozen=True)
class GlueTask:
    name: str  # folder name under data_dir, and the task's name in results
    text_columns: tuple[str, ...]  # one sentence, or a pair fed as segments A and B
    label_column: str
    labels: tuple[str, ...] | None  # label strings in class-id order; None = regression on a float
    metrics: tuple[str, ...]  # the task's score is the mean of these (GLUE's rule for multi-metric tasks)
    dev_files: dict[str, str]  # split name -> file; MNLI has a matched and a mismatched dev set
    test_files: dict[str, str]  # test file -> file name in the GLUE submission format
    headerless_columns: tuple[str, ...] | None = None  # names of train/dev columns when those files have no header
    test_index_column: str = "index"  # written back next to each test prediction

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def required_files(self) -> tuple[str, ...]:
        return (TRAIN_FILE, *self.dev_files.values())

    @property
    def metric_names(self) -> tuple[str, ...]:
        """Result keys: one per metric and dev split, e.g. MNLI's accuracy_matched."""
        if len(self.dev_files) == 1:
            return self.metrics
        return tuple(f"{metric}_{split}" for split in self.dev_files for metric in self.metrics)


BINARY = ("0", "1")
ENTAILMENT = ("entailment", "not_entailment")
SINGLE_DEV = {"dev": "dev.tsv"}

TASKS: dict[str, GlueTask] = {
    task.name: task
    for task in (
        GlueTask(
            "CoLA",
            ("sentence",),
            "label",
            BINARY,
            ("mcc",),
            SINGLE_DEV,
            {"test.tsv": "CoLA.tsv"},
            headerless_columns=("source", "label", "original_mark", "sentence"),
        ),
        GlueTask("SST-2", ("sentence",), "label", BINARY, ("accuracy",), SINGLE_DEV, {"test.tsv": "SST-2.tsv"}),
        GlueTask(
            "MRPC",
            ("#1 String", "#2 String"),
            "Quality",
            BINARY,
            ("f1", "accuracy"),
            SINGLE_DEV,
            {"test.tsv": "MRPC.tsv"},
        ),
        GlueTask(
            "STS-B",
            ("sentence1", "sentence2"),
            "score",
            None,
            ("pearson", "spearman"),
            SINGLE_DEV,
            {"test.tsv": "STS-B.tsv"},
        ),
        GlueTask(
            "QQP",
            ("question1", "question2"),
            "is_duplicate",
            BINARY,
            ("f1", "accuracy"),
            SINGLE_DEV,
            {"test.tsv": "QQP.tsv"},
            test_index_column="id",
        ),
        GlueTask(
            "MNLI",
            ("sentence1", "sentence2"),
            "gold_label",
            ("entailment", "neutral", "contradiction"),
            ("accuracy",),
            {"matched": "dev_matched.tsv", "mismatched": "dev_mismatched.tsv"},
            {"test_matched.tsv": "MNLI-m.tsv", "test_mismatched.tsv": "MNLI-mm.tsv"},
        ),
        GlueTask(
            "QNLI", ("question", "sentence"), "label", ENTAILMENT, ("accuracy",), SINGLE_DEV, {"test.tsv": "QNLI.tsv"}
        ),
        GlueTask(
            "RTE", ("sentence1", "sentence2"), "label", ENTAILMENT, ("accuracy",), SINGLE_DEV, {"test.tsv": "RTE.tsv"}
        ),
        GlueTask(
            "WNLI", ("sentence1", "sentence2"), "label", BINARY, ("accuracy",), SINGLE_DEV, {"test.tsv": "WNLI.tsv"}
        ),
    )
}


@dataclass
class GlueSplit:
    path: Path
    texts: tuple[list[str], ...]  # one list per text column, aligned by example
    labels: list[int] | list[float] | None  # class ids or scores; None for an unlabeled test file
    indices: list[str] | None  # the test file's index column, for the submission file

    def __len__(self) -> int:
        return len(self.texts[0])


def missing_files(task: GlueTask, data_dir: Path) -> list[str]:
    """Train/dev files of `task` that are absent, as paths relative to data_dir."""
    return [f"{task.name}/{name}" for name in task.required_files if not (data_dir / task.name / name).is_file()]


def read_labeled(task: GlueTask, path: Path, max_examples: int | None = None) -> GlueSplit:
    """A train or dev file: texts and labels; with max_examples, a fixed random subset of that size."""
    header, rows = read_tsv(path, task.headerless_columns)
    rows = subsample(rows, max_examples)
    text_positions = column_positions(path, header, task.text_columns)
    (label_position,) = column_positions(path, header, (task.label_column,))
    if not rows:
        raise UserError(f"{path}: no examples, only a header; use the task's complete GLUE file")
    labels = [parse_label(task, path, line, fields[label_position]) for line, fields in rows]
    return GlueSplit(path, texts_of(rows, text_positions), labels, indices=None)


def subsample(rows: list, size: int | None, seed: int = 0) -> list:
    """``size`` rows drawn without replacement, kept in file order; all rows if size is None.

    A sample, not the first rows: GLUE files are not shuffled (the head of a file can be one
    source or one label). The seed is fixed, so every fine-tuning seed and every model
    compared sees the same subset.
    """
    if size is None or size >= len(rows):
        return rows
    chosen = np.sort(np.random.default_rng(seed).choice(len(rows), size=size, replace=False))
    return [rows[i] for i in chosen]


def read_unlabeled(task: GlueTask, path: Path) -> GlueSplit:
    """A test file: index and texts, no labels."""
    header, rows = read_tsv(path, column_names=None)  # test files have a header in every task
    text_positions = column_positions(path, header, task.text_columns)
    (index_position,) = column_positions(path, header, (task.test_index_column,))
    indices = [fields[index_position] for _, fields in rows]
    return GlueSplit(path, texts_of(rows, text_positions), labels=None, indices=indices)


def read_tsv(path: Path, column_names: tuple[str, ...] | None) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """Header and (1-based line number, fields) rows; the header is the first line unless column_names is given.

    Quotes are literal text (csv.QUOTE_NONE behaviour): fields are split on tabs only.
    utf-8-sig drops MRPC's BOM; newline="\\n" keeps a stray carriage return inside a
    sentence from splitting the line. Blank lines (a trailing empty line) are skipped.
    """
    lines = [(number, text.rstrip("\r\n")) for number, text in enumerate(_decoded_lines(path), start=1)]
    lines = [(number, text) for number, text in lines if text]
    if column_names is None:
        if not lines:
            raise UserError(f"{path}: file is empty; expected a header line with tab-separated column names")
        header = lines.pop(0)[1].split("\t")
    else:
        header = list(column_names)
    rows = [(number, text.split("\t")) for number, text in lines]
    for number, fields in rows:
        if len(fields) != len(header):
            raise UserError(
                f"{path}:{number}: expected {len(header)} tab-separated fields ({', '.join(header)}), "
                f"found {len(fields)}; fix or remove this line"
            )
    return header, rows


def _decoded_lines(path: Path) -> list[str]:
    """The file's lines as text; a byte that is not UTF-8 is a UserError naming the line."""
    with open(path, "rb") as file:
        raw = file.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not valid UTF-8; re-encode the file as UTF-8 (GLUE's files are)") from None
    return text.split("\n")  # a trailing newline gives a last blank line, skipped like every blank line


def column_positions(path: Path, header: list[str], wanted: tuple[str, ...]) -> list[int]:
    absent = [name for name in wanted if name not in header]
    if absent:
        raise UserError(
            f"{path}: missing column(s) {', '.join(absent)}; the header has {', '.join(header)}, "
            f"expected a GLUE file with columns {', '.join(wanted)}"
        )
    return [header.index(name) for name in wanted]


def texts_of(rows: list[tuple[int, list[str]]], positions: list[int]) -> tuple[list[str], ...]:
    return tuple([fields[position] for _, fields in rows] for position in positions)


def parse_label(task: GlueTask, path: Path, line: int, value: str) -> int | float:
    if task.is_regression:
        try:
            return float(value)
        except ValueError:
            raise UserError(
                f"{path}:{line}: {task.label_column} {value!r} is not a number; expected a float score"
            ) from None
    if value not in task.labels:
        raise UserError(
            f"{path}:{line}: {task.label_column} {value!r} is not a {task.name} label; "
            f"expected one of {', '.join(task.labels)}"
        )
    return task.labels.index(value)
