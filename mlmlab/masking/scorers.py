"""Uncertainty scores for Adaptive Dynamic Masking: how much a position is worth masking.

Every scorer returns (B, T) float32 scores, high = hard, meaningful on eligible
positions only (0 elsewhere). Two families:

Model scorers run the current model on the batch before it is masked (no dropout:
eval mode, restored afterwards, so scoring never draws from torch's global RNG):

- ``entropy`` (the seed's): entropy of the MLM head's distribution at every eligible
  position of the UNMASKED sequence. The vocabulary projection is done ``chunk``
  positions at a time, so a B×T×V probability tensor never exists.
- ``max_prob``: 1 / max_j p_j of the same distribution, same chunking.
- ``grad_norm``: per-position L2 norm of d(MLM loss)/d(input embedding), where the MLM
  loss is the summed cross-entropy of a uniformly 15%-masked copy of the batch (its own
  counter-based stream, seeding.STREAM_SCORE). An extra forward AND backward: research only.

Both ``entropy`` and ``max_prob`` look at a token the model can SEE. A trained encoder
mostly copies a visible input token to its output, so after the first few hundred steps
these scores measure how well the model copies (mostly: how rare and how poorly embedded
the token is), not how hard the token is to infer from its context — which is what
masking asks of the model.

Loss scorers learn from the masked-LM losses the training step computes anyway
(``observe``), so they cost a table lookup per position:

- ``loss_ema``: per-vocabulary-id running mean (EMA) of the loss of that id when it was
  masked and predicted. Unseen ids score the running mean loss over all tokens.
- ``context``: the same running loss keyed by the token together with its immediate
  context, a hash of (left id, id, right id) of the original sequence into a fixed table
  (``context_buckets`` entries), backing off to the id's entry, then to the global mean.
  Why this measures "hard to predict when masked": every entry is an average of losses
  the model incurred predicting that token FROM ITS CONTEXT with the token hidden, so it
  is the quantity masking trains on, not a copying score; keying by the neighbours
  separates "the" after "of" (easy) from a name after "the" (hard) where ``loss_ema``
  gives one number per id. Design choices: a per-(example, position) cache would be
  exact but grows with the corpus and is refreshed only when that very position is
  masked again (~15% of epochs); a hashed trigram table is fixed-size, shared across
  examples, and refreshed by every occurrence. Hash collisions average unrelated
  contexts; with 2**20 buckets that is a known, bounded blur. Entries lag the model by
  their EMA horizon, which is what makes them free.

The data scorer reads only the training corpus's token counts (stored with the data):

- ``frequency``: -log of the token's add-one smoothed unigram probability. A control, not
  a method: ADM's uncertainty scores are high on rare ids, so moving targets to rare ids is
  part of what any scorer does; this scorer does only that. No model pass, nothing learnt,
  no state to checkpoint (the table is a function of the data).

Each scorer is a ``variants.Scorer`` and has an entry in ``SCORER_ENTRIES`` (at the end): how to
build it, what it reads, its extra FLOPs and its state bytes.
"""

import numpy as np
import torch
import torch.nn.functional as F

from mlmlab import choices
from mlmlab.config import Config, MaskingConfig
from mlmlab.masking import seeding
from mlmlab.masking.select import Corruption, select_and_corrupt
from mlmlab.masking.variants import READS_COUNTS, READS_LOSSES, READS_MODEL, ScorerEntry, add_entry, entry_named
from mlmlab.model.flops import TRAINING_PASSES, head_flops
from mlmlab.model.pretraining import IGNORE_INDEX, SparsePretraining, encode, eval_mode, predict

GRAD_NORM_RATE = 0.15  # mask rate of the copy whose loss grad_norm differentiates
CONTEXT_BYTES_PER_BUCKET = 12  # the context table's float32 value + int64 count


def unwrap(model):
    """The transformers model inside a DDP/accelerate wrapper or a SparsePretraining module."""
    model = getattr(model, "module", model)
    return model.model if isinstance(model, SparsePretraining) else model


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)  # (C, V)
    return -(logp.exp() * logp).sum(dim=-1)  # (C,)


def _inverse_max_prob(logits: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    return torch.exp(torch.logsumexp(logits, dim=-1) - logits.max(dim=-1).values)  # (C,) = 1 / max p


def _over_vocab(model, batch, eligible, vocab_size: int, chunk: int, reduce) -> torch.Tensor:
    """reduce(logits) at every eligible position, ``chunk`` positions per vocabulary projection."""
    model = unwrap(model)
    batch_size, length = eligible.shape
    with torch.no_grad(), eval_mode(model):
        hidden, _ = encode(model, batch)  # (B, T, H)
        index = eligible.flatten().nonzero().squeeze(1)  # (N,)
        hidden = hidden.flatten(0, 1).index_select(0, index)  # (N, H)
        scores = torch.zeros(batch_size * length, device=hidden.device)  # (B*T,)
        for start in range(0, index.numel(), chunk):
            logits = predict(model, hidden[start : start + chunk])[:, :vocab_size]  # (C, V)
            scores[index[start : start + chunk]] = reduce(logits)
    return scores.view(batch_size, length)


class StatelessScorer:
    """A scorer that learns nothing from training: nothing to observe, learn or checkpoint."""

    def observations(self, original_ids, selected_index, token_losses) -> None:
        return None

    def learn(self, observed: dict) -> None:
        """Nothing to learn."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """No state."""


class OverVocabScorer(StatelessScorer):
    """entropy / max_prob: ``reduce`` of the MLM head's logits at every eligible, unmasked position."""

    def __init__(self, reduce, vocab_size: int, chunk: int):
        self.reduce, self.vocab_size, self.chunk = reduce, vocab_size, chunk

    def batch_scores(self, model, batch: dict, eligible: torch.Tensor, step: int) -> torch.Tensor:
        return _over_vocab(model, batch, eligible, self.vocab_size, self.chunk, self.reduce)  # (B, T)


def entropy_scores(model, batch, eligible, vocab_size: int, chunk: int = 2048) -> torch.Tensor:
    """(B, T) entropy (nats) of the predicted distribution at each eligible, unmasked position."""
    return _over_vocab(model, batch, eligible, vocab_size, chunk, _entropy)


def max_prob_scores(model, batch, eligible, vocab_size: int, chunk: int = 2048) -> torch.Tensor:
    """(B, T) 1 / max predicted probability at each eligible, unmasked position (>= 1)."""
    return _over_vocab(model, batch, eligible, vocab_size, chunk, _inverse_max_prob)


def score_seed(seed: int) -> int:
    """The seed of grad_norm's masked copy: independent of the training masks' streams."""
    return seeding.mix32(seeding.mix32(seed) ^ seeding.STREAM_SCORE)


def grad_norm_scores(model, batch, eligible, *, info, vocab_size: int, seed: int, key: int) -> torch.Tensor:
    """(B, T) norm of d(summed MLM loss of a uniformly masked copy)/d(input embedding) per position."""
    model = unwrap(model)
    example_ids = batch["example_ids"]
    masked, labels, _ = select_and_corrupt(
        batch["input_ids"],
        example_ids,
        torch.full_like(example_ids, key),
        seed=score_seed(seed),
        rate=GRAD_NORM_RATE,
        info=info,
        corruption=Corruption(),
        eligible=eligible,
    )
    with torch.enable_grad(), eval_mode(model):
        embeds = model.get_input_embeddings()(masked).detach().requires_grad_(True)  # (B, T, H)
        hidden, _ = encode(model, batch, inputs_embeds=embeds)  # (B, T, H)
        index = (labels != IGNORE_INDEX).flatten().nonzero().squeeze(1)  # (M,)
        logits = predict(model, hidden.flatten(0, 1).index_select(0, index))[:, :vocab_size]  # (M, V)
        loss = F.cross_entropy(logits.float(), labels.flatten().index_select(0, index), reduction="sum")
        (grad,) = torch.autograd.grad(loss, embeds)  # parameters' .grad untouched
    return torch.where(eligible, grad.norm(dim=-1), torch.zeros(eligible.shape, device=grad.device))


class GradNormScorer(StatelessScorer):
    """grad_norm: its masked copy is drawn with the optimizer step as key, so every process scores a step alike."""

    def __init__(self, info, vocab_size: int, seed: int):
        self.info, self.vocab_size, self.seed = info, vocab_size, seed

    def batch_scores(self, model, batch: dict, eligible: torch.Tensor, step: int) -> torch.Tensor:
        return grad_norm_scores(
            model, batch, eligible, info=self.info, vocab_size=self.vocab_size, seed=self.seed, key=step
        )  # (B, T)


class LossTable:
    """Running mean (EMA) of masked-LM loss per key; an entry's first observation sets it."""

    def __init__(self, size: int, decay: float):
        self.decay = decay
        self.value = torch.zeros(size)  # (K,)
        self.count = torch.zeros(size, dtype=torch.long)  # (K,) observations, 0 = never seen

    def _follow(self, device) -> None:
        """The table lives on the device of the batches that use it (no host round trip per step)."""
        if self.value.device != device:
            self.value, self.count = self.value.to(device), self.count.to(device)

    def update(self, keys: torch.Tensor, losses: torch.Tensor) -> None:
        self._follow(keys.device)
        losses = losses.detach().float().to(keys.device)
        unique, inverse = torch.unique(keys, return_inverse=True)  # (U,), (M,)
        sums = torch.zeros(len(unique), device=keys.device).index_add_(0, inverse, losses)
        hits = torch.zeros(len(unique), dtype=torch.long, device=keys.device).index_add_(
            0, inverse, torch.ones_like(inverse)
        )
        mean = sums / hits
        old = self.value[unique]
        seen = self.count[unique] > 0
        self.value[unique] = torch.where(seen, self.decay * old + (1 - self.decay) * mean, mean)
        self.count[unique] += hits

    def lookup(self, keys: torch.Tensor, default: torch.Tensor) -> torch.Tensor:
        """Entries at keys (any shape); ``default`` (same shape) where never seen."""
        self._follow(keys.device)
        flat = keys.flatten()
        return torch.where(self.count[flat] > 0, self.value[flat], default.flatten()).view(keys.shape)

    def state_dict(self, prefix: str) -> dict:
        return {f"{prefix}_value": self.value.cpu().clone(), f"{prefix}_count": self.count.cpu().clone()}

    def load_state_dict(self, state: dict, prefix: str) -> None:
        self.value = state[f"{prefix}_value"].clone().float().cpu()
        self.count = state[f"{prefix}_count"].clone().long().cpu()


def context_keys(input_ids: torch.Tensor, buckets: int) -> torch.Tensor:
    """(B, T) bucket of each position's (left id, id, right id); -1 stands for the sequence edge."""
    edge = torch.full_like(input_ids[:, :1], -1)
    left = torch.cat([edge, input_ids[:, :-1]], dim=1)  # (B, T)
    right = torch.cat([input_ids[:, 1:], edge], dim=1)  # (B, T)
    h = seeding.mix32(seeding.mix32(seeding.mix32(left.long()) ^ input_ids.long()) ^ (right.long() & 0xFFFFFFFF))
    return h % buckets


class LossScorer:
    """loss_ema (per id) and context (per hashed trigram, backing off to per id) scores."""

    # State-dict key prefixes of the two tables (checkpoint format, not choice names).
    ID_TABLE, CONTEXT_TABLE = "id", "context"

    def __init__(self, kind: str, vocab_size: int, decay: float, buckets: int):
        self.kind = kind
        self.buckets = buckets
        self.ids = LossTable(vocab_size, decay)
        self.contexts = LossTable(buckets, decay) if kind == choices.CONTEXT else None
        self.global_value = torch.zeros(())  # EMA of the mean loss over all predicted tokens
        self.global_count = torch.zeros((), dtype=torch.long)
        self.decay = decay

    def observations(
        self, original_ids: torch.Tensor, selected_index: torch.Tensor, token_losses: torch.Tensor
    ) -> dict:
        """What one micro-batch teaches, as flat (M,) tensors: original_ids (B, T), selected_index (M,) flat.

        Flat per predicted token, so that micro-batches and processes concatenate into one update.
        """
        observed = {
            "ids": original_ids.flatten().index_select(0, selected_index),
            "losses": token_losses.detach().float(),
        }
        if self.contexts is not None:
            observed["contexts"] = context_keys(original_ids, self.buckets).flatten().index_select(0, selected_index)
        return observed

    def learn(self, observed: dict) -> None:
        """One update of the tables from ``observations`` (of any number of micro-batches, concatenated)."""
        losses = observed["losses"]
        if losses.numel() == 0:
            return
        self.ids.update(observed["ids"], losses)
        if self.contexts is not None:
            self.contexts.update(observed["contexts"], losses)
        mean = losses.mean()
        old = self.global_value.to(mean.device)
        seen = self.global_count.to(mean.device) > 0
        self.global_value = torch.where(seen, self.decay * old + (1 - self.decay) * mean, mean)
        self.global_count = self.global_count.to(mean.device) + 1

    def batch_scores(self, model, batch: dict, eligible: torch.Tensor, step: int) -> torch.Tensor:
        return self.scores(batch["input_ids"])  # (B, T)

    def scores(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) expected masked-LM loss of each position."""
        default = self.global_value.to(input_ids.device).expand(input_ids.shape)
        scores = self.ids.lookup(input_ids.clamp(max=len(self.ids.value) - 1), default)
        if self.contexts is not None:
            scores = self.contexts.lookup(context_keys(input_ids, self.buckets), scores)
        return scores.float()

    def state_dict(self) -> dict:
        state = {**self.ids.state_dict(self.ID_TABLE), "global_value": self.global_value.cpu().clone()}
        state["global_count"] = self.global_count.cpu().clone()
        if self.contexts is not None:
            state.update(self.contexts.state_dict(self.CONTEXT_TABLE))
        return state

    def load_state_dict(self, state: dict) -> None:
        self.ids.load_state_dict(state, self.ID_TABLE)
        if self.contexts is not None:
            self.contexts.load_state_dict(state, self.CONTEXT_TABLE)
        self.global_value = state["global_value"].clone().float().cpu()
        self.global_count = state["global_count"].clone().long().cpu()


class FrequencyScorer(StatelessScorer):
    """frequency scores: -log p(id), p = (count + 1) / (total + V), from the corpus's (V,) token counts.

    Add-one smoothing gives an id the corpus never showed a finite score, the highest of all.
    Every score is >= 0 (p <= 1) and strictly decreasing in the count.
    """

    def __init__(self, token_counts, vocab_size: int):
        counts = np.zeros(vocab_size, dtype=np.float64)
        given = np.asarray(token_counts, dtype=np.float64)[:vocab_size]
        counts[: len(given)] = given  # ids beyond the stored counts: unseen
        # float64 logs, then float32: the weights that use them are float32 anyway
        self.table = torch.from_numpy(np.log(counts.sum() + vocab_size) - np.log(counts + 1.0)).float()  # (V,)

    def batch_scores(self, model, batch: dict, eligible: torch.Tensor, step: int) -> torch.Tensor:
        return self.scores(batch["input_ids"])  # (B, T)

    def scores(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) score of each position's id (specials too: selection never takes them)."""
        if self.table.device != input_ids.device:  # lives where the batches are: no host round trip per step
            self.table = self.table.to(input_ids.device)
        return self.table[input_ids.clamp(max=len(self.table) - 1)]


# ----- the scorers' entries: how each is built, and its facts ---------------------------------------
def scored_share(m: MaskingConfig) -> float:
    """The share of steps and rows a model scorer scores on average: its cost controls."""
    return m.score_fraction / m.score_every


def _over_vocab_flops(cfg: Config, encoder: float, vocab: int) -> float:
    """One forward with the full head on every position, on the scored share."""
    return scored_share(cfg.masking) * (encoder + head_flops(cfg.model, vocab, cfg.data.max_seq_length))


def _grad_norm_flops(cfg: Config, encoder: float, vocab: int) -> float:
    """Forward and backward of a GRAD_NORM_RATE-masked copy, on the scored share."""
    head = head_flops(cfg.model, vocab, GRAD_NORM_RATE * cfg.data.max_seq_length)
    return scored_share(cfg.masking) * TRAINING_PASSES * (encoder + head)


def _frequency_scorer(cfg: MaskingConfig, info, vocab_size: int, token_counts) -> FrequencyScorer:
    if token_counts is None:
        raise ValueError("the frequency scorer needs token_counts= (the corpus's token counts)")
    return FrequencyScorer(token_counts, vocab_size)


def _loss_scorer(cfg: MaskingConfig, info, vocab_size: int, token_counts) -> LossScorer:
    return LossScorer(cfg.scorer, vocab_size, cfg.ema_decay, cfg.context_buckets)


SCORER_ENTRIES = {
    entry.name: entry
    for entry in (
        ScorerEntry(
            choices.ENTROPY,
            reads=READS_MODEL,
            extra_flops=_over_vocab_flops,
            build=lambda cfg, info, vocab_size, counts: OverVocabScorer(_entropy, vocab_size, cfg.score_chunk),
        ),
        ScorerEntry(
            choices.MAX_PROB,
            reads=READS_MODEL,
            extra_flops=_over_vocab_flops,
            build=lambda cfg, info, vocab_size, counts: OverVocabScorer(_inverse_max_prob, vocab_size, cfg.score_chunk),
        ),
        ScorerEntry(
            choices.GRAD_NORM,
            reads=READS_MODEL,
            extra_flops=_grad_norm_flops,
            build=lambda cfg, info, vocab_size, counts: GradNormScorer(info, vocab_size, cfg.seed),
        ),
        # loss_ema's per-id table is vocabulary-sized: small beside the model's embeddings, so not estimated
        ScorerEntry(choices.LOSS_EMA, reads=READS_LOSSES, build=_loss_scorer),
        ScorerEntry(
            choices.CONTEXT,
            reads=READS_LOSSES,
            build=_loss_scorer,
            state_bytes=lambda cfg: {"context table": CONTEXT_BYTES_PER_BUCKET * cfg.context_buckets},
        ),
        ScorerEntry(choices.FREQUENCY, reads=READS_COUNTS, build=_frequency_scorer),
    )
}


def add_scorer(entry: ScorerEntry) -> None:
    """Make ``entry`` a masking.scorer: the config accepts its name, and ADM builds and prices it by its entry."""
    add_entry(SCORER_ENTRIES, choices.SCORERS, entry, "masking.scorer")


def scorer_entry(name: str) -> ScorerEntry:
    """The entry of masking.scorer ``name``."""
    return entry_named(SCORER_ENTRIES, name, "masking.scorer")


def scorer_names(reads: str) -> list[str]:
    """The scorers that read ``reads`` (variants.READS_*)."""
    return [name for name, entry in SCORER_ENTRIES.items() if entry.reads == reads]
