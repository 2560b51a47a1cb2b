"""Typed configuration: one dataclass per component, YAML presets, dotted overrides.

A preset is a YAML file holding only what differs from the defaults below. The
resolution order is: defaults < preset or config file < ``key=value`` overrides.
Any key that is not a field is an error, so a typo never silently trains the wrong model.
"""

import ast
import dataclasses
import hashlib
import inspect
import io
import math
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mlmlab import choices
from mlmlab.errors import UserError

PRESET_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class Allowed:
    """The values a number may take: an interval, finite whatever its bounds.

    A check written ``x < 0`` lets NaN through (every comparison with NaN is false): NaN mask
    probabilities trained a model to copy its input, and a NaN weight decay wrote NaN weights.
    """

    low: float
    high: float = math.inf  # inf: no upper bound (the value must still be finite)
    low_open: bool = False
    high_open: bool = False
    why: str = ""  # said in the refusal when the range is not self-explanatory

    def admits(self, value) -> bool:
        if isinstance(value, int) and abs(value) > LARGEST_INT:
            return False
        if not (isinstance(value, int) or math.isfinite(value)):  # a huge int has no float: LARGEST_INT refuses it
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self, value) -> str:
        if isinstance(value, int) and abs(value) > LARGEST_INT:
            return f"at most {LARGEST_INT} in size (2**53: past it a count is no longer exact as a float)"
        if self.high == math.inf:
            text = "positive" if (self.low, self.low_open) == (0, True) else f"at least {self.low:g}"
            text += "" if isinstance(value, int) else " and finite"
        else:
            text = f"within {'[('[self.low_open]}{self.low:g}, {self.high:.10g}{'])'[self.high_open]}"
        return f"{text} ({self.why})" if self.why else text


# The largest whole number any count, size or step of mlmlab may be: steps, tokens and FLOPs are also
# counted as floats (exact up to 2**53), and 10**30 steps overflowed int64 tensors with a traceback.
LARGEST_INT = 2**53


def check_range(key: str, value, allowed: Allowed, example) -> None:
    """A one-line UserError naming ``key``, its value and what is allowed, unless ``allowed`` admits it."""
    if value is not None and not allowed.admits(value):
        raise UserError(f"{key}={value!r} must be {allowed.describe(value)}; use e.g. {key}={example}")


PROBABILITY = Allowed(0.0, 1.0)
RATE = Allowed(0.0, 1.0, low_open=True, high_open=True)
FRACTION = Allowed(0.0, 1.0, low_open=True)  # (0, 1]: a share of something, all of it allowed
BELOW_ONE = Allowed(0.0, 1.0, high_open=True)  # [0, 1): dropout 1 would zero every activation, a beta 1 never forget
POSITIVE = Allowed(0.0, low_open=True)
NON_NEGATIVE = Allowed(0.0)
# numpy's legacy seeding (accelerate's and transformers' set_seed) takes only 32-bit seeds, and the masks'
# counter-based hash (seeding.py) folds a seed to 32 bits: a larger one would repeat a smaller one's masks.
SEEDS = Allowed(0, 2**32 - 1, why="seeds are 32-bit")


def at_least(least: int) -> Allowed:
    return Allowed(least)


def number_argument(option: str, kind: type, allowed: Allowed, example) -> Callable[[str], int | float]:
    """argparse ``type=`` of a command's numeric option: ``kind`` read from the text, then range-checked as a
    config key is, so that a bad value is the same one line (a UserError, not argparse's usage message)."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise UserError(f"{option} {text!r} is not {what}; use e.g. {option} {example}") from None
        check_range(option, value, allowed, example)
        return value

    return parse


# Every number of the config is declared with its allowed values. Counts and sizes out of range fail deep
# inside training (a division by zero, a deleted checkpoint); a negative learning rate ascends the loss; a NaN
# anywhere trains something other than asked, silently.
def ranged(default, allowed: Allowed, example=None):
    """A numeric field with the values it may take, and the value a refusal suggests instead (default: ``default``)."""
    return field(default=default, metadata={"range": (allowed, default if example is None else example)})


def declared_ranges(cfg: "Config") -> list[tuple[str, object, Allowed, object]]:
    """(dotted key, value, allowed values, example) of every numeric field of ``cfg``, in declaration order."""
    found = []
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        found += [
            (f"{section.name}.{key.name}", getattr(values, key.name), *key.metadata["range"])
            for key in dataclasses.fields(values)
            if "range" in key.metadata
        ]
    return found


@dataclass
class ModelConfig:
    # "bert": the seed's BertForPreTraining; "roberta": transformers' RobertaForMaskedLM (MLM only, no NSP head);
    # "xlm-roberta": the same as XLMRobertaForMaskedLM (XLM-R's folders); "modernbert": transformers'
    # ModernBertForMaskedLM (MLM only, no NSP head)
    architecture: str = choices.BERT
    hidden_size: int = ranged(128, at_least(1))  # tiny by default: runs on a laptop CPU in minutes
    num_layers: int = ranged(2, at_least(1))  # encoder layers (BERT-base: 12)
    num_heads: int = ranged(2, at_least(1))  # attention heads; hidden_size must be divisible by it
    intermediate_size: int = ranged(512, at_least(1))  # 4x hidden, as in BERT
    # tokens; longer ones are refused (RoBERTa's config.json adds pad id + 1 rows)
    max_position_embeddings: int = ranged(512, at_least(1))
    # Hidden states (BERT's hidden_dropout_prob, 0.1); also attention's unless set below. Off by
    # default, as cramming pretrains: in studies/dropout-wp8k (tiny, 9,000 steps, 3 seeds) no dropout
    # reached a lower held-out loss than BERT's 0.1, at +28% tokens/s at mini (README, Throughput).
    dropout: float = ranged(0.0, BELOW_ONE, example=0.1)
    # Attention probabilities (attention_probs_dropout_prob); null: model.dropout. 0 lets torch's
    # SDPA take its fused kernel on CPU: +15% tokens/s at mini (benchmarks/throughput.py).
    attention_dropout: float | None = ranged(None, BELOW_ONE, example=0.1)
    # transformers' attention implementation: "sdpa" measured faster than "eager" (benchmarks/throughput.py);
    # "sdpa_fp32" is sdpa on fp32 copies under bf16 autocast (mlmlab/model/attention_fp32.py), a CPU lever.
    attention: str = "sdpa"
    pad_vocab_multiple: int = ranged(64, at_least(1))  # matmul-friendly vocab size; padded ids are never targets
    # modernbert only (defaults: the published ModernBERT's). Local layers attend within this window
    # (local_attention // 2 tokens each side); layers 0, n, 2n, ... attend globally; RoPE bases of each.
    local_attention: int = ranged(128, at_least(2))
    global_attention_every: int = ranged(3, at_least(1))
    rope_theta_global: float = ranged(160000.0, POSITIVE)
    rope_theta_local: float = ranged(10000.0, POSITIVE)


@dataclass
class DataConfig:
    # Files (text, WikiExtractor, JSONL; .gz ok; .parquet/.arrow), folders of them (recursive) or folders written
    # by datasets' save_to_disk; empty: the sample bundled with the package. A mapping {source: weight} of two or
    # more is a mixture: each epoch draws from each source its weight's share of the examples (docs/data.md)
    corpus: list[str] | dict[str, float] = field(default_factory=list)
    valid_corpus: list[str] = field(default_factory=list)  # as corpus; empty: the bundled validation sample
    # > 0: hold out this share of the training corpus's documents (by a hash of each one's text) as the held-out
    # set instead of valid_corpus; 0: valid_corpus
    valid_fraction: float = ranged(
        0.0, Allowed(0.0, 0.5, why="a held-out split larger than the training side is a mistake"), example=0.02
    )
    text_column: str = "text"  # JSONL and tables: the field holding the text
    # as text_column, for valid_corpus (a JSONL training file's "body" beside a held-out one's "text"); empty:
    # text_column
    valid_text_column: str = ""
    # JSONL and tables: consecutive records with the same value here form one document; empty: one record, one document
    id_column: str = ""
    # a tokenizer folder (tokenizer.json, or vocab.json + merges.txt), a vocab.txt, or a bundled one by name
    # (sample-bpe-8k: byte-level BPE on the sample); empty: bundled bert-base-uncased vocab
    tokenizer: str = ""
    # tokens per instance, [CLS] and [SEP] included (BERT: 128, then 512 for the last 10%)
    max_seq_length: int = ranged(128, at_least(8))
    objective: str = choices.NSP  # "nsp": sentence pairs + NSP loss; "mlm": packed full sentences, no NSP
    # google-research/bert: share of instances with a shorter target length
    short_seq_prob: float = ranged(0.1, PROBABILITY)
    prepare_seed: int = ranged(12345, SEEDS)  # NSP pair sampling; part of the prepared dataset's hash
    # processes preparing a dataset not yet prepared; 0: every core this process may use
    prepare_workers: int = ranged(0, at_least(0), example=2)
    loader_workers: int = ranged(1, at_least(0))  # DataLoader worker processes that prefetch batches
    # sort each run of this many batches by length (less padding); 0: plain shuffle
    bucket_batches: int = ranged(50, at_least(0))


@dataclass
class MaskingConfig:
    # "static" (BERT), "dynamic" (RoBERTa), "adaptive" (ADM), "span" (SpanBERT), "pmi" (PMI-Masking)
    strategy: str = choices.DYNAMIC
    rate: float = ranged(0.15, RATE)  # share of eligible positions selected per sequence
    mask_prob: float = ranged(0.8, PROBABILITY)  # of the selected: shown as [MASK]
    # of the selected: shown as a random ordinary token; the rest unchanged
    random_prob: float = ranged(0.1, PROBABILITY)
    dupe_factor: int = ranged(10, at_least(1))  # static only: number of distinct masks cycled over epochs
    seed: int = ranged(0, SEEDS)  # masks are a function of (seed, example, epoch, position)
    mask_unk: bool = False  # whether [UNK] may be selected (it carries no learnable identity)
    whole_word: bool = False  # select whole words (the tokenizer's ##, Ġ or ▁ tells where one begins), any strategy
    rate_schedule: str = (
        choices.CONSTANT
    )  # "constant" (rate) or "linear_decay" from rate_start to rate (Ankner et al. 2024)
    rate_start: float = ranged(0.30, RATE)  # linear_decay only: the mask rate at step 0
    scorer: str = (
        choices.ENTROPY
    )  # adaptive: entropy (seed's), max_prob, grad_norm, loss_ema (~free), context, frequency (control)
    adapt_schedule: str = choices.QUADRATIC  # adaptive: shape of a(progress); the seed's is progress ** 2
    # adaptive: a = a_max * f(progress); lower keeps some uniform masking at the end
    a_max: float = ranged(1.0, PROBABILITY)
    # adaptive: least weight of any eligible position (the seed's 0.1), so none starves
    floor: float = ranged(0.1, POSITIVE)
    normalize: str = choices.MEAN  # adaptive: "mean" scales scores to mean 1 per sequence; "raw" is the seed's formula
    # adaptive, model scorers: score every K-th step, uniform masks between (cost control)
    score_every: int = ranged(1, at_least(1))
    # adaptive, model scorers: each sequence is scored with this chance (per example)
    score_fraction: float = ranged(1.0, FRACTION, example=0.25)
    # entropy/max_prob: positions projected onto the vocabulary at once (memory cap)
    score_chunk: int = ranged(2048, at_least(1))
    # loss_ema/context: weight of the old running loss at each update of an entry
    ema_decay: float = ranged(0.95, BELOW_ONE)
    # context: hashed (left, token, right) loss table size; collisions share entries
    context_buckets: int = ranged(1048576, at_least(1))
    # Frequency-rank cut-offs of the per-bucket figures: the masked share while training and
    # held-out perplexity at each evaluation. Default: the 1k most frequent ids, the next 9k, the rest.
    freq_buckets: str = "1000,10000"
    # adaptive: draw each frequency bucket's share of the k targets as uniform masking would
    # (k * n_b / n per sequence, randomised rounding) and let the weights choose only within a
    # bucket: a control that cannot shift the target prior between frequent and rare ids.
    frequency_neutral: bool = False
    # span (SpanBERT, Joshi et al. 2020): span lengths in words ~ Geo(span_p) renormalised over 1..span_max_words;
    # the paper's 0.2 and 10 give a mean of 3.8 words
    span_p: float = ranged(0.2, RATE)
    span_max_words: int = ranged(10, at_least(1))  # span: the longest span, in words (the paper's 10)
    # pmi (PMI-Masking, Levine et al. 2021): n-grams in the vocabulary built from the training corpus. The paper's
    # 800k is for BERT's 3.3B-word corpus; a corpus of millions of words wants thousands
    pmi_vocab_size: int = ranged(800000, at_least(1), example=20000)
    pmi_min_n: int = ranged(2, at_least(2))  # pmi: the shortest n-gram, in words (the paper's 2)
    pmi_max_n: int = ranged(5, at_least(2))  # pmi: the longest n-gram, in words (the paper's 5)
    pmi_min_count: int = ranged(11, at_least(1))  # pmi: the fewest occurrences of an n-gram (the paper's "over 10")

    @property
    def freq_cuts(self) -> tuple[int, ...]:
        """``freq_buckets`` as increasing ranks, or a UserError naming the key."""
        return frequency_cuts(self.freq_buckets, "masking.freq_buckets")


@dataclass
class TrainConfig:
    # Sequences per micro-batch on each process: the global batch per optimizer step is batch_size * grad_accum *
    # processes. `pretrain --processes N` instead keeps it as the global batch and gives each process batch_size / N
    batch_size: int = ranged(32, at_least(1))
    grad_accum: int = ranged(1, at_least(1))  # micro-batches whose gradients are summed into one optimizer step
    # ModernBERT's batch-size warmup: over these first steps a step takes batch_warmup_start micro-batches, then one
    # more at a time up to grad_accum - 1, each count for an equal share of the steps (its recipe gives every batch
    # size the same number of updates); then grad_accum. 0: off. The data is not skipped: a smaller step reads less
    batch_warmup_steps: int = ranged(0, at_least(0), example=1000)
    # micro-batches per step when the batch warmup starts (per process)
    batch_warmup_start: int = ranged(1, at_least(1))
    lr: float = ranged(1e-3, POSITIVE)  # small models tolerate a high LR (cramming, academic-budget-bert)
    # "adamw" (torch's, fused), or "stable-adamw": AdamW whose step shrinks per tensor when that tensor's gradient
    # spikes past its running scale (ModernBERT's optimizer; mlmlab/train/stable_adamw.py)
    optimizer: str = choices.ADAMW
    weight_decay: float = ranged(0.01, NON_NEGATIVE)  # decoupled (AdamW); never on bias or LayerNorm
    adam_beta1: float = ranged(0.9, BELOW_ONE)  # AdamW's first-moment decay (BERT's)
    adam_beta2: float = ranged(0.98, BELOW_ONE)  # RoBERTa's value, more stable than 0.999 with large LR
    adam_eps: float = ranged(1e-6, POSITIVE)  # as BERT and RoBERTa
    # LR rises linearly from 0 to lr over these steps. A step budget must leave steps after them (warmup_steps <
    # max_steps, or 0): otherwise the LR would still be rising at the end and never decay, so the run is refused,
    # not silently trained. Under max_minutes it is not checked: how many steps the time holds is known only after.
    warmup_steps: int = ranged(100, at_least(0))
    # LR decays to 0 over this last share of the budget; 1.0: BERT's decay after warmup
    decay_fraction: float = ranged(0.2, FRACTION)
    # the decay's shape: "linear" (BERT's; warmup-stable-decay), "cosine" (the seed's RoBERTa), "1-sqrt" (ModernBERT's)
    lr_schedule: str = choices.LINEAR
    max_steps: int = ranged(1000, at_least(1))  # optimizer steps of the run: the budget, unless max_minutes is set
    # > 0: a wall-clock budget instead of max_steps; LR and masking schedules follow it
    max_minutes: float = ranged(0.0, NON_NEGATIVE, example=60)
    # gradients are clipped to this global norm (BERT's 1.0); 0: not clipped, norm still logged
    max_grad_norm: float = ranged(1.0, NON_NEGATIVE)
    log_every: int = ranged(20, at_least(1))  # steps between records in metrics.jsonl (and TensorBoard)
    eval_every: int = ranged(200, at_least(0))  # steps between held-out evaluations; 0 disables
    eval_batches: int = ranged(20, at_least(1))  # held-out batches per evaluation (fixed masks, same every time)
    # Sequences per held-out batch, not train.batch_size: arms of a study that differ in batch size
    # must evaluate the same sequences (eval_batches of them are the first in a fixed order)
    eval_batch_size: int = ranged(32, at_least(1))
    save_every: int = ranged(200, at_least(0))  # steps between checkpoints; the final one is always written
    keep_last: int = ranged(2, at_least(0))  # newest checkpoints kept on disk; 0 keeps every one
    seed: int = ranged(0, SEEDS)  # model initialisation, dropout and data order
    # "auto": bf16 autocast on CUDA and on CPUs whose bf16 matmuls time clearly faster, else fp32 (train/launch.py)
    precision: str = choices.AUTO
    compile: bool = False  # torch.compile the encoder (static shapes) and MLM head; 0.97-1.05x on a 2-core CPU
    # The MLM decoder and its cross-entropy chunk by chunk, gradients in the forward (mlmlab/model/head_loss.py): the
    # same loss to float tolerance without the (M, V) logits in memory three times. null (auto): off. Its CPU wins
    # were glibc's page faults on the eager head's (M, V) blocks; with those gone the eager head is 1.03-1.11x faster
    # there (docs/benchmarks.md). On an H200: 0.94x the eager head (one run)
    fused_head: bool | None = None
    # BERT's attention projects Q, K and V with one matmul over its three weights, concatenated
    # (mlmlab/model/fused_qkv.py): the same weights and checkpoints; ModernBERT's is fused already
    fused_qkv: bool = False
    # torch's deterministic kernels (torch.use_deterministic_algorithms): on a GPU float atomics otherwise vary the last
    # bits from run to run, so a resume ends close to, not equal to, the uninterrupted run. CPU kernels are already
    deterministic: bool = False
    max_bad_steps: int = ranged(5, at_least(1))  # consecutive non-finite losses (each skipped) before training aborts
    out_dir: str = ""  # empty: runs/<hash of the resolved config>, so a rerun resumes the same run
    # Where metrics go besides metrics.jsonl, comma-separated: "tensorboard" (the run's tensorboard/ folder), "none",
    # or any of accelerate's trackers: wandb, mlflow, trackio, aim, comet_ml, dvclive, swanlab, clearml (install the
    # library: pip install -e ".[wandb]"). Not part of the run's identity: adding one resumes the same run folder
    report_to: str = "tensorboard"
    # A model folder to start from, weights only (a HuggingFace BERT, RoBERTa, XLM-R or ModernBERT folder with its
    # own tokenizer, or an mlmlab model/): continued pretraining, BERT's phase 2. Optimizer, step and schedules start
    # fresh. Empty: fresh weights
    init: str = ""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        validate(self)


def validate(cfg: Config) -> None:
    """Refuse values that cannot train, with a message that says what to change."""
    for key, value, allowed, example in declared_ranges(cfg):
        check_range(key, value, allowed, example)
    m = cfg.masking
    if m.mask_prob + m.random_prob > 1.0:
        raise UserError(
            f"masking.mask_prob + masking.random_prob = {m.mask_prob + m.random_prob:g} exceeds 1 (they "
            "share the selected positions); use e.g. masking.mask_prob=0.8 masking.random_prob=0.1"
        )
    _check_choice("masking.strategy", m.strategy, choices.STRATEGIES)
    _check_choice("masking.rate_schedule", m.rate_schedule, choices.RATE_SCHEDULES)
    _check_choice("masking.scorer", m.scorer, choices.SCORERS)
    _check_choice("masking.adapt_schedule", m.adapt_schedule, choices.ADAPT_SCHEDULES)
    _check_choice("masking.normalize", m.normalize, choices.NORMALIZATIONS)
    m.freq_cuts  # parsing it is the check: a bad value raises the one-line UserError
    _check_frequency_neutral(m)
    if m.pmi_max_n < m.pmi_min_n:
        raise UserError(
            f"masking.pmi_max_n={m.pmi_max_n} is below masking.pmi_min_n={m.pmi_min_n}; the n-grams are "
            f"{m.pmi_min_n} to pmi_max_n words long, so use e.g. masking.pmi_max_n={max(m.pmi_min_n, 5)}"
        )
    _check_choice("data.objective", cfg.data.objective, choices.OBJECTIVES)
    _check_held_out(cfg.data)
    _check_mixture(cfg.data.corpus)
    if not cfg.data.text_column:
        raise UserError("data.text_column is empty; name the field that holds the text, e.g. data.text_column=text")
    if cfg.data.max_seq_length > cfg.model.max_position_embeddings:
        raise UserError(
            f"data.max_seq_length={cfg.data.max_seq_length} exceeds model.max_position_embeddings="
            f"{cfg.model.max_position_embeddings}; lower the first or raise the second"
        )
    if cfg.model.hidden_size % cfg.model.num_heads:
        raise UserError(
            f"model.hidden_size={cfg.model.hidden_size} is not divisible by model.num_heads={cfg.model.num_heads}"
        )
    # What each architecture asks of a config beyond its name is on its adapter: model/architectures/check_config,
    # which the commands, the Trainer and a study's arms call (the model code sits above the config).
    _check_choice("model.architecture", cfg.model.architecture, choices.ARCHITECTURES)
    _check_choice("train.precision", cfg.train.precision, choices.PRECISIONS)
    _check_choice("train.lr_schedule", cfg.train.lr_schedule, choices.LR_SCHEDULES)
    _check_choice("train.optimizer", cfg.train.optimizer, choices.OPTIMIZERS)
    _check_batch_warmup(cfg.train)
    report_targets(cfg.train.report_to)


def _check_batch_warmup(t: "TrainConfig") -> None:
    if not t.batch_warmup_steps:
        return
    if t.batch_warmup_start >= t.grad_accum:
        raise UserError(
            f"train.batch_warmup_steps grows the step from train.batch_warmup_start={t.batch_warmup_start} "
            f"micro-batches to train.grad_accum={t.grad_accum}, so it needs more micro-batches than it starts "
            f"with; e.g. train.batch_size={max(t.batch_size // 4, 1)} train.grad_accum={4 * t.grad_accum} keeps "
            f"the batch, or train.batch_warmup_steps=0"
        )
    if t.max_minutes == 0 and t.batch_warmup_steps >= t.max_steps:
        raise UserError(
            f"train.batch_warmup_steps={t.batch_warmup_steps} takes all of train.max_steps={t.max_steps}: "
            f"the batch would never reach its full size; set e.g. train.batch_warmup_steps="
            f"{t.max_steps // 10}, or raise train.max_steps"
        )


def _check_held_out(data: DataConfig) -> None:
    if not data.valid_fraction:
        return
    for key in ("valid_corpus", "valid_text_column"):
        if getattr(data, key):
            raise UserError(
                f"data.valid_fraction holds out documents of data.corpus, data.{key} names another "
                f"held-out set; set one of them (data.{key}= or data.valid_fraction=0)"
            )


def _check_mixture(corpus) -> None:
    """A mixture's weights: two sources or more, each weight positive and finite."""
    if not isinstance(corpus, dict):
        return
    if len(corpus) < 2:
        raise UserError(
            f"data.corpus={corpus!r} is a mixture of one source; give two or more with weights, e.g. "
            "data.corpus='{domain/: 0.8, wiki/: 0.2}', or the source alone: data.corpus=[domain/]"
        )
    for source, weight in corpus.items():
        if not POSITIVE.admits(weight):
            raise UserError(
                f"data.corpus gives {source} the weight {weight!r}; a weight is a share of the draws, "
                "positive and finite, e.g. data.corpus='{domain/: 0.8, wiki/: 0.2}'"
            )
    if not math.isfinite(sum(corpus.values())):  # each share is its weight over the sum: every one would be 0
        raise UserError(
            f"data.corpus's weights are each finite but sum past the largest float ({sum(corpus.values())}), so "
            "no share can be taken of them; scale them down, e.g. to shares that sum to 1: "
            "data.corpus='{domain/: 0.8, wiki/: 0.2}'"
        )


def _check_frequency_neutral(m: MaskingConfig) -> None:
    if not m.frequency_neutral:
        return
    if m.strategy != choices.ADAPTIVE:
        raise UserError(
            f"masking.frequency_neutral=true re-weights ADM only; set masking.strategy={choices.ADAPTIVE} "
            "or masking.frequency_neutral=false"
        )
    if m.whole_word:  # the quotas count tokens, but whole-word selection takes words whose pieces span buckets
        raise UserError(
            "masking.frequency_neutral=true does not combine with masking.whole_word=true; set one of them to false"
        )


def report_targets(report_to: str) -> tuple[str, ...]:
    """The names in a comma-separated train.report_to, each once, in order; a UserError for one that is unknown."""
    names = tuple(dict.fromkeys(name.strip().lower() for name in report_to.split(",") if name.strip()))
    for name in names:
        _check_choice("train.report_to", name, choices.REPORT_TO)
    if choices.NO_TRACKER in names and len(names) > 1:
        raise UserError(f"train.report_to={report_to!r} names 'none' beside trackers; name either 'none' or trackers")
    return names


def _check_choice(key: str, value: str, names: tuple[str, ...]) -> None:
    if value not in names:
        raise UserError(f"{key}={value!r} is unknown; choose {choices.listed(names)}")


def frequency_cuts(text, name: str) -> tuple[int, ...]:
    """Frequency-rank cut-offs from "1000,10000": increasing positive ranks, or a UserError naming ``name``."""
    try:
        cuts = [int(c) for c in str(text).split(",") if c.strip()]
    except ValueError:
        cuts = []
    if not cuts or any(c < 1 for c in cuts) or cuts != sorted(set(cuts)):
        raise UserError(f'{name}={text!r} must be increasing positive ranks, e.g. "1000,10000"')
    return tuple(cuts)


def load_config(source: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults < preset name or YAML file < ``section.key=value`` overrides."""
    tree = read_yaml(source) if source else {}
    for item in overrides:
        key, value = _parse_override(item)
        set_dotted(tree, key, value)
    return from_dict(tree)


def from_dict(tree: dict) -> Config:
    """Build a Config from a nested dict, refusing unknown sections and keys."""
    if not isinstance(tree, dict):
        raise UserError("a config must be a mapping of sections (model, data, masking, train)")
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    unknown = set(tree) - set(sections)
    if unknown:
        raise UserError(f"unknown config section {sorted(unknown)[0]!r}; valid sections: {', '.join(sections)}")
    for name, values in tree.items():
        if values is not None and not isinstance(values, dict):
            raise UserError(
                f"config section {name!r} must be a mapping of keys (e.g. {name}: {{key: value}}), got {values!r}"
            )
    return Config(**{name: _build_section(name, cls, tree.get(name) or {}) for name, cls in sections.items()})


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def flat_keys(tree: dict) -> dict:
    """{"section.key": value} of a config tree (to_dict's, or a config.yaml read back)."""
    return {f"{section}.{key}": value for section, values in tree.items() for key, value in (values or {}).items()}


def config_text(cfg: Config) -> str:
    """The resolved config as YAML: what a run folder records and a rerun compares against."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_hash(cfg: Config) -> str:
    """12 hex digits of the config_text of what ``cfg`` computes: a default run folder's name, and a study row's
    record of its whole config."""
    return hashlib.sha256(config_text(what_it_computes(cfg)).encode()).hexdigest()[:12]


def what_it_computes(cfg: Config) -> Config:
    """``cfg`` without the settings that say where a run lives and where it reports (train.out_dir,
    train.report_to): a rerun that changes only those is the same run."""
    train = dataclasses.replace(cfg.train, out_dir="", report_to=TrainConfig.report_to)
    return dataclasses.replace(cfg, train=train)


def config_listing(cfg: Config) -> str:
    """Every key of ``cfg``, one a line: its value, its default where it differs, and the comment beside its field."""
    values, defaults = flat_keys(to_dict(cfg)), flat_keys(to_dict(Config()))
    comments = {
        f"{section.name}.{name}": text
        for section in dataclasses.fields(Config)
        for name, text in field_comments(section.type).items()
    }
    settings = {key: f"{key} = {_yaml_value(value)}" for key, value in values.items()}
    width = max(map(len, settings.values()))
    lines = []
    for key, value in values.items():
        changed = f"[default {_yaml_value(defaults[key])}] " if value != defaults[key] else ""
        lines.append(f"{settings[key]:<{width}}  # {changed}{comments.get(key, '')}".rstrip(" #"))
    return "\n".join(lines)


def _yaml_value(value) -> str:
    """A value as an override takes it (train.lr=0.001, data.corpus=[a, b], data.tokenizer='')."""
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 30).removesuffix("\n...\n").strip()


def field_comments(section: type) -> dict[str, str]:
    """Each field of a dataclass in this file with its comment: the comment lines just above it, then the one
    beside it."""
    source = textwrap.dedent(inspect.getsource(section))
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    found, previous_end = {}, ast.parse(source).body[0].lineno  # the class line
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign):
            lines = range(previous_end + 1, node.end_lineno + 1)  # above it (after the previous statement), and its own
            found[node.target.id] = " ".join(comments[line] for line in lines if line in comments)
        previous_end = node.end_lineno
    return found


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def named_keys(source: str | None, overrides: list[str] = ()) -> frozenset[str]:
    """The dotted keys a user chose for a run: every override, and each key a config file of their own sets to
    other than mlmlab's default.

    A preset's keys are mlmlab's, and a resolved config (a run's config.yaml: every masking key, whatever the
    strategy) records values rather than choosing them; neither names any. A setting that nothing in the run
    reads is refused only when named (masking keys of another strategy, a model key beside train.init).
    """
    named = {_parse_override(item)[0] for item in overrides}
    if source and _config_path(source).parent.resolve() != PRESET_DIR.resolve():
        written = flat_keys(read_yaml(source)).keys()
        resolved = {f"masking.{f.name}" for f in dataclasses.fields(MaskingConfig)} <= written
        values, defaults = flat_keys(to_dict(load_config(source))), flat_keys(to_dict(Config()))
        named |= set() if resolved else {key for key in written if values[key] != defaults[key]}
    return frozenset(named)


def _config_path(source: str) -> Path:
    """A config file, or the preset that ``source`` names."""
    path = Path(source)
    return path if path.exists() or source.endswith((".yaml", ".yml")) else PRESET_DIR / f"{source}.yaml"


def read_yaml(source: str) -> dict:
    path = _config_path(source)
    if not path.exists():
        raise UserError(f"no config file or preset named {source!r}; presets: {', '.join(preset_names())}")
    if path.is_dir():
        raise UserError(
            f"{path} is a folder, not a config file; name a YAML file or a preset ({', '.join(preset_names())})"
        )
    try:
        tree = load_yaml(path.read_text(encoding="utf-8")) or {}
    except Misread as err:
        raise UserError(f"{path} line {err.line}: {err}; fix the file") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid YAML ({str(err).splitlines()[0]}); fix the file") from None
    if not isinstance(tree, dict):
        raise UserError(
            f"{path} holds a {type(tree).__name__}, not a mapping of config sections (model, data, "
            "masking, train); fix the file"
        )
    return tree


def _parse_override(item: str) -> tuple[str, object]:
    """``section.key=value``, the value read as YAML by ``load_yaml``, or a one-line UserError."""
    if "=" not in item:
        raise UserError(f"override {item!r} is not key=value; write e.g. train.lr=3e-4")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not raw.strip():
        return key, ""
    try:
        return key, load_yaml(raw)
    except Misread as err:
        raise UserError(f"override {item}: {err}") from None
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        if isinstance(err, yaml.constructor.ConstructorError):  # "=": a tag with no constructor
            problem = "it has no plain reading"
        raise UserError(
            f"override {item}: {raw!r} is not a YAML value ({problem}); quote text ({key}='...') or close a "
            f"list ({key}=[a, b])"
        ) from None


class Misread(Exception):
    """A plain YAML scalar that YAML 1.1 reads otherwise than it looks: a date, an octal or base-60 number."""

    def __init__(self, node: yaml.ScalarNode, reading: str, instead: str | None = None):
        write = f"write {instead}, or " if instead else ""
        super().__init__(f"YAML reads {node.value} as {reading}; {write}quote it ('{node.value}') to mean the text")
        self.line = node.start_mark.line + 1


class _Loader(yaml.SafeLoader):
    """PyYAML's safe reading, less its surprises: "007" and "010" were the octal numbers 7 and 8, "1:30" the
    number 90 (base 60), "2024-01-01" a date. Each is a Misread instead; a quoted one stays text."""


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    value = loader.construct_yaml_int(node)
    digits = node.value.replace("_", "").lstrip("+-")
    if ":" in digits:
        raise Misread(node, f"the base-60 number {value}")
    if len(digits) > 1 and digits[0] == "0" and digits[1] not in "xbo":  # 0x1f, 0b101: the base is written out
        sign = node.value[0] if node.value[0] in "+-" else ""
        raise Misread(node, f"the octal number {value}", sign + (digits.lstrip("0") or "0"))
    return value


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    value = loader.construct_yaml_float(node)
    if ":" in node.value:
        raise Misread(node, f"the base-60 number {value:g}")
    return value


def _construct_timestamp(loader: yaml.SafeLoader, node: yaml.ScalarNode):
    raise Misread(node, "a date")


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)
_Loader.add_constructor("tag:yaml.org,2002:timestamp", _construct_timestamp)


def load_yaml(text: str):
    """A YAML text as every config, preset, study file and override is read: ``yaml.safe_load`` less its
    misreadings (a Misread names the line)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)


def set_dotted(tree: dict, key: str, value) -> None:
    parts = key.split(".")
    if len(parts) != 2:
        raise UserError(f"override key {key!r} must be section.field, e.g. train.lr")
    section = tree.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise UserError(f"config section {parts[0]!r} must be a mapping")
    section[parts[1]] = value


def _build_section(name: str, cls, values: dict):
    hints = typing.get_type_hints(cls)
    unknown = set(values) - set(hints)
    if unknown:
        key = sorted(unknown)[0]
        raise UserError(f"unknown config key '{name}.{key}'; valid keys in {name}: {', '.join(hints)}")
    return cls(**{key: _coerce(f"{name}.{key}", hints[key], value) for key, value in values.items()})


def _coerce(key: str, hint, value):
    """Check a value against its field type; ints are accepted where floats are expected."""
    if isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint):  # "X | None": null allowed
        if value is None:
            return None
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if isinstance(hint, types.UnionType):  # list[str] | dict[str, float]: the first form that takes the value
        return _first_form(key, typing.get_args(hint), value)
    if hint is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if typing.get_origin(hint) is list:
        value = [value] if isinstance(value, str) else value
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    elif typing.get_origin(hint) is dict:
        if isinstance(value, dict):
            key_type, value_type = typing.get_args(hint)
            return {_coerce(key, key_type, k): _coerce(key, value_type, v) for k, v in value.items()}
    elif isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise UserError(f"config key '{key}' expects {getattr(hint, '__name__', hint)}, got {value!r}")


def _first_form(key: str, forms: tuple, value):
    for form in forms:
        try:
            return _coerce(key, form, value)
        except UserError:
            pass
    raise UserError(f"config key '{key}' expects {' or '.join(map(str, forms))}, got {value!r}")
