"""XLM-R continues pretraining: a released XLMRobertaForMaskedLM folder with its SentencePiece Unigram tokenizer,
through --init, whole-word masking at "▁" word starts, export and evaluation, as RoBERTa's in test_roberta.py. What
every architecture does (training from scratch with each masking variant, exact resume, its own exported folder) is
test_conformance.py's.

The folder is what a downloaded xlm-roberta-base is, in miniature and offline: transformers' own classes and
save_pretrained, the tokenizer trained by `mlmlab tokenizer --kind unigram` on the bundled sample (conftest's
trained_tokenizers). A one-layer H32 model and a 2,000-piece vocabulary keep the file to seconds.
"""

import pytest
import torch
from conftest import QUICK_RUN, one_line_error
from safetensors.torch import load_file
from test_roberta import released_folder
from test_workflows import assert_same_evaluation
from tokenizers import Tokenizer
from transformers import (
    AutoModelForMaskedLM,
    AutoTokenizer,
    XLMRobertaConfig,
    XLMRobertaForMaskedLM,
    XLMRobertaTokenizer,
)

from mlmlab import choices
from mlmlab.config import load_config
from mlmlab.data.tokenizer import load_tokenizer
from mlmlab.evaluate.held_out import evaluate_model
from mlmlab.evaluate.perplexity import evaluate_mlm
from mlmlab.model.pretraining import IGNORE_INDEX
from mlmlab.train.loop import Trainer

CONTINUE = [*QUICK_RUN, "data.objective=mlm", "masking.whole_word=true", "train.max_steps=20", "train.warmup_steps=0"]

pytestmark = pytest.mark.usefixtures("no_progress_bars")


@pytest.fixture(scope="module")
def unigram(trained_tokenizers):
    return trained_tokenizers[choices.UNIGRAM]


@pytest.fixture(scope="module")
def released(unigram, tmp_path_factory):
    """A tiny xlm-roberta-base as downloaded: its config.json's entries (2 + 128 position rows, one token type,
    LayerNorm eps 1e-5), a pooler in the weights file that XLMRobertaForMaskedLM does not read, and the tokenizer
    saved beside it as XLMRobertaTokenizer (whose pair framing, <s> A </s></s> B </s>, is XLM-R's)."""
    tokenizer = load_tokenizer(unigram)
    torch.manual_seed(0)
    config = XLMRobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=130,
        type_vocab_size=1,
        layer_norm_eps=1e-5,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())  # a copy: the wrapper sets its own framing
    xlmr_tokenizer = XLMRobertaTokenizer(tokenizer_object=backend, **tokenizer.special_tokens_map)
    pooler = {"roberta.pooler.dense.weight": torch.ones(32, 32)}
    folder = tmp_path_factory.mktemp("released") / "xlm-roberta-tiny"
    return released_folder(folder, XLMRobertaForMaskedLM(config), xlmr_tokenizer, pooler)


@pytest.fixture(scope="module")
def continued(released, tmp_path_factory):
    """The released folder continued 20 steps (MLM, whole-word masks): its trainer, step 0's held-out evaluation,
    the run's summary and its folder."""
    run = tmp_path_factory.mktemp("continued") / "run"
    cfg = load_config(None, [*CONTINUE, f"train.init={released}", f"train.out_dir={run}"])
    trainer = Trainer(cfg, evaluator=evaluate_mlm, show_progress=False)  # no model.* keys: taken from the folder
    start = trainer.evaluate(cfg.train.eval_batches)
    summary = trainer.train()
    return trainer, start, summary, run


def test_init_takes_xlm_roberta_from_the_folders_config(continued):
    trainer, _, _, _ = continued
    assert isinstance(trainer.model, XLMRobertaForMaskedLM)
    assert trainer.cfg.model.architecture == choices.XLM_ROBERTA
    assert trainer.cfg.model.max_position_embeddings == 128  # 130 rows less the 2 before the first token's
    assert trainer.state.step == 20


def test_step_0_evaluation_is_the_source_folders(continued, released):
    trainer, start, summary, _ = continued
    # `mlmlab evaluate` of the source folder on the run's held-out store (a corpus would be prepared as NSP pairs)
    source = evaluate_model(
        released,
        trainer.valid_store.path,
        batch_size=trainer.cfg.train.eval_batch_size,
        max_batches=trainer.cfg.train.eval_batches,
    )
    print(f"mlm loss: source {source['mlm_loss']:.6f}, init's step 0 {start['mlm_loss']:.6f}")
    assert_same_evaluation(start, source, keys=("mlm_loss", "mlm_accuracy"))
    # The same evaluation tells the weights apart: the 20 steps trained moved it.
    assert abs(summary["eval"]["mlm_loss"] - start["mlm_loss"]) > 1e-3


def test_whole_word_masks_follow_the_sentencepiece_word_starts(continued, unigram):
    trainer, _, _, _ = continued
    tokenizer = load_tokenizer(unigram)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    continues = torch.tensor([not token.startswith("▁") for token in tokens])
    ordinary = torch.tensor([token not in tokenizer.all_special_tokens for token in tokens])
    assert torch.equal(trainer.masker.continuation[ordinary], continues[ordinary])
    text = " ".join(["Unmistakably, the extraordinarily understated cartographers misrepresented Constantinople."] * 4)
    ids = torch.tensor([tokenizer(text)["input_ids"]])  # (1, T)
    batch = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        token_type_ids=torch.zeros_like(ids),
        example_ids=torch.tensor([0]),
    )
    masked, _ = trainer.masker.mask(batch, epoch=0, model=trainer.model, progress=0.0, step=1)
    selected = masked["labels"][0] != IGNORE_INDEX  # (T,)
    inside_words = continues[ids[0, 1:-1]]  # (T - 2,) pieces after the first of their word (<s> and </s> aside)
    # Each piece that continues a word is selected exactly when the piece before it is: whole words only.
    assert torch.equal(selected[1:-1][inside_words], selected[:-2][inside_words])
    assert (selected[1:-1] & inside_words).any()  # a word of several pieces was among the targets


def test_the_exported_folder_is_an_xlm_roberta_with_the_sources_tokenizer(continued, released):
    _, _, _, run = continued
    exported = AutoModelForMaskedLM.from_pretrained(run / "model")
    assert isinstance(exported, XLMRobertaForMaskedLM) and exported.config.model_type == choices.XLM_ROBERTA
    assert exported.config.max_position_embeddings == 130 and exported.config.type_vocab_size == 1
    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(released).get_vocab()
    assert (
        tokenizer.mask_token == "<mask>"
        and tokenizer.convert_ids_to_tokens(tokenizer("Hello")["input_ids"])[1][0] == "▁"
    )
    trained, started = exported.state_dict(), load_file(released / "model.safetensors")
    assert any(not torch.equal(trained[name], started[name]) for name in trained if name in started)
    card = (run / "model" / "README.md").read_text()
    assert "XLM-R L1/H32" in card and "XLMRobertaForMaskedLM" in card and "objective: `mlm`" in card


@pytest.mark.parametrize("start", ["from scratch", "--init"])
def test_nsp_with_xlm_roberta_is_refused_in_one_line(start, released, tmp_path, capsys):
    architecture = ["model.architecture=xlm-roberta"] if start == "from scratch" else ["--init", str(released)]
    err = one_line_error(["pretrain", "--no-progress", *QUICK_RUN, *architecture, f"train.out_dir={tmp_path}"], capsys)
    assert "NSP head" in err and "XLM-R" in err and "data.objective=mlm" in err
