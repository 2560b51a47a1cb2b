"""Model construction from the config."""

import pytest
import torch

from mlmlab.config import load_config
from mlmlab.errors import UserError
from mlmlab.model.architecture import Architecture
from mlmlab.model.architectures import ADAPTERS
from mlmlab.model.architectures.bert import Bert
from mlmlab.model.pretraining import build_model, encode


def train_mode_outputs_differ(*overrides) -> bool:
    """Whether two training-mode forwards of the same batch differ, i.e. whether any dropout is drawn."""
    torch.manual_seed(0)
    bert = build_model(load_config(None, list(overrides)).model, vocab_size=100, pad_token_id=0).train()
    batch = {
        "input_ids": torch.randint(1, 100, (2, 16)),
        "attention_mask": torch.ones(2, 16, dtype=torch.long),
        "token_type_ids": torch.zeros(2, 16, dtype=torch.long),
    }
    first, second = encode(bert, batch)[0], encode(bert, batch)[0]  # (B, T, H) each
    return not torch.equal(first, second)


def test_attention_dropout_follows_dropout_unless_set():
    assert not train_mode_outputs_differ("model.dropout=0")  # null attention_dropout: off with dropout
    assert train_mode_outputs_differ("model.dropout=0", "model.attention_dropout=0.5")
    assert train_mode_outputs_differ("model.dropout=0.1", "model.attention_dropout=0")
    config = build_model(load_config(None, ["model.dropout=0.1", "model.attention_dropout=0"]).model, 100, 0).config
    assert (config.hidden_dropout_prob, config.attention_probs_dropout_prob) == (0.1, 0.0)


@pytest.mark.parametrize("preset", ["tiny", "modernbert-tiny"])
def test_an_attention_transformers_cannot_make_is_one_line_naming_the_key(preset):
    cfg = load_config(preset, ["model.attention=bogus"]).model
    with pytest.raises(UserError, match=r"^model.attention='bogus' cannot be used here: .*Use model.attention=sdpa"):
        build_model(cfg, vocab_size=100, pad_token_id=0)


def test_every_architecture_declares_the_interface():
    """Each registered adapter has every member the Architecture interface declares; one that lacks any is not one."""
    assert ADAPTERS and all(isinstance(adapter, Architecture) for adapter in ADAPTERS.values())
    lacking = type("Lacking", (), {name: getattr(Bert, name) for name in dir(Bert) if name != "separate_qkv"})
    assert not isinstance(lacking, Architecture)


def test_an_architecture_added_from_outside_is_accepted_by_the_config_and_asked_by_name(monkeypatch):
    from mlmlab import choices
    from mlmlab.model import architectures

    monkeypatch.setattr(choices, "ARCHITECTURES", list(choices.ARCHITECTURES))
    monkeypatch.setattr(architectures, "ADAPTERS", dict(architectures.ADAPTERS))
    outside = type("Outside", (Bert,), {"name": "outside", "label": "Outside"})
    with pytest.raises(UserError, match="model.architecture='outside' is unknown"):
        load_config(None, ["model.architecture=outside"])
    architectures.add_architecture(outside)
    cfg = load_config(None, ["model.architecture=outside"])
    architectures.check_config(cfg)
    assert architectures.architecture_named("outside") is outside
    with pytest.raises(ValueError, match="exists already"):
        architectures.add_architecture(outside)
