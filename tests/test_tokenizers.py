"""Tokenizers of every kind (WordPiece, byte-level BPE, Unigram): trained with the tokenizers library, loaded with
AutoTokenizer, their own special tokens and word boundaries used by masking, packing and pairs; adopted folders.

The tokenizers are conftest's trained_tokenizers: trained once per session on the bundled validation sample (2,000
tokens: a second each). Every architecture trains with each kind in test_conformance.py.
"""

import json
import shutil

import pytest
import torch
from conftest import CORPUS
from transformers import AutoTokenizer, RobertaTokenizerFast

from mlmlab import choices
from mlmlab.cli import main
from mlmlab.data.build import prepare
from mlmlab.data.loader import collate
from mlmlab.data.resolve import tokenizer_dir_for
from mlmlab.data.store import TokenStore
from mlmlab.data.tokenizer import load_tokenizer, ordinary_token_ids
from mlmlab.errors import UserError
from mlmlab.masking.select import Corruption, continuation_table, mask_batch, token_info_for, word_starts
from mlmlab.model.pretraining import IGNORE_INDEX

NAMES = {
    choices.WORDPIECE: ("[CLS]", "[SEP]", "[PAD]", "[MASK]"),
    choices.BPE: ("<s>", "</s>", "<pad>", "<mask>"),
    choices.UNIGRAM: ("<s>", "</s>", "<pad>", "<mask>"),
}

pytestmark = pytest.mark.usefixtures("no_progress_bars")


# ----- what each kind is -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", choices.TOKENIZER_KINDS)
def test_each_kind_loads_with_autotokenizer_and_its_own_special_tokens(trained_tokenizers, kind):
    folder = trained_tokenizers[kind]
    ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert len(auto) == len(ours) == 2000
    model_type = json.loads((folder / "tokenizer.json").read_text())["model"]["type"]
    assert model_type == {choices.WORDPIECE: "WordPiece", choices.BPE: "BPE", choices.UNIGRAM: "Unigram"}[kind]
    cls, sep, pad, mask = NAMES[kind]
    assert (auto.cls_token, auto.sep_token, auto.pad_token, auto.mask_token) == (cls, sep, pad, mask)
    encoded = auto("The cat sat.", "It purred.")["input_ids"]
    assert encoded[0] == auto.cls_token_id and encoded[-1] == auto.sep_token_id
    info = token_info_for(auto)
    assert set(info.special_ids) == set(auto.all_special_ids) and info.mask_id == auto.mask_token_id
    ordinary = set(ordinary_token_ids(auto).tolist())
    assert not ordinary & set(auto.all_special_ids) and len(ordinary) == 2000 - len(set(auto.all_special_ids))
    if kind == choices.BPE:  # RoBERTa's slow files too, and a word is the same with or without a space before it
        assert (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
        assert auto.tokenize("Paris") == auto.tokenize(" Paris") and auto.tokenize("Paris")[0].startswith("Ġ")


@pytest.mark.parametrize("kind", choices.TOKENIZER_KINDS)
def test_random_replacements_and_selection_avoid_the_tokenizers_special_ids(trained_tokenizers, kind):
    tokenizer = load_tokenizer(trained_tokenizers[kind])
    info = token_info_for(tokenizer)
    texts = ["The quick brown fox jumps over the lazy dog near the river bank today."] * 64
    ids = [tokenizer(text)["input_ids"] for text in texts]
    batch = collate(
        [{"input_ids": row, "token_type_ids": [0] * len(row), "next_sentence_label": 0} for row in ids],
        list(range(len(ids))),
        tokenizer.pad_token_id,
    )
    out = mask_batch(batch, seed=0, epoch_key=0, rate=0.5, info=info, corruption=Corruption(0.0, 1.0))  # all random
    selected = out["labels"] != IGNORE_INDEX
    assert selected.any() and not torch.isin(batch["input_ids"][selected], torch.tensor(info.special_ids)).any()
    assert not torch.isin(out["input_ids"][selected], torch.tensor(info.special_ids)).any()  # only ordinary ids
    assert torch.equal(out["input_ids"][~selected], batch["input_ids"][~selected])


# ----- whole words -----------------------------------------------------------------------------
def reference_word_starts(encoding, text: str, kind: str) -> list[bool]:
    """Per token, from the fast tokenizer's word_ids(): the first token of a word, where a word is the pre-tokenizer's
    (WordPiece: punctuation is a word) or, for byte-level BPE and Unigram, a whitespace-separated one."""
    # Byte-level BPE's "Ġ" is the byte of " ": another space (U+00A0) is a piece of its own, as in GPT-2 and RoBERTa
    # (Unigram's NFKC turns it into " " first)
    space = (lambda char: char == " ") if kind == choices.BPE else str.isspace
    starts, previous = [], None
    for word, (begin, _) in zip(encoding.word_ids(), encoding["offset_mapping"]):
        first = word is not None and word != previous
        if first and kind != choices.WORDPIECE:  # the pre-tokenizer splits "don't", "x2", "end." inside a word
            first = begin == 0 or space(text[begin - 1]) or space(text[begin])
        starts.append(first)
        previous = word
    return starts


@pytest.mark.parametrize("kind", choices.TOKENIZER_KINDS)
def test_the_begins_a_word_table_agrees_with_word_ids_on_real_text(trained_tokenizers, kind, sample_paragraphs):
    tokenizer = load_tokenizer(trained_tokenizers[kind])
    table = continuation_table(tokenizer)  # from the tokenizer's own convention: "##", "Ġ", "▁"
    info = token_info_for(tokenizer)
    checked = 0
    for text in sample_paragraphs[:200]:
        encoding = tokenizer(text, return_offsets_mapping=True)
        ids = torch.tensor([encoding["input_ids"]])  # (1, T)
        eligible = ~torch.isin(ids, torch.tensor(info.special_ids))
        ours = word_starts(eligible, table[ids])[0]
        expected = torch.tensor(reference_word_starts(encoding, text, kind))
        # as word_starts documents: after a token never selected (Unigram's <unk> inside a word) a new word begins
        expected[1:] |= ~eligible[0, :-1]
        expected &= eligible[0]
        assert torch.equal(ours, expected), [
            (t, o, e) for t, o, e in zip(encoding.tokens(), ours.tolist(), expected.tolist()) if o != e
        ][:5]
        checked += int(eligible.sum())
    assert checked > 20000 and 0 < int(table.sum()) < len(table)


# ----- adopted folders and refusals --------------------------------------------------------
def test_a_folder_of_robertas_slow_files_is_adopted(trained_tokenizers, tmp_path):
    slow = tmp_path / "slow"
    slow.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(trained_tokenizers[choices.BPE] / name, slow / name)
    adopted = load_tokenizer(tokenizer_dir_for(str(slow)))
    original = load_tokenizer(trained_tokenizers[choices.BPE])
    assert adopted.get_vocab() == original.get_vocab() and adopted.mask_token == "<mask>"
    text = "Whole words and pieces, measured."
    assert adopted(text)["input_ids"][1:] == RobertaTokenizerFast.from_pretrained(slow)(text)["input_ids"][1:]
    (slow / "merges.txt").unlink()
    with pytest.raises(UserError, match="no merges.txt"):
        tokenizer_dir_for(str(slow))


def _without(folder, tmp_path, **changes):
    """A copy of a tokenizer folder whose tokenizer_config.json changes (None: the entry removed)."""
    copy = tmp_path / "changed"
    shutil.copytree(folder, copy)
    settings = json.loads((copy / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        settings.pop(key) if value is None else settings.update({key: value})
    (copy / "tokenizer_config.json").write_text(json.dumps(settings))
    return copy


def test_a_tokenizer_without_a_mask_token_is_refused_in_one_line(trained_tokenizers, tmp_path, capsys):
    folder = _without(trained_tokenizers[choices.UNIGRAM], tmp_path, mask_token=None)
    assert main(["pretrain", "--no-progress", f"data.tokenizer={folder}", f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no mask token" in err, err


def test_special_tokens_that_collide_are_refused(trained_tokenizers, tmp_path):
    folder = _without(trained_tokenizers[choices.BPE], tmp_path, mask_token="<pad>")
    with pytest.raises(UserError, match="as both its pad_token and its mask_token"):
        load_tokenizer(folder)


def test_packing_separates_documents_with_the_tokenizers_own_separator(trained_tokenizers, tmp_path):
    store = TokenStore(
        prepare(
            [CORPUS],
            tokenizer_dir=trained_tokenizers[choices.BPE],
            max_seq_length=64,
            objective=choices.MLM,
            out_dir=tmp_path / "packed",
        )
    )
    tokenizer = load_tokenizer(trained_tokenizers[choices.BPE])
    assert store.meta["pad_token_id"] == tokenizer.pad_token_id
    assert store.meta["special_token_ids"]["<mask>"] == tokenizer.mask_token_id
    inside = {int(i) for index in range(len(store)) for i in store[index]["input_ids"][1:-1]}
    assert tokenizer.sep_token_id in inside and tokenizer.cls_token_id not in inside
