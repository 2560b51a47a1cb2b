"""Resolve a config's data section to prepared stores and a tokenizer.

Empty corpus / tokenizer settings mean the sample bundled with the package, so that
``mlmlab pretrain`` runs with nothing else on disk. Prepared data and adopted
tokenizers live in the cache, in folders named by a hash of what made them.
"""

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path

from accelerate import PartialState

from mlmlab.config import DataConfig
from mlmlab.data.build import cache_root, prepare, prepared_hash
from mlmlab.data.corpus import is_prepared_dataset, refuse_missing_fields, resolve_paths
from mlmlab.data.mixture import MixedStore, mixture_hash
from mlmlab.data.records import Columns
from mlmlab.data.split import DocumentSplit
from mlmlab.data.store import TokenStore
from mlmlab.data.tokenizer import adopt_bpe_files, adopt_vocab, load_tokenizer, refuse_incomplete_bpe, vocab_hash
from mlmlab.data.wikitext import UNK_MARKER, is_wikitext, write_plain
from mlmlab.errors import UserError
from mlmlab.utils.files import building, file_sha256

log = logging.getLogger(__name__)

SAMPLE_DIR = Path(__file__).resolve().parent.parent / "resources" / "sample"
SAMPLE_TRAIN = SAMPLE_DIR / "train.txt.gz"
SAMPLE_VALID = SAMPLE_DIR / "valid.txt.gz"
SAMPLE_VOCAB = SAMPLE_DIR / "vocab.txt"
# Tokenizers bundled with the package, by the name data.tokenizer gives them (a folder of that name is used instead)
BUNDLED_TOKENIZERS = {"sample-bpe-8k": SAMPLE_DIR / "bpe-8k"}  # byte-level BPE, RoBERTa's tokens, on the sample


def tokenizer_dir_for(setting: str) -> Path:
    """A tokenizer folder as is; a vocab.txt (or the bundled one), or a folder of RoBERTa's slow files (vocab.json +
    merges.txt), adopted into the cache."""
    source = Path(setting) if setting else SAMPLE_VOCAB
    if setting in BUNDLED_TOKENIZERS and not source.exists():
        return BUNDLED_TOKENIZERS[setting]
    if source.is_dir():
        if (source / "tokenizer.json").is_file() or not (source / "vocab.json").is_file():
            return source
        refuse_incomplete_bpe(source)
        files = [source / "vocab.json", source / "merges.txt"]
        digest = hashlib.sha256(b"".join(path.name.encode() + path.read_bytes() for path in files)).hexdigest()[:16]
        return _cached_folder(
            cache_root().parent / "tokenizers" / f"bpe-{digest}", lambda staging: adopt_bpe_files(source, staging)
        )
    if not source.is_file():
        raise UserError(f"data.tokenizer={setting!r} is neither a tokenizer folder nor a vocab file")
    target = cache_root().parent / "tokenizers" / file_sha256(source)[:16]
    return _cached_folder(target, lambda staging: adopt_vocab(source, staging))


def _cached_folder(target: Path, fill) -> Path:
    """``target``, made once by ``fill(staging)`` and published by a rename; a concurrent maker's copy wins."""
    if not target.is_dir():
        with building(target) as staging:
            fill(staging)
    return target


def standalone_tokenizer(model_dir: Path) -> Path:
    """The tokenizer files of a model folder, copied to the cache so data hashes ignore the weights (RoBERTa's slow
    files, vocab.json + merges.txt without a tokenizer.json, are adopted from there)."""
    files = sorted(
        p
        for p in Path(model_dir).iterdir()
        if p.name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens"))
    )
    if not files:
        raise UserError(
            f"{model_dir} holds no tokenizer files (vocab.txt, tokenizer.json); copy the model's "
            "tokenizer into it, or name it with data.tokenizer"
        )
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()[:16]
    copied = _cached_folder(cache_root().parent / "tokenizers" / digest, lambda staging: _copy_files(files, staging))
    return tokenizer_dir_for(str(copied))


def _copy_files(files: list[Path], folder: Path) -> None:
    for path in files:
        shutil.copy2(path, folder / path.name)


def saved_tokenizer(tokenizer) -> Path:
    """A tokenizer object's files as data preparation reads them: saved, then kept in the cache by their contents."""
    with tempfile.TemporaryDirectory() as staging:
        tokenizer.save_pretrained(staging)
        return standalone_tokenizer(Path(staging))


def held_out_store(
    data: list[str], tokenizer_dir: Path, form: dict, columns: Columns = Columns(), show_progress: bool = False
) -> TokenStore:
    """A prepared dataset folder as is; a corpus (WikiText detokenised first) prepared with the model's tokenizer
    (``tokenizer_dir``: standalone_tokenizer's folder of a model, or saved_tokenizer's).

    ``form``: the data.* settings (keys as model/folder.py's held_out_form_of has them) the text becomes sequences by:
    the model's own objective (NSP pairs or packed blocks), length and pair sampling."""
    paths = [Path(p) for p in data]
    if folder := prepared_folder(paths):
        store = TokenStore(folder)
        _require_objective(store, form["data.objective"])
        return store
    wikitext = [path for path in paths if is_wikitext(path) and path.is_file()]
    corpus = [
        write_plain(path, cache_root().parent / "wikitext" / f"{path.stem}-{file_sha256(path)[:16]}.txt")
        if path in wikitext
        else path
        for path in paths
    ]
    return TokenStore(
        prepare(
            corpus,
            tokenizer_dir=tokenizer_dir,
            max_seq_length=form["data.max_seq_length"],
            objective=form["data.objective"],
            short_seq_prob=form["data.short_seq_prob"],
            seed=form["data.prepare_seed"],
            columns=columns,
            unk_marker=UNK_MARKER if wikitext else "",
            show_progress=show_progress,
        )
    )


def check_held_out_data(data: list, objectives: set[str]) -> None:
    """What held_out_store would refuse of ``data`` for models trained with ``objectives``, found before anything is
    trained: a missing path, a folder without corpus files, a prepared folder of another objective."""
    paths = [Path(p) for p in data]
    if folder := prepared_folder(paths):
        for objective in sorted(objectives):
            _require_objective(TokenStore(folder), objective)
        return
    resolve_paths(paths)


def _require_objective(store: TokenStore, objective: str) -> None:
    """A prepared folder of the other sequence form (NSP pairs for a model trained on packed blocks, or the reverse)
    would be measured on inputs the model never saw: refused."""
    built = store.meta["config"]["objective"]
    if built != objective:
        raise UserError(
            f"{store.path} was prepared with objective {built!r}, but the model was trained with "
            f"data.objective={objective}; give the text itself (it is prepared as the model was trained), or a "
            f"folder prepared with --objective {objective}"
        )


def prepared_folder(corpus: list) -> Path | None:
    """The folder, when a corpus is one folder `mlmlab prepare` wrote: used as it is, not read as text."""
    return Path(corpus[0]) if len(corpus) == 1 and is_prepared_dataset(Path(corpus[0])) else None


def _corpora_and_settings(data: DataConfig, model_dir: str) -> tuple[dict, dict]:
    """({"train": paths, "valid": paths}, {"train": prepare's settings, "valid": ...}) of a config's data section.

    A mixture's "train" paths are all its sources' (``_train_sources`` parts them); with data.valid_fraction, "valid"
    is the same paths, read for their held-out documents, and "train" for every other.
    """
    train = list(data.corpus) or [SAMPLE_TRAIN]
    corpora = {"train": train, "valid": train if data.valid_fraction else data.valid_corpus or [SAMPLE_VALID]}
    shared = dict(
        tokenizer_dir=_tokenizer_dir(data, model_dir, train),
        max_seq_length=data.max_seq_length,
        objective=data.objective,
        short_seq_prob=data.short_seq_prob,
        seed=data.prepare_seed,
    )
    text_columns = {"train": data.text_column, "valid": data.valid_text_column or data.text_column}
    return corpora, {
        split: {
            **shared,
            "columns": Columns(text_columns[split], data.id_column),
            "split": _document_split(data, split),
        }
        for split in corpora
    }


def _train_sources(data: DataConfig, corpus: list) -> list[list]:
    """The training corpus as the sources it is drawn from: each of a mixture's, else the whole of it as one."""
    return [[path] for path in corpus] if isinstance(data.corpus, dict) else [corpus]


def _document_split(data: DataConfig, split: str) -> DocumentSplit | None:
    """Which side of data.valid_fraction's split a corpus is read for; None without one."""
    if not data.valid_fraction:
        return None
    if any(prepared_folder([path]) for path in data.corpus):
        raise UserError(
            "data.valid_fraction splits corpus text by documents, and a prepared folder is no longer "
            "text; give the text it was prepared from, or a held-out set as data.valid_corpus"
        )
    return DocumentSplit(data.valid_fraction, held_out=split == "valid")


def _tokenizer_dir(data: DataConfig, model_dir: str, train_corpus: list) -> Path:
    """data.tokenizer if set; else the tokenizer of train.init's model (``model_dir``; the same vocabulary is
    required if both are set: train/init.py); else a prepared training set's own; else the bundled vocabulary."""
    if data.tokenizer:
        return tokenizer_dir_for(data.tokenizer)
    if model_dir:
        return standalone_tokenizer(Path(model_dir))
    folder = prepared_folder(train_corpus)
    return TokenStore(folder).tokenizer_dir if folder else tokenizer_dir_for("")


def prepare_datasets(data: DataConfig, model_dir: str = "", show_progress: bool = False):
    """(train store, valid TokenStore, tokenizer) for a config's data section, preparing what is missing; the train
    store of a mixture is a MixedStore of its sources' TokenStores."""
    corpora, settings = _corpora_and_settings(data, model_dir)
    parts = [(source, "train") for source in _train_sources(data, corpora["train"])] + [(corpora["valid"], "valid")]
    for corpus, split in parts:  # all, before minutes of preparing the first
        if not prepared_folder(corpus):
            refuse_missing_fields(corpus, settings[split]["columns"], COLUMN_KEYS[split])
    if data.corpus and not (data.valid_corpus or data.valid_fraction) and PartialState().is_main_process:
        log.warning(
            "mlmlab: warning: held-out figures come from the sample bundled with mlmlab (Wikipedia), not from "
            "data.corpus; set data.valid_corpus=FILES, or data.valid_fraction=0.02 to hold out 2% of its documents"
        )
    workers = data.prepare_workers or None  # None: every core
    stores = [_token_store(corpus, settings[split], workers, show_progress) for corpus, split in parts]
    tokenizer_dir = settings["train"]["tokenizer_dir"]
    tokenizer = load_tokenizer(tokenizer_dir)
    expected = vocab_hash(tokenizer.get_vocab())
    for store in stores:
        require_vocab(store, expected, f"data.tokenizer ({tokenizer_dir})")
    *sources, valid = stores
    train = MixedStore(sources, list(data.corpus.values())) if isinstance(data.corpus, dict) else sources[0]
    if isinstance(train, MixedStore) and PartialState().is_main_process:
        for note in never_drawn_notes(data.corpus, train):
            log.warning(note)
    return train, valid, tokenizer


def never_drawn_notes(corpus: dict, mixture: MixedStore) -> list[str]:
    """A warning line for each source of ``mixture`` whose weight's share of an epoch rounds to no draw."""
    epoch, total = len(mixture), sum(corpus.values())
    return [
        f"mlmlab: warning: data.corpus source {source} weighs {weight:g} of {total:g}, less than one of an epoch's "
        f"{epoch:,} draws, so it is never drawn (the model card leaves it out of the training data); give it a "
        f"weight above {total / epoch:.3g}, or leave it out"
        for (source, weight), draws in zip(corpus.items(), mixture.quotas)
        if not draws
    ]


# The config keys that name each split's text field, for the refusal to name the one to change.
COLUMN_KEYS = {"train": "data.text_column", "valid": "data.valid_text_column"}


def require_vocab(store: TokenStore, expected: str, whose: str) -> None:
    """Refuse data tokenized with another vocabulary than ``whose`` (a size check misses a renumbered one)."""
    if store.vocab_hash != expected:
        raise UserError(
            f"{store.path} was tokenized with another vocabulary than {whose} (vocabulary hash "
            f"{store.vocab_hash}, expected {expected}); prepare the data again with that tokenizer"
        )


def _token_store(corpus: list, settings: dict, workers: int | None, show_progress: bool) -> TokenStore:
    """A prepared folder given as the corpus, checked against the data section; else the corpus, prepared."""
    folder = prepared_folder(corpus)
    if folder is None:
        return TokenStore(prepare(corpus, num_workers=workers, show_progress=show_progress, **settings))
    store = TokenStore(folder)
    _require_build_settings(store, settings)
    return store


# What a prepared folder was built with, and the data keys that must say the same: the run's recorded
# config then describes the data it trained on (the objective and length also decide how it trains).
_BUILD_KEYS = {
    "objective": "data.objective",
    "max_seq_length": "data.max_seq_length",
    "short_seq_prob": "data.short_seq_prob",
    "seed": "data.prepare_seed",
}


def _require_build_settings(store: TokenStore, settings: dict) -> None:
    built = store.meta["config"]
    for name, key in _BUILD_KEYS.items():
        if built[name] != settings[name]:
            raise UserError(
                f"{store.path} was prepared with {name} {built[name]!r}, but {key}={settings[name]!r}; "
                f"set {key}={built[name]} to train on it, or give the corpus it was prepared from"
            )


def dataset_hashes(data: DataConfig, model_dir: str = "") -> dict:
    """{"train": hash, "valid": hash} of the datasets ``prepare_datasets`` would give, without preparing them."""
    corpora, settings = _corpora_and_settings(data, model_dir)
    sources = [_dataset_hash(source, settings["train"]) for source in _train_sources(data, corpora["train"])]
    train = mixture_hash(sources, list(data.corpus.values())) if isinstance(data.corpus, dict) else sources[0]
    return {"train": train[:16], "valid": _dataset_hash(corpora["valid"], settings["valid"])[:16]}


def _dataset_hash(corpus: list, settings: dict) -> str:
    folder = prepared_folder(corpus)
    return TokenStore(folder).meta["hash"] if folder else prepared_hash(corpus, **settings)
