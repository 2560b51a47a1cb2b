"""A held-out split carved from a training corpus by documents (``data.valid_fraction``).

A document's side is a hash of its text, not of its position or of a random draw: the same
document is on the same side however the corpus is ordered, split into files or seeded, and
an exact duplicate cannot sit on both sides. The hash, read as a number in [0, 1), puts a
document in the held-out split when it is below the fraction, so a larger fraction only adds
documents to a smaller one's held-out split.
"""

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from mlmlab.errors import UserError

_PERSON = b"mlmlab-valid"  # blake2b's personalisation: this hash is no other hash of the same text


@dataclass(frozen=True)
class DocumentSplit:
    """One side of a corpus's held-out split."""

    valid_fraction: float  # share of the documents held out, in expectation
    held_out: bool  # True: the held-out documents; False: every other (the training side)

    def keeps(self, paragraphs: list[str]) -> bool:
        return is_held_out(paragraphs, self.valid_fraction) == self.held_out


def is_held_out(paragraphs: list[str], valid_fraction: float) -> bool:
    """Whether a document (its paragraphs, as read) belongs to the held-out split of this fraction."""
    digest = hashlib.blake2b("\n".join(paragraphs).encode(), digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "big") / 2**64 < valid_fraction


def split_documents(documents: Iterable[list[str]], split: DocumentSplit) -> Iterator[list[str]]:
    """The documents on ``split``'s side; a UserError at the end when there were none."""
    kept = 0
    for paragraphs in documents:
        if split.keeps(paragraphs):
            kept += 1
            yield paragraphs
    if not kept:
        side = "holds out no document" if split.held_out else "leaves no document to train on"
        raise UserError(
            f"data.valid_fraction={split.valid_fraction:g} {side} of this corpus (a document's side is a "
            "hash of its text); use more text, another data.valid_fraction, or data.valid_corpus"
        )
