"""The architectures mlmlab trains, one module each in this folder, and what the rest of mlmlab asks of them.

Each architecture's module defines one adapter (the ``Architecture`` interface of ``model/architecture.py``) as its
``ARCHITECTURE``; every such module here is registered under its adapter's name, which the config names in
``choices.ARCHITECTURES`` (so that it refuses an unknown one when it is built). ``add_architecture``
registers one from outside the package.
"""

import importlib
import inspect
import pkgutil

import torch

from mlmlab import choices
from mlmlab.config import Config
from mlmlab.errors import UserError
from mlmlab.model.architecture import Architecture


def _modules_here() -> dict[str, Architecture]:
    """{name: adapter} of every module in this folder that defines one, in the order choices.ARCHITECTURES names
    them (a module without ``ARCHITECTURE`` holds what adapters share)."""
    found = {}
    for module in pkgutil.iter_modules(__path__):
        adapter = getattr(importlib.import_module(f"{__name__}.{module.name}"), "ARCHITECTURE", None)
        if adapter is not None:
            found[adapter.name] = adapter
    if set(found) != set(choices.ARCHITECTURES):
        raise RuntimeError(
            f"the architecture modules here define {sorted(found)}, choices.ARCHITECTURES names "
            f"{sorted(choices.ARCHITECTURES)}: name each in both"
        )
    return {name: found[name] for name in choices.ARCHITECTURES}


ADAPTERS = _modules_here()  # by model.architecture (model_type)


class AnyMaskedLM:
    """Any other transformers masked LM (DistilBERT, ELECTRA's generator, ...), for held-out scoring only: mlmlab
    does not know where its encoder ends and its head begins, so its own forward projects every position and the
    sparse loss picks the selected ones from those logits. Never trained, never an ADAPTERS entry."""

    label = "masked LM"
    layer_class = None
    has_nsp = False

    @staticmethod
    def encode(model, input_ids, attention_mask, token_type_ids=None, inputs_embeds=None) -> tuple:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None and "token_type_ids" in inspect.signature(model.forward).parameters:
            inputs["token_type_ids"] = token_type_ids  # DistilBERT's and ModernBERT's forwards take none
        return model(**inputs).logits, None  # (B, T, V) in the place of hidden states; no pooler

    @staticmethod
    def predict(model, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # encode's output is the logits already: (..., V)


def add_architecture(adapter: Architecture) -> None:
    """Make ``adapter`` a model.architecture from outside the package: the config accepts its name, and building,
    training, resuming, exporting and the model card ask it."""
    if adapter.name in ADAPTERS:
        raise ValueError(f"model.architecture {adapter.name!r} exists already")
    ADAPTERS[adapter.name] = adapter
    choices.ARCHITECTURES.append(adapter.name)


def architecture_named(name: str) -> Architecture:
    if name not in ADAPTERS:
        raise UserError(
            f"model_type {name!r} is not an architecture mlmlab trains; it trains {choices.listed(ADAPTERS)}"
        )
    return ADAPTERS[name]


def check_config(cfg: Config) -> None:
    """A config's model section and objective against its architecture (named already checked), each refused in one
    line."""
    architecture = architecture_named(cfg.model.architecture)
    for other in ADAPTERS.values():
        changed = [name for name in other.own_settings if getattr(cfg.model, name) != getattr(type(cfg.model), name)]
        if changed and other is not architecture:
            raise UserError(
                f"model.{changed[0]} applies to model.architecture={other.name} only ({architecture.label} "
                f"has {architecture.positions}); drop it or set model.architecture={other.name}"
            )
    if cfg.data.objective == choices.NSP and not architecture.has_nsp:
        raise UserError(
            f"data.objective={choices.NSP} needs an NSP head, which {architecture.label} does not have "
            f"({architecture.without_nsp}); set data.objective={choices.MLM}, or "
            f"model.architecture={choices.BERT}"
        )
    architecture.check(cfg.model)


def architecture_of(model):
    """The adapter of a transformers model mlmlab built or loaded."""
    return architecture_named(model.config.model_type)


def saved_architecture(saved: dict):
    """The adapter of a config.json's model; a BERT when it names none (google-research/bert's configs)."""
    return architecture_named(saved.get("model_type", choices.BERT))


def saved_settings(saved: dict) -> dict:
    """{model.* setting: value} of a model's config.json (or its config's to_dict()); None where absent."""
    architecture = saved_architecture(saved)
    settings = {setting: config_entry(saved, key) for key, setting in architecture.settings.items()}
    if settings.get("max_position_embeddings") is not None:
        settings["max_position_embeddings"] = token_positions(saved)
    return {"architecture": architecture.name, **settings}


def token_positions(saved: dict) -> int | None:
    """The tokens a config.json's model takes at most: its position rows less the architecture's offset (RoBERTa's
    ids start past the padding id: 66 rows take 64 tokens). A model type mlmlab does not train (GLUE and
    evaluate_masked_lm take any) is counted without an offset, an upper bound; None where it names no position rows."""
    rows = saved.get("max_position_embeddings")
    if not isinstance(rows, int) or isinstance(rows, bool):
        return None
    return rows - ADAPTERS.get(saved.get("model_type", choices.BERT), ADAPTERS[choices.BERT]).position_offset(saved)


def refuse_past_positions(what: str, length: int, model: str, positions: int | None, remedy: str) -> None:
    """The one check of an input length against a model's positions, whichever command would feed the model
    (evaluate, glue, probe, train.init, a study before its first run): ``what`` (e.g. "GLUE RTE reads inputs of up
    to") ``length`` tokens, where ``model`` takes ``positions`` (token_positions, or a config's
    model.max_position_embeddings: mlmlab's setting counts tokens; None: not known), refused in one line with
    ``remedy``, before any work, not as an embedding's "index out of bounds" minutes in."""
    if positions is not None and length > positions:
        raise UserError(f"{what} {length} tokens, but {model} takes at most {positions}; {remedy}")


def config_entry(saved: dict, key):
    """A config.json entry; a tuple key is a path into nested entries. None where absent."""
    for part in key if isinstance(key, tuple) else (key,):
        saved = saved.get(part) if isinstance(saved, dict) else None
    return saved


def entry_name(setting: str, architecture) -> str:
    """How config.json names the entry of a model.* setting, for messages."""
    if setting == "architecture":
        return "model_type"
    key = next(key for key, name in architecture.settings.items() if name == setting)
    return ".".join(key) if isinstance(key, tuple) else key
