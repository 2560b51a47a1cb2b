"""Does ADM's uncertainty score point at the tokens that are hard to predict when masked? (exploratory)

For each of six trained models (two regimes, 3 seeds), on the first 320 sequences of the Wikipedia valid split:

- each eligible position's *score* as ADM computes it during training: the entropy of the
  model's prediction at that position of the UNMASKED sequence (masking.scorers.entropy_scores);
- each position's *masked loss*: the model's cross-entropy for that token with it replaced by
  [MASK] along with a uniform 15% of the sequence, averaged over the times it was selected in
  10 fixed uniform masks (positions never selected are left out);
- the token's corpus-frequency rank (the model's token_counts.npy) in the study's buckets.

Spearman correlations between score and masked loss, over all positions, within each frequency
bucket, and within token ids (both sides minus their id's mean, ids seen at least 5 times): the
last is what a score must carry to choose *which occurrence* of a token to mask, beyond what is
known of the token itself. For comparison, how much -log frequency (the frequency control) and
an id's mean masked loss at its other positions (what loss_ema estimates) rank-correlate with it.

Run from the repository root, on a machine that has the run folders' model/ directories (they
are not committed):

    python studies/adm-study-wp8k-9k/exploratory/uncertainty_signal.py > studies/adm-study-wp8k-9k/exploratory/uncertainty_signal.txt
"""

import sys
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

from mlmlab.data.loader import LoaderPosition, iterate_batches
from mlmlab.data.resolve import held_out_store
from mlmlab.evaluate.perplexity import load_pretrained
from mlmlab.masking.buckets import frequency_buckets
from mlmlab.masking.scorers import entropy_scores
from mlmlab.masking.select import Corruption, eligible_positions, token_info_for
from mlmlab.masking.strategies import mask_batch
from mlmlab.model.pretraining import SparsePretraining, eval_mode

RUNS = Path("studies/dropout-wp8k/runs")
# Both arms trained 9,000 steps with uniform dynamic masking. With hidden dropout 0.1 the models were still
# on the unigram plateau at the end; with none they had left it (studies/dropout-wp8k). BERT's own 0.1/0.1
# arm would be the plateau's first choice, but its model folders were not kept.
MODELS = {"hidden dropout 0.1": "no-attention-dropout", "no dropout": "no-dropout"}
VALID = "../shared/data/enwiki_sample/valid.txt.gz"
BATCHES, BATCH_SIZE, MASKS, MIN_OCCURRENCES = 10, 32, 10, 5
ALWAYS_MASK = Corruption(mask_prob=1.0, random_prob=0.0)
BUCKET_CUTS = (500, 2000)


@torch.no_grad()
def positions(model_dir: Path) -> dict[str, np.ndarray]:
    """Per eligible position: token id, entropy score, mean masked loss (NaN if never selected)."""
    bert, tokenizer = load_pretrained(model_dir)
    bert.eval()
    info = token_info_for(tokenizer)
    store = held_out_store([VALID], model_dir, 128)
    batches = iterate_batches(store, batch_size=BATCH_SIZE, seed=0, start=LoaderPosition(),
                              pad_id=store.meta["special_token_ids"]["[PAD]"])
    module = SparsePretraining(bert, use_nsp=False)
    ids, scores, losses = [], [], []
    for _ in range(BATCHES):
        _, batch = next(batches)
        eligible = eligible_positions(batch["input_ids"], info.special_ids) & batch["attention_mask"].bool()  # (B, T)
        score = entropy_scores(bert, batch, eligible, vocab_size=len(tokenizer))  # (B, T)
        loss_sum, picks = torch.zeros(eligible.numel()), torch.zeros(eligible.numel())  # (B*T,)
        for mask_seed in range(MASKS):
            masked = mask_batch(batch, seed=mask_seed, epoch_key=0, rate=0.15, info=info, corruption=ALWAYS_MASK)
            with eval_mode(module):
                result = module(**masked)
            loss_sum.index_add_(0, result["selected_index"], result["token_losses"].float())
            picks.index_add_(0, result["selected_index"], torch.ones(len(result["selected_index"])))
        keep = eligible.flatten()
        ids.append(batch["input_ids"].flatten()[keep])
        scores.append(score.flatten()[keep])
        losses.append(torch.where(picks > 0, loss_sum / picks.clamp(min=1), torch.nan)[keep])
    return {"id": torch.cat(ids).numpy(), "score": torch.cat(scores).numpy(), "loss": torch.cat(losses).numpy(),
            "counts": np.load(model_dir / "token_counts.npy")}


def minus_id_means(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return values - (np.bincount(ids, weights=values) / np.bincount(ids))[ids]


def others_mean(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Each position's id's mean over the id's OTHER positions (ids seen at least twice)."""
    sums, counts = np.bincount(ids, weights=values), np.bincount(ids)
    return (sums[ids] - values) / (counts[ids] - 1)


def correlations(data: dict) -> dict[str, float]:
    seen = ~np.isnan(data["loss"])
    ids, score, loss = data["id"][seen], data["score"][seen], data["loss"][seen]
    bucket_of, names = frequency_buckets(data["counts"], BUCKET_CUTS, len(data["counts"]))
    buckets = bucket_of.numpy()[ids]
    result = {"positions": len(ids), "entropy, all": spearmanr(score, loss)[0]}
    for index, name in enumerate(names):
        inside = buckets == index
        result[f"entropy, within bucket {name}"] = spearmanr(score[inside], loss[inside])[0]
    result["-log frequency (the control), all"] = spearmanr(-np.log1p(data["counts"][ids]), loss)[0]
    repeated = np.bincount(ids)[ids] >= MIN_OCCURRENCES
    ids, score, loss = ids[repeated], score[repeated], loss[repeated]
    result[f"positions of ids seen >= {MIN_OCCURRENCES} times"] = len(ids)
    result["entropy, those positions"] = spearmanr(score, loss)[0]
    result["id's mean masked loss elsewhere (loss_ema's target), those positions"] = \
        spearmanr(others_mean(loss, ids), loss)[0]
    result["entropy, within id"] = spearmanr(minus_id_means(score, ids), minus_id_means(loss, ids))[0]
    return result


def main() -> None:
    table = {}
    for label, arm in MODELS.items():
        for seed in range(3):
            table[(label, seed)] = correlations(positions(RUNS / arm / f"seed{seed}" / "model"))
            print(f"done: {label} seed {seed}", file=sys.stderr, flush=True)
    rows = list(next(iter(table.values())))
    header = [f"{label} s{seed}" for label, seed in table]
    print("| Spearman with masked loss | " + " | ".join(header) + " |")
    print("|---|" + "---|" * len(header))
    for row in rows:
        cells = [f"{table[key][row]:,}" if row.startswith("positions") else f"{table[key][row]:+.3f}" for key in table]
        print(f"| {row} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
