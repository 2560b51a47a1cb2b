"""Masking strategies: each one only decides the epoch key and per-position weights.

``static`` (BERT) reuses ``dupe_factor`` distinct masks per example, cycled over epochs;
``dynamic`` (RoBERTa) draws new masks every epoch. Both use uniform weights, so the
selection itself is the shared Gumbel-top-k of ``select.py``.

``span`` (SpanBERT) and ``pmi`` (PMI-Masking) key like ``dynamic`` with uniform weights, and select units of
whole words instead of single positions (units.py): random-length spans, or the corpus's collocated n-grams.
Their targets are corrupted 80/10/10 per token like every other strategy's (SpanBERT decides per span), so that
strategies differ only in which positions are targets; per-span corruption is not offered.

``adaptive`` (ADM, seeds/002) keys like ``dynamic`` and weights each eligible position
w = max((1 - a) + a * s, floor), where s is the position's uncertainty score (scorers.py),
normalised to mean 1 over the sequence's eligible positions (or raw, as the seed), and
a = a_max * f(progress) (schedules.py). a = 0 gives exactly the dynamic masks. k stays
round(rate * eligible); special tokens are never eligible, whatever their score.

Frequency-neutral ADM (``masking.frequency_neutral``) is a control for the target prior:
ADM's weights move targets from frequent to rare ids, which by itself refits the output
bias. It gives every corpus-frequency bucket (``masking.freq_buckets``) of a sequence the
share of k that uniform masking gives it in expectation, and lets the weights choose only
within a bucket (select.gumbel_top_k_grouped). Rescaling scores per bucket would not do:
Gumbel-top-k's inclusion probabilities are not proportional to the weights. The quotas
apply at every step, also where the weights are uniform (a = 0, unscored steps).

A training step calls a strategy in the order masker.py's docstring gives (variants.Strategy).
Each strategy's entry (``STRATEGY_ENTRIES``, at the end) says how to build it and what others
ask of it: its label, its cost, its state, whether it runs under FSDP.
"""

from collections import deque

import torch

from mlmlab import choices
from mlmlab.config import Config, MaskingConfig
from mlmlab.errors import UserError
from mlmlab.masking.buckets import frequency_buckets
from mlmlab.masking.schedules import adapt_factor
from mlmlab.masking.scorers import SCORER_ENTRIES, scorer_entry
from mlmlab.masking.seeding import STREAM_SCORED_ROWS, row_uniforms
from mlmlab.masking.select import TokenInfo, eligible_positions
from mlmlab.masking.units import NgramTable, drawn_span_lengths, unit_starts
from mlmlab.masking.variants import StrategyEntry, add_entry, entry_named
from mlmlab.model.pretraining import IGNORE_INDEX
from mlmlab.utils.devices import clock

LEGACY_STEP_KEY = "step"  # in the masking state of checkpoints made before the optimizer step drove scoring


class UniformStrategy:
    """RoBERTa's dynamic masking: every eligible position equally likely, new masks every epoch."""

    def __init__(self, cfg: MaskingConfig, vocab_size: int | None = None, token_counts=None):
        self.cfg = cfg
        self.bucket_of, self.bucket_names = None, []
        if token_counts is not None and vocab_size is not None:
            self.bucket_of, self.bucket_names = frequency_buckets(token_counts, cfg.freq_cuts, vocab_size)
        self._reset_window()

    def _reset_window(self) -> None:
        self._bucket_hits = torch.zeros(len(self.bucket_names), dtype=torch.long)
        self._score_sums = [0.0, 0.0, 0]  # mean score of selected, of eligible, micro-batches they sum over
        self._scored_steps = 0  # optimizer steps scored: one per step however many micro-batches it has
        self._seconds = 0.0

    def epoch_key(self, epoch: int) -> int:
        return epoch

    def weights(self, model, batch: dict, progress: float, epoch_key: int = 0, step: int = 1):
        return None  # uniform

    def selection_groups(self, batch: dict):
        """(B, T) groups whose share of the targets selection must keep, or None: uniform masking keeps none."""

    def selection_units(self, batch: dict, epoch_key: int, starts: torch.Tensor, eligible: torch.Tensor):
        """None: single positions (or single words, masking.whole_word) are the units."""

    def observe(self, batch: dict, result: dict) -> None:
        """Count what was selected (and, adaptive, keep the micro-batch's masked-LM losses for learn())."""
        if self.bucket_of is not None:
            ids = batch["labels"].flatten().index_select(0, result["selected_index"]).cpu()  # (M,)
            buckets = self.bucket_of[ids.clamp(max=len(self.bucket_of) - 1)]
            self._bucket_hits += torch.bincount(buckets, minlength=len(self.bucket_names))

    def learn(self, gather=None) -> None:
        """Uniform strategies learn nothing."""

    def stats(self, total=None) -> dict:
        """Logs since the previous call: selected share per frequency bucket (and ADM's own).

        ``total`` sums a tensor over processes (every process then calls ``stats``), so that
        the figures describe the global batch rather than the main process's share of it.
        """
        hits = total(self._bucket_hits) if total else self._bucket_hits  # (buckets,)
        out, selected = {}, int(hits.sum())
        for name, count in zip(self.bucket_names, hits.tolist()):
            out[f"mask_share_freq_{name}"] = count / selected if selected else float("nan")
        self._reset_window()
        return out

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Uniform strategies keep no state."""


class StaticStrategy(UniformStrategy):
    """BERT's static masking: uniform, dupe_factor distinct masks per example cycled over epochs."""

    def epoch_key(self, epoch: int) -> int:
        return epoch % self.cfg.dupe_factor  # the key ignores the epoch beyond dupe_factor distinct versions


class AdaptiveStrategy(UniformStrategy):
    """ADM: weights from uncertainty scores, blended with uniform by a = a_max * f(progress)."""

    def __init__(self, cfg: MaskingConfig, info: TokenInfo, vocab_size: int, token_counts=None):
        super().__init__(cfg, vocab_size, token_counts)
        self.info = info
        self.vocab_size = vocab_size
        self.a = 0.0
        self.score_seconds_total = 0.0
        self.scorer_runs_the_model = scorer_entry(cfg.scorer).runs_the_model  # only model passes are thinned out
        self.scorer = scorer_entry(cfg.scorer).build(cfg, info, vocab_size, token_counts)
        self._group_table = None  # frequency_neutral: bucket_of on the batches' device (observe() counts on the CPU)
        # stats(): (scores, counted) of each weights() call, (B, T) each, until observe() takes its own batch's
        # (grad_accum: a step asks the weights of all its micro-batches before the first one is observed).
        self._unobserved_scores = deque()
        self._observed = []  # scorers that learn: observations of this step's micro-batches, for learn()
        self._last_scored_step = None

    def weights(self, model, batch: dict, progress: float, epoch_key: int = 0, step: int = 1):
        """(B, T) selection weights, or None for uniform; ``epoch_key``: the masks' (it draws score_fraction's rows).

        ``step``: the optimizer step (from 1) the batch trains. score_every and grad_norm's masks follow
        it, not a count of calls, so every micro-batch and process of one step is scored alike, and a
        run scores the same steps however its global batch is split.
        """
        weights, scores = self._weights_and_scores(model, batch, progress, epoch_key, step)
        self._unobserved_scores.append(scores)
        return weights

    def _weights_and_scores(self, model, batch: dict, progress: float, epoch_key: int, step: int):
        """weights() and, for stats(), (scores, counted): the normalised scores and the (B, T) positions they
        describe (eligible, in scored rows); (None, None) where the weights are uniform."""
        cfg = self.cfg
        self.a = adapt_factor(cfg.adapt_schedule, progress, cfg.a_max)
        model_scorer = self.scorer_runs_the_model  # only model passes cost enough to thin out
        if self.a == 0.0 or (model_scorer and (step - 1) % cfg.score_every):
            return None, None  # uniform: exactly the dynamic masks, and no scoring cost
        eligible = eligible_positions(batch["input_ids"], self.info.special_ids)  # (B, T)
        scored = self._scored_rows(batch, epoch_key) if model_scorer else None  # (B,) bool; None: every row
        scores = normalise(self._raw_scores(model, batch, eligible, scored, step), eligible, cfg.normalize)  # (B, T)
        self._count_scored_step(step)
        weights = blend(scores, self.a, cfg.floor)
        counted = eligible.clone()  # (B, T)
        if scored is not None:
            weights[~scored] = 1.0  # rows not scored: uniform
            counted[~scored] = False
        return weights, (scores, counted)

    def _count_scored_step(self, step: int) -> None:
        """A step's micro-batches all score at the same step: count it once (stats' mask_scored_steps)."""
        if step != self._last_scored_step:
            self._scored_steps += 1
            self._last_scored_step = step

    def _raw_scores(
        self, model, batch: dict, eligible: torch.Tensor, scored: torch.Tensor | None, step: int
    ) -> torch.Tensor:
        """(B, T) the scorer's scores of the ``scored`` rows (None: every row), 0 in the others; timed for stats()."""
        input_ids = batch["input_ids"]  # (B, T)
        rows = slice(None) if scored is None else scored
        start = clock(input_ids.device)
        raw = torch.zeros(input_ids.shape, device=input_ids.device)  # (B, T)
        head = (
            batch
            if scored is None
            else {k: v[scored] if torch.is_tensor(v) and v.dim() else v for k, v in batch.items()}
        )
        if len(head["input_ids"]):
            raw[rows] = self.scorer.batch_scores(model, head, eligible[rows], step)
        self._add_seconds(clock(input_ids.device) - start)
        return raw

    def _scored_rows(self, batch: dict, epoch_key: int) -> torch.Tensor | None:
        """Under score_fraction < 1, (B,) which sequences to score; None: every one.

        Drawn per example (counter-based), not the batch's leading rows: which sequences are
        scored then does not depend on how the global batch is split over processes and
        micro-batches. Each one is scored with probability score_fraction.
        """
        if self.cfg.score_fraction >= 1.0:
            return None
        ids = batch["example_ids"]  # (B,)
        draws = row_uniforms(self.cfg.seed, STREAM_SCORED_ROWS, ids, torch.full_like(ids, epoch_key))  # (B,)
        return draws < self.cfg.score_fraction

    def selection_groups(self, batch: dict):
        """frequency_neutral: (B, T) corpus-frequency bucket of every position; else None."""
        if not self.cfg.frequency_neutral:
            return None
        ids = batch["input_ids"]  # (B, T)
        if self._group_table is None or self._group_table.device != ids.device:
            self._group_table = self.bucket_of.to(ids.device)
        return self._group_table[ids.clamp(max=len(self._group_table) - 1)]  # (B, T)

    def _add_seconds(self, seconds: float) -> None:
        self._seconds += seconds
        self.score_seconds_total += seconds

    def observe(self, batch: dict, result: dict) -> None:
        super().observe(batch, result)
        selected_index = result["selected_index"]  # (M,)
        labels = batch["labels"]  # (B, T): the original ids where selected
        original = torch.where(labels != IGNORE_INDEX, labels, batch["input_ids"])  # (B, T)
        observed = self.scorer.observations(original, selected_index, result["token_losses"])
        if observed is not None:
            self._observed.append(observed)
        # The oldest weights() call's scores are this batch's; none where weights() was not asked (a caller
        # feeding the loss tables directly).
        scores = self._unobserved_scores.popleft() if self._unobserved_scores else None
        if scores is not None:
            self._add_score_sums(*scores, selected_index)

    def _add_score_sums(self, scores: torch.Tensor, counted: torch.Tensor, selected_index: torch.Tensor) -> None:
        """Mean score of the selected and of all counted positions (both (B, T)); selected_index: (M,) flat."""
        selected = torch.zeros(counted.numel(), dtype=torch.bool, device=counted.device)
        selected = selected.index_fill_(0, selected_index, True).view_as(counted) & counted  # (B, T)
        if selected.any():
            self._score_sums[0] += float(scores[selected].mean())
            self._score_sums[1] += float(scores[counted].mean())
            self._score_sums[2] += 1

    def learn(self, gather=None) -> None:
        """One update of the loss tables from all of the step's micro-batches, on every process.

        ``gather`` concatenates a (N,) tensor over processes. With it each process learns the
        same tables from the whole global batch, as one process with that batch would: masks do
        not depend on the process count, and the main process's checkpoint holds every process's
        tables. Once per step (not per micro-batch), so grad_accum does not change them either.
        """
        if not self._observed:
            return
        observed = {key: torch.cat([o[key] for o in self._observed]) for key in self._observed[0]}
        self._observed = []
        if gather is not None:
            observed = {key: gather(value) for key, value in observed.items()}
        self.scorer.learn(observed)

    def stats(self, total=None) -> dict:
        sums = torch.tensor(self._score_sums, dtype=torch.float64)  # (selected, eligible, micro-batches) sums
        selected, eligible, all_scored = (total(sums) if total else sums).tolist()
        out = {
            "mask_a": self.a,
            "mask_score_selected": selected / all_scored if all_scored else float("nan"),
            "mask_score_eligible": eligible / all_scored if all_scored else float("nan"),
            "mask_scored_steps": self._scored_steps,  # step-based: the same on every process
            "mask_score_seconds": self._seconds,  # the main process's
            "mask_score_seconds_total": self.score_seconds_total,
        }
        out.update(super().stats(total))  # resets the window
        return out

    def state_dict(self) -> dict:
        state = {
            **super().state_dict(),
            "score_seconds_total": torch.tensor(self.score_seconds_total, dtype=torch.float64),
        }
        return {**state, **self.scorer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        state = {key: value for key, value in state.items() if key != LEGACY_STEP_KEY}
        expected = set(self.state_dict())
        if set(state) != expected:
            raise UserError(
                f"the checkpoint's masking state has keys {sorted(state)} but masking.scorer={self.cfg.scorer} "
                f"expects {sorted(expected)}; resume with the masking settings the run started with"
            )
        for key, value in self.state_dict().items():
            if tuple(state[key].shape) != tuple(value.shape):
                raise UserError(
                    f"the checkpoint's masking state '{key}' has shape {tuple(state[key].shape)}, expected "
                    f"{tuple(value.shape)}; resume with the same vocabulary and masking.context_buckets"
                )
        super().load_state_dict(state)
        self.score_seconds_total = float(state["score_seconds_total"])
        self.scorer.load_state_dict(state)


class SpanStrategy(UniformStrategy):
    """SpanBERT's span masking: units of whole words whose lengths are drawn anew every epoch (units.py)."""

    def selection_units(self, batch: dict, epoch_key: int, starts: torch.Tensor, eligible: torch.Tensor):
        ids = batch["example_ids"]  # (B,)
        lengths = drawn_span_lengths(
            self.cfg.seed,
            ids,
            torch.full_like(ids, epoch_key),
            starts.size(1),
            self.cfg.span_p,
            self.cfg.span_max_words,
        )  # (B, T)
        return unit_starts(starts, eligible, lengths)


class PmiStrategy(UniformStrategy):
    """PMI-Masking: the corpus's collocated n-grams (the longest one at a word, taken left to right) and otherwise
    single words are the units; the units of a sequence are fixed, which of them are targets is drawn every epoch."""

    def __init__(self, cfg: MaskingConfig, ngrams: list[dict], vocab_size=None, token_counts=None):
        super().__init__(cfg, vocab_size, token_counts)
        self.table = NgramTable([entry["words"] for entry in ngrams], cfg.pmi_max_n)

    def selection_units(self, batch: dict, epoch_key: int, starts: torch.Tensor, eligible: torch.Tensor):
        lengths = self.table.lengths(batch["input_ids"], starts, eligible)  # (B, T)
        return unit_starts(starts, eligible, lengths)


def normalise(scores: torch.Tensor, eligible: torch.Tensor, how: str) -> torch.Tensor:
    """(B, T) scores; "mean": each row scaled to mean 1 over its eligible positions; "raw": as is."""
    if how == choices.RAW:
        return scores
    scores = torch.where(eligible, scores.float(), 0.0)
    n = eligible.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    mean = scores.sum(dim=1, keepdim=True) / n  # (B, 1)
    ok = mean > 0
    return torch.where(ok, scores / torch.where(ok, mean, 1.0), torch.ones_like(scores))


def blend(scores: torch.Tensor, a: float, floor: float) -> torch.Tensor:
    """ADM's weight: w = max((1 - a) * 1 + a * s, floor), (B, T)."""
    return ((1.0 - a) + a * scores).clamp(min=floor)


# ----- the strategies' entries: how each is built, and its facts -----------------------------------
def _uniform(cls):
    return lambda cfg, info=None, vocab_size=None, token_counts=None: cls(cfg, vocab_size, token_counts)


def _adaptive(cfg: MaskingConfig, info: TokenInfo | None = None, vocab_size: int | None = None, token_counts=None):
    if info is None or vocab_size is None:
        raise ValueError("the adaptive strategy needs info= and vocab_size=")
    if token_counts is None and cfg.frequency_neutral:
        raise ValueError("frequency_neutral needs token_counts= (the corpus's token counts)")
    return AdaptiveStrategy(cfg, info, vocab_size, token_counts)


def _pmi(cfg: MaskingConfig, info=None, vocab_size=None, token_counts=None, ngrams=None):
    if ngrams is None:
        raise ValueError("the pmi strategy needs ngrams= (data.ngrams.ngram_vocabulary of the training corpus)")
    return PmiStrategy(cfg, ngrams, vocab_size, token_counts)


def _adaptive_label(m: dict) -> str:
    label = f"ADM {m['scorer']}, a={m['a_max']:g}·{m['adapt_schedule']}"
    scorer = SCORER_ENTRIES.get(m["scorer"])  # None: a scorer registered where the run was made, not here
    if scorer and scorer.runs_the_model:  # the cost controls apply to model passes only
        label += f", every {m['score_every']} steps" if m["score_every"] > 1 else ""
        label += f", {m['score_fraction']:g} of rows" if m["score_fraction"] < 1 else ""
    return label + (", frequency-neutral" if m.get("frequency_neutral") else "")  # absent from older results


def _adaptive_card(m: MaskingConfig) -> list[str]:
    return [
        f"- adaptive masking: scorer `{m.scorer}`, schedule `{m.adapt_schedule}`, a_max {m.a_max}, "
        f"floor {m.floor}, normalize `{m.normalize}`, scored every {m.score_every} step(s)"
        + (", frequency-neutral" if m.frequency_neutral else "")
    ]


def _adaptive_flops(cfg: Config, encoder: float, vocab: int) -> float:
    return 0.0 if cfg.masking.a_max == 0.0 else scorer_entry(cfg.masking.scorer).extra_flops(cfg, encoder, vocab)


def _adaptive_fsdp_refusal(m: MaskingConfig) -> str | None:
    if scorer_entry(m.scorer).runs_under_fsdp:
        return None
    sharded = [name for name, entry in SCORER_ENTRIES.items() if entry.runs_under_fsdp]
    return (
        f"masking.scorer={m.scorer} needs the whole model on each process, which FSDP shards; under FSDP use "
        f"scorer {choices.listed(sharded)}, or launch with DDP"
    )


# ADM's own keys, its scorers' included (score_chunk, ema_decay, context_buckets belong to one scorer or two)
ADAPTIVE_SETTINGS = (
    "scorer",
    "adapt_schedule",
    "a_max",
    "floor",
    "normalize",
    "score_every",
    "score_fraction",
    "score_chunk",
    "ema_decay",
    "context_buckets",
    "frequency_neutral",
)

STRATEGY_ENTRIES = {
    entry.name: entry
    for entry in (
        StrategyEntry(
            choices.STATIC,
            build=_uniform(StaticStrategy),
            card_lines=lambda m: [f"- static masking: {m.dupe_factor} fixed masks per example, cycled over epochs"],
            settings=("dupe_factor",),
        ),
        StrategyEntry(choices.DYNAMIC, build=_uniform(UniformStrategy)),
        StrategyEntry(
            choices.ADAPTIVE,
            build=_adaptive,
            label=_adaptive_label,
            scored=True,
            card_lines=_adaptive_card,
            extra_flops=_adaptive_flops,
            state_bytes=lambda m: scorer_entry(m.scorer).state_bytes(m),
            fsdp_refusal=_adaptive_fsdp_refusal,
            settings=ADAPTIVE_SETTINGS,
        ),
        StrategyEntry(
            choices.SPAN,
            build=_uniform(SpanStrategy),
            label=lambda m: f"span p={m['span_p']:g}, ≤{m['span_max_words']} words",
            card_lines=lambda m: [
                f"- span masking (SpanBERT): spans of whole words, lengths ~ Geo({m.span_p}) over 1 to "
                f"{m.span_max_words} words"
            ],
            units=True,
            settings=("span_p", "span_max_words"),
        ),
        StrategyEntry(
            choices.PMI,
            build=_pmi,
            label=lambda m: f"PMI n-grams ({m['pmi_vocab_size']:,}, n {m['pmi_min_n']}-{m['pmi_max_n']})",
            card_lines=lambda m: [
                f"- PMI masking (Levine et al. 2021): {m.pmi_vocab_size:,} n-grams of {m.pmi_min_n} to "
                f"{m.pmi_max_n} words from the training corpus (each seen at least {m.pmi_min_count} times), "
                "else single words"
            ],
            units=True,
            ngrams=True,
            settings=("pmi_vocab_size", "pmi_min_n", "pmi_max_n", "pmi_min_count"),
        ),
    )
}


def add_strategy(entry: StrategyEntry) -> None:
    """Make ``entry`` a masking.strategy: the config accepts its name, training builds it, and budgets, memory
    estimates, launches, reports and the model card ask its entry."""
    add_entry(STRATEGY_ENTRIES, choices.STRATEGIES, entry, "masking.strategy")


def strategy_entry(name: str) -> StrategyEntry:
    """The entry of masking.strategy ``name``."""
    return entry_named(STRATEGY_ENTRIES, name, "masking.strategy")


def refuse_other_strategies_settings(strategy: str, named, where: str = "") -> None:
    """A one-line UserError when ``named`` (dotted keys a user chose) holds a masking.* key that only another
    strategy reads (its entry's ``settings``): beside this strategy it would change nothing, silently.

    Only named keys, never every key of the config: a study's base carries the ADM arm's a_max beside its dynamic
    arm, and a run's config.yaml records every key whatever the strategy; both are records, not choices. So the
    check runs where the named keys are known, not in the config's own validation (which sees only values, and sits
    below these entries): the Trainer's set-up for pretrain (config.named_keys), and a study's arms for their own
    keys (experiments/study.py), so that shipped studies load and their run keys stay as they are."""
    own = set(strategy_entry(strategy).settings)
    for name, entry in STRATEGY_ENTRIES.items():
        for key in entry.settings:
            if f"masking.{key}" in named and key not in own:
                raise UserError(
                    f"{where}masking.{key} is read by masking.strategy={name} only, and this run's strategy is "
                    f"{strategy}: it would change nothing; drop masking.{key}, or set "
                    f"masking.strategy={name}"
                )


def build_strategy(
    cfg: MaskingConfig, info: TokenInfo | None = None, vocab_size: int | None = None, token_counts=None, ngrams=None
):
    """The strategy cfg.strategy names. vocab_size: the tokenizer's (unpadded); token_counts: (V,) corpus counts or
    None; ngrams: the corpus's PMI n-gram vocabulary, handed only to an entry that reads it."""
    entry = strategy_entry(cfg.strategy)
    extra = {"ngrams": ngrams} if entry.ngrams else {}
    return entry.build(cfg, info, vocab_size, token_counts, **extra)
