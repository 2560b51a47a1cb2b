"""Batch order: each example once per epoch, bucketing pads less, resume continues exactly."""

import os

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA

from mlmlab.data.loader import LoaderPosition, epoch_batches, epoch_plans, iterate_batches
from mlmlab.data.wikitext import detokenize_line, wikitext_documents
from mlmlab.masking.select import Corruption, mask_batch, token_info_for
from mlmlab.show import dump_instances


def test_every_example_once_per_epoch_and_new_order_each_epoch():
    lengths = np.random.default_rng(0).integers(10, 128, size=1000)
    for bucket in (0, 5):
        first = epoch_batches(1000, 32, seed=1, epoch=0, lengths=lengths, bucket_batches=bucket)
        assert first.shape == (31, 32) and len(np.unique(first)) == first.size
        assert not np.array_equal(
            first, epoch_batches(1000, 32, seed=1, epoch=1, lengths=lengths, bucket_batches=bucket)
        )


def test_bucketing_reduces_padding():
    lengths = np.random.default_rng(0).integers(10, 128, size=3200)

    def efficiency(batches):
        return lengths[batches].sum() / (lengths[batches].max(axis=1).sum() * batches.shape[1])

    plain = efficiency(epoch_batches(3200, 32, 0, 0))
    bucketed = efficiency(epoch_batches(3200, 32, 0, 0, lengths, bucket_batches=20))
    assert bucketed > 0.9 > plain


class _FakeStore:
    def __init__(self, n):
        self.lengths = np.random.default_rng(1).integers(4, 12, size=n)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        n = int(self.lengths[i])
        return {"input_ids": np.full(n, i + 1), "token_type_ids": np.zeros(n, dtype=np.int64), "next_sentence_label": 0}


def test_resuming_at_a_position_gives_the_same_following_batches():
    store = _FakeStore(100)
    straight = iterate_batches(store, batch_size=8, seed=3, start=LoaderPosition(), bucket_batches=4)
    seen = [next(straight) for _ in range(20)]  # crosses an epoch boundary (12 batches per epoch)
    position = seen[9][0]
    resumed = iterate_batches(store, batch_size=8, seed=3, start=position, bucket_batches=4)
    for (pos_a, a), _ in zip(seen[10:], range(10)):
        pos_b, b = next(resumed)
        assert pos_a == pos_b and torch.equal(a["example_ids"], b["example_ids"])


def test_the_plan_without_a_loader_holds_the_loaders_batches():
    """What benchmarks/throughput.py feeds its transformers arms: the same batches as a run's loader."""
    store = _FakeStore(100)
    for bucket in (0, 4):
        start = LoaderPosition(0, 5)
        loaded = iterate_batches(store, batch_size=8, seed=3, start=start, bucket_batches=bucket)
        planned = (
            ids
            for _, _, plan in epoch_plans(store, global_batch=8, seed=3, start=start, bucket_batches=bucket)
            for ids in plan
        )
        for _ in range(20):  # crosses an epoch boundary (12 batches per epoch)
            assert next(loaded)[1]["example_ids"].tolist() == next(planned).tolist()


def test_a_loader_worker_serves_every_epoch_and_gives_the_in_process_batches(tmp_path, monkeypatch):
    """One worker for the whole run, forked as the loop starts: a worker forked at each epoch shared the grown
    training process's heap copy-on-write (every page the step then wrote was copied, and the worker kept the
    stale copies). The batches and positions are those of the in-process loader."""

    def note_the_worker(worker_id: int) -> None:
        (tmp_path / f"worker-{os.getpid()}").touch()

    monkeypatch.setattr("mlmlab.data.loader.ignore_stop_signals", note_the_worker)
    store = _FakeStore(100)
    in_process = iterate_batches(store, batch_size=8, seed=3, start=LoaderPosition(), bucket_batches=4)
    in_worker = iterate_batches(store, batch_size=8, seed=3, start=LoaderPosition(), bucket_batches=4, workers=1)
    for _ in range(40):  # three epoch boundaries (12 batches per epoch)
        (want_position, want), (got_position, got) = next(in_process), next(in_worker)
        assert got_position == want_position and torch.equal(got["input_ids"], want["input_ids"])
    assert len(list(tmp_path.glob("worker-*"))) == 1


def test_ranks_split_each_global_batch():
    store = _FakeStore(100)
    whole = next(iterate_batches(store, batch_size=8, seed=3, start=LoaderPosition()))[1]["example_ids"]
    parts = [
        next(iterate_batches(store, batch_size=4, seed=3, start=LoaderPosition(), rank=r, world_size=2))[1][
            "example_ids"
        ]
        for r in range(2)
    ]
    assert sorted(torch.cat(parts).tolist()) == sorted(whole.tolist())


def test_a_position_of_another_global_batch_resumes_at_the_same_share_of_the_epoch():
    """Recorded with 2 processes x 8 (16 a step): resumed with 1 x 8 or 2 x 16, as a cluster's run might be."""
    store = _FakeStore(100)
    batches = iterate_batches(store, batch_size=8, seed=3, start=LoaderPosition(), world_size=2)
    recorded = [next(batches)[0] for _ in range(3)][-1]
    assert (recorded.batch, recorded.global_batch) == (3, 16)  # 48 examples of the epoch consumed
    for batch_size, world_size, expected in ((8, 1, 6), (16, 2, 1)):
        position, _ = next(iterate_batches(store, batch_size=batch_size, seed=3, start=recorded, world_size=world_size))
        assert (position.epoch, position.batch, position.global_batch) == (0, expected + 1, batch_size * world_size)
    unknown = LoaderPosition(0, 3)  # a checkpoint from before the size was recorded: read as it is
    assert next(iterate_batches(store, batch_size=8, seed=3, start=unknown))[0].batch == 4


def test_dump_masks_equal_the_training_step():
    from mlmlab.config import MaskingConfig, load_config
    from mlmlab.data.resolve import prepare_datasets

    train, _, tokenizer = prepare_datasets(load_config("tiny").data)
    info = token_info_for(tokenizer)
    records = list(dump_instances(train.path, 4, MaskingConfig(seed=5), start=10, masked=True, epoch=2))
    batch = next(iterate_batches(train, batch_size=16, seed=0, start=LoaderPosition(), pad_id=0))[1]
    batch["example_ids"][:4] = torch.arange(10, 14)  # the dumped examples, at other places in a batch
    for row, index in enumerate(range(10, 14)):
        example = train[index]
        n = len(example["input_ids"])
        batch["input_ids"][row] = 0
        batch["input_ids"][row, :n] = torch.from_numpy(example["input_ids"])
    masked = mask_batch(batch, seed=5, epoch_key=2, rate=0.15, info=info, corruption=Corruption())
    for row, record in enumerate(records):
        n = len(record["input_ids"])
        assert masked["input_ids"][row, :n].tolist() == record["masked_input_ids"]
        assert masked["labels"][row, :n].tolist() == record["labels"]


def test_wikitext_lines_are_detokenised():
    assert (
        detokenize_line(' 1 @,@ 000 well @-@ known ( 24 in ) , it \'s " red " . ')
        == '1,000 well-known (24 in), it\'s "red".'
    )


@pytest.mark.shared_data("wikitext103_eval")
def test_wikitext_is_read_as_its_articles():
    documents = wikitext_documents(SHARED_DATA / "wikitext103_eval" / "wiki.valid.tokens")
    assert len(documents) == 60
    assert documents[0][0].startswith("Homarus gammarus, known as the European lobster")
