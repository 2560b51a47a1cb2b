"""Strict JSON for every file and line mlmlab writes.

json.dumps writes NaN and infinities as bare ``NaN`` / ``Infinity``, which is not JSON:
strict readers (jq, JavaScript, pandas' default engine) reject the whole file. An undefined
metric (the perplexity of an empty frequency bucket, Pearson of a constant prediction) is
written as ``null`` instead.
"""

import json
import math
from pathlib import Path

from mlmlab.errors import UserError


def finite_or_none(value):
    """``value`` with every NaN or infinite float replaced by None, recursively."""
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def dumps(value, **kwargs) -> str:
    """json.dumps of ``value`` with undefined numbers as null; raises rather than write bare NaN."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)


def json_lines(text: str) -> list[tuple[int, dict | None]]:
    """(line number, record) of each non-blank line of a JSON-lines text; the record is None where the line is
    no JSON object (cut short by a kill, or damaged since)."""
    return [(number, object_or_none(line)) for number, line in enumerate(text.splitlines(), 1) if line.strip()]


def object_or_none(line: str) -> dict | None:
    """A JSON-lines line as a dict; None for one that is not."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def read_json_file(path: Path, again: str):
    """A JSON file's value; a file that cannot be read, is cut short or is not UTF-8 JSON raises a UserError naming
    it, then ``again`` (what to do)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is truncated or not JSON ({err}); {again}") from None
    except OSError as err:
        raise UserError(f"cannot read {path} ({err.strerror}); {again}") from None
