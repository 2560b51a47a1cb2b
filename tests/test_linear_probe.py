"""Frozen linear probes: features once per split, C chosen without dev labels, random-init baselines,
the CLI's table and one-line errors, and the probe block of a study."""

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import SAMPLE
from test_experiments import DYNAMIC, TINY_BASE, write_study

from mlmlab import choices
from mlmlab.cli import main
from mlmlab.errors import UserError
from mlmlab.evaluate import linear_probe
from mlmlab.evaluate.linear_probe import load_encoder, run_probes
from mlmlab.experiments import study as study_file
from mlmlab.experiments.gates import gate_results, row_value
from mlmlab.experiments.running import downstream, runner

POSITIVE = "good great happy fine nice lovely".split()
NEGATIVE = "bad awful sad poor nasty ugly".split()
FILLER = "the a movie film was is it this story plot".split()
HEADERS = {"SST-2": "sentence\tlabel", "MRPC": "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String", "CoLA": None}


def sentence(rng, positive: bool) -> str:
    """Filler words and two words of one polarity: bags of words that a linear probe separates."""
    words = [*rng.choice(FILLER, 4), *rng.choice(POSITIVE if positive else NEGATIVE, 2)]
    rng.shuffle(words)
    return " ".join(words)


def task_line(task: str, rng, label: int, polarity: bool) -> str:
    if task == "SST-2":
        return f"{sentence(rng, polarity)}\t{label}"
    if task == "MRPC":
        return f"{label}\t1\t2\t{sentence(rng, polarity)}\t{sentence(rng, polarity)}"
    return f"src\t{label}\t\t{sentence(rng, polarity)}"  # CoLA: no header, four fields


def write_glue(folder, rows=(200, 100), label_noise=0.0, seed=0):
    """SST-2, MRPC and CoLA files in GLUE's layout whose label is the words' polarity, but for a
    ``label_noise`` share of rows whose polarity is a coin flip (1.0: labels independent of the text)."""
    rng = np.random.default_rng(seed)
    for task, header in HEADERS.items():
        (folder / task).mkdir(parents=True)
        for name, count in zip(("train.tsv", "dev.tsv"), rows):
            labels = rng.integers(0, 2, count)
            polarities = np.where(rng.random(count) < label_noise, rng.integers(0, 2, count), labels)
            lines = [task_line(task, rng, label, bool(polarity)) for label, polarity in zip(labels, polarities)]
            (folder / task / name).write_text("\n".join(([header] if header else []) + lines) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random 1-layer BERT saved like an mlmlab model folder, with the bundled uncased vocabulary."""
    from transformers import BertConfig, BertForPreTraining, BertTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-bert")
    config = BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128
    )
    with torch.random.fork_rng(devices=[]):  # fixed weights, not the probes' random init; other tests' RNG untouched
        torch.manual_seed(12345)
        BertForPreTraining(config).save_pretrained(folder)
    shutil.copy(SAMPLE / "vocab.txt", folder / "vocab.txt")
    BertTokenizerFast.from_pretrained(folder).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory):
    return write_glue(tmp_path_factory.mktemp("glue"))


@pytest.fixture(autouse=True)
def empty_feature_cache(monkeypatch):
    """Each test starts without the process's random-init features, so call counts do not depend on test order."""
    monkeypatch.setattr(linear_probe, "_RANDOM_INIT_FEATURES", {})


def probe(model_dir, data_dir, tasks=("SST-2",), **options):
    return run_probes(model_dir, list(tasks), data_dir, show_progress=False, **options)


def test_features_are_computed_once_per_split_and_random_init_ones_reused(tiny_model_dir, glue_dir, monkeypatch):
    calls = []
    compute = linear_probe.split_features
    monkeypatch.setattr(linear_probe, "split_features", lambda *args: calls.append(args[3]) or compute(*args))
    first = probe(tiny_model_dir, glue_dir, poolings=choices.POOLINGS)
    # both poolings come from one pass: each (split, init) once
    assert sorted(calls) == sorted(
        f"SST-2 {split} ({init})" for split in ("train", "dev") for init in ("pretrained", "random")
    )
    calls.clear()
    again = probe(tiny_model_dir, glue_dir, poolings=choices.POOLINGS)
    assert sorted(calls) == ["SST-2 dev (pretrained)", "SST-2 train (pretrained)"]
    assert again["poolings"] == first["poolings"]  # the kept random-init features are the ones computed


def test_every_figure_has_its_random_init_baseline_and_gain(tiny_model_dir, glue_dir):
    results = probe(tiny_model_dir, glue_dir, ["SST-2", "MRPC", "CoLA"])
    pooled = results["poolings"]["mean"]
    metrics = {"SST-2": ["accuracy"], "MRPC": ["f1", "accuracy"], "CoLA": ["mcc"]}
    for task, names in metrics.items():
        figures = pooled["tasks"][task]
        for name in names:
            assert 0 <= abs(figures[name]) <= 1 and 0 <= abs(figures[f"random_init_{name}"]) <= 1
        assert figures["score"] == pytest.approx(np.mean([figures[name] for name in names]))
        assert figures["gain"] == pytest.approx(figures["score"] - figures["random_init_score"])
        assert figures["C"] in linear_probe.STRENGTHS and figures["train_examples"] == 200
        assert set(figures) == set(linear_probe.figure_names(linear_probe.TASKS[task]))
    assert pooled["average_gain"] == pytest.approx(np.mean([f["gain"] for f in pooled["tasks"].values()]))


def test_several_random_inits_average_the_baseline(tiny_model_dir, glue_dir, tmp_path):
    """random_inits = 3: the baseline is the mean of draws from seeds 0, 1, 2; the first draw is the one-draw
    baseline."""
    noisy = write_glue(tmp_path / "noisy", label_noise=0.5)  # not separable: the draws' probes differ
    one = probe(tiny_model_dir, noisy, ["SST-2", "MRPC"])["poolings"]["mean"]["tasks"]
    three = probe(tiny_model_dir, noisy, ["SST-2", "MRPC"], random_inits=3)
    for task, figures in three["poolings"]["mean"]["tasks"].items():
        draws = figures["random_init_scores"]
        assert len(draws) == 3 and draws[0] == one[task]["random_init_score"] and len(set(draws)) > 1, draws
        assert figures["random_init_score"] == pytest.approx(np.mean(draws))
        assert figures["random_init_sd"] == pytest.approx(np.std(draws, ddof=1))
        assert figures["score"] == one[task]["score"] and figures["random_init_C"] == one[task]["random_init_C"]
        assert figures["gain"] == pytest.approx(figures["score"] - np.mean(draws))
    table = linear_probe.format_probe_table(three)
    assert "weights drawn from seeds 0-2, the mean of the 3 probes" in table and " ± " in table


def test_a_separable_task_is_probed_to_100_percent_and_random_labels_to_chance(tiny_model_dir, glue_dir, tmp_path):
    separable = probe(tiny_model_dir, glue_dir, poolings=choices.POOLINGS)["poolings"]
    for pooling in choices.POOLINGS:
        figures = separable[pooling]["tasks"]["SST-2"]
        assert figures["accuracy"] >= 0.95 and figures["random_init_accuracy"] >= 0.95, pooling
    noise = write_glue(tmp_path / "noise", rows=(400, 400), label_noise=1.0)
    figures = probe(tiny_model_dir, noise)["poolings"]["mean"]["tasks"]["SST-2"]
    assert 0.4 < figures["accuracy"] < 0.6 and 0.4 < figures["random_init_accuracy"] < 0.6


def test_the_regularisation_is_chosen_on_training_rows_only(tiny_model_dir, tmp_path, monkeypatch):
    noisy = write_glue(tmp_path / "noisy", label_noise=0.5)  # some labels not in the text: C matters
    flipped = tmp_path / "flipped"
    shutil.copytree(noisy, flipped)
    dev = flipped / "SST-2" / "dev.tsv"
    header, *lines = dev.read_text().splitlines()
    flips = (f"{text}\t{1 - int(label)}" for text, label in (line.rsplit("\t", 1) for line in lines))
    dev.write_text("\n".join([header, *flips]) + "\n")
    seen = []
    choose = linear_probe.chosen_strength
    monkeypatch.setattr(
        linear_probe, "chosen_strength", lambda task, x, y, seed: seen.append(len(y)) or choose(task, x, y, seed)
    )
    first, second = (probe(tiny_model_dir, data)["poolings"]["mean"]["tasks"]["SST-2"] for data in (noisy, flipped))
    assert (first["C"], first["random_init_C"]) == (second["C"], second["random_init_C"])
    assert second["accuracy"] == pytest.approx(1 - first["accuracy"])  # the dev labels did reach the score
    assert set(seen) == {200}  # C is chosen on the 200 training rows, never on the 100 dev rows


def test_the_random_init_encoder_is_the_same_config_from_a_fixed_seed(tiny_model_dir):
    def weights(init, seed):
        return load_encoder(tiny_model_dir, init, seed, torch.device("cpu")).state_dict()

    state = torch.get_rng_state()
    first, again, other = weights("random", 0), weights("random", 0), weights("random", 1)
    pretrained = weights("pretrained", 0)
    assert torch.equal(state, torch.get_rng_state())  # the caller's random stream is left as it was
    name = "embeddings.word_embeddings.weight"
    assert first[name].shape == pretrained[name].shape
    assert torch.equal(first[name], again[name]) and not torch.equal(first[name], other[name])
    assert not torch.equal(first[name], pretrained[name])


def test_cli_prints_the_table_and_writes_results(tiny_model_dir, glue_dir, tmp_path, capsys):
    out = tmp_path / "probe"
    assert (
        main(
            [
                "probe",
                "--model",
                str(tiny_model_dir),
                "--data-dir",
                str(glue_dir),
                "--task",
                "SST-2",
                "CoLA",
                "--pooling",
                "mean",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "| Task | Pooling | Score | Pretrained | Random init | Gain |" in text
    assert "| SST-2 | mean | accuracy |" in text and "| CoLA | mean | mcc |" in text and "| average | mean |" in text
    written = json.loads((out / "probe_results.json").read_text())
    assert set(written["poolings"]["mean"]["tasks"]) == {"SST-2", "CoLA"}
    assert (out / "probe_results.md").read_text() == text.rstrip("\n") + "\n"


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        ("columns", "missing column(s) sentence"),
        ("dev file", "MRPC/dev.tsv is missing"),
        ("model", "has no config.json"),
        ("seed", "--seed=-1 must be within [0, 4294967295] (seeds are 32-bit)"),
        ("random inits", "--random-inits=0 must be at least 1"),
    ],
)
def test_cli_errors_are_one_line(tiny_model_dir, glue_dir, tmp_path, capsys, breakage, expected):
    data, model = tmp_path / "glue", tiny_model_dir
    shutil.copytree(glue_dir, data)
    if breakage == "columns":
        train = data / "SST-2" / "train.tsv"
        train.write_text(train.read_text().replace("sentence\tlabel", "text\tlabel", 1))
    elif breakage == "dev file":
        (data / "MRPC" / "dev.tsv").unlink()
    else:
        model = tmp_path / "not-a-model"
        model.mkdir()
    extra = {"seed": ["--seed", "-1"], "random inits": ["--random-inits", "0"]}.get(breakage, [])
    assert main(["probe", "--model", str(model), "--data-dir", str(data), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlmlab: error: ") and "\n" not in err and expected in err, err


# ---------------------------------------------------------------- in a study


def test_a_probe_block_validates_and_its_row_paths_are_known(tmp_path, glue_dir):
    fields = {
        "glue_dir": str(glue_dir),
        "probe": {"tasks": ["sst2", "MRPC"], "pooling": "cls"},
        "gates": {"arm": "dynamic", "min": {"probe.tasks.SST-2.gain": 0.03}},
        "decision": {
            "metric": "eval.mlm_loss",
            "guard": {"probe.average_gain": 0.01, "probe.tasks.MRPC.random_init_f1": 0.01},
        },
    }
    study = study_file.load_study(write_study(tmp_path, **fields))
    assert study.probe == study_file.ProbeSettings(["SST-2", "MRPC"], "cls", 0)
    assert study_file.load_study(write_study(tmp_path, probe={})).probe.tasks == ["CoLA", "SST-2", "MRPC"]  # GLUE order
    assert study_file.load_study(write_study(tmp_path)).probe is None


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (
            {"probe": {"tasks": ["SST-2"], "layers": 2}},
            ["unknown probe key 'layers'", "valid keys: tasks, pooling, seed, random_inits"],
        ),
        ({"probe": {"pooling": "max"}}, ["study key 'probe'", "pooling"]),
        ({"probe": {"pooling": ["mean", "cls"]}}, ["study key 'probe'", "one pooling"]),
        ({"probe": {"tasks": ["SQuAD"]}}, ["study key 'probe'", "unknown GLUE task(s) SQuAD"]),
        ({"probe": "SST-2"}, ["study key 'probe' must be a mapping"]),
        (
            {"probe": {"tasks": ["SST-2"]}, "gates": {"arm": "dynamic", "min": {"probe.tasks.CoLA.gain": 0.0}}},
            ["gates min", "'probe.tasks.CoLA.gain'"],
        ),
        ({"gates": {"arm": "dynamic", "min": {"probe.average_gain": 0.0}}}, ["gates min", "'probe.average_gain'"]),
    ],
)
def test_bad_probe_blocks_give_one_line_errors(tmp_path, capsys, fields, words):
    assert main(["study", write_study(tmp_path, **fields), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlmlab: error: ") and "\n" not in err
    for word in words:
        assert word in err, err


def test_the_probe_block_enters_run_keys_only_where_a_study_has_one(tmp_path):
    def keys(**fields):
        return [run.key for run in runner.plan_runs(study_file.load_study(write_study(tmp_path, **fields)))]

    assert keys() == keys()
    assert keys(probe={"tasks": ["SST-2"]}) != keys()
    assert keys(probe={"tasks": ["SST-2"]}) != keys(probe={"tasks": ["SST-2"], "pooling": "cls"})
    # A probe key added later enters only when set off its default: the finished runs of a study keep their keys.
    assert keys(probe={"tasks": ["SST-2"], "random_inits": 1}) == keys(probe={"tasks": ["SST-2"]})
    assert keys(probe={"tasks": ["SST-2"], "random_inits": 3}) != keys(probe={"tasks": ["SST-2"]})


def test_a_studys_probe_cost_counts_each_random_init_draw(tmp_path, glue_dir, bert_tokenizer):
    def probe_encoders(**probe):
        study = study_file.load_study(
            write_study(tmp_path, glue_dir=str(glue_dir), probe={"tasks": ["SST-2"], **probe})
        )
        [work] = downstream.probe_work(study, bert_tokenizer)
        return work.runs

    assert probe_encoders() == 2 and probe_encoders(random_inits=3) == 4  # the pretrained encoder and each draw


def test_a_study_without_the_probes_data_stops_before_training(tmp_path):
    study = study_file.load_study(write_study(tmp_path, probe={"tasks": ["SST-2"]}))
    with pytest.raises(UserError, match="probes SST-2 but glue_dir '' is not a folder"):
        runner.run_study(study, log=lambda line: None)
    empty = tmp_path / "empty-glue"
    empty.mkdir()
    study = study_file.load_study(write_study(tmp_path, probe={"tasks": ["SST-2"]}, glue_dir=str(empty)))
    with pytest.raises(UserError, match="SST-2/train.tsv is missing"):
        runner.run_study(study, log=lambda line: None)
    assert not (tmp_path / "out" / "runs").exists()


def test_a_study_probes_each_finished_run_and_gates_read_its_row(tmp_path, glue_dir):
    base = {**TINY_BASE, "train": {**TINY_BASE["train"], "max_steps": 2, "eval_every": 0}}
    study = study_file.load_study(
        write_study(tmp_path, base=base, arms=[DYNAMIC], glue_dir=str(glue_dir), probe={"tasks": ["CoLA"]})
    )
    (row,) = runner.run_study(study, show_progress=False, log=lambda line: None)
    probed = row["probe"]
    assert probed["pooling"] == "mean" and list(probed["tasks"]) == ["CoLA"] and probed["seconds"] > 0
    cola = probed["tasks"]["CoLA"]
    assert row_value(row, "probe.tasks.CoLA.gain") == pytest.approx(cola["mcc"] - cola["random_init_mcc"])
    assert row_value(row, "probe.average_gain") == row_value(row, "probe.tasks.CoLA.gain")
    assert gate_results({"probe.tasks.CoLA.gain": -1.0}, [row])[0]["held"]
    assert (tmp_path / "out" / row["run_dir"] / "probe" / "probe_results.json").is_file()
