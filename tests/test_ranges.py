"""Every number of the config has an allowed range, NaN and infinities are in none, and nothing shipped is refused."""

import dataclasses
import re
import types
import typing

import pytest
import torch

from mlmlab.config import Config, declared_ranges, load_config, preset_names
from mlmlab.errors import UserError
from mlmlab.experiments.running.runner import arm_config
from mlmlab.experiments.study import STUDY_DIR, load_study
from mlmlab.model.pretraining import build_model
from mlmlab.train.memory import GB, parameter_count, training_bytes

BERT_VOCAB = 30522  # the largest vocabulary shipped (studies on 8k vocabularies need less)


def numeric_keys(kinds: tuple[type, ...]) -> list[str]:
    """Dotted keys of the config fields whose type (``X | None`` read as X) is one of ``kinds``."""
    keys = []
    for section in dataclasses.fields(Config):
        for name, hint in typing.get_type_hints(section.type).items():
            if isinstance(hint, types.UnionType):
                hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
            if hint in kinds:
                keys.append(f"{section.name}.{name}")
    return keys


def test_every_number_of_the_config_has_an_allowed_range():
    """A field added without one would take NaN, inf or any size unchecked, as several did."""
    assert sorted(key for key, *_ in declared_ranges(Config())) == sorted(numeric_keys((int, float)))


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
@pytest.mark.parametrize("key", numeric_keys((float,)))
def test_no_float_takes_nan_or_infinity(key, value):
    with pytest.raises(UserError, match=re.escape(f"{key}={float(value.replace('.', ''))}")):
        load_config("tiny", [f"{key}={value}"])


def shipped_configs() -> list[Config]:
    """Every preset, and every arm of every study preset."""
    studies = [load_study(path.stem) for path in sorted(STUDY_DIR.glob("*.yaml"))]
    return [load_config(name) for name in preset_names()] + [arm_config(s, arm) for s in studies for arm in s.arms]


def test_nothing_shipped_is_refused_where_it_is_meant_to_run():
    """Base-size models (hidden 768) are for GPUs, in bf16 (80 GB: an H100); the rest for CPUs in fp32 (8 GB: a
    laptop)."""
    for cfg in shipped_configs():
        bytes_per_value, limit = (2, 80 * GB) if cfg.model.hidden_size >= 768 else (4, 8 * GB)
        assert sum(training_bytes(cfg, BERT_VOCAB, bytes_per_value).values()) < limit, cfg


def test_a_large_batch_of_the_tiny_preset_is_estimated_beyond_a_small_host():
    """The MLM logits dominate: 4096 sequences x 19 targets x 30,528 ids, twice, in fp32 are 19 GB alone."""
    parts = training_bytes(load_config("tiny", ["train.batch_size=4096"]), BERT_VOCAB, 4)
    assert parts["MLM logits"] > 19 * GB and sum(parts.values()) > 25 * GB


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"seeds": [0, -1]}, "seeds=-1 must be within [0, 4294967295]"),
        ({"seeds": [2**32]}, "seeds=4294967296 must be within"),
        ({"gates": {"arm": "dynamic", "min": {"eval.mlm_accuracy": float("nan")}}}, "gates min: values must be finite"),
        ({"decision": {"metric": "eval.mlm_loss", "min_effect": float("inf")}}, "must be numbers >= 0 (finite)"),
        ({"glue": {"tasks": ["RTE"], "learning_rates": ["inf"]}}, "learning_rates=inf must be positive and finite"),
        ({"glue": {"tasks": ["RTE"], "seeds": [-3]}}, "seeds=-3 must be within"),
    ],
    ids=[
        "negative seed",
        "seed beyond 32 bits",
        "NaN gate",
        "infinite min_effect",
        "infinite GLUE lr",
        "negative GLUE seed",
    ],
)
def test_a_study_out_of_range_is_refused_when_read(tmp_path, fields, message):
    """Before, a seed out of range crashed its run hours into the study, and NaN bounds decided nothing."""
    import yaml

    tree = {
        "base": {"model": {"hidden_size": 32, "num_heads": 2}},
        "arms": [{"name": "dynamic"}],
        "seeds": [0],
        **fields,
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(UserError, match=re.escape(message)):
        load_study(str(path))


@pytest.mark.parametrize("preset", ["tiny", "modernbert-tiny"])
def test_the_estimate_counts_each_architectures_own_parameters_without_drawing_random_numbers(preset):
    """BERT's closed form counted ModernBERT's GLU, biases and (absent) position table wrongly."""
    cfg = load_config(preset).model
    before = torch.get_rng_state()
    counted = parameter_count(cfg, BERT_VOCAB)
    assert torch.equal(torch.get_rng_state(), before)  # the run's weight initialisation draws what it drew
    assert counted == sum(p.numel() for p in build_model(cfg, BERT_VOCAB, pad_token_id=0).parameters())
