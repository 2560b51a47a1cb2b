"""Progress on stderr for every command that takes long: one bar style, tqdm's, as training's.

Bars are drawn when stderr is a terminal (tqdm's rule for ``disable=None``): a log file or a
pipe would get every redraw. Lines (``say``) are written wherever stderr goes. A command's
``--no-progress`` turns both off (``shown=False``), so stderr holds only warnings and errors.
"""

import sys
import time

from tqdm.auto import tqdm


def progress_bar(desc: str, total: int | None = None, shown: bool = True, **options) -> tqdm:
    """A bar on stderr when it is a terminal; ``total`` None counts without an end (a corpus streamed, a time
    budget)."""
    return tqdm(total=total, desc=desc, disable=None if shown else True, dynamic_ncols=True, file=sys.stderr, **options)


def say(text: str, shown: bool = True) -> None:
    """A line on stderr, above any bar rather than through it."""
    if shown:
        tqdm.write(text, file=sys.stderr)


def say_once(accelerator, text: str) -> None:
    """``say`` from the main process only: a line for people, once however many processes train.

    On stderr, as every such line: stdout is the command's result (`pretrain --json` is JSON alone).
    """
    say(text, accelerator.is_main_process)


class Pace:
    """Time left at the pace this process has kept since it began, for the lines that stand in for a bar in a
    log file. The work is counted as a share done, in [0, 1]."""

    def __init__(self, done: float):
        self.started, self.done_at_start = time.perf_counter(), done

    def time_left(self, done: float) -> str:
        """ "; about N min left", or nothing while no work has been done since the start."""
        per_second = (done - self.done_at_start) / (time.perf_counter() - self.started)
        return f"; about {(1 - done) / per_second / 60:.0f} min left" if per_second > 0 else ""
