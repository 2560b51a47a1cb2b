"""Hostile inputs, as a new user would try them: one table, each case run in-process through the CLI.

Every case must end in exactly one line on stderr that starts "mlmlab: error:" and names the
problem, exit with its code (2: a mistake the user can fix), print no traceback, and leave the
earlier run's checkpoints and the prepared datasets as they were. One small trained run (a few
steps of a tiny model on the bundled validation sample) serves every case.

Below the table: inputs that used to break a run and must now work (a cut metrics line, a
resume into a new folder, a changed config, overrides after options, SIGTERM at the end, text
that prepare cannot use, concurrent cache writers, staging folders of killed writers).
"""

import builtins
import errno
import gzip
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import SAMPLE
from safetensors.torch import load_file, save_file

from mlmlab.cli import main
from mlmlab.config import load_config
from mlmlab.data.resolve import _cached_folder
from mlmlab.data.store import TokenStore
from mlmlab.train import run_folder
from mlmlab.train.loop import Trainer
from mlmlab.utils.files import staging_folder

CORPUS = SAMPLE / "valid.txt.gz"  # 0.4 MB of text: prepares in about a second
TINY = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.intermediate_size=64",
    "train.batch_size=8",
    "train.eval_batches=2",
    "train.eval_every=0",
    "train.warmup_steps=1",
    "train.log_every=1",
    "data.loader_workers=0",
    f"data.corpus={CORPUS}",
    f"data.valid_corpus={CORPUS}",
]


def pretrain_argv(out_dir: Path, *overrides: str) -> list[str]:
    return [
        "pretrain",
        "--no-progress",
        *TINY,
        "train.max_steps=4",
        "train.save_every=2",
        f"train.out_dir={out_dir}",
        *overrides,
    ]


@dataclass(frozen=True)
class World:
    """What the cases attack and must leave intact."""

    root: Path
    run: Path  # a finished 4-step run: ckpt-2, ckpt-4, model/
    tokenizer: Path
    data: Path  # the validation sample prepared with the bundled vocabulary
    renumbered_vocab: Path  # the bundled vocabulary with two tokens swapped: same size, another vocabulary
    renumbered_data: Path  # the same text prepared with it
    glue: Path  # a GLUE folder with a small SST-2

    @property
    def model(self) -> Path:
        return self.run / "model"

    def fingerprint(self) -> dict:
        folders = (self.run, self.data, self.renumbered_data, self.tokenizer)
        return {
            str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in folders
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }


def write_glue_task(folder: Path, rows: int = 24) -> None:
    folder.mkdir(parents=True)
    lines = "".join(f"a {'good' if i % 2 else 'bad'} film number {i}\t{i % 2}\n" for i in range(rows))
    for name in ("train.tsv", "dev.tsv"):
        (folder / name).write_text("sentence\tlabel\n" + lines)


pytestmark = pytest.mark.usefixtures("no_progress_bars")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("hostile")
    vocab = (SAMPLE / "vocab.txt").read_text().splitlines()
    vocab[2000], vocab[2001] = vocab[2001], vocab[2000]  # what a retrained WordPiece does to hundreds of ids
    (root / "renumbered.txt").write_text("\n".join(vocab) + "\n")
    for argv in (
        pretrain_argv(root / "run"),
        ["tokenizer", "--vocab", str(SAMPLE / "vocab.txt"), "--out", str(root / "tok")],
        ["tokenizer", "--vocab", str(root / "renumbered.txt"), "--out", str(root / "tok-renumbered")],
        [
            "prepare",
            "--corpus",
            str(CORPUS),
            "--tokenizer",
            str(root / "tok"),
            "--out",
            str(root / "data"),
            "--workers",
            "1",
        ],
        [
            "prepare",
            "--corpus",
            str(CORPUS),
            "--tokenizer",
            str(root / "tok-renumbered"),
            "--out",
            str(root / "data-renumbered"),
            "--workers",
            "1",
        ],
    ):
        assert main(argv) == 0, argv
    write_glue_task(root / "glue" / "SST-2")
    return World(
        root,
        root / "run",
        root / "tok",
        root / "data",
        root / "renumbered.txt",
        root / "data-renumbered",
        root / "glue",
    )


# ----- building hostile inputs: each returns the command line, writing what it needs under tmp -----
def copy_of(folder: Path, tmp: Path) -> Path:
    return Path(shutil.copytree(folder, tmp / folder.name))


def moved_run(w: World, tmp: Path) -> Path:
    """A copy of the world's run whose config.yaml names its new folder: the same run, moved."""
    run = copy_of(w.run, tmp)
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace(str(w.run), str(run)))
    return run


def truncated(path: Path, keep: float = 0.5) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def gz_cut_short(tmp: Path) -> Path:
    path = tmp / "cut.txt.gz"
    path.write_bytes(gzip.compress(gzip.decompress(CORPUS.read_bytes()))[:50_000])
    return path


def latin1_vocab(tmp: Path) -> Path:
    path = tmp / "vocab.txt"
    path.write_bytes((SAMPLE / "vocab.txt").read_bytes() + "caf\xe9\n".encode("latin-1"))
    return path


def vocab_with_blank_line(tmp: Path) -> Path:
    lines = (SAMPLE / "vocab.txt").read_text().splitlines()
    path = tmp / "vocab.txt"
    path.write_text("\n".join(lines[:100] + [""] + lines[100:]) + "\n")
    return path


def run_without_config(w: World, tmp: Path) -> list[str]:
    run = copy_of(w.run, tmp)
    (run / "config.yaml").unlink()
    return pretrain_argv(run)


def checkpoint_lacking_a_weight(w: World, tmp: Path) -> list[str]:
    """A complete checkpoint (valid manifest) whose weights lack the NSP head: a resume allows nothing missing."""
    from safetensors.torch import load_file, save_file

    run = copy_of(w.run, tmp)
    saved = run_folder.latest(run)
    weights = load_file(saved / "model" / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if not k.startswith("cls.seq_relationship.")},
        saved / "model" / "model.safetensors",
        metadata={"format": "pt"},
    )
    (saved / run_folder.MANIFEST).unlink()
    run_folder._write_manifest(saved)
    return pretrain_argv(run, "--resume", "auto")


def glue_argv(model: Path, data_dir: Path, *tasks: str) -> list[str]:
    return [
        "glue",
        "--model",
        str(model),
        "--task",
        *(tasks or ("SST-2",)),
        "--data-dir",
        str(data_dir),
        "--seeds",
        "0",
        "--epochs",
        "1",
        "--out",
        str(data_dir.parent / "glue-out"),
    ]


def glue_with_bad_file(w: World, tmp: Path, content: bytes) -> list[str]:
    glue = copy_of(w.glue, tmp)
    (glue / "SST-2" / "train.tsv").write_bytes(content)
    return glue_argv(w.model, glue)


def model_with(w: World, tmp: Path, change: Callable[[Path], object]) -> Path:
    model = copy_of(w.model, tmp)
    change(model)
    return model


def prepare_argv(w: World, tmp: Path, corpus: Path) -> list[str]:
    return [
        "prepare",
        "--corpus",
        str(corpus),
        "--tokenizer",
        str(w.tokenizer),
        "--out",
        str(tmp / "p"),
        "--workers",
        "1",
    ]


def tar_gz_corpus(tmp: Path) -> Path:
    """The text corpus packed as a .tar.gz: gzip's magic passes, and the tar inside read as text before."""
    import tarfile

    path = tmp / "corpus.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        archive.add(CORPUS, arcname="valid.txt.gz")
    return path


def jsonl_with_a_cut_first_line(tmp: Path) -> Path:
    """Read as plain text before, JSON syntax and all, because only the first line decided the format."""
    records = [json.dumps({"text": f"Record {i} says one thing. Then it says another."}) for i in range(20)]
    path = tmp / "cut.jsonl"
    path.write_text(records[0][12:] + "\n" + "\n".join(records[1:]) + "\n", encoding="utf-8")
    return path


def shard_with_an_id_beyond_the_vocabulary(w: World, tmp: Path) -> Path:
    import numpy as np

    data = copy_of(w.data, tmp)
    ids = np.load(data / "shard_00000" / "input_ids.npy")
    ids[5] = 40_000  # the vocabulary has 30,522 ids
    np.save(data / "shard_00000" / "input_ids.npy", ids)
    return data


def drop_tokenizer(model: Path) -> None:
    for path in model.iterdir():
        if path.name.startswith(("tokenizer", "vocab", "special_tokens")):
            path.unlink()


def infinite_embeddings(model: Path) -> None:
    weights = load_file(model / "model.safetensors")
    name = next(name for name in weights if "word_embeddings" in name)
    weights[name] = torch.full_like(weights[name], math.inf)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})


def swap_tokenizer(w: World) -> Callable[[Path], None]:
    def change(model: Path) -> None:
        for name in ("vocab.txt", "tokenizer.json"):
            shutil.copy(w.tokenizer.parent / "tok-renumbered" / name, model / name)

    return change


# ----- tokenizer folders, prepared metadata, run folders, model folders, corpora with the wrong cause -----
def tokenizer_with(w: World, tmp: Path, change: Callable[[Path], object]) -> Path:
    tokenizer = copy_of(w.tokenizer, tmp)
    change(tokenizer)
    return tokenizer


def data_with_meta(w: World, tmp: Path, text: str) -> Path:
    data = copy_of(w.data, tmp)
    (data / "meta.json").write_text(text)
    return data


def meta_with(w: World, change: Callable[[dict], object]) -> str:
    meta = json.loads((w.data / "meta.json").read_text())
    change(meta)
    return json.dumps(meta)


def run_with(w: World, tmp: Path, name: str, text: str) -> Path:
    """A moved copy of the world's run with ``name`` (a path inside it) holding ``text``."""
    run = moved_run(w, tmp)
    (run / name).write_text(text)
    return run


def newest_checkpoint_file(w: World, name: str) -> str:
    return str(run_folder.latest(w.run).relative_to(w.run) / name)


def config_json_with(text: str) -> Callable[[Path], None]:
    def change(model: Path) -> None:
        (model / "config.json").write_text(text)

    return change


def corpus_of_bytes(tmp: Path, name: str, content: bytes) -> Path:
    path = tmp / name
    path.write_bytes(content)
    return path


def failing(error: int, where: str) -> Callable[[pytest.MonkeyPatch], None]:
    """A fault: ``where`` ("os.fsync", "mlmlab.train.metrics.open") raises OSError ``error`` from now on."""

    def fault(monkeypatch: pytest.MonkeyPatch) -> None:
        def fail(*args, **kwargs):
            raise OSError(error, os.strerror(error), str(args[0]) if args and not isinstance(args[0], int) else None)

        monkeypatch.setattr(where, fail, raising=False)

    return fault


class HalfWriter:
    """A file open for writing whose every write puts half its bytes on disk, then raises OSError ``error``."""

    def __init__(self, handle, error: int):
        self._handle, self._error = handle, error

    def write(self, data) -> int:
        self._handle.write(data[: len(data) // 2])
        self._handle.flush()
        raise OSError(self._error, os.strerror(self._error))

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self) -> "HalfWriter":
        return self

    def __exit__(self, *exc) -> None:
        self._handle.close()


def filled_part_way(name: str, error: int = errno.ENOSPC) -> Callable[[pytest.MonkeyPatch], None]:
    """A fault: the disk fills part-way through a file named ``name``: its first write stops half-way with
    ``error``, as a real full disk does (not at fsync). Copies go through write(), not sendfile, as on file
    systems without it."""

    def fault(monkeypatch: pytest.MonkeyPatch) -> None:
        real_open = builtins.open

        def opening(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            writes = any(flag in mode for flag in "wax")
            named = isinstance(file, (str, os.PathLike)) and Path(file).name == name
            return HalfWriter(handle, error) if writes and named else handle

        monkeypatch.setattr(builtins, "open", opening)
        monkeypatch.setattr(shutil, "_USE_CP_SENDFILE", False)

    return fault


def export_argv(w: World, tmp: Path) -> list[str]:
    return ["export", str(w.run), "--out", str(tmp / "exported")]


def probe_argv(model: Path, data_dir: Path, out: Path, *options: str) -> list[str]:
    return ["probe", "--model", str(model), "--task", "SST-2", "--data-dir", str(data_dir), "--out", str(out), *options]


def vocab_of_its_own(tmp: Path) -> Path:
    """The bundled vocabulary and one token more: a vocabulary no cache holds yet."""
    path = tmp / "vocab.txt"
    path.write_text((SAMPLE / "vocab.txt").read_text() + "hostilium\n")
    return path


def resumed_run(w: World, tmp: Path, *overrides: str) -> list[str]:
    return pretrain_argv(moved_run(w, tmp), "train.max_steps=6", "--resume", "auto", *overrides)


@dataclass(frozen=True)
class Case:
    name: str
    argv: Callable[[World, Path], list[str]]
    words: tuple[str, ...]
    code: int = 2
    fault: Callable[[pytest.MonkeyPatch], None] | None = None  # a failure of the machine, not of the input


CASES = [
    # Config values that crashed deep inside training, or deleted what they should keep.
    Case(
        "keep_last negative",
        lambda w, t: pretrain_argv(t / "r", "train.keep_last=-1"),
        ("train.keep_last", "at least 0"),
    ),
    Case("log_every zero", lambda w, t: pretrain_argv(t / "r", "train.log_every=0"), ("train.log_every",)),
    Case("num_heads zero", lambda w, t: pretrain_argv(t / "r", "model.num_heads=0"), ("model.num_heads",)),
    Case("negative lr", lambda w, t: pretrain_argv(t / "r", "train.lr=-1e-3"), ("train.lr", "positive")),
    Case(
        "negative loader_workers",
        lambda w, t: pretrain_argv(t / "r", "data.loader_workers=-1"),
        ("data.loader_workers",),
    ),
    Case(
        "options after overrides still parse",
        lambda w, t: ["pretrain", "train.max_steps=3", "--no-progress", "train.log_every=0"],
        ("train.log_every",),
    ),
    # NaN and inf passed checks written as `x < 0`; seeds beyond 32 bits crashed numpy or repeated smaller ones' masks.
    Case(
        "NaN mask_prob",
        lambda w, t: pretrain_argv(t / "r", "masking.mask_prob=.nan"),
        ("masking.mask_prob=nan", "[0, 1]"),
    ),
    Case(
        "NaN weight_decay",
        lambda w, t: pretrain_argv(t / "r", "train.weight_decay=.nan"),
        ("train.weight_decay=nan", "finite"),
    ),
    Case("infinite lr", lambda w, t: pretrain_argv(t / "r", "train.lr=.inf"), ("train.lr=inf", "finite")),
    Case("infinite floor", lambda w, t: pretrain_argv(t / "r", "masking.floor=.inf"), ("masking.floor=inf", "finite")),
    Case(
        "NaN max_minutes",
        lambda w, t: pretrain_argv(t / "r", "train.max_minutes=.nan"),
        ("train.max_minutes=nan", "finite"),
    ),
    Case("negative train.seed", lambda w, t: pretrain_argv(t / "r", "train.seed=-1"), ("train.seed=-1", "32-bit")),
    Case(
        "masking.seed beyond 32 bits",
        lambda w, t: pretrain_argv(t / "r", "masking.seed=4294967296"),
        ("masking.seed=4294967296", "[0, 4294967295]"),
    ),
    # Sizes that cannot fit: refused with the estimate and the limit, before anything is allocated.
    Case(
        "a batch no memory holds",
        lambda w, t: pretrain_argv(t / "r", "train.batch_size=100000"),
        ("needs at least", "MLM logits", "train.batch_size"),
    ),
    Case(
        "a context table no memory holds",
        lambda w, t: pretrain_argv(
            t / "r", "masking.strategy=adaptive", "masking.scorer=context", "masking.context_buckets=1000000000000"
        ),
        ("needs at least", "context table"),
    ),
    # The run folder.
    Case("out_dir is a file", lambda w, t: pretrain_argv((t / "f").touch() or t / "f"), ("is a file",)),
    Case("out_dir under a file", lambda w, t: pretrain_argv((t / "f").touch() or t / "f" / "run"), ("cannot create",)),
    Case("config.yaml deleted", run_without_config, ("no config.yaml", "--resume auto")),
    # Resumes that would load part of a checkpoint, or one of another vocabulary.
    Case(
        "resume after a layer change",
        lambda w, t: pretrain_argv(w.run, "--resume", "auto", "model.num_layers=2"),
        ("num_hidden_layers=1", "model.num_layers"),
    ),
    Case(
        "resume after a head-count change (same shapes)",
        lambda w, t: pretrain_argv(w.run, "--resume", "auto", "model.num_heads=4"),
        ("num_attention_heads", "model.num_heads"),
    ),
    Case(
        "resume with a renumbered vocabulary",
        lambda w, t: pretrain_argv(w.run, "--resume", "auto", f"data.tokenizer={w.renumbered_vocab}"),
        ("another vocabulary",),
    ),
    Case(
        "--init from a model folder whose tokenizer was swapped",
        lambda w, t: pretrain_argv(t / "r", "--init", str(model_with(w, t, swap_tokenizer(w)))),
        ("not the vocabulary the model was trained with",),
    ),
    Case("resume from a checkpoint lacking a weight", checkpoint_lacking_a_weight, ("lacks cls.seq_relationship",)),
    # Corpora, vocabularies, prepared data.
    Case(
        "truncated gz corpus",
        lambda w, t: [
            "prepare",
            "--corpus",
            str(gz_cut_short(t)),
            "--tokenizer",
            str(w.tokenizer),
            "--out",
            str(t / "p"),
        ],
        ("truncated or corrupt gzip",),
    ),
    Case(
        "empty directory as corpus",
        lambda w, t: ["prepare", "--corpus", str(t), "--tokenizer", str(w.tokenizer)],
        ("holds no corpus files",),
    ),
    Case(
        "non-UTF-8 vocab",
        lambda w, t: ["tokenizer", "--vocab", str(latin1_vocab(t)), "--out", str(t / "tok")],
        ("UTF-8", "line 30523"),
    ),
    Case(
        "blank line in vocab",
        lambda w, t: ["tokenizer", "--vocab", str(vocab_with_blank_line(t)), "--out", str(t / "tok")],
        ("line 101 is blank",),
    ),
    Case(
        "truncated shard",
        lambda w, t: [
            "dump",
            "--data",
            str(truncated(copy_of(w.data, t) / "shard_00000" / "input_ids.npy").parent.parent),
        ],
        ("truncated",),
    ),
    Case("dump past the end", lambda w, t: ["dump", "--data", str(w.data), "--start", "1000000"], ("past the end",)),
    # Corpus formats decided by content, not by the first line alone; prepared data as a corpus; changed shards.
    Case(
        "tar.gz corpus", lambda w, t: prepare_argv(w, t, tar_gz_corpus(t)), ("tar archive (gzip-compressed)", "extract")
    ),
    Case(
        "JSONL with a damaged first line",
        lambda w, t: prepare_argv(w, t, jsonl_with_a_cut_first_line(t)),
        ("cut.jsonl line 1 is not valid JSON",),
    ),
    Case(
        "prepared folder given to prepare",
        lambda w, t: prepare_argv(w, t, w.data),
        ("`mlmlab prepare` wrote", "data.corpus=", "evaluate --data"),
    ),
    Case(
        "prepared folder as corpus, other sequence length",
        lambda w, t: pretrain_argv(t / "r", f"data.corpus={w.data}", "data.max_seq_length=64"),
        ("prepared with max_seq_length 128", "data.max_seq_length=128"),
    ),
    Case(
        "prepared folder as corpus, other vocabulary",
        lambda w, t: pretrain_argv(
            t / "r", f"data.corpus={w.renumbered_data}", f"data.tokenizer={SAMPLE / 'vocab.txt'}"
        ),
        ("another vocabulary",),
    ),
    Case(
        "shard with an id beyond the vocabulary",
        lambda w, t: ["dump", "--data", str(shard_with_an_id_beyond_the_vocabulary(w, t))],
        ("token id 40000", "changed after `mlmlab prepare`"),
    ),
    # Evaluation and GLUE.
    Case(
        "evaluate data of a same-size other vocabulary",
        lambda w, t: ["evaluate", "--model", str(w.model), "--data", str(w.renumbered_data), "--max-batches", "1"],
        ("another vocabulary",),
    ),
    Case(
        "GLUE: non-UTF-8 TSV",
        lambda w, t: glue_with_bad_file(w, t, "sentence\tlabel\ncaf\xe9\t1\n".encode("latin-1")),
        ("train.tsv:2", "UTF-8"),
    ),
    Case("GLUE: header-only train.tsv", lambda w, t: glue_with_bad_file(w, t, b"sentence\tlabel\n"), ("no examples",)),
    Case(
        "GLUE: truncated model file",
        lambda w, t: glue_argv(model_with(w, t, lambda m: truncated(m / "model.safetensors")), w.glue),
        ("truncated",),
    ),
    Case(
        "GLUE: every requested task missing",
        lambda w, t: glue_argv(w.model, w.glue, "RTE", "MRPC"),
        ("none of the requested GLUE tasks",),
    ),
    Case(
        "GLUE: model folder with another tokenizer",
        lambda w, t: glue_argv(model_with(w, t, swap_tokenizer(w)), w.glue),
        ("not the vocabulary the model was trained with",),
    ),
    # Messages that misled: each says what is true and what to do.
    Case(
        "evaluate: model folder without its tokenizer files",
        lambda w, t: ["evaluate", "--model", str(model_with(w, t, drop_tokenizer)), "--data", str(w.data)],
        ("holds no tokenizer files", "copy"),
    ),
    Case(
        "GLUE: model folder without its tokenizer files",
        lambda w, t: glue_argv(model_with(w, t, drop_tokenizer), copy_of(w.glue, t)),
        ("holds no tokenizer files",),
    ),
    Case(
        "probe: model folder without its tokenizer files",
        lambda w, t: [
            "probe",
            "--model",
            str(model_with(w, t, drop_tokenizer)),
            "--task",
            "SST-2",
            "--data-dir",
            str(w.glue),
            "--out",
            str(t / "probe"),
        ],
        ("holds no tokenizer files",),
    ),
    Case(
        "GLUE: --test-predictions without a test file",
        lambda w, t: [*glue_argv(w.model, copy_of(w.glue, t)), "--test-predictions"],
        ("--test-predictions", "SST-2/test.tsv is missing", "leave --test-predictions out"),
    ),
    Case(
        "every loss non-finite from the first step (train.init's weights overflow)",
        lambda w, t: pretrain_argv(
            t / "r", "--init", str(model_with(w, t, infinite_embeddings)), "train.max_bad_steps=2"
        ),
        ("before any update", "train.lr is not the cause", "holds no checkpoint"),
    ),
    Case(
        "a learning rate that diverges after a checkpoint",
        lambda w, t: pretrain_argv(t / "r", "train.lr=1e30", "train.warmup_steps=0", "train.max_bad_steps=2"),
        ("lower train.lr", "its checkpoints are kept, the newest", "ckpt-00000002"),
    ),
    Case(
        "GLUE: infinite learning rate",
        lambda w, t: [*glue_argv(w.model, w.glue), "--lr", "inf"],
        ("--lr=inf", "finite"),
    ),
    Case(
        "GLUE: seed beyond 32 bits",
        lambda w, t: [*glue_argv(w.model, w.glue), "--seeds", "4294967296"],
        ("seeds=4294967296", "32-bit"),
    ),
    Case("GLUE: negative seed", lambda w, t: [*glue_argv(w.model, w.glue), "--seeds", "-1"], ("seeds=-1", "32-bit")),
    # Tokenizer folders missing or cut short.
    Case(
        "tokenizer.json cut short",
        lambda w, t: [
            "prepare",
            "--corpus",
            str(CORPUS),
            "--tokenizer",
            str(tokenizer_with(w, t, lambda tok: truncated(tok / "tokenizer.json"))),
            "--out",
            str(t / "p"),
        ],
        ("tokenizer.json", "truncated or not JSON"),
    ),
    Case(
        "model folder with a cut tokenizer.json",
        lambda w, t: [
            "evaluate",
            "--model",
            str(model_with(w, t, lambda m: truncated(m / "tokenizer.json"))),
            "--data",
            str(w.data),
            "--max-batches",
            "1",
        ],
        ("tokenizer.json", "truncated or not JSON"),
    ),
    # Prepared-data metadata of the wrong shape.
    Case(
        "meta.json a list",
        lambda w, t: ["dump", "--data", str(data_with_meta(w, t, "[1, 2]"))],
        ("meta.json", "prepare"),
    ),
    Case(
        "meta.json cut short",
        lambda w, t: ["dump", "--data", str(data_with_meta(w, t, '{"shards": ['))],
        ("meta.json", "truncated or not JSON", "prepare"),
    ),
    Case(
        "meta.json without shards",
        lambda w, t: ["dump", "--data", str(data_with_meta(w, t, meta_with(w, lambda m: m.pop("shards"))))],
        ("meta.json", "shards"),
    ),
    Case(
        "meta.json shards of the wrong type",
        lambda w, t: ["dump", "--data", str(data_with_meta(w, t, meta_with(w, lambda m: m.update(shards=[7]))))],
        ("meta.json",),
    ),
    Case(
        "meta.json vocab_size a string",
        lambda w, t: ["dump", "--data", str(data_with_meta(w, t, meta_with(w, lambda m: m.update(vocab_size="many"))))],
        ("meta.json", "vocab_size"),
    ),
    # Run folders whose config.yaml or checkpoint manifest is damaged.
    Case(
        "config.yaml not YAML",
        lambda w, t: pretrain_argv(run_with(w, t, "config.yaml", "train: [1\n")),
        ("config.yaml is not valid YAML", "--resume auto"),
    ),
    Case(
        "config.yaml a list",
        lambda w, t: pretrain_argv(run_with(w, t, "config.yaml", "- 1\n- 2\n")),
        ("config.yaml is not a config", "mapping"),
    ),
    Case(
        "config.yaml with a section that is a number",
        lambda w, t: pretrain_argv(run_with(w, t, "config.yaml", "train: 5\n")),
        ("config.yaml is not a config", "'train' must be a mapping"),
    ),
    Case(
        "checkpoint manifest a list, resumed by name",
        lambda w, t: pretrain_argv(
            t / "r",
            "--resume",
            str(run_with(w, t, newest_checkpoint_file(w, run_folder.MANIFEST), "[]") / newest_checkpoint_file(w, "")),
        ),
        ("manifest.json",),
    ),
    # --config that is not a config file.
    Case(
        "--config a folder",
        lambda w, t: ["pretrain", "--config", str(t), "--no-progress"],
        ("is a folder, not a config file",),
    ),
    Case(
        "--config with a section that is not a mapping",
        lambda w, t: ["pretrain", "--config", str(corpus_of_bytes(t, "c.yaml", b"train: 5\n")), "--no-progress"],
        ("train", "mapping"),
    ),
    # Output paths that cannot be written, found before the run rather than after it.
    Case(
        "pretrain --json under a file",
        lambda w, t: [*pretrain_argv(t / "r"), "--json", str((t / "f").touch() or t / "f" / "s.json")],
        ("--json", "f is a file"),
    ),
    Case(
        "pretrain --json onto a folder", lambda w, t: [*pretrain_argv(t / "r"), "--json", str(t)], ("--json", "folder")
    ),
    Case(
        "glue --out onto a file",
        lambda w, t: [*glue_argv(w.model, w.glue)[:-1], str((t / "f").touch() or t / "f")],
        ("--out", "is a file"),
    ),
    Case(
        "evaluate --json onto a folder",
        lambda w, t: [
            "evaluate",
            "--model",
            str(w.model),
            "--data",
            str(w.data),
            "--max-batches",
            "1",
            "--json",
            str(t),
        ],
        ("--json", "folder"),
    ),
    Case(
        "probe --out onto a file",
        lambda w, t: [
            "probe",
            "--model",
            str(w.model),
            "--task",
            "SST-2",
            "--data-dir",
            str(w.glue),
            "--out",
            str((t / "f").touch() or t / "f"),
        ],
        ("--out", "is a file"),
    ),
    # A full disk or a read-only file while writing: one line naming the path, earlier files intact.
    Case(
        "disk full while a checkpoint is written",
        resumed_run,
        ("No space left on device", "intact"),
        fault=failing(errno.ENOSPC, "mlmlab.utils.files._sync_tree"),
    ),
    Case(
        "disk full while preparing",
        lambda w, t: prepare_argv(w, t, CORPUS),
        ("No space left on device", "intact"),
        fault=failing(errno.ENOSPC, "mlmlab.utils.files._sync_tree"),
    ),
    Case(
        "disk full while the tokenizer cache is written",
        lambda w, t: pretrain_argv(t / "r", f"data.tokenizer={vocab_of_its_own(t)}"),
        ("No space left on device",),
        fault=failing(errno.ENOSPC, "mlmlab.utils.files._sync_tree"),
    ),
    Case(
        "read-only metrics.jsonl",
        resumed_run,
        ("metrics.jsonl", "Permission denied"),
        fault=failing(errno.EACCES, "mlmlab.train.metrics.open"),
    ),
    Case(
        "read-only file system under the run",
        resumed_run,
        ("Read-only file system",),
        fault=failing(errno.EROFS, "mlmlab.utils.files.tempfile.mkstemp"),
    ),
    # The disk fills part-way through a file (torch's writer, shutil's copy), with the file half written.
    Case(
        "disk full part-way through a checkpoint's training state (torch's writer)",
        resumed_run,
        ("checkpoint ckpt-00000006", "No space left on device", "ckpt-00000004 is kept intact", "to resume"),
        fault=filled_part_way("training_state.pt"),
    ),
    Case(
        "disk full part-way through export's weights (shutil's copy)",
        export_argv,
        ("the model folder", "exported", "No space left on device", "is intact"),
        fault=filled_part_way("model.safetensors"),
    ),
    Case(
        "disk full part-way through the run's final model/ (shutil's copy)",
        resumed_run,
        ("the model folder", "model", "No space left on device", "ckpt-00000006", "is intact"),
        fault=filled_part_way("model.safetensors"),
    ),
    Case(
        "read-only file system part-way through a checkpoint's training state",
        resumed_run,
        ("checkpoint ckpt-00000006", "Read-only file system", "ckpt-00000004 is kept intact"),
        fault=filled_part_way("training_state.pt", errno.EROFS),
    ),
    # Numbers of a command's options, range-checked as config keys are, naming the option.
    Case(
        "tokenizer --vocab-size past any size",
        lambda w, t: ["tokenizer", "--corpus", str(CORPUS), "--vocab-size", str(10**30), "--out", str(t / "tok")],
        ("--vocab-size", "at most"),
    ),
    Case(
        "mask --training-progress past the end",
        lambda w, t: ["mask", "a sentence", "--training-progress", "2"],
        ("--training-progress=2.0", "[0, 1]"),
    ),
    Case("mask --epoch negative", lambda w, t: ["mask", "a sentence", "--epoch", "-3"], ("--epoch=-3", "at least 0")),
    Case(
        "dump --mask-seed negative",
        lambda w, t: ["dump", "--data", str(w.data), "--mask-seed", "-1"],
        ("--mask-seed=-1", "32-bit"),
    ),
    Case("dump -n 0", lambda w, t: ["dump", "--data", str(w.data), "-n", "0"], ("-n=0", "at least 1")),
    Case(
        "evaluate --batch-size 0",
        lambda w, t: ["evaluate", "--model", str(w.model), "--data", str(w.data), "--batch-size", "0"],
        ("--batch-size=0", "at least 1"),
    ),
    Case(
        "prepare --seed past 32 bits",
        lambda w, t: [*prepare_argv(w, t, CORPUS), "--seed", str(2**32)],
        ("--seed=4294967296", "32-bit"),
    ),
    Case(
        "probe --seed past 32 bits",
        lambda w, t: probe_argv(w.model, w.glue, t / "p", "--seed", str(2**32)),
        ("--seed=4294967296", "32-bit"),
    ),
    Case(
        "probe random-init draws past 32-bit seeds",
        lambda w, t: probe_argv(w.model, w.glue, t / "p", "--seed", str(2**32 - 1), "--random-inits", "2"),
        ("random_inits 2", "4294967296", "32-bit"),
    ),
    # Messages that blamed the wrong cause.
    Case(
        "binary corpus",
        lambda w, t: prepare_argv(w, t, corpus_of_bytes(t, "c.txt", bytes(range(256)) * 64)),
        ("binary",),
    ),
    Case(
        "UTF-16 corpus",
        lambda w, t: prepare_argv(
            w, t, corpus_of_bytes(t, "c.txt", "Some text. More text.\n\nOther text here.\n".encode("utf-16") * 20)
        ),
        ("UTF-16", "iconv -f UTF-16"),
    ),
    Case(
        "run config.yaml with an unknown section",
        lambda w, t: pretrain_argv(run_with(w, t, "config.yaml", (w.run / "config.yaml").read_text() + "extra: 1\n")),
        ("config.yaml is not a config", "'extra'"),
    ),
    Case(
        "model config.json not JSON",
        lambda w, t: [
            "evaluate",
            "--model",
            str(model_with(w, t, config_json_with('{"model_type": "bert",'))),
            "--data",
            str(w.data),
            "--max-batches",
            "1",
        ],
        ("config.json", "truncated or not JSON"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_hostile_input_ends_in_one_line(case, world, tmp_path, capsys, monkeypatch):
    before = world.fingerprint()
    argv = case.argv(world, tmp_path)
    if case.fault is not None:
        case.fault(monkeypatch)
    capsys.readouterr()
    code = main(argv)
    said = capsys.readouterr().err.strip()
    # Lines for people may come first (a resume or the run's precision: the run had started); the
    # error is one line, the last, and nothing else is an error.
    err = said.splitlines()[-1]
    assert code == case.code, said
    assert err.startswith("mlmlab: error: ") and said.count("mlmlab: error") == 1 and "Traceback" not in said, said
    for word in case.words:
        assert word in err, said
    assert world.fingerprint() == before, "an earlier checkpoint or dataset changed"


# ----- inputs that must work -----------------------------------------------------------------
def test_a_cut_last_metrics_line_does_not_block_resuming(world, tmp_path, capsys):
    run = moved_run(world, tmp_path)
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 5, "lo')  # killed while writing
    assert main(pretrain_argv(run, "train.max_steps=5", "--resume", "auto")) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 5 and 5 in steps[:-1]


def test_resume_into_a_new_folder_records_where_it_came_from(world, tmp_path, capsys):
    source = run_folder.latest(world.run)
    new = tmp_path / "b"
    assert main(pretrain_argv(new, "train.max_steps=5", "--resume", str(source))) == 0
    assert run_folder.latest(new).name == "ckpt-00000005" and (new / "model").is_dir()
    (line,) = (new / "config_history.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["step"] == 4 and record["resumed_from"] == str(source)
    assert record["changes"]["train.max_steps"] == [4, 5] and "train.out_dir" in record["changes"]


def test_a_resume_with_a_changed_config_is_recorded_and_the_rerun_accepted(world, tmp_path, capsys):
    run = moved_run(world, tmp_path)
    assert main(pretrain_argv(run, "train.max_steps=6", "--resume", "auto")) == 0
    assert "max_steps: 6" in (run / "config.yaml").read_text()
    (line,) = (run / "config_history.jsonl").read_text().splitlines()
    assert json.loads(line)["changes"] == {"train.max_steps": [4, 6]}
    capsys.readouterr()
    assert main(pretrain_argv(run, "train.max_steps=6")) == 0  # the same command, without --resume
    assert "resuming from" in capsys.readouterr().err


def test_following_the_advice_for_a_damaged_config_yaml_resumes_the_run(world, tmp_path, capsys):
    """The refusal says --resume auto continues the run; before, that ended in a traceback (the damaged file diffed)."""
    run = run_with(world, tmp_path, "config.yaml", "train: [1\n")
    assert main(pretrain_argv(run, "train.max_steps=5")) == 2
    assert "--resume auto" in capsys.readouterr().err
    assert main(pretrain_argv(run, "train.max_steps=5", "--resume", "auto")) == 0
    assert run_folder.latest(run).name == "ckpt-00000005" and "max_steps: 5" in (run / "config.yaml").read_text()
    (line,) = (run / "config_history.jsonl").read_text().splitlines()
    assert json.loads(line)["changes"] is None  # what the damaged file held is unknown


def test_a_config_yaml_the_disk_refuses_leaves_no_history_line(world, tmp_path, capsys, monkeypatch):
    """Before, the history line of the resume was written first, and stayed though the resume never ran."""
    run = moved_run(world, tmp_path)
    config = (run / "config.yaml").read_bytes()
    failing(errno.EROFS, "mlmlab.utils.files.tempfile.mkstemp")(monkeypatch)
    assert main(pretrain_argv(run, "train.max_steps=6", "--resume", "auto")) == 2
    assert "Read-only file system" in capsys.readouterr().err
    assert not (run / "config_history.jsonl").exists() and (run / "config.yaml").read_bytes() == config


class Terminated(Exception):
    """What SIGTERM raises in this test when mlmlab has no handler installed (its default would end pytest)."""


def _terminated(signum, frame):
    raise Terminated


@pytest.mark.parametrize("during", ["a held-out evaluation", "the final evaluation"])
def test_sigterm_leaves_a_resumable_checkpoint(tmp_path, during):
    """save_every=0: before, SIGTERM during the final evaluation lost the whole run."""
    final = during == "the final evaluation"
    cfg = load_config(
        "tiny",
        [
            *TINY,
            "train.max_steps=2",
            "train.save_every=0",
            f"train.out_dir={tmp_path}",
            f"train.eval_every={0 if final else 1}",
        ],
    )
    trainer = None

    def validate(*args, **kwargs):
        if not final or trainer.state.step == cfg.train.max_steps:
            os.kill(os.getpid(), signal.SIGTERM)
        return {}

    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        trainer = Trainer(cfg, evaluator=validate, show_progress=False)
        try:
            trainer.train()
        except SystemExit as stop:
            assert stop.code == 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    saved = run_folder.latest(tmp_path)
    assert saved is not None and run_folder.verify(saved) is None
    state = json.loads((saved / "trainer_state.json").read_text())
    assert state["elapsed"] > state["seconds"] > 0  # set-up and evaluations count in the run's wall-clock
    resumed = Trainer(cfg, evaluator=lambda *a, **k: {}, show_progress=False)
    assert resumed.state.step == state["step"] >= 1
    summary = resumed.train()
    assert summary["steps"] == cfg.train.max_steps
    assert summary["wall_seconds"] > state["elapsed"]  # the time before the SIGTERM is not forgotten


def test_prepare_reports_tokens_used_and_warns_when_text_is_lost(world, tmp_path, capsys, caplog):
    """Lowercased documents split into no sentences, so NSP takes no pair from them; the instances do not change."""
    sentences = [f"The river number {i} runs through the old town. It floods in spring." for i in range(40)]
    normal = "\n\n".join(" ".join(sentences[i : i + 4]) for i in range(0, 40, 4))
    lowered = "\n\n".join(" ".join(sentences[i : i + 4]).lower() for i in range(0, 40, 4))
    corpus = tmp_path / "mixed.txt"
    corpus.write_text(normal + "\n\n" + lowered + "\n")
    assert (
        main(
            [
                "prepare",
                "--corpus",
                str(corpus),
                "--tokenizer",
                str(world.tokenizer),
                "--out",
                str(tmp_path / "p"),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    assert "corpus tokens" in capsys.readouterr().out
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "10 document(s) of one sentence" in warning and "lowercased" in warning


def test_prepare_reports_the_bundled_sample_as_mostly_used(world, capsys):
    meta = json.loads((world.data / "meta.json").read_text())
    assert meta["num_used_tokens"] > 0.9 * meta["num_corpus_tokens"]


def test_a_concurrent_cache_writer_wins_and_ours_is_discarded(tmp_path):
    target = tmp_path / "tokenizers" / "abc"

    def fill(staging: Path) -> None:
        (staging / "vocab.txt").write_text("ours\n")
        theirs = staging_folder(target)  # another process publishes the same folder meanwhile
        (theirs / "vocab.txt").write_text("theirs\n")
        theirs.rename(target)

    assert _cached_folder(target, fill) == target
    assert (target / "vocab.txt").read_text() == "theirs\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["abc"]  # no staging folder left


def test_staging_folders_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    target = tmp_path / "dataset"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    own_prefix = staging_folder(target).name.rsplit("-", 2)[0]  # ".tmp-dataset-<host>"
    stale = tmp_path / f"{own_prefix}-{int(dead.stdout)}-x"
    live = tmp_path / f"{own_prefix}-{os.getpid()}-y"
    for folder in (stale, live):
        folder.mkdir()
    staging_folder(target)
    assert not stale.exists() and live.exists()


def test_one_weight_loader_allows_only_the_listed_missing_keys(tmp_path):
    """Starting from a BertForMaskedLM leaves the pooler and NSP head fresh; nothing else may be missing."""
    from transformers import BertConfig, BertForMaskedLM, BertForPreTraining

    from mlmlab.errors import UserError
    from mlmlab.model.architectures.bert import Bert
    from mlmlab.model.pretraining import load_weights

    config = BertConfig(vocab_size=64, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    BertForMaskedLM(config).save_pretrained(tmp_path)
    load_weights(BertForPreTraining(config), tmp_path / "model.safetensors", allowed_missing=tuple(Bert.optional_parts))
    with pytest.raises(UserError, match="lacks bert.pooler.dense.bias"):
        load_weights(BertForPreTraining(config), tmp_path / "model.safetensors")
    wider = BertConfig(**{**config.to_dict(), "intermediate_size": 32})
    with pytest.raises(UserError, match="intermediate.dense.bias of shape \\[16\\], this model's is \\[32\\]"):
        load_weights(
            BertForPreTraining(wider), tmp_path / "model.safetensors", allowed_missing=tuple(Bert.optional_parts)
        )


def test_a_prepared_folder_given_as_the_corpus_is_trained_on_with_its_own_tokenizer(world, tmp_path):
    """Before, its tokenizer/vocab.txt was read as the corpus text."""
    cfg = load_config("tiny", [*TINY, f"data.corpus={world.data}", f"train.out_dir={tmp_path / 'r'}"])
    trainer = Trainer(cfg, evaluator=None, show_progress=False)
    assert trainer.train_store.path == world.data and len(trainer.train_store) == len(TokenStore(world.data))
    assert trainer.valid_store.vocab_hash == TokenStore(world.data).vocab_hash


def test_pretrain_refuses_data_of_another_vocabulary_than_its_tokenizer(world):
    """What prepare_datasets checks for pretrain: the data's vocabulary against data.tokenizer's, not the sizes."""
    from mlmlab.data.resolve import require_vocab
    from mlmlab.data.store import TokenStore
    from mlmlab.data.tokenizer import folder_vocab_hash
    from mlmlab.errors import UserError

    store = TokenStore(world.renumbered_data)
    assert store.meta["vocab_size"] == TokenStore(world.data).meta["vocab_size"]
    require_vocab(store, folder_vocab_hash(world.tokenizer.parent / "tok-renumbered"), "data.tokenizer")
    with pytest.raises(UserError, match="another vocabulary than data.tokenizer"):
        require_vocab(store, folder_vocab_hash(world.tokenizer), "data.tokenizer")
