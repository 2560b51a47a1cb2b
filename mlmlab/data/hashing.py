"""What a prepared dataset is named by: a sha256 over the format version, the settings that determine
its content, the corpus files, how they are read, and the tokenizer files."""

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from mlmlab.data.records import Columns
from mlmlab.data.split import DocumentSplit
from mlmlab.data.store import FORMAT_VERSION
from mlmlab.utils.files import file_sha256


@dataclass(frozen=True)
class BuildConfig:
    """Everything that determines the shards' content (all of it goes into the hash)."""

    objective: str
    max_seq_length: int
    short_seq_prob: float
    seed: int
    docs_per_shard: int


def dataset_hash(
    paths: list[Path],
    tokenizer_dir: Path,
    config: BuildConfig,
    columns: Columns = Columns(),
    unk_marker: str = "",
    split: DocumentSplit | None = None,
) -> str:
    """sha256 over format version, config, corpus contents, how it is read (if not the default), the side of a
    held-out split (if any) and tokenizer files.

    A folder given as the corpus hashes as the files in it, in the order they are read: the
    same as naming those files. Default columns, no unk marker and no split add nothing, so the
    hashes of every corpus prepared before any of them could be chosen are unchanged.
    """
    digest = hashlib.sha256(json.dumps({"format": FORMAT_VERSION, **asdict(config)}, sort_keys=True).encode())
    for path in paths:
        digest.update(_source_sha256(path).encode())
    if not columns.is_default:
        digest.update(json.dumps({"columns": asdict(columns)}, sort_keys=True).encode())
    if unk_marker:
        digest.update(json.dumps({"unk_marker": unk_marker}).encode())
    if split is not None:
        digest.update(json.dumps({"split": asdict(split)}, sort_keys=True).encode())
    digest.update(_tokenizer_sha256(tokenizer_dir).encode())
    return digest.hexdigest()


def _source_sha256(path: Path) -> str:
    """A file's sha256; for a saved dataset folder, one over its files' names and contents."""
    if not path.is_dir():
        return file_sha256(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + b"\0" + file_sha256(file).encode())
    return digest.hexdigest()


def _tokenizer_sha256(tokenizer_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in _tokenizer_files(tokenizer_dir):
        digest.update(path.name.encode() + b"\0" + file_sha256(path).encode())
    return digest.hexdigest()


def _tokenizer_files(tokenizer_dir: Path) -> list[Path]:
    return sorted(p for p in tokenizer_dir.iterdir() if p.is_file())
