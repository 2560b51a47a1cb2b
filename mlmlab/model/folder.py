"""A model folder: one trained model as mlmlab writes, checks and loads it.

The format (``save_pretrained``'s, so the Auto classes load it): ``config.json`` with one
entries of mlmlab's, ``vocab_hash`` (the vocabulary the model was trained with) and ``held_out_form`` (how its
run built and measured its held-out set, which ``mlmlab evaluate`` follows); safetensors
weights; the tokenizer files; ``token_counts.npy`` (the pretraining corpus's token counts,
which define the frequency buckets of later evaluations); an exported folder adds its model
card (train/model_card.py). A run's ``model/``, a checkpoint's ``model/`` and ``mlmlab
export``'s folder are all one. Everything that reads one goes through here, so a damaged or
foreign folder is refused in one line, the same way whichever command reads it.
"""

import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from mlmlab.config import Config
from mlmlab.data.tokenizer import folder_vocab_hash, load_tokenizer, vocab_hash
from mlmlab.errors import UserError
from mlmlab.model.architectures import architecture_named, saved_architecture, token_positions
from mlmlab.model.pretraining import load_weights, weight_shapes
from mlmlab.utils.jsonio import read_json_file
from mlmlab.utils.restoring import restoring

CONFIG_JSON = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKEN_COUNTS_FILE = "token_counts.npy"
VOCAB_HASH_KEY = "vocab_hash"  # config.json entry: the vocabulary the model was trained with
# config.json entry: the settings its run's held-out figures were measured under, by config key (held_out_form_of)
HELD_OUT_FORM_KEY = "held_out_form"
GIVE_A_MODEL_FOLDER = (
    "give a model folder (config.json + model.safetensors), e.g. a run's model/ or a checkpoint's model/"
)


# ----- writing -----------------------------------------------------------------------------
def write_model_folder(
    folder: Path, config: PreTrainedConfig, state_dict: dict, tokenizer, token_counts: np.ndarray
) -> None:
    """The folder of a model of ``config`` holding ``state_dict``, trained with ``tokenizer`` on a corpus of
    ``token_counts``.

    Saved from a plain copy, built on the meta device (no init, no RNG draw) and given the
    gathered weights: ``save_pretrained`` inspects the model's own parameters, which under
    FSDP are shards whose gathering would wait for the other processes forever.
    """
    config = copy.deepcopy(config)  # the running model's stays as it is
    setattr(config, VOCAB_HASH_KEY, vocab_hash(tokenizer.get_vocab()))  # what evaluate, GLUE, --init and resume compare
    with torch.device("meta"):
        plain = architecture_named(config.model_type).model_class(config)
    plain.load_state_dict(state_dict, assign=True)
    plain.tie_weights()
    plain.save_pretrained(folder, safe_serialization=True)
    # The tokenizer saved with the model knows the model's positions (token_positions: the architecture's offset taken
    # off), so that transformers' readers of the folder (pipeline("fill-mask"), truncation=True) cut inputs where the
    # positions end, not past them; the running tokenizer is left as it was.
    positions = token_positions(config.to_dict()) or tokenizer.model_max_length
    with restoring(lambda: tokenizer.model_max_length, lambda n: setattr(tokenizer, "model_max_length", n), positions):
        tokenizer.save_pretrained(folder)
    np.save(folder / TOKEN_COUNTS_FILE, token_counts)


def held_out_form_of(cfg: Config) -> dict:
    """The settings that decide a run's held-out figures besides the text: how the text becomes sequences (NSP pairs
    or packed blocks, their length, the pair sampling) and how they are masked and batched. Recorded in the model
    folder, so that ``mlmlab evaluate`` of the same text measures the same sequences under the same masks."""
    return {
        "data.objective": cfg.data.objective,
        "data.max_seq_length": cfg.data.max_seq_length,
        "data.short_seq_prob": cfg.data.short_seq_prob,
        "data.prepare_seed": cfg.data.prepare_seed,
        "masking.mask_unk": cfg.masking.mask_unk,
        "train.eval_batch_size": cfg.train.eval_batch_size,
        "train.eval_batches": cfg.train.eval_batches,
    }


def record_held_out_form(config: PreTrainedConfig, cfg: Config) -> None:
    """``config`` (a model's, written into every model folder of its run) records ``held_out_form_of(cfg)``; an
    --init folder's record is replaced by this run's."""
    setattr(config, HELD_OUT_FORM_KEY, held_out_form_of(cfg))


# ----- reading -----------------------------------------------------------------------------
def is_model_folder(folder: Path) -> bool:
    return (folder / CONFIG_JSON).is_file() and (folder / WEIGHTS_FILE).is_file()


def read_config(folder: Path, named: str = "") -> dict:
    """The folder's config.json, or a one-line UserError saying what is missing or damaged.

    ``named``: how the message names the folder (the setting that gave it, e.g. ``train.init=DIR``).
    """
    named, path = named or str(folder), Path(folder) / CONFIG_JSON
    if not Path(folder).is_dir():
        raise UserError(f"{named}: no such folder; {GIVE_A_MODEL_FOLDER}")
    if not path.is_file():
        raise UserError(f"{named} has no {CONFIG_JSON}; {GIVE_A_MODEL_FOLDER}")
    config = read_json_file(path, "copy or export the model again")
    if not isinstance(config, dict):
        raise UserError(f"{path} holds a {type(config).__name__}, not a model config; copy or export the model again")
    return config


def saved_weight_shapes(folder: Path, named: str = "") -> dict[str, tuple[int, ...]]:
    """{name: shape} of the folder's weights; a missing, truncated or foreign weights file is a UserError."""
    named = named or str(folder)
    if not (folder / WEIGHTS_FILE).is_file():
        if (folder / "pytorch_model.bin").is_file():
            raise UserError(
                f"{named} has no {WEIGHTS_FILE}, only a pytorch_model.bin, which mlmlab never unpickles: "
                "save it once as safetensors with transformers (from_pretrained(DIR).save_pretrained(DIR))"
            )
        raise UserError(f"{named} has no {WEIGHTS_FILE}; {GIVE_A_MODEL_FOLDER}")
    return weight_shapes(folder / WEIGHTS_FILE)


def load_saved_weights(model: nn.Module, folder: Path, allowed_missing: tuple[str, ...] = (), prefix: str = "") -> None:
    """The folder's weights into ``model`` (model.load_weights: any difference is refused but ``allowed_missing``;
    ``prefix`` before every saved name)."""
    load_weights(model, folder / WEIGHTS_FILE, allowed_missing, prefix)


def load_pretrained(folder: Path) -> tuple[PreTrainedModel, object]:
    """The model (BertForPreTraining, ModernBertForMaskedLM) and its WordPiece tokenizer, or a one-line UserError."""
    folder = Path(folder)
    architecture = saved_architecture(read_config(folder))  # a model type mlmlab does not train is refused here
    saved_weight_shapes(folder)
    try:
        model = architecture.model_class.from_pretrained(folder)
    except Exception as err:  # transformers raises many types for foreign or corrupt files
        raise UserError(f"cannot load the model in {folder}: {str(err).splitlines()[0]}") from None
    refuse_missing_tokenizer(folder)
    tokenizer = load_tokenizer(folder)
    check_own_tokenizer(folder, tokenizer)
    return model, tokenizer


def load_any_tokenizer(folder: Path):
    """The tokenizer saved with a model, of any kind AutoTokenizer loads (GLUE fine-tunes other encoders too), checked
    against the vocabulary the model was trained with; no size checks."""
    from transformers import AutoTokenizer

    refuse_missing_tokenizer(folder)  # else AutoTokenizer may build one from config.json alone: another vocabulary
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise UserError(f"{folder}: no usable tokenizer ({error}); save the tokenizer into the model folder") from None
    check_own_tokenizer(folder, tokenizer)
    return tokenizer


def saved_held_out_form(folder: Path) -> dict | None:
    """The held-out settings recorded in the folder (held_out_form_of); None for a folder written before they were."""
    recorded = read_config(folder).get(HELD_OUT_FORM_KEY)
    return recorded if isinstance(recorded, dict) else None


# Where a saved tokenizer's vocabulary is read from: fast tokenizers, WordPiece, BPE's slow files, SentencePiece
VOCABULARY_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "sentencepiece.bpe.model", "spiece.model")


def refuse_missing_tokenizer(folder: Path) -> None:
    """A model folder without its tokenizer files is refused saying so (not as another vocabulary than its own)."""
    if not any((Path(folder) / name).is_file() for name in VOCABULARY_FILES):
        raise UserError(
            f"{folder} holds no tokenizer files ({', '.join(VOCABULARY_FILES[:3])}, ...): the model's tokenizer was "
            "not saved or copied with its weights; copy its tokenizer files in from where the model came from (a "
            "run's model/ folder holds them)"
        )


def saved_token_counts(folder: Path) -> np.ndarray | None:
    """The pretraining corpus's token counts saved with the model; None for a folder without them (not mlmlab's)."""
    path = Path(folder) / TOKEN_COUNTS_FILE
    return np.load(path) if path.is_file() else None


# ----- the vocabulary ----------------------------------------------------------------------
def saved_vocab_hash(folder: Path) -> str:
    """The vocabulary the model was trained with: recorded in config.json, else its tokenizer files' (older folders)."""
    recorded = read_config(folder).get(VOCAB_HASH_KEY)
    if recorded:
        return recorded
    if not (folder / "tokenizer.json").is_file() and not (folder / "vocab.txt").is_file():
        raise UserError(
            f"cannot tell which vocabulary the model in {folder} was trained with: its config.json records "
            "none and the folder holds no tokenizer files; copy the model's vocab.txt / tokenizer.json into it"
        )
    return folder_vocab_hash(folder)


def refuse_other_vocabulary(folder: Path, tokenizer, problem: str, remedy: str) -> None:
    """``tokenizer`` must be the vocabulary the model in ``folder`` was trained with, id for id: same size or not,
    other ids would mean other tokens. Else a UserError: ``problem`` (the hashes), ``remedy``."""
    expected, given = saved_vocab_hash(folder), vocab_hash(tokenizer.get_vocab())
    if given != expected:
        raise UserError(f"{problem} (vocabulary hash {given}, the model's {expected}); {remedy}")


def check_own_tokenizer(folder: Path, tokenizer) -> None:
    """The folder's own tokenizer must be the vocabulary its config.json records (a swapped vocab.txt is refused).

    A folder that records none (not mlmlab's) is not checked: its files are all there is to go by.
    """
    if VOCAB_HASH_KEY in read_config(folder):
        refuse_other_vocabulary(
            folder,
            tokenizer,
            f"{folder}: its tokenizer is not the vocabulary the model was trained with",
            "restore the folder's tokenizer files",
        )
