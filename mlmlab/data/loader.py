"""Batches from a prepared TokenStore: a deterministic order, padding only, stateful.

The loader never masks (masking needs the current model, so it runs in the training
step). The order of epoch e is a permutation of its examples (every example once, or a
mixture's draws: data/mixture.py) drawn from a generator keyed by (seed, e), split into
global batches; rank r of w takes every w-th example of each global batch. Where the
loop stands is just (epoch, batches done in that epoch), so resuming needs no iterator
state: the same batches follow.
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from mlmlab.data.mixture import MixedStore
from mlmlab.errors import UserError
from mlmlab.utils.signals import ignore_stop_signals

KEYS_PADDED = ("input_ids", "token_type_ids")


@dataclass
class LoaderPosition:
    epoch: int = 0
    batch: int = 0  # global batches already consumed in this epoch
    global_batch: int = 0  # examples in each of them; 0: unknown (a checkpoint from before it was recorded)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self.global_batch = int(state.get("global_batch", 0))

    def for_global_batch(self, global_batch: int) -> "LoaderPosition":
        """The same share of the epoch in global batches of ``global_batch`` examples.

        A resume with another process count or batch size: batch k of another size is
        another point of the epoch, so it is rescaled rather than read as it is.
        """
        if self.global_batch in (0, global_batch):
            return LoaderPosition(self.epoch, self.batch, global_batch)
        return LoaderPosition(self.epoch, self.batch * self.global_batch // global_batch, global_batch)


def epoch_batches(
    num_examples: int, global_batch: int, seed: int, epoch: int, lengths=None, bucket_batches: int = 0
) -> np.ndarray:
    """(num_batches, global_batch) example ids of one epoch; the ragged tail is dropped.

    With ``lengths`` and ``bucket_batches`` > 0, each run of ``bucket_batches`` batches of the
    shuffled order is sorted by length before it is cut into batches, and the batch
    order is shuffled again: batches then hold similar lengths and pad little
    (fairseq-style bucketing), while every batch still mixes random examples.
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(num_examples)
    num_batches = num_examples // global_batch
    order = order[: num_batches * global_batch]
    if lengths is not None and bucket_batches > 0:
        window = bucket_batches * global_batch
        for start in range(0, len(order), window):
            chunk = order[start : start + window]
            order[start : start + window] = chunk[np.argsort(lengths[chunk], kind="stable")]
        return order.reshape(num_batches, global_batch)[rng.permutation(num_batches)]
    return order.reshape(num_batches, global_batch)


def collate(examples: list[dict], example_ids, pad_id: int) -> dict:
    """Pad to the longest example of the batch; returns HF-named (B, T) tensors + example_ids.

    An example is a store's (input_ids, token_type_ids, next_sentence_label) or a tokenizer's output, which may
    lack the segment ids (zeros), the NSP label (none) and the attention mask (every token attended)."""
    length = max(len(e["input_ids"]) for e in examples)
    batch = {
        key: np.full((len(examples), length), pad_id if key == "input_ids" else 0, dtype=np.int64)
        for key in KEYS_PADDED
    }
    attention = np.zeros((len(examples), length), dtype=np.int64)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        for key in KEYS_PADDED:
            batch[key][row, :n] = example.get(key, 0)
        attention[row, :n] = example.get("attention_mask", 1)
    out = {key: torch.from_numpy(value) for key, value in batch.items()}
    out["attention_mask"] = torch.from_numpy(attention)
    out["example_ids"] = torch.as_tensor(np.asarray(example_ids), dtype=torch.long)
    labels = [e.get("next_sentence_label", -1) for e in examples]
    if all(label >= 0 for label in labels):  # the mlm objective has no NSP label
        out["next_sentence_label"] = torch.tensor(labels, dtype=torch.long)
    return out


class _BatchDataset(Dataset):
    """Index = (the loader's position after the batch, a list of example ids); one call builds the whole batch
    (cheap in workers) and hands the position back beside it."""

    def __init__(self, store, pad_id: int):
        self.store = store
        self.pad_id = pad_id

    def __len__(self):
        return len(self.store)

    def __getitem__(self, index):
        position, example_ids = index
        return position, collate([self.store[int(i)] for i in example_ids], example_ids, self.pad_id)


def iterate_batches(
    store,
    *,
    batch_size: int,
    seed: int,
    start: LoaderPosition,
    rank: int = 0,
    world_size: int = 1,
    workers: int = 0,
    pad_id: int = 0,
    bucket_batches: int = 0,
):
    """Yield (LoaderPosition after this batch, batch) forever, starting at ``start``.

    Each yielded batch is this rank's share (batch_size examples) of a global batch of
    batch_size * world_size examples.
    """
    dataset = _BatchDataset(store, pad_id)
    global_batch = batch_size * world_size
    if len(store) < global_batch:
        raise UserError(
            f"the dataset has {len(store)} instances, fewer than one global batch of {global_batch}; "
            "use more text or a smaller train.batch_size"
        )
    plans = epoch_plans(store, global_batch=global_batch, seed=seed, start=start, bucket_batches=bucket_batches)
    batches = (
        (LoaderPosition(epoch, first + offset + 1, global_batch), example_ids[rank::world_size])
        for epoch, first, plan in plans
        for offset, example_ids in enumerate(plan)
    )
    # One loader over every epoch, its worker forked once, as the loop starts: a worker forked at each epoch
    # shared the then-grown training process's heap copy-on-write, so every page the step wrote next was copied
    # (a page fault each), and the worker kept the stale copies. Its own generator: a DataLoader draws a worker
    # base seed when iterated, and from torch's default generator that would shift the dropout stream of a
    # resumed run. Its workers leave a stop signal to the training loop, which saves before it exits.
    loader = DataLoader(
        dataset,
        batch_size=None,
        sampler=batches,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=ignore_stop_signals,
    )
    yield from loader


def epoch_plans(store, *, global_batch: int, seed: int, start: LoaderPosition, bucket_batches: int = 0):
    """Yield (epoch, index of its first batch, its (num_batches, global_batch) example ids from there) from
    ``start``, forever.

    The loader's order without the loader: what a run's batches hold, for anyone who must draw the same ones
    (benchmarks/throughput.py gives every arm these batches).
    """
    epoch, first = start.epoch, start.for_global_batch(global_batch).batch
    while True:
        examples = epoch_examples(store, seed, epoch)  # (N,)
        positions = epoch_batches(len(examples), global_batch, seed, epoch, store.lengths[examples], bucket_batches)
        yield epoch, first, examples[positions[first:]]
        epoch, first = epoch + 1, 0


def epoch_examples(store, seed: int, epoch: int) -> np.ndarray:
    """(N,) the example ids epoch ``epoch`` reads, before shuffling: a mixture's draws, else every example once."""
    return store.epoch_examples(seed, epoch) if isinstance(store, MixedStore) else np.arange(len(store))
