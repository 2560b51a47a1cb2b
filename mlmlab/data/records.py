"""Record-based corpora: JSONL lines and HuggingFace ``datasets`` tables, as documents of paragraphs.

A record's text field holds a document (paragraphs separated by newlines), unless a
document-id field is named: consecutive records sharing its value are then the paragraphs
of one document (a table of paragraphs or sentences with a ``doc_id`` column). Records of
one document must be consecutive; the same id further on starts a new document.

Tables are read through ``datasets``, streaming: ``.parquet`` and ``.arrow`` files with
``load_dataset(..., streaming=True)`` (the call a hub name would take too; the hub is not
used here), folders written by ``Dataset.save_to_disk`` with ``load_from_disk``, which
memory-maps them. Either way RAM does not grow with the corpus. ``datasets`` is imported
only when a table is read: it takes seconds, and text corpora do not need it.
"""

from __future__ import annotations

import html
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mlmlab.errors import UserError

TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}  # suffix -> datasets' packaged builder
_BATCH_ROWS = 1000  # rows read from a table at once: bounded memory, few Python calls


@dataclass(frozen=True)
class Columns:
    """Which fields of a record hold its text and, optionally, the id of its document."""

    text: str = "text"
    doc_id: str = ""  # empty: every record is a document of its own

    @property
    def is_default(self) -> bool:
        """Only other columns change what a corpus reads as: the prepared data's hash names them then."""
        return self == Columns()


def clean_paragraph(text: str) -> str:
    """A paragraph as every reader keeps it: HTML entities unescaped, outer whitespace stripped."""
    return html.unescape(text).strip()


def is_saved_dataset(folder: Path) -> bool:
    """A folder written by ``save_to_disk``: a Dataset (state.json) or a DatasetDict (dataset_dict.json)."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def is_table(path: Path) -> bool:
    return path.is_dir() or path.suffix.lower() in TABLE_SUFFIXES


def record_documents(records: Iterator[tuple[str, dict]], columns: Columns, source: Path) -> Iterator[list[str]]:
    """Documents (lists of paragraphs) from (where, record) pairs; empty documents are skipped."""
    document: list[str] = []
    current = None
    for where, record in records:
        paragraphs = [
            p for p in (clean_paragraph(line) for line in _text(record, columns, source, where).split("\n")) if p
        ]
        key = _doc_id(record, columns, source, where) if columns.doc_id else None
        if document and (key is None or key != current):
            yield document
            document = []
        current = key
        document += paragraphs
    if document:
        yield document


def _text(record: dict, columns: Columns, source: Path, where: str) -> str:
    text = record.get(columns.text)
    if not isinstance(text, str):
        fields = ", ".join(map(str, record)) or "none"
        raise UserError(
            f"{source} {where} has no string {columns.text!r} field (its fields: {fields}); every record "
            "needs one: name the text field with --text-column / data.text_column"
        )
    return text


def _doc_id(record: dict, columns: Columns, source: Path, where: str):
    if columns.doc_id not in record:
        fields = ", ".join(map(str, record)) or "none"
        raise UserError(
            f"{source} {where} has no {columns.doc_id!r} field for the document id (its fields: {fields}); "
            "name the right one with --id-column / data.id_column, or leave it empty"
        )
    return record[columns.doc_id]


def table_records(path: Path, columns: Columns) -> Iterator[tuple[str, dict]]:
    """("row N", {column: value}) of a table, only the columns asked for, streamed."""
    table = _open_table(path)
    wanted = [name for name in (columns.text, columns.doc_id) if name]
    missing = [name for name in wanted if table.column_names is not None and name not in table.column_names]
    if missing:
        which = "--text-column / data.text_column" if missing[0] == columns.text else "--id-column / data.id_column"
        raise UserError(
            f"{path} has no column {missing[0]!r} (its columns: {', '.join(table.column_names)}); "
            f"name the right one with {which}"
        )
    row = 0
    for batch in table.select_columns(wanted).iter(batch_size=_BATCH_ROWS):
        for values in zip(*(batch[name] for name in wanted)):
            row += 1
            yield f"row {row}", dict(zip(wanted, values))


def table_fields(path: Path) -> list:
    """A table's column names (its first row's, where a streamed file does not name them before reading)."""
    table = _open_table(path)
    return list(table.column_names or next(iter(table), {}))


def _open_table(path: Path):
    """A datasets Dataset (memory-mapped) or IterableDataset (streaming) over the table at ``path``."""
    import datasets

    datasets.disable_progress_bars()  # one bar per file would bury prepare's own report
    verbosity = datasets.logging.get_verbosity()
    # datasets logs a failure before raising it; the UserError below already says it, in one line.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        if path.is_dir():
            table = datasets.load_from_disk(str(path))
        else:
            table = datasets.load_dataset(
                TABLE_SUFFIXES[path.suffix.lower()], data_files=[str(path)], split="train", streaming=True
            )
    except Exception as err:  # datasets and pyarrow raise many types for foreign or corrupt files
        raise UserError(
            f"cannot read {path} as a dataset ({type(err).__name__}: {_first_line(err)}); "
            "give a .parquet or .arrow file, or a folder written by Dataset.save_to_disk"
        ) from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if isinstance(table, datasets.DatasetDict):
        raise UserError(
            f"{path} holds a DatasetDict with splits {', '.join(table)}; give one split's folder, "
            f"e.g. {path / next(iter(table))}"
        )
    return table


def _first_line(err: Exception) -> str:
    return (str(err).splitlines() or [""])[0]
