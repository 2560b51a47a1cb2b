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
import yaml
from conftest import CORPUS, SAMPLE, TINY_RUN
from safetensors.torch import load_file, save_file

from mlmlab.cli import main
from mlmlab.config import load_config, to_dict
from mlmlab.data.resolve import _cached_folder
from mlmlab.data.store import TokenStore
from mlmlab.experiments.running import runner
from mlmlab.experiments.study import load_study
from mlmlab.train import run_folder
from mlmlab.train.loop import Trainer
from mlmlab.utils.files import staging_folder

TINY = [*TINY_RUN, "data.max_seq_length=128"]  # the default length, which the world's prepared folders have


SHORT_ROBERTA = (
    "model.architecture=roberta",
    "data.tokenizer=sample-bpe-8k",
    "data.objective=mlm",
    "model.max_position_embeddings=64",
    "data.max_seq_length=64",
    "train.max_steps=2",
    "train.save_every=0",
)


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
    short_roberta: Path  # a RoBERTa run of 64 positions (config.json: 66 rows, its ids start past the padding id 1)

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
        pretrain_argv(root / "short-roberta", *SHORT_ROBERTA),
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
        root / "short-roberta",
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


def glue_with_long_rte(tmp: Path) -> Path:
    """A GLUE folder whose RTE pairs run past 64 tokens: fine-tuning or probing a model of 64 positions on it ended in
    "index out of range" in the position embedding."""
    folder = tmp / "glue-long" / "RTE"
    folder.mkdir(parents=True)
    premise = " ".join(["the committee met again on tuesday to discuss the budget"] * 8)
    labels = ("not_entailment", "entailment")
    rows = "".join(f"{i}\t{premise}\tthe committee met {i} times\t{labels[i % 2]}\n" for i in range(16))
    for name in ("train.tsv", "dev.tsv"):
        (folder / name).write_text("index\tsentence1\tsentence2\tlabel\n" + rows)
    return folder.parent


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


# A two-seed study of a one-layer model on the bundled sample, with a decision rule.
STUDY = {
    "base": {
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
        "data": {"loader_workers": 0},
        "train": {"batch_size": 8, "max_steps": 4, "warmup_steps": 1, "eval_batches": 2},
    },
    "arms": [{"name": "dynamic", "masking.strategy": "dynamic"}],
    "seeds": [0, 1],
    "decision": {"metric": "eval.mlm_loss", "min_effect": 0.01},
}


def write_study_file(tmp: Path, **fields) -> Path:
    path = tmp / "study.yaml"
    path.write_text(yaml.safe_dump({**STUDY, "out_dir": str(tmp / "out"), **fields}, sort_keys=False))
    return path


def study_with_its_first_row(tmp: Path, identity: bool = True) -> Path:
    """STUDY's file, its seed 0 finished (its row in results.jsonl, as the runner records it, with no
    pre-registration beside it; without its study's identity, as an older mlmlab recorded it) and seed 1 not
    started: what the runner finds before that run."""
    study = load_study(str(write_study_file(tmp)))
    run = runner.plan_runs(study)[0]
    record = runner.study_record(study, []) if identity else {"preregistration_sha256": None}
    made = {"config": to_dict(run.config), "datasets": run.datasets, **record}
    (tmp / "out").mkdir()
    runner.append_row(
        tmp / "out" / "results.jsonl",
        {"key": run.key, "study": study.name, "arm": run.arm.name, "seed": run.seed, "eval": {"mlm_loss": 5.0}, **made},
    )
    return Path(study.source)


def preregistered_after_the_first_row(w: World, tmp: Path) -> list[str]:
    path = study_with_its_first_row(tmp, identity=False)
    (tmp / "out" / "preregistration.md").write_text("# Question\n\nDecision rule: ...\n")
    return ["study", str(path), "--no-progress"]


def rule_edited_after_the_first_row(w: World, tmp: Path) -> list[str]:
    path = study_with_its_first_row(tmp)
    write_study_file(tmp, decision={"metric": "eval.mlm_loss", "min_effect": 0.05})
    return ["study", str(path), "--no-progress"]


def report_of_rows(tmp: Path, *changes: dict) -> list[str]:
    """`mlmlab report` of one dynamic row per seed, each with its ``changes``."""
    results = tmp / "results.jsonl"
    row = {"study": "s", "arm": "dynamic", "eval": {"mlm_loss": 5.0}}
    rows = [{**row, "key": f"dynamic/seed{seed}/x", "seed": seed, **change} for seed, change in enumerate(changes)]
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return ["report", str(results), "--out", str(tmp / "report")]


def resumed_run(w: World, tmp: Path, *overrides: str) -> list[str]:
    return pretrain_argv(moved_run(w, tmp), "train.max_steps=6", "--resume", "auto", *overrides)


def roberta_folder(w: World, tmp: Path) -> Path:
    """A RoBERTa folder as transformers saves one (test_roberta's), with the world's tokenizer."""
    from test_roberta import _released, released_folder

    from mlmlab.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(w.tokenizer)
    return released_folder(tmp / "roberta", *_released("roberta", tokenizer)[:1], tokenizer)


def study_argv(tmp: Path, arm: dict, *options: str) -> list[str]:
    """``mlmlab study`` of a one-arm, one-seed study of two tiny steps, its folder under ``tmp``."""
    import yaml

    base = {
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
        "data": {"corpus": [str(CORPUS)], "valid_corpus": [str(CORPUS)], "loader_workers": 0},
        "train": {"max_steps": 2, "warmup_steps": 1, "batch_size": 8, "eval_batches": 1, "eval_every": 0},
    }
    tree = {"name": "hostile", "base": base, "arms": [arm], "seeds": [0], "out_dir": str(tmp / "study")}
    path = tmp / "study.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return ["study", str(path), "--no-progress", *options]


def preregistration_folder(tmp: Path) -> list[str]:
    (tmp / "study" / "preregistration.md").mkdir(parents=True)
    return study_argv(tmp, {"name": "dynamic", "masking.strategy": "dynamic"})


def config_file(tmp: Path, text: str) -> Path:
    path = tmp / "mine.yaml"
    path.write_text(text)
    return path


def tokenizer_argv(tmp: Path, *options: str) -> list[str]:
    return ["tokenizer", "--corpus", str(CORPUS), "--out", str(tmp / "tok"), "--no-progress", *options]


def setting(**variables: str | None) -> Callable[[pytest.MonkeyPatch], None]:
    """A fault of the environment: each variable set, or unset where None."""

    def fault(monkeypatch: pytest.MonkeyPatch) -> None:
        for name, value in variables.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)

    return fault


def no_wandb_login(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_trackers import without_wandb_login

    without_wandb_login(monkeypatch)


def mlflow_skinny_default_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """The [mlflow] extra as installed (mlflow-skinny: no SQL store) with MLflow's default tracking URI."""
    from mlmlab.train import trackers

    setting(MLFLOW_TRACKING_URI=None)(monkeypatch)
    monkeypatch.setattr(trackers, "sql_store_installed", lambda: False)


def tokenizers_writer_fills(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault: tokenizers' Rust writer meets a full disk (it writes to /dev/full), raising its plain Exception."""
    from tokenizers import Tokenizer

    save = Tokenizer.save
    monkeypatch.setattr(Tokenizer, "save", lambda self, path, *args, **kwargs: save(self, "/dev/full", *args, **kwargs))


def results_file(tmp: Path) -> Path:
    from conftest import ROOT

    return Path(shutil.copy(ROOT / "studies" / "adm-study-wp8k" / "results.jsonl", tmp / "results.jsonl"))


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
    # Inputs longer than the model's positions: one check (evaluate's) for every command that feeds a model.
    Case(
        "GLUE: a task's default length past a RoBERTa's 64 positions",
        lambda w, t: glue_argv(w.short_roberta / "model", glue_with_long_rte(t), "RTE"),
        ("GLUE RTE reads inputs of up to 128 tokens", "takes at most 64", "--max-length", "max_length: 64"),
    ),
    Case(
        "GLUE: --max-length within RoBERTa's position rows but past its positions",
        lambda w, t: [*glue_argv(w.short_roberta / "model", glue_with_long_rte(t), "RTE"), "--max-length", "65"],
        ("GLUE RTE reads inputs of up to 65 tokens", "takes at most 64"),
    ),
    Case(
        "probe: a task's length past a RoBERTa's 64 positions",
        lambda w, t: probe_argv(w.short_roberta / "model", glue_with_long_rte(t), t / "probe", "--task", "RTE"),
        ("the RTE probe reads inputs of up to 128 tokens", "takes at most 64", "leave the task out"),
    ),
    Case(
        "evaluate: text prepared longer than a RoBERTa's 64 positions",
        lambda w, t: [
            "evaluate",
            "--model",
            str(w.short_roberta / "model"),
            "--data",
            str(CORPUS),
            "--max-seq-length",
            "65",
            "--max-batches",
            "1",
        ],
        ("holds sequences of up to 65 tokens", "takes at most 64", "--max-seq-length"),
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
    # Settings that cannot apply together, refused rather than dropped without a word.
    Case(
        "tokenizer --vocab with --kind",
        lambda w, t: ["tokenizer", "--vocab", str(SAMPLE / "vocab.txt"), "--kind", "bpe", "--out", str(t / "tok")],
        ("--vocab adopts", "--kind would change nothing", "drop it"),
    ),
    Case(
        "tokenizer --vocab with --vocab-size and --corpus",
        lambda w, t: [*tokenizer_argv(t, "--vocab-size", "8000"), "--vocab", str(SAMPLE / "vocab.txt")],
        ("--corpus and --vocab-size would change nothing",),
    ),
    Case("tokenizer --cased --lowercase", lambda w, t: tokenizer_argv(t, "--cased", "--lowercase"), ("give one",)),
    Case(
        "--init of a RoBERTa folder beside model.architecture=bert",
        lambda w, t: pretrain_argv(
            t / "r", "--init", str(roberta_folder(w, t)), "model.architecture=bert", "data.objective=mlm"
        ),
        ("model_type=roberta", "model.architecture=bert", "drop model.architecture", "start from a bert folder"),
    ),
    Case(
        "masking.span_p beside dynamic masking",
        lambda w, t: pretrain_argv(t / "r", "masking.span_p=0.3"),
        ("masking.span_p is read by masking.strategy=span only", "dynamic", "drop masking.span_p"),
    ),
    Case(
        "PMI settings beside span masking",
        lambda w, t: pretrain_argv(t / "r", "masking.strategy=span", "masking.pmi_min_count=3"),
        ("masking.pmi_min_count is read by masking.strategy=pmi only", "span"),
    ),
    Case(
        "a config file that sets another strategy's key",
        lambda w, t: [
            *pretrain_argv(t / "r"),
            "--config",
            str(config_file(t, "masking:\n  strategy: static\n  a_max: 0.5\n")),
        ],
        ("masking.a_max is read by masking.strategy=adaptive only", "static"),
    ),
    Case(
        "a study arm that sets another strategy's key",
        lambda w, t: study_argv(t, {"name": "dynamic", "masking.strategy": "dynamic", "masking.dupe_factor": 4}),
        ("arm 'dynamic': masking.dupe_factor is read by masking.strategy=static only",),
    ),
    # What a library refuses, said in one line before the work (or in place of its own words).
    Case(
        "a Unigram below its alphabet",
        lambda w, t: tokenizer_argv(t, "--kind", "unigram", "--vocab-size", "40"),
        ("cannot hold the corpus's alphabet", "use at least"),
    ),
    Case(
        "a vocabulary past what the trainer can allocate",
        lambda w, t: tokenizer_argv(t, "--kind", "unigram", "--vocab-size", str(2**32)),
        ("more than the tokenizers trainer can build", "at most 4194304"),
    ),
    Case(
        "W&B with no login",
        lambda w, t: pretrain_argv(t / "r", "train.report_to=wandb"),
        ("wandb did not start", "WANDB_MODE=offline"),
        fault=no_wandb_login,
    ),
    Case(
        "MLflow's default store with the [mlflow] extra",
        lambda w, t: pretrain_argv(t / "r", "train.report_to=mlflow"),
        ("mlflow-skinny", "cannot write", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE=true"),
        fault=mlflow_skinny_default_store,
    ),
    Case(
        "mixture weights each finite, their sum not",
        lambda w, t: pretrain_argv(t / "r", f"data.corpus={{{CORPUS}: 1.0e+308, {w.data}: 1.0e+308}}"),
        ("sum past the largest float", "scale them down"),
    ),
    Case(
        "report --out an existing file",
        lambda w, t: ["report", str(results_file(t)), "--out", str((t / "f").touch() or t / "f")],
        ("--out", "is a file"),
    ),
    Case(
        "disk full in tokenizers' own writer",
        lambda w, t: tokenizer_argv(t, "--vocab-size", "2000"),
        ("the tokenizer folder", "No space left on device", "nothing is left at"),
        fault=tokenizers_writer_fills,
    ),
    Case(
        "disk full part-way through a tokenizer file",
        lambda w, t: tokenizer_argv(t, "--vocab-size", "2000"),
        ("the tokenizer folder", "No space left on device", "nothing is left at"),
        fault=filled_part_way("tokenizer_config.json"),
    ),
    Case(
        "disk full part-way through a prepared shard",
        lambda w, t: prepare_argv(w, t, CORPUS),
        ("the prepared dataset", "No space left on device", "nothing is left at", "the corpus is intact"),
        fault=filled_part_way("input_ids.npy"),
    ),
    Case(
        "--init with a vocabulary padding no multiple fits",
        lambda w, t: pretrain_argv(t / "r", "--init", str(w.model), "model.pad_vocab_multiple=128"),
        ("30528 embedding rows", "set model.pad_vocab_multiple=8"),
    ),
    Case(
        "a tokenizer.json as --vocab",
        lambda w, t: ["tokenizer", "--vocab", str(w.tokenizer / "tokenizer.json"), "--out", str(t / "tok")],
        ("is JSON", "not a vocab.txt", "name the folder"),
    ),
    Case(
        "preregistration.md replaced by a folder",
        lambda w, t: preregistration_folder(t),
        ("preregistration.md is a folder, not the pre-registration file",),
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
    # A study's record: a rule written after results, or changed under them, and rows of two studies compared as one.
    Case(
        "a pre-registration written after the first rows",
        preregistered_after_the_first_row,
        ("preregistration.md appeared after the study's first rows", "README.md", "--out"),
    ),
    Case(
        "a decision rule edited after the first rows",
        rule_edited_after_the_first_row,
        ("decision rule or baseline changed", "README.md", "--out"),
    ),
    Case(
        "a report of two studies' rows",
        lambda w, t: report_of_rows(
            t,
            {"study": "a", "study_identity": {"sha256": "1", "parts": {}}},
            {"study": "b", "study_identity": {"sha256": "2", "parts": {}}},
        ),
        ("more than one study", "studies a, b", "--mixed descriptive"),
    ),
    Case(
        "a report of rows under two pre-registrations",
        lambda w, t: report_of_rows(t, {"preregistration_sha256": None}, {"preregistration_sha256": "fa39" * 16}),
        ("pre-registrations fa39fa39fa39, none", "--mixed descriptive"),
    ),
    Case(
        "a report of rows under two decision rules",
        lambda w, t: report_of_rows(
            t, {"decision": {"metric": "eval.mlm_loss"}}, {"decision": {"metric": "eval.mlm_accuracy"}}
        ),
        ("2 decision rules", "--mixed descriptive"),
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


def test_fill_mask_cuts_a_long_text_where_the_models_positions_end(world):
    """A model folder's tokenizer knows its model's positions (the RoBERTa's 66 rows take 64 tokens), so transformers'
    fill-mask pipeline, asked to truncate, cuts there; before, the tokenizer knew no limit and the pipeline indexed
    past the position rows."""
    from transformers import AutoTokenizer, pipeline

    folder = world.short_roberta / "model"
    assert AutoTokenizer.from_pretrained(folder).model_max_length == 64
    assert AutoTokenizer.from_pretrained(world.model).model_max_length == 512  # BERT: no offset
    text = "The capital of France is <mask>." + " It has many museums and old streets." * 40  # about 320 tokens
    guesses = pipeline("fill-mask", model=str(folder))(text, tokenizer_kwargs={"truncation": True})
    assert len(guesses) == 5


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


# ----- a fallback says so in one warning line, and the model card records what was really used -------------------
def test_pmi_with_no_ngram_past_the_count_says_it_masks_whole_words(world, tmp_path, caplog):
    """Before, it became whole-word masking without a word, and the card spoke of the n-grams it asked for."""
    data = copy_of(world.data, tmp_path)  # the vocabulary is kept beside the data: the world's stays as it was
    argv = pretrain_argv(tmp_path / "r", f"data.corpus={data}", "masking.strategy=pmi")
    assert main([*argv, "masking.pmi_vocab_size=100", "masking.pmi_min_count=1000000"]) == 0
    (line,) = [r.getMessage() for r in caplog.records if "n-gram" in r.getMessage()]
    assert "found no n-gram of 2 to 5 words seen 1000000 times or more" in line and "whole-word" in line
    card = (tmp_path / "r" / "model" / "README.md").read_text()
    assert "n-grams masked as units: none" in card and "whole-word masking" in card


def test_a_mixture_source_never_drawn_is_said_and_left_off_the_card(world, tmp_path, caplog):
    """Before, a weight whose share rounds to no draw was never trained on, yet the card listed it."""
    rare = tmp_path / "rare.txt"
    rare.write_text("\n\n".join(f"Rare document {i} says one thing. Then it says another." for i in range(40)) + "\n")
    argv = pretrain_argv(tmp_path / "r", f"data.corpus={{{CORPUS}: 1, {rare}: 1.0e-9}}")
    assert main(argv) == 0
    (line,) = [r.getMessage() for r in caplog.records if "never drawn" in r.getMessage()]
    assert f"data.corpus source {rare} weighs 1e-09 of 1" in line
    card = (tmp_path / "r" / "model" / "README.md").read_text()
    training = next(line for line in card.splitlines() if line.startswith("| training |"))
    assert "rare.txt" not in training and f"Not trained on, though data.corpus names it: `{rare}`" in card


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda path: truncated(path), "truncated or not JSON"),
        (lambda path: path.write_text(json.dumps({"ngrams": []})), "not a format-2 vocabulary file"),
        (lambda path: _edit_vocabulary(path, lambda kept: kept["ngrams"].pop()), "checksum does not match"),
        (lambda path: _edit_vocabulary(path, _an_id_beyond_the_vocabulary), "ids below 30522"),
    ],
    ids=["truncated", "wrong keys", "an n-gram lost", "an id beyond the vocabulary"],
)
def test_a_damaged_ngram_vocabulary_is_built_again_with_a_line_saying_so(world, tmp_path, caplog, damage, says):
    """Before, a cut file ended in a JSONDecodeError, a missing key in a KeyError, and an id beyond the vocabulary
    was masked with as if it were a word."""
    from mlmlab.config import MaskingConfig
    from mlmlab.data.ngrams import vocabulary_path
    from mlmlab.data.tokenizer import load_tokenizer
    from mlmlab.masking.masker import corpus_ngrams, ngram_settings
    from mlmlab.masking.select import continuation_table, token_info_for

    store, tokenizer = TokenStore(copy_of(world.data, tmp_path)), load_tokenizer(world.tokenizer)
    cfg = MaskingConfig(strategy="pmi", pmi_vocab_size=200)

    def vocabulary() -> list[dict]:
        return corpus_ngrams(cfg, store, continuation_table(tokenizer), token_info_for(tokenizer))

    built = vocabulary()
    damage(vocabulary_path(store, ngram_settings(cfg)))
    assert vocabulary() == built
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "PMI n-gram vocabulary" in line and says in line and "building it again" in line
    caplog.clear()
    assert vocabulary() == built and not caplog.records  # the rebuilt file is whole


def _edit_vocabulary(path: Path, change: Callable[[dict], object]) -> None:
    kept = json.loads(path.read_text())
    change(kept)
    path.write_text(json.dumps(kept))


def _an_id_beyond_the_vocabulary(kept: dict) -> None:
    """An id past the vocabulary, with the checksum made to match: only the entries' own check sees it."""
    from mlmlab.data.ngrams import _checksum

    kept["ngrams"][0]["words"][0][0] = 40_000
    kept["checksum"] = _checksum(kept["ngrams"])


def test_a_run_config_yaml_names_no_key_and_a_file_of_ones_own_its_changed_ones(tmp_path):
    """A run's config.yaml records every key, an ADM arm's a_max beside a dynamic run's strategy: pretrain --config
    with it is no choice of another strategy's key. A file the user wrote names the keys it changes."""
    from mlmlab.config import config_text, named_keys

    recorded = tmp_path / "config.yaml"
    recorded.write_text(config_text(load_config("tiny", ["masking.a_max=0.5"])))
    assert named_keys(str(recorded)) == frozenset()
    assert (
        main([*pretrain_argv(tmp_path / "r", "train.max_steps=1", "train.warmup_steps=0"), "--config", str(recorded)])
        == 0
    )
    own = tmp_path / "mine.yaml"
    own.write_text("masking:\n  strategy: dynamic\n  rate: 0.15\n  span_p: 0.3\n")
    assert named_keys(str(own), ["train.lr=1e-3"]) == {"masking.span_p", "train.lr"}  # at their defaults: none
    assert named_keys("tiny") == frozenset()  # a preset's keys are mlmlab's
