"""The one exception type for mistakes a user can fix, and the failures of the machine a user can fix.

The CLI turns a UserError, or an OSError of a full disk or a file it may not write, into a
single line on stderr and a non-zero exit; anything else is a bug in mlmlab and keeps its traceback.
"""

import errno


class UserError(Exception):
    """Bad input or configuration: the message says what is wrong and what to do."""


# A full disk or quota, a read-only file, folder or file system: the user's to fix, not mlmlab's.
WRITE_REFUSALS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS}


def write_refusal(err: OSError) -> str | None:
    """The one line for an OSError of WRITE_REFUSALS (None for any other): the path, the cause, what is intact.

    Intact because every file mlmlab rewrites (checkpoints, model/, prepared data, caches, config.yaml,
    results) is written under a staging name and renamed when whole: a failed write leaves the old one.
    """
    if err.errno not in WRITE_REFUSALS:
        return None
    where = f"{err.filename}" if err.filename else "a file"
    return (
        f"cannot write {where}: {err.strerror}; everything written before it is intact (earlier checkpoints, "
        "model folders, prepared data and caches are replaced only by whole copies): free space or make the "
        "path writable, then run the command again"
    )
