"""Units of whole words (span: SpanBERT; pmi: PMI-Masking): exact counts for every strategy, SpanBERT's length
distribution, units that never cross a special token, the n-gram vocabulary's collocations, training and resume."""

import numpy as np
import pytest
import torch
from conftest import PMI_TEST_VOCAB, TINY_RUN, assert_killed_run_resumes_bitwise
from scipy.stats import chisquare
from test_pretrain import _command as bert_command

from mlmlab import choices
from mlmlab.cli import main
from mlmlab.config import Config, MaskingConfig, load_config
from mlmlab.data.loader import collate
from mlmlab.data.mixture import MixedStore
from mlmlab.data.ngrams import ngram_text
from mlmlab.errors import UserError
from mlmlab.masking.masker import Masker, corpus_ngrams
from mlmlab.masking.select import continuation_table, eligible_positions, token_info_for, word_starts
from mlmlab.masking.units import span_length_cdf
from mlmlab.model.pretraining import IGNORE_INDEX
from mlmlab.train.loop import Trainer

pytestmark = pytest.mark.usefixtures("no_progress_bars")

PMI = [f"masking.pmi_vocab_size={PMI_TEST_VOCAB}"]
# The strategies of the exact-count property, with the settings they compose with.
EXACT = {
    "static": {"strategy": choices.STATIC},
    "dynamic": {"strategy": choices.DYNAMIC},
    "adaptive": {"strategy": choices.ADAPTIVE, "scorer": choices.FREQUENCY, "adapt_schedule": choices.CONSTANT},
    "adaptive-frequency-neutral": {
        "strategy": choices.ADAPTIVE,
        "scorer": choices.FREQUENCY,
        "frequency_neutral": True,
    },
    "span": {"strategy": choices.SPAN},
    "span-whole-word": {"strategy": choices.SPAN, "whole_word": True, "span_p": 0.05},
    "pmi": {"strategy": choices.PMI, "pmi_vocab_size": PMI_TEST_VOCAB},
    "pmi-whole-word": {"strategy": choices.PMI, "pmi_vocab_size": PMI_TEST_VOCAB, "whole_word": True},
}


def random_batch(store, tokenizer, rng, rows: int = 12) -> dict:
    """Sample instances cut to random lengths, with [UNK]s and [SEP]s dropped in and padding after; half of the
    rows from random ordinary ids instead (random words and pieces)."""
    sequences = []
    for row in range(rows):
        ids = store[int(rng.integers(len(store)))]["input_ids"][: int(rng.integers(3, 120))].copy()
        if row % 2:
            ids[1:] = rng.integers(1000, len(tokenizer), len(ids) - 1)
        for special in (tokenizer.unk_token_id, tokenizer.sep_token_id):
            ids[rng.integers(0, len(ids), int(rng.integers(0, 3)))] = special
        sequences.append(ids)
    return collate(
        [{"input_ids": ids, "token_type_ids": np.zeros_like(ids), "next_sentence_label": 0} for ids in sequences],
        [int(i) for i in rng.integers(0, 10**6, rows)],
        tokenizer.pad_token_id,
    )


@pytest.mark.parametrize("name", EXACT)
def test_every_strategy_selects_exactly_k_per_sequence(name, sample_store, bert_tokenizer):
    """Property: over random sequences, mask rates and (Ankner's) decaying rate schedules, every sequence has
    exactly round(rate x eligible) targets (at least one), never a special token."""
    rng = np.random.default_rng(list(EXACT).index(name))
    info = token_info_for(bert_tokenizer)
    for trial in range(6):
        rate, progress = float(rng.uniform(0.02, 0.9)), float(rng.uniform())
        cfg = Config(
            masking=MaskingConfig(
                **EXACT[name], rate=rate, rate_start=min(0.95, rate * 2), rate_schedule=choices.LINEAR_DECAY
            )
        ).masking
        masker = Masker(cfg, bert_tokenizer, sample_store.token_counts, corpus=sample_store)
        batch = random_batch(sample_store, bert_tokenizer, rng)
        masked, _ = masker.mask(batch, trial, None, progress=progress, step=1)
        eligible = eligible_positions(batch["input_ids"], info.special_ids)  # (B, T)
        selected = masked["labels"] != IGNORE_INDEX  # (B, T)
        current = cfg.rate_start + (cfg.rate - cfg.rate_start) * progress  # linear_decay, written out
        n = eligible.sum(dim=1)
        expected = torch.minimum(torch.round(torch.tensor(current, dtype=torch.float32) * n).long().clamp(min=1), n)
        assert torch.equal(selected.sum(dim=1), expected), (name, trial, rate, progress)
        assert not (selected & ~eligible).any()


def _unit_lengths(starts: torch.Tensor, is_unit_start: torch.Tensor) -> list[list[int]]:
    """Per row, the words in each unit, in order (rows of one run of words, no specials)."""
    rows = []
    for word_row, unit_row in zip(starts.tolist(), is_unit_start.tolist()):
        units = [0]
        for word, unit in zip(word_row, unit_row):
            if unit:
                units.append(0)
            units[-1] += word
        rows.append(units[1:])
    return rows


def test_span_lengths_follow_spanberts_clipped_geometric_distribution(bert_tokenizer):
    """10k+ spans cut from runs of words (each word one or two pieces): their lengths in words match SpanBERT's
    Geo(0.2) renormalised over 1..10 (mean 3.8 words) by a chi-square test; the run's last span is left out (the
    end of the run may cut it)."""
    masker = Masker(Config(masking=MaskingConfig(strategy=choices.SPAN, seed=3)).masking, bert_tokenizer, None)
    g = torch.Generator().manual_seed(0)
    rows, length = 120, 500
    ids = torch.randint(2000, 20000, (rows, length), generator=g)  # (B, T) ordinary ids
    continuation = masker.continuation
    pieces = torch.nonzero(continuation).flatten()
    second = torch.rand(rows, length, generator=g) < 0.2  # a fifth of the tokens continue a word
    ids[second] = pieces[torch.randint(len(pieces), (int(second.sum()),), generator=g)]
    ids[:, 0] = bert_tokenizer.cls_token_id
    ids[:, -1] = bert_tokenizer.sep_token_id
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "example_ids": torch.arange(rows)}
    eligible = eligible_positions(ids, masker.info.special_ids)
    starts = word_starts(eligible, continuation[ids])  # (B, T)
    units = masker.strategy.selection_units(batch, masker.strategy.epoch_key(0), starts, eligible)
    lengths = [n for row in _unit_lengths(starts, units) for n in row[:-1]]
    assert len(lengths) >= 10000
    pmf = span_length_cdf(0.2, 10).diff(prepend=torch.zeros(1)).numpy()
    assert abs(float((np.arange(1, 11) * pmf).sum()) - 3.8) < 0.01  # the paper's mean span length
    observed = np.bincount(lengths, minlength=12)[1:11]
    assert observed.sum() == len(lengths)  # none outside 1..10
    assert chisquare(observed, pmf * len(lengths)).pvalue > 1e-3, observed


def test_units_are_whole_words_inside_one_run_and_masks_are_whole_units_but_one(sample_store, bert_tokenizer):
    rng = np.random.default_rng(7)
    for strategy in (choices.SPAN, choices.PMI):
        cfg = Config(masking=MaskingConfig(strategy=strategy, pmi_vocab_size=PMI_TEST_VOCAB, rate=0.3)).masking
        masker = Masker(cfg, bert_tokenizer, None, corpus=sample_store)
        batch = random_batch(sample_store, bert_tokenizer, rng, rows=24)
        ids = batch["input_ids"]
        eligible = eligible_positions(ids, masker.info.special_ids)
        starts = word_starts(eligible, masker.continuation[ids])
        units = masker.strategy.selection_units(batch, 0, starts, eligible)  # (B, T)
        assert not (units & ~starts).any()  # a unit begins a word
        first_of_run = eligible.clone()
        first_of_run[:, 1:] &= ~eligible[:, :-1]
        assert not (first_of_run & ~units).any()  # a run of words after a special token begins a new unit
        selected = masker.mask(batch, 0, None, progress=0.0, step=1)[0]["labels"] != IGNORE_INDEX
        for row in range(len(ids)):
            unit_of = torch.cumsum(units[row].long(), 0)[eligible[row]].tolist()
            chosen = selected[row][eligible[row]].tolist()
            partial = {
                u for u in set(unit_of) if 0 < sum(c for c, v in zip(chosen, unit_of) if v == u) < unit_of.count(u)
            }
            assert len(partial) <= 1, (strategy, row)  # only the unit that reaches k is cut short


@pytest.mark.parametrize("strategy", [choices.SPAN, choices.PMI])
def test_whole_word_composes_with_units_by_changing_nothing(strategy, sample_store, bert_tokenizer):
    batch = random_batch(sample_store, bert_tokenizer, np.random.default_rng(3), rows=16)
    masks = []
    for whole_word in (False, True):
        cfg = Config(
            masking=MaskingConfig(strategy=strategy, whole_word=whole_word, pmi_vocab_size=PMI_TEST_VOCAB)
        ).masking
        masked, _ = Masker(cfg, bert_tokenizer, None, corpus=sample_store).mask(batch, 2, None, progress=0, step=1)
        masks.append((masked["input_ids"], masked["labels"]))
    assert all(torch.equal(a, b) for a, b in zip(*masks))


def test_pmi_vocabulary_of_the_sample_holds_its_collocations(sample_store, bert_tokenizer):
    cfg = Config(masking=MaskingConfig(strategy=choices.PMI, pmi_vocab_size=PMI_TEST_VOCAB)).masking
    vocabulary = corpus_ngrams(cfg, sample_store, continuation_table(bert_tokenizer), token_info_for(bert_tokenizer))
    texts = [ngram_text(entry, bert_tokenizer) for entry in vocabulary]
    top = "\n".join(f"{entry['pmi_n']:.2f} {entry['count']:>5} {text}" for entry, text in zip(vocabulary, texts[:20]))
    collocations = ["united states", "new york", "prime minister", "los angeles", "hong kong", "buenos aires"]
    found = [text for text in collocations if text in texts]
    assert len(found) >= 5, f"found only {found}; the top 20:\n{top}"
    assert not {"of the", "in the", "and the", "to the"} & set(texts), f"frequent, not collocated; top 20:\n{top}"
    assert {len(entry["words"]) for entry in vocabulary} == {2, 3, 4, 5}, top
    assert [entry["pmi_n"] for entry in vocabulary] == sorted((e["pmi_n"] for e in vocabulary), reverse=True)
    out = sample_store.path / "ngrams"
    assert len(list(out.glob("*.json"))) >= 1  # kept beside the prepared data: built once


def test_pmi_on_a_mixture_of_corpora_is_refused_in_one_line(sample_store, bert_tokenizer):
    cfg = Config(masking=MaskingConfig(strategy=choices.PMI)).masking
    with pytest.raises(UserError, match="a mixture of corpora has no n-gram vocabulary yet; train it on one corpus"):
        Masker(cfg, bert_tokenizer, None, corpus=MixedStore([sample_store, sample_store], [1.0, 1.0]))


def test_a_changed_setting_builds_another_vocabulary_under_another_name(sample_store):
    from mlmlab.data.ngrams import NgramSettings, vocabulary_path

    one = vocabulary_path(sample_store, NgramSettings(size=PMI_TEST_VOCAB))
    assert one == vocabulary_path(sample_store, NgramSettings(size=PMI_TEST_VOCAB))
    assert one != vocabulary_path(sample_store, NgramSettings(size=PMI_TEST_VOCAB, max_n=4))


@pytest.mark.parametrize(
    "bad,says",
    [
        (["masking.pmi_min_n=4", "masking.pmi_max_n=3"], "masking.pmi_max_n=3 is below masking.pmi_min_n=4"),
        (["masking.span_p=1"], "masking.span_p=1.0 must be within (0, 1)"),
        (["masking.span_max_words=0"], "masking.span_max_words=0 must be at least 1"),
        (["masking.strategy=spans"], "masking.strategy"),
    ],
)
def test_bad_unit_settings_are_refused_in_one_line(bad, says, tmp_path, capsys):
    assert main(["pretrain", "--no-progress", f"train.out_dir={tmp_path}", *bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_mask_shows_span_and_pmi_and_pmi_without_data_is_refused(sample_store, capsys):
    text = "The prime minister of the United States flew from New York to Hong Kong on a Tuesday."
    assert main(["mask", text, "masking.strategy=span", "masking.rate=0.3", "masking.span_p=0.3"]) == 0
    assert "span masking" in capsys.readouterr().out
    data = ["--data", str(sample_store.path), f"masking.pmi_vocab_size={PMI_TEST_VOCAB}"]
    assert main(["mask", text, "masking.strategy=pmi", "masking.rate=0.3", *data]) == 0
    out = capsys.readouterr().out
    selected, _, eligible = out.splitlines()[-1].split()[:3]
    assert out.startswith("pmi masking") and int(selected) == round(0.3 * int(eligible)), out
    assert main(["mask", text, "masking.strategy=pmi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "add --data DIR" in err
    assert main(["dump", "--ngrams", "3", *data]) == 0
    assert capsys.readouterr().out.count('"ngram"') == 3


# ----- training and resume -----------------------------------------------------------------
SMALL = [
    *TINY_RUN,
    "train.batch_size=4",
    "masking.rate_schedule=linear_decay",  # Ankner's decay, composed
    *PMI,
]
ARCHITECTURES = {
    "bert": ["model.architecture=bert", "data.objective=nsp"],
    "modernbert": ["model.architecture=modernbert", "data.objective=mlm"],
}


# BERT trains 20 steps with each strategy in the resume test below; here ModernBERT with each, and BERT with
# whole_word composed (it composes alike on every architecture)
RUNS = [("modernbert", choices.SPAN, False), ("modernbert", choices.PMI, False), ("bert", choices.SPAN, True)]


@pytest.mark.parametrize("architecture,strategy,whole_word", RUNS, ids=["-".join(map(str, run)) for run in RUNS])
def test_twenty_steps_train_with_units(architecture, strategy, whole_word, tmp_path):
    overrides = [*ARCHITECTURES[architecture], *SMALL, f"masking.strategy={strategy}", f"train.out_dir={tmp_path}"]
    cfg = load_config(None, [*overrides, f"masking.whole_word={str(whole_word).lower()}"])
    trainer = Trainer(cfg, evaluator=None, show_progress=False)
    batches = trainer.batches()
    losses = []
    for _ in range(20):
        out = trainer.train_step(batches)
        trainer.state.advance(out["clock"], cfg.train)
        losses.append(out["loss"])
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


@pytest.mark.parametrize("strategy", [choices.SPAN, choices.PMI])
def test_bert_trains_20_steps_and_a_sigkill_then_resume_is_bitwise_identical(strategy, tmp_path):
    def command(out_dir, steps):
        pmi = PMI if strategy == choices.PMI else []  # named beside span, a pmi_* key is refused
        return [*bert_command(out_dir, steps), f"masking.strategy={strategy}", *pmi]

    assert_killed_run_resumes_bitwise(tmp_path, command, steps=20)
