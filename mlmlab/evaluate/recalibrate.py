"""A prior-free held-out MLM loss: the loss left after refitting the output bias alone.

A masking strategy that changes *which* tokens are targets (ADM moves them from frequent to
rare ids) shifts the model's output prior, its decoder bias, by that alone; uniform-mask loss
then charges the model for the prior, not for what it knows. Here the V bias numbers are
refitted (everything else frozen) on one fixed half of the held-out targets, under the fixed
uniform masks evaluation always uses, and the other half is scored with them. The refit is
maximum likelihood shrunk towards a corpus-frequency prior (refit_bias); it never starts from
or regularises towards the model's own bias, so the result does not depend on it at all: a
model whose bias is offset per token scores the same (tested). Studies report it beside the raw loss, so that a
gain that only moves the output prior is not read as learning ("prior shift", docs/studies.md).
"""

import math

import numpy as np
import torch

from mlmlab.evaluate.perplexity import fixed_mask_batches
from mlmlab.masking.buckets import frequency_buckets
from mlmlab.model.pretraining import eval_mode, scoring_module

ROWS_PER_CHUNK = 2048  # logits are computed this many targets at a time: (2048, V), never (M, V)


def recalibrated_loss(
    model,
    store,
    info,
    *,
    batch_size: int = 32,
    max_batches: int | None = None,
    token_counts: np.ndarray,
    device="cpu",
    freq_cuts: tuple[int, ...] = (),
    show_progress: bool = False,
) -> dict:
    """Raw and bias-recalibrated MLM loss (nats) on the scored half of ``store``, overall and per frequency bucket.

    ``model``: a masked LM whose output layer (get_output_embeddings, a linear with a bias) computes the
    logits. Even examples of the evaluation order fit the bias, odd ones are scored.
    """
    features, targets, examples = decoder_inputs(model, store, info, batch_size, max_batches, device, show_progress)
    decoder = model.get_output_embeddings()
    weight = decoder.weight.detach().double().cpu()  # (V, H)
    fit, scored = examples % 2 == 0, examples % 2 == 1
    bias = refit_bias(features[fit], targets[fit], weight, token_counts)
    raw, recalibrated = token_losses(
        features[scored], targets[scored], weight, decoder.bias.detach().double().cpu(), bias
    )
    report = {
        "mlm_loss": recalibrated.mean().item(),
        "raw_mlm_loss": raw.mean().item(),
        "scored_targets": int(scored.sum()),
        "fit_targets": int(fit.sum()),
    }
    return {**report, **_per_bucket(targets[scored], raw, recalibrated, token_counts, freq_cuts)}


@torch.no_grad()
def decoder_inputs(model, store, info, batch_size: int, max_batches: int | None, device, show_progress: bool = False):
    """The output layer's input (M, H) float64, target id (M,) and example number (M,) of every
    masked position of the evaluated set: the same batches and fixed masks as evaluate_mlm."""
    module = scoring_module(model, use_nsp=False).to(device)
    captured = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda layer, args, output: captured.append(args[0].detach().double().cpu())
    )
    targets, examples, seen = [], [], 0
    try:
        with eval_mode(module):
            batches = fixed_mask_batches(store, info, batch_size, max_batches, device, show_progress, "recalibrate")
            for masked in batches:
                result = module(**masked)
                labels = masked["labels"]  # (B, T)
                selected = result["selected_index"].cpu()  # (M_b,) flat positions
                if captured[-1].dim() == 3:  # a model scored through its own forward projected every position
                    captured[-1] = captured[-1].flatten(0, 1).index_select(0, selected)  # (B, T, H) -> (M_b, H)
                targets.append(labels.flatten().cpu().index_select(0, selected))
                examples.append(seen + torch.div(selected, labels.shape[1], rounding_mode="floor"))
                seen += len(labels)
    finally:
        hook.remove()
    return torch.cat(captured), torch.cat(targets), torch.cat(examples)


def refit_bias(
    features: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, token_counts: np.ndarray, max_steps: int = 100
) -> torch.Tensor:
    """(V,) bias maximising the likelihood of ``targets`` given logits features @ weight.T + bias, shrunk
    towards a prior that knows only the corpus: bias = prior + shift of its rank bin + own term.

    Per-id maximum likelihood alone overfits: an id that is no target in the fit half goes to
    -inf and costs ~20 nats wherever it is one in the scored half (measured: the refit loss came
    out 1.2 nats above the raw one on a 30k vocabulary). So each id's own term pays an L2 price
    worth SHRINK_TARGETS targets, and what it is shrunk to is the corpus log-frequency plus one
    free shift per log2 rank bin (fitted, unpenalised): an id with few targets takes its bin's
    level, one with many its own. Nothing here reads the model's bias.
    """
    prior, bins = corpus_prior(token_counts, weight.shape[0])
    fit = _FitHalf(features, targets, weight)
    penalty = SHRINK_TARGETS / len(targets)
    shift, own = torch.zeros(int(bins.max()) + 1, dtype=torch.float64), torch.zeros_like(prior)
    value = None
    for _ in range(max_steps):
        before = value
        shift, value = _newton_step(
            fit,
            lambda s: (prior + s[bins] + own, penalty / 2 * own.square().sum().item()),
            shift,
            lambda g, h: (
                torch.zeros_like(shift).index_add_(0, bins, g),
                torch.zeros_like(shift).index_add_(0, bins, h),
            ),
        )
        own, value = _newton_step(
            fit,
            lambda o: (prior + shift[bins] + o, penalty / 2 * o.square().sum().item()),
            own,
            lambda g, h: (g + penalty * own, h + penalty),
        )
        if before is not None and before - value < CONVERGED_NATS:
            break
    return prior + shift[bins] + own


# An id's own bias term is worth this many fit targets: fewer targets, and it stays near its bin's level.
SHRINK_TARGETS = 2.0
# Converged when a round of steps lowers the objective by less than this: effects of interest are 0.01 nats.
CONVERGED_NATS = 1e-4


def corpus_prior(token_counts: np.ndarray, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(V,) log corpus frequency (half a count added) and (V,) log2 rank bin of every id (padding ids last)."""
    counts = np.zeros(vocab_size)
    counts[: len(token_counts)] = token_counts[:vocab_size]
    rank = np.empty(vocab_size, dtype=np.int64)
    rank[np.argsort(-counts, kind="stable")] = np.arange(vocab_size)
    return torch.from_numpy(np.log(counts + 0.5)), torch.from_numpy(np.log2(rank + 1).astype(np.int64))


def _newton_step(fit: "_FitHalf", bias_of, parameters, reduce) -> tuple[torch.Tensor, float]:
    """One damped diagonal-Newton step on ``parameters``; bias_of(p) -> (V bias, penalty),
    reduce(gradient, curvature per id) -> the parameters' own. Halves the step until the objective does not rise."""
    bias, extra = bias_of(parameters)
    value, gradient, curvature = fit.objective(bias)
    gradient, curvature = reduce(gradient, curvature)
    value += extra
    step, scale = gradient / curvature.clamp(min=1e-12), 1.0
    while scale >= 1e-3:
        candidate = parameters - scale * step
        bias, extra = bias_of(candidate)
        tried = fit.objective(bias)[0] + extra
        if tried <= value:
            return candidate, tried
        scale /= 2
    return parameters, value


# The fit half's exponentiated bias-free logits are kept between objectives up to this many bytes (chunks past it are
# recomputed each time): quick-compare's 7k fit targets on a 30k vocabulary take 0.9 GB.
CACHE_BYTES = 2 * 2**30
# An id whose bias is further below the largest than this is priced as if it were this far: exp(-80) keeps every
# row's normaliser above float32's smallest normal (exp(-87)) whatever the bias, and moves no probability that counts.
FLOOR_NATS = 80.0


class _FitHalf:
    """The fit half's targets and the objective at a bias: mean cross-entropy, its gradient (V,) and the diagonal
    of its Hessian (V,).

    Only the bias moves between objectives, so each chunk of rows keeps E = exp(logits - row max) of its bias-free
    logits (float32, (m, V)). At a bias b, with s = exp(b - max b), row i's probabilities are E_i * s / (E_i . s):
    an objective is three passes over E (matrix-vector products, sums in float64) instead of a matmul and three
    exp passes over fresh logits. The last bias evaluated is remembered, since a step's accepted candidate is where
    the next step starts."""

    def __init__(self, features: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor):
        self.features, self.targets, self.weight = features.float(), targets, weight.float()
        self.counts = torch.bincount(targets, minlength=weight.shape[0]).double()  # (V,)
        self.cached_rows = CACHE_BYTES // (4 * weight.shape[0])
        self._chunks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # start -> (E, row max - target logit)
        self._squares = torch.empty(min(ROWS_PER_CHUNK, len(targets)), weight.shape[0])  # (m, V) scratch for E**2
        self._last = None  # (bias, objective)

    def _chunk(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows start.. of the fit half, bias-free: (m, V) exp(logits - row max) in [0, 1] and (m,) float64 row max
        less the target's logit. Kept if they fit in CACHE_BYTES."""
        if start in self._chunks:
            return self._chunks[start]
        stop = min(start + ROWS_PER_CHUNK, len(self.targets))
        logits = self.features[start:stop] @ self.weight.T  # (m, V)
        top = logits.max(1).values  # (m,)
        gap = (top - logits.gather(1, self.targets[start:stop, None]).squeeze(1)).double()  # (m,)
        chunk = logits.sub_(top[:, None]).exp_(), gap
        if stop <= self.cached_rows:
            self._chunks[start] = chunk
        return chunk

    def objective(self, bias: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
        if self._last is not None and torch.equal(self._last[0], bias):
            return self._last[1]
        top = bias.max()
        scale = torch.exp((bias - top).clamp(min=-FLOOR_NATS))  # (V,) float64 in (0, 1]
        scale32 = scale.float()
        loss, probability_sums, square_sums = 0.0, torch.zeros_like(bias), torch.zeros_like(bias)
        for start in range(0, len(self.targets), ROWS_PER_CHUNK):
            exps, gap = self._chunk(start)  # (m, V), (m,)
            norms = (exps @ scale32).double()  # (m,): row i's sum of exp(logit + bias - row max - max bias)
            chosen_bias = bias[self.targets[start : start + len(gap)]]  # (m,)
            loss += (norms.log() + gap + top - chosen_bias).sum().item()  # logsumexp(logits + bias) - target's
            inverse = norms.reciprocal().float()  # (m,)
            probability_sums += (inverse @ exps).double()  # (V,), times scale below
            squares = torch.mul(exps, exps, out=self._squares[: len(gap)])  # (m, V)
            square_sums += (inverse.square() @ squares).double()  # (V,), times scale**2 below
        n = len(self.targets)
        probability_sums *= scale
        square_sums *= scale.square()
        result = loss / n, (probability_sums - self.counts) / n, (probability_sums - square_sums) / n
        self._last = (bias.clone(), result)
        return result


def token_losses(features: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, *biases) -> list[torch.Tensor]:
    """(M,) cross-entropy of each target under logits features @ weight.T + bias, for each bias (one matmul for all)."""
    losses = [[] for _ in biases]
    for start in range(0, len(targets), ROWS_PER_CHUNK):
        products = features[start : start + ROWS_PER_CHUNK] @ weight.T  # (m, V)
        for bias, kept in zip(biases, losses):
            logits = products + bias  # (m, V)
            chosen = logits.gather(1, targets[start : start + ROWS_PER_CHUNK, None]).squeeze(1)
            kept.append(logits.logsumexp(1) - chosen)
    return [torch.cat(kept) if kept else torch.zeros(0, dtype=torch.float64) for kept in losses]


def _per_bucket(targets, raw, recalibrated, token_counts, freq_cuts) -> dict:
    """mlm_loss_freq_<bucket> and raw_mlm_loss_freq_<bucket> (nats; null for a bucket with no target)."""
    bucket_of, names = frequency_buckets(token_counts, freq_cuts, len(token_counts))
    buckets = bucket_of[targets.clamp(max=len(bucket_of) - 1)]  # (M,)
    report = {}
    for index, name in enumerate(names):
        chosen = buckets == index
        n = int(chosen.sum())
        report[f"mlm_loss_freq_{name}"] = recalibrated[chosen].mean().item() if n else math.nan
        report[f"raw_mlm_loss_freq_{name}"] = raw[chosen].mean().item() if n else math.nan
        report[f"scored_targets_freq_{name}"] = n
    return report
