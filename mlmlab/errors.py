"""The one exception type for mistakes a user can fix, and the failures of the machine a user can fix.

The CLI turns a UserError, or a failed write of a full disk or a file it may not write, into a
single line on stderr and a non-zero exit; anything else is a bug in mlmlab and keeps its traceback.
A write that knows what it is writing and what stays intact says so through ``writes_of``.
"""

import errno
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager


class UserError(Exception):
    """Bad input or configuration: the message says what is wrong and what to do."""


# A full disk or quota, a read-only file, folder or file system: the user's to fix, not mlmlab's.
WRITE_REFUSALS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS}
_FREE_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # the others: the path is not writable


def write_error_of(err: BaseException) -> OSError | None:
    """The OSError of WRITE_REFUSALS behind ``err``, however the library that wrote reported it; else None.

    shutil.copytree gathers its failures in one ``shutil.Error`` (an OSError without an errno) whose
    entries are (source, destination, message); safetensors' Rust writer raises ``SafetensorError``
    ending in "(os error 28)", and tokenizers' a plain ``Exception`` ending the same way. torch's writer
    loses the errno altogether: ``run_folder.save_torch`` keeps it.
    """
    if isinstance(err, shutil.Error):
        entries = err.args[0] if err.args and isinstance(err.args[0], list) else []
        found = [(int(m[1]), entry[1]) for entry in entries if (m := re.search(r"\[Errno (\d+)\]", str(entry[-1])))]
        cause = OSError(found[0][0], os.strerror(found[0][0]), found[0][1]) if found else None
    elif isinstance(err, OSError):
        cause = err
    elif _rust_writer_error(err) and (m := re.search(r"\(os error (\d+)\)", str(err))):
        cause = OSError(int(m[1]), os.strerror(int(m[1])))
    else:
        cause = None
    return cause if cause is not None and cause.errno in WRITE_REFUSALS else None


def write_refusal(err: BaseException) -> str | None:
    """The one line for a failed write no ``writes_of`` described (None for any other error): the path, the
    cause, what is intact.

    Intact because every file mlmlab rewrites (checkpoints, model/, prepared data, caches, config.yaml,
    results) is written under a staging name and renamed when whole: a failed write leaves the old one.
    """
    cause = write_error_of(err)
    if cause is None:
        return None
    where = f"{cause.filename}" if cause.filename else "a file"
    return (
        f"cannot write {where}: {cause.strerror}; everything written before it is intact (earlier checkpoints, "
        f"model folders, prepared data and caches are replaced only by whole copies): {_remedy(cause)}, then run "
        "the command again"
    )


def _rust_writer_error(err: BaseException) -> bool:
    """An error of safetensors' or tokenizers' Rust writers, which carry the errno only in their text."""
    return type(err).__name__ == "SafetensorError" or type(err) is Exception


@contextmanager
def writes_of(what: str, kept: str, then: str = "run the command again") -> Iterator[None]:
    """A failed write in the block becomes one line: what was being written, the cause, ``kept`` (what is
    intact) and what to do, ``then``.

    ``with writes_of("checkpoint ckpt-00000400 to runs/x", "the last complete checkpoint ckpt-00000200 is
    kept intact", "rerun to resume"):`` -> "cannot write checkpoint ckpt-00000400 to runs/x: No space left
    on device; the last complete checkpoint ckpt-00000200 is kept intact; free space, then rerun to resume".
    """
    try:
        yield
    except Exception as err:  # torch's and safetensors' writers raise other types than OSError
        cause = write_error_of(err)
        if cause is None:
            raise
        raise UserError(f"cannot write {what}: {cause.strerror}; {kept}; {_remedy(cause)}, then {then}") from None


def _remedy(cause: OSError) -> str:
    if cause.errno in _FREE_SPACE:
        return "free space on that disk (or write elsewhere)"
    return "make the folder writable (or write elsewhere)"
