"""GLUE evaluation: readers on the real files, metrics against scikit-learn/scipy, and a
tiny end-to-end fine-tuning run that must be deterministic given its seed."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import SAMPLE, SHARED_DATA
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from mlmlab.errors import UserError
from mlmlab.evaluate.glue import (
    check_only_head_is_new,
    compute_metrics,
    format_glue_table,
    load_model,
    run_glue,
    task_score,
)
from mlmlab.evaluate.glue_data import TASKS, read_labeled, read_unlabeled
from mlmlab.evaluate.glue_settings import GlueSettings, resolve_task_names
from mlmlab.utils import jsonio

GLUE_DIR = SHARED_DATA / "glue"
VOCAB = SAMPLE / "vocab.txt"  # bert-base-uncased's, bundled with the package
needs_glue = pytest.mark.shared_data("glue")
PRESENT_FILES = [  # (task, file, has header) for every train/dev/test file shipped in shared/data/glue
    (task, name, header)
    for task in ("CoLA", "SST-2", "MRPC", "STS-B", "RTE", "WNLI")
    for name, header in (("train.tsv", task != "CoLA"), ("dev.tsv", task != "CoLA"), ("test.tsv", True))
] + [("QNLI", "dev.tsv", True), ("QNLI", "test.tsv", True)]


# ---------------------------------------------------------------- metrics


@pytest.mark.parametrize("name", list(TASKS))
def test_metrics_equal_sklearn_and_scipy(name):
    task = TASKS[name]
    rng = np.random.default_rng(0)
    if task.is_regression:
        labels, predictions = rng.uniform(0, 5, 50), rng.uniform(0, 5, 50)
    else:
        labels, predictions = rng.integers(0, len(task.labels), 50), rng.integers(0, len(task.labels), 50)
    reference = {
        "mcc": lambda: matthews_corrcoef(labels, predictions),
        "accuracy": lambda: accuracy_score(labels, predictions),
        "f1": lambda: f1_score(labels, predictions),
        "pearson": lambda: pearsonr(labels, predictions)[0],
        "spearman": lambda: spearmanr(labels, predictions)[0],
    }
    metrics = compute_metrics(task, labels, predictions)
    assert metrics == {metric: pytest.approx(reference[metric](), abs=1e-12) for metric in task.metrics}


def test_undefined_metrics_are_written_as_json_null():
    # Pearson of a constant prediction is NaN; json.dumps would write a bare NaN, which is not JSON.
    pearson = compute_metrics(TASKS["STS-B"], [1.0, 2.0, 3.0], [2.5, 2.5, 2.5])["pearson"]
    text = jsonio.dumps({"dev": {"pearson": pearson}, "runs": [float("inf"), 0.5]})
    assert json.loads(text) == {"dev": {"pearson": None}, "runs": [None, 0.5]}


def test_task_score_averages_a_tasks_metrics_glue_style():
    assert task_score({"f1": 0.8, "accuracy": 0.7}) == pytest.approx(0.75)
    assert TASKS["MNLI"].metric_names == ("accuracy_matched", "accuracy_mismatched")
    assert TASKS["STS-B"].metric_names == ("pearson", "spearman")


# ---------------------------------------------------------------- readers


def data_lines(path: Path) -> int:
    # splitlines counts CoLA/dev.tsv's last line, which has no trailing newline (wc -l would not).
    return len(path.read_text(encoding="utf-8").splitlines())


@needs_glue
@pytest.mark.parametrize(("name", "file_name", "has_header"), PRESENT_FILES)
def test_readers_parse_every_row_of_the_real_files(name, file_name, has_header):
    task, path = TASKS[name], GLUE_DIR / name / file_name
    split = read_unlabeled(task, path) if file_name == "test.tsv" else read_labeled(task, path)
    assert len(split) == data_lines(path) - has_header
    assert all(len(texts) == len(split) for texts in split.texts)
    assert len(split.labels if split.labels is not None else split.indices) == len(split)


@needs_glue
def test_cola_without_header_and_mrpc_with_bom():
    cola = read_labeled(TASKS["CoLA"], GLUE_DIR / "CoLA" / "train.tsv")
    assert (cola.texts[0][0], cola.labels[0]) == (
        "Our friends won't buy this analysis, let alone the next one we propose.",
        1,
    )
    mrpc = read_labeled(TASKS["MRPC"], GLUE_DIR / "MRPC" / "dev.tsv")  # "\ufeffQuality" would be a missing column
    assert len(mrpc) == 408 and set(mrpc.labels) == {0, 1}
    assert mrpc.texts[1][0].startswith('" The foodservice')  # a literal quote, not csv quoting


@needs_glue
def test_max_examples_is_a_fixed_sample_in_file_order_not_the_head():
    path = GLUE_DIR / "SST-2" / "train.tsv"
    (full,) = read_labeled(TASKS["SST-2"], path).texts
    (sample,) = read_labeled(TASKS["SST-2"], path, max_examples=500).texts
    assert len(sample) == 500 and sample == read_labeled(TASKS["SST-2"], path, max_examples=500).texts[0]
    assert sample != full[:500]
    remaining = iter(full)
    assert all(text in remaining for text in sample)  # a subsequence: file order kept


@needs_glue
def test_regression_labels_are_floats():
    stsb = read_labeled(TASKS["STS-B"], GLUE_DIR / "STS-B" / "dev.tsv")
    assert stsb.labels[:3] == [5.0, 4.75, 5.0] and len(stsb) == 1500


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("RTE", "index\tsentence1\thypothesis\tlabel\n0\ta\tb\tentailment\n", "missing column(s) sentence2"),
        ("RTE", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\tmaybe\n", ":3: label 'maybe'"),
        ("RTE", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\n", ":2: expected 4 tab-separated fields"),
        ("CoLA", "gj04\t1\t\tFine.\ngj04\t1\tToo few fields.\n", ":2: expected 4 tab-separated fields"),
        ("STS-B", "sentence1\tsentence2\tscore\na\tb\thigh\n", ":2: score 'high' is not a number"),
        ("SST-2", "", "file is empty"),
    ],
)
def test_malformed_files_name_file_line_and_expectation(tmp_path, name, content, expected):
    path = tmp_path / "train.tsv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UserError) as error:
        read_labeled(TASKS[name], path)
    message = str(error.value)
    assert str(path) in message and expected in message and "\n" not in message


def test_task_names_and_bad_arguments():
    assert resolve_task_names(["sst2", "cola", "STS-B"]) == ["CoLA", "SST-2", "STS-B"]
    assert resolve_task_names("all") == list(TASKS)
    with pytest.raises(UserError, match="unknown GLUE task"):
        resolve_task_names(["MRPC", "SQuAD"])


def test_the_command_line_and_a_study_default_to_glue_settings(tmp_path):
    """One definition of GLUE's defaults; the command line fine-tunes on every task by default, a study on none."""
    from mlmlab.cli import build_parser, glue_settings_of
    from mlmlab.experiments.running.identity import settings_of
    from mlmlab.experiments.study import load_study

    command_line = glue_settings_of(build_parser().parse_args(["glue", "--model", "m", "--data-dir", "d"]))
    assert command_line == GlueSettings(tasks="all")
    study = tmp_path / "study.yaml"
    for glue, tasks in (("", ()), ("glue: {tasks: [RTE]}\n", ["RTE"])):
        study.write_text(f"arms: [{{name: dynamic}}]\nseeds: [0]\n{glue}")
        assert load_study(str(study)).glue == GlueSettings(tasks=tasks)
    # Run keys hold the GLUE seeds: those of the studies that run no GLUE were made with the default's [0].
    for name in ("adm-study-v3", "arch-plateau-wp8k"):
        assert list(settings_of(load_study(name))["glue"]["seeds"]) == [0]


def test_only_the_classifier_head_may_be_missing_from_a_checkpoint():
    check_only_head_is_new(Path("m"), ["classifier.weight", "classifier.bias", "bert.pooler.dense.weight"])
    with pytest.raises(UserError, match="lacks encoder weights"):
        check_only_head_is_new(Path("m"), ["classifier.weight", "bert.encoder.layer.0.output.dense.weight"])


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random 1-layer BERT saved like an mlmlab checkpoint, with the bert-base-uncased tokenizer."""
    from transformers import BertConfig, BertForPreTraining, BertTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-bert")
    config = BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    BertForPreTraining(config).save_pretrained(folder)
    shutil.copy(VOCAB, folder / "vocab.txt")
    # Through a folder: in transformers 5, BertTokenizerFast(vocab_file=...) silently builds a 5-token vocab.
    tokenizer = BertTokenizerFast.from_pretrained(folder)
    assert len(tokenizer) == 30522
    tokenizer.save_pretrained(folder)
    return folder


def test_fine_tuning_dropout_is_berts_whatever_the_pretrainings(tiny_model_dir, tmp_path):
    """mlmlab pretrains without dropout by default; GLUE must not fine-tune such models without it too."""
    from transformers import AutoConfig

    dropout_free = tmp_path / "pretrained-without-dropout"
    shutil.copytree(tiny_model_dir, dropout_free)
    config = AutoConfig.from_pretrained(dropout_free)
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    config.save_pretrained(dropout_free)
    default = GlueSettings(tasks=["STS-B"]).per_task()["STS-B"].dropout
    assert default == 0.1
    assert GlueSettings(tasks=["STS-B"], dropout=0.0).per_task()["STS-B"].dropout == 0.0
    for folder, dropout in [(dropout_free, default), (tiny_model_dir, 0.0)]:  # pretrained with none / with 0.1
        model = load_model(folder, TASKS["STS-B"], "pretrained", dropout)
        assert (model.config.hidden_dropout_prob, model.config.attention_probs_dropout_prob) == (dropout, dropout)
        assert model.bert.encoder.layer[0].output.dropout.p == dropout and model.dropout.p == dropout


def tiny_run(model_dir, out_dir, tasks, seeds=(0,), init="pretrained", write_test_predictions=False, **overrides):
    settings = dict(learning_rates=[1e-3], epochs=1, batch_size=8, max_length=32, max_train_examples=48)
    return run_glue(
        model_dir,
        GlueSettings(tasks, seeds, **(settings | overrides)),
        GLUE_DIR,
        out_dir,
        init=init,
        write_test_predictions=write_test_predictions,
        show_progress=False,
    )


@needs_glue
def test_fine_tuning_is_deterministic_given_a_seed(tiny_model_dir, tmp_path):
    first = tiny_run(tiny_model_dir, tmp_path / "a", ["RTE", "STS-B"])
    again = tiny_run(tiny_model_dir, tmp_path / "b", ["RTE", "STS-B"])
    other_seed = tiny_run(tiny_model_dir, tmp_path / "c", ["STS-B"], seeds=(1,))
    fresh_weights = tiny_run(tiny_model_dir, tmp_path / "d", ["STS-B"], init="random")
    for name in ("RTE", "STS-B"):
        assert first["tasks"][name]["runs"][0]["metrics"] == again["tasks"][name]["runs"][0]["metrics"]
    # Pearson moves with any change in the weights: the seed must actually reach init and order.
    assert first["tasks"]["STS-B"]["dev"] != other_seed["tasks"]["STS-B"]["dev"]
    assert first["tasks"]["STS-B"]["dev"] != fresh_weights["tasks"]["STS-B"]["dev"]
    assert fresh_weights["init"] == "random"


@needs_glue
def test_results_json_and_markdown_carry_median_choice_and_average(tiny_model_dir, tmp_path):
    results = tiny_run(tiny_model_dir, tmp_path, ["MRPC", "WNLI", "MNLI"], seeds=(0, 1), learning_rates=[1e-3, 3e-4])
    written = json.loads((tmp_path / "glue_results.json").read_text())
    mrpc = written["tasks"]["MRPC"]
    assert [(run["learning_rate"], run["seed"]) for run in mrpc["runs"]] == [(1e-3, 0), (1e-3, 1), (3e-4, 0), (3e-4, 1)]
    chosen = next(
        entry for entry in mrpc["median_per_learning_rate"] if entry["learning_rate"] == mrpc["chosen_learning_rate"]
    )
    assert chosen["score"] == max(entry["score"] for entry in mrpc["median_per_learning_rate"])
    f1s = [run["metrics"]["f1"] for run in mrpc["runs"] if run["learning_rate"] == mrpc["chosen_learning_rate"]]
    assert mrpc["dev"]["f1"] == pytest.approx(np.median(f1s))
    assert mrpc["score"] == pytest.approx((mrpc["dev"]["f1"] + mrpc["dev"]["accuracy"]) / 2)
    assert written["average"] == pytest.approx((mrpc["score"] + written["tasks"]["WNLI"]["score"]) / 2)
    assert written["tasks"]["MNLI"]["status"] == "missing"
    markdown = (tmp_path / "glue_results.md").read_text()
    assert markdown == format_glue_table(results)
    assert "| MRPC f1 | MRPC accuracy | WNLI accuracy | Average |" in markdown
    assert f"| {100 * written['average']:.1f} |" in markdown and "Missing" in markdown and "MNLI" in markdown


@needs_glue
def test_every_requested_task_missing_is_an_error_not_an_empty_success(tiny_model_dir, tmp_path):
    """Some missing tasks are reported beside the others (MNLI above); all missing would run nothing."""
    with pytest.raises(UserError, match="none of the requested GLUE tasks .* QQP/train.tsv is missing"):
        run_glue(tiny_model_dir, GlueSettings(["MNLI", "QQP", "QNLI"]), GLUE_DIR, tmp_path, show_progress=False)
    assert not (tmp_path / "glue_results.json").exists()


@needs_glue
@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"init": "scratch"}, "init='scratch' is not known"),
        ({"epochs": 0}, "epochs=0 must be at least 1"),
        ({"dropout": 1.0}, r"dropout=1.0 must be within \[0, 1\)"),
        ({"seeds": ()}, "seeds .* must be a non-empty list"),
        ({"model_dir": GLUE_DIR}, "has no config.json"),
    ],
)
def test_bad_arguments_fail_before_any_training(tiny_model_dir, tmp_path, arguments, expected):
    settings = {name: arguments.pop(name) for name in ("epochs", "dropout", "seeds") if name in arguments}
    arguments = {"model_dir": tiny_model_dir, "show_progress": False} | arguments
    with pytest.raises(UserError, match=expected):
        run_glue(settings=GlueSettings(["RTE"], **settings), data_dir=GLUE_DIR, out_dir=tmp_path, **arguments)
    assert not (tmp_path / "glue_results.json").exists()


@needs_glue
def test_test_predictions_in_glue_submission_format(tiny_model_dir, tmp_path):
    tiny_run(tiny_model_dir, tmp_path, ["RTE"], write_test_predictions=True)
    lines = (tmp_path / "test_predictions" / "RTE.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 3001
    assert {line.split("\t")[1] for line in lines[1:]} <= {"entailment", "not_entailment"}
