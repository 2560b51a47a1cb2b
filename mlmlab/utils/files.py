"""Files and folders written so that a reader never sees half of one, by one writer at a time.

A folder is built under a staging name beside its target (same filesystem) and published
with one rename. Checksums of files name caches and verify checkpoints. What a command
keeps writing to (a run folder, GLUE's --out, a study's results) is locked for it alone.
"""

import fcntl
import glob
import hashlib
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from mlmlab.errors import UserError
from mlmlab.utils.jsonio import object_or_none

LOCK_FILE = ".lock"  # a folder's WriterLock
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
    """Delete ``target``'s staging folders and files whose writer, a process of this host, is dead.

    A live writer's (a concurrent prepare) is left alone, and so is one from another host
    sharing the filesystem: its process cannot be checked from here.
    """
    remove_stale_staging_like(target.parent, glob.escape(target.name))


def remove_stale_staging_like(folder: Path, names: str) -> None:
    """``remove_stale_staging`` for every target in ``folder`` whose name matches the glob ``names`` ("ckpt-*")."""
    for staged in Path(folder).glob(f"{glob.escape(STAGING_PREFIX)}{names}-{glob.escape(_HOST)}-*"):
        pid = staged.name.rsplit("-", 2)[1]  # ".tmp-<name>-<host>-<pid>-<random>"; the random part has no "-"
        if not pid.isdigit() or _alive(int(pid)):
            continue
        if staged.is_dir():
            shutil.rmtree(staged, ignore_errors=True)
        else:  # write_text_atomically's
            staged.unlink(missing_ok=True)


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
        if replaced is not None:  # the old one goes back under its name: a failed publish leaves it as it was
            os.rename(replaced, target)
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


def require_output(path: Path, option: str, *, folder: bool) -> None:
    """Refuse now, not after the work, an output path (``option``'s) that cannot be written: a file where a folder
    goes or a folder where a file goes, or a path under a file. Missing folders are created by the writer."""
    path = Path(path)
    wanted, other = ("a folder", "file") if folder else ("a file", "folder")
    if path.exists() and path.is_dir() != folder:
        raise UserError(f"{option} {path} is a {other}; give {wanted}")
    existing = next(parent for parent in path.parents if parent.exists())
    if not existing.is_dir():
        raise UserError(f"{option} {path} cannot be created: {existing} is a file; give another path")


def write_text_atomically(target: Path, text: str) -> None:
    """``target`` holds ``text`` after one rename of a staging file beside it: a reader sees the old or the new,
    never half."""
    with replacing(target, text):
        pass


@contextmanager
def replacing(target: Path, text: str) -> Iterator[None]:
    """``text`` is written beside ``target`` first, then the block runs, then ``target`` is replaced by it.

    What the block records about the new ``target`` (a history line) is then written only once the
    text is on disk: a full disk or a read-only folder stops both before either is written.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(target)
    handle, staging = tempfile.mkstemp(prefix=_writer_prefix(target), dir=target.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())  # the text reaches the disk before the name does
        yield
        os.replace(staging, target)
        _sync_folder(target.parent)
    finally:
        Path(staging).unlink(missing_ok=True)


@contextmanager
def building(target: Path, *, replace: bool = False) -> Iterator[Path]:
    """``with building(target) as staging:`` fill ``staging``; it becomes ``target`` if the block succeeds."""
    staging = staging_folder(target)
    try:
        yield staging
        publish(staging, target, replace=replace)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class WriterLock:
    """One writer at a time: an exclusive ``flock`` on ``lock_file``, held until ``release`` or the process's end.

    The OS releases it when the process dies, however it dies, so a killed writer never
    leaves a folder locked. The file holds the holder's pid and host, for the refusal to
    name. ``release`` deletes it while still holding it, so no lock file stays beside an
    output; a writer that locked the deleted file meanwhile sees that its file is no longer
    the one under the name, and locks again (only a killed writer leaves its file behind).
    """

    def __init__(self, lock_file: Path, what: str, instead: str):
        """``what`` is locked ("the run folder runs/x"); ``instead``: what a refused writer can do."""
        self.path = Path(lock_file)
        self._handle = _locked(self.path, what, instead)

    def release(self) -> None:
        if self._handle is not None:
            self.path.unlink(missing_ok=True)  # before the lock ends: whoever locks next has a file of its own
            self._handle.close()  # closing the descriptor releases the lock
            self._handle = None

    def __enter__(self) -> "WriterLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _locked(path: Path, what: str, instead: str) -> TextIO:
    while True:
        handle = _lock_file_handle(path, instead)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(handle)
            handle.close()
            raise UserError(
                f"{what} is being written by another mlmlab process ({holder}); wait for it to end or stop it, "
                f"or {instead}"
            ) from None
        if _still_named(handle, path):
            break
        handle.close()  # its holder deleted it as it released it, after this process opened it: lock the new one
    handle.truncate(0)  # "a+": the write below lands at the (new) end, the start
    handle.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    handle.flush()
    return handle


def _lock_file_handle(path: Path, instead: str) -> TextIO:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a+", encoding="utf-8")  # not truncated yet: a refused writer reads the holder in it
    except OSError as err:
        raise UserError(f"cannot create the lock file {path} ({err.strerror}); {instead}") from None


def _still_named(handle: TextIO, path: Path) -> bool:
    """Whether ``path`` still names the file ``handle`` has open."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(handle.fileno())
    return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)


def _holder(handle: TextIO) -> str:
    """What the lock file says of its holder, which writes it just after it locks: a moment's wait for a new one."""
    for _ in range(20):
        handle.seek(0)
        if text := handle.read().strip():
            return text
        time.sleep(0.05)
    return "a process that has not said which"


def live_holder(folder: Path) -> int | None:
    """The pid that the folder's lock file names, when that process is alive on this host; else None.

    Read, never locked: a probe that took the lock for a moment could refuse a writer starting then.
    A pid reused by another process after the writer died reads as alive; the caller says "pid P".
    """
    try:
        text = (Path(folder) / LOCK_FILE).read_text(encoding="utf-8")
    except OSError:
        return None
    match = re.fullmatch(r"pid (\d+) on host (\S+)\s*", text)
    if not match or match[2] != socket.gethostname() or not _alive(int(match[1])):
        return None
    return int(match[1])


def lock_folder(folder: Path, what: str, instead: str) -> WriterLock:
    """A ``WriterLock`` on the folder's own ``.lock``: for a folder a command keeps writing to (a run, GLUE's --out)."""
    return WriterLock(Path(folder) / LOCK_FILE, what, instead)


def lock_beside(target: Path, what: str, instead: str) -> WriterLock:
    """A ``WriterLock`` on ``.<name>.lock`` beside ``target``: a file's, or a folder's that holds only its contents."""
    target = Path(target)
    return WriterLock(target.parent / f".{target.name}.lock", what, instead)


def _moved_together(recorded: Path, model_dir: Path, folder: Path) -> bool:
    """Whether ``recorded`` is ``model_dir`` under another root, both moved with the results ``folder``: the
    recorded path ends in the path from the folders' common ancestor down to ``model_dir``."""
    model_dir, folder = model_dir.resolve(), folder.resolve()
    below = model_dir.relative_to(os.path.commonpath([model_dir, folder])).parts
    return bool(below) and Path(recorded).parts[-len(below) :] == below and len(below) < len(model_dir.parts) - 1


def refuse_results_of_another_model(folder: Path, results_file: str, model_dir: Path, option: str = "--out") -> None:
    """Refuse a results folder whose ``results_file`` holds another model's figures, before any work.

    "Another model's": the file's ``model_dir`` names another folder than ``model_dir`` (compared as
    given and resolved), and not the same one moved together with the results (a study folder moved
    elsewhere: its runs' glue/ and model/ keep their places beside each other); a file that names none,
    or is not JSON, belongs to no model this can tell apart and is refused too. The same model's results
    are replaced by the new ones (a rerun).
    """
    path = Path(folder) / results_file
    if not path.is_file():
        return
    try:
        recorded = object_or_none(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError):
        recorded = {}
    other = recorded.get("model_dir")
    if isinstance(other, str) and (
        other == str(model_dir)
        or Path(other).resolve() == Path(model_dir).resolve()
        or _moved_together(Path(other), Path(model_dir), Path(folder))
    ):
        return
    whose = f"the model {other}" if isinstance(other, str) else "an unknown model"
    raise UserError(
        f"{option} {folder} already holds results of {whose} ({results_file}), not of {model_dir}; give {option} "
        "a new folder, or delete that one to replace its results"
    )
