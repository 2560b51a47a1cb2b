"""Several prepared datasets read as one weighted mixture (``data.corpus`` as {source: weight}).

Example ids run through the sources in order: source 0's examples, then source 1's, and so on.
An epoch holds as many draws as the sources hold examples together, and each source gets its
weight's share of them, exactly (to one example: largest remainders). A source's draws walk an
endless sequence of its own permutations, epoch after epoch, so every example of a source is
drawn equally often (to within one) and none twice before all were drawn once. Each permutation
is keyed by (seed, source, pass): an epoch's draws are a pure function of (seed, epoch), so a
resume at any batch reads the same data, and the loader shuffles them as any epoch.

An example drawn twice within one epoch (a source weighted above its share of the examples)
gets the same masks both times: masks are keyed by (seed, example, epoch, position).
"""

import hashlib
import json

import numpy as np

from mlmlab.data.store import TokenStore

_STREAM = 0x6D6978  # "mix": the permutations' key differs from the loader's (seed, epoch) order

# meta.json counts that add up over the sources (the model card shows them).
_SUMMED = (
    "num_documents",
    "num_instances",
    "num_instance_tokens",
    "num_random_next",
    "num_used_tokens",
    "long_sentences",
    "one_sentence_documents",
    "num_corpus_tokens",
)


class MixedStore:
    """The training examples of a mixture: random access over every source, and each epoch's draws."""

    def __init__(self, stores: list[TokenStore], weights: list[float]):
        self.stores = stores
        self.weights = normalized(weights)
        self.sizes = [len(store) for store in stores]
        self._starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)  # (S,)
        self.quotas = draw_quotas(self.weights, sum(self.sizes))  # (S,) draws per epoch
        self.meta = _mixture_meta(stores, self.weights, self.quotas)

    def __len__(self) -> int:
        return sum(self.sizes)

    def __getitem__(self, index: int) -> dict:
        source = int(np.searchsorted(self._starts, index, side="right") - 1)
        return self.stores[source][index - int(self._starts[source])]

    @property
    def lengths(self) -> np.ndarray:
        """int64[len(self)]: tokens per example, the sources' in order."""
        return np.concatenate([store.lengths for store in self.stores])

    @property
    def token_counts(self) -> np.ndarray:
        """int64[vocab_size]: the corpus token counts an epoch draws, in expectation (a source's counts times the
        times each of its examples is drawn): the frequencies training sees, which frequency buckets rank."""
        drawn = sum(
            store.token_counts * (quota / size) for store, quota, size in zip(self.stores, self.quotas, self.sizes)
        )
        return np.rint(drawn).astype(np.int64)

    def epoch_examples(self, seed: int, epoch: int) -> np.ndarray:
        """(len(self),) the example ids epoch ``epoch`` draws, source by source (the loader shuffles them)."""
        return np.concatenate(
            [
                start + _drawn(size, quota * epoch, quota, (seed, _STREAM, source))
                for source, (start, size, quota) in enumerate(zip(self._starts, self.sizes, self.quotas))
            ]
        )


def normalized(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [weight / total for weight in weights]


def draw_quotas(weights: list[float], total: int) -> np.ndarray:
    """(S,) int64 shares of ``total`` draws in proportion to ``weights``, summing to ``total`` (largest remainders)."""
    exact = np.asarray(weights) * total  # (S,)
    quotas = np.floor(exact).astype(np.int64)  # (S,)
    quotas[np.argsort(quotas - exact, kind="stable")[: total - int(quotas.sum())]] += 1
    return quotas


def _drawn(size: int, first: int, count: int, key: tuple) -> np.ndarray:
    """(count,) draws ``first`` .. ``first + count - 1`` of a source's endless sequence of permutations of
    range(size)."""
    if not count:  # a weight too small for one draw in an epoch of this size
        return np.zeros(0, dtype=np.int64)
    passes = range(first // size, (first + count - 1) // size + 1)
    sequence = np.concatenate([np.random.default_rng([*key, k]).permutation(size) for k in passes])
    offset = first - passes.start * size
    return sequence[offset : offset + count]


def mixture_hash(source_hashes: list[str], weights: list[float]) -> str:
    """sha256 over each source's prepared-data hash and its normalised weight: a mixture's identity."""
    sources = [{"hash": digest, "weight": weight} for digest, weight in zip(source_hashes, normalized(weights))]
    return hashlib.sha256(json.dumps({"mixture": sources}, sort_keys=True).encode()).hexdigest()


def _mixture_meta(stores: list[TokenStore], weights: list[float], quotas: np.ndarray) -> dict:
    """The first source's meta (the settings, tokenizer and special ids every source shares), with the counts and
    files of the sources an epoch draws from (the model card's training data), and the mixture: each source's
    hash, weight, draws per epoch and files. The hash covers every source, drawn or not: it is the config's."""
    metas = [store.meta for store in stores]
    sources = [
        {"hash": meta["hash"], "weight": weight, "draws": int(quota), "corpus": meta["corpus"]}
        for meta, weight, quota in zip(metas, weights, quotas)
    ]
    drawn = [meta for meta, quota in zip(metas, quotas) if quota]
    shared = {key: value for key, value in metas[0].items() if key != "shards"}
    return {
        **shared,
        **{key: sum(meta.get(key, 0) for meta in drawn) for key in _SUMMED},
        "hash": mixture_hash([meta["hash"] for meta in metas], weights),
        "corpus": [path for meta in drawn for path in meta["corpus"]],
        "mixture": sources,
    }
