"""Held-out MLM perplexity and NSP accuracy under fixed uniform masks.

Every model is scored with the same masks (``eval_masks``: uniform 15%, fixed seed),
whatever strategy trained it; otherwise perplexities of strategies that choose
*which* tokens to mask would not be comparable. Perplexity = exp(mean cross-entropy
over all masked tokens of the evaluated set), also per corpus-frequency bucket of the
target token.
"""

import math
from collections.abc import Iterator

import numpy as np
import torch
from transformers import PreTrainedModel

from mlmlab.config import MaskingConfig
from mlmlab.data.loader import LoaderPosition, iterate_batches
from mlmlab.masking.buckets import frequency_buckets
from mlmlab.masking.evaluation import eval_masks
from mlmlab.model.pretraining import eval_mode, scoring_module
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
def evaluate_mlm(
    model,
    store,
    info,
    *,
    batch_size: int = 32,
    max_batches: int | None = None,
    device: torch.device | str = "cpu",
    token_counts: np.ndarray | None = None,
    freq_cuts: tuple[int, ...] = DEFAULT_BUCKETS,
    show_progress: bool = False,
) -> dict:
    """Perplexity, MLM accuracy, NSP accuracy (and perplexity per frequency-rank bucket) on ``store``.

    ``model``: a transformers model mlmlab trains (BertForPreTraining, ModernBertForMaskedLM), a BertForMaskedLM
    (MLM figures only: it has no NSP head), any other transformers masked LM (model.scoring_module), or training's
    SparsePretraining as accelerate wrapped it (under FSDP every process must call this, as with any forward of
    the sharded model).
    """
    module = scoring_module(model) if isinstance(model, PreTrainedModel) else model
    bucket_of, names = (
        frequency_buckets(token_counts, freq_cuts, len(token_counts)) if token_counts is not None else (None, [])
    )
    totals = _Totals(len(names))
    with eval_mode(module):
        for masked in fixed_mask_batches(store, info, batch_size, max_batches, device, show_progress):
            result = module(**masked)
            targets = masked["labels"].flatten().index_select(0, result["selected_index"])
            totals.add(result, targets, bucket_of, masked.get("next_sentence_label"))
    return _summarise(totals, names)


def fixed_mask_batches(
    store, info, batch_size: int, max_batches: int | None, device, show_progress: bool = False, desc: str = "evaluate"
) -> Iterator[dict]:
    """The evaluated batches of ``store`` on ``device``, masked with the fixed uniform masks: the same every time."""
    batches = iterate_batches(
        store,
        batch_size=min(batch_size, len(store)),
        seed=0,
        start=LoaderPosition(),
        pad_id=store.meta.get("pad_token_id", store.meta["special_token_ids"].get("[PAD]")),
    )
    count = evaluated_batches(len(store), batch_size, max_batches)
    with progress_bar(desc, count, show_progress, unit="batch") as bar:
        for _ in range(count):
            _, batch = next(batches)
            yield {k: v.to(device) for k, v in eval_masks(batch, info).items()}
            bar.update()


def evaluated_batches(sequences: int, batch_size: int, max_batches: int | None = None) -> int:
    """Batches evaluate_mlm runs: the whole batches of the set (one short batch if it has fewer), at most
    max_batches."""
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
