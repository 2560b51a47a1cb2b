"""RoBERTa beside BERT and ModernBERT: transformers' own RobertaForMaskedLM through the same sparse loss (eager and
fused head), fused Q/K/V, its positions past the padding id, refusals, its presets, continuing released folders.
What every architecture does (masking variants, exact resume, export, --init from its own folder) is
test_conformance.py's.

A one-layer H32 RoBERTa keeps each test to seconds.
"""

import json

import pytest
import torch
from conftest import QUICK_RUN, one_line_error, tiny_encoder
from safetensors.torch import load_file
from transformers import AutoModelForMaskedLM, RobertaForMaskedLM, pipeline

from mlmlab import choices
from mlmlab.cli import main
from mlmlab.config import ModelConfig, load_config
from mlmlab.model.fused_qkv import fuse_qkv
from mlmlab.model.pretraining import IGNORE_INDEX, SparsePretraining, build_model, pretraining_loss

ROBERTA = ["model.architecture=roberta", "data.objective=mlm"]

pytestmark = pytest.mark.usefixtures("no_progress_bars")


def small_roberta(pad_token_id: int = 1, **fields) -> RobertaForMaskedLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        **{
            "architecture": choices.ROBERTA,
            "hidden_size": 32,
            "num_layers": 1,
            "num_heads": 2,
            "intermediate_size": 64,
            "max_position_embeddings": 24,
            "pad_vocab_multiple": 1,
            **fields,
        }
    )
    return build_model(cfg, vocab_size=100, pad_token_id=pad_token_id)


# ----- the model -----------------------------------------------------------------------------
def test_positions_start_past_the_padding_id_as_the_released_roberta():
    model = small_roberta(pad_token_id=1)
    assert model.config.max_position_embeddings == 24 + 2  # roberta-base: 514 rows for 512 tokens
    assert model.config.type_vocab_size == 1 and model.roberta.pooler is None
    ids = torch.randint(5, 100, (1, 24))  # the longest sequence the model takes runs without an index error
    assert model(input_ids=ids).logits.shape == (1, 24, 100)


@pytest.mark.parametrize("fused", [False, True], ids=["eager-head", "fused-head"])
def test_the_sparse_loss_is_the_librarys_own_loss_on_the_selected_positions(fused):
    model = small_roberta().eval()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 100, (3, 20), generator=generator)  # (B, T)
    attention = torch.ones_like(ids)
    ids[2, 14:], attention[2, 14:] = 1, 0  # a padded row (pad id 1)
    selected = (torch.rand(ids.shape, generator=generator) < 0.3) & attention.bool()  # (B, T)
    labels = torch.where(selected, torch.randint(5, 100, ids.shape, generator=generator), IGNORE_INDEX)
    batch = dict(input_ids=ids, attention_mask=attention, token_type_ids=torch.zeros_like(ids), labels=labels)
    theirs = model(input_ids=ids, attention_mask=attention, labels=labels)  # the full head over every position
    if fused:  # the fused head runs in training mode; no dropout here
        model.train()
    ours = SparsePretraining(model, use_nsp=True, fused_head=fused)(**batch)  # no NSP head: use_nsp is moot
    assert int(ours["mlm_count"]) == int(selected.sum()) > 0 and "nsp_loss" not in ours
    assert ours["mlm_loss"].item() == pytest.approx(theirs.loss.item(), rel=1e-5)


def test_fused_qkv_computes_the_same_loss():
    model = small_roberta().eval()
    ids = torch.randint(5, 100, (2, 12))
    batch = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        token_type_ids=torch.zeros_like(ids),
        labels=torch.where(torch.rand(ids.shape) < 0.5, ids, IGNORE_INDEX),
    )
    before = pretraining_loss(model, batch)["mlm_loss"]
    assert fuse_qkv(model) == 1
    assert pretraining_loss(model, batch)["mlm_loss"].item() == pytest.approx(before.item(), rel=1e-6)


# ----- refusals ------------------------------------------------------------------------------
def test_nsp_with_roberta_is_refused_in_one_line(capsys):
    err = one_line_error(["pretrain", "--no-progress", "model.architecture=roberta"], capsys)
    assert "NSP head" in err and "RoBERTa" in err and "data.objective=mlm" in err


def test_modernbert_settings_with_roberta_are_refused_in_one_line(capsys):
    err = one_line_error(["pretrain", "--no-progress", *ROBERTA, "model.rope_theta_local=500"], capsys)
    assert "model.rope_theta_local" in err and "model.architecture=modernbert" in err


# ----- presets -------------------------------------------------------------------------------
def test_roberta_base_with_robertas_vocabulary_has_the_released_models_parameters():
    from transformers import RobertaConfig

    cfg = load_config("roberta-base", ["model.pad_vocab_multiple=1"])
    assert (cfg.model.architecture, cfg.data.objective, cfg.data.max_seq_length) == (choices.ROBERTA, choices.MLM, 512)
    with torch.device("meta"):
        ours = build_model(cfg.model, vocab_size=50265, pad_token_id=1)  # GPT-2's BPE as RoBERTa numbers it
        released = RobertaForMaskedLM(
            RobertaConfig(max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5)
        )
    assert ours.config.max_position_embeddings == 514
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in released.parameters()) and round(count / 1e6, 1) == 124.7


def test_pretrain_roberta_tiny_gives_a_roberta_folder_with_its_bpe_tokenizer(tmp_path, capsys):
    run = tmp_path / "run"
    assert (
        main(
            [
                "pretrain",
                "--no-progress",
                "--config",
                "roberta-tiny",
                "train.max_steps=3",
                "train.warmup_steps=1",
                "train.eval_every=0",
                f"train.out_dir={run}",
            ]
        )
        == 0
    )  # the bundled sample, the bundled BPE
    said = capsys.readouterr().out
    assert "is <mask>." in said  # the fill-mask line it prints names the tokenizer's own mask token
    folder = run / "model"
    assert isinstance(AutoModelForMaskedLM.from_pretrained(folder), RobertaForMaskedLM)
    fill = pipeline("fill-mask", model=str(folder))
    assert json.loads(fill.tokenizer.backend_tokenizer.to_str())["model"]["type"] == "BPE"
    assert fill.tokenizer.mask_token == "<mask>" and len(fill.tokenizer) == 8192
    predictions = fill("The capital of France is <mask>.")
    assert len(predictions) == 5 and all("<mask>" not in p["sequence"] for p in predictions)
    card = (folder / "README.md").read_text()
    assert "Byte-level BPE, 8,192 tokens" in card and "The capital of France is <mask>." in card


# ----- continuing a released encoder (--init) -------------------------------------------------
@pytest.fixture(scope="module")
def bpe_tokenizer(trained_tokenizers):
    from mlmlab.data.tokenizer import load_tokenizer

    return load_tokenizer(trained_tokenizers[choices.BPE])


def released_folder(folder, model, tokenizer, extra: dict | None = None):
    """What a downloaded folder is: transformers' save_pretrained of the model and its tokenizer."""
    from safetensors.torch import save_file

    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if extra:  # weights a released file holds beyond the class's (roberta-base's pooler)
        weights = {name: tensor.contiguous() for name, tensor in load_file(folder / "model.safetensors").items()}
        save_file({**weights, **extra}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _released(kind: str, tokenizer):
    from transformers import ModernBertConfig, ModernBertForMaskedLM, RobertaConfig

    torch.manual_seed(0)
    shape = tiny_encoder(tokenizer)
    if kind == choices.ROBERTA:  # as roberta-base's config.json: 2 + 128 position rows, one token type
        config = RobertaConfig(**shape, max_position_embeddings=130, type_vocab_size=1, layer_norm_eps=1e-5)
        return RobertaForMaskedLM(config), {"roberta.pooler.dense.weight": torch.ones(32, 32)}
    return ModernBertForMaskedLM(ModernBertConfig(**shape, max_position_embeddings=128)), None


@pytest.mark.parametrize("kind", [choices.ROBERTA, choices.MODERNBERT])
def test_init_continues_a_released_folder_with_the_tokenizer_it_brings(kind, bpe_tokenizer, tmp_path, capsys):
    model, extra = _released(kind, bpe_tokenizer)
    source = released_folder(tmp_path / "released", model, bpe_tokenizer, extra)
    run = tmp_path / "run"
    assert (
        main(
            [
                "pretrain",
                "--no-progress",
                *QUICK_RUN,
                "data.objective=mlm",
                "--init",
                str(source),
                f"train.out_dir={run}",
                "train.max_steps=2",
                "train.warmup_steps=0",
            ]
        )
        == 0
    )
    said = capsys.readouterr()
    assert "starting from the weights of" in said.out + said.err
    exported = AutoModelForMaskedLM.from_pretrained(run / "model")
    assert exported.config.model_type == kind and exported.config.hidden_size == 32
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(run / "model").get_vocab() == bpe_tokenizer.get_vocab()
    trained, started = exported.state_dict(), model.state_dict()
    moved = [name for name in started if name in trained and not torch.equal(trained[name], started[name])]
    assert moved  # trained on from the released weights ...
    embeddings = {
        choices.ROBERTA: "roberta.embeddings.position_embeddings.weight",
        choices.MODERNBERT: "model.embeddings.tok_embeddings.weight",
    }[kind]
    assert trained[embeddings].shape == started[embeddings].shape  # ... into the same shapes


def test_init_of_an_unsupported_architecture_is_refused_listing_the_supported(bpe_tokenizer, tmp_path, capsys):
    from transformers import ElectraConfig, ElectraForMaskedLM

    model = ElectraForMaskedLM(
        ElectraConfig(
            vocab_size=len(bpe_tokenizer),
            hidden_size=32,
            embedding_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
        )
    )
    source = released_folder(tmp_path / "electra", model, bpe_tokenizer)
    err = one_line_error(
        [
            "pretrain",
            "--no-progress",
            *QUICK_RUN,
            "data.objective=mlm",
            "--init",
            str(source),
            f"train.out_dir={tmp_path / 'run'}",
        ],
        capsys,
    )
    assert "model_type='electra'" in err and choices.listed(repr(name) for name in choices.ARCHITECTURES) in err


def test_init_whose_tokenizer_pads_with_another_id_than_its_weights_is_refused(bpe_tokenizer, tmp_path, capsys):
    model, _ = _released(choices.ROBERTA, bpe_tokenizer)
    model.config.pad_token_id = 0  # <s>: the position rows count from another id than the tokenizer pads with
    source = released_folder(tmp_path / "released", model, bpe_tokenizer)
    err = one_line_error(
        [
            "pretrain",
            "--no-progress",
            *QUICK_RUN,
            "data.objective=mlm",
            "--init",
            str(source),
            f"train.out_dir={tmp_path / 'run'}",
        ],
        capsys,
    )
    assert "pad_token_id=0" in err and "disagree" in err
