"""What every architecture promises, whichever it is: one matrix read from the registries.

Its axes are the registered architectures (``model/architectures/``: ``ADAPTERS``), the registered masking
strategies, each scored one once with every registered scorer (``masking/strategies.py`` and ``scorers.py``), and the
tokenizer kinds (``choices.TOKENIZER_KINDS``), so an architecture, strategy or scorer registered later is in it with no
edit here. The cheap scenario runs over every pair: a few training steps of each architecture with each masking
variant, and with each tokenizer kind, every step's targets checked. The costly ones run once per architecture, on its
natural tokenizer: a SIGKILLed run resumes bit for bit; and, on one tiny run of it trained once (``tiny_run``), the
exported folder loads with transformers' Auto classes and fill-mask, a checkpoint exports and evaluates as the run
did, a run starts from the exported folder (``--init``) and exports again, and a resume into another architecture is
refused. What only one architecture has (RoBERTa's positions, NSP refusals, released parameter counts, ModernBERT's
pooling) stays in its own file.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    CORPUS,
    PMI_TEST_VOCAB,
    QUICK_RUN,
    TINY_MODEL,
    assert_killed_run_resumes_bitwise,
    one_line_error,
    pretrain_command,
)
from safetensors.torch import load_file
from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer, pipeline

from mlmlab import choices
from mlmlab.cli import main
from mlmlab.config import load_config
from mlmlab.evaluate.perplexity import evaluate_mlm
from mlmlab.masking import scorers, strategies
from mlmlab.masking.schedules import rate_at
from mlmlab.masking.select import eligible_positions
from mlmlab.model.architectures import ADAPTERS
from mlmlab.model.pretraining import IGNORE_INDEX, encode, predict
from mlmlab.train.loop import Trainer

pytestmark = pytest.mark.usefixtures("no_progress_bars")

ARCHITECTURES = list(ADAPTERS)  # every registered architecture, in choices.ARCHITECTURES' order
# The kind of tokenizer each architecture's released models use, where it is not WordPiece (BERT's, and what the
# ModernBERT presets train with): its costly scenarios and its masking variants run on it, so that every variant
# trains with every kind; test_trains_with_each_tokenizer_kind trains each architecture with the others.
NATURAL_KIND = {choices.ROBERTA: choices.BPE, choices.XLM_ROBERTA: choices.UNIGRAM}
# Runs from scratch add TINY_MODEL to it; a run that starts from a folder (--init) takes the folder's model.
QUICK = [*QUICK_RUN, "train.batch_size=4"]
STEPS = 3  # ADM's second and third steps score with what the first taught (the loss tables)

# A strategy's own settings, beside its name: a constant adapt factor, so that ADM's scores decide from step 1; the
# suite's one n-gram vocabulary size for PMI (built once per prepared data). A strategy not named here trains
# under its defaults.
OWN_SETTINGS = {
    choices.ADAPTIVE: ["masking.adapt_schedule=constant"],
    choices.PMI: [f"masking.pmi_vocab_size={PMI_TEST_VOCAB}"],
}
# Settings that compose with a strategy rather than being one (no registry lists them): each trains once more.
COMPOSED = {
    "whole-word": ["masking.whole_word=true"],
    "rate-decay": ["masking.rate_schedule=linear_decay", "masking.rate=0.15", "masking.rate_start=0.3"],
    "frequency-neutral": [
        "masking.strategy=adaptive",
        "masking.adapt_schedule=constant",
        "masking.scorer=loss_ema",
        "masking.frequency_neutral=true",
    ],
}


def registered_variants() -> dict[str, list[str]]:
    """{id: masking overrides} of every registered strategy, a scored one (ADM) once with each registered scorer."""
    variants = {}
    for name, entry in strategies.STRATEGY_ENTRIES.items():
        for scorer in scorers.SCORER_ENTRIES if entry.scored else [None]:
            scored = [f"masking.scorer={scorer}"] if scorer else []
            variants[f"{name}-{scorer}" if scorer else name] = [
                f"masking.strategy={name}",
                *scored,
                *OWN_SETTINGS.get(name, []),
            ]
    return variants


VARIANTS = {**registered_variants(), **COMPOSED}
# Each architecture with each tokenizer kind but its natural one (its variants above train on that one).
OTHER_KINDS = [
    (architecture, kind)
    for architecture in ARCHITECTURES
    for kind in choices.TOKENIZER_KINDS
    if kind != NATURAL_KIND.get(architecture, choices.WORDPIECE)
]


def test_the_matrix_holds_every_registered_architecture_strategy_and_scorer():
    assert ARCHITECTURES == choices.ARCHITECTURES
    expected = {
        f"{strategy}-{scorer}" if strategies.strategy_entry(strategy).scored else strategy
        for strategy in choices.STRATEGIES
        for scorer in choices.SCORERS
    }
    assert set(registered_variants()) == expected and not expected & set(COMPOSED)
    assert set(NATURAL_KIND) <= set(ARCHITECTURES) and set(NATURAL_KIND.values()) <= set(choices.TOKENIZER_KINDS)
    assert {kind for _, kind in OTHER_KINDS} == set(choices.TOKENIZER_KINDS)


# ----- the settings of a run ------------------------------------------------------------------------
def objective_of(architecture: str) -> str:
    """NSP where the architecture has its head (it trains both losses), else MLM."""
    return choices.NSP if ADAPTERS[architecture].has_nsp else choices.MLM


def settings_of(architecture: str, kind: str, tokenizers: dict) -> list[str]:
    """A tiny ``architecture`` from scratch on the session's trained tokenizer of ``kind``."""
    return [
        *TINY_MODEL,
        *QUICK,
        f"model.architecture={architecture}",
        f"data.objective={objective_of(architecture)}",
        f"data.tokenizer={tokenizers[kind]}",
    ]


def natural_settings(architecture: str, tokenizers: dict) -> list[str]:
    return settings_of(architecture, NATURAL_KIND.get(architecture, choices.WORDPIECE), tokenizers)


# ----- a few steps: every variant, every kind --------------------------------------------------------
def recorded_masks(trainer: Trainer) -> list[tuple[float, dict]]:
    """(progress, masked micro-batch) of each micro-batch the trainer's steps mask from now on."""
    seen = []
    mask_step = trainer.masker.mask_step

    def recording(micro, model, *, progress, step):
        masked = mask_step(micro, model, progress=progress, step=step)
        seen.extend((progress, batch) for batch in masked)
        return masked

    trainer.masker.mask_step = recording  # this trainer's only
    return seen


def assert_targets(trainer: Trainer, progress: float, batch: dict) -> None:
    """No special token selected, and the count the settings promise: exactly k = round(rate x eligible) a row (at
    least 1) for every strategy; whole words instead where masking.whole_word selects them one by one (a unit
    strategy draws exactly k positions of whole words, the last unit trimmed)."""
    masking = trainer.cfg.masking
    labels = batch["labels"]  # (B, T)
    selected = labels != IGNORE_INDEX  # (B, T)
    original = torch.where(selected, labels, batch["input_ids"])  # (B, T)
    eligible = eligible_positions(original, trainer.masker.info.special_ids)  # (B, T)
    assert selected.any() and not (selected & ~eligible).any()
    if masking.whole_word and not strategies.strategy_entry(masking.strategy).units:
        after_eligible = torch.nn.functional.pad(eligible[:, :-1], (1, 0))  # (B, T)
        continues = trainer.masker.continuation[original] & eligible & after_eligible  # (B, T)
        previous = torch.nn.functional.pad(selected[:, :-1], (1, 0))  # (B, T)
        assert not (continues & (selected != previous)).any(), "a word was split"
        assert (continues & selected).any()  # a word of several pieces was among the targets
        return
    n = eligible.sum(dim=1)  # (B,)
    rate = torch.tensor(rate_at(masking, progress), dtype=torch.float32)
    expected = torch.minimum(torch.round(rate * n).long().clamp(min=1), n)  # (B,)
    assert torch.equal(selected.sum(dim=1), expected), (progress, selected.sum(dim=1), expected)


def assert_trains(overrides: list[str], architecture: str, out_dir: Path) -> None:
    """STEPS steps of ``overrides``: instances framed by the tokenizer's own tokens, the architecture's model class,
    every step's targets as promised, a finite loss (with NSP's exactly where it has the head), moved weights."""
    cfg = load_config(None, [*overrides, f"train.out_dir={out_dir}"])
    trainer = Trainer(cfg, evaluator=None, show_progress=False)
    first = trainer.train_store[0]["input_ids"]
    assert first[0] == trainer.tokenizer.cls_token_id and first[-1] == trainer.tokenizer.sep_token_id
    assert isinstance(trainer.model, ADAPTERS[architecture].model_class)
    masked = recorded_masks(trainer)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    batches = trainer.batches()
    for _ in range(STEPS):
        out = trainer.train_step(batches)
        trainer.state.advance(out["clock"], cfg.train)
    assert len(masked) >= STEPS
    for progress, batch in masked:
        assert_targets(trainer, progress, batch)
    assert np.isfinite(out["loss"]) and ("nsp_loss" in out) == ADAPTERS[architecture].has_nsp
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_trains_with_every_masking_variant(architecture, variant, trained_tokenizers, tmp_path):
    overrides = [*natural_settings(architecture, trained_tokenizers), *VARIANTS[variant]]
    assert_trains(overrides, architecture, tmp_path)


@pytest.mark.parametrize("architecture,kind", OTHER_KINDS, ids=[f"{a}-{k}" for a, k in OTHER_KINDS])
def test_trains_with_each_tokenizer_kind(architecture, kind, trained_tokenizers, tmp_path):
    assert_trains(settings_of(architecture, kind, trained_tokenizers), architecture, tmp_path)


# ----- a SIGKILLed run resumes bit for bit ---------------------------------------------------------
# What a resume must restore, all at once: ADM's scorer state, StableAdamW's moments (AdamW's resume: test_units.py's
# BERT runs), micro-batches of a step while its batch still warms up (a kill can land inside it), dropout's generator.
HARD_TO_RESUME = [
    "train.save_every=2",
    "train.warmup_steps=3",
    "masking.strategy=adaptive",
    "masking.scorer=context",
    "train.optimizer=stable-adamw",
    "train.max_grad_norm=0",  # ModernBERT's recipe: StableAdamW's own clipping only
    "train.grad_accum=3",
    "train.batch_warmup_steps=6",
    "model.dropout=0.1",
]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_sigkill_then_resume_is_bitwise_identical(architecture, trained_tokenizers, tmp_path):
    settings = [*natural_settings(architecture, trained_tokenizers), *HARD_TO_RESUME]

    def command(out_dir, steps):
        return pretrain_command(*settings, f"train.out_dir={out_dir}", f"train.max_steps={steps}")

    assert_killed_run_resumes_bitwise(tmp_path, command)


# ----- one tiny run of each architecture: export, Auto classes, --init, refusals ----------------------
@dataclass(frozen=True)
class TinyRun:
    architecture: str
    overrides: list[str]  # without train.out_dir
    folder: Path  # the run folder: ckpt-00000002, ckpt-00000004, model/
    trainer: Trainer
    summary: dict  # the run's summary.json: its final held-out evaluation under "eval"

    @property
    def model(self) -> Path:
        return self.folder / "model"


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_run(request, trained_tokenizers, tmp_path_factory) -> TinyRun:
    """Each architecture trained once on its natural tokenizer: 4 steps, checkpoints at 2 and 4, its batch warming
    up from 1 micro-batch to 2 over the first 2, evaluated at the end."""
    architecture = request.param
    folder = tmp_path_factory.mktemp(architecture) / "run"
    overrides = [
        *natural_settings(architecture, trained_tokenizers),
        "train.max_steps=4",
        "train.save_every=2",
        "train.keep_last=0",
        "train.grad_accum=2",
        "train.batch_warmup_steps=2",
    ]
    trainer = Trainer(
        load_config(None, [*overrides, f"train.out_dir={folder}"]), evaluator=evaluate_mlm, show_progress=False
    )
    summary = trainer.train()
    return TinyRun(architecture, overrides, folder, trainer, summary)


SENTENCES = ["The city lies on the river.", "She was born in 1990 and plays basketball."]


def test_the_exported_folder_loads_with_the_auto_classes_and_fill_mask(tiny_run):
    adapter, trained = ADAPTERS[tiny_run.architecture], tiny_run.trainer.model.eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_run.model)
    assert tokenizer.get_vocab() == tiny_run.trainer.tokenizer.get_vocab()
    masked_lm = AutoModelForMaskedLM.from_pretrained(tiny_run.model).eval()
    assert masked_lm.config.model_type == tiny_run.architecture
    # its own class, but BERT's, which is BertForPreTraining: its masked LM without the NSP head then
    assert isinstance(masked_lm, adapter.model_class) or adapter.has_nsp
    saved = json.loads((tiny_run.model / "config.json").read_text())
    tokens = tiny_run.trainer.cfg.model.max_position_embeddings  # model.* counts tokens, config.json rows
    assert saved["max_position_embeddings"] == tokens + adapter.position_offset(saved)
    assert masked_lm.get_output_embeddings().weight.data_ptr() == masked_lm.get_input_embeddings().weight.data_ptr()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = predict(trained, encode(trained, batch)[0])  # (B, T, V)
        torch.testing.assert_close(masked_lm(**batch).logits, expected, rtol=1e-5, atol=1e-5)
    as_trained = adapter.model_class.from_pretrained(tiny_run.model).state_dict()  # BERT's: with its NSP head
    assert all(torch.equal(tensor, as_trained[name]) for name, tensor in trained.state_dict().items())
    _, info = AutoModelForSequenceClassification.from_pretrained(tiny_run.model, num_labels=2, output_loading_info=True)
    assert info["missing_keys"] and all(key.startswith("classifier.") for key in info["missing_keys"])
    fill = pipeline("fill-mask", model=str(tiny_run.model))
    mask = fill.tokenizer.mask_token
    predictions = fill(f"The capital of France is {mask}.")
    assert len(predictions) == 5 and all(mask not in p["sequence"] for p in predictions)
    assert all(p["token_str"] and 0 <= p["score"] <= 1 for p in predictions)
    card = (tiny_run.model / "README.md").read_text()
    assert f"{adapter.label} L1/H32" in card and adapter.loaded_by in card
    assert f"objective: `{objective_of(tiny_run.architecture)}`" in card


def test_a_checkpoint_exports_and_the_model_evaluates_as_the_run_did(tiny_run, tmp_path, capsys):
    assert main(["export", str(tiny_run.folder / "ckpt-00000002"), "--out", str(tmp_path / "step2")]) == 0
    assert AutoModelForMaskedLM.from_pretrained(tmp_path / "step2").config.model_type == tiny_run.architecture
    card = (tmp_path / "step2" / "README.md").read_text()
    assert "- 2 steps," in card and "batch warmup: 1 micro-batch(es) a step growing to 2 over 2 steps" in card
    # `mlmlab evaluate` prepares the held-out text as the run did (packed blocks or NSP pairs, 64 tokens): the run's
    # own final figures
    argv = ["evaluate", "--model", str(tiny_run.model), "--data", str(CORPUS), "--max-batches", "2"]
    assert main([*argv, "--json", str(tmp_path / "eval.json")]) == 0
    report, own = json.loads((tmp_path / "eval.json").read_text()), tiny_run.summary["eval"]
    assert report["objective"] == objective_of(tiny_run.architecture) and np.isfinite(report["perplexity"])
    assert report["masked_tokens"] == own["masked_tokens"] > 0
    assert report["mlm_loss"] == pytest.approx(own["mlm_loss"], abs=1e-4)
    assert ("nsp_accuracy" in report) == ADAPTERS[tiny_run.architecture].has_nsp
    capsys.readouterr()


def test_a_run_starts_from_the_exported_folder_and_exports_again(tiny_run, tmp_path):
    objective = f"data.objective={objective_of(tiny_run.architecture)}"
    init = [*QUICK, objective, f"train.init={tiny_run.model}", f"train.out_dir={tmp_path}", "train.max_steps=2"]
    trainer = Trainer(load_config(None, init), evaluator=evaluate_mlm, show_progress=False)
    cfg = trainer.cfg.model  # no model.* keys given: taken from the folder
    assert (cfg.architecture, cfg.hidden_size) == (tiny_run.architecture, 32)
    assert cfg.max_position_embeddings == tiny_run.trainer.cfg.model.max_position_embeddings
    saved = load_file(tiny_run.model / "model.safetensors")
    assert all(torch.equal(trainer.model.state_dict()[name], tensor) for name, tensor in saved.items())
    start, own = trainer.evaluate(trainer.cfg.train.eval_batches), tiny_run.summary["eval"]
    has_nsp = ADAPTERS[tiny_run.architecture].has_nsp
    for key in ("mlm_loss", "mlm_accuracy", "nsp_accuracy") if has_nsp else ("mlm_loss", "mlm_accuracy"):
        assert start[key] == pytest.approx(own[key], abs=1e-4), key  # step 0 is where the source ended
    trainer.train()
    again = AutoModelForMaskedLM.from_pretrained(tmp_path / "model")
    assert again.config.model_type == tiny_run.architecture
    assert AutoTokenizer.from_pretrained(tmp_path / "model").get_vocab() == tiny_run.trainer.tokenizer.get_vocab()
    assert any(not torch.equal(again.state_dict()[name], saved[name]) for name in saved if name in again.state_dict())


def test_a_resume_into_another_architecture_is_refused(tiny_run, tmp_path, capsys):
    other = ARCHITECTURES[(ARCHITECTURES.index(tiny_run.architecture) + 1) % len(ARCHITECTURES)]
    as_other = [f"model.architecture={other}", f"data.objective={objective_of(other)}"]
    argv = ["pretrain", "--no-progress", *tiny_run.overrides, *as_other, f"train.out_dir={tmp_path}"]
    err = one_line_error([*argv, "--resume", str(tiny_run.folder / "ckpt-00000002")], capsys)
    assert f"model_type={tiny_run.architecture}" in err and "model.architecture" in err
