"""Corpus-frequency buckets of the vocabulary: frequent ids, mid-frequency ids, rare ids.

One bucketing serves training and evaluation alike, so their figures line up: the share of
the training targets each bucket receives (a strategy's stats), frequency-neutral ADM's
per-bucket quotas, and the held-out loss per bucket.
"""

import numpy as np
import torch


def frequency_buckets(token_counts, cuts: tuple[int, ...], vocab_size: int) -> tuple[torch.Tensor, list[str]]:
    """(V,) bucket index of every id by corpus-frequency rank, and the bucket names.

    Cut-offs at or beyond the vocabulary size are dropped: the bucket they would open holds
    no id, and a bucket that is empty by construction is noise in every table (an 8k
    vocabulary with the default 1000,10000 gets buckets 0_1000 and 1000_rest).
    """
    cuts = tuple(cut for cut in cuts if cut < vocab_size)
    counts = np.zeros(vocab_size, dtype=np.float64)
    given = np.asarray(token_counts, dtype=np.float64)[:vocab_size]
    counts[: len(given)] = given
    rank = np.empty(vocab_size, dtype=np.int64)
    rank[np.argsort(-counts, kind="stable")] = np.arange(vocab_size)
    bucket = np.searchsorted(np.asarray(cuts), rank, side="right")
    edges = (0, *cuts, None)
    names = [f"{lo}_{hi if hi is not None else 'rest'}" for lo, hi in zip(edges[:-1], edges[1:])]
    return torch.from_numpy(bucket), names
