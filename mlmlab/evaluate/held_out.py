"""A model folder evaluated on held-out data: what ``mlmlab evaluate`` and a study's further held-out sets report.

The perplexity figures come from perplexity.py, the prior-free loss from recalibrate.py; this module
loads the model folder and the data, checks that they belong together, and puts the two side by side.
"""

from pathlib import Path

from mlmlab import choices
from mlmlab.config import Config, from_dict, read_yaml
from mlmlab.data.records import Columns
from mlmlab.data.resolve import held_out_store, require_vocab
from mlmlab.errors import UserError
from mlmlab.evaluate.perplexity import DEFAULT_BUCKETS, evaluate_mlm
from mlmlab.evaluate.recalibrate import recalibrated_loss
from mlmlab.masking.select import token_info_for
from mlmlab.model.architectures import saved_architecture, token_positions
from mlmlab.model.folder import (
    held_out_form_of,
    load_pretrained,
    read_config,
    saved_held_out_form,
    saved_token_counts,
    saved_vocab_hash,
)
from mlmlab.train.run_folder import CONFIG_FILE, MODEL_DIR, PREFIX
from mlmlab.utils.devices import compute_device


def evaluate_model(
    model_dir,
    data,
    *,
    batch_size: int | None = None,
    max_batches: int | None = None,
    max_seq_length: int | None = None,
    freq_cuts: tuple[int, ...] = DEFAULT_BUCKETS,
    columns: Columns = Columns(),
    recalibrate: bool = False,
    show_progress: bool = False,
) -> dict:
    """``mlmlab evaluate``: perplexity per frequency bucket + NSP accuracy on held-out data.

    ``data``: a prepared dataset folder, or a corpus (files, folders, tables; WikiText
    ``*.tokens`` included) that is prepared here with the model's own tokenizer, into the sequences the model
    trained on (its objective's NSP pairs or packed blocks). ``batch_size`` and ``max_seq_length``: None, the run's
    own (held_out_form); with them and the run's eval_batches as ``max_batches``, the run's held-out text gives the
    run's own held-out figures.
    ``recalibrate``: also the prior-free loss (recalibrate.py) as report["recalibrated"]. ``show_progress``:
    bars on stderr (preparing, evaluating).
    """
    model_dir = Path(model_dir)
    bert, tokenizer = load_pretrained(model_dir)
    form = held_out_form(model_dir)
    if max_seq_length is not None:
        form["data.max_seq_length"] = max_seq_length
    batch_size = batch_size or form["train.eval_batch_size"]
    store = held_out_store(
        [data] if isinstance(data, (str, Path)) else list(data), model_dir, form, columns, show_progress
    )
    require_vocab(store, saved_vocab_hash(model_dir), f"the model's ({model_dir})")
    positions = token_positions(bert.config.to_dict())
    if store.max_seq_length > positions:
        raise UserError(
            f"{data} holds sequences of up to {store.max_seq_length} tokens, more than the model's "
            f"{positions} positions; prepare it with a smaller --max-seq-length"
        )
    pretraining_counts = saved_token_counts(model_dir)
    counts = store.token_counts if pretraining_counts is None else pretraining_counts
    device = compute_device()
    report = evaluate_mlm(
        bert.to(device),
        store,
        token_info_for(tokenizer, form["masking.mask_unk"]),
        batch_size=batch_size,
        max_batches=max_batches,
        device=device,
        token_counts=counts,
        freq_cuts=freq_cuts,
        show_progress=show_progress,
    )
    if recalibrate:
        report["recalibrated"] = recalibrated_loss(
            bert,
            store,
            token_info_for(tokenizer, form["masking.mask_unk"]),
            batch_size=batch_size,
            max_batches=max_batches,
            token_counts=counts,
            device=device,
            freq_cuts=freq_cuts,
            show_progress=show_progress,
        )
    report["objective"] = form["data.objective"]  # NSP pairs or packed blocks: what the figures are of
    report["frequency_source"] = "evaluated data" if pretraining_counts is None else "pretraining corpus"
    report["dataset"] = store.meta["hash"][:16]  # what was evaluated: rows made before a data fix differ here
    return report


def held_out_form(model_dir: Path) -> dict:
    """How the model's run built and measured its held-out set (held_out_form_of in model/folder.py): recorded in the
    folder; for a folder written before that, its run's config.yaml (a run's model/ or a checkpoint's); else the
    defaults, with the objective the architecture trains (MLM only without an NSP head)."""
    recorded = saved_held_out_form(model_dir)
    if recorded is not None:
        return {**held_out_form_of(Config()), **recorded}
    run_config = _run_config_of(model_dir)
    if run_config is not None:
        return held_out_form_of(run_config)
    has_nsp = saved_architecture(read_config(model_dir)).has_nsp
    return held_out_form_of(from_dict({"data": {"objective": choices.NSP if has_nsp else choices.MLM}}))


def _run_config_of(model_dir: Path) -> Config | None:
    """The config of the run a model folder lies in (a run's model/, a checkpoint's ckpt-*/model/), if readable."""
    run_dir = model_dir.parent.parent if model_dir.parent.name.startswith(PREFIX) else model_dir.parent
    if model_dir.name != MODEL_DIR or not (run_dir / CONFIG_FILE).is_file():
        return None
    try:
        return from_dict(read_yaml(str(run_dir / CONFIG_FILE)))
    except UserError:  # a config this version of mlmlab no longer reads: the architecture's defaults
        return None


def format_eval_table(report: dict, prefix: str = "") -> str:
    """One line per figure; a nested report (recalibrated) as its own lines, its keys prefixed."""
    rows = [
        format_eval_table(value, f"{prefix}{key}.")
        if isinstance(value, dict)
        else f"{prefix + key:<40} {value:>12.4f}"
        if isinstance(value, float)
        else f"{prefix + key:<40} {value!s:>12}"
        for key, value in report.items()
    ]
    return "\n".join(rows)
