"""Files and folders written so that a reader never sees half of one.

A folder is built under a staging name beside its target (same filesystem) and published
with one rename. Checksums of files name caches and verify checkpoints.
"""

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STAGING_PREFIX = ".tmp-"  # a killed writer leaves ".tmp-<target name>-<random>" behind
_BLOCK = 1 << 20


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in blocks (shards and weights can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def staging_folder(target: Path) -> Path:
    """A new, empty folder beside ``target``, unique to this writer."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{target.name}-", dir=target.parent))


def publish(staging: Path, target: Path, *, replace: bool = False) -> bool:
    """Rename the finished ``staging`` to ``target`` in one step; False when another writer won.

    ``replace``: an existing ``target`` is deleted first (a checkpoint rewritten at the same
    step). Otherwise a non-empty ``target`` that appears meanwhile was published by a
    concurrent writer of the same content: ``staging`` is discarded and theirs is kept.
    """
    target = Path(target)
    if replace and target.exists():
        shutil.rmtree(target)
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    try:
        os.rename(staging, target)
    except OSError:
        if replace or not target.is_dir():
            raise
        shutil.rmtree(staging, ignore_errors=True)
        return False
    return True


@contextmanager
def building(target: Path, *, replace: bool = False) -> Iterator[Path]:
    """``with building(target) as staging:`` fill ``staging``; it becomes ``target`` if the block succeeds."""
    staging = staging_folder(target)
    try:
        yield staging
        publish(staging, target, replace=replace)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
