"""What a masking strategy and an ADM scorer are, as code: the calls training makes, and the facts others ask.

A strategy decides an epoch key and per-position weights (selection itself is select.py's, shared by
all). A training step makes the ``Strategy`` calls in the order masker.py's docstring gives. A scorer
gives ADM's per-position scores and may learn from the step's losses (``Scorer``).

Each strategy and each scorer is one entry, assembled beside its implementation (strategies.py's
``STRATEGY_ENTRIES``, scorers.py's ``SCORER_ENTRIES``; ``add_strategy`` / ``add_scorer`` add one).
Budgets, memory estimates, launch refusals, reports, the model card and ``mlmlab mask`` ask the
entry instead of testing names.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from mlmlab import choices
from mlmlab.config import Config, MaskingConfig
from mlmlab.errors import UserError

# What a scorer reads (ScorerEntry.reads)
READS_MODEL = "the model"  # runs the model on the batch: costs passes, needs the whole model on every process
READS_LOSSES = "the training losses"  # running tables of the step's own masked-LM losses: ~free, learnt state
READS_COUNTS = "the corpus counts"  # the training corpus's token counts stored with the data: no model, no state


class Strategy(Protocol):
    """A run's masking strategy, as a training step calls it (masker.py's docstring gives the order)."""

    def epoch_key(self, epoch: int) -> int:
        """The key the epoch's masks are drawn with (static: one of dupe_factor; dynamic: the epoch)."""

    def weights(self, model, batch: dict, progress: float, epoch_key: int = 0, step: int = 1) -> torch.Tensor | None:
        """(B, T) selection weights, or None for uniform; ``step``: the optimizer step the batch trains, from 1."""

    def selection_groups(self, batch: dict) -> torch.Tensor | None:
        """(B, T) groups whose share of the targets selection must keep (frequency buckets), or None."""

    def selection_units(self, batch: dict, epoch_key: int, starts: torch.Tensor, eligible: torch.Tensor):
        """(B, T) bool: where each unit of whole words begins (units.unit_starts), or None: single positions.
        Asked only of an entry with ``units``; ``starts``: the (B, T) word starts, ``eligible``: (B, T)."""

    def observe(self, batch: dict, result: dict) -> None:
        """One masked micro-batch and its forward's result (model.SparsePretraining's), in mask order."""

    def learn(self, gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Once per step, after every micro-batch was observed; ``gather`` concatenates over processes."""

    def stats(self, total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
        """Logs since the previous call; ``total`` sums a tensor over processes."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Scorer(Protocol):
    """ADM's uncertainty scores of a batch, and what it learns from the step's masked-LM losses."""

    def batch_scores(self, model, batch: dict, eligible: torch.Tensor, step: int) -> torch.Tensor:
        """(B, T) float32, high = hard, meaningful at ``eligible`` positions; ``step``: the optimizer step."""

    def observations(
        self, original_ids: torch.Tensor, selected_index: torch.Tensor, token_losses: torch.Tensor
    ) -> dict | None:
        """What one micro-batch teaches as flat (M,) tensors (None: nothing), for ``learn``."""

    def learn(self, observed: dict) -> None:
        """One update from the step's observations, concatenated over micro-batches and processes."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class ScorerEntry:
    """One ``masking.scorer``: how to build it, and its facts."""

    name: str
    # (cfg, info, vocab_size, token_counts) -> Scorer; token_counts: (V,) corpus counts or None
    build: Callable[..., Scorer]
    reads: str  # READS_MODEL, READS_LOSSES or READS_COUNTS
    # (cfg, encoder forward FLOPs per sequence, padded vocab) -> extra FLOPs per sequence per step, on average
    extra_flops: Callable[[Config, float, int], float] = lambda cfg, encoder, vocab: 0.0
    # its memory beyond the model's, bytes by name, for the memory estimate (train/memory.py)
    state_bytes: Callable[[MaskingConfig], dict[str, int]] = lambda cfg: {}

    @property
    def runs_the_model(self) -> bool:
        """Model passes are what cost: score_every and score_fraction thin them out, and only them."""
        return self.reads == READS_MODEL

    @property
    def runs_under_fsdp(self) -> bool:
        """Model scorers call the encoder's parts directly, outside the wrapped forward that gathers FSDP's shards."""
        return not self.runs_the_model


@dataclass(frozen=True)
class StrategyEntry:
    """One ``masking.strategy``: how to build it, and its facts."""

    name: str
    # (cfg, info, vocab_size, token_counts) -> Strategy; info: select.TokenInfo or None; vocab_size: the tokenizer's
    build: Callable[..., Strategy]
    # the strategy part of a report's arm label, from a results row's masking section (a dict: older rows lack keys)
    label: Callable[[dict], str] = lambda masking: masking["strategy"]
    # its weights come from masking.scorer (ADM's): reports plot its adapt factor and target shares, and
    # mlmlab mask asks for what the scorer reads
    scored: bool = False
    card_lines: Callable[[MaskingConfig], list[str]] = lambda cfg: []  # the model card's lines on its own settings
    extra_flops: Callable[[Config, float, int], float] = lambda cfg, encoder, vocab: 0.0  # as ScorerEntry's
    state_bytes: Callable[[MaskingConfig], dict[str, int]] = lambda cfg: {}  # as ScorerEntry's
    # why it cannot run with FSDP's sharded weights, one line that says what to do; None: it can
    fsdp_refusal: Callable[[MaskingConfig], str | None] = lambda cfg: None
    # it selects units of whole words (span, pmi): masking reads the tokenizer's word boundaries for it and asks its
    # selection_units; exactly k positions are then drawn as whole units, the last one trimmed
    units: bool = False
    # it reads the training corpus's PMI n-gram vocabulary (data/ngrams.py): build gets it as ngrams=, a list
    # of data.ngrams' entries, built beside the prepared data the first time
    ngrams: bool = False
    # the masking.* keys that only it reads (span: span_p, span_max_words): a user who names one beside another
    # strategy is refused (refuse_other_strategies_settings), as it would change nothing
    settings: tuple[str, ...] = ()


def add_entry(entries: dict, names: list[str], entry, key: str) -> None:
    """Add ``entry`` to ``entries`` and its name to the config's ``names`` (choices.py) of setting ``key``."""
    if entry.name in entries:
        raise ValueError(f"{key} {entry.name!r} exists already")
    entries[entry.name] = entry
    names.append(entry.name)


def entry_named(entries: dict, name: str, key: str):
    """The entry of setting ``key``'s value ``name``, or a one-line UserError listing the known ones."""
    if name not in entries:
        raise UserError(f"{key}={name!r} is unknown; choose {choices.listed(entries)}")
    return entries[name]
