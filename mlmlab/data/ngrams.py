"""PMI-Masking's n-gram vocabulary (Levine et al. 2021, "PMI-Masking: Principled masking of correlated spans",
ICLR 2021): the word n-grams of the training corpus that co-occur far above chance, built once and kept
beside the prepared data.

The method, with the paper's defaults (its section 3 and its released lists' README):
- word n-grams of n = 2..5 words that occur over 10 times in the corpus;
- each ranked by PMI_n(w1..wn) = min over segmentations σ of w1..wn into two or more contiguous parts of
  log p(w1..wn) / Π_{s in σ} p(s): an n-gram counts as a collocation only if no way of cutting it explains
  its frequency, so "the united states" is not ranked by "united states" alone;
- one ranking per length (PMI_n grows with n), merged as 50% bigrams, 25% trigrams and 12.5% each of 4- and
  5-grams (generally: each next length half the previous share, the last two equal), 800k n-grams in all.
Probabilities are counts over the number of word positions. The paper's released lists multiply in
p(w1..wn) as well; this is the published PMI_n. Counts come from the prepared instances (what training reads),
between special tokens: an n-gram never spans two segments.

Words are whole words by the tokenizer's own boundaries (a per-id "continues a word" table), each as its
token ids, so the vocabulary matches any tokenizer's output exactly.
"""

import hashlib
import json
import logging
import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from mlmlab.errors import UserError
from mlmlab.utils.files import write_text_atomically

METHOD_VERSION = 1  # bump when counting or ranking changes: the cached vocabularies are then built again
FILE_FORMAT = 2  # the kept file's layout (2: with its format, vocabulary size and checksum); another one is rebuilt
FOLDER = "ngrams"  # inside the prepared dataset's folder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NgramSettings:
    """What decides the vocabulary besides the corpus (masking.pmi_*)."""

    size: int = 800000
    min_n: int = 2
    max_n: int = 5
    min_count: int = 11


def vocabulary_path(store, settings: NgramSettings) -> Path:
    """Where the vocabulary of ``store`` (a TokenStore) under ``settings`` is kept: named by a hash of the
    prepared data's own hash, the settings and the method, so a changed setting builds another one."""
    identity = {"data": store.meta["hash"], "method": METHOD_VERSION, **asdict(settings)}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return store.path / FOLDER / f"{digest}.json"


def ngram_vocabulary(store, settings: NgramSettings, continues: np.ndarray, special_ids) -> list[dict]:
    """The vocabulary, best first: {"words": [[token ids] per word], "count", "pmi_n"} per n-gram; read from
    beside ``store`` (a TokenStore), or built from it once and kept there.

    continues: (V,) bool, True for the ids that continue a word; special_ids: the ids that end a segment.
    """
    path = vocabulary_path(store, settings)
    if path.is_file():
        kept, damage = read_kept_vocabulary(path, settings, len(continues))
        if damage is None:
            return kept
        log.warning(f"mlmlab: warning: the PMI n-gram vocabulary {path} is damaged ({damage}); building it again")
    ngrams = build_vocabulary(_segments(store, continues, special_ids), settings)
    kept = {
        "format": FILE_FORMAT,
        "settings": asdict(settings),
        "vocab_size": len(continues),
        "checksum": _checksum(ngrams),
        "ngrams": ngrams,
    }
    try:
        path.parent.mkdir(exist_ok=True)
        write_text_atomically(path, json.dumps(kept))
    except OSError as error:
        raise UserError(
            f"cannot keep the PMI n-gram vocabulary beside the prepared data in {store.path} ({error.strerror}); "
            "prepare the corpus into a folder you can write to"
        ) from error
    return ngrams


def read_kept_vocabulary(path: Path, settings: NgramSettings, vocab_size: int) -> tuple[list[dict] | None, str | None]:
    """(the n-grams kept at ``path``, None), or (None, what is wrong with the file): cut short, another format or
    settings, a checksum that does not match, or entries that are not n-grams of ids below ``vocab_size``."""
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return None, f"truncated or not JSON: {err}"
    if not isinstance(kept, dict) or kept.get("format") != FILE_FORMAT:
        return None, f"not a format-{FILE_FORMAT} vocabulary file"
    if kept.get("settings") != asdict(settings) or kept.get("vocab_size") != vocab_size:
        return None, f"made for other settings: {kept.get('settings')}, vocabulary size {kept.get('vocab_size')}"
    ngrams = kept.get("ngrams")
    if kept.get("checksum") != _checksum(ngrams):
        return None, "its checksum does not match its n-grams"
    if not isinstance(ngrams, list) or not all(_is_ngram(entry, settings, vocab_size) for entry in ngrams):
        return None, f"an entry is not an n-gram of {settings.min_n}-{settings.max_n} words of ids below {vocab_size}"
    return ngrams, None


def _is_ngram(entry, settings: NgramSettings, vocab_size: int) -> bool:
    words = entry.get("words") if isinstance(entry, dict) else None
    return (
        isinstance(words, list)
        and settings.min_n <= len(words) <= settings.max_n
        and all(isinstance(word, list) and word for word in words)
        and all(type(token) is int and 0 <= token < vocab_size for word in words for token in word)
    )


def _checksum(ngrams) -> str:
    return hashlib.sha256(json.dumps(ngrams, sort_keys=True).encode()).hexdigest()


def _segments(store, continues: np.ndarray, special_ids):
    """Each run of words between special tokens of every instance, as a list of words (tuples of ids)."""
    specials = np.asarray(sorted(special_ids))
    for index in range(len(store)):
        ids = store[index]["input_ids"]  # (T,)
        special = np.isin(ids, specials)
        for run in np.split(ids, np.flatnonzero(special)):
            run = run[~np.isin(run, specials)]
            if len(run):
                begins = np.flatnonzero(~continues[run.clip(max=len(continues) - 1)] | (np.arange(len(run)) == 0))
                yield [tuple(word.tolist()) for word in np.split(run, begins[1:])]


def build_vocabulary(segments, settings: NgramSettings) -> list[dict]:
    """The vocabulary of ``segments`` (runs of words, each word a tuple of ids): see the module's docstring."""
    word_ids, counts, positions = {}, Counter(), 0
    for segment in segments:
        ids = [word_ids.setdefault(word, len(word_ids)) for word in segment]
        positions += len(ids)
        for n in range(1, settings.max_n + 1):
            counts.update(zip(*(ids[i:] for i in range(n))))
    words = list(word_ids)  # id -> word
    ranked = {n: [] for n in range(settings.min_n, settings.max_n + 1)}
    for gram, count in counts.items():
        if len(gram) >= settings.min_n and count >= settings.min_count:
            ranked[len(gram)].append((pmi_n(gram, counts, positions), count, gram))
    chosen = []
    for n, quota in zip(ranked, length_quotas(settings)):
        best = sorted(ranked[n], key=lambda item: (-item[0], -item[1], item[2]))[:quota]
        chosen += [{"words": [list(words[w]) for w in gram], "count": count, "pmi_n": pmi} for pmi, count, gram in best]
    return sorted(chosen, key=lambda entry: -entry["pmi_n"])


def length_quotas(settings: NgramSettings) -> list[int]:
    """How many n-grams of each length n = min_n..max_n: halving shares, the last two equal (the paper's 2..5:
    50%, 25%, 12.5%, 12.5%)."""
    lengths = settings.max_n - settings.min_n + 1
    shares = [0.5**i for i in range(1, lengths)] + [0.5 ** (lengths - 1)]
    return [round(settings.size * share) for share in shares]


def pmi_n(gram: tuple, counts: Counter, positions: int) -> float:
    """PMI_n: log p(gram) minus the best log-probability of any segmentation of it into two or more parts.

    Dynamic programming over prefixes: best[i] = the most probable segmentation of gram[:i]; every part
    of a counted n-gram is itself counted (at least as often).
    """
    n, log_total = len(gram), math.log(positions)
    best = [0.0] + [-math.inf] * n
    for end in range(1, n + 1):
        for start in range(end):
            if (start, end) != (0, n):  # the n-gram itself is not a segmentation of it
                part = math.log(counts[gram[start:end]]) - log_total
                best[end] = max(best[end], best[start] + part)
    return math.log(counts[gram]) - log_total - best[n]


def ngram_text(entry: dict, tokenizer) -> str:
    """An n-gram as text, its words decoded by the tokenizer."""
    return " ".join(tokenizer.decode(word).strip() for word in entry["words"])
