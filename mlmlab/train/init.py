"""Starting a run from another model's weights (train.init): continued pretraining, BERT's phase 2.

Weights only: the optimizer, the step and every schedule start fresh, as with
``run_mlm.py --model_name_or_path``. Checked before any slow set-up, each refused in one
line naming the key:

- the folder: config.json and model.safetensors (a pytorch_model.bin is never unpickled);
- the model: a BERT, RoBERTa, XLM-R or ModernBERT as mlmlab builds it (model type, activation, tied embeddings, ...);
- the architecture: the model section (model.architecture included) is taken from the checkpoint's
  config.json, so ``--init DIR`` needs no model.* keys; a value the config sets to something other
  than its default and the checkpoint's is refused, and so is one the user named (an override, their
  config file) even at its default: ``model.architecture=bert`` beside a RoBERTa folder would otherwise
  train a RoBERTa without a word (the run's config.yaml records what was taken);
- the positions: data.max_seq_length beyond the checkpoint's max_position_embeddings;
- the vocabulary: data.tokenizer, when given, must be the checkpoint's (vocab_hash); when
  empty, the checkpoint's own tokenizer is the run's (data/resolve.py), and must be the one
  its config.json records.

A BertForMaskedLM folder has no pooler and no NSP head: they start fresh, and the log says so. A base-model folder
(BertModel, RobertaModel, XLMRobertaModel, ModernBertModel: the encoder alone, its weight names without the
``bert.``-style prefix) starts its MLM head fresh too, tied to the input embeddings as the architecture ties it.
"""

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

from accelerate.utils import set_seed
from transformers import PreTrainedModel

from mlmlab import choices
from mlmlab.config import Config, ModelConfig
from mlmlab.data.resolve import standalone_tokenizer, tokenizer_dir_for
from mlmlab.data.tokenizer import load_tokenizer
from mlmlab.errors import UserError
from mlmlab.model.architectures import (
    ADAPTERS,
    architecture_of,
    entry_name,
    refuse_past_positions,
    saved_architecture,
    saved_settings,
    token_positions,
)
from mlmlab.model.folder import (
    check_own_tokenizer,
    load_saved_weights,
    read_config,
    refuse_other_vocabulary,
    saved_weight_shapes,
)
from mlmlab.model.fused_qkv import fuse_qkv
from mlmlab.model.pretraining import (
    COMPILED_LENGTH_MULTIPLE,
    build_model,
    compile_model,
    current_name,
    padded_vocab_size,
)


def resolve_init(cfg: Config, named: frozenset[str] = frozenset()) -> Config:
    """``cfg`` with its model section taken from train.init's config.json; every check above, before any set-up.
    ``named``: the dotted keys the user chose (config.named_keys)."""
    if not cfg.train.init:
        return cfg
    folder = Path(cfg.train.init)
    setting = f"train.init={folder}"
    saved = read_config(folder, setting)
    saved_weight_shapes(folder, setting)  # a missing or damaged weights file, before any slow set-up
    _refuse_other_models(folder, saved)
    _check_objective(folder, saved, cfg.data.objective)
    _check_positions(folder, saved, cfg.data.max_seq_length)
    _check_vocabulary(folder, cfg.data.tokenizer)
    return _with_architecture(cfg, folder, saved, named)


def _refuse_other_models(folder: Path, saved: dict) -> None:
    """A model type mlmlab does not build, or config.json entries it leaves at other values (an absent entry: the
    default)."""
    model_type = saved.get("model_type", choices.BERT)
    if model_type not in ADAPTERS:
        raise UserError(
            f"train.init={folder} has model_type={model_type!r}, mlmlab builds model_type "
            f"{choices.listed(repr(name) for name in ADAPTERS)}; start from a "
            f"{choices.listed(adapter.label for adapter in ADAPTERS.values())} folder, or without train.init"
        )
    for key, built in saved_architecture(saved).as_built.items():
        if saved.get(key, built) != built:
            raise UserError(
                f"train.init={folder} has {key}={saved[key]!r}, mlmlab builds {key}={built!r}; "
                f"start from a {model_type} as mlmlab builds it, or without train.init"
            )


def _check_objective(folder: Path, saved: dict, objective: str) -> None:
    """The folder's architecture replaces the config's (_with_architecture): its NSP head, or the lack of one, decides
    the objective it can continue with, and only data.objective can change that."""
    architecture = saved_architecture(saved)
    if objective == choices.NSP and not architecture.has_nsp:
        raise UserError(
            f"train.init={folder} is a {architecture.label} model, which has no NSP head "
            f"({architecture.without_nsp}), and data.objective={choices.NSP} trains one; set "
            f"data.objective={choices.MLM} to continue pretraining it"
        )


def _check_positions(folder: Path, saved: dict, max_seq_length: int) -> None:
    positions = token_positions(saved)
    refuse_past_positions(
        f"data.max_seq_length={max_seq_length} packs sequences of",
        max_seq_length,
        f"train.init={folder}",
        positions,
        f"lower data.max_seq_length to {positions}, or train the first phase with "
        f"model.max_position_embeddings={max_seq_length} (BERT keeps 512 positions while it trains at 128)",
    )


def _check_vocabulary(folder: Path, tokenizer_setting: str) -> None:
    """The run's tokenizer must be the vocabulary the checkpoint was trained with, id for id: data.tokenizer's, or
    the folder's own, checked as evaluate and glue check it (a swapped vocab.txt trained with the wrong ids)."""
    if not tokenizer_setting:
        tokenizer = load_tokenizer(standalone_tokenizer(folder))
        check_own_tokenizer(folder, tokenizer)
    else:
        tokenizer = load_tokenizer(tokenizer_dir_for(tokenizer_setting))
        refuse_other_vocabulary(
            folder,
            tokenizer,
            f"data.tokenizer={tokenizer_setting} is another vocabulary than train.init={folder}'s",
            "leave data.tokenizer empty to use the model's own tokenizer",
        )
    _check_padding(folder, tokenizer)


def _check_padding(folder: Path, tokenizer) -> None:
    """The weights' padding id must be the tokenizer's: the embedding keeps that row for padding, and RoBERTa
    counts its positions from past it."""
    saved = read_config(folder).get("pad_token_id")
    if saved is not None and saved != tokenizer.pad_token_id:
        raise UserError(
            f"train.init={folder} has pad_token_id={saved} in its config.json, but its tokenizer pads "
            f"with {tokenizer.pad_token!r} (id {tokenizer.pad_token_id}): the weights and the tokenizer "
            "disagree; start from a folder whose tokenizer is the one its model was trained with"
        )


def _with_architecture(cfg: Config, folder: Path, saved: dict, named: frozenset[str]) -> Config:
    """The model section from the checkpoint; a value that differs is refused, naming the key, when the config sets
    it to other than its default or the user named it."""
    defaults, changes = ModelConfig(), {}
    for name, theirs in saved_settings(saved).items():  # the vocabulary size follows the tokenizer (checked at load)
        ours = getattr(cfg.model, name)
        if theirs is None or ours == theirs:  # None: an entry the folder lacks; the library's default applies
            continue
        if ours != getattr(defaults, name) or f"model.{name}" in named:
            instead = f"start from a {ours} folder" if name == "architecture" else f"set it to {theirs}"
            raise UserError(
                f"train.init={folder} has {entry_name(name, saved_architecture(saved))}={theirs}, the "
                f"config sets model.{name}={ours}; drop model.{name} (the model's own is taken) or {instead}"
            )
        changes[name] = theirs
    multiple = cfg.model.pad_vocab_multiple
    if saved.get("vocab_size", 0) % multiple and multiple == defaults.pad_vocab_multiple:
        changes["pad_vocab_multiple"] = 1  # an unpadded embedding (bert-base-uncased: 30,522 rows)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes)) if changes else cfg


def initial_model(cfg: Config, tokenizer, resuming: bool, log: Callable[[str], None]) -> PreTrainedModel:
    """The run's model before any resume: fresh (seeded by train.seed), then train.init's weights unless resuming."""
    set_seed(cfg.train.seed)  # weight init and dropout draw from torch's default generator (checkpointer.rng_states)
    model = build_model(cfg.model, len(tokenizer), tokenizer.pad_token_id)
    if cfg.train.init and not resuming:  # a resume loads its checkpoint's weights instead
        load_init_weights(model, Path(cfg.train.init), log, len(tokenizer))
    if cfg.train.fused_qkv:
        fused = fuse_qkv(model)
        log(
            f"train.fused_qkv: {fused} attention layers project Q, K and V with one matmul"
            if fused
            else "train.fused_qkv: nothing to fuse, this architecture projects Q, K and V with one matmul already"
        )
    if cfg.train.compile:
        compile_model(model)
        log(
            f"train.compile: the first step of each input length (padded to a multiple of {COMPILED_LENGTH_MULTIPLE}) "
            "waits while torch.compile builds its graph, tens of seconds each on a CPU"
        )
    return model


def load_init_weights(model: PreTrainedModel, folder: Path, log: Callable[[str], None], tokens: int) -> None:
    """train.init's weights into a freshly built model of ``tokens`` tokens (padded); a part it may lack (a BERT's
    pooler, NSP head) stays fresh, and so does the MLM head of a base-model folder (the encoder alone: a BertModel's,
    as sentence-transformers saves one), its decoder tied to the input embeddings where the architecture ties them."""
    rows = read_config(folder).get("vocab_size")
    if rows != model.config.vocab_size:
        raise UserError(
            f"train.init={folder} has vocab_size={rows} embedding rows, this config builds "
            f"{model.config.vocab_size} (the tokenizer's {tokens} tokens padded to a multiple of "
            f"model.pad_vocab_multiple); {_padding_giving(rows, tokens)}"
        )
    names = [current_name(name) or "" for name in saved_weight_shapes(folder)]
    prefix = base_model_prefix(model, names)
    optional = architecture_of(model).optional_parts
    heads = head_prefixes(model, prefix) if prefix else ()
    fresh = [part for start, part in optional.items() if not any((prefix + name).startswith(start) for name in names)]
    load_saved_weights(model, folder, allowed_missing=(*optional, *heads), prefix=prefix)
    log(
        f"starting from the weights of {folder} (weights only: optimizer, step and schedules start fresh)"
        + (base_model_note(model, folder, fresh) if prefix else fresh_note(fresh))
    )


def fresh_note(fresh: list[str]) -> str:
    if not fresh:
        return ""
    return f"; it has no {' and no '.join(fresh)}: {'they start' if len(fresh) > 1 else 'it starts'} fresh"


def base_model_note(model: PreTrainedModel, folder: Path, fresh: list[str]) -> str:
    """What a base-model folder leaves fresh, in the words of the log line."""
    saved_class = (read_config(folder).get("architectures") or ["a base model"])[0]
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    parts = " and ".join(["the MLM head", *(f"the {part}" for part in fresh)])
    return f"; it holds the encoder alone ({saved_class}): {parts} start fresh" + (
        ", the decoder tied to the input embeddings" if tied else ""
    )


def base_model_prefix(model: PreTrainedModel, saved_names: list[str]) -> str:
    """What a base-model folder's weight names lack (``bert.`` for a BertModel's ``embeddings...`` in a
    BertForPreTraining), when no saved name carries it; "" for a folder of the whole model."""
    prefix = f"{model.base_model_prefix}."
    return "" if any(name.startswith(prefix) for name in saved_names) else prefix


def head_prefixes(model: PreTrainedModel, prefix: str) -> tuple[str, ...]:
    """The parts of ``model`` outside its encoder (``prefix``): the heads a base-model folder does not hold."""
    return tuple(sorted({name.split(".")[0] + "." for name in model.state_dict() if not name.startswith(prefix)}))


def _padding_giving(rows, tokens: int) -> str:
    """What to set so that ``tokens`` padded make ``rows`` embedding rows: the multiples that do, or why none can."""
    if not isinstance(rows, int) or rows < tokens:
        return (
            f"no model.pad_vocab_multiple pads {tokens} tokens to {rows} rows: the weights were trained with another "
            "tokenizer than the folder's; start from a folder whose tokenizer is its model's"
        )
    divisors = {d for i in range(1, math.isqrt(rows) + 1) if rows % i == 0 for d in (i, rows // i)}
    least = min(m for m in divisors if padded_vocab_size(tokens, m) == rows)  # rows itself always pads to rows
    return f"set model.pad_vocab_multiple={least} (the least that pads {tokens} tokens to {rows} rows)"
