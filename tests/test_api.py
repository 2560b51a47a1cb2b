"""mlmlab's Python API: the names ``import mlmlab`` hands out, the held-out evaluator on any transformers masked LM, and
every example of docs/api.md run as written.
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import CORPUS, ROOT, TINY_MODEL, tiny_encoder

import mlmlab
from mlmlab.cli import main
from mlmlab.errors import UserError
from mlmlab.model.architectures import AnyMaskedLM
from mlmlab.model.pretraining import SparsePretraining


def test_import_mlmlab_stays_light_and_every_public_name_says_what_it_is():
    code = "import sys, mlmlab; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    light = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert light.stdout.strip() == "[]"
    for name in mlmlab.__all__:
        assert (getattr(mlmlab, name).__doc__ or "").strip(), f"mlmlab.{name} has no docstring"
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        mlmlab.Trainer  # noqa: B018 (the access is the test)


@pytest.fixture(scope="module")
def mlmlab_model(tmp_path_factory):
    """A tiny BERT trained by mlmlab.pretrain for a few steps (NSP pairs, as the defaults): its model folder."""
    run = tmp_path_factory.mktemp("api") / "run"
    overrides = [*TINY_MODEL, f"train.out_dir={run}", "train.max_steps=3", "train.warmup_steps=1", "train.batch_size=4"]
    summary = mlmlab.pretrain(None, [*overrides, "train.eval_batches=1", "data.loader_workers=0"], show_progress=False)
    assert summary["steps"] == 3
    return run / "model"


def test_pretrain_takes_overrides_with_a_preset_not_with_a_config():
    with pytest.raises(UserError, match="load_config"):
        mlmlab.pretrain(mlmlab.load_config("tiny"), ["train.max_steps=1"])


def test_the_evaluator_gives_mlmlab_evaluates_figures_of_the_same_model(mlmlab_model, tmp_path, capsys):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    out = tmp_path / "cli.json"
    argv = ["evaluate", "--model", str(mlmlab_model), "--data", str(CORPUS), "--max-batches", "2", "--recalibrate"]
    assert main([*argv, "--json", str(out), "--no-progress"]) == 0
    cli = json.loads(out.read_text())
    model = AutoModelForMaskedLM.from_pretrained(mlmlab_model)  # a BertForMaskedLM: the NSP head is left behind
    ours = mlmlab.evaluate_masked_lm(model, AutoTokenizer.from_pretrained(mlmlab_model), CORPUS, max_batches=2)
    assert "nsp_accuracy" in cli and "nsp_accuracy" not in ours
    assert cli["frequency_source"] == ours["frequency_source"] == "pretraining corpus"
    assert cli["objective"] == ours["objective"]  # the folder's recorded held-out form: NSP pairs
    figures = [key for key in cli if key not in ("nsp_accuracy", "dataset", "objective", "frequency_source")]
    assert {*figures, "nsp_accuracy", "dataset", "objective", "frequency_source"} == {*ours, "nsp_accuracy"}
    for key in figures:
        expected, got = cli[key], ours[key]
        for inner in expected if isinstance(expected, dict) else [None]:
            a, b = (expected[inner], got[inner]) if inner else (expected, got)
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, abs=1e-6), (key, inner)
    assert cli["masked_tokens"] > 0 and cli["recalibrated"]["scored_targets"] > 0


def tiny_distilbert(tokenizer):
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    config = DistilBertConfig(
        vocab_size=len(tokenizer), dim=32, n_layers=1, n_heads=2, hidden_dim=64, pad_token_id=tokenizer.pad_token_id
    )
    return DistilBertForMaskedLM(config)


def tiny_electra_generator(tokenizer):
    from transformers import ElectraConfig, ElectraForMaskedLM

    return ElectraForMaskedLM(ElectraConfig(**tiny_encoder(tokenizer, embedding_size=16)))


def test_other_toolkits_masked_lms_are_scored_on_the_same_masks(bert_tokenizer, sample_paragraphs, tmp_path):
    """A DistilBertForMaskedLM and an ELECTRA generator saved with save_pretrained, loaded with the Auto classes
    (no hub): the same targets for both, a random model's loss near log(V), texts and a Dataset alike."""
    from datasets import Dataset
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    texts = sample_paragraphs[:60]
    reports = {}
    for name, build in (("distilbert", tiny_distilbert), ("electra", tiny_electra_generator)):
        torch.manual_seed(0)
        build(bert_tokenizer).save_pretrained(tmp_path / name)
        bert_tokenizer.save_pretrained(tmp_path / name)
        model, tokenizer = (
            AutoModelForMaskedLM.from_pretrained(tmp_path / name),
            AutoTokenizer.from_pretrained(tmp_path / name),
        )
        reports[name] = mlmlab.evaluate_masked_lm(model, tokenizer, texts, max_batches=2, batch_size=8)
    distil, electra = reports["distilbert"], reports["electra"]
    assert distil["objective"] == "mlm" and distil["frequency_source"] == "evaluated data"
    assert distil["masked_tokens"] == electra["masked_tokens"] > 0  # one footing: the same fixed masks
    assert distil["recalibrated"]["scored_targets"] == electra["recalibrated"]["scored_targets"]
    assert abs(distil["mlm_loss"] - math.log(len(bert_tokenizer))) < 0.5  # near uniform: untrained
    assert abs(distil["recalibrated"]["raw_mlm_loss"] - distil["mlm_loss"]) < 0.2  # the scored half of the same
    as_dataset = mlmlab.evaluate_masked_lm(
        model,
        tokenizer,
        Dataset.from_dict({"body": texts}),
        max_batches=2,
        batch_size=8,
        text_column="body",
        recalibrate=False,
    )
    assert as_dataset["mlm_loss"] == electra["mlm_loss"] and "recalibrated" not in as_dataset


def test_a_masked_lm_through_its_own_forward_scores_as_through_its_sparse_head(bert_tokenizer, sample_paragraphs):
    """The path any masked LM takes (its forward's logits, the selected positions picked) gives the losses of
    the sparse path mlmlab takes through an architecture it knows: here one BertForMaskedLM both ways."""
    from transformers import BertConfig, BertForMaskedLM

    from mlmlab.data.loader import collate
    from mlmlab.masking.evaluation import eval_masks
    from mlmlab.masking.select import token_info_for

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(**tiny_encoder(bert_tokenizer))).eval()
    examples = [
        {"input_ids": bert_tokenizer(text, truncation=True, max_length=40)["input_ids"]}
        for text in sample_paragraphs[:4]
    ]
    batch = eval_masks(collate(examples, range(4), bert_tokenizer.pad_token_id), token_info_for(bert_tokenizer))
    with torch.no_grad():
        sparse = SparsePretraining(model)(**batch)
        whole = SparsePretraining(model, architecture=AnyMaskedLM)(**batch)
    assert torch.equal(sparse["selected_index"], whole["selected_index"])
    torch.testing.assert_close(whole["token_losses"], sparse["token_losses"], rtol=1e-5, atol=1e-5)
    assert int(whole["mlm_correct"]) == int(sparse["mlm_correct"])


def python_examples(page) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S)


def test_every_example_of_docs_api_runs_as_written(tmp_path):
    """docs/api.md's examples, in order, as one script in a fresh folder (they build on each other's files)."""
    examples = python_examples(ROOT / "docs" / "api.md")
    assert len(examples) >= 3
    script = tmp_path / "examples.py"
    script.write_text("\n".join(examples))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    ran = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "mlm_loss" in ran.stdout
