"""Change a setting for the length of a ``with`` block, and put it back however the block ends."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def restoring(read: Callable[[], object], write: Callable[[object], object], value) -> Iterator[None]:
    """``write(value)`` inside the block; ``write(read())`` of before, on exit."""
    previous = read()
    write(value)
    try:
        yield
    finally:
        write(previous)
