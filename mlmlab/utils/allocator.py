"""glibc's allocator: tuned for training steps (the mlmlab command runs under MALLOC_TUNING), trimmed between runs."""

import ctypes
import os
import sys

# glibc returns freed activation memory to the OS after every step and maps it back on the
# next, which showed up as ~50% system time here. Keeping the heap (no trimming, 1 GiB top
# pad) measured 1.27x faster steps on the tiny preset (646 -> 507 ms, 2 CPU cores). Blocks
# over 32 MiB (glibc's largest mmap threshold) are still mapped and unmapped one by one: ADM's
# scoring pass allocates ~0.6 GB of them a step ((2048, V) logits and their softmax), and an
# adm-study-v3 run spent half its time in ~450k page faults/s, at 9k instead of 18.5k tokens/s.
# No mmap at all (MALLOC_MMAP_MAX_=0) serves them from the kept heap too. glibc reads these
# only at start-up, so the command re-executes itself once with them set.
MALLOC_TUNING = {"MALLOC_TRIM_THRESHOLD_": str(4 << 30), "MALLOC_TOP_PAD_": str(1 << 30), "MALLOC_MMAP_MAX_": "0"}


def reexec_with_malloc_tuning(command: list[str]) -> None:
    """Replace this process by ``command`` with MALLOC_TUNING set, unless the user set any of it."""
    if sys.platform.startswith("linux") and not any(key in os.environ for key in MALLOC_TUNING):
        os.execve(command[0], command, {**os.environ, **MALLOC_TUNING})


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; nothing elsewhere).

    Under MALLOC_TUNING the heap never shrinks on its own, and what one run freed is not all reused by the next: one
    `mlmlab study` process grew to 17.9 GB over six ModernBERT-tiny runs and part of a seventh and was killed by the
    kernel's OOM killer, while none of its runs alone held more than 2.5 GB. Called between runs, where a step's speed
    does not depend on the heap being kept."""
    if not sys.platform.startswith("linux"):
        return
    # The process's own symbols, libc's among them: find_library("c") would run ldconfig on every call.
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:  # musl has none
        trim(0)
