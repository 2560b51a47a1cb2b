"""STS-B dev without fine-tuning: Pearson of the cosine between the two sentences' mean-pooled
last hidden states and the gold score, for every finished run of the study (exploratory).

Does the STS-B split into two groups (near 0.4 and near 0.7 after fine-tuning) show in the
pretrained representations themselves? Reads the run folders' model/ (not committed; they are on
the machine that trained them) and prints one line per run, then the same architecture untrained
(two init seeds); nothing is trained.

    OMP_NUM_THREADS=1 python studies/adm-study-wp8k-9k/exploratory/stsb_zero_shot.py ../shared/data/glue
"""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch
from scipy import stats
from transformers import AutoConfig, AutoModel

from mlmlab.evaluate.glue import collate, encode, quiet_transformers
from mlmlab.evaluate.glue_data import TASKS, GlueSplit, read_labeled
from mlmlab.experiments.results import RESULTS_FILE, read_rows
from mlmlab.model.folder import load_any_tokenizer

STUDY = Path(__file__).resolve().parents[1]
BATCH = 64


@torch.no_grad()
def mean_pooled(model, split) -> torch.Tensor:
    """(N, H) mean of the last hidden states over each sentence's real tokens."""
    pooled = []
    for start in range(0, len(split), BATCH):
        batch = collate(split, list(range(start, min(start + BATCH, len(split)))), torch.device("cpu"))
        hidden = model(**batch).last_hidden_state  # (B, T, H)
        mask = batch["attention_mask"].unsqueeze(-1).float()  # (B, T, 1)
        pooled.append((hidden * mask).sum(1) / mask.sum(1))
    return torch.cat(pooled)


def sentence_vectors(model, tokenizer, dev: GlueSplit, column: int) -> torch.Tensor:
    """(N, H) one text column's sentences, each encoded alone."""
    split = encode(dataclasses.replace(dev, texts=(dev.texts[column],)), tokenizer, max_length=128)
    return mean_pooled(model, split)


def zero_shot_pearson(model, tokenizer, dev: GlueSplit) -> float:
    cosine = torch.nn.functional.cosine_similarity(sentence_vectors(model, tokenizer, dev, 0),
                                                   sentence_vectors(model, tokenizer, dev, 1))  # (N,)
    return float(stats.pearsonr(cosine.numpy(), np.asarray(dev.labels))[0])


def pretrained(model_dir: Path):
    with quiet_transformers():  # the pretraining heads it drops are expected
        return AutoModel.from_pretrained(model_dir, add_pooling_layer=False).eval()


def random_init(model_dir: Path, seed: int):
    """The same architecture untrained: what the cosine gets from word overlap alone."""
    torch.manual_seed(seed)
    return AutoModel.from_config(AutoConfig.from_pretrained(model_dir), add_pooling_layer=False).eval()


def main(glue_dir: str) -> None:
    dev = read_labeled(TASKS["STS-B"], Path(glue_dir) / "STS-B" / "dev.tsv")
    rows, _ = read_rows(STUDY / RESULTS_FILE)
    for row in rows:
        model_dir = STUDY / row["run_dir"] / "model"
        fine_tuned = row["glue"]["tasks"]["STS-B"]["dev"]["pearson"]
        zero_shot = zero_shot_pearson(pretrained(model_dir), load_any_tokenizer(model_dir), dev)
        print(f"{row['arm']:<20} seed {row['seed']}  fine-tuned {fine_tuned:.3f}  zero-shot {zero_shot:.3f}  "
              f"MLM loss {row['eval']['mlm_loss']:.3f}", flush=True)
    model_dir = STUDY / rows[0]["run_dir"] / "model"
    for seed in (0, 1):
        zero_shot = zero_shot_pearson(random_init(model_dir, seed), load_any_tokenizer(model_dir), dev)
        print(f"{'random init':<20} seed {seed}  zero-shot {zero_shot:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
