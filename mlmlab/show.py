"""What people read: prepared instances and masked sentences as the model sees them, and the end of a run."""

import dataclasses
import shlex

import torch

from mlmlab import choices
from mlmlab.config import Config, MaskingConfig
from mlmlab.data.build import cache_root
from mlmlab.data.loader import collate
from mlmlab.data.ngrams import ngram_text
from mlmlab.data.resolve import SAMPLE_VALID, dataset_hashes, tokenizer_dir_for
from mlmlab.data.store import TokenStore
from mlmlab.data.tokenizer import load_tokenizer, vocab_hash
from mlmlab.errors import UserError
from mlmlab.masking.masker import Masker, run_ngrams
from mlmlab.masking.scorers import scorer_entry, scorer_names
from mlmlab.masking.select import token_info_for
from mlmlab.masking.strategies import strategy_entry
from mlmlab.masking.variants import READS_COUNTS, READS_LOSSES, READS_MODEL
from mlmlab.model.folder import load_pretrained
from mlmlab.model.pretraining import IGNORE_INDEX

INSTANCE_KEYS = ("next_sentence_label", "doc_a", "doc_b")


def dump_instances(
    data_dir,
    n: int,
    masking: MaskingConfig | None = None,
    *,
    start: int = 0,
    masked: bool = False,
    epoch: int = 0,
    progress: float = 0.0,
):
    """Yield instances start..start+n-1 as dicts; with ``masked``, as a training step under ``masking`` (default: the
    defaults) masks them in ``epoch`` at ``progress``."""
    store = TokenStore(data_dir)
    if not 0 <= start < len(store):
        raise UserError(
            f"--start {start} is past the end: {data_dir} holds {len(store)} instances (0 to {len(store) - 1})"
        )
    tokenizer = load_tokenizer(store.tokenizer_dir)
    cfg = Config(masking=masking or MaskingConfig()).masking  # validated
    if masked and strategy_entry(cfg.strategy).scored:
        raise UserError(
            f"masking.strategy={cfg.strategy} weights by a scorer, which a dump does not run; show it on a "
            f'sentence with mlmlab mask "..." masking.strategy={cfg.strategy}'
        )
    masker = Masker(cfg, tokenizer, store.token_counts, corpus=store)
    for index in range(start, min(start + n, len(store))):
        example = store[index]
        record = {
            "index": index,
            "tokens": tokenizer.convert_ids_to_tokens(example["input_ids"].tolist()),
            "input_ids": example["input_ids"].tolist(),
            "token_type_ids": example["token_type_ids"].tolist(),
            **{key: int(example[key]) for key in INSTANCE_KEYS},
        }
        if masked:
            one = collate([example], [index], tokenizer.pad_token_id)
            batch, _ = masker.mask(one, epoch, None, progress=progress, step=1)
            record["masked_input_ids"] = batch["input_ids"][0].tolist()
            record["masked_tokens"] = tokenizer.convert_ids_to_tokens(record["masked_input_ids"])
            record["labels"] = batch["labels"][0].tolist()
        yield record


def top_ngrams(data_dir, n: int, masking: MaskingConfig) -> list[dict]:
    """The ``n`` best n-grams of the PMI vocabulary of the prepared dataset ``data_dir`` under ``masking``'s
    masking.pmi_* settings, built beside it the first time: {"rank", "ngram", "words", "count", "pmi_n"} each."""
    store = TokenStore(data_dir)
    tokenizer = load_tokenizer(store.tokenizer_dir)
    cfg = Config(masking=dataclasses.replace(masking, strategy=choices.PMI)).masking  # validated
    vocabulary = run_ngrams(cfg, tokenizer, store)
    return [
        {
            "rank": rank,
            "ngram": ngram_text(entry, tokenizer),
            "words": len(entry["words"]),
            "count": entry["count"],
            "pmi_n": round(entry["pmi_n"], 3),
        }
        for rank, entry in enumerate(vocabulary[:n], start=1)
    ]


def mask_sentence(
    text: str,
    masking: MaskingConfig | None = None,
    *,
    tokenizer: str = "",
    data: str | None = None,
    model: str | None = None,
    progress: float = 1.0,
    epoch: int = 0,
) -> str:
    """A table: each token, its masking weight, whether it was selected, what the model sees, the label.

    The sentence is masked as a training step under ``masking`` (default: the defaults) masks it in ``epoch`` at
    ``progress``. An adaptive scorer that runs the model scores with the one in ``model``; the frequency scorer
    and frequency_neutral read the corpus counts of the prepared dataset ``data``; the loss-table scorers need a
    training run's state.
    """
    cfg = Config(masking=masking or MaskingConfig()).masking  # validated
    tok, pretrained, store = _mask_inputs(cfg, tokenizer, data, model)
    ids = torch.tensor([tok(text)["input_ids"]])  # (1, T)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
        "example_ids": torch.zeros(1, dtype=torch.long),
    }
    counts = None if store is None else store.token_counts
    masker = Masker(cfg, tok, counts, corpus=store)
    masked, weights = masker.mask(batch, epoch, pretrained, progress=progress, step=1)
    return _mask_table(
        tok, ids[0], masked, weights, f"{cfg.strategy} masking, rate {cfg.rate}, seed {cfg.seed}, epoch {epoch}"
    )


def _mask_inputs(cfg: MaskingConfig, tokenizer: str, data: str | None, model: str | None):
    """(tokenizer, model or None, prepared dataset or None) that masking ``cfg`` needs, or a UserError saying what
    is missing. The tokenizer is the model folder's, else the prepared dataset's, else ``tokenizer``."""
    reads = scorer_entry(cfg.scorer).reads if strategy_entry(cfg.strategy).scored else None
    if reads == READS_LOSSES:
        raise UserError(
            f"masking.scorer={cfg.scorer} reads loss tables a training run learns, which a sentence does not "
            f"have; show {choices.listed(scorer_names(READS_MODEL))} with --model DIR, or "
            f"{choices.listed(scorer_names(READS_COUNTS))} with --data DIR"
        )
    if reads == READS_MODEL and model is None:
        raise UserError(f"masking.scorer={cfg.scorer} scores with a model: add --model DIR (a model folder)")
    if (cfg.frequency_neutral or reads == READS_COUNTS) and data is None:
        raise UserError(
            "the frequency scorer and masking.frequency_neutral read the training corpus's token counts: add "
            "--data DIR (a prepared dataset)"
        )
    if strategy_entry(cfg.strategy).ngrams and data is None:
        raise UserError(
            f"masking.strategy={cfg.strategy} masks the n-grams of a training corpus: add --data DIR (a prepared "
            "dataset)"
        )
    if data is not None and tokenizer:
        raise UserError("--data brings the tokenizer the dataset was prepared with; drop --tokenizer")
    store = TokenStore(data) if data is not None else None
    pretrained, tok = load_pretrained(model) if reads == READS_MODEL else (None, None)
    if tok is None:
        tok = load_tokenizer(tokenizer_dir_for(model or tokenizer) if model or store is None else store.tokenizer_dir)
    if store is not None and vocab_hash(tok.get_vocab()) != store.vocab_hash:
        raise UserError(
            f"{data} was prepared with another vocabulary than {model}'s; use a dataset prepared with "
            "the model's tokenizer"
        )
    return tok, pretrained, store


def _mask_table(tok, ids, masked, weights, title: str) -> str:
    shown, labels = masked["input_ids"][0].tolist(), masked["labels"][0].tolist()
    rows = [title, f"{'pos':>3}  {'token':<16} {'weight':>7}  {'model sees':<16} {'what':<10} label"]
    for pos, (orig, seen, label) in enumerate(zip(ids.tolist(), shown, labels)):
        selected = label != IGNORE_INDEX
        what = (
            "" if not selected else "[MASK]" if seen == tok.mask_token_id else "unchanged" if seen == orig else "random"
        )
        token, seen_token = tok.convert_ids_to_tokens([orig, seen])
        weight = "" if weights is None else f"{weights[0, pos].item():.3f}"
        rows.append(
            f"{pos:>3}  {token:<16} {weight:>7}  {seen_token if selected else '':<16} {what:<10} "
            f"{token if selected else '-100'}"
        )
    eligible = int((~torch.isin(ids, torch.tensor(token_info_for(tok).special_ids))).sum())
    rows.append(f"{sum(label != IGNORE_INDEX for label in labels)} of {eligible} eligible positions selected")
    return "\n".join(rows)


def pretrain_summary(summary: dict, cfg: Config) -> str:
    """What ``pretrain`` prints at the end: where the model is, what it cost, how good it is, what to try next."""
    model = f"{summary['run_dir']}/model"
    held_out = summary.get("eval") or {}
    lines = [
        f"pretrained {summary['steps']:,} steps, {summary['tokens_seen']:,} tokens, "
        f"{_duration(summary['train_seconds'])} of training "
        f"({summary.get('tokens_per_s', 0):,.0f} tokens/s{_mfu(summary)})",
        f"model: {model} (model card: {model}/README.md; run folder: {summary['run_dir']})",
    ]
    if held_out:
        nsp = held_out.get("nsp_accuracy")
        lines.append(
            f"held-out: perplexity {held_out['perplexity']:,.2f}, MLM accuracy {held_out['mlm_accuracy']:.4f}"
            + (f", NSP accuracy {nsp:.4f}" if nsp is not None else "")
            + f" ({held_out['masked_tokens']:,} masked tokens, fixed masks)"
        )
    valid = " ".join(shlex.quote(p) for p in _held_out_data(cfg))
    fill = (
        f"\"from transformers import pipeline; print(pipeline('fill-mask', model={model!r})"
        f"('The capital of France is {_mask_token(model)}.'))\""
    )  # double quotes outside: pastes into any shell
    lines += [
        "next:",
        f"  mlmlab evaluate --model {shlex.quote(model)} --data {valid} --max-batches {cfg.train.eval_batches}",
        f"  mlmlab glue --model {shlex.quote(model)} --task RTE MRPC --data-dir GLUE_DIR",
        f"  python -c {fill}",
        "(--json: this summary as JSON)",
    ]
    return "\n".join(lines)


def _held_out_data(cfg: Config) -> list[str]:
    """What the run's held-out figures were measured on, as evaluate's --data: the held-out text; with
    data.valid_fraction (documents held out of the training text), the prepared folder of them."""
    if cfg.data.valid_fraction:
        return [str(cache_root() / dataset_hashes(cfg.data, cfg.train.init)["valid"])]
    return list(cfg.data.valid_corpus) or [str(SAMPLE_VALID)]


def _mask_token(model: str) -> str:
    """The model folder's own mask token ([MASK], <mask>), as its tokenizer_config.json names it."""
    import json
    from pathlib import Path

    path = Path(model) / "tokenizer_config.json"
    mask = json.loads(path.read_text(encoding="utf-8")).get("mask_token") if path.is_file() else None
    return (mask.get("content") if isinstance(mask, dict) else mask) or "[MASK]"


def _mfu(summary: dict) -> str:
    """ ", MFU 31% of a measured 0.11 TFLOP/s matmul peak": which peak the figure is of, as it varies by host and
    load."""
    if not summary.get("peak_flops"):
        return ""
    return f", MFU {summary['mfu']:.0%} of a measured {summary['peak_flops'] / 1e12:.2f} TFLOP/s matmul peak"


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{seconds:.1f} s"
