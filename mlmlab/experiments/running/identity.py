"""What makes two study runs the same run, and what makes finished runs incomparable with new ones.

A study grows over several sessions while mlmlab changes under it. Its runs are keyed by
what the study itself fixes: the values of the config keys its preset, base and arm set,
the budget's steps, the seed, the GLUE and held-out settings, and the hashes of the
prepared datasets. A config key added to mlmlab later (with a default that keeps the old
behaviour) therefore neither changes a key nor reruns a finished run. What could silently
mix old and new runs is refused instead of rerun: a finished row whose recorded config
differs from what the study now resolves to (a changed default the study did not pin), or
whose prepared data differs (changed data preparation).
"""

import dataclasses
import hashlib
import json

from mlmlab.config import Config, flat_keys, to_dict

# Set for every run by the study (budget, seeds), whatever its preset and base say.
STUDY_SET_KEYS = ("train.max_steps", "train.warmup_steps", "train.seed", "masking.seed")
NOT_IDENTITY = ("train.out_dir",)  # where a run lives, not what it computes
# The GLUE settings that existed when keys were first made: always in a key. A field added later
# enters only when a study sets it off its default, so adding one changes no finished run's key.
KEYED_GLUE_FIELDS = ("tasks", "seeds", "learning_rates", "epochs", "batch_size", "max_length", "max_train_examples")
KEYED_PROBE_FIELDS = ("tasks", "pooling", "seed")  # the probe block's, by the same rule


def identity_hash(cfg: Config, explicit_keys, datasets: dict, settings: dict) -> str:
    """12 hex digits over the explicitly set config values, the datasets' hashes and the study's other settings."""
    values = flat_keys(to_dict(cfg))
    chosen = {key: values[key] for key in sorted(set(explicit_keys) | set(STUDY_SET_KEYS)) if key not in NOT_IDENTITY}
    text = json.dumps({"config": chosen, "datasets": datasets, **settings}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def config_changes(recorded: dict, planned: dict) -> list[str]:
    """ "key: old -> new" for every key both config trees have and that differs (folders aside)."""
    old, new = flat_keys(recorded), flat_keys(planned)
    return [
        f"{key}: {old[key]!r} -> {new[key]!r}"
        for key in sorted(old.keys() & new.keys())
        if key not in NOT_IDENTITY and old[key] != new[key]
    ]


def settings_of(study) -> dict:
    """The study's settings besides the config that decide a row's numbers. The probe block enters only
    where a study has one: the studies from before probes keep their keys."""
    settings = {"glue": keyed_fields(study.glue, KEYED_GLUE_FIELDS), "eval_data": study.eval_data}
    return settings if study.probe is None else {**settings, "probe": keyed_fields(study.probe, KEYED_PROBE_FIELDS)}


def keyed_fields(settings, always: tuple[str, ...]) -> dict:
    """The fields of a settings dataclass in a run key: ``always``'s, and any other set off its default."""
    values, defaults = dataclasses.asdict(settings), dataclasses.asdict(type(settings)())
    return {key: value for key, value in values.items() if key in always or value != defaults[key]}
