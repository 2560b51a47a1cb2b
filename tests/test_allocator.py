"""The allocator settings the mlmlab command re-executes itself with (utils/allocator.py): freed memory is reused."""

import subprocess
import sys

import pytest

# In the re-executed process: allocate, touch and free a 128 MiB tensor (over glibc's largest mmap threshold, as
# ADM's scoring logits are) again and again, as training steps do; print the minor page faults of the last ten,
# once the heap has grown to what the loop needs (6 rounds here).
FAULTS = """
import resource, torch
def touch(): torch.empty(32 << 20).fill_(1.0)
for _ in range(20): touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10): touch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
REEXEC = "import sys; from mlmlab.utils import allocator; allocator.reexec_with_malloc_tuning(sys.argv[1:])"


def page_faults(*setup: str) -> int:
    command = [sys.executable, *setup, sys.executable, "-c", FAULTS]
    return int(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the settings are glibc's; the command sets them on Linux"
)
def test_large_blocks_are_reused_not_mapped_again_each_time():
    pages = (32 << 20) * 4 // 4096  # one 128 MiB block, in 4 KiB pages
    untuned = page_faults("-c", "import os, sys; os.execv(sys.argv[1], sys.argv[1:])")
    tuned = page_faults("-c", REEXEC)
    assert untuned > 9 * pages  # glibc's defaults: each block mapped afresh, every page faulted in again
    assert tuned < pages  # with the tuning: the heap's pages serve every block


# In the re-executed process: fill 320 MiB of heap with tensors, keep a small block above them (as a run's row or
# log line is, so the heap's top cannot shrink), free the tensors; print the resident MiB then and after the trim.
TRIM = """
import torch
from mlmlab.utils.allocator import release_freed_memory
def resident(): return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
blocks = [torch.empty(2 << 20).fill_(1.0) for _ in range(40)]
kept = torch.empty(1024).fill_(1.0)
del blocks
print(resident())
release_freed_memory()
print(resident())
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the settings are glibc's; the command sets them on Linux"
)
def test_memory_a_run_freed_goes_back_to_the_os_between_runs():
    """Under the tuning the heap never shrinks by itself: a study process grew run after run until the OOM killer
    stopped it. The trim between runs must hand the freed pages back."""
    command = [sys.executable, "-c", REEXEC, sys.executable, "-c", TRIM]
    kept, trimmed = map(int, subprocess.run(command, capture_output=True, text=True, check=True).stdout.split())
    assert kept - trimmed > 250  # MiB of the 320 freed
