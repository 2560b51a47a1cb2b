"""A run's masking, as the training loop calls it: once to mask a step, once to learn from it.

``Masker`` holds what masking needs besides the batches: the vocabulary's token info, the
80/10/10 corruption, the strategy (ADM's state included), the whole-word continuation table,
and the config's seed and rate schedule. Per optimizer step (all randomness is counter-based,
so resume is exact):

    masked = masker.mask_step([(epoch, batch), ...], model, progress=p, step=s)  # the step's micro-batches
    results = [sparse_pretraining(**m) for m in masked]                          # model.SparsePretraining
    masker.learn_step(masked, results, gather)                                   # after the step's forwards
    logs.update(masker.stats(total))                                             # window since the last stats()

``mask_step`` masks every micro-batch before the first forward (the loss is normalised over
the masked tokens of the whole global batch), each one in order with ``mask``, which makes
these strategy calls (variants.Strategy is the interface):

    key = strategy.epoch_key(epoch)                                  # epoch: of the batch (a step may span two)
    weights = strategy.weights(model, batch, progress, key, step)    # (B, T) or None = uniform; step: from 1
    groups = strategy.selection_groups(batch)                        # (B, T) frequency buckets, or None
    units = strategy.selection_units(batch, key, starts, eligible)   # span, pmi only: (B, T) unit starts
    mask_batch(batch, seed=cfg.seed, epoch_key=key, rate=rate_at(cfg, progress), info=info,
               corruption=corruption, weights=weights, groups=groups, whole_word=cfg.whole_word,
               continuation=table, unit_starts=units)

``learn_step`` calls ``strategy.observe(masked, result)`` for every micro-batch in the same
order (a strategy pairs each observe with the weights of its own batch by that order), then
``strategy.learn(gather)`` once: ADM's loss tables learn from the whole global batch.
"""

import logging
from collections.abc import Callable

import torch
from accelerate import PartialState

from mlmlab.config import MaskingConfig
from mlmlab.data.mixture import MixedStore
from mlmlab.data.ngrams import NgramSettings, ngram_vocabulary
from mlmlab.errors import UserError
from mlmlab.masking.schedules import rate_at
from mlmlab.masking.select import (
    Corruption,
    TokenInfo,
    continuation_table,
    eligible_positions,
    mask_batch,
    token_info_for,
    word_starts,
)
from mlmlab.masking.strategies import build_strategy, strategy_entry

log = logging.getLogger(__name__)


class Masker:
    """Masks a run's training batches and keeps what its strategy learns (checkpointed as its state)."""

    def __init__(self, cfg: MaskingConfig, tokenizer, token_counts, corpus=None):
        """``token_counts``: (V,) the training corpus's token counts (frequency buckets, the frequency scorer),
        or None; ``corpus``: the prepared training data (a TokenStore), for a strategy that reads its PMI
        n-gram vocabulary (built beside it the first time), or None."""
        self.cfg = cfg
        self.info = token_info_for(tokenizer, cfg.mask_unk)  # held-out evaluation masks with it too
        self.corruption = Corruption(cfg.mask_prob, cfg.random_prob)
        entry = strategy_entry(cfg.strategy)
        self.units = entry.units  # span, pmi: selection draws whole units of words
        # (V,) bool: the pieces that continue a word, by the tokenizer's own convention
        self.continuation = continuation_table(tokenizer) if cfg.whole_word or self.units else None
        # the corpus's n-gram vocabulary (pmi); None: the strategy reads none. The model card says how many it held
        self.ngrams = run_ngrams(cfg, tokenizer, corpus)
        self.strategy = build_strategy(
            cfg, info=self.info, vocab_size=len(tokenizer), token_counts=token_counts, ngrams=self.ngrams
        )

    def mask_step(self, micro: list[tuple[int, dict]], model, *, progress: float, step: int) -> list[dict]:
        """The step's micro-batches, masked, in order. ``micro``: (epoch, batch) pairs, the batches on the
        model's device; ``model`` scores them for ADM; ``step``: the optimizer step they train, from 1."""
        return [self.mask(batch, epoch, model, progress=progress, step=step)[0] for epoch, batch in micro]

    def mask(self, batch: dict, epoch: int, model, *, progress: float, step: int) -> tuple[dict, torch.Tensor | None]:
        """One batch masked as a training step masks it (``mlmlab mask`` and ``dump`` show it), and the (B, T)
        weights its targets were drawn by (None: uniform)."""
        epoch_key = self.strategy.epoch_key(epoch)
        weights = self.strategy.weights(model, batch, progress, epoch_key, step=step)  # (B, T) or None
        units = self._units(batch, epoch_key) if self.units else None  # (B, T) bool unit starts
        masked = mask_batch(
            batch,
            seed=self.cfg.seed,
            epoch_key=epoch_key,
            rate=rate_at(self.cfg, progress),
            info=self.info,
            corruption=self.corruption,
            weights=weights,
            groups=self.strategy.selection_groups(batch),
            whole_word=self.cfg.whole_word,
            continuation=self.continuation,
            unit_starts=units,
        )
        return masked, weights

    def _units(self, batch: dict, epoch_key: int) -> torch.Tensor:
        """(B, T) bool: where the strategy's units of whole words begin in ``batch``."""
        ids = batch["input_ids"]  # (B, T)
        eligible = eligible_positions(ids, self.info.special_ids)  # (B, T)
        starts = word_starts(eligible, self.continuation.to(ids.device)[ids])  # (B, T)
        return self.strategy.selection_units(batch, epoch_key, starts, eligible)

    def learn_step(
        self, masked: list[dict], results: list[dict], gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        """What the step's forwards showed: each micro-batch's result (model.SparsePretraining's) in the order
        ``mask_step`` returned them; ``gather`` concatenates a (N,) tensor over processes."""
        for batch, result in zip(masked, results, strict=True):
            self.strategy.observe(batch, result)
        self.strategy.learn(gather)

    def stats(self, total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
        """The strategy's logs since the previous call; ``total`` sums a tensor over processes."""
        return self.strategy.stats(total)

    def state_dict(self) -> dict:
        return self.strategy.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.strategy.load_state_dict(state)


def ngram_settings(cfg: MaskingConfig) -> NgramSettings:
    """The masking.pmi_* settings that decide the n-gram vocabulary."""
    return NgramSettings(cfg.pmi_vocab_size, cfg.pmi_min_n, cfg.pmi_max_n, cfg.pmi_min_count)


def run_ngrams(cfg: MaskingConfig, tokenizer, corpus) -> list[dict] | None:
    """The n-gram vocabulary a run of ``cfg`` masks with on ``corpus``; None when its strategy reads none."""
    if not strategy_entry(cfg.strategy).ngrams:
        return None
    return corpus_ngrams(cfg, corpus, continuation_table(tokenizer), token_info_for(tokenizer, cfg.mask_unk))


def corpus_ngrams(cfg: MaskingConfig, corpus, continuation: torch.Tensor, info: TokenInfo) -> list[dict]:
    """The PMI n-gram vocabulary of the prepared training data ``corpus`` (a TokenStore), best first."""
    if corpus is None:
        raise ValueError(f"masking.strategy={cfg.strategy} needs corpus= (the prepared training data)")
    if isinstance(corpus, MixedStore):
        raise UserError(
            f"masking.strategy={cfg.strategy} masks the n-grams of one training corpus, and a mixture of corpora "
            "has no n-gram vocabulary yet; train it on one corpus (data.corpus=FILES)"
        )
    ngrams = ngram_vocabulary(corpus, ngram_settings(cfg), continuation.numpy(), info.special_ids)
    if not ngrams and PartialState().is_main_process:
        log.warning(
            f"mlmlab: warning: masking.strategy={cfg.strategy} found no n-gram of {cfg.pmi_min_n} to "
            f"{cfg.pmi_max_n} words seen {cfg.pmi_min_count} times or more in {corpus.path}, so every unit is a "
            "single word (whole-word masking); lower masking.pmi_min_count or train on more text"
        )
    return ngrams
