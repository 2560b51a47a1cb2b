"""Corpora beyond one text file: folders, JSONL with another text key, parquet / arrow / save_to_disk tables.

Each form holds the same documents as one plain text file and must give the same
prepared instances, shard file for shard file; the hashes of plain-text corpora prepared
before these forms existed must not move (a study's runs are keyed by them).
"""

import gzip
import json
from itertools import islice
from pathlib import Path

import datasets
import pytest
from conftest import SAMPLE

from mlmlab.cli import main
from mlmlab.config import DataConfig
from mlmlab.data.build import prepare, prepared_hash
from mlmlab.data.corpus import read_paragraph_documents, resolve_paths
from mlmlab.data.records import Columns
from mlmlab.data.resolve import dataset_hashes
from mlmlab.data.store import TokenStore
from mlmlab.data.tokenizer import adopt_vocab
from mlmlab.errors import UserError

NUM_DOCS = 60
SETTINGS = dict(max_seq_length=64, num_workers=1, docs_per_shard=20)  # 3 shards, so shard boundaries are compared too


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    return adopt_vocab(SAMPLE / "vocab.txt", tmp_path_factory.mktemp("vocab") / "uncased")


@pytest.fixture(scope="module")
def documents():
    """Real documents (lists of paragraphs) from the bundled validation sample."""
    return list(islice(read_paragraph_documents(SAMPLE / "valid.txt.gz"), NUM_DOCS))


@pytest.fixture(scope="module")
def reference(documents, vocab_dir, tmp_path_factory):
    """The documents as one plain text file (a blank line between documents), prepared."""
    folder = tmp_path_factory.mktemp("reference")
    path = folder / "corpus.txt"
    path.write_text(plain_text(documents), encoding="utf-8")
    return prepare(path, vocab_dir, out_dir=folder / "prepared", **SETTINGS)


def plain_text(documents) -> str:
    return "".join("\n".join(paragraphs) + "\n\n" for paragraphs in documents)


def assert_same_instances(folder: Path, reference: Path) -> None:
    ours, theirs = TokenStore(folder), TokenStore(reference)
    files = sorted(p.relative_to(reference) for p in reference.rglob("*.npy"))
    assert len(files) == 1 + 3 * 8  # token counts + 3 shards of 8 fields
    for relative in files:
        assert (folder / relative).read_bytes() == (reference / relative).read_bytes(), relative
    for key in ("num_documents", "num_instances", "num_corpus_tokens", "num_used_tokens"):
        assert ours.meta[key] == theirs.meta[key], key


def folder_corpus(documents, root: Path) -> Path:
    """The documents spread over nested files, one gzipped, one without suffix, with files to skip."""
    (root / "b" / "inner").mkdir(parents=True)
    (root / "a.txt").write_text(plain_text(documents[:15]), encoding="utf-8")
    with gzip.open(root / "b" / "inner" / "c.txt.gz", "wt", encoding="utf-8") as handle:
        handle.write(plain_text(documents[15:40]))
    (root / "b" / "wiki_00").write_text(plain_text(documents[40:]), encoding="utf-8")  # WikiExtractor-style name
    for skipped in (".hidden.txt", "SOURCE.md", "LICENSE", "b/meta.json"):  # hidden, documentation, metadata
        (root / skipped).write_text("Never read. Not part of the corpus.\n", encoding="utf-8")
    (root / "b" / ".git").mkdir()
    (root / "b" / ".git" / "HEAD").write_text("ref: refs/heads/main\n", encoding="utf-8")
    return root


def paragraph_rows(documents) -> dict:
    """One row per paragraph, with its document's id: the usual shape of a paragraph dataset."""
    rows = [(f"doc-{i}", paragraph) for i, paragraphs in enumerate(documents) for paragraph in paragraphs]
    return {"doc": [doc for doc, _ in rows], "body": [text for _, text in rows]}


def test_a_folder_reads_the_corpus_files_under_it_in_sorted_order(documents, vocab_dir, reference, tmp_path):
    root = folder_corpus(documents, tmp_path / "corpus")
    assert [p.relative_to(root).as_posix() for p in resolve_paths(root)] == ["a.txt", "b/inner/c.txt.gz", "b/wiki_00"]
    assert_same_instances(prepare(root, vocab_dir, out_dir=tmp_path / "p", **SETTINGS), reference)
    # A folder is its files: the same hash as naming them, in that order.
    assert prepared_hash(root, vocab_dir, 64) == prepared_hash(resolve_paths(root), vocab_dir, 64)


def test_jsonl_with_another_text_key(documents, vocab_dir, reference, tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text(
        "".join(json.dumps({"id": i, "body": "\n".join(p)}) + "\n" for i, p in enumerate(documents)), encoding="utf-8"
    )
    out = prepare(path, vocab_dir, out_dir=tmp_path / "p", columns=Columns(text="body"), **SETTINGS)
    assert_same_instances(out, reference)
    with pytest.raises(UserError, match="line 1 has no string 'text' field .*--text-column"):
        prepare(path, vocab_dir, out_dir=tmp_path / "q", **SETTINGS)


def test_parquet_of_paragraphs_with_a_document_id_column(documents, vocab_dir, reference, tmp_path):
    path = tmp_path / "corpus.parquet"
    datasets.Dataset.from_dict(paragraph_rows(documents)).to_parquet(str(path))
    out = prepare(path, vocab_dir, out_dir=tmp_path / "p", columns=Columns(text="body", doc_id="doc"), **SETTINGS)
    assert_same_instances(out, reference)


def test_arrow_file_and_save_to_disk_folder_of_documents(documents, vocab_dir, reference, tmp_path):
    table = datasets.Dataset.from_dict({"text": ["\n".join(p) for p in documents]})
    table.save_to_disk(str(tmp_path / "saved"))
    assert_same_instances(prepare(tmp_path / "saved", vocab_dir, out_dir=tmp_path / "p1", **SETTINGS), reference)
    arrow = tmp_path / "corpus.arrow"
    arrow.write_bytes(next((tmp_path / "saved").glob("*.arrow")).read_bytes())
    assert_same_instances(prepare(arrow, vocab_dir, out_dir=tmp_path / "p2", **SETTINGS), reference)


def test_a_saved_dataset_inside_a_corpus_folder_is_read_as_one_table(documents, vocab_dir, reference, tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "1-first.txt").write_text(plain_text(documents[:30]), encoding="utf-8")
    datasets.Dataset.from_dict({"text": ["\n".join(p) for p in documents[30:]]}).save_to_disk(str(root / "2-rest"))
    assert [p.name for p in resolve_paths(root)] == ["1-first.txt", "2-rest"]
    assert_same_instances(prepare(root, vocab_dir, out_dir=tmp_path / "p", **SETTINGS), reference)


def test_columns_enter_the_hash_only_when_not_the_default(vocab_dir, tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "One. Two.", "body": "One. Two."}\n', encoding="utf-8")
    default = prepared_hash(path, vocab_dir, 64)
    assert prepared_hash(path, vocab_dir, 64, columns=Columns()) == default
    assert prepared_hash(path, vocab_dir, 64, columns=Columns(text="body")) != default
    assert prepared_hash(path, vocab_dir, 64, columns=Columns(doc_id="id")) != default


def test_the_bundled_sample_keeps_its_prepared_hashes():
    # The hashes the bundled sample had before folders, tables and columns existed: studies key their runs
    # by them (studies/adm-study-*). A change here reruns or refuses every finished run.
    assert dataset_hashes(DataConfig()) == {"train": "45aa3bd7c57ff7c8", "valid": "ac7ae8e507108116"}
    assert dataset_hashes(DataConfig(objective="mlm", max_seq_length=64)) == {
        "train": "0ffd6be365cffebb",
        "valid": "a2d0553439da607f",
    }


def test_table_errors_are_one_line(documents, tmp_path, capsys):
    path = tmp_path / "corpus.parquet"
    datasets.Dataset.from_dict(paragraph_rows(documents)).to_parquet(str(path))
    with pytest.raises(UserError, match=r"has no column 'text' \(its columns: doc, body\); .*--text-column"):
        list(read_paragraph_documents(path))
    with pytest.raises(UserError, match=r"has no column 'nope' .*--id-column"):
        list(read_paragraph_documents(path, Columns(text="body", doc_id="nope")))
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["A. B."]}),
            "test": datasets.Dataset.from_dict({"text": ["C. D."]}),
        }
    )
    splits.save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(UserError, match="DatasetDict with splits train, test; give one split's folder"):
        list(read_paragraph_documents(tmp_path / "splits"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "empty").mkdir()
    for argv in (
        ["prepare", "--corpus", str(tmp_path / "broken.parquet"), "--tokenizer", "x"],
        ["prepare", "--corpus", str(tmp_path / "empty"), "--tokenizer", "x"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("mlmlab: error: ") and err.count("\n") == 1, err
    (tmp_path / "empty" / "README.md").write_text("A folder of notes.\n", encoding="utf-8")
    with pytest.raises(UserError, match="holds no corpus files"):
        resolve_paths(tmp_path / "empty")


def test_prepare_command_reads_a_parquet_file_with_column_options(documents, vocab_dir, tmp_path, capsys):
    path = tmp_path / "corpus.parquet"
    datasets.Dataset.from_dict(paragraph_rows(documents)).to_parquet(str(path))
    assert (
        main(
            [
                "prepare",
                "--corpus",
                str(path),
                "--tokenizer",
                str(vocab_dir),
                "--max-seq-length",
                "64",
                "--workers",
                "1",
                "--text-column",
                "body",
                "--id-column",
                "doc",
                "--out",
                str(tmp_path / "p"),
            ]
        )
        == 0
    )
    assert "instances in" in capsys.readouterr().out
    meta = TokenStore(tmp_path / "p").meta
    assert meta["columns"] == {"text": "body", "doc_id": "doc"}
    assert meta["num_documents"] == NUM_DOCS


# ---------------------------------------------------------------- tokenizers


def byte_level_bpe_folder(folder: Path, corpus: Path, *, fast: bool) -> Path:
    """A RoBERTa-style tokenizer folder: tokenizer.json (fast) or only vocab.json + merges.txt (slow files)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train(
        [str(corpus)], vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], show_progress=False
    )
    folder.mkdir(parents=True)
    if fast:
        RobertaTokenizerFast(tokenizer_object=bpe._tokenizer).save_pretrained(str(folder))
    else:
        bpe.save_model(str(folder))  # vocab.json + merges.txt
    return folder


@pytest.mark.parametrize("fast", [True, False], ids=["tokenizer.json", "vocab.json+merges.txt"])
def test_a_byte_level_bpe_tokenizer_folder_is_adopted(documents, tmp_path, capsys, fast):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(plain_text(documents[:5]), encoding="utf-8")
    folder = byte_level_bpe_folder(tmp_path / "roberta", corpus, fast=fast)
    assert (
        main(
            [
                "prepare",
                "--corpus",
                str(corpus),
                "--tokenizer",
                str(folder),
                "--out",
                str(tmp_path / "p"),
                "--objective",
                "mlm",
            ]
        )
        == 0
    )
    store = TokenStore(tmp_path / "p")
    assert store[0]["input_ids"][0] == 0 and store.meta["special_token_ids"]["<mask>"] == 4  # RoBERTa's <s>, <mask>
    capsys.readouterr()
