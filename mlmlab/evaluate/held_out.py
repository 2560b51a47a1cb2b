"""A model folder evaluated on held-out data: what ``mlmlab evaluate`` and a study's further held-out sets report.

The perplexity figures come from perplexity.py, the prior-free loss from recalibrate.py; this module
loads the model folder and the data, checks that they belong together, and puts the two side by side.
"""

from pathlib import Path

from mlmlab.architectures import token_positions
from mlmlab.data.records import Columns
from mlmlab.data.resolve import held_out_store, require_vocab
from mlmlab.errors import UserError
from mlmlab.evaluate.perplexity import DEFAULT_BUCKETS, evaluate_mlm
from mlmlab.evaluate.recalibrate import recalibrated_loss
from mlmlab.masking.select import token_info_for
from mlmlab.model_folder import load_pretrained, saved_token_counts, saved_vocab_hash
from mlmlab.utils.devices import compute_device


def evaluate_model(
    model_dir,
    data,
    *,
    batch_size: int = 32,
    max_batches: int | None = None,
    max_seq_length: int = 128,
    freq_cuts: tuple[int, ...] = DEFAULT_BUCKETS,
    columns: Columns = Columns(),
    recalibrate: bool = False,
    show_progress: bool = False,
) -> dict:
    """``mlmlab evaluate``: perplexity per frequency bucket + NSP accuracy on held-out data.

    ``data``: a prepared dataset folder, or a corpus (files, folders, tables; WikiText
    ``*.tokens`` included) that is prepared here with the model's own tokenizer.
    ``recalibrate``: also the prior-free loss (recalibrate.py) as report["recalibrated"]. ``show_progress``:
    bars on stderr (preparing, evaluating).
    """
    model_dir = Path(model_dir)
    bert, tokenizer = load_pretrained(model_dir)
    store = held_out_store(
        [data] if isinstance(data, (str, Path)) else list(data), model_dir, max_seq_length, columns, show_progress
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
        token_info_for(tokenizer),
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
            token_info_for(tokenizer),
            batch_size=batch_size,
            max_batches=max_batches,
            token_counts=counts,
            device=device,
            freq_cuts=freq_cuts,
            show_progress=show_progress,
        )
    report["frequency_source"] = "evaluated data" if pretraining_counts is None else "pretraining corpus"
    report["dataset"] = store.meta["hash"][:16]  # what was evaluated: rows made before a data fix differ here
    return report


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
