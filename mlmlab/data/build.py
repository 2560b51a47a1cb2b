"""Building a prepared dataset (store.py has its layout and reads it).

`prepare` streams the corpus in chunks of `docs_per_shard` documents and turns each chunk into
one shard: the chunk's documents are tokenized in pieces on every worker process, then one
worker builds the shard's instances from the whole chunk. The folder is published with one
atomic rename, so a folder with meta.json is always complete. The main process holds at
most two chunks plus per-shard counts, so memory does not grow with the corpus.

Limitation: a random NSP B is drawn from another document *of the same chunk*, not of
the whole corpus; chunks are large (2000 documents by default), so a model cannot
exploit this, and it is what lets chunks be built independently and in parallel. A last
chunk holding a single document gives no NSP pairs (it has no random B to balance them).
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import multiprocessing
import multiprocessing.pool
import os
import shutil
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from itertools import chain, count, islice
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from mlmlab import choices
from mlmlab.data.corpus import document_sentences, named_files, read_paragraph_documents, resolve_paths
from mlmlab.data.hashing import BuildConfig, dataset_hash
from mlmlab.data.instances import IS_NEXT, NO_NSP_LABEL, RANDOM_NEXT, create_mlm_blocks, create_nsp_instances
from mlmlab.data.records import Columns
from mlmlab.data.split import DocumentSplit, split_documents
from mlmlab.data.store import FORMAT_VERSION, SHARD_FIELDS, TokenStore
from mlmlab.data.tokenizer import load_tokenizer, vocab_hash
from mlmlab.errors import UserError, writes_of
from mlmlab.utils.devices import available_cores
from mlmlab.utils.files import building
from mlmlab.utils.progress import progress_bar, say
from mlmlab.utils.restoring import restoring
from mlmlab.utils.signals import ignore_stop_signals, stop_signals_held

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Chunk:
    """The documents of one shard, as read: shard ``index`` holds the corpus's documents from ``first_doc`` on."""

    index: int
    first_doc: int
    paragraph_docs: list[list[str]]


@dataclass(frozen=True)
class _ShardSpec:
    """What building any shard needs besides its documents."""

    config: BuildConfig
    out_dir: str
    cls_id: int
    sep_id: int
    vocab_size: int


@dataclass(frozen=True)
class _TokenizedPart:
    """Consecutive documents of a chunk, tokenized, as flat arrays: they cross between processes
    at numpy speed, where nested lists of ids took longer to unpickle than to build instances from."""

    tokens: np.ndarray  # int32[total ids]: every kept sentence's ids, concatenated
    sentence_lengths: np.ndarray  # int64[kept sentences]
    document_sizes: np.ndarray  # int64[kept documents]: sentences in each
    doc_ids: np.ndarray  # int64[kept documents]: index in the corpus

    @classmethod
    def joined(cls, parts: list[_TokenizedPart]) -> _TokenizedPart:
        """Consecutive parts as one."""
        return cls(*(np.concatenate([getattr(part, field.name) for part in parts]) for field in fields(cls)))

    def documents(self) -> list[list[list[int]]]:
        """Each kept document as its list of sentences' ids."""
        return _cut(_cut(self.tokens.tolist(), self.sentence_lengths), self.document_sizes)


def _cut(items: list, sizes: np.ndarray) -> list[list]:
    """``items`` cut into consecutive lists of ``sizes`` items each."""
    ends = np.cumsum(sizes).tolist()
    return [items[start:end] for start, end in zip([0, *ends[:-1]], ends)]


@dataclass(frozen=True)
class _ShardSummary:
    name: str
    num_documents: int
    num_instances: int
    num_instance_tokens: int
    num_random_next: int
    num_used_tokens: int  # corpus tokens placed in an instance of their own document (random Bs are copies)
    long_sentences: int  # sentences longer than an instance holds: cut (text without sentence ends?)
    one_sentence_documents: int  # nsp: never an A, so their text is only ever a random B
    token_counts: np.ndarray  # int64[vocab_size] over this chunk's corpus tokens
    max_id: int  # the largest token id written (-1: none), checked again when the shard is loaded


def cache_root() -> Path:
    """Where hash-named datasets live when no out_dir is given."""
    return Path(os.environ.get("MLMLAB_CACHE") or Path.home() / ".cache" / "mlmlab" / "prepared")


def prepare(
    corpus_paths: str | Path | Iterable[str | Path],
    tokenizer_dir: str | Path,
    max_seq_length: int,
    objective: str = choices.NSP,
    short_seq_prob: float = 0.1,
    seed: int = 12345,
    out_dir: str | Path | None = None,
    num_workers: int | None = None,
    docs_per_shard: int = 2000,
    columns: Columns = Columns(),
    unk_marker: str = "",
    split: DocumentSplit | None = None,
    show_progress: bool = False,
) -> Path:
    """Build (or reuse) the prepared dataset for these inputs and settings; return its folder.

    ``columns``: the text and document-id fields of JSONL and table inputs. ``unk_marker``:
    the corpus's own word for an unknown word (WikiText's ``<unk>``), encoded as the [UNK] id.
    ``split``: only the corpus's documents on one side of its held-out split (data/split.py); None: every one.
    ``show_progress``: a bar of the documents read on stderr, and a line saying what is prepared into the cache.
    """
    config = _validated_config(objective, max_seq_length, short_seq_prob, seed, docs_per_shard)
    num_workers = _validated_workers(num_workers)
    paths = resolve_paths(corpus_paths)
    tokenizer_dir = Path(tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    digest = dataset_hash(paths, tokenizer_dir, config, columns, unk_marker, split)
    target = Path(out_dir) if out_dir is not None else cache_root() / digest[:16]
    if _holds_dataset(target, digest):
        log.info("reusing prepared dataset %s", target)
        return target
    # Into the cache, unasked: where it goes is news (--out named it). A line, so logs have it too.
    say(
        f"preparing {named_files(paths)} into {target} (the cache; MLMLAB_CACHE moves it)",
        show_progress and out_dir is None,
    )
    kept = (
        f"nothing is left at {target} (a prepared folder is renamed into place only when whole); the corpus is intact"
    )
    with (
        writes_of(f"the prepared dataset {target}", kept),
        building(target) as staging,
        progress_bar("prepare", None, show_progress, unit="doc") as bar,
    ):
        _build(paths, columns, unk_marker, split, tokenizer, tokenizer_dir, config, digest, staging, num_workers, bar)
    _holds_dataset(target, digest)  # refuses a different dataset that a concurrent writer published there
    return target


def prepared_hash(
    corpus_paths,
    tokenizer_dir: str | Path,
    max_seq_length: int,
    objective: str = choices.NSP,
    short_seq_prob: float = 0.1,
    seed: int = 12345,
    docs_per_shard: int = 2000,
    columns: Columns = Columns(),
    unk_marker: str = "",
    split: DocumentSplit | None = None,
) -> str:
    """The hash ``prepare`` would give these inputs and settings, without preparing anything."""
    config = _validated_config(objective, max_seq_length, short_seq_prob, seed, docs_per_shard)
    return dataset_hash(resolve_paths(corpus_paths), Path(tokenizer_dir), config, columns, unk_marker, split)


def _validated_config(objective, max_seq_length, short_seq_prob, seed, docs_per_shard) -> BuildConfig:
    if objective not in choices.OBJECTIVES:
        raise UserError(f"objective {objective!r} is unknown; choose {choices.listed(choices.OBJECTIVES)}")
    if not 8 <= max_seq_length <= 65535:
        raise UserError(f"max_seq_length {max_seq_length} is out of range; use 8..65535 (BERT uses 128 then 512)")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise UserError(f"short_seq_prob {short_seq_prob} is not a probability; use a value in [0, 1] (BERT: 0.1)")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise UserError(f"seed {seed!r} must be a non-negative integer")
    if docs_per_shard < 2:
        raise UserError(f"docs_per_shard {docs_per_shard} is too small; random NSP pairs need >= 2 (default 2000)")
    return BuildConfig(objective, int(max_seq_length), float(short_seq_prob), int(seed), int(docs_per_shard))


def _validated_workers(num_workers: int | None) -> int:
    if num_workers is None:
        return available_cores()
    if num_workers < 1:
        raise UserError(f"num_workers {num_workers} must be at least 1")
    return num_workers


def _holds_dataset(target: Path, digest: str) -> bool:
    """True when target is a complete dataset with this hash; refuse anything else non-empty."""
    if not target.exists():
        return False
    if not target.is_dir():
        raise UserError(f"{target} is a file, not a dataset folder; give a new or empty folder as out_dir")
    if (target / "meta.json").is_file():
        found = TokenStore(target).meta["hash"]
        if found == digest:
            return True
        raise UserError(
            f"{target} holds a dataset prepared from other inputs or settings (hash {found[:16]}, "
            f"these give {digest[:16]}); pass another out_dir or delete that folder"
        )
    if any(target.iterdir()):
        raise UserError(f"{target} exists and is not a prepared mlmlab dataset; give a new or empty folder as out_dir")
    return False


def _build(
    paths, columns, unk_marker, split, tokenizer, tokenizer_dir, config, digest, staging: Path, num_workers: int, bar
) -> None:
    shutil.copytree(tokenizer_dir, staging / "tokenizer")
    vocab_size = len(tokenizer)
    spec = _ShardSpec(config, str(staging), tokenizer.cls_token_id, tokenizer.sep_token_id, vocab_size)
    initargs = (tokenizer.backend_tokenizer.to_str(), unk_marker, tokenizer.unk_token_id)
    with _worker_pool(num_workers, initargs) as pool:
        chunks = _counted(_chunks(paths, columns, split, config.docs_per_shard), bar)
        totals = _accumulate(_built_shards(pool, chunks, spec, pieces=num_workers), vocab_size, bar)
    if totals["num_instances"] == 0:
        raise UserError(
            f"no {config.objective} training instance could be made from {', '.join(p.name for p in paths)}: "
            "the documents are too short or too few (NSP needs at least two documents, one of them with "
            "two or more sentences); use more text"
        )
    np.save(staging / "token_counts.npy", totals.pop("token_counts"))
    meta = {
        "format_version": FORMAT_VERSION,
        "hash": digest,
        "config": asdict(config),
        "corpus": [str(p.resolve()) for p in paths],
        **({} if columns.is_default else {"columns": asdict(columns)}),
        **({"unk_marker": unk_marker} if unk_marker else {}),
        **({"split": asdict(split)} if split else {}),
        "vocab_size": vocab_size,
        "vocab_hash": vocab_hash(tokenizer.get_vocab()),
        "token_dtype": _token_dtype(vocab_size).__name__,
        # the tokenizer's own special tokens by name ([PAD] or <pad>, ...), and the padding id by role
        "special_token_ids": {token: tokenizer.convert_tokens_to_ids(token) for token in tokenizer.all_special_tokens},
        "pad_token_id": tokenizer.pad_token_id,
        **totals,
    }
    # meta.json is written last: its presence marks the folder complete.
    (staging / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    if warning := lost_text_warning(meta):
        log.warning(warning)


# Used share of the corpus's tokens below which prepare warns. Measured on the bundled sample
# (max_seq_length 128): nsp 0.92, mlm 1.00; the two losses the warning names cost far more.
LOW_USE = 0.8


def token_use(meta: dict) -> str:
    """ "N corpus tokens, M (P%) in instances" from a dataset's meta (empty for folders made before it was counted)."""
    if "num_used_tokens" not in meta:
        return ""
    corpus, used = meta["num_corpus_tokens"], meta["num_used_tokens"]
    return f"{corpus:,} corpus tokens, {used:,} ({used / max(corpus, 1):.0%}) in instances"


def lost_text_warning(meta: dict) -> str | None:
    """A one-line warning when much of the corpus is in no instance, with the likely causes; else None."""
    if meta["num_used_tokens"] >= LOW_USE * meta["num_corpus_tokens"]:
        return None
    causes = []
    if meta["long_sentences"]:
        causes.append(
            f"{meta['long_sentences']:,} sentence(s) longer than an instance were cut (text without "
            "sentence ends? put one sentence or paragraph per line)"
        )
    if meta["one_sentence_documents"]:
        causes.append(
            f"{meta['one_sentence_documents']:,} document(s) of one sentence give no NSP pair (sentences are "
            "split at . ! ? before a capital letter: lowercased text is not split; put one sentence per line)"
        )
    return f"mlmlab: warning: only {token_use(meta)}; {'; '.join(causes) or 'instances were truncated'}"


def _chunks(paths, columns, split: DocumentSplit | None, docs_per_shard: int) -> Iterator[_Chunk]:
    documents = read_paragraph_documents(paths, columns)
    if split is not None:
        documents = split_documents(documents, split)
    first_doc = 0
    for index in count():
        paragraph_docs = list(islice(documents, docs_per_shard))
        if not paragraph_docs:
            return
        yield _Chunk(index, first_doc, paragraph_docs)
        first_doc += len(paragraph_docs)


def _counted(chunks: Iterable[_Chunk], bar) -> Iterator[_Chunk]:
    """The chunks, each counted on the bar as it is read (up to two chunks ahead of the shards built)."""
    for chunk in chunks:
        bar.update(len(chunk.paragraph_docs))
        yield chunk


def _built_shards(pool, chunks: Iterable[_Chunk], spec: _ShardSpec, pieces: int) -> Iterator[_ShardSummary]:
    """Every chunk tokenized in ``pieces`` parts across the pool, then built into its shard; summaries in order.

    The pool's queue is first in, first out: chunk k's build is queued behind chunk k+1's
    pieces, so every worker stays busy, and a corpus of a single chunk still uses every core.
    A shard depends only on its chunk's documents and index, never on how they were split
    for tokenizing, so the data is the same whatever the number of workers.
    """
    tokenizing: deque = deque()  # (chunk, its pieces' pending results): at most two chunks
    building: deque = deque()  # pending shard summaries, in chunk order
    for chunk in chunks:
        parts = [pool.apply_async(_tokenize, part) for part in _split(chunk, pieces)]
        tokenizing.append((chunk, parts))
        if len(tokenizing) > 1:
            building.append(_build_async(pool, *tokenizing.popleft(), spec))
        if len(building) > 1:
            yield building.popleft().get()
    while tokenizing:
        building.append(_build_async(pool, *tokenizing.popleft(), spec))
    while building:
        yield building.popleft().get()


def _split(chunk: _Chunk, pieces: int) -> list[tuple[list[list[str]], int]]:
    """(paragraph documents, corpus index of the first) of up to ``pieces`` consecutive parts of a chunk."""
    size = -(-len(chunk.paragraph_docs) // pieces)  # ceiling: no part is empty
    return [
        (chunk.paragraph_docs[start : start + size], chunk.first_doc + start)
        for start in range(0, len(chunk.paragraph_docs), size)
    ]


def _build_async(pool, chunk: _Chunk, parts: list, spec: _ShardSpec):
    """Wait for a chunk's tokenized parts, then queue the build of its shard; the pending summary."""
    tokenized = [part.get() for part in parts]
    return pool.apply_async(_build_shard, (chunk.index, len(chunk.paragraph_docs), tokenized, spec))


def _accumulate(summaries: Iterable[_ShardSummary], vocab_size: int, bar) -> dict:
    totals = {
        "num_documents": 0,
        "num_instances": 0,
        "num_instance_tokens": 0,
        "num_random_next": 0,
        "num_used_tokens": 0,
        "long_sentences": 0,
        "one_sentence_documents": 0,
    }
    counts = np.zeros(vocab_size, dtype=np.int64)
    shards = []
    for summary in summaries:
        for key in totals:
            totals[key] += getattr(summary, key)
        counts += summary.token_counts
        # max_id is not part of the dataset's hash (dataset_hash): folders prepared before it was recorded keep theirs.
        shards.append({"name": summary.name, "num_instances": summary.num_instances, "max_id": summary.max_id})
        log.info("shard %s: %d instances", summary.name, summary.num_instances)
        bar.set_postfix(shards=len(shards), instances=totals["num_instances"])
    return {**totals, "num_corpus_tokens": int(counts.sum()), "shards": shards, "token_counts": counts}


def _token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 65536 else np.int32


# Worker side. Each worker process parses the tokenizer once (initializer), then tokenizes
# parts of chunks and builds shards; a shard's summary is all that travels back from a build.
_worker_tokenizer: Tokenizer | None = None
_worker_unk: tuple[str, int] = ("", 0)  # (the corpus's unknown-word marker, the [UNK] id)


def _worker_pool(num_workers: int, initargs: tuple) -> multiprocessing.pool.Pool:
    """The workers, started with the job's stop signals held back until ``_init_worker`` has them ignored."""
    with stop_signals_held():
        return _KillingPool(num_workers, _init_worker, initargs, context=multiprocessing.get_context())


class _KillingPool(multiprocessing.pool.Pool):
    """A pool that stops its workers with SIGKILL.

    They let SIGTERM pass unless their parent sent it, but a SIGTERM of the pool's that arrives
    while one of the job's is still pending merges with it (signals do not queue): the worker
    would read it as the job's, stay, and the pool would wait for it forever.
    """

    @staticmethod
    def Process(ctx, *args, **kwds):
        process = ctx.Process(*args, **kwds)
        process.terminate = process.kill
        return process


def _init_worker(tokenizer_json: str, unk_marker: str, unk_id: int) -> None:
    global _worker_tokenizer, _worker_unk
    ignore_stop_signals()  # the main process stops the pool; a worker dead of the job's signal would hang it
    # The pool already uses every worker core; nested Rust threads would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)
    # Corpus text that literally says "[MASK]" or "[SEP]" is text, not a special token.
    _worker_tokenizer.encode_special_tokens = True
    _worker_unk = (unk_marker, unk_id)


def _without_gc(function):
    """``function`` with the cyclic garbage collector paused while it runs.

    Tokenizing and building instances create hundreds of thousands of lists and no reference
    cycles; the collector's passes over them took 75% of turning a chunk's arrays into
    documents (0.23 s of which 0.056 s without it, 2,000 documents of the bundled sample).
    """

    @functools.wraps(function)
    def paused(*args, **kwargs):
        with restoring(gc.isenabled, lambda on: gc.enable() if on else gc.disable(), False):
            return function(*args, **kwargs)

    return paused


@_without_gc
def _build_shard(index: int, num_documents: int, parts: list[_TokenizedPart], spec: _ShardSpec) -> _ShardSummary:
    config, chunk = spec.config, _TokenizedPart.joined(parts)
    documents, doc_ids = chunk.documents(), chunk.doc_ids.tolist()
    if config.objective == choices.NSP:
        # Keyed by chunk index, so shards do not depend on the number of workers.
        rng = np.random.default_rng([config.seed, index])
        instances = create_nsp_instances(
            documents, doc_ids, config.max_seq_length, config.short_seq_prob, spec.cls_id, spec.sep_id, rng
        )
    else:
        instances = create_mlm_blocks(documents, doc_ids, config.max_seq_length, spec.cls_id, spec.sep_id)
    name = f"shard_{index:05d}"
    _write_shard(Path(spec.out_dir) / name, instances, _token_dtype(spec.vocab_size))
    # Counted from what was built, after it was built: the instances themselves are unaffected.
    room = config.max_seq_length - (3 if config.objective == choices.NSP else 2)
    return _ShardSummary(
        name=name,
        num_documents=num_documents,
        num_instances=len(instances),
        num_instance_tokens=sum(len(x.input_ids) for x in instances),
        num_random_next=sum(x.next_sentence_label == RANDOM_NEXT for x in instances),
        num_used_tokens=sum(_own_tokens(x, spec.sep_id) for x in instances),
        long_sentences=int((chunk.sentence_lengths > room).sum()),
        one_sentence_documents=int((chunk.document_sizes == 1).sum()) if config.objective == choices.NSP else 0,
        token_counts=np.bincount(chunk.tokens, minlength=spec.vocab_size),
        max_id=max((max(x.input_ids) for x in instances), default=-1),
    )


def _own_tokens(instance, sep_id: int) -> int:
    """Corpus tokens of an instance that come from its own document: not specials, not a random B."""
    if instance.next_sentence_label == NO_NSP_LABEL:  # a packed block: [SEP] also separates its documents
        return sum(token != sep_id for token in instance.input_ids[1:-1])
    b_tokens = len(instance.input_ids) - instance.a_len - 1
    return instance.a_len - 2 + (b_tokens if instance.next_sentence_label == IS_NEXT else 0)


@_without_gc
def _tokenize(paragraph_docs: list[list[str]], first_doc: int) -> _TokenizedPart:
    """Sentence-split and tokenize; drop sentences with no tokens and documents with none left."""
    sentence_docs = [document_sentences(paragraphs) for paragraphs in paragraph_docs]
    flat = [sentence for sentences in sentence_docs for sentence in sentences]
    encoded = iter(_encoded(flat))
    kept: list[list[int]] = []
    document_sizes, doc_ids = [], []
    for position, sentences in enumerate(sentence_docs):
        segments = [ids for ids in (next(encoded) for _ in sentences) if ids]
        if segments:
            kept += segments
            document_sizes.append(len(segments))
            doc_ids.append(first_doc + position)
    return _TokenizedPart(
        tokens=np.fromiter(chain.from_iterable(kept), dtype=np.int32),
        sentence_lengths=np.array([len(ids) for ids in kept], dtype=np.int64),
        document_sizes=np.array(document_sizes, dtype=np.int64),
        doc_ids=np.array(doc_ids, dtype=np.int64),
    )


def _encoded(sentences: list[str]) -> list[list[int]]:
    """Each sentence's ids, the corpus's unknown-word marker (if it has one) as the [UNK] id.

    The marker cannot be left to the tokenizer: as text, WikiText's ``<unk>`` (or a literal
    "[UNK]", since special tokens in corpus text are text) becomes 3-4 ordinary wordpieces, and
    a perplexity would score the model on predicting a placeholder that no real text holds.
    """
    marker, unk_id = _worker_unk
    if not marker:
        return _ids(sentences)
    pieces = [sentence.split(marker) for sentence in sentences]
    ids = iter(_ids(list(chain.from_iterable(pieces))))
    return [_joined([next(ids) for _ in parts], unk_id) for parts in pieces]


def _ids(texts: list[str]) -> list[list[int]]:
    # _fast: the same ids without character offsets, which nothing here reads.
    return [encoding.ids for encoding in _worker_tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


def _joined(piece_ids: list[list[int]], separator: int) -> list[int]:
    """The pieces' ids with ``separator`` between consecutive pieces."""
    if len(piece_ids) == 1:
        return piece_ids[0]
    return [*piece_ids[0], *chain.from_iterable((separator, *ids) for ids in piece_ids[1:])]


def _write_shard(shard_dir: Path, instances, token_dtype: type) -> None:
    shard_dir.mkdir()
    lengths = np.array([len(x.input_ids) for x in instances], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    arrays = {
        "input_ids": np.fromiter(chain.from_iterable(x.input_ids for x in instances), token_dtype, int(offsets[-1])),
        "offsets": offsets,
        "a_len": np.array([x.a_len for x in instances], dtype=np.int32),
        "nsp_label": np.array([x.next_sentence_label for x in instances], dtype=np.int8),
        "doc_a": np.array([x.doc_a for x in instances], dtype=np.int64),
        "doc_b": np.array([x.doc_b for x in instances], dtype=np.int64),
        "seg_a": np.array([x.seg_a for x in instances], dtype=np.int32).reshape(-1, 2),
        "seg_b": np.array([x.seg_b for x in instances], dtype=np.int32).reshape(-1, 2),
    }
    for field in SHARD_FIELDS:
        np.save(shard_dir / f"{field}.npy", arrays[field])
