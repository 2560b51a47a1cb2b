"""Stop signals (SIGTERM, SIGINT): the main process owns shutdown, worker processes never do.

A scheduler's preemption, ``timeout`` and Ctrl-C signal every process of the job. A worker
that died of it would take the main process down before it could save: a DataLoader reports
a killed worker as an error, and a multiprocessing pool waits forever for the task a dead
worker held. So workers let these signals pass, and the main process stops them itself: a
DataLoader by its own shutdown message, prepare's pool with SIGKILL (data/build.py), and a
SIGTERM from their parent (a DataLoader's fallback, multiprocessing at exit) still ends them.
The main process stops as training decides (``StopRequest``: train/loop.py saves first), or,
outside training, unwinds as Ctrl-C does (``sigterm_unwinds``).
"""

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """A process stopped by a signal exits with 128 + its number, as a shell reports it (143, 130)."""
    return 128 + signum


class StopRequest:
    """Inside ``with``, SIGTERM or SIGINT (Ctrl-C) sets a flag, which training reads at its next step boundary to
    save a checkpoint and exit. The flag outlives the ``with``: a signal while the run folder is set up stops the
    run."""

    def __init__(self):
        self.requested = False
        self.signum = signal.SIGTERM  # what the exit reports; another process's SIGTERM stops this one too

    def __enter__(self):
        self._previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        return self

    def _handle(self, signum, frame):
        self.requested, self.signum = True, signum

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def exit(self) -> SystemExit:
        return SystemExit(exit_code(self.signum))


def ignore_stop_signals(worker_id: int | None = None) -> None:
    """In a worker process (a DataLoader's ``worker_init_fn``, which passes ``worker_id``; a pool's initializer).

    SIGINT is ignored. SIGTERM is blocked and taken by one thread that ends the worker only when
    its parent sent it: a handler could not tell who did. Threads started later inherit the block.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_exit_on_parents_sigterm, args=(os.getppid(),), daemon=True).start()


def _exit_on_parents_sigterm(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)  # as torch's own worker handler: a clean exit, which the DataLoader does not report


@contextmanager
def stop_signals_held() -> Iterator[None]:
    """Workers forked inside start with SIGTERM and SIGINT blocked, until ``ignore_stop_signals`` takes over;
    this process takes one arriving meanwhile when the block ends (main thread only).

    Otherwise one arriving in between would end a worker, or raise in it what this process's
    handler raises. Blocking alone would not hold it back here: another thread receives it, and
    Python runs the handler in the main thread wherever it stands, e.g. in the fork's after-fork
    hooks, where a raised exception is reported and dropped, and the stop lost with it.
    """
    held = []
    handlers = {signum: signal.signal(signum, lambda signum, frame: held.append(signum)) for signum in STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # what forked workers start with
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)


class Stopped(KeyboardInterrupt):
    """SIGTERM raised as SIGINT raises KeyboardInterrupt; ``signum`` says which signal it was."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise Stopped(signum)


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Inside, SIGTERM raises ``Stopped`` instead of ending the process where it stands.

    What runs then unwinds: worker pools are stopped (their workers ignore the job's SIGTERM),
    staging folders removed, locks released.
    """
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
