"""What makes two study runs the same run, what makes finished runs incomparable with new ones, and what makes
rows one study's.

A study grows over several sessions while mlmlab changes under it. Its runs are keyed by
what the study itself fixes: the values of the config keys its preset, base and arm set,
the budget's steps, the seed, the GLUE and held-out settings, and the hashes of the
prepared datasets. A config key added to mlmlab later (with a default that keeps the old
behaviour) therefore neither changes a key nor reruns a finished run. What could silently
mix old and new runs is refused instead of rerun: a finished row whose recorded config
differs from what the study now resolves to (a changed default the study did not pin), or
whose prepared data differs (changed data preparation).

A study's rows are compared under its rule, so every row also records the study's identity:
a hash of each part of the study file that decides what the rows mean (its arms, budget,
seeds, screen, decision rule and baseline, gates). The runner appends no row whose study
identity differs from the first row's; it is no part of a run key.
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
    return sha256_of({"config": chosen, "datasets": datasets, **settings})[:12]


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


def keyed_fields(settings, always: tuple[str, ...] = ()) -> dict:
    """The fields of a settings dataclass in a key: ``always``'s and those without a default, and any other set off
    its default."""
    values = dataclasses.asdict(settings)
    return {
        field.name: values[field.name]
        for field in dataclasses.fields(settings)
        if field.name in always or values[field.name] != default_of(field)
    }


def default_of(field: dataclasses.Field):
    """A dataclass field's default; for a field without one, a value nothing equals."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return object()


# The parts of a study file that decide what its rows mean, by the words a refusal names each with.
STUDY_PARTS = {
    "arms": "arms (their names, order, overrides or budgets)",
    "budget": "budget",
    "seeds": "seeds",
    "screen": "screen: block",
    "rule": "decision rule or baseline",
    "gates": "validity gates",
}


def study_identity(study) -> dict:
    """{"sha256": of the parts, "parts": {part: sha256}}: what a study's rows record of the study file. A field that
    mlmlab adds to the rule, the gates or the screen later enters only once a study sets it off its default, so
    adding one changes no study's identity (keyed_fields)."""
    parts = {
        "arms": [[arm.name, arm.overrides, arm.budget] for arm in study.arms],
        "budget": study.budget,
        "seeds": study.seeds,
        "screen": study.screen and keyed_fields(study.screen),
        "rule": {"baseline": study.baseline, "decision": study.decision and keyed_fields(study.decision)},
        "gates": study.gates and keyed_fields(study.gates),
    }
    hashes = {name: sha256_of(value)[:16] for name, value in parts.items()}
    return {"sha256": sha256_of(hashes)[:16], "parts": hashes}


def identity_changes(recorded: dict, current: dict) -> list[str]:
    """The words of each part of a study's identity that differs between two (STUDY_PARTS)."""
    return [words for part, words in STUDY_PARTS.items() if recorded["parts"].get(part) != current["parts"][part]]


def sha256_of(value) -> str:
    """The sha256 (hex) of a JSON value, its keys sorted."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
