"""Why a random-init ModernBERT probes SST-2 better than a random-init BERT (the probe's baselines).

For each architecture's seed-0 model folder: the random-init encoder's SST-2 probe at init seeds
0-5 (the study's probe uses seed 0), and at seed 0 how close its mean-pooled final states are to a
bag of its own input embeddings (the embedding layer's output, mean-pooled): linear CKA, mean
cosine, and that bag's own probe score. Needs the runs' model folders (the study's worktree):

    HF_HUB_OFFLINE=1 python studies/arch-plateau-wp8k/random_init_probes.py RUNS_DIR
"""

import sys
from pathlib import Path

import numpy as np
import torch

from mlmlab.evaluate import linear_probe as probe
from mlmlab.evaluate.glue_data import TASKS

CPU = torch.device("cpu")
SEEDS = range(6)


class EmbeddingBag(torch.nn.Module):
    """An encoder's embedding layer alone, called as the encoder is."""

    def __init__(self, encoder):
        super().__init__()
        self.embeddings = encoder.embeddings

    def forward(self, input_ids, attention_mask, **_):
        return type("Output", (), {"last_hidden_state": self.embeddings(input_ids=input_ids)})


def features(encoder, task):
    return {name: probe.split_features(encoder, split, CPU, name, False) for name, split in task.splits.items()}


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """(N, H) and (N, H'): 1 when one is a rotation and scaling of the other."""
    x, y = x - x.mean(0), y - y.mean(0)
    return float(np.linalg.norm(x.T @ y) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)))


def report(model_dir: Path) -> str:
    task = probe.read_task(TASKS["SST-2"], Path("../shared/data/glue"), probe.load_any_tokenizer(model_dir))
    scores = []
    for seed in SEEDS:
        encoder = probe.load_encoder(model_dir, probe.RANDOM_INIT, seed, CPU)
        final = features(encoder, task)
        scores.append(probe.probe_task(task, final, "mean", 0)["score"])
        if seed == 0:
            bag = features(EmbeddingBag(encoder), task)
            f, b = final["dev"]["mean"], bag["dev"]["mean"]  # (N, H) each
            cosine = float(np.mean(np.sum(f * b, 1) / (np.linalg.norm(f, axis=1) * np.linalg.norm(b, axis=1))))
            seed0 = (f"seed 0: CKA(final, embedding bag) {linear_cka(f, b):.3f}, mean cosine {cosine:.3f}, "
                     f"the bag's own probe {probe.probe_task(task, bag, 'mean', 0)['score']:.3f}")
    listed = " ".join(f"{score:.3f}" for score in scores)
    arm = model_dir.parent.parent.name
    return f"{arm}: random-init SST-2 at init seeds 0-5: {listed} (mean {np.mean(scores):.3f}); {seed0}"


if __name__ == "__main__":
    torch.set_num_threads(1)
    runs = Path(sys.argv[1])
    for arm in ("bert-15", "modernbert-15"):
        print(report(runs / arm / "seed0" / "model"), flush=True)
