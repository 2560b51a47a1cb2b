"""Masking variants are entries: one registered from outside the package trains, and the mask command masks as
training does."""

import pytest
import torch

from mlmlab import choices
from mlmlab.cli import main
from mlmlab.config import load_config
from mlmlab.data.resolve import prepare_datasets
from mlmlab.masking import scorers, strategies
from mlmlab.masking.masker import Masker
from mlmlab.masking.select import IGNORE_INDEX
from mlmlab.masking.strategies import UniformStrategy, add_strategy
from mlmlab.masking.variants import READS_COUNTS, READS_LOSSES, READS_MODEL, StrategyEntry

pytestmark = pytest.mark.usefixtures("no_progress_bars")

TINY_RUN = [
    "--config",
    "tiny",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.intermediate_size=64",
    "train.batch_size=8",
    "train.max_steps=5",
    "train.warmup_steps=1",
    "train.eval_batches=2",
    "train.eval_every=0",
    "train.log_every=1",
    "train.precision=fp32",
    "data.loader_workers=0",
]


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
    run = ["pretrain", "--no-progress", *TINY_RUN, f"train.out_dir={tmp_path}", "masking.strategy=odd-positions"]
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


# ----- mlmlab mask masks as a training step does ---------------------------------------------
SENTENCE = "The quick brown fox jumps over the lazy dog, unbelievably."
# Every option the command shows without a model: (mask flags, the training config's masking keys, epoch).
SHOWN = {
    "dynamic": ([], [], 3),
    "static, past its dupe_factor": (
        ["--strategy", "static", "--dupe-factor", "3"],
        ["masking.strategy=static", "masking.dupe_factor=3"],
        4,
    ),
    "whole words, rate 0.4": (["--whole-word", "--rate", "0.4"], ["masking.whole_word=true", "masking.rate=0.4"], 1),
    "seed": (["--mask-seed", "7"], ["masking.seed=7"], 0),
    "frequency scorer": (
        ["--strategy", "adaptive", "--scorer", "frequency"],
        ["masking.strategy=adaptive", "masking.scorer=frequency"],
        2,
    ),
    "frequency-neutral": (
        ["--strategy", "adaptive", "--scorer", "frequency", "--frequency-neutral", "--rate", "0.5"],
        ["masking.strategy=adaptive", "masking.scorer=frequency", "masking.frequency_neutral=true", "masking.rate=0.5"],
        2,
    ),
}


@pytest.fixture(scope="module")
def prepared():
    train, _, tokenizer = prepare_datasets(load_config("tiny").data)
    return train, tokenizer


def shown_targets(table: str) -> dict[int, str]:
    """{position: what the model sees there} of every selected row of mlmlab mask's table."""
    rows = [line.split() for line in table.splitlines()[2:-1]]
    return {int(row[0]): row[-3] for row in rows if row[-1] != "-100"}  # selected: ... seen, what, label


@pytest.mark.parametrize("flags, keys, epoch", SHOWN.values(), ids=SHOWN.keys())
def test_the_mask_command_shows_a_training_steps_masks(capsys, prepared, flags, keys, epoch):
    train, tokenizer = prepared
    assert (
        main(["mask", SENTENCE, "--data", str(train.path), "--epoch", str(epoch), "--training-progress", "0.5", *flags])
        == 0
    )
    shown = shown_targets(capsys.readouterr().out)
    cfg = load_config("tiny", keys)
    ids = torch.tensor([tokenizer(SENTENCE)["input_ids"]])  # (1, T)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
        "example_ids": torch.zeros(1, dtype=torch.long),
    }
    [step] = Masker(cfg.masking, tokenizer, train.token_counts).mask_step([(epoch, batch)], None, progress=0.5, step=1)
    selected = (step["labels"][0] != IGNORE_INDEX).nonzero()[:, 0].tolist()
    assert sorted(shown) == selected and selected
    seen = tokenizer.convert_ids_to_tokens(step["input_ids"][0, selected].tolist())
    assert [shown[position] for position in selected] == seen


def test_dump_shows_a_training_steps_whole_word_and_static_masks(prepared):
    train, tokenizer = prepared
    from mlmlab.show import dump_instances

    records = list(
        dump_instances(
            train.path,
            4,
            start=10,
            masked=True,
            seed=5,
            epoch=7,
            strategy=choices.STATIC,
            dupe_factor=3,
            whole_word=True,
        )
    )
    cfg = load_config(
        "tiny", ["masking.strategy=static", "masking.dupe_factor=3", "masking.whole_word=true", "masking.seed=5"]
    )
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
    [step] = Masker(cfg.masking, tokenizer, train.token_counts).mask_step([(7, batch)], None, progress=0.0, step=1)
    for row, record in enumerate(records):
        n = len(record["input_ids"])
        assert step["input_ids"][row, :n].tolist() == record["masked_input_ids"]
        assert step["labels"][row, :n].tolist() == record["labels"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--strategy", "adaptive", "--scorer", "loss_ema"], ["loss tables", "--model", "--data"]),
        (["--strategy", "adaptive", "--scorer", "entropy"], ["--model"]),
        (["--strategy", "adaptive", "--scorer", "frequency"], ["--data"]),
    ],
)
def test_the_mask_command_says_what_a_scorer_needs(capsys, flags, words):
    assert main(["mask", SENTENCE, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and all(word in err for word in words)


def test_dump_refuses_a_strategy_that_needs_a_scorer(capsys, prepared):
    assert main(["dump", "--data", str(prepared[0].path), "--masked", "--strategy", "adaptive"]) == 2
    assert "mlmlab mask" in capsys.readouterr().err
