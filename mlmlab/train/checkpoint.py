"""Atomic, verifiable checkpoints with exact resume.

A checkpoint is a folder ``ckpt-<step>``: the model as a HuggingFace folder
(safetensors, loads with the Auto classes), the tokenizer, optimizer/scheduler/
strategy state (``torch.save``, read back with ``weights_only=True``), and
``trainer_state.json``. It is written under a temporary name and renamed when
complete; ``manifest.json`` (written last) holds the sha256 of every file, so a
truncated or edited checkpoint is detected and skipped rather than resumed from.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from mlmlab.errors import UserError

MANIFEST = "manifest.json"
PREFIX = "ckpt-"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(folder)): _sha256(p) for p in files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


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
        if _sha256(path) != digest:
            return f"{name} does not match its checksum (corrupt or modified)"
    return None


def save(run_dir: Path, step: int, write_contents, keep_last: int) -> Path:
    """Write a checkpoint atomically via ``write_contents(folder)``; keep the newest ``keep_last``."""
    final = Path(run_dir) / f"{PREFIX}{step:08d}"
    tmp = Path(run_dir) / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_contents(tmp)
    _write_manifest(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in complete_checkpoints(run_dir, check=False)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def remove_partial(run_dir: Path) -> None:
    """Delete temporary folders left by a writer that was killed mid-save."""
    for partial in Path(run_dir).glob(f".tmp-{PREFIX}*"):
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
    if resume == "auto":
        return latest(run_dir)
    folder = Path(resume)
    problem = verify(folder) if folder.is_dir() else "no such folder"
    if problem:
        raise UserError(f"cannot resume from {folder}: {problem}; pass --resume auto or another checkpoint")
    return folder


def save_torch(obj, path: Path) -> None:
    torch.save(obj, path)


def load_torch(path: Path):
    """State we wrote ourselves; ``weights_only`` so no pickled code is ever executed."""
    return torch.load(path, map_location="cpu", weights_only=True)
