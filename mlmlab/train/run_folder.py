"""Run folders, atomic and verifiable checkpoint files, and finding the one to resume from (what a
checkpoint holds: checkpointer.py; the exported model folder: model_card.py).

A run folder holds ``config.yaml`` (the resolved config it trains with now),
``config_history.jsonl`` (one line per resume that changed the config: the step, the
checkpoint and every changed key), ``metrics.jsonl``, checkpoints ``ckpt-<step>``, at the
end ``model/``, and ``.lock``, which the one process writing the run holds (``lock_run``; a
second is refused). A checkpoint folder holds:

- ``model/``: a model folder (model/folder.py: safetensors weights, config, tokenizer, the
  pretraining corpus's ``token_counts.npy``) that the Auto classes load;
- ``training_state.pt`` (``STATE_TENSORS_FILE``): optimizer state (keyed by parameter name),
  masking strategy state, RNG states and the fp16 loss scale (``torch.save``, read back with
  ``weights_only=True``; the LR is a pure function of the step, so no scheduler state);
- ``trainer_state.json`` (``PROGRESS_FILE``): step, loader position, token and time counters;
- ``manifest.json``, written last: the sha256 of every file, so a truncated or edited
  checkpoint is detected and skipped rather than resumed from.

It is written under a staging name and renamed when complete. A resume refuses, in one
line, a checkpoint of another architecture or vocabulary: loading part of one is never silent.
What the state files hold, and how a run's parts are gathered into them and restored from
them, is ``checkpointer.py``'s.
"""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
import yaml
from transformers import PreTrainedConfig, PreTrainedModel

from mlmlab.config import Config, config_hash, config_text, flat_keys, from_dict, read_yaml, what_it_computes
from mlmlab.errors import UserError, writes_of
from mlmlab.model.architectures import entry_name, saved_architecture, saved_settings
from mlmlab.model.folder import (
    is_model_folder,
    load_saved_weights,
    read_config,
    refuse_other_vocabulary,
    write_model_folder,
)
from mlmlab.utils.files import WriterLock, building, file_sha256, lock_folder, remove_stale_staging_like, replacing
from mlmlab.utils.progress import say

MANIFEST = "manifest.json"
PREFIX = "ckpt-"
CONFIG_FILE = "config.yaml"
CONFIG_HISTORY = "config_history.jsonl"
MODEL_DIR = "model"
STATE_TENSORS_FILE = "training_state.pt"  # optimizer, masking and RNG states, loss scale: what a resume restores
PROGRESS_FILE = "trainer_state.json"  # the trainer's step, loader position, token and time counters
RESUME_LATEST = "auto"  # --resume auto: the newest intact checkpoint of the run


# ----- the run folder ----------------------------------------------------------------------
def run_dir_for(cfg: Config) -> Path:
    """``train.out_dir``, or runs/<hash of the resolved config> so a rerun finds its own run."""
    if cfg.train.out_dir:
        return Path(cfg.train.out_dir)
    return Path("runs") / config_hash(cfg)


def lock_run(run_dir: Path) -> WriterLock:
    """The run folder, created if need be and locked for this process, before anything is written to it."""
    make_writable_folder(run_dir)
    return lock_folder(run_dir, f"the run folder {run_dir}", "choose another train.out_dir")


def open_run(run_dir: Path, cfg: Config, resume: str | None, is_main: bool) -> Path | None:
    """The checkpoint to resume from, if any, in a run folder ``lock_run`` made (main process).

    A folder that already holds checkpoints of this very config is resumed without being
    asked; one of another config (or of an unknown one: config.yaml deleted) is refused
    unless ``resume`` says to continue it. The config is recorded later, by ``record_config``,
    once the checkpoint has loaded: a refused resume leaves the folder as it was.
    """
    if resume is None and complete_checkpoints(run_dir, check=False):
        recorded = read_text_or_none(run_dir / CONFIG_FILE)
        if recorded is None:
            raise UserError(
                f"{run_dir} holds checkpoints but no {CONFIG_FILE}, so what made them is unknown; "
                "pass --resume auto to continue it with this config, or choose another train.out_dir"
            )
        if damage := config_damage(recorded):
            raise UserError(
                f"{run_dir / CONFIG_FILE} {damage}, so what made the run's checkpoints is unknown; pass "
                "--resume auto to continue it with this config (config.yaml is rewritten), or choose "
                "another train.out_dir"
            )
        if not same_config(recorded, cfg):
            raise UserError(
                f"{run_dir} holds a run with a different config; choose another train.out_dir "
                "or pass --resume auto to continue it with this config"
            )
        resume = RESUME_LATEST
    folder = resolve_resume(resume, run_dir)
    if is_main:
        remove_partial(run_dir)
    return folder


def same_config(recorded: str, cfg: Config) -> bool:
    """Whether a recorded config.yaml is ``cfg``; keys mlmlab added since it was written count at their defaults,
    and train.out_dir and train.report_to say where the run lives and reports, not what it computes.

    So a run interrupted under an older mlmlab (a study's, say) resumes under a newer one
    that only added settings whose defaults keep the old behaviour, and a run folder moved
    elsewhere (a study's docs/<name> -> studies/<name>) resumes where it now is.
    """
    if recorded == config_text(cfg):
        return True
    parsed = parsed_config(recorded)
    return parsed is not None and config_text(what_it_computes(parsed)) == config_text(what_it_computes(cfg))


def parsed_config(text: str | None) -> Config | None:
    """A recorded config.yaml as a Config; None for none, or one this mlmlab cannot read (a removed key, a wrong
    type, a damaged file)."""
    try:
        return None if text is None else from_dict(yaml.safe_load(text) or {})
    except (UserError, yaml.YAMLError):
        return None


def make_writable_folder(run_dir: Path) -> None:
    """Create ``run_dir``, or a one-line UserError when it is a file or cannot be written."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"train.out_dir={str(run_dir)!r} is a file, not a folder; choose another train.out_dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(
            f"cannot create the run folder {run_dir} ({err.strerror}); choose another train.out_dir"
        ) from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise UserError(
            f"the run folder {run_dir} is not writable; choose another train.out_dir or fix its permissions"
        )


def read_text_or_none(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def record_config(run_dir: Path, cfg: Config, resumed_from: Path | None, step: int) -> None:
    """config.yaml: the config the run trains with from now on; a resume that changes it adds a history line.

    The previous config is this folder's config.yaml, or, for a resume from another run's
    checkpoint, that run's. The same command rerun later then finds its own config recorded.
    """
    text, path = config_text(cfg), run_dir / CONFIG_FILE
    previous = previous_config_text(run_dir, resumed_from)
    if previous == text and path.is_file():
        return
    with replacing(path, text):  # staged first: a config.yaml the disk refuses leaves no history line either
        if resumed_from is not None and previous != text:
            line = {"step": step, "resumed_from": str(resumed_from), "changes": config_diff(previous, text)}
            with open(run_dir / CONFIG_HISTORY, "a") as handle:
                handle.write(json.dumps(line) + "\n")


def previous_config_text(run_dir: Path, resumed_from: Path | None) -> str | None:
    """The config the run trained with until this process: its config.yaml, or, resumed from another run's
    checkpoint into a new folder, that run's."""
    previous = read_text_or_none(run_dir / CONFIG_FILE)
    if resumed_from is not None:
        previous = previous or read_text_or_none(resumed_from.parent / CONFIG_FILE)
    return previous


def config_tree_at(run_dir: Path, step: int) -> tuple[dict, list[str]]:
    """The config tree a checkpoint of ``step`` was written under, and notes on what could not be undone.

    config.yaml is the config the run continues with; a checkpoint of step s predates every
    resume from a step >= s, so the changes config_history.jsonl records for those are undone,
    newest first. A key absent before (None) goes back to its default.
    """
    tree = read_yaml(str(run_dir / CONFIG_FILE))
    history = run_dir / CONFIG_HISTORY
    lines = (
        [_history_line(text) for text in history.read_text().splitlines() if text.strip()] if history.is_file() else []
    )
    notes = []
    for line in reversed(lines):
        if line is not None and line["step"] < step:
            break
        if line is None or line["changes"] is None:
            notes.append(
                f"{CONFIG_HISTORY} does not say what a resume after step {step} changed; the config it "
                "continued with is shown"
            )
            break
        for key, (old, _) in line["changes"].items():
            section, name = key.split(".", 1)
            if old is None:
                tree.get(section, {}).pop(name, None)
            else:
                tree.setdefault(section, {})[name] = old
    return tree, notes


def _history_line(text: str) -> dict | None:
    """A config_history.jsonl line; None for a damaged one."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(line, dict) or not isinstance(line.get("step"), int):
        return None
    changes = line.get("changes")
    well_formed = (
        changes is None
        or isinstance(changes, dict)
        and all(isinstance(pair, list) and len(pair) == 2 and "." in key for key, pair in changes.items())
    )
    return line if well_formed else None


def config_diff(before: str | None, after: str) -> dict | None:
    """{"section.key": [old, new]} of two config.yaml texts; None when the old one is unknown."""
    old, new = _flat_config(before), _flat_config(after)
    if old is None:
        return None
    return {
        key: [old.get(key), new.get(key)] for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)
    }


def _flat_config(text: str | None) -> dict | None:
    """flat_keys of a config.yaml text; None for none, or a damaged one (not YAML, not a mapping of sections)."""
    if text is None:
        return None
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        return None
    sections_are_mappings = isinstance(tree, dict) and all(isinstance(v, dict | None) for v in tree.values())
    return flat_keys(tree) if sections_are_mappings else None


def config_damage(text: str) -> str | None:
    """How a recorded config.yaml is no config this mlmlab reads (damaged, or of another version); None if it is one."""
    try:
        from_dict(yaml.safe_load(text) or {})
    except yaml.YAMLError as err:
        return f"is not valid YAML ({str(err).splitlines()[0]})"
    except UserError as err:
        return f"is not a config this mlmlab reads ({err})"
    return None


# ----- writing -----------------------------------------------------------------------------
def save(run_dir: Path, step: int, write_contents, keep_last: int) -> Path:
    """Write a checkpoint atomically via ``write_contents(folder)``; keep the newest ``keep_last``.

    A write the disk refuses (full, read-only) ends in one line naming the checkpoint kept instead.
    """
    final = Path(run_dir) / f"{PREFIX}{step:08d}"
    with writes_of(f"checkpoint {final.name} to {run_dir}", *_kept_instead(run_dir, step)):
        with building(final, replace=True) as staging:
            write_contents(staging)
            _write_manifest(staging)
    if keep_last > 0:  # 0 keeps every checkpoint (config validation refuses negative values)
        # Only those up to this step: a later one is a damaged one that the resume skipped; it
        # must not count among the newest, or pruning would delete the checkpoint just written.
        earlier = [folder for folder in complete_checkpoints(run_dir, check=False) if step_of(folder) <= step]
        for old in earlier[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _kept_instead(run_dir: Path, step: int) -> tuple[str, str]:
    """What a failed save of ``step`` leaves to resume from, and how: for ``writes_of``."""
    earlier = [folder for folder in complete_checkpoints(run_dir, check=False) if step_of(folder) <= step]
    if not earlier:
        return "no checkpoint of this run was complete yet", "run the command again"
    return f"the last complete checkpoint {earlier[-1].name} is kept intact", "rerun the command to resume from it"


def step_of(folder: Path) -> int:
    """The step of a ``ckpt-<step>`` folder, from its name."""
    return int(folder.name.removeprefix(PREFIX))


def save_run_state(
    run_dir: Path,
    step: int,
    model_config: PreTrainedConfig,
    weights: dict,
    training_state: dict,
    tokenizer,
    token_counts: np.ndarray,
    keep_last: int,
) -> Path:
    """The checkpoint of ``step``: the model folder and a Checkpointer's ``state_dict``."""

    def write(folder: Path) -> None:
        write_model_folder(folder / MODEL_DIR, model_config, weights, tokenizer, token_counts)
        write_training_state(folder, training_state)

    return save(run_dir, step, write, keep_last)


def write_training_state(folder: Path, states: dict) -> None:
    """A Checkpointer's state_dict: its "trainer" entry as JSON, the tensors as one torch file."""
    save_torch({key: value for key, value in states.items() if key != "trainer"}, folder / STATE_TENSORS_FILE)
    (folder / PROGRESS_FILE).write_text(json.dumps(states["trainer"]))


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(folder)): file_sha256(p) for p in files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def save_torch(obj, path: Path) -> None:
    """``torch.save`` through a Python file, so that a failed write raises its OSError (ENOSPC, EROFS).

    Given a path, torch's writer reports a full disk as "RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos", and so it does given a file: the OSError the file raised is
    kept here and raised instead.
    """
    with open(path, "wb") as handle:
        recording = _RecordingWriter(handle)
        try:
            torch.save(obj, recording)
        except RuntimeError:
            if recording.error is None:
                raise
            raise recording.error from None


class _RecordingWriter:
    """A binary file whose first failed write is kept (torch's writer replaces it with a RuntimeError)."""

    def __init__(self, handle):
        self._handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self._handle.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self._handle.flush()


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
    if not isinstance(manifest, dict):
        return "manifest.json is not a mapping of files to checksums"
    for name, digest in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if file_sha256(path) != digest:
            return f"{name} does not match its checksum (corrupt or modified)"
    return None


def remove_partial(run_dir: Path) -> None:
    """Delete staging folders left by a writer that was killed mid-save; never a live writer's."""
    remove_stale_staging_like(Path(run_dir), f"{PREFIX}*")


def complete_checkpoints(run_dir: Path, check: bool = True, warn=say) -> list[Path]:
    """Checkpoint folders in step order; with ``check``, corrupt ones are reported and skipped."""
    named = Path(run_dir).glob(f"{PREFIX}*") if Path(run_dir).exists() else []
    folders = sorted(folder for folder in named if folder.name.removeprefix(PREFIX).isdigit())
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
        return _latest_or_refuse(run_dir)
    folder = Path(resume)
    problem = verify(folder) if folder.is_dir() else "no such folder"
    if problem and is_model_folder(folder):
        raise UserError(
            f"cannot resume from {folder}: it is a model folder, not a checkpoint (ckpt-*); to start "
            f"a new run from its weights, pass --init {folder}"
        )
    if problem:
        raise UserError(f"cannot resume from {folder}: {problem}; pass --resume auto or another checkpoint")
    _refuse_later_checkpoints(folder, run_dir)
    return folder


def _latest_or_refuse(run_dir: Path) -> Path | None:
    """The newest intact checkpoint; None for a run without any; refused when every one is damaged.

    Starting over there would erase the run's metrics and, once saving, prune its checkpoints.
    """
    found = latest(run_dir)
    damaged = complete_checkpoints(run_dir, check=False)
    if found is None and damaged:
        raise UserError(
            f"every checkpoint in {run_dir} is damaged ({len(damaged)}, see above), so the run cannot "
            "resume; move them out of the folder to start it over, or choose another train.out_dir"
        )
    return found


def _refuse_later_checkpoints(folder: Path, run_dir: Path) -> None:
    """A resume from an earlier checkpoint of the run itself would mix two runs in one folder.

    Its later checkpoints would stay: the next automatic resume would take one of them, and
    pruning would keep them over the new ones.
    """
    if folder.resolve().parent != Path(run_dir).resolve():
        return
    resumed_step = read_progress(folder)["step"]
    later = [other.name for other in complete_checkpoints(run_dir) if step_of(other) > resumed_step]
    if later:
        raise UserError(
            f"cannot resume from {folder} inside its own run: {run_dir} holds later checkpoints "
            f"({', '.join(later)}); pass another train.out_dir to branch from it (the run stays "
            "as it is), or delete the later checkpoints"
        )


def load_resumed_weights(model: PreTrainedModel, folder: Path, tokenizer) -> None:
    """The checkpoint's weights into ``model`` (every process, before FSDP shards it), refusing any difference.

    The same architecture and vocabulary (the config.json entries that fix the weights' shapes or
    meaning), and every weight: a resume allows no missing key.
    """
    saved = read_config(folder / MODEL_DIR)
    built = model.config.to_dict()
    theirs, ours = saved_settings(saved), saved_settings(built)
    for setting, value in theirs.items():
        if value != ours.get(setting):
            raise UserError(
                f"cannot resume from {folder}: its model has {entry_name(setting, saved_architecture(saved))}="
                f"{value}, this config gives {ours.get(setting)} (set by model.{setting}); resume with the "
                "config it was trained with (the run's config.yaml) or start a new train.out_dir"
            )
    if saved.get("vocab_size") != built["vocab_size"]:
        raise UserError(
            f"cannot resume from {folder}: its model has vocab_size={saved.get('vocab_size')}, this config "
            f"gives {built['vocab_size']} (set by the vocabulary size: data.tokenizer, "
            "model.pad_vocab_multiple); resume with the config it was trained with or start a new train.out_dir"
        )
    refuse_other_vocabulary(
        folder / MODEL_DIR,
        tokenizer,
        f"cannot resume from {folder}: it was trained with another vocabulary than data.tokenizer's",
        "resume with its tokenizer (its model/ folder) or start a new train.out_dir",
    )
    load_saved_weights(model, folder / MODEL_DIR)


def read_training_state(folder: Path) -> dict:
    """What ``write_training_state`` wrote, as a Checkpointer's ``load_state_dict`` takes it."""
    return {**load_torch(folder / STATE_TENSORS_FILE), "trainer": read_progress(folder)}


def read_progress(folder: Path) -> dict:
    """A checkpoint's progress: the trainer's step, loader position, token and time counters."""
    return json.loads((folder / PROGRESS_FILE).read_text())


def load_torch(path: Path):
    """State we wrote ourselves; ``weights_only`` so no pickled code is ever executed."""
    return torch.load(path, map_location="cpu", weights_only=True)
