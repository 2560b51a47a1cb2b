"""Masking variants are entries: one registered from outside the package trains, and the mask command masks as
training does."""

import json

import pytest
import torch
from conftest import PMI_TEST_VOCAB, TINY_RUN

from mlmlab import choices
from mlmlab.cli import main
from mlmlab.config import load_config
from mlmlab.data.resolve import prepare_datasets
from mlmlab.masking import scorers, strategies
from mlmlab.masking.masker import Masker
from mlmlab.masking.select import IGNORE_INDEX
from mlmlab.masking.strategies import UniformStrategy, add_strategy
from mlmlab.masking.variants import READS_COUNTS, READS_LOSSES, READS_MODEL, StrategyEntry
from mlmlab.model.folder import load_pretrained, write_model_folder
from mlmlab.model.pretraining import build_model

pytestmark = pytest.mark.usefixtures("no_progress_bars")

RUN = ["--config", "tiny", *TINY_RUN, "train.max_steps=5"]


class OddPositions(UniformStrategy):
    """Weight 1 at odd positions, 0 at even ones; keeps every batch's labels to show what was selected."""

    def __init__(self, cfg, vocab_size=None, token_counts=None):
        super().__init__(cfg, vocab_size, token_counts)
        self.selected_positions = []  # (N,) position in its row of every target, per micro-batch
        BUILT.append(self)

    def weights(self, model, batch, progress, epoch_key=0, step=1):
        ids = batch["input_ids"]  # (B, T)
        return (torch.arange(ids.size(1), device=ids.device) % 2).float().expand_as(ids)  # (B, T)

    def observe(self, batch, result):
        super().observe(batch, result)
        self.selected_positions.append((batch["labels"] != IGNORE_INDEX).nonzero()[:, 1])


BUILT: list[OddPositions] = []
ODD = StrategyEntry(
    "odd-positions",
    build=lambda cfg, info, vocab_size, counts: OddPositions(cfg, vocab_size, counts),
    card_lines=lambda cfg: ["- odd-positions masking: targets only at odd positions"],
)


@pytest.fixture
def registries(monkeypatch):
    """The registries as they were, after the test: a strategy it adds leaves with it."""
    monkeypatch.setattr(choices, "STRATEGIES", list(choices.STRATEGIES))
    monkeypatch.setattr(strategies, "STRATEGY_ENTRIES", dict(strategies.STRATEGY_ENTRIES))


def test_a_strategy_added_from_outside_trains_with_its_weights_and_its_facts(tmp_path, registries):
    add_strategy(ODD)
    BUILT.clear()
    run = ["pretrain", "--no-progress", *RUN, f"train.out_dir={tmp_path}", "masking.strategy=odd-positions"]
    assert main(run) == 0
    [strategy] = BUILT  # the run built it from its entry
    positions = torch.cat(strategy.selected_positions)
    assert len(strategy.selected_positions) == 5 and positions.numel() > 0
    assert (positions % 2 == 1).all()  # weight 0 is never drawn: selection used its weights
    card = (tmp_path / "model" / "README.md").read_text()
    assert "masking strategy: `odd-positions`" in card and "targets only at odd positions" in card
    with pytest.raises(ValueError, match="exists already"):
        add_strategy(ODD)


def test_every_strategy_and_scorer_is_an_entry_under_its_configurable_name():
    assert list(strategies.STRATEGY_ENTRIES) == choices.STRATEGIES
    assert list(scorers.SCORER_ENTRIES) == choices.SCORERS
    assert {entry.reads for entry in scorers.SCORER_ENTRIES.values()} == {READS_MODEL, READS_LOSSES, READS_COUNTS}


# ----- mlmlab mask and dump mask as a training step does, under the same settings ----------------
SENTENCE = "The quick brown fox jumps over the lazy dog, unbelievably."
# Settings every variant is shown under: a seed, and a decaying rate (0.3 at the progress shown).
SHARED = ["masking.seed=7", "masking.rate_schedule=linear_decay", "masking.rate_start=0.4", "masking.rate=0.2"]
# A strategy's own settings, so that the matrix sees them taken; a strategy not named here is shown under SHARED.
OWN = {
    choices.STATIC: ["masking.dupe_factor=3", "masking.whole_word=true"],
    choices.SPAN: ["masking.span_p=0.3", "masking.span_max_words=4"],
    choices.ADAPTIVE: ["masking.adapt_schedule=linear", "masking.a_max=0.5", "masking.floor=0.2"],
    choices.PMI: [f"masking.pmi_vocab_size={PMI_TEST_VOCAB}"],
}
PROGRESS, EPOCH = 0.5, 3


def variants(scored: bool) -> list[tuple[str, str | None]]:
    """(strategy, scorer) of every registered strategy (``scored``: with each scorer where it has one)."""
    return [
        (strategy, scorer)
        for strategy in choices.STRATEGIES
        for scorer in (choices.SCORERS if scored and strategies.strategy_entry(strategy).scored else [None])
    ]


def settings_of(strategy: str, scorer: str | None) -> list[str]:
    scored = [f"masking.scorer={scorer}"] if scorer else []
    return [f"masking.strategy={strategy}", *scored, *SHARED, *OWN.get(strategy, [])]


@pytest.fixture(scope="module")
def prepared():
    train, _, tokenizer = prepare_datasets(load_config("tiny").data)
    return train, tokenizer


@pytest.fixture(scope="module")
def model_folder(prepared, tmp_path_factory):
    """A tiny fresh model with the prepared data's tokenizer, as a model folder (what ADM's model scorers read)."""
    train, tokenizer = prepared
    model = build_model(
        load_config("tiny", ["model.hidden_size=32", "model.intermediate_size=64"]).model,
        len(tokenizer),
        tokenizer.pad_token_id,
    )
    folder = tmp_path_factory.mktemp("model")
    write_model_folder(folder, model.config, model.state_dict(), tokenizer, train.token_counts)
    return folder


def shown_targets(table: str) -> dict[int, str]:
    """{position: what the model sees there} of every selected row of mlmlab mask's table."""
    rows = [line.split() for line in table.splitlines()[2:-1]]
    return {int(row[0]): row[-3] for row in rows if row[-1] != "-100"}  # selected: ... seen, what, label


def training_step(settings: list[str], batch: dict, epoch: int, progress: float, corpus, tokenizer, model=None) -> dict:
    """``batch`` masked as the training step of a run under ``settings`` masks it (the Trainer's call)."""
    masker = Masker(load_config("tiny", settings).masking, tokenizer, corpus.token_counts, corpus=corpus)
    [step] = masker.mask_step([(epoch, batch)], model, progress=progress, step=1)
    return step


@pytest.mark.parametrize("strategy, scorer", variants(scored=True), ids=lambda v: v or "no-scorer")
def test_the_mask_command_shows_a_training_steps_masks_under_its_settings(
    capsys, prepared, model_folder, strategy, scorer
):
    train, tokenizer = prepared
    reads = scorers.scorer_entry(scorer).reads if scorer else None
    argv = ["mask", SENTENCE, "--data", str(train.path), "--epoch", str(EPOCH), "--training-progress", str(PROGRESS)]
    argv += ["--model", str(model_folder)] if reads == READS_MODEL else []
    code = main([*argv, *settings_of(strategy, scorer)])
    if reads == READS_LOSSES:  # a sentence has no training losses: refused, saying what to show instead
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and "loss tables" in err
        return
    assert code == 0
    shown = shown_targets(capsys.readouterr().out)
    ids = torch.tensor([tokenizer(SENTENCE)["input_ids"]])  # (1, T)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
        "example_ids": torch.zeros(1, dtype=torch.long),
    }
    model = load_pretrained(model_folder)[0] if reads == READS_MODEL else None
    step = training_step(settings_of(strategy, scorer), batch, EPOCH, PROGRESS, train, tokenizer, model)
    selected = (step["labels"][0] != IGNORE_INDEX).nonzero()[:, 0].tolist()
    assert sorted(shown) == selected and selected
    seen = tokenizer.convert_ids_to_tokens(step["input_ids"][0, selected].tolist())
    assert [shown[position] for position in selected] == seen


@pytest.mark.parametrize("strategy", [strategy for strategy, _ in variants(scored=False)])
def test_dump_shows_a_training_steps_masks_under_its_settings(capsys, prepared, strategy):
    train, tokenizer = prepared
    if strategies.strategy_entry(strategy).scored:  # a dump runs no scorer: mlmlab mask shows it (above)
        assert main(["dump", "--data", str(train.path), "--masked", f"masking.strategy={strategy}"]) == 2
        assert "mlmlab mask" in capsys.readouterr().err
        return
    argv = ["dump", "--data", str(train.path), "-n", "4", "--start", "10", "--masked"]
    argv += ["--epoch", str(EPOCH), "--training-progress", str(PROGRESS), *settings_of(strategy, None)]
    assert main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    examples = [train[index] for index in range(10, 14)]
    length = max(len(example["input_ids"]) for example in examples)
    ids = torch.zeros(4, length, dtype=torch.long)  # (B, T) padded as a training batch is
    for row, example in enumerate(examples):
        ids[row, : len(example["input_ids"])] = torch.from_numpy(example["input_ids"])
    batch = {
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
        "token_type_ids": torch.zeros_like(ids),
        "example_ids": torch.arange(10, 14),
    }
    step = training_step(settings_of(strategy, None), batch, EPOCH, PROGRESS, train, tokenizer)
    assert len(records) == 4 and any(record["labels"].count(IGNORE_INDEX) < len(record["labels"]) for record in records)
    for row, record in enumerate(records):
        n = len(record["input_ids"])
        assert step["input_ids"][row, :n].tolist() == record["masked_input_ids"]
        assert step["labels"][row, :n].tolist() == record["labels"]


def test_the_old_masking_options_still_work_and_name_their_settings(capsys):
    assert main(["mask", SENTENCE, "masking.strategy=span", "masking.rate=0.3", "masking.seed=4"]) == 0
    new = capsys.readouterr()
    assert main(["mask", SENTENCE, "--strategy", "span", "--rate", "0.3", "--mask-seed", "4"]) == 0
    old = capsys.readouterr()
    assert old.out == new.out and new.err == ""
    assert [note.split()[2:5] for note in old.err.splitlines()] == [
        ["--mask-seed", "is", "masking.seed=4"],
        ["--rate", "is", "masking.rate=0.3"],
        ["--strategy", "is", "masking.strategy=span"],
    ]


@pytest.mark.parametrize(
    "settings, words",
    [
        (["masking.strategy=adaptive", "masking.scorer=loss_ema"], ["loss tables", "--model", "--data"]),
        (["masking.strategy=adaptive", "masking.scorer=entropy"], ["--model"]),
        (["masking.strategy=adaptive", "masking.scorer=frequency"], ["--data"]),
    ],
)
def test_the_mask_command_says_what_a_scorer_needs(capsys, settings, words):
    assert main(["mask", SENTENCE, *settings]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and all(word in err for word in words)
