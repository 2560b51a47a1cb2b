"""Read pretraining corpora as a stream of documents, each a list of sentences.

A corpus is a list of sources: files, or folders (the corpus files under them, recursively,
in sorted order: ``_folder_files``). Three text formats are understood, each optionally
gzip-compressed (detected by magic bytes):

- plain text as google-research/bert expects it: one sentence or paragraph per line,
  a blank line between documents;
- WikiExtractor output: ``<doc ...>`` ... ``</doc>`` blocks whose first body line is the
  article title (dropped); title-only blocks (about 62% of enwiki) are skipped;
- JSONL: one JSON object per line with a ``text`` field (``Columns.text``), paragraphs
  separated by newlines.

Tables go through HuggingFace ``datasets`` (``records.py``): ``.parquet`` and ``.arrow``
files, and folders written by ``Dataset.save_to_disk``. In JSONL and tables, one record is
one document, unless ``Columns.doc_id`` names a column: consecutive records with the same
value there are then the paragraphs of one document.

A file's format is read from its content, never its name: gzip by magic bytes; WikiExtractor
and JSONL from its first non-blank lines (``_SNIFF_LINES``); archives and other compressions
(zip, tar, tar.gz, 7z, bzip2, xz, zstd) are refused, and so is a folder `mlmlab prepare`
wrote (data/resolve.py trains on one given as the whole corpus).

Documents stream one at a time so memory does not grow with corpus size.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import chain
from pathlib import Path
from typing import BinaryIO

from mlmlab.data.records import (
    Columns,
    clean_paragraph,
    is_saved_dataset,
    is_table,
    record_documents,
    table_fields,
    table_records,
)
from mlmlab.errors import UserError

GZIP_MAGIC = b"\x1f\x8b"

# Why a regex and not nltk/spaCy: those need model downloads (machines here are offline),
# are 10-100x slower, and NSP only needs roughly right segment boundaries (BERT itself
# takes pre-split text and tolerates paragraph-sized segments).
_ABBREVIATIONS = frozenset(
    """
    mr mrs ms dr prof sr jr st mt ft gen gov sen rep col lt sgt capt cmdr adm rev hon
    vs etc al eg ie cf approx ca inc ltd co corp bros dept univ assn est fig figs vol
    vols no nos op pp jan feb mar apr jun jul aug sep sept oct nov dec
    """.split()
)
# A sentence ends at . ! or ? (plus closing quotes/brackets), then whitespace, then
# something that can start a sentence.
_BOUNDARY = re.compile(r"""[.!?]["'”’)\]]*\s+(?=["'“‘(\[]?[A-Z0-9])""")
_LAST_WORD = re.compile(r"([A-Za-z][A-Za-z.]*)\.$")


def split_sentences(paragraph: str) -> list[str]:
    """Split one paragraph into sentences, keeping common abbreviations and initials intact."""
    sentences = []
    start = 0
    for boundary in _BOUNDARY.finditer(paragraph):
        # Only the sentence's last few characters are read: slicing it from its start would copy
        # the whole run so far at each boundary, quadratic in runs of abbreviations ("Dr. Smith Dr. ...").
        tail = paragraph[max(start, boundary.start() + 1 - _TAIL) : boundary.start() + 1]
        if _ends_with_abbreviation(tail):
            continue
        sentences.append(paragraph[start : boundary.end()].strip())
        start = boundary.end()
    sentences.append(paragraph[start:].strip())
    return [s for s in sentences if s]


_TAIL = 40  # characters before a boundary that decide whether it ends an abbreviation


def _ends_with_abbreviation(tail: str) -> bool:
    match = _LAST_WORD.search(tail)
    if match is None:
        return False
    word = match.group(1)
    # Single letters are initials ("J. R. R. Tolkien"); inner dots mean "U.S." / "e.g.".
    return len(word) == 1 or "." in word or word.lower() in _ABBREVIATIONS


def read_documents(paths: str | Path | Iterable[str | Path], columns: Columns = Columns()) -> Iterator[list[str]]:
    """Yield every document with text, in corpus order, as a list of sentences."""
    for paragraphs in read_paragraph_documents(paths, columns):
        yield document_sentences(paragraphs)


def document_sentences(paragraphs: list[str]) -> list[str]:
    """Split a document's paragraphs into its list of sentences."""
    return [sentence for paragraph in paragraphs for sentence in split_sentences(paragraph)]


def read_paragraph_documents(
    paths: str | Path | Iterable[str | Path], columns: Columns = Columns()
) -> Iterator[list[str]]:
    """Yield every document with text as a list of paragraphs (HTML entities unescaped).

    Sentence splitting is left to the caller so that `prepare` can do it in worker
    processes; raises UserError at the end when no file held any document.
    """
    paths = resolve_paths(paths)
    found = False
    for path in paths:
        for document in _read_source(path, columns):
            found = True
            yield document
    if not found:
        raise UserError(
            f"corpus {named_files(paths)} holds no document with text; give files with a blank line between documents, "
            f"<doc> blocks, or JSONL / tables with a {columns.text!r} field (--text-column, data.text_column)"
        )


def named_files(paths: list[Path], shown: int = 3) -> str:
    """ "a.txt", or "5 files: a.txt, b.txt, c.txt and 2 more": what a corpus read, in a line."""
    names = ", ".join(str(p) for p in paths[:shown]) + (f" and {len(paths) - shown} more" if len(paths) > shown else "")
    return names if len(paths) == 1 else f"{len(paths)} files: {names}"


def resolve_paths(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """One path or many as the list of sources they name: folders expanded, saved datasets kept whole."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    given = [Path(p) for p in paths]
    if not given:
        raise UserError("no corpus files given; pass at least one text, <doc> or JSONL file, a folder or a dataset")
    resolved = []
    for path in given:
        if path.is_dir():
            _refuse_prepared(path)
            files = [path] if is_saved_dataset(path) else _folder_files(path)
            if not files:
                raise UserError(
                    f"corpus folder {path} holds no corpus files (.txt .text .tokens .raw .jsonl, none, .gz, "
                    ".parquet, .arrow); give a folder of text files or name the files themselves"
                )
            resolved += files
        elif path.is_file():
            resolved.append(path)
        else:
            raise UserError(f"corpus file {path} does not exist; check the path")
    return resolved


# Inside a folder, the files read as corpus: text (.txt .text .tokens .raw, JSONL, and no suffix, as WikiExtractor's
# wiki_00), each optionally .gz, and tables. Anything else is taken for documentation or metadata (a SOURCE.md,
# a dataset's .json) and skipped, and so are README / LICENSE-like names. Files named one by one are always read.
_TEXT_SUFFIXES = ("", ".txt", ".text", ".tokens", ".raw", ".jsonl")
_NOT_CORPUS = ("readme", "license", "licence", "copying", "notice", "authors")


def _folder_files(folder: Path) -> list[Path]:
    """The corpus files under ``folder``, recursively, sorted by path; hidden names skipped; saved datasets kept
    whole."""
    found = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):  # .git, .DS_Store, editors' swap files: never corpus text
            continue
        if entry.is_dir():
            _refuse_prepared(entry)
            found += [entry] if is_saved_dataset(entry) else _folder_files(entry)
        elif entry.is_file() and _is_corpus_file(entry):
            found.append(entry)
    return found


def is_prepared_dataset(folder: Path) -> bool:
    """A folder written by `mlmlab prepare` (data/store.py): meta.json beside the tokenizer copy.

    Both, so that a corpus folder with a meta.json of its own is still read as text.
    """
    return (folder / "meta.json").is_file() and (folder / "tokenizer").is_dir()


def _refuse_prepared(folder: Path) -> None:
    """Read as text, a prepared folder's tokenizer/vocab.txt trained silently as if it were the corpus."""
    if is_prepared_dataset(folder):
        raise UserError(
            f"{folder} is a dataset `mlmlab prepare` wrote, not corpus text; train on it as the only "
            f"corpus (data.corpus={folder}), evaluate on it (mlmlab evaluate --data {folder}), or give "
            "the text it was prepared from"
        )


def _is_corpus_file(path: Path) -> bool:
    name = path.name.lower()
    suffix = Path(name.removesuffix(".gz")).suffix
    return not name.startswith(_NOT_CORPUS) and (suffix in _TEXT_SUFFIXES or is_table(path))


def refuse_missing_fields(corpus, columns: Columns, text_key: str) -> None:
    """A UserError naming ``text_key`` (or data.id_column) when the first record of the corpus's first file lacks
    that field: checked before any preparing, where a second corpus's record is read only after the first's minutes."""
    path = resolve_paths(corpus)[0]
    fields = _first_record_fields(path)
    for name, key in ((columns.text, text_key), (columns.doc_id, "data.id_column")):
        if fields is not None and name and name not in fields:
            raise UserError(
                f"{path} has no {name!r} field (its fields: {', '.join(map(str, fields)) or 'none'}); "
                f"name the right one with {key}"
            )


def _first_record_fields(path: Path) -> list | None:
    """The fields of the first record of a JSONL file or table; None for text without fields (or no record)."""
    if is_table(path):
        return table_fields(path)
    with _gzip_errors_refused(path), _open_binary(path) as raw:
        kind, lines = _sniffed(raw, path)
        first = next(_jsonl_records(lines, path), None) if kind == _JSONL else None
    return None if first is None else list(first[1])


def _read_source(path: Path, columns: Columns) -> Iterator[list[str]]:
    if is_table(path):
        yield from record_documents(table_records(path, columns), columns, path)
        return
    with _gzip_errors_refused(path):
        yield from _read_documents(path, columns)


@contextmanager
def _gzip_errors_refused(path: Path) -> Iterator[None]:
    try:
        yield
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:  # raised while decompressing, mid-stream
        raise UserError(
            f"{path} is a truncated or corrupt gzip file ({err}); copy or compress it again (`gzip -t` checks a file)"
        ) from None


def _read_documents(path: Path, columns: Columns) -> Iterator[list[str]]:
    with _open_binary(path) as raw:
        kind, lines = _sniffed(raw, path)
        if kind == _WIKIEXTRACTOR:
            yield from _wikiextractor_documents(lines)
        elif kind == _JSONL:
            yield from record_documents(_jsonl_records(lines, path), columns, path)
        elif kind == _PLAIN:
            yield from _plain_documents(lines)


_WIKIEXTRACTOR, _JSONL, _PLAIN = "WikiExtractor", "JSONL", "plain text"


def _sniffed(raw: BinaryIO, path: Path) -> tuple[str | None, Iterator[tuple[int, str]]]:
    """(the format of a text file by its first non-blank lines, None when it has none; every line of it)."""
    _refuse_archive(path)
    head, lines = _peeked(_decoded_lines(raw, path), _SNIFF_LINES)
    texts = [text for _, text in head if text.strip()]
    if not texts:
        return None, lines
    return (_WIKIEXTRACTOR if _is_wikiextractor(texts) else _JSONL if _is_jsonl(texts) else _PLAIN), lines


# A file's format is decided by its first non-blank lines, this many, not by the first alone: a WikiExtractor
# file cut mid-article, or a JSONL file whose first line is damaged, read as plain text before.
_SNIFF_LINES = 100


def _peeked(lines: Iterator[tuple[int, str]], nonblank: int) -> tuple[list, Iterator[tuple[int, str]]]:
    """(the lines up to the ``nonblank``-th non-blank one, every line again from the first)."""
    head, seen = [], 0
    for line in lines:
        head.append(line)
        seen += bool(line[1].strip())
        if seen == nonblank:
            break
    return head, chain(head, lines)


def _is_wikiextractor(texts: list[str]) -> bool:
    """The first line opens a <doc> block (as always), or any sampled line is a <doc ...> or </doc> tag line."""
    return texts[0].lstrip().startswith("<doc") or any(_is_doc_tag(text.strip()) for text in texts)


def _is_doc_tag(stripped: str) -> bool:
    return stripped == "</doc>" or (stripped.startswith("<doc ") and stripped.endswith(">"))


def _is_jsonl(texts: list[str]) -> bool:
    """The first line starts an object (as always: a damaged one is then reported), or half the lines are objects."""
    return texts[0].lstrip().startswith("{") or 2 * sum(map(_is_json_object, texts)) >= len(texts)


def _is_json_object(text: str) -> bool:
    if not text.lstrip().startswith("{"):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _open_binary(path: Path) -> BinaryIO:
    with open(path, "rb") as probe:
        magic = probe.read(2)
    return gzip.open(path, "rb") if magic == GZIP_MAGIC else open(path, "rb")


# Containers and compressions that are not corpus text, by their magic bytes (after gzip's, for a .tar.gz):
# (offset, pattern, what the file is, what to do). Read as text they trained on their bytes, or failed as "not UTF-8".
_EXTRACT = "and give the files it holds (or their folder) as the corpus"
_RECOMPRESS = "or recompress it with gzip, which mlmlab reads"
_FOREIGN = (
    (0, re.compile(rb"PK\x03\x04|PK\x05\x06"), "a zip archive", f"unzip it {_EXTRACT}"),
    (257, re.compile(rb"ustar[\x00 ]"), "a tar archive", f"extract it (tar -xf) {_EXTRACT}"),
    (0, re.compile(rb"7z\xbc\xaf\x27\x1c"), "a 7z archive", f"extract it {_EXTRACT}"),
    (0, re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P\x90)"), "bzip2-compressed", f"decompress it (bunzip2) {_RECOMPRESS}"),
    (0, re.compile(rb"\xfd7zXZ\x00"), "xz-compressed", f"decompress it (unxz) {_RECOMPRESS}"),
    (0, re.compile(rb"\x28\xb5\x2f\xfd"), "zstd-compressed", f"decompress it (unzstd) {_RECOMPRESS}"),
)
_FOREIGN_HEAD = 512  # bytes read to recognise them: tar's magic sits at 257


def _refuse_archive(path: Path) -> None:
    with _open_binary(path) as raw:
        head = raw.read(_FOREIGN_HEAD)
    for offset, pattern, what, remedy in _FOREIGN:
        if pattern.match(head, offset):
            compressed = " (gzip-compressed)" if isinstance(raw, gzip.GzipFile) else ""
            raise UserError(f"{path} is {what}{compressed}, not corpus text; {remedy}")


def _decoded_lines(raw: BinaryIO, path: Path) -> Iterator[tuple[int, str]]:
    """Yield (line number, text without newline); UTF-8 errors name file, line and byte."""
    offset = 0
    for number, line in enumerate(raw, start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            where = "uncompressed byte" if isinstance(raw, gzip.GzipFile) else "byte"
            kind = _undecodable(line, number)
            raise UserError(
                f"{path} {kind} at line {number} ({where} offset {offset + err.start}); {_ENCODING_REMEDY[kind]}"
            ) from None
        offset += len(line)
        if number == 1:  # a byte-order mark (Windows editors write one) would hide a JSONL or <doc> file's format
            text = text.removeprefix("\ufeff")
        yield number, text.rstrip("\r\n")


_UTF16, _BINARY, _OTHER_ENCODING = "is UTF-16 text, not UTF-8", "is binary data, not text", "is not valid UTF-8"
_ENCODING_REMEDY = {
    _UTF16: "re-encode it as UTF-8, e.g. `iconv -f UTF-16 -t UTF-8`",
    _BINARY: "give text files (plain, WikiExtractor <doc>, JSONL; .gz ok) or .parquet / .arrow tables",
    _OTHER_ENCODING: "re-encode it as UTF-8, e.g. `iconv -f latin1 -t utf-8` for Latin-1 text",
}


def _undecodable(line: bytes, number: int) -> str:
    """What a line that is not UTF-8 looks like: UTF-16 (a byte-order mark, or every other byte NUL), binary
    (NUL, or over 5% control bytes), or text in another 8-bit encoding (Latin-1, Windows-1252)."""
    every_other_nul = max(line[0::2].count(0), line[1::2].count(0)) * 2 >= 0.4 * len(line)
    if (number == 1 and line.startswith((b"\xff\xfe", b"\xfe\xff"))) or every_other_nul:
        return _UTF16
    controls = sum(byte < 0x20 and byte not in b"\t\n\r\f" for byte in line)
    return _BINARY if b"\x00" in line or controls * 20 > len(line) else _OTHER_ENCODING


def _plain_documents(lines: Iterator[tuple[int, str]]) -> Iterator[list[str]]:
    document: list[str] = []
    for _, text in lines:
        paragraph = clean_paragraph(text)
        if paragraph:
            document.append(paragraph)
        elif document:
            yield document
            document = []
    if document:
        yield document


def _wikiextractor_documents(lines: Iterator[tuple[int, str]]) -> Iterator[list[str]]:
    body: list[str] | None = None  # None = outside a <doc> block
    for _, text in lines:
        stripped = text.strip()
        if stripped.startswith("<doc") and stripped.endswith(">"):
            body = []
        elif stripped == "</doc>":
            # body[0] is the article title; title-only stubs yield nothing.
            paragraphs = [p for p in (clean_paragraph(line) for line in (body or [])[1:]) if p]
            if paragraphs:
                yield paragraphs
            body = None
        elif body is not None and (stripped or body):
            body.append(text)


def _jsonl_records(lines: Iterator[tuple[int, str]], path: Path) -> Iterator[tuple[str, dict]]:
    """("line N", record) of every non-blank line."""
    for number, text in lines:
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{path} line {number} is not valid JSON ({err.msg}); fix or remove that line") from None
        if not isinstance(record, dict):
            raise UserError(f"{path} line {number} is not a JSON object; every JSONL line needs one")
        yield f"line {number}", record
