"""ModernBERT beside BERT: transformers' own ModernBertForMaskedLM through the same sparse loss, its weight decay
and FLOP model, its presets, refusals, its folder's classifier (mean pooling, no token types), --init under NSP,
GLUE, linear probes and studies. What every architecture does (masking variants, exact resume, export, evaluation,
--init from its own folder) is test_conformance.py's.

A one- or two-layer H32 ModernBERT keeps each test to seconds.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import QUICK_RUN, TINY_RUN, corpus_folders, one_line_error
from test_hostile_inputs import write_glue_task
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForSequenceClassification, AutoTokenizer, ModernBertForMaskedLM

from mlmlab import choices
from mlmlab.cli import main
from mlmlab.config import ModelConfig, load_config
from mlmlab.model.architectures.modernbert import local_attention_pairs
from mlmlab.model.flops import encoder_forward_flops
from mlmlab.model.pretraining import IGNORE_INDEX, SparsePretraining, build_model
from mlmlab.train.loop import Trainer
from mlmlab.train.optim import parameter_groups

MODERNBERT = ["model.architecture=modernbert", "data.objective=mlm"]

pytestmark = pytest.mark.usefixtures("no_progress_bars")


def small_config(**fields) -> ModelConfig:
    return ModelConfig(
        **{
            "architecture": choices.MODERNBERT,
            "hidden_size": 32,
            "num_layers": 1,
            "num_heads": 2,
            "intermediate_size": 64,
            **fields,
        }
    )


def small_modernbert(**fields) -> ModernBertForMaskedLM:
    torch.manual_seed(0)
    return build_model(small_config(**fields), vocab_size=100, pad_token_id=0)


# ----- the model -----------------------------------------------------------------------------
def test_the_sparse_loss_is_the_librarys_own_loss_on_the_selected_positions():
    # two layers: layer 0 attends globally, layer 1 within 4 tokens either side of each position
    model = small_modernbert(num_layers=2, local_attention=8).eval()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 100, (3, 20), generator=generator)  # (B, T)
    attention = torch.ones_like(ids)
    ids[2, 14:], attention[2, 14:] = 0, 0  # a padded row
    selected = (torch.rand(ids.shape, generator=generator) < 0.3) & attention.bool()  # (B, T)
    labels = torch.where(selected, torch.randint(5, 100, ids.shape, generator=generator), IGNORE_INDEX)
    ours = SparsePretraining(model, use_nsp=False)(
        input_ids=ids, attention_mask=attention, token_type_ids=torch.zeros_like(ids), labels=labels
    )
    theirs = model(input_ids=ids, attention_mask=attention, labels=labels)  # the full head over every position
    assert int(ours["mlm_count"]) == int(selected.sum()) > 0
    assert ours["mlm_loss"].item() == pytest.approx(theirs.loss.item(), rel=1e-5)


def test_weight_decay_spares_exactly_the_norms_and_the_decoder_bias():
    model = small_modernbert(num_layers=2)
    decay, spared = parameter_groups(model, 0.01)
    names = {id(p): name for name, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in spared["params"]) == sorted(
        name for name in names.values() if "norm" in name or name == "decoder.bias"
    )
    assert "model.embeddings.tok_embeddings.weight" in {names[id(p)] for p in decay["params"]}  # tied to the decoder


def test_the_flop_model_counts_geglu_and_the_local_windows():
    reach = 3
    assert all(
        local_attention_pairs(length, reach) == sum(abs(i - j) <= reach for i in range(length) for j in range(length))
        for length in (1, 3, 4, 9, 20)
    )
    cfg = small_config(num_layers=4, local_attention=2 * reach)
    model = build_model(cfg, vocab_size=100, pad_token_id=0)
    length = 16
    with FlopCounterMode(display=False) as counter:  # the projections' and MLPs' matmuls, as torch counts them
        model.model(input_ids=torch.randint(5, 100, (1, length)))
    counted = sum(
        count for op, count in counter.get_flop_counts()["Global"].items() if str(op) in ("aten.mm", "aten.addmm")
    )
    attention = 4 * 32 * (2 * length * length + 2 * local_attention_pairs(length, reach))  # layers 0 and 3 global
    assert encoder_forward_flops(cfg, length) == counted + attention
    lengths = torch.tensor([length], dtype=torch.float64)  # as training counts them
    assert encoder_forward_flops(cfg, lengths).item() == counted + attention


def test_presets_match_bert_parameter_counts(bert_tokenizer):
    counts = {
        name: sum(
            p.numel()
            for p in build_model(load_config(name).model, len(bert_tokenizer), bert_tokenizer.pad_token_id).parameters()
        )
        for name in ("tiny", "modernbert-tiny", "mini", "modernbert-mini")
    }
    print("parameters with the bundled 30,522-token vocabulary:", counts)
    for size in ("tiny", "mini"):
        assert abs(counts[f"modernbert-{size}"] / counts[size] - 1) < 0.03
    for name in ("modernbert-tiny", "modernbert-mini", "modernbert-base"):
        cfg = load_config(name)
        assert (cfg.model.architecture, cfg.data.objective, cfg.masking.rate) == (choices.MODERNBERT, choices.MLM, 0.3)


# ----- refusals ------------------------------------------------------------------------------
def test_nsp_with_modernbert_is_refused_in_one_line(capsys):
    err = one_line_error(["pretrain", "--no-progress", "model.architecture=modernbert"], capsys)
    assert "NSP head" in err and "data.objective=mlm" in err
    err = one_line_error(["pretrain", "--no-progress", "--config", "modernbert-tiny", "data.objective=nsp"], capsys)
    assert "NSP head" in err


def test_modernbert_settings_with_bert_are_refused_in_one_line(capsys):
    err = one_line_error(["pretrain", "--no-progress", "model.local_attention=64"], capsys)
    assert "model.local_attention" in err and "model.architecture=modernbert" in err


# ----- what only ModernBERT's folder has --------------------------------------------------------
@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A small ModernBERT trained 2 steps: its run folder (test_conformance.py checks what every architecture's
    folder holds)."""
    run = tmp_path_factory.mktemp("modernbert") / "run"
    cfg = load_config(None, [*MODERNBERT, *TINY_RUN, f"train.out_dir={run}", "train.max_steps=2"])
    Trainer(cfg, evaluator=None, show_progress=False).train()
    return run


def test_its_classifier_pools_the_mean_and_takes_no_token_types(source):
    folder = source / "model"
    classifier = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)
    assert classifier.config.classifier_pooling == "mean"  # as the released ModernBERT folders, not the library's "cls"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer(["a sentence", "and another"], ["with a pair", "b"], padding=True, return_tensors="pt")
    assert "token_type_ids" not in inputs  # ModernBERT has no segment embeddings
    assert classifier(**inputs).logits.shape == (2, 2)


def test_init_from_it_under_nsp_names_train_init_and_the_remedy_it_suggests_trains(source, tmp_path, capsys):
    """Before: "set data.objective=mlm, or model.architecture=bert", without naming train.init; the second is refused
    next (the folder's architecture is taken)."""
    argv = [
        "pretrain",
        "--no-progress",
        "--init",
        str(source / "model"),
        *QUICK_RUN,
        "train.max_steps=1",
        "train.warmup_steps=0",
    ]
    capsys.readouterr()
    assert main([*argv, f"train.out_dir={tmp_path / 'nsp'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "NSP head" in err  # without data.objective=mlm the run would train NSP, which ModernBERT cannot
    assert f"train.init={source / 'model'} is a ModernBERT model" in err and "model.architecture" not in err, err
    remedy = err.split("; set ")[1].split(" ")[0]
    assert main([*argv, remedy, f"train.out_dir={tmp_path / 'mlm'}"]) == 0


def test_glue_and_probes_work_on_it(source, tmp_path, capsys):
    glue = tmp_path / "glue-data"
    write_glue_task(glue / "SST-2", rows=64)
    glue_argv = ["--model", str(source / "model"), "--task", "SST-2", "--data-dir", str(glue)]
    tuning = ["--seeds", "0", "--lr", "1e-3", "--epochs", "1", "--max-train-examples", "16"]
    assert main(["glue", *glue_argv, "--out", str(tmp_path / "glue"), *tuning, "--no-progress"]) == 0
    results = json.loads((tmp_path / "glue" / "glue_results.json").read_text())
    assert np.isfinite(results["tasks"]["SST-2"]["score"])
    assert main(["probe", *glue_argv, "--pooling", choices.MEAN_POOLING, "--no-progress"]) == 0  # frozen linear probes
    capsys.readouterr()


# ----- studies -------------------------------------------------------------------------------
def test_a_study_arm_sets_the_architecture(tmp_path, capsys):
    study = {
        "name": "architectures",
        "preset": "tiny",
        "seeds": [0],
        "baseline": "bert",
        "base": {
            "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
            "data": {"objective": choices.MLM},
            "train": {"max_steps": 10, "warmup_steps": 1},
        },
        "arms": [
            {"name": "bert"},
            {"name": "modernbert", "model.architecture": choices.MODERNBERT, "model.intermediate_size": 48},
        ],
        "out_dir": str(tmp_path / "out"),
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    assert main(["study", str(path), "--dry-run"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.split()}
    assert "modernbert" in rows and "bert" in rows
    assert rows["modernbert"][4] != rows["bert"][4]  # FLOPs per run: each architecture's own FLOP model


@pytest.mark.shared_data(*corpus_folders("adm-study-wp8k-9k"))
def test_an_existing_studys_run_keys_are_unchanged():
    """The new model.* keys enter no key of a study that does not set them: its finished rows stay its own."""
    from mlmlab.experiments.running.runner import plan_runs
    from mlmlab.experiments.study import load_study

    results = Path(__file__).resolve().parent.parent / "studies" / "adm-study-wp8k-9k" / "results.jsonl"
    recorded = {json.loads(line)["key"] for line in results.read_text().splitlines() if line.strip()}
    assert recorded <= {run.key for run in plan_runs(load_study("adm-study-wp8k-9k"))}
