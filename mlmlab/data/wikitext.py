"""WikiText-103 ``wiki.*.tokens`` files as plain text documents.

The files are word-tokenised (spaces around punctuation, ``@-@`` for an intra-word
hyphen, ``<unk>`` for rare words). A WordPiece model must see text as it was written,
or its perplexity measures the tokenisation artefacts, so the text is detokenised
first (the Moses-style rules used for WikiText by e.g. Megatron-LM's evaluation), and
``<unk>`` becomes the [UNK] id, which held-out evaluation never selects for masking.
Documents start at top-level `` = Title = `` lines with a blank line on both sides.
"""

import re
from pathlib import Path

from mlmlab.errors import UserError
from mlmlab.utils.files import write_text_atomically

_TITLE = re.compile(r"^ = [^=].* = $")
_RULES = [
    (re.compile(r" @(.)@ "), r"\1"),  # 1 @,@ 000 -> 1,000 ; well @-@ known -> well-known
    (re.compile(r" ([.,;:!?%)\]}])"), r"\1"),
    (re.compile(r"([(\[{$]) "), r"\1"),
    (re.compile(r" (n't|'s|'re|'ve|'m|'ll|'d)\b"), r"\1"),
    (re.compile(r'" (.*?) "'), r'"\1"'),
]
UNK_MARKER = "<unk>"  # kept as it is: prepare(unk_marker=...) encodes it as the [UNK] id


def is_wikitext(path: Path) -> bool:
    return Path(path).name.endswith(".tokens")


def detokenize_line(line: str) -> str:
    text = line.strip()
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    return text


def wikitext_documents(path: Path) -> list[list[str]]:
    """Articles as lists of paragraphs (section headings dropped)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 (byte {err.start}); WikiText files are UTF-8") from None
    documents: list[list[str]] = []
    for i, line in enumerate(lines):
        blank_around = (i == 0 or not lines[i - 1].strip()) and (i + 1 >= len(lines) or not lines[i + 1].strip())
        if _TITLE.match(line) and blank_around:
            documents.append([])
        elif line.strip() and not line.strip().startswith("= ") and documents:
            documents[-1].append(detokenize_line(line))
    return [doc for doc in documents if doc]


def write_plain(path: Path, out: Path) -> Path:
    """The detokenised file in mlmlab's plain format: a paragraph per line, a blank line between articles."""
    documents = wikitext_documents(path)
    if not documents:
        raise UserError(f"{path} holds no WikiText article (no ' = Title = ' line); is it a wiki.*.tokens file?")
    # Two runs evaluating at once may write it together: neither may read the other's half.
    write_text_atomically(out, "\n\n".join("\n".join(doc) for doc in documents) + "\n")
    return out
