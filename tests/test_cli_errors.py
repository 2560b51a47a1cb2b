"""Bad input: one clear line on stderr, a non-zero exit, nothing half-written."""

import gzip

import pytest
from conftest import SAMPLE

from mlmlab.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err.strip()


def assert_one_line_error(code, err, *words):
    assert code == 2
    assert err.startswith("mlmlab: error: ") and "\n" not in err and "Traceback" not in err
    for word in words:
        assert word in err, err


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tok"
    assert main(["tokenizer", "--vocab", str(SAMPLE / "vocab.txt"), "--out", str(out)]) == 0
    return out


def test_empty_corpus(capsys, tmp_path, tokenizer_dir):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    out = tmp_path / "prepared"
    code, err = run_cli(capsys, "prepare", "--corpus", str(empty), "--tokenizer", str(tokenizer_dir), "--out", str(out))
    assert_one_line_error(code, err, "empty.txt")
    assert not out.exists() and not list(tmp_path.glob(".*prepared*"))


def test_undecodable_corpus(capsys, tmp_path, tokenizer_dir):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("Caf\xe9 au lait is a drink.\n".encode("latin-1") * 3)
    out = tmp_path / "prepared"
    code, err = run_cli(capsys, "prepare", "--corpus", str(bad), "--tokenizer", str(tokenizer_dir), "--out", str(out))
    assert_one_line_error(code, err, "latin1.txt", "UTF-8")
    assert not out.exists()


def test_vocab_without_mask(capsys, tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(line for line in (SAMPLE / "vocab.txt").read_text().splitlines() if line != "[MASK]"))
    code, err = run_cli(capsys, "tokenizer", "--vocab", str(vocab), "--out", str(tmp_path / "tok"))
    assert_one_line_error(code, err, "[MASK]")


@pytest.mark.parametrize(
    "override, words",
    [
        ("train.lrr=1e-3", ["train.lrr"]),
        ("modle.hidden_size=64", ["modle"]),
        ("masking.rate=1.5", ["masking.rate", "(0, 1)"]),
        ("masking.rate=0", ["masking.rate"]),
        ("data.max_seq_length=1024", ["max_position_embeddings"]),
        ("train.lr=fast", ["train.lr"]),
        ("masking.freq_buckets=10000,1000", ["masking.freq_buckets", "increasing"]),
        ("model.attention_dropout=1.5", ["model.attention_dropout", "[0, 1)"]),
        ("model.dropout=-0.1", ["model.dropout"]),
    ],
)
def test_bad_config(capsys, tmp_path, override, words):
    code, err = run_cli(capsys, "pretrain", override, f"train.out_dir={tmp_path / 'run'}")
    assert_one_line_error(code, err, *words)
    assert not (tmp_path / "run").exists()


def test_mask_rate_on_the_mask_command(capsys):
    code, err = run_cli(capsys, "mask", "a sentence", "--rate", "1.2")
    assert_one_line_error(code, err, "rate")


def test_not_a_prepared_dataset(capsys, tmp_path):
    code, err = run_cli(capsys, "dump", "--data", str(tmp_path))
    assert_one_line_error(code, err, "prepared")


def test_not_a_model_folder(capsys, tmp_path, tokenizer_dir):
    code, err = run_cli(capsys, "evaluate", "--model", str(tmp_path), "--data", str(tmp_path))
    assert_one_line_error(code, err, "model folder")


def test_bad_frequency_buckets_for_evaluate(capsys, tmp_path):
    code, err = run_cli(capsys, "evaluate", "--model", str(tmp_path), "--data", str(tmp_path), "--freq-buckets", "1k")
    assert_one_line_error(code, err, "--freq-buckets", "1000,10000")


def test_corrupt_model_weights(capsys, tmp_path, tokenizer_dir):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "bert"}')
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    code, err = run_cli(capsys, "evaluate", "--model", str(folder), "--data", str(tmp_path))
    assert_one_line_error(code, err, "cannot read the weights", "truncated or not safetensors")


def test_missing_corpus_file(capsys, tmp_path, tokenizer_dir):
    code, err = run_cli(capsys, "prepare", "--corpus", str(tmp_path / "nope.txt.gz"), "--tokenizer", str(tokenizer_dir))
    assert_one_line_error(code, err, "nope.txt.gz")


def test_short_documents_for_nsp(capsys, tmp_path, tokenizer_dir):
    """A corpus of one one-sentence document cannot give a random B from another document."""
    one = tmp_path / "one.txt.gz"
    with gzip.open(one, "wt", encoding="utf-8") as handle:
        handle.write("Just one sentence here.\n")
    code, err = run_cli(
        capsys, "prepare", "--corpus", str(one), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "p")
    )
    assert_one_line_error(code, err)


@pytest.mark.parametrize("variable, name", [("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")])
def test_unsharded_or_untested_launch_is_refused_before_training(capsys, tmp_path, monkeypatch, variable, name):
    """DeepSpeed is untested; FSDP on CPU would silently run as DDP (accelerate shards only on accelerators)."""
    monkeypatch.setenv(variable, "true")  # what `accelerate launch` sets for an FSDP / DeepSpeed config
    code, err = run_cli(capsys, "pretrain", "--no-progress", f"train.out_dir={tmp_path / 'run'}")
    assert_one_line_error(code, err, name, "DDP")
    assert not (tmp_path / "run").exists()


def test_fp16_on_cpu_is_refused_rather_than_trained_in_fp32(capsys, tmp_path):
    code, err = run_cli(
        capsys, "pretrain", "--no-progress", "train.precision=fp16", f"train.out_dir={tmp_path / 'run'}"
    )
    assert_one_line_error(code, err, "fp16", "bf16")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, words",
    [
        # YAML errors inside an override: before, a yaml traceback
        ("train.lr==", ["override train.lr==", "not a YAML value"]),
        ("data.corpus=[a.txt,b.txt", ["override data.corpus=[a.txt,b.txt", "not a YAML value", "close a list"]),
        # before, accepted: 10**30 steps overflowed deep inside training
        (f"train.max_steps={10**30}", ["train.max_steps=", "at most 9007199254740992"]),
        # before, read silently as the octal numbers 7 and 8, the base-60 number 90
        ("train.seed=007", ["train.seed=007", "octal number 7", "write 7", "quote it ('007')"]),
        ("train.max_steps=010", ["octal number 8", "write 10"]),
        ("train.max_steps=1:30", ["base-60 number 90", "quote it ('1:30')"]),
        # before, "expects str, got datetime.date(2024, 1, 1)" with no word of quoting
        ("data.tokenizer=2024-01-01", ["2024-01-01 as a date", "quote it ('2024-01-01')"]),
    ],
)
def test_an_override_yaml_misreads_or_cannot_read_is_one_line(capsys, override, words):
    code, err = run_cli(capsys, "config", override)
    assert_one_line_error(code, err, *words)


def test_a_quoted_override_is_the_text_as_written(capsys):
    assert main(["config", "train.out_dir='2024-01-01'", "data.tokenizer='007'"]) == 0
    listing = capsys.readouterr().out
    assert "train.out_dir = '2024-01-01'" in listing and "data.tokenizer = '007'" in listing


def test_a_config_file_with_a_zero_padded_number_names_its_line(capsys, tmp_path):
    """Before, `seed: 010` trained with seed 8."""
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_steps: 100\n  seed: 010\n")
    code, err = run_cli(capsys, "config", str(path))
    assert_one_line_error(code, err, f"{path} line 3", "octal number 8", "write 10")
