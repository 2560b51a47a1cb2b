"""WordPiece tokenizers: train one, or adopt an existing BERT vocab.txt; load and check it.

Every tokenizer is saved as a folder (tokenizer.json, vocab.txt, tokenizer_config.json)
that `transformers.AutoTokenizer.from_pretrained(folder)` loads. We never build one with
`BertTokenizerFast(vocab_file=...)`: in transformers 5 that silently yields a 5-token
vocabulary, so `load_tokenizer` also asserts the loaded size against the files.

`transformers` is imported inside functions: `prepare` workers only need the light
`tokenizers` package, and importing transformers costs seconds per process.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from mlmlab.data.corpus import read_documents
from mlmlab.data.records import Columns
from mlmlab.errors import UserError
from mlmlab.utils.jsonio import read_json_file
from mlmlab.utils.progress import progress_bar

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_UNUSED = re.compile(r"^\[unused\d+\]$")


def train_tokenizer(
    corpus_paths: str | Path | Iterable[str | Path], vocab_size: int, out_dir: str | Path, lowercase: bool = True,
    columns: Columns = Columns(), show_progress: bool = False,
) -> Path:
    """Train a BERT WordPiece vocabulary on the corpus and save it as a tokenizer folder (with ``show_progress``,
    a bar of the documents read on stderr).

    Not reproducible run to run: tokenizers (0.23) numbers the "##" pieces in hash-map order and
    breaks merge-count ties by those numbers (huggingface/tokenizers#1794), so two trainings on
    the same corpus number hundreds of tokens differently and differ in a few entries (2 of 8,192
    measured on the bundled sample). Train once and reuse the folder.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 1:
        raise UserError(f"vocab_size {vocab_size} is too small; use at least a few thousand (BERT uses 30522)")
    out_dir = _empty_out_dir(out_dir)
    tokenizer = _bert_tokenizer(models.WordPiece(unk_token="[UNK]"), lowercase)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    with progress_bar("tokenizer", None, show_progress, unit="doc") as bar:
        tokenizer.train_from_iterator(_sentences(corpus_paths, columns, bar), trainer=trainer)
    vocab = tokenizer.get_vocab()
    return _save_folder(sorted(vocab, key=vocab.__getitem__), out_dir, lowercase)


def adopt_vocab(vocab_file: str | Path, out_dir: str | Path, lowercase: bool = True) -> Path:
    """Build a tokenizer folder from an existing BERT vocab.txt (one token per line, id = line)."""
    tokens = _read_vocab_file(Path(vocab_file))
    return _save_folder(tokens, _empty_out_dir(out_dir), lowercase)


def load_tokenizer(tokenizer_dir: str | Path):
    """Load a tokenizer folder with AutoTokenizer and check its size and special tokens."""
    from transformers import AutoTokenizer

    tokenizer_dir = Path(tokenizer_dir)
    refuse_other_kinds(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").is_file() and not (tokenizer_dir / "vocab.txt").is_file():
        raise UserError(
            f"{tokenizer_dir} is not a tokenizer folder (no tokenizer.json or vocab.txt); "
            "make one with `mlmlab tokenizer --corpus FILES --out DIR` or `mlmlab tokenizer --vocab vocab.txt --out DIR`"
        )
    expected = _expected_vocab(tokenizer_dir)
    _require_special_tokens(expected, tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if len(tokenizer) != len(expected) or tokenizer.get_vocab() != expected:
        raise UserError(
            f"tokenizer in {tokenizer_dir} loaded with {len(tokenizer)} tokens but its files list {len(expected)}; "
            "rebuild the folder with `mlmlab tokenizer`"
        )
    return tokenizer


def refuse_other_kinds(tokenizer_dir: Path) -> None:
    """A one-line UserError for a tokenizer folder that is not WordPiece (RoBERTa's byte-level BPE, SentencePiece).

    Not supported rather than half-supported: masking, NSP pairs, whole-word selection ("##"
    pieces), prepared data and GLUE all name BERT's special tokens ([CLS] [SEP] [MASK] [PAD]).
    """
    tokenizer_json = tokenizer_dir / "tokenizer.json"
    kind = _tokenizer_spec(tokenizer_json)["model"].get("type") \
        if tokenizer_json.is_file() else ("BPE" if (tokenizer_dir / "merges.txt").is_file() else None)
    if kind in (None, "WordPiece"):
        return
    described = "a byte-level BPE (RoBERTa/GPT-2-style)" if kind == "BPE" else f"a {kind}"
    raise UserError(f"{tokenizer_dir} holds {described} tokenizer; mlmlab trains BERT-style models with WordPiece "
                    "tokenizers only: make one with `mlmlab tokenizer --corpus FILES --out DIR`, or adopt a BERT "
                    "vocab.txt with `mlmlab tokenizer --vocab vocab.txt --out DIR`")


def vocab_hash(vocab: Mapping[str, int]) -> str:
    """A vocabulary's identity: 16 hex digits of sha256 over its (id, token) pairs.

    The one place it is computed. The size is not an identity: a WordPiece retrained on the
    same corpus has the same size and renumbers hundreds of ids.
    """
    pairs = "\n".join(f"{i}\t{token}" for token, i in sorted(vocab.items(), key=lambda item: item[1]))
    return hashlib.sha256(pairs.encode("utf-8")).hexdigest()[:16]


def folder_vocab_hash(tokenizer_dir: str | Path) -> str:
    """``vocab_hash`` of a tokenizer folder's files (what ``load_tokenizer`` checks the loaded tokenizer against)."""
    return vocab_hash(_expected_vocab(Path(tokenizer_dir)))


def folder_vocab_size(tokenizer_dir: str | Path) -> int:
    """The number of tokens a tokenizer folder's files declare."""
    return len(_expected_vocab(Path(tokenizer_dir)))


def ordinary_token_ids(tokenizer) -> np.ndarray:
    """Ids a random replacement may insert: not special and not a reserved [unusedN] slot."""
    special = set(tokenizer.all_special_ids)
    ids = [i for token, i in tokenizer.get_vocab().items() if i not in special and not _UNUSED.match(token)]
    return np.array(sorted(ids), dtype=np.int64)


def _sentences(corpus_paths, columns: Columns, bar) -> Iterator[str]:
    for document in read_documents(corpus_paths, columns):
        bar.update()
        yield from document


def _bert_tokenizer(model, lowercase: bool) -> Tokenizer:
    tokenizer = Tokenizer(model)
    # strip_accents=None follows `lowercase`, exactly as BERT's uncased/cased models do.
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=None)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def _save_folder(tokens: list[str], out_dir: Path, lowercase: bool) -> Path:
    """Write vocab.txt + tokenizer.json + tokenizer_config.json, then reload to verify."""
    from transformers import BertTokenizerFast

    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = _bert_tokenizer(models.WordPiece(vocab, unk_token="[UNK]"), lowercase)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    wrapped = BertTokenizerFast(
        tokenizer_object=tokenizer,
        do_lower_case=lowercase,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    wrapped.save_pretrained(str(out_dir))
    (out_dir / "vocab.txt").write_text("".join(token + "\n" for token in tokens), encoding="utf-8")
    load_tokenizer(out_dir)
    return out_dir


def _read_vocab_file(vocab_file: Path) -> list[str]:
    if not vocab_file.is_file():
        raise UserError(f"vocab file {vocab_file} does not exist; give a BERT vocab.txt (one token per line)")
    tokens = _vocab_lines(vocab_file)
    duplicates = len(tokens) - len(set(tokens))
    if duplicates:
        raise UserError(f"vocab {vocab_file} has {duplicates} duplicate lines; each token must appear once")
    _require_special_tokens(tokens, vocab_file)
    return tokens


def _expected_vocab(tokenizer_dir: Path) -> dict[str, int]:
    """The vocabulary the folder's files declare: tokenizer.json's model, else vocab.txt lines."""
    tokenizer_json = tokenizer_dir / "tokenizer.json"
    if tokenizer_json.is_file():
        spec = _tokenizer_spec(tokenizer_json)
        vocab = dict(spec["model"]["vocab"])
        vocab.update({added["content"]: added["id"] for added in spec.get("added_tokens", [])})
        return vocab
    return {token: i for i, token in enumerate(_vocab_lines(tokenizer_dir / "vocab.txt"))}


def _tokenizer_spec(tokenizer_json: Path) -> dict:
    """A tokenizer.json read and checked for what mlmlab reads of it: a model and its vocabulary."""
    again = "copy the folder again, or rebuild it with `mlmlab tokenizer`"
    spec = read_json_file(tokenizer_json, again)
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("vocab", {}), dict):
        raise UserError(f"{tokenizer_json} holds no tokenizer model with a vocabulary; {again}")
    return spec


def _vocab_lines(vocab_file: Path) -> list[str]:
    """The tokens of a vocab.txt, id = line number; trailing blank lines are dropped.

    A blank line inside is refused rather than skipped: skipping it would renumber every
    later token, and keeping it would make the empty string a token.
    """
    try:
        lines = vocab_file.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        line = vocab_file.read_bytes()[: err.start].count(b"\n") + 1
        raise UserError(f"vocab {vocab_file} is not valid UTF-8 at line {line}; re-encode it as UTF-8") from None
    while lines and not lines[-1].strip():
        lines.pop()
    blank = next((number for number, token in enumerate(lines, start=1) if not token.strip()), None)
    if blank is not None:
        raise UserError(f"vocab {vocab_file} line {blank} is blank; each line must hold one token (delete the line "
                        "only if the ids after it may shift)")
    return lines


def _require_special_tokens(tokens: Iterable[str], source: Path) -> None:
    present = set(tokens)
    for token in SPECIAL_TOKENS:
        if token not in present:
            raise UserError(
                f"vocab {source} has no {token} token; add a line '{token}' to it (BERT needs "
                f"{' '.join(SPECIAL_TOKENS)}) or use a standard BERT vocab.txt"
            )


def _empty_out_dir(out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"tokenizer folder {out_dir} already exists and is not empty; choose a new folder or delete it")
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir
