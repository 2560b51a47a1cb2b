"""``mlmlab export``: the model folder of any checkpoint, with the model card the end of ``pretrain`` writes.

The held-out figures are the ones the run recorded at that step (metrics.jsonl); a step
without them is evaluated here as the Trainer would (same data, fixed masks, batches), by
the ``evaluator`` the caller hands over (evaluation sits in a higher layer than training).
Where the run's data cannot be read any more (moved, another machine), the card says so
instead of failing the export.
"""

from collections.abc import Callable
from pathlib import Path

from mlmlab.config import Config, from_dict
from mlmlab.data.resolve import prepare_datasets
from mlmlab.errors import UserError
from mlmlab.masking.masker import run_ngrams
from mlmlab.masking.select import token_info_for
from mlmlab.model.folder import load_saved_weights
from mlmlab.model.pretraining import build_model
from mlmlab.train.metrics import metrics_records
from mlmlab.train.model_card import export_model_folder
from mlmlab.train.run_folder import CONFIG_FILE, MANIFEST, MODEL_DIR, config_tree_at, latest, read_progress, verify
from mlmlab.utils.devices import compute_device
from mlmlab.utils.files import lock_beside


def export_run(source: Path, out: Path, evaluator: Callable[..., dict], log=print) -> Path:
    """``out``: the model folder and card of ``source`` (a run folder: its newest intact checkpoint; or a
    checkpoint)."""
    folder = checkpoint_of(Path(source))
    with lock_beside(out, f"the export folder {out}", "give --out another folder"):
        return _export(folder, out, evaluator, log)


def _export(folder: Path, out: Path, evaluator: Callable[..., dict], log) -> Path:
    """``export_run`` once ``out`` is this process's to write."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not empty; give --out a new folder")
    step = read_progress(folder)["step"]
    cfg = run_config(folder, step, log)
    try:
        train, valid, tokenizer = prepare_datasets(cfg.data, cfg.train.init)
    except UserError as err:  # a copied run folder: its data is elsewhere; the card then says what it lacks
        log(f"mlmlab: warning: the run's data cannot be read ({err}); the model card leaves its figures out")
        train = valid = tokenizer = None
    evaluation = recorded_evaluation(folder.parent, step)
    if evaluation is None and valid is not None:
        evaluation = evaluate_checkpoint(folder, cfg, train, valid, tokenizer, evaluator)
    data = {"train": train.meta if train else None, "valid": valid.meta if valid else None}
    ngrams = run_ngrams(cfg.masking, tokenizer, train) if train else None
    return export_model_folder(folder, out, cfg, evaluation, data, ngrams=ngrams)


def checkpoint_of(source: Path) -> Path:
    """A checkpoint folder as is (verified); a run folder's newest intact checkpoint; else a one-line UserError."""
    if (source / MANIFEST).is_file():
        problem = verify(source)
        if problem:
            raise UserError(f"cannot export {source}: {problem}; export another checkpoint of the run")
        return source
    found = latest(source) if source.is_dir() else None
    if found is None:
        raise UserError(
            f"{source} is neither a run folder with an intact checkpoint nor a checkpoint (ckpt-*); "
            "give a run's folder (train.out_dir) or one of its ckpt-* folders"
        )
    return found


def run_config(folder: Path, step: int, log=print) -> Config:
    """The config a checkpoint was written under: its run's config.yaml, less the changes of later resumes."""
    if not (folder.parent / CONFIG_FILE).is_file():
        raise UserError(
            f"{folder.parent} has no {CONFIG_FILE}, so what made {folder.name} is unknown; export a "
            "checkpoint inside its run folder"
        )
    tree, notes = config_tree_at(folder.parent, step)
    for note in notes:
        log(f"mlmlab: warning: {note}")
    return from_dict(tree)


def recorded_evaluation(run_dir: Path, step: int) -> dict | None:
    """The last held-out evaluation metrics.jsonl holds for ``step``, or None."""
    found = None
    for record in metrics_records(run_dir):  # a last line cut short by a kill is left out
        if record.get("step") == step and record.get("eval"):
            found = record["eval"]
    return found


def evaluate_checkpoint(folder: Path, cfg: Config, train, valid, tokenizer, evaluator) -> dict:
    """Held-out figures of a checkpoint, as the Trainer measures them."""
    model = build_model(cfg.model, len(tokenizer), tokenizer.pad_token_id)
    load_saved_weights(model, folder / MODEL_DIR)  # the one weight loader; nothing may be missing
    device = compute_device()
    return evaluator(
        model.to(device),
        valid,
        token_info_for(tokenizer, cfg.masking.mask_unk),
        batch_size=cfg.train.eval_batch_size,
        max_batches=cfg.train.eval_batches,
        device=device,
        token_counts=train.token_counts,
        freq_cuts=cfg.masking.freq_cuts,
    )
