"""Where training and held-out data come from: a held-out split by documents, weighted corpus mixtures."""

import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_killed_run_resumes_bitwise
from test_pretrain import _command

from mlmlab.config import DataConfig, load_config
from mlmlab.data.loader import LoaderPosition, epoch_plans
from mlmlab.data.mixture import MixedStore
from mlmlab.data.resolve import SAMPLE_VALID, dataset_hashes, prepare_datasets
from mlmlab.errors import UserError

SAMPLE_VOCAB = Path(__file__).resolve().parent.parent / "mlmlab" / "resources" / "sample" / "vocab.txt"
FILLER = "the river was named after a town in the north".split()
WARNING = "held-out figures come from the sample bundled with mlmlab"


def _markers(count: int, skip: int = 0) -> list[str]:
    """``count`` whole words of the bundled vocabulary, each one token, none of them filler."""
    lines = SAMPLE_VOCAB.read_text().split("\n")[5000:]
    return [word for word in lines if word.isalpha() and len(word) > 4 and word not in FILLER][skip : skip + count]


def _corpus(path: Path, markers: list[str]) -> Path:
    """One document per marker: four sentences, each naming its marker, so every instance shows its documents."""
    documents = [
        "\n".join(f"The {marker} {' '.join(FILLER[i:] + FILLER[:i])}." for i in range(4)) for marker in markers
    ]
    path.write_text("\n\n".join(documents) + "\n")
    return path


def _markers_in(store, markers: list[str]) -> set[str]:
    """The markers (so the documents) any instance of ``store`` holds a token of."""
    ids = {word: number for number, word in enumerate(SAMPLE_VOCAB.read_text().split("\n"))}
    by_id = {ids[marker]: marker for marker in markers}
    return {by_id[t] for i in range(len(store)) for t in store[i]["input_ids"].tolist() if t in by_id}


def _data(**settings) -> DataConfig:
    return DataConfig(prepare_workers=1, **settings)


def test_valid_fraction_holds_out_whole_documents_the_training_side_never_reads(tmp_path):
    markers = _markers(300)
    corpus = _corpus(tmp_path / "corpus.txt", markers)
    train, valid, _ = prepare_datasets(_data(corpus=[str(corpus)], valid_fraction=0.2))
    trained, held_out = _markers_in(train, markers), _markers_in(valid, markers)
    assert not trained & held_out  # no document on both sides, NSP's random Bs included
    assert trained | held_out == set(markers)  # and none lost
    assert 30 < len(held_out) < 90  # 60 expected: each document is held out with chance 0.2
    assert valid.meta["split"] == {"valid_fraction": 0.2, "held_out": True}


def test_a_larger_fraction_adds_to_a_smaller_ones_held_out_documents(tmp_path):
    markers = _markers(200)
    corpus = _corpus(tmp_path / "corpus.txt", markers)
    small, large = (
        _markers_in(prepare_datasets(_data(corpus=[str(corpus)], valid_fraction=f))[1], markers) for f in (0.1, 0.3)
    )
    assert small < large


def test_the_split_is_in_the_prepared_data_identity_and_the_plain_hashes_are_unchanged(tmp_path):
    corpus = [str(_corpus(tmp_path / "corpus.txt", _markers(50)))]
    plain = dataset_hashes(_data(corpus=corpus, valid_corpus=[str(SAMPLE_VALID)]))
    assert plain == dataset_hashes(_data(corpus=corpus, valid_corpus=[str(SAMPLE_VALID)], valid_fraction=0.0))
    split = dataset_hashes(_data(corpus=corpus, valid_fraction=0.02))
    other = dataset_hashes(_data(corpus=corpus, valid_fraction=0.05))
    assert len({plain["train"], split["train"], other["train"]}) == 3 and split["valid"] != other["valid"]


@pytest.mark.parametrize(
    "settings, warned",
    [
        ({"corpus": "user"}, True),
        ({"corpus": "user", "valid_corpus": "user"}, False),
        ({"corpus": "user", "valid_fraction": 0.2}, False),
        ({}, False),  # the bundled sample trains: its own held-out split is the right one
        ({"corpus": "mixture"}, True),
    ],
)
def test_one_warning_line_exactly_when_the_bundled_sample_stands_in_for_a_user_corpus(
    tmp_path, caplog, settings, warned
):
    files = [str(_corpus(tmp_path / f"{name}.txt", _markers(40, skip))) for name, skip in (("a", 0), ("b", 40))]
    forms = {"user": [files[0]], "mixture": {files[0]: 0.8, files[1]: 0.2}}
    with caplog.at_level(logging.WARNING):
        prepare_datasets(_data(**{key: forms.get(value, value) for key, value in settings.items()}))
    lines = [record.getMessage() for record in caplog.records if WARNING in record.getMessage()]
    assert len(lines) == warned
    if warned:
        assert "data.valid_corpus=" in lines[0] and "data.valid_fraction=" in lines[0] and "\n" not in lines[0]


def test_a_prepared_folder_cannot_be_split(tmp_path):
    train, _, _ = prepare_datasets(_data(corpus=[str(_corpus(tmp_path / "corpus.txt", _markers(50)))]))
    with pytest.raises(UserError, match="data.valid_fraction splits corpus text"):
        prepare_datasets(_data(corpus=[str(train.path)], valid_fraction=0.1))


def test_the_mixture_forms_of_a_config_file_and_of_the_command_line_are_one_config(tmp_path):
    (tmp_path / "mix.yaml").write_text("data:\n  corpus:\n    domain/: 0.8\n    wiki/: 0.2\n")
    from_file = load_config(str(tmp_path / "mix.yaml"))
    from_command_line = load_config(None, ["data.corpus={domain/: 0.8, wiki/: 0.2}"])
    assert from_file == from_command_line and from_file.data.corpus == {"domain/": 0.8, "wiki/": 0.2}


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """A mixture at 0.8/0.2 whose heavy source holds a third of the examples: drawn above its size, the other below."""
    folder = tmp_path_factory.mktemp("mixture")
    small, large = _corpus(folder / "small.txt", _markers(150)), _corpus(folder / "large.txt", _markers(300, 150))
    train, _, _ = prepare_datasets(_data(corpus={str(small): 0.8, str(large): 0.2}, objective="mlm", max_seq_length=32))
    return train


def test_a_mixture_draws_each_source_its_weight_over_an_epoch(mixture):
    assert isinstance(mixture, MixedStore) and 0.2 < mixture.sizes[0] / len(mixture) < 0.45
    for epoch in (0, 3):
        _, _, plan = next(epoch_plans(mixture, global_batch=16, seed=7, start=LoaderPosition(epoch, 0)))
        share = np.mean(plan < mixture.sizes[0])  # example ids of the first source come first
        assert abs(share - 0.8) <= 0.02


def test_a_mixture_epoch_is_a_function_of_seed_and_epoch_and_walks_every_example(mixture):
    draws = [mixture.epoch_examples(seed=1, epoch=e) for e in range(4)]
    assert np.array_equal(draws[2], mixture.epoch_examples(seed=1, epoch=2))
    assert not np.array_equal(draws[0], mixture.epoch_examples(seed=2, epoch=0))
    # the light source is drawn below its size: no example twice before every one was drawn once
    light = np.concatenate(draws)[np.concatenate(draws) >= mixture.sizes[0]]
    counts = np.bincount(light - mixture.sizes[0], minlength=mixture.sizes[1])
    assert counts.max() - counts.min() <= 1


def test_the_mixture_is_in_the_prepared_data_identity(mixture):
    sources = [path for source in mixture.meta["mixture"] for path in source["corpus"]]
    hashes = [
        dataset_hashes(_data(corpus=dict(zip(sources, weights)), objective="mlm", max_seq_length=32))
        for weights in ((0.8, 0.2), (0.7, 0.3))
    ]
    assert hashes[0]["train"] == mixture.meta["hash"][:16] != hashes[1]["train"]
    assert hashes[0]["train"] != dataset_hashes(_data(corpus=sources, objective="mlm", max_seq_length=32))["train"]


def test_a_mixture_run_killed_and_resumed_ends_bitwise_as_one_run(tmp_path):
    mixed = f"data.corpus={{{SAMPLE_VALID}: 0.8, {_corpus(tmp_path / 'small.txt', _markers(100))}: 0.2}}"
    assert_killed_run_resumes_bitwise(tmp_path, lambda out_dir, steps: _command(out_dir, steps) + [mixed])


def test_a_user_error_for_a_mixture_of_one_source_is_one_line(tmp_path):
    result = subprocess.run(_command(tmp_path / "run", 2) + ["data.corpus={a.txt: 1}"], capture_output=True, text=True)
    assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1
    assert "a mixture of one source" in result.stderr
