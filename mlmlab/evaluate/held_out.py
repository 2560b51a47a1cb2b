"""A model evaluated on held-out data: what ``mlmlab evaluate`` and a study's further held-out sets report of a model
folder, and ``evaluate_masked_lm`` of any transformers masked LM with its tokenizer (mlmlab's Python API).

The perplexity figures come from perplexity.py, the prior-free loss from recalibrate.py; this module
loads the model and the data, checks that they belong together, and puts the two side by side.
"""

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from mlmlab import choices
from mlmlab.config import Config, from_dict, read_yaml
from mlmlab.data.records import Columns
from mlmlab.data.resolve import held_out_store, require_vocab, saved_tokenizer, standalone_tokenizer
from mlmlab.data.tokenizer import vocab_hash
from mlmlab.errors import UserError
from mlmlab.evaluate.perplexity import DEFAULT_BUCKETS, evaluate_mlm
from mlmlab.evaluate.recalibrate import recalibrated_loss
from mlmlab.masking.select import token_info_for
from mlmlab.model.architectures import refuse_past_positions, saved_architecture, token_positions
from mlmlab.model.folder import (
    HELD_OUT_FORM_KEY,
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
    form = with_length(held_out_form(model_dir), max_seq_length)
    store = held_out_store(
        [data] if isinstance(data, (str, Path)) else list(data),
        standalone_tokenizer(model_dir),
        form,
        columns,
        show_progress,
    )
    require_vocab(store, saved_vocab_hash(model_dir), f"the model's ({model_dir})")
    return held_out_figures(
        bert,
        tokenizer,
        store,
        form,
        saved_token_counts(model_dir),
        batch_size=batch_size,
        max_batches=max_batches,
        freq_cuts=freq_cuts,
        recalibrate=recalibrate,
        show_progress=show_progress,
    )


def evaluate_masked_lm(
    model,
    tokenizer,
    data,
    *,
    batch_size: int | None = None,
    max_batches: int | None = None,
    max_seq_length: int | None = None,
    token_counts: np.ndarray | None = None,
    freq_cuts: tuple[int, ...] = DEFAULT_BUCKETS,
    text_column: str = "text",
    recalibrate: bool = True,
    show_progress: bool = False,
) -> dict:
    """The figures ``mlmlab evaluate`` prints, of any transformers masked LM (``AutoModelForMaskedLM``: BERT, RoBERTa,
    XLM-R, ModernBERT, DistilBERT, ELECTRA's generator, ...) with ``tokenizer``, under mlmlab's fixed evaluation
    masks (uniform 15%, a fixed seed): two models of two toolkits compare on one footing.

    ``data``: held-out text as ``mlmlab evaluate --data`` takes it (a file, a folder, a prepared dataset; a str or
    Path, or a list of Paths), a list of str (each one a document), or a ``datasets.Dataset`` (its ``text_column``,
    each row a document). The text becomes the sequences the model's mlmlab run measured (the held-out form its
    config.json records), else packed blocks of ``max_seq_length`` tokens (128), with the tokenizer's own special
    tokens. ``token_counts``: (V,) the pretraining corpus's token counts, which set the frequency buckets; None: those
    saved in the folder the model was loaded from (an mlmlab model's), else the evaluated text's.
    ``recalibrate``: also the prior-free loss (report["recalibrated"]). The model is moved to the device mlmlab
    computes on (a GPU where there is one) and scored there, in eval mode.

    Returns mlm_loss (nats), perplexity, mlm_accuracy, masked_tokens, perplexity_freq_<bucket> and
    masked_tokens_freq_<bucket>, nsp_accuracy for a model with an NSP head on NSP pairs, and "recalibrated":
    its mlm_loss and raw_mlm_loss overall and per bucket.
    """
    form = with_length(masked_lm_form(model), max_seq_length)
    columns = Columns(text_column)
    with held_out_inputs(data, columns) as paths:
        store = held_out_store(paths, saved_tokenizer(tokenizer), form, columns, show_progress)
    require_vocab(store, vocab_hash(tokenizer.get_vocab()), "the tokenizer's")
    saved = saved_token_counts(Path(model.name_or_path)) if Path(model.name_or_path or "-").is_dir() else None
    return held_out_figures(
        model,
        tokenizer,
        store,
        form,
        token_counts if token_counts is not None else saved,
        batch_size=batch_size,
        max_batches=max_batches,
        freq_cuts=freq_cuts,
        recalibrate=recalibrate,
        show_progress=show_progress,
    )


def held_out_figures(
    model,
    tokenizer,
    store,
    form: dict,
    pretraining_counts: np.ndarray | None,
    *,
    batch_size: int | None,
    max_batches: int | None,
    freq_cuts: tuple[int, ...],
    recalibrate: bool,
    show_progress: bool,
) -> dict:
    """The held-out figures of ``model`` on a prepared ``store`` of text in the held-out ``form``: perplexity.py's,
    with recalibrate.py's prior-free loss beside them when ``recalibrate``; frequency buckets by
    ``pretraining_counts``, else the store's."""
    refuse_past_positions(
        f"the held-out data ({store.path}) holds sequences of up to",
        store.max_seq_length,
        f"the model {model.name_or_path}".rstrip(),
        token_positions(model.config.to_dict()),
        "give a smaller max_seq_length (--max-seq-length)",
    )
    counts = store.token_counts if pretraining_counts is None else pretraining_counts
    info = token_info_for(tokenizer, form["masking.mask_unk"])
    batch_size = batch_size or form["train.eval_batch_size"]
    device = compute_device()
    model = model.to(device)
    report = evaluate_mlm(
        model,
        store,
        info,
        batch_size=batch_size,
        max_batches=max_batches,
        device=device,
        token_counts=counts,
        freq_cuts=freq_cuts,
        show_progress=show_progress,
    )
    if recalibrate:
        report["recalibrated"] = recalibrated_loss(
            model,
            store,
            info,
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


def with_length(form: dict, max_seq_length: int | None) -> dict:
    """A held-out form with the sequence length a caller chose (None: the form's own)."""
    return form if max_seq_length is None else {**form, "data.max_seq_length": max_seq_length}


def masked_lm_form(model) -> dict:
    """How the held-out text becomes sequences for ``model``: its mlmlab run's form, recorded in its config, else
    the defaults with packed blocks (masked LMs of other toolkits have no NSP head)."""
    recorded = getattr(model.config, HELD_OUT_FORM_KEY, None)
    if isinstance(recorded, dict):
        return {**held_out_form_of(Config()), **recorded}
    return held_out_form_of(from_dict({"data": {"objective": choices.MLM}}))


@contextmanager
def held_out_inputs(data, columns: Columns) -> Iterator[list]:
    """``data`` as the paths held_out_store reads: paths as they are; texts (a list of str, a datasets.Dataset's
    text column) written to a JSONL file of one document a record, for the time it is prepared."""
    if isinstance(data, (str, Path)):
        yield [data]
        return
    if hasattr(data, "column_names"):  # a datasets.Dataset
        if columns.text not in data.column_names:
            raise UserError(
                f"the dataset has no {columns.text!r} column (its columns: {', '.join(data.column_names)}); name "
                "the one holding the text with text_column="
            )
        data = list(data[columns.text])
    items = list(data)
    if not items or not all(isinstance(item, str) for item in items):
        yield items  # paths (a list of Paths), or what held_out_store refuses in its own words
        return
    with tempfile.TemporaryDirectory() as folder:
        texts = Path(folder) / "texts.jsonl"
        texts.write_text("".join(json.dumps({columns.text: text}) + "\n" for text in items), encoding="utf-8")
        yield [texts]


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
