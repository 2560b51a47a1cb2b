"""Files and folders written so that a reader never sees half of one.

A folder is built under a staging name beside its target (same filesystem) and published
with one rename. Checksums of files name caches and verify checkpoints.
"""

import glob
import hashlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STAGING_PREFIX = ".tmp-"  # a killed writer leaves ".tmp-<target name>-<host>-<pid>-<random>" behind
_BLOCK = 1 << 20


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in blocks (shards and weights can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def staging_folder(target: Path) -> Path:
    """A new, empty folder beside ``target``, unique to this writer; stale ones of dead writers are removed first."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(target)
    return Path(tempfile.mkdtemp(prefix=_writer_prefix(target), dir=target.parent))


_HOST = socket.gethostname().replace("-", "_")  # "-" separates the name's fields


def _staging_prefix(target: Path) -> str:
    return f"{STAGING_PREFIX}{target.name}-"


def _writer_prefix(target: Path) -> str:
    """This process's staging names for ``target``: the host and pid tell remove_stale_staging whose they are."""
    return f"{_staging_prefix(target)}{_HOST}-{os.getpid()}-"


def remove_stale_staging(target: Path) -> None:
    """Delete ``target``'s staging folders whose writer, a process of this host, is dead.

    A live writer's folder (a concurrent prepare) is left alone, and so is one from another
    host sharing the filesystem: its process cannot be checked from here.
    """
    prefix = _staging_prefix(target)
    for folder in target.parent.glob(f"{glob.escape(prefix)}{_HOST}-*"):
        pid = folder.name[len(prefix) + len(_HOST) + 1:].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def publish(staging: Path, target: Path, *, replace: bool = False) -> bool:
    """Rename the finished ``staging`` to ``target`` in one step; False when another writer won.

    ``replace``: an existing ``target`` is deleted first (a checkpoint rewritten at the same
    step). Otherwise a non-empty ``target`` that appears meanwhile was published by a
    concurrent writer of the same content: ``staging`` is discarded and theirs is kept.
    """
    target = Path(target)
    _sync_tree(staging)  # the contents reach the disk before the name does: a crash never leaves a hollow target
    replaced = _move_aside(target) if replace and target.exists() else None
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    try:
        os.rename(staging, target)
    except OSError:
        if replace or not target.is_dir():
            raise
        shutil.rmtree(staging, ignore_errors=True)
        return False
    _sync_folder(target.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return True


def _move_aside(target: Path) -> Path:
    """Rename ``target`` to a staging name (removed as stale if this writer dies) rather than delete it first.

    Deleting first would leave, until the rename, no copy of it under any name the writer's
    successor keeps.
    """
    aside = Path(tempfile.mkdtemp(prefix=f"{_staging_prefix(target)}{_HOST}-{os.getpid()}-", dir=target.parent))
    aside.rmdir()
    os.rename(target, aside)
    return aside


def _sync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then the folders themselves (their entries), deepest first."""
    for path in sorted(Path(folder).rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        elif path.is_dir():
            _sync_folder(path)
    _sync_folder(Path(folder))


def _sync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_text_atomically(target: Path, text: str) -> None:
    """``target`` holds ``text`` after one rename of a staging file beside it: a reader sees the old or the new, never half."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=_writer_prefix(target), dir=target.parent)
    with os.fdopen(handle, "w", encoding="utf-8") as file:
        file.write(text)
    os.replace(staging, target)


@contextmanager
def building(target: Path, *, replace: bool = False) -> Iterator[Path]:
    """``with building(target) as staging:`` fill ``staging``; it becomes ``target`` if the block succeeds."""
    staging = staging_folder(target)
    try:
        yield staging
        publish(staging, target, replace=replace)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
