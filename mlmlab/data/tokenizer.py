"""Tokenizers of three kinds: train one, or adopt an existing one; load and check it.

- WordPiece (BERT's): [CLS] [SEP] [PAD] [UNK] [MASK]; "##" marks a word's continuation pieces.
  Trained here, or adopted from a BERT vocab.txt.
- Byte-level BPE (RoBERTa's, GPT-2's): <s> </s> <pad> <unk> <mask>, <s> and </s> framing a sequence
  as RoBERTa's [CLS] and [SEP]; "Ġ" (the byte of a space) marks a word's first piece. Trained here with
  a space before every text (add_prefix_space), so the first word of a sentence is a word like any other.
- Unigram (SentencePiece's): XLM-R's names for the same roles, <s> </s> <pad> <unk> <mask>, and BERT's
  pair framing (<s> A </s> B </s>, token types 0 then 1), which is what mlmlab's NSP pairs are; "▁"
  marks a word's first piece. Cased, NFKC-normalised, as SentencePiece's defaults.

Every tokenizer is a folder (tokenizer.json, tokenizer_config.json, and vocab.txt for WordPiece) that
`transformers.AutoTokenizer.from_pretrained(folder)` loads; any folder with a tokenizer.json is adopted as
it is, and one with only vocab.json + merges.txt (RoBERTa's files) is rebuilt as one (``adopt_bpe_files``).
The special tokens are the tokenizer's own (its cls/sep/pad/mask/unk roles and added special tokens),
never looked up by BERT's names. We never build one with `BertTokenizerFast(vocab_file=...)`: in
transformers 5 that silently yields a 5-token vocabulary, so `load_tokenizer` also asserts the loaded
size against the files.

`transformers` is imported inside functions: `prepare` workers only need the light
`tokenizers` package, and importing transformers costs seconds per process.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from mlmlab import choices
from mlmlab.data.corpus import read_documents
from mlmlab.data.records import Columns
from mlmlab.errors import UserError, writes_of
from mlmlab.utils.files import building
from mlmlab.utils.jsonio import read_json_file
from mlmlab.utils.progress import progress_bar

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # WordPiece's, BERT's names
# Byte-level BPE and Unigram: fairseq's dictionary order (<s> <pad> </s> <unk>: ids 0-3 as RoBERTa's, XLM-R's), <mask>
SENTENCE_SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
# The roles every tokenizer must fill, as transformers names them: framing, padding, masking
REQUIRED_ROLES = ("cls_token", "sep_token", "pad_token", "mask_token")
_UNUSED = re.compile(r"^\[unused\d+\]$")
# The most tokens mlmlab trains: the trainers size their tables by the vocabulary asked for, and past
# what memory holds the process aborts natively (10^8: a Rust panic, no Python error). 16x XLM-R's 250,002.
LARGEST_TRAINED_VOCAB = 2**22


def train_tokenizer(
    corpus_paths: str | Path | Iterable[str | Path],
    vocab_size: int,
    out_dir: str | Path,
    lowercase: bool = True,
    columns: Columns = Columns(),
    show_progress: bool = False,
    kind: str = choices.WORDPIECE,
) -> Path:
    """Train a tokenizer of ``kind`` (wordpiece, bpe, unigram) on the corpus and save it as a tokenizer folder
    (with ``show_progress``, a bar of the documents read on stderr).

    Not reproducible run to run: tokenizers (0.23) numbers the "##" pieces in hash-map order and
    breaks merge-count ties by those numbers (huggingface/tokenizers#1794), so two trainings on
    the same corpus number hundreds of tokens differently and differ in a few entries (2 of 8,192
    measured on the bundled sample). Train once and reuse the folder.
    """
    if kind not in choices.TOKENIZER_KINDS:
        raise UserError(
            f"tokenizer kind {kind!r} is not one mlmlab trains; use {choices.listed(choices.TOKENIZER_KINDS)}"
        )
    if vocab_size < len(SPECIAL_TOKENS) + 1 or (kind == choices.BPE and vocab_size <= 256 + 5):
        raise UserError(
            f"vocab_size {vocab_size} is too small; use at least a few thousand (BERT uses 30522, "
            "RoBERTa 50265; a byte-level BPE needs more than its 256 bytes and 5 special tokens)"
        )
    if vocab_size > LARGEST_TRAINED_VOCAB:
        raise UserError(
            f"vocab_size {vocab_size} is more than the tokenizers trainer can build (it sizes its tables by the "
            f"vocabulary asked for: 10^8 aborted the process natively); use at most {LARGEST_TRAINED_VOCAB}, a few "
            "thousand to a few hundred thousand as released models do (BERT 30522, XLM-R 250002)"
        )
    with new_tokenizer_folder(out_dir) as staging:
        if kind != choices.WORDPIECE:
            _train_sentence_tokenizer(corpus_paths, vocab_size, staging, lowercase, columns, show_progress, kind)
            return Path(out_dir)
        tokenizer = _bert_tokenizer(models.WordPiece(unk_token="[UNK]"), lowercase)
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
        )
        _train(tokenizer, trainer, corpus_paths, columns, show_progress)
        vocab = tokenizer.get_vocab()
        _save_folder(sorted(vocab, key=vocab.__getitem__), staging, lowercase)
    return Path(out_dir)


def _train_sentence_tokenizer(
    corpus_paths, vocab_size: int, out_dir: Path, lowercase: bool, columns: Columns, show_progress: bool, kind: str
) -> Path:
    """A byte-level BPE or a Unigram (module docstring), trained and saved as a folder AutoTokenizer loads."""
    special = list(SENTENCE_SPECIAL_TOKENS)
    if kind == choices.BPE:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=special,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    else:
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size, special_tokens=special, unk_token="<unk>", show_progress=False
        )
    steps = [normalizers.NFKC()] if kind == choices.UNIGRAM else []
    if lowercase:
        steps.append(normalizers.Lowercase())
    if steps:
        tokenizer.normalizer = normalizers.Sequence(steps)
    _train(tokenizer, trainer, corpus_paths, columns, show_progress)
    ids = {token: tokenizer.token_to_id(token) for token in special}
    roles = dict(
        bos_token="<s>",
        eos_token="</s>",
        cls_token="<s>",
        sep_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
    )
    if kind == choices.BPE:
        from transformers import RobertaTokenizerFast

        tokenizer.post_processor = processors.RobertaProcessing(
            ("</s>", ids["</s>"]), ("<s>", ids["<s>"]), trim_offsets=True, add_prefix_space=True
        )
        wrapped = RobertaTokenizerFast(tokenizer_object=tokenizer, add_prefix_space=True, **roles)
        tokenizer.model.save(str(out_dir))  # vocab.json + merges.txt too, RoBERTa's slow files, for other tools
    else:
        from transformers import PreTrainedTokenizerFast

        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>",
            pair="<s> $A </s> $B:1 </s>:1",
            special_tokens=[("<s>", ids["<s>"]), ("</s>", ids["</s>"])],
        )
        wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **roles)
    wrapped.save_pretrained(str(out_dir))
    load_tokenizer(out_dir)
    return out_dir


def adopt_bpe_files(folder: str | Path, out_dir: str | Path) -> Path:
    """A tokenizer folder (tokenizer.json) rebuilt from RoBERTa's slow files, vocab.json + merges.txt, with RoBERTa's
    special tokens and framing, as transformers' RobertaTokenizer reads them."""
    from transformers import RobertaTokenizerFast

    folder = Path(folder)
    refuse_incomplete_bpe(folder)
    try:
        RobertaTokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt")).save_pretrained(
            str(out_dir)
        )
    except Exception as err:  # tokenizers raises its own types for a damaged file
        raise UserError(
            f"cannot read the byte-level BPE files in {folder} ({str(err).splitlines()[0]}); copy "
            "vocab.json and merges.txt again"
        ) from None
    load_tokenizer(out_dir)
    return Path(out_dir)


def refuse_incomplete_bpe(folder: Path) -> None:
    """A one-line UserError for RoBERTa's slow files without their merges.txt."""
    if not (Path(folder) / "merges.txt").is_file():
        raise UserError(
            f"{folder} has a vocab.json but no merges.txt: a byte-level BPE needs both (or a "
            "tokenizer.json); copy the tokenizer's merges.txt into it"
        )


def adopt_vocab(vocab_file: str | Path, out_dir: str | Path, lowercase: bool = True) -> Path:
    """Build a tokenizer folder from an existing BERT vocab.txt (one token per line, id = line)."""
    tokens = _read_vocab_file(Path(vocab_file))
    with new_tokenizer_folder(out_dir) as staging:
        _save_folder(tokens, staging, lowercase)
    return Path(out_dir)


def load_tokenizer(tokenizer_dir: str | Path):
    """Load a tokenizer folder with AutoTokenizer and check its size and special tokens."""
    from transformers import AutoTokenizer

    tokenizer_dir = Path(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").is_file() and not (tokenizer_dir / "vocab.txt").is_file():
        slow = (
            " (only vocab.json: a byte-level BPE needs its merges.txt too)"
            if (tokenizer_dir / "vocab.json").is_file() and not (tokenizer_dir / "merges.txt").is_file()
            else ""
        )
        raise UserError(
            f"{tokenizer_dir} is not a tokenizer folder (no tokenizer.json or vocab.txt){slow}; name it with "
            "data.tokenizer (vocab.json + merges.txt are adopted), or make one with `mlmlab tokenizer --corpus FILES "
            "--out DIR`"
        )
    expected = _expected_vocab(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        _require_special_tokens(expected, tokenizer_dir)  # a vocab.txt: BERT's names are all there is to go by
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError, TypeError) as err:
        raise UserError(
            f"cannot load the tokenizer in {tokenizer_dir} ({str(err).splitlines()[0]}); copy the folder "
            "again, or make one with `mlmlab tokenizer`"
        ) from None
    if len(tokenizer) != len(expected) or tokenizer.get_vocab() != expected:
        raise UserError(
            f"tokenizer in {tokenizer_dir} loaded with {len(tokenizer)} tokens but its files list {len(expected)}; "
            "rebuild the folder with `mlmlab tokenizer`"
        )
    require_roles(tokenizer, tokenizer_dir)
    return tokenizer


def require_roles(tokenizer, source) -> None:
    """A one-line UserError unless the tokenizer names its framing, padding and mask tokens, each its own id."""
    ids, vocab = {}, tokenizer.get_vocab()
    for role in REQUIRED_ROLES:
        token = getattr(tokenizer, role, None)
        if token is None or str(token) not in vocab:
            name = role.removesuffix("_token")
            raise UserError(
                f"the tokenizer in {source} has no {name} token ({role} in tokenizer_config.json); "
                f"mlmlab needs a {' '.join(r.removesuffix('_token') for r in REQUIRED_ROLES)} token: "
                "add it, or train one with `mlmlab tokenizer --kind wordpiece|bpe|unigram`"
            )
        ids[role] = vocab[str(token)]
    pairs = [(a, b) for i, a in enumerate(REQUIRED_ROLES) for b in REQUIRED_ROLES[i + 1 :] if ids[a] == ids[b]]
    allowed = {("cls_token", "sep_token")}  # GPT-2-style <|endoftext|> both begins and ends: still not a mask or pad
    clash = next((pair for pair in pairs if pair not in allowed), None)
    if clash:
        raise UserError(
            f"the tokenizer in {source} uses one token ({getattr(tokenizer, clash[0])!r}, id "
            f"{ids[clash[0]]}) as both its {clash[0]} and its {clash[1]}: masked or padded positions could "
            "not be told apart; give each role its own token"
        )


def special_ids(tokenizer) -> set[int]:
    """Every id that is not text: the tokenizer's named special tokens and the added tokens it marks special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}


def tokenizer_kind(tokenizer) -> str:
    """The tokenizers model of a fast tokenizer: "WordPiece", "BPE", "Unigram" (or "WordLevel")."""
    return json.loads(tokenizer.backend_tokenizer.to_str())["model"]["type"]


def word_marker(tokenizer) -> tuple[str, bool]:
    """How the tokenizer's own pieces say where a word begins: (marker, begins).

    WordPiece: ("##", False), the marker opens a continuation piece; byte-level BPE: ("Ġ", True), the byte of a space
    opens a word's first piece (fairseq's whole-word masking for GPT-2's BPE reads it the same way); Unigram and
    other Metaspace tokenizers: ("▁", True). Anything else cannot mark words: a one-line UserError.
    """
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model["type"] == "WordPiece":
        return model.get("continuing_subword_prefix") or "##", False
    steps = _pre_tokenizer_steps(spec.get("pre_tokenizer"))
    if any(step.get("type") == "ByteLevel" for step in steps):
        return "Ġ", True
    metaspace = next((step for step in steps if step.get("type") == "Metaspace"), None)
    if metaspace is not None:
        return metaspace.get("replacement", "▁"), True
    if model.get("continuing_subword_prefix"):
        return model["continuing_subword_prefix"], False
    raise UserError(
        f"masking.whole_word=true needs the tokenizer's pieces to mark where words begin (WordPiece's "
        f'"##", byte-level BPE\'s "Ġ", SentencePiece\'s "▁"); this {model["type"]} tokenizer marks '
        "none: set masking.whole_word=false"
    )


def _pre_tokenizer_steps(pre: dict | None) -> list[dict]:
    if not pre:
        return []
    return (
        [step for inner in pre.get("pretokenizers", []) for step in _pre_tokenizer_steps(inner)]
        if pre.get("type") == "Sequence"
        else [pre]
    )


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
    """Ids a random replacement may insert: not special (named or added) and not a reserved [unusedN] slot."""
    special = special_ids(tokenizer)
    ids = [i for token, i in tokenizer.get_vocab().items() if i not in special and not _UNUSED.match(token)]
    return np.array(sorted(ids), dtype=np.int64)


def _train(tokenizer: Tokenizer, trainer, corpus_paths, columns: Columns, show_progress: bool) -> None:
    """``trainer`` run on the corpus's sentences; a Unigram whose vocabulary cannot hold the corpus's alphabet (it
    keeps every character as a token, and only reading the corpus tells how many there are) in one line."""
    characters: set[str] = set()
    with progress_bar("tokenizer", None, show_progress, unit="doc") as bar:
        try:
            tokenizer.train_from_iterator(_noting(_sentences(corpus_paths, columns, bar), characters), trainer=trainer)
        except Exception as err:  # tokenizers raises a plain Exception; any other is re-raised as it came
            if "not large enough to contain all chars" not in str(err):
                raise
            least = len(characters) + len(SENTENCE_SPECIAL_TOKENS) + 1
            raise UserError(
                f"vocab_size {trainer.vocab_size} cannot hold the corpus's alphabet: a Unigram keeps each of its "
                f"{len(characters)} distinct characters (before normalising) as a token; use at least {least}, "
                "better a few thousand"
            ) from None


def _noting(sentences: Iterator[str], characters: set[str]) -> Iterator[str]:
    """The sentences, unchanged, with every character of them added to ``characters``."""
    for sentence in sentences:
        characters.update(sentence)
        yield sentence


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
    with open(vocab_file, "rb") as handle:
        json_object = handle.read(4096).lstrip().startswith(b"{")
    if json_object:  # its lines read as tokens were refused as duplicates or as lacking [PAD]: not the cause
        raise UserError(
            f"{vocab_file} is JSON (a tokenizer.json or vocab.json), not a vocab.txt of one token a line; its folder "
            f"is a tokenizer as it is: name the folder (prepare --tokenizer {vocab_file.parent}, "
            f"data.tokenizer={vocab_file.parent}) instead of adopting the file"
        )
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
        vocab = spec["model"]["vocab"]  # a Unigram's is a list of (piece, score), id = position
        vocab = {entry[0]: i for i, entry in enumerate(vocab)} if isinstance(vocab, list) else dict(vocab)
        vocab.update({added["content"]: added["id"] for added in spec.get("added_tokens", [])})
        return vocab
    return {token: i for i, token in enumerate(_vocab_lines(tokenizer_dir / "vocab.txt"))}


def _tokenizer_spec(tokenizer_json: Path) -> dict:
    """A tokenizer.json read and checked for what mlmlab reads of it: a model and its vocabulary."""
    again = "copy the folder again, or rebuild it with `mlmlab tokenizer`"
    spec = read_json_file(tokenizer_json, again)
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("vocab", {}), (dict, list)):
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
        raise UserError(
            f"vocab {vocab_file} line {blank} is blank; each line must hold one token (delete the line "
            "only if the ids after it may shift)"
        )
    return lines


def _require_special_tokens(tokens: Iterable[str], source: Path) -> None:
    present = set(tokens)
    for token in SPECIAL_TOKENS:
        if token not in present:
            raise UserError(
                f"vocab {source} has no {token} token; add a line '{token}' to it (BERT needs "
                f"{' '.join(SPECIAL_TOKENS)}) or use a standard BERT vocab.txt"
            )


@contextmanager
def new_tokenizer_folder(out_dir: str | Path) -> Iterator[Path]:
    """``with new_tokenizer_folder(out) as staging:`` fill ``staging``, published as ``out`` (new or empty) once
    whole: a full disk leaves no half tokenizer folder that the next try would refuse."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"tokenizer folder {out_dir} already exists and is not empty; choose a new folder or delete it")
    kept = f"nothing is left at {out_dir} (a tokenizer folder is renamed into place only when whole)"
    with writes_of(f"the tokenizer folder {out_dir}", kept), building(out_dir) as staging:
        yield staging
