"""Held-out MLM perplexity and NSP accuracy under fixed uniform masks.

Every model is scored with the same masks (``eval_masks``: uniform 15%, fixed seed),
whatever strategy trained it; otherwise perplexities of strategies that choose
*which* tokens to mask would not be comparable. Perplexity = exp(mean cross-entropy
over all masked tokens of the evaluated set), also per corpus-frequency bucket of the
target token.
"""

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel

from mlmlab.architectures import token_positions
from mlmlab.config import MaskingConfig
from mlmlab.data.loader import LoaderPosition, iterate_batches
from mlmlab.data.records import Columns
from mlmlab.data.resolve import held_out_store, require_vocab
from mlmlab.errors import UserError
from mlmlab.masking.buckets import frequency_buckets
from mlmlab.masking.evaluation import eval_masks
from mlmlab.masking.select import token_info_for
from mlmlab.model import SparsePretraining, eval_mode
from mlmlab.model_folder import load_pretrained, saved_token_counts, saved_vocab_hash
from mlmlab.utils.devices import compute_device
from mlmlab.utils.progress import progress_bar

DEFAULT_BUCKETS = MaskingConfig().freq_cuts  # the same as training's


class _Totals:
    """Running sums of losses and hits, overall and per bucket."""

    def __init__(self, num_buckets: int):
        self.loss = 0.0
        self.count = 0
        self.correct = 0
        self.nsp_correct = 0
        self.nsp_count = 0
        self.bucket_loss = torch.zeros(num_buckets, dtype=torch.float64)
        self.bucket_count = torch.zeros(num_buckets, dtype=torch.float64)

    def add(self, result: dict, targets: torch.Tensor, bucket_of: torch.Tensor | None, nsp_labels) -> None:
        losses = result["token_losses"].double().cpu()  # (M,)
        self.loss += losses.sum().item()
        self.count += len(losses)
        self.correct += int(result["mlm_correct"])
        if bucket_of is not None:
            buckets = bucket_of[targets.cpu()]  # (M,)
            self.bucket_loss.index_add_(0, buckets, losses)
            self.bucket_count.index_add_(0, buckets, torch.ones_like(losses))
        if "nsp_correct" in result:
            self.nsp_correct += int(result["nsp_correct"])
            self.nsp_count += len(nsp_labels)


@torch.no_grad()
def evaluate_mlm(model, store, info, *, batch_size: int = 32, max_batches: int | None = None,
                 device: torch.device | str = "cpu", token_counts: np.ndarray | None = None,
                 freq_cuts: tuple[int, ...] = DEFAULT_BUCKETS, show_progress: bool = False) -> dict:
    """Perplexity, MLM accuracy, NSP accuracy (and perplexity per frequency-rank bucket) on ``store``.

    ``model``: a transformers model mlmlab trains (BertForPreTraining, ModernBertForMaskedLM), or
    training's SparsePretraining as accelerate wrapped it (under FSDP every process must call this,
    as with any forward of the sharded model).
    """
    module = SparsePretraining(model, use_nsp=True) if isinstance(model, PreTrainedModel) else model
    bucket_of, names = (frequency_buckets(token_counts, freq_cuts, len(token_counts))
                        if token_counts is not None else (None, []))
    totals = _Totals(len(names))
    with eval_mode(module):
        for masked in fixed_mask_batches(store, info, batch_size, max_batches, device, show_progress):
            result = module(**masked)
            targets = masked["labels"].flatten().index_select(0, result["selected_index"])
            totals.add(result, targets, bucket_of, masked.get("next_sentence_label"))
    return _summarise(totals, names)


def fixed_mask_batches(store, info, batch_size: int, max_batches: int | None, device, show_progress: bool = False,
                       desc: str = "evaluate") -> Iterator[dict]:
    """The evaluated batches of ``store`` on ``device``, masked with the fixed uniform masks: the same every time."""
    batches = iterate_batches(store, batch_size=min(batch_size, len(store)), seed=0, start=LoaderPosition(),
                              pad_id=store.meta.get("pad_token_id", store.meta["special_token_ids"].get("[PAD]")))
    count = evaluated_batches(len(store), batch_size, max_batches)
    with progress_bar(desc, count, show_progress, unit="batch") as bar:
        for _ in range(count):
            _, batch = next(batches)
            yield {k: v.to(device) for k, v in eval_masks(batch, info).items()}
            bar.update()


def evaluated_batches(sequences: int, batch_size: int, max_batches: int | None = None) -> int:
    """Batches evaluate_mlm runs: the whole batches of the set (one short batch if it has fewer), at most max_batches."""
    available = max(1, sequences // batch_size)
    return min(max_batches or available, available)


# What _summarise reports: these, and perplexity_freq_<bucket> / masked_tokens_freq_<bucket> per frequency bucket.
FIGURES = ("mlm_loss", "perplexity", "mlm_accuracy", "masked_tokens", "nsp_accuracy")
BUCKET_FIGURES = ("perplexity_freq_", "masked_tokens_freq_")


def _summarise(totals: _Totals, names: list[str]) -> dict:
    count = totals.count or float("nan")  # nothing masked: no figure, not a perplexity of 1
    mean = totals.loss / count
    report = {
        "mlm_loss": mean,
        "perplexity": math.exp(mean),
        "mlm_accuracy": totals.correct / count,
        "masked_tokens": totals.count,
    }
    if totals.nsp_count:
        report["nsp_accuracy"] = totals.nsp_correct / totals.nsp_count
    for i, name in enumerate(names):
        n = totals.bucket_count[i].item()
        report[f"perplexity_freq_{name}"] = math.exp(totals.bucket_loss[i].item() / n) if n else float("nan")
        report[f"masked_tokens_freq_{name}"] = int(n)
    return report


def evaluate_model(model_dir, data, *, batch_size: int = 32, max_batches: int | None = None,
                   max_seq_length: int = 128, freq_cuts: tuple[int, ...] = DEFAULT_BUCKETS,
                   columns: Columns = Columns(), recalibrate: bool = False, show_progress: bool = False) -> dict:
    """``mlmlab evaluate``: perplexity per frequency bucket + NSP accuracy on held-out data.

    ``data``: a prepared dataset folder, or a corpus (files, folders, tables; WikiText
    ``*.tokens`` included) that is prepared here with the model's own tokenizer.
    ``recalibrate``: also the prior-free loss (recalibrate.py) as report["recalibrated"]. ``show_progress``:
    bars on stderr (preparing, evaluating).
    """
    model_dir = Path(model_dir)
    bert, tokenizer = load_pretrained(model_dir)
    store = held_out_store([data] if isinstance(data, (str, Path)) else list(data), model_dir, max_seq_length,
                           columns, show_progress)
    require_vocab(store, saved_vocab_hash(model_dir), f"the model's ({model_dir})")
    positions = token_positions(bert.config.to_dict())
    if store.max_seq_length > positions:
        raise UserError(f"{data} holds sequences of up to {store.max_seq_length} tokens, more than the model's "
                        f"{positions} positions; prepare it with a smaller --max-seq-length")
    pretraining_counts = saved_token_counts(model_dir)
    counts = store.token_counts if pretraining_counts is None else pretraining_counts
    device = compute_device()
    report = evaluate_mlm(bert.to(device), store, token_info_for(tokenizer), batch_size=batch_size,
                          max_batches=max_batches, device=device, token_counts=counts, freq_cuts=freq_cuts,
                          show_progress=show_progress)
    if recalibrate:
        from mlmlab.evaluate.recalibrate import recalibrated_loss  # it builds on this module

        report["recalibrated"] = recalibrated_loss(bert, store, token_info_for(tokenizer), batch_size=batch_size,
                                                   max_batches=max_batches, token_counts=counts, device=device,
                                                   freq_cuts=freq_cuts, show_progress=show_progress)
    report["frequency_source"] = "evaluated data" if pretraining_counts is None else "pretraining corpus"
    report["dataset"] = store.meta["hash"][:16]  # what was evaluated: rows made before a data fix differ here
    return report


def format_eval_table(report: dict, prefix: str = "") -> str:
    """One line per figure; a nested report (recalibrated) as its own lines, its keys prefixed."""
    rows = [format_eval_table(value, f"{prefix}{key}.") if isinstance(value, dict) else
            f"{prefix + key:<40} {value:>12.4f}" if isinstance(value, float) else f"{prefix + key:<40} {value!s:>12}"
            for key, value in report.items()]
    return "\n".join(rows)
