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
    mask_batch(batch, seed=cfg.seed, epoch_key=key, rate=rate_at(cfg, progress), info=info,
               corruption=corruption, weights=weights, groups=groups, whole_word=cfg.whole_word,
               continuation=table)

``learn_step`` calls ``strategy.observe(masked, result)`` for every micro-batch in the same
order (a strategy pairs each observe with the weights of its own batch by that order), then
``strategy.learn(gather)`` once: ADM's loss tables learn from the whole global batch.
"""

from collections.abc import Callable

import torch

from mlmlab.config import MaskingConfig
from mlmlab.masking.schedules import rate_at
from mlmlab.masking.select import Corruption, continuation_table, mask_batch, token_info_for
from mlmlab.masking.strategies import build_strategy


class Masker:
    """Masks a run's training batches and keeps what its strategy learns (checkpointed as its state)."""

    def __init__(self, cfg: MaskingConfig, tokenizer, token_counts):
        """``token_counts``: (V,) the training corpus's token counts (frequency buckets, the frequency scorer),
        or None."""
        self.cfg = cfg
        self.info = token_info_for(tokenizer, cfg.mask_unk)  # held-out evaluation masks with it too
        self.corruption = Corruption(cfg.mask_prob, cfg.random_prob)
        self.strategy = build_strategy(cfg, info=self.info, vocab_size=len(tokenizer), token_counts=token_counts)
        # (V,) bool: the pieces that continue a word, by the tokenizer's own convention
        self.continuation = continuation_table(tokenizer) if cfg.whole_word else None

    def mask_step(self, micro: list[tuple[int, dict]], model, *, progress: float, step: int) -> list[dict]:
        """The step's micro-batches, masked, in order. ``micro``: (epoch, batch) pairs, the batches on the
        model's device; ``model`` scores them for ADM; ``step``: the optimizer step they train, from 1."""
        return [self.mask(batch, epoch, model, progress=progress, step=step)[0] for epoch, batch in micro]

    def mask(self, batch: dict, epoch: int, model, *, progress: float, step: int) -> tuple[dict, torch.Tensor | None]:
        """One batch masked as a training step masks it (``mlmlab mask`` and ``dump`` show it), and the (B, T)
        weights its targets were drawn by (None: uniform)."""
        epoch_key = self.strategy.epoch_key(epoch)
        weights = self.strategy.weights(model, batch, progress, epoch_key, step=step)  # (B, T) or None
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
        )
        return masked, weights

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
