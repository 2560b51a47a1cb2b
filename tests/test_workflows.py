"""What BERT pretrainers do every day: start from a model, BERT's two phases, export, read the result.

One small source run (a tiny model, 30 steps at length 64 with 128 positions: BERT's phase 1
in miniature) serves every test: starting from its weights (its own folder, a
BertForMaskedLM copy, legacy LayerNorm names), phase 2 at length 128, its model card,
and exporting its checkpoints. Fill-mask and the Auto classes on every architecture's folder: test_conformance.py.
"""

import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from conftest import QUICK_RUN, SAMPLE, TINY_MODEL, tiny_encoder
from safetensors.torch import load_file, save_file

from mlmlab import choices
from mlmlab.cli import main
from mlmlab.config import config_text, load_config
from mlmlab.evaluate.perplexity import evaluate_mlm
from mlmlab.train import run_folder
from mlmlab.train.loop import Trainer

COMMON = [*QUICK_RUN, "train.eval_batches=4"]  # no model.* key: a run that starts from a folder takes its model
PHASE_1 = [
    *TINY_MODEL,
    *COMMON,
    "model.max_position_embeddings=128",
    "train.max_steps=30",
    "train.lr=3e-3",
    "train.save_every=10",
    "train.keep_last=0",
]


pytestmark = pytest.mark.usefixtures("no_progress_bars")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Phase 1 in miniature: its run folder and final summary."""
    run = tmp_path_factory.mktemp("source") / "run"
    summary = Trainer(
        load_config(None, [*PHASE_1, f"train.out_dir={run}"]), evaluator=evaluate_mlm, show_progress=False
    ).train()
    return run, summary


def trainer_from(model_dir, out_dir, *overrides) -> Trainer:
    """A run that starts from ``model_dir``, on the source's data and evaluation settings, not trained yet."""
    config = load_config(None, [*COMMON, f"train.init={model_dir}", f"train.out_dir={out_dir}", *overrides])
    return Trainer(config, evaluator=evaluate_mlm, show_progress=False)


def assert_same_evaluation(got: dict, expected: dict, keys=("mlm_loss", "mlm_accuracy", "nsp_accuracy")) -> None:
    for key in keys:
        assert got[key] == pytest.approx(expected[key], abs=1e-4), key


# ----- --init --------------------------------------------------------------------------------
def test_init_starts_where_the_source_ended(source, tmp_path, capsys):
    run, summary = source
    trainer = trainer_from(run / "model", tmp_path / "init")  # no model.* keys: taken from the checkpoint
    assert "starting from the weights of" in capsys.readouterr().err
    start = trainer.evaluate(4)
    fresh = Trainer(
        load_config(None, [*PHASE_1, f"train.out_dir={tmp_path / 'fresh'}"]),
        evaluator=evaluate_mlm,
        show_progress=False,
    ).evaluate(4)
    print(
        f"mlm loss: source's final {summary['eval']['mlm_loss']:.6f}, init's step 0 {start['mlm_loss']:.6f}, "
        f"fresh {fresh['mlm_loss']:.6f}"
    )
    assert_same_evaluation(start, summary["eval"])
    assert fresh["mlm_loss"] > start["mlm_loss"] + 1.0  # far below a fresh model's (measured: 8.14 vs 10.33)
    assert trainer.state.step == 0 and not trainer.optimizer.state  # weights only: optimizer and step fresh
    recorded = load_config(str(tmp_path / "init" / "config.yaml"))
    assert recorded.train.init == str(run / "model") and recorded.model.hidden_size == 32
    assert recorded.model.max_position_embeddings == 128 and recorded.model.num_layers == 1


def masked_lm_copy(run: Path, folder: Path, legacy_names: bool = False) -> Path:
    """The source as a HuggingFace BertForMaskedLM folder (no pooler, no NSP head), optionally with the
    LayerNorm gamma/beta names and position_ids buffer of checkpoints converted from google-research/bert."""
    from transformers import AutoModelForMaskedLM

    AutoModelForMaskedLM.from_pretrained(run / "model").save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(run / "model" / name, folder / name)
    if legacy_names:
        weights = load_file(folder / "model.safetensors")
        renamed = {
            name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): value
            for name, value in weights.items()
        }
        renamed["bert.embeddings.position_ids"] = torch.arange(128)[None]
        save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("legacy_names", [False, True], ids=["BertForMaskedLM", "legacy gamma-beta names"])
def test_init_from_a_masked_lm_folder_leaves_pooler_and_nsp_head_fresh(source, tmp_path, capsys, legacy_names):
    run, summary = source
    folder = masked_lm_copy(run, tmp_path / "mlm", legacy_names)
    trainer = trainer_from(folder, tmp_path / "init")
    assert "it has no pooler and no NSP head: they start fresh" in capsys.readouterr().err
    start = trainer.evaluate(4)
    assert_same_evaluation(start, summary["eval"], keys=("mlm_loss", "mlm_accuracy"))
    source_weights = load_file(run / "model" / "model.safetensors")
    ours = trainer.model.state_dict()
    assert torch.equal(ours["bert.embeddings.LayerNorm.weight"], source_weights["bert.embeddings.LayerNorm.weight"])
    assert not torch.equal(ours["cls.seq_relationship.weight"], source_weights["cls.seq_relationship.weight"])


def model_variant(run: Path, folder: Path, change) -> Path:
    shutil.copytree(run / "model", folder)
    change(folder)
    return folder


def edit_config(**entries):
    def change(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **entries}))

    return change


def renumbered_tokenizer(tmp: Path) -> Path:
    vocab = (SAMPLE / "vocab.txt").read_text().splitlines()
    vocab[2000], vocab[2001] = vocab[2001], vocab[2000]
    (tmp / "renumbered.txt").write_text("\n".join(vocab) + "\n")
    return tmp / "renumbered.txt"


def pickled_only(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")


REFUSALS = [
    (
        "positions beyond the checkpoint's",
        lambda run, t: ["--init", str(run / "model"), "data.max_seq_length=256"],
        ("data.max_seq_length=256 packs sequences of 256 tokens", "takes at most 128", "data.max_seq_length to 128"),
    ),
    (
        "another architecture set explicitly",
        lambda run, t: ["--init", str(run / "model"), "model.hidden_size=64"],
        ("hidden_size=32", "model.hidden_size=64"),
    ),
    (
        "another vocabulary of the same size",
        lambda run, t: ["--init", str(run / "model"), f"data.tokenizer={renumbered_tokenizer(t)}"],
        ("another vocabulary", "leave data.tokenizer empty"),
    ),
    (
        "weights only as pytorch_model.bin",
        lambda run, t: ["--init", str(model_variant(run, t / "m", pickled_only))],
        ("pytorch_model.bin", "never unpickles"),
    ),
    (
        "a DeBERTa checkpoint",
        lambda run, t: ["--init", str(model_variant(run, t / "m", edit_config(model_type="deberta")))],
        ("model_type='deberta'", choices.listed(repr(name) for name in choices.ARCHITECTURES)),
    ),
    (
        "untied output embeddings",
        lambda run, t: ["--init", str(model_variant(run, t / "m", edit_config(tie_word_embeddings=False)))],
        ("tie_word_embeddings=False",),
    ),
    ("no such folder", lambda run, t: ["--init", str(t / "nowhere")], ("no such folder",)),
    (
        "--resume with a model folder",
        lambda run, t: ["--resume", str(run / "model")],
        ("is a model folder, not a checkpoint", "--init"),
    ),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[case[0] for case in REFUSALS])
def test_init_refusals_are_one_line(source, tmp_path, capsys, case):
    _, argv, words = case
    run, _ = source
    code = main(
        [
            "pretrain",
            "--no-progress",
            *COMMON,
            "train.max_steps=2",
            f"train.out_dir={tmp_path / 'run'}",
            *argv(run, tmp_path),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("mlmlab: error: ") and err.count("\n") == 1, err
    assert all(word in err for word in words), err
    assert not run_folder.complete_checkpoints(tmp_path / "run", check=False)


# ----- --init of a base-model folder (the encoder alone) ----------------------------------------------
def base_model_folder(folder: Path, kind: str, tokenizer) -> tuple[Path, torch.nn.Module]:
    """A folder as save_pretrained writes a base model (a sentence encoder's BertModel): weights named without the
    ``bert.``-style prefix, no MLM head; with its tokenizer."""
    from transformers import (
        BertConfig,
        BertModel,
        ModernBertConfig,
        ModernBertModel,
        RobertaConfig,
        RobertaModel,
        XLMRobertaConfig,
        XLMRobertaModel,
    )

    torch.manual_seed(0)
    shape = tiny_encoder(tokenizer)
    roberta = dict(max_position_embeddings=130, type_vocab_size=1, layer_norm_eps=1e-5)  # as roberta-base's
    model = {
        choices.BERT: lambda: BertModel(BertConfig(**shape)),
        choices.ROBERTA: lambda: RobertaModel(RobertaConfig(**shape, **roberta)),
        choices.XLM_ROBERTA: lambda: XLMRobertaModel(XLMRobertaConfig(**shape, **roberta)),
        choices.MODERNBERT: lambda: ModernBertModel(ModernBertConfig(**shape, max_position_embeddings=128)),
    }[kind]()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model.eval()


@pytest.mark.parametrize("kind", [choices.BERT, choices.ROBERTA, choices.XLM_ROBERTA, choices.MODERNBERT])
def test_init_from_a_base_model_folder_keeps_its_encoder_and_starts_the_head_fresh(kind, bert_tokenizer, tmp_path):
    from mlmlab.data.tokenizer import load_tokenizer
    from mlmlab.train.init import initial_model, resolve_init

    tokenizer = bert_tokenizer if kind == choices.BERT else load_tokenizer(SAMPLE / "bpe-8k")
    folder, source = base_model_folder(tmp_path / "base", kind, tokenizer)
    said = []
    cfg = resolve_init(load_config(None, [f"train.init={folder}", "data.objective=mlm", "data.max_seq_length=64"]))
    model = initial_model(cfg, tokenizer, resuming=False, log=said.append).eval()
    assert len(said) == 1 and "it holds the encoder alone" in said[0], said
    assert "the MLM head" in said[0] and "start fresh, the decoder tied to the input embeddings" in said[0]
    ids = torch.tensor([tokenizer("The capital of France is Paris.")["input_ids"]])
    with torch.no_grad():
        ours = getattr(model, model.base_model_prefix)(input_ids=ids).last_hidden_state
        theirs = source(input_ids=ids).last_hidden_state
    assert torch.equal(ours, theirs)  # step 0: the source's encoder, weight for weight
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_a_bert_model_folder_trains_and_exports_a_masked_lm_with_its_encoder_and_vocabulary(
    bert_tokenizer, tmp_path, capsys
):
    """What sentence-transformers saves (all-MiniLM-L6-v2 is a BertModel folder) continues as a masked LM."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    folder, source = base_model_folder(tmp_path / "encoder", choices.BERT, bert_tokenizer)
    run, lr = tmp_path / "run", 1e-3
    argv = ["pretrain", "--no-progress", "--init", str(folder), *COMMON, "data.objective=mlm", f"train.lr={lr}"]
    assert main([*argv, "train.max_steps=2", f"train.out_dir={run}"]) == 0
    said = capsys.readouterr()
    assert "it holds the encoder alone (BertModel): the MLM head and the NSP head start fresh" in said.err
    exported = AutoModelForMaskedLM.from_pretrained(run / "model")
    assert AutoTokenizer.from_pretrained(run / "model").get_vocab() == bert_tokenizer.get_vocab()
    started, trained = source.state_dict(), exported.bert.state_dict()
    shared = [name for name in started if name in trained]
    assert len(shared) >= len(started) - 2  # all but the pooler, which a masked LM has not
    drift = max((trained[name] - started[name]).abs().max().item() for name in shared)
    assert 0 < drift <= 3 * lr  # two AdamW steps of at most ~lr each from the source's weights, not fresh ones


# ----- BERT's two phases ---------------------------------------------------------------------------
def test_phase_2_continues_at_length_128_with_its_own_cosine_schedule(source, tmp_path, capsys):
    run, _ = source
    out = tmp_path / "phase2"
    assert (
        main(
            [
                "pretrain",
                "--no-progress",
                "--init",
                str(run / "model"),
                *COMMON,
                "data.max_seq_length=128",
                "train.max_steps=6",
                "train.warmup_steps=2",
                "train.lr_schedule=cosine",
                "train.decay_fraction=1.0",
                f"train.out_dir={out}",
                "--json",
                str(tmp_path / "summary.json"),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 6
    lrs = [line["lr"] for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "lr" in line]
    assert len(lrs) == 6 and lrs[1] == pytest.approx(1e-3)  # its own warmup from step 0, then the cosine
    assert lrs[3] == pytest.approx(1e-3 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * 1 / 4)).item()))
    config = load_config(str(out / "config.yaml"))
    assert config.data.max_seq_length == 128 and config.model.max_position_embeddings == 128
    assert max(len(ids) for ids in _instances(out)) > 64  # the longer sequences are really trained on
    # The text summary: where the model is, the figures, and the next commands.
    assert f"model: {out}/model" in text and "held-out: perplexity" in text and "NSP accuracy" in text
    assert f"mlmlab evaluate --model {out}/model --data" in text and "pipeline('fill-mask'" in text
    # --json alone: the summary as JSON on stdout (a rerun of the finished run trains no further step).
    assert (
        main(
            [
                "pretrain",
                "--no-progress",
                "--init",
                str(run / "model"),
                *COMMON,
                "data.max_seq_length=128",
                "train.max_steps=6",
                "train.warmup_steps=2",
                "train.lr_schedule=cosine",
                "train.decay_fraction=1.0",
                f"train.out_dir={out}",
                "--json",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert json.loads(captured.out)["steps"] == 6 and "resuming from" in captured.err  # the JSON alone on stdout


def _instances(run_dir: Path):
    from mlmlab.data.resolve import prepare_datasets

    config = load_config(str(run_dir / "config.yaml"))
    train, _, _ = prepare_datasets(config.data, config.train.init)
    return [train[i]["input_ids"] for i in range(len(train))]


# ----- the model folder ----------------------------------------------------------------------------
def test_the_model_card_says_what_the_model_is_and_how_it_was_made(source):
    run, summary = source
    card = (run / "model" / "README.md").read_text()
    meta = json.loads((Path(summary["run_dir"]) / "model" / "config.json").read_text())
    for fact in (
        "pipeline_tag: fill-mask",
        "L1/H32",
        "| 1 | 32 | 2 | 64 | 128 |",
        "WordPiece, 30,522 tokens, lowercased",
        meta["vocab_hash"],
        "`valid.txt.gz`",
        "objective: `nsp`",
        "masking strategy: `dynamic`; 15%",
        f"{summary['steps']} steps, {summary['tokens_seen']:,} tokens seen",
        f"{summary['eval']['perplexity']:.2f}",
        f"{summary['eval']['mlm_accuracy']:.4f}",
        f"{summary['eval']['nsp_accuracy']:.4f}",
        "random initialisation",
    ):
        assert fact in card, fact
    store_meta = _train_meta(run)
    assert f"{store_meta['num_corpus_tokens']:,}" in card and f"{store_meta['num_documents']:,}" in card
    # The command in the card gives the run's config again.
    command = card.split("```bash\n", 1)[1].split("\n```", 1)[0]
    words = shlex.split(command)
    assert words[:2] == ["mlmlab", "pretrain"]
    assert config_text(load_config(None, words[2:])) == (run / "config.yaml").read_text()


def _train_meta(run: Path) -> dict:
    from mlmlab.data.resolve import prepare_datasets

    return prepare_datasets(load_config(str(run / "config.yaml")).data)[0].meta


def test_export_of_the_last_checkpoint_is_the_final_model_folder(source, tmp_path, capsys):
    run, _ = source
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    assert "model card" in capsys.readouterr().out
    final = sorted(p.relative_to(run / "model") for p in (run / "model").rglob("*") if p.is_file())
    assert final == sorted(
        p.relative_to(tmp_path / "exported") for p in (tmp_path / "exported").rglob("*") if p.is_file()
    )
    for relative in final:
        assert (run / "model" / relative).read_bytes() == (tmp_path / "exported" / relative).read_bytes(), relative


def test_export_of_an_earlier_checkpoint_evaluates_it(source, tmp_path, capsys):
    run, _ = source
    assert main(["export", str(run / "ckpt-00000010"), "--out", str(tmp_path / "step10")]) == 0
    card = (tmp_path / "step10" / "README.md").read_text()
    assert "- 10 steps," in card and "| perplexity | MLM accuracy | NSP accuracy |" in card
    from transformers import AutoModelForMaskedLM

    AutoModelForMaskedLM.from_pretrained(tmp_path / "step10")
    for argv, words in (
        (["export", str(run), "--out", str(tmp_path / "step10")], "not empty"),
        (["export", str(tmp_path), "--out", str(tmp_path / "x")], "neither a run folder"),
    ):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def card_config(folder: Path) -> str:
    """The config that the command in a model card gives."""
    card = (folder / "README.md").read_text()
    words = shlex.split(card.split("```bash\n", 1)[1].split("\n```", 1)[0])
    return config_text(load_config(None, words[2:]))


def test_export_of_a_checkpoint_from_before_a_resume_shows_the_config_it_was_made_with(source, tmp_path, capsys):
    run, _ = source
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    (copy / "config.yaml").write_text((copy / "config.yaml").read_text().replace(str(run), str(copy)))
    before = (copy / "config.yaml").read_text()
    assert (
        main(
            [
                "pretrain",
                "--no-progress",
                *PHASE_1,
                f"train.out_dir={copy}",
                "train.max_steps=40",
                "train.lr=1e-3",
                "--resume",
                "auto",
            ]
        )
        == 0
    )
    after = (copy / "config.yaml").read_text()
    assert main(["export", str(copy / "ckpt-00000010"), "--out", str(tmp_path / "step10")]) == 0
    assert main(["export", str(copy / "ckpt-00000040"), "--out", str(tmp_path / "step40")]) == 0
    capsys.readouterr()
    assert card_config(tmp_path / "step10") == before != after == card_config(tmp_path / "step40")


def test_a_run_recorded_before_the_new_settings_existed_resumes(source, tmp_path, capsys):
    """A run interrupted under an older mlmlab, whose config.yaml lacks the keys added since (train.init,
    train.lr_schedule, data.text_column, data.id_column), is the same config: rerunning resumes it."""
    run, _ = source
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    added = ("  init: ", "  lr_schedule: ", "  text_column: ", "  id_column: ")
    text = (copy / "config.yaml").read_text().replace(str(run), str(copy))
    (copy / "config.yaml").write_text(
        "".join(line for line in text.splitlines(keepends=True) if not line.startswith(added))
    )
    assert main(["pretrain", "--no-progress", *PHASE_1, f"train.out_dir={copy}", "--json"]) == 0
    captured = capsys.readouterr()
    assert "resuming from" in captured.err and json.loads(captured.out)["steps"] == 30
    edited = (copy / "config.yaml").read_text()
    (copy / "config.yaml").write_text(edited.replace("max_steps: 30", "max_steps: 31"))
    assert main(["pretrain", "--no-progress", *PHASE_1, f"train.out_dir={copy}"]) == 2  # a real difference still is one
    assert "different config" in capsys.readouterr().err


def test_a_damaged_config_history_leaves_the_config_as_it_is_with_a_note(tmp_path):
    from mlmlab.train.run_folder import config_tree_at

    (tmp_path / "config.yaml").write_text(config_text(load_config(None, ["train.lr=1e-3"])))
    lines = ['{"step": 10, "changes": {"train.lr": [0.003, 0.001]}}', '{"step": 20, "changes": "cut sh']
    (tmp_path / "config_history.jsonl").write_text("\n".join(lines) + "\n")
    tree, notes = config_tree_at(tmp_path, 5)
    assert tree["train"]["lr"] == 0.001 and "does not say what a resume" in notes[0]  # not undone past the damage
    (tmp_path / "config_history.jsonl").write_text(lines[0] + "\n")
    tree, notes = config_tree_at(tmp_path, 5)
    assert tree["train"]["lr"] == 0.003 and notes == []
    assert config_tree_at(tmp_path, 15)[0]["train"]["lr"] == 0.001  # made after that resume
