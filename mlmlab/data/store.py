"""The prepared dataset: a folder of memory-mapped shards, named by a hash of what made it (hashing.py).

build.py writes the folder (``mlmlab prepare``); TokenStore reads it, checking what it reads.

Layout::

    <folder>/meta.json            hash, config, counts, special-token ids, shard list
    <folder>/token_counts.npy     int64[vocab_size]: corpus token frequencies
    <folder>/tokenizer/           copy of the tokenizer files (AutoTokenizer loads it)
    <folder>/shard_00000/         input_ids (flat), offsets, a_len, nsp_label, doc_a,
                                  doc_b, seg_a, seg_b (.npy each)
"""

from pathlib import Path

import numpy as np

from mlmlab.data.tokenizer import folder_vocab_hash
from mlmlab.errors import UserError
from mlmlab.utils.jsonio import read_json_file

# Bump whenever the shard layout or instance construction changes: old folders then
# get a new hash instead of being misread. 2: one-segment documents no longer give NSP pairs.
FORMAT_VERSION = 2
SHARD_FIELDS = ("input_ids", "offsets", "a_len", "nsp_label", "doc_a", "doc_b", "seg_a", "seg_b")


class TokenStore:
    """Random access to a prepared dataset; memmaps open lazily so the store pickles cheaply."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = _read_meta(self.path)
        counts = [shard["num_instances"] for shard in self.meta["shards"]]
        self._starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self._len = int(sum(counts))
        self._shards: dict[int, dict[str, np.ndarray]] = {}
        self._lengths: np.ndarray | None = None
        # Shards whose ids were checked (_check_ids); kept when pickled, so loader workers do not scan them again.
        self._checked: set[int] = set()

    def __getstate__(self) -> dict:
        # DataLoader workers re-open memmaps themselves instead of receiving copies.
        return {**self.__dict__, "_shards": {}, "_lengths": None}

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict:
        if not -self._len <= index < self._len:
            raise IndexError(f"instance {index} out of range for a store of {self._len}")
        index %= self._len
        shard_index = int(np.searchsorted(self._starts, index, side="right") - 1)  # skips empty shards
        local = index - int(self._starts[shard_index])
        shard = self._shard(shard_index)
        start, end = shard["offsets"][local : local + 2]
        input_ids = np.asarray(shard["input_ids"][start:end], dtype=np.int64)  # (T,)
        token_type_ids = np.zeros_like(input_ids)  # (T,)
        token_type_ids[int(shard["a_len"][local]) :] = 1
        seg_a, seg_b = shard["seg_a"][local], shard["seg_b"][local]
        return {
            "input_ids": input_ids,
            "token_type_ids": token_type_ids,
            "next_sentence_label": int(shard["nsp_label"][local]),
            "doc_a": int(shard["doc_a"][local]),
            "doc_b": int(shard["doc_b"][local]),
            "seg_a_start": int(seg_a[0]),
            "seg_a_end": int(seg_a[1]),
            "seg_b_start": int(seg_b[0]),
            "seg_b_end": int(seg_b[1]),
        }

    @property
    def lengths(self) -> np.ndarray:
        """int64[len(store)]: tokens per instance including specials (for length bucketing)."""
        if self._lengths is None:
            per_shard = [np.diff(self._shard(k)["offsets"]) for k in range(len(self._starts))]
            self._lengths = np.concatenate(per_shard) if per_shard else np.zeros(0, dtype=np.int64)
        return self._lengths

    @property
    def vocab_hash(self) -> str:
        """The identity of the vocabulary the data was tokenized with (tokenizer.vocab_hash)."""
        return self.meta.get("vocab_hash") or folder_vocab_hash(self.tokenizer_dir)  # older folders: from the copy

    @property
    def max_seq_length(self) -> int:
        return int(self.meta["config"]["max_seq_length"])

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    @property
    def token_counts(self) -> np.ndarray:
        return np.load(self.path / "token_counts.npy")

    def _shard(self, shard_index: int) -> dict[str, np.ndarray]:
        if shard_index not in self._shards:
            shard_dir = self.path / self.meta["shards"][shard_index]["name"]
            arrays = {f: np.load(shard_dir / f"{f}.npy", mmap_mode="r") for f in SHARD_FIELDS}
            if shard_index not in self._checked:
                self._check_ids(shard_index, arrays["input_ids"])
                self._checked.add(shard_index)
            self._shards[shard_index] = arrays
        return self._shards[shard_index]

    def _check_ids(self, shard_index: int, input_ids: np.ndarray) -> None:
        """Refuse a shard changed since prepare: an id the vocabulary lacks (a crash at step 1, or a wrong
        embedding), or a largest id other than the one prepare recorded. One pass over its ids, once:
        ``lengths`` opens every shard in the main process, and loader workers inherit ``_checked``."""
        shard = self.meta["shards"][shard_index]
        where = self.path / shard["name"] / "input_ids.npy"
        vocab_size = self.meta["vocab_size"]
        largest = int(input_ids.max()) if len(input_ids) else -1
        smallest = int(input_ids.min()) if len(input_ids) and input_ids.dtype.kind == "i" else 0  # uint16: never < 0
        if smallest < 0 or largest >= vocab_size:
            outside = smallest if smallest < 0 else largest
            raise UserError(
                f"{where} holds token id {outside}, outside the {vocab_size} ids of the vocabulary it was "
                f"prepared with: it was changed after `mlmlab prepare`; delete {self.path} and prepare again"
            )
        if shard.get("max_id", largest) != largest:  # folders prepared before max_id was recorded: the range check only
            raise UserError(
                f"{where} was changed after `mlmlab prepare` (its largest token id is {largest}, prepare "
                f"recorded {shard['max_id']}); delete {self.path} and prepare again"
            )


def _read_meta(path: Path) -> dict:
    """meta.json of a prepared folder, checked for format version and completeness."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise UserError(f"{path} is not a prepared mlmlab dataset (no meta.json); run `mlmlab prepare` first")
    meta = read_json_file(meta_path, f"delete {path} and run `mlmlab prepare` again")
    if problem := _meta_shape_problem(meta):
        raise UserError(
            f"{meta_path} is not what `mlmlab prepare` writes ({problem}); delete {path} and run `mlmlab prepare` again"
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{path} has dataset format {meta.get('format_version')} but this mlmlab reads format "
            f"{FORMAT_VERSION}; run `mlmlab prepare` again into a new folder"
        )
    for required in [Path("token_counts.npy"), Path("tokenizer")] + [
        Path(shard["name"]) / f"{field}.npy" for shard in meta["shards"] for field in SHARD_FIELDS
    ]:
        if not (path / required).exists():
            raise UserError(f"{path} is incomplete (missing {required}); delete it and run `mlmlab prepare` again")
        if required.suffix == ".npy" and not _complete_npy(path / required):
            raise UserError(f"{path / required} is truncated or corrupt; delete {path} and run `mlmlab prepare` again")
    return meta


# What every reader of meta.json takes as given: each key's type, and each shard's.
META_TYPES = {"hash": str, "config": dict, "vocab_size": int, "shards": list}
SHARD_TYPES = {"name": str, "num_instances": int}


def _meta_shape_problem(meta) -> str | None:
    """What is wrong with the shape of a meta.json (edited by hand, or another program's); None when nothing is."""
    if not isinstance(meta, dict):
        return f"a {type(meta).__name__}, not a mapping"
    for key, kind in META_TYPES.items():
        if not isinstance(meta.get(key), kind):
            return f"{key} is {meta.get(key)!r}, not a {kind.__name__}"
    for number, shard in enumerate(meta["shards"]):
        if not isinstance(shard, dict) or not all(isinstance(shard.get(k), t) for k, t in SHARD_TYPES.items()):
            return f"shards[{number}] is {shard!r}, not a shard's name and num_instances"
    return None


def _complete_npy(path: Path) -> bool:
    """Whether a .npy file is as long as its header says (a cut file would fail later, in a loader worker)."""
    try:
        with open(path, "rb") as handle:
            major, _ = np.lib.format.read_magic(handle)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(handle)
            expected = handle.tell() + int(np.prod(shape)) * dtype.itemsize
    except (ValueError, OSError, EOFError):
        return False
    return path.stat().st_size == expected
