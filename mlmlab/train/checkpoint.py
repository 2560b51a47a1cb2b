"""Run folders, atomic and verifiable checkpoints, exact resume, and the exported model.

A run folder holds ``config.yaml`` (the resolved config), ``metrics.jsonl``, checkpoints
``ckpt-<step>`` and, at the end, ``model/``. A checkpoint folder holds:

- ``model/``: a HuggingFace folder (safetensors weights, config, tokenizer, the
  pretraining corpus's ``token_counts.npy``) that the Auto classes load;
- ``training_state.pt``: optimizer state (keyed by parameter name), masking strategy
  state, RNG states and the fp16 loss scale (``torch.save``, read back with
  ``weights_only=True``; the LR is a pure function of the step, so no scheduler state);
- ``trainer_state.json``: step, loader position, counters;
- ``manifest.json``, written last: the sha256 of every file, so a truncated or edited
  checkpoint is detected and skipped rather than resumed from.

It is written under a staging name and renamed when complete.
"""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_model
from transformers import BertConfig, BertForPreTraining

from mlmlab.config import Config, config_text
from mlmlab.errors import UserError
from mlmlab.files import STAGING_PREFIX, building, file_sha256

MANIFEST = "manifest.json"
PREFIX = "ckpt-"
CONFIG_FILE = "config.yaml"
MODEL_DIR = "model"
TRAINING_STATE = "training_state.pt"
TRAINER_STATE = "trainer_state.json"
RESUME_LATEST = "auto"  # --resume auto: the newest intact checkpoint of the run


# ----- the run folder ----------------------------------------------------------------------
def run_dir_for(cfg: Config) -> Path:
    """``train.out_dir``, or runs/<hash of the resolved config> so a rerun finds its own run."""
    if cfg.train.out_dir:
        return Path(cfg.train.out_dir)
    digest = hashlib.sha256(config_text(cfg).encode()).hexdigest()[:12]
    return Path("runs") / digest


def open_run(run_dir: Path, cfg: Config, resume: str | None, is_main: bool) -> Path | None:
    """Prepare the run folder; the checkpoint to resume from, if any.

    A folder that already holds checkpoints of this very config is resumed without being
    asked; one of another config is refused unless ``resume`` says to continue it.
    """
    config_path = run_dir / CONFIG_FILE
    if resume is None and complete_checkpoints(run_dir, check=False):
        if config_path.read_text() != config_text(cfg):
            raise UserError(f"{run_dir} holds a run with a different config; choose another train.out_dir "
                            "or pass --resume auto to continue it with this config")
        resume = RESUME_LATEST
    folder = resolve_resume(resume, run_dir)
    if is_main:
        remove_partial(run_dir)
        if folder is None:
            run_dir.mkdir(parents=True, exist_ok=True)
            config_path.write_text(config_text(cfg))
    return folder


# ----- writing -----------------------------------------------------------------------------
def save(run_dir: Path, step: int, write_contents, keep_last: int) -> Path:
    """Write a checkpoint atomically via ``write_contents(folder)``; keep the newest ``keep_last``."""
    final = Path(run_dir) / f"{PREFIX}{step:08d}"
    with building(final, replace=True) as staging:
        write_contents(staging)
        _write_manifest(staging)
    if keep_last > 0:  # 0 keeps every checkpoint (config validation refuses negative values)
        for old in complete_checkpoints(run_dir, check=False)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_run_state(run_dir: Path, step: int, model_config: BertConfig, weights: dict, training_state: dict,
                   tokenizer, token_counts: np.ndarray, keep_last: int) -> Path:
    """The checkpoint of ``step``: the exported model and a Trainer's ``state_dict``."""

    def write(folder: Path) -> None:
        export_model(folder / MODEL_DIR, model_config, weights, tokenizer, token_counts)
        write_training_state(folder, training_state)

    return save(run_dir, step, write, keep_last)


def write_training_state(folder: Path, states: dict) -> None:
    """A Trainer's state_dict: its "trainer" entry as JSON, the tensors as one torch file."""
    save_torch({key: value for key, value in states.items() if key != "trainer"}, folder / TRAINING_STATE)
    (folder / TRAINER_STATE).write_text(json.dumps(states["trainer"]))


def export_model(folder: Path, config: BertConfig, state_dict: dict, tokenizer, token_counts: np.ndarray) -> None:
    """A HuggingFace folder: safetensors weights, config and tokenizer.

    Saved from a plain copy, built on the meta device (no init, no RNG draw) and given the
    gathered weights: ``save_pretrained`` inspects the model's own parameters, which under
    FSDP are shards whose gathering would wait for the other processes forever.
    """
    with torch.device("meta"):
        plain = BertForPreTraining(config)
    plain.load_state_dict(state_dict, assign=True)
    plain.tie_weights()
    plain.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    # Frequency buckets of later evaluations are defined by the pretraining corpus.
    np.save(folder / "token_counts.npy", token_counts)


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(folder)): file_sha256(p) for p in files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def save_torch(obj, path: Path) -> None:
    torch.save(obj, path)


# ----- reading -----------------------------------------------------------------------------
def verify(folder: Path) -> str | None:
    """None when the checkpoint is complete and intact, else what is wrong with it."""
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        return "no manifest.json (incomplete write or not an mlmlab checkpoint)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "manifest.json is corrupt"
    for name, digest in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if file_sha256(path) != digest:
            return f"{name} does not match its checksum (corrupt or modified)"
    return None


def remove_partial(run_dir: Path) -> None:
    """Delete staging folders left by a writer that was killed mid-save."""
    for partial in Path(run_dir).glob(f"{STAGING_PREFIX}{PREFIX}*"):
        shutil.rmtree(partial, ignore_errors=True)


def complete_checkpoints(run_dir: Path, check: bool = True, warn=print) -> list[Path]:
    """Checkpoint folders in step order; with ``check``, corrupt ones are reported and skipped."""
    folders = sorted(Path(run_dir).glob(f"{PREFIX}*")) if Path(run_dir).exists() else []
    good = []
    for folder in folders:
        problem = verify(folder) if check else None
        if problem:
            warn(f"skipping checkpoint {folder}: {problem}")
        else:
            good.append(folder)
    return good


def latest(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """``auto``: the newest intact checkpoint of the run (None when there is none); else a path."""
    if not resume:
        return None
    if resume == RESUME_LATEST:
        return latest(run_dir)
    folder = Path(resume)
    problem = verify(folder) if folder.is_dir() else "no such folder"
    if problem:
        raise UserError(f"cannot resume from {folder}: {problem}; pass --resume auto or another checkpoint")
    return folder


def load_weights(model: BertForPreTraining, folder: Path) -> None:
    """The checkpoint's weights into ``model`` (every process, before FSDP shards it)."""
    load_model(model, folder / MODEL_DIR / "model.safetensors", strict=False)


def read_training_state(folder: Path) -> dict:
    """What ``write_training_state`` wrote, as the Trainer's ``load_state_dict`` takes it."""
    return {**load_torch(folder / TRAINING_STATE), "trainer": json.loads((folder / TRAINER_STATE).read_text())}


def load_torch(path: Path):
    """State we wrote ourselves; ``weights_only`` so no pickled code is ever executed."""
    return torch.load(path, map_location="cpu", weights_only=True)
