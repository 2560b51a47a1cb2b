"""The documentation: a short README as the front door, pages under docs/ and the committed studies'
pages under studies/ with no dead links.

Reads files only: no package import, no training.
"""

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
STUDIES = ROOT / "studies"
README_MAX_LINES = 200

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)  # fenced code blocks
CODE_SPAN = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def pages() -> list[Path]:
    """The README, the top-level pages under docs/, and each committed study's README.md (its folder's and
    its subfolders') and report.md under studies/."""
    study_pages = [*STUDIES.glob("*/**/README.md"), *STUDIES.glob("*/report.md")]
    return [README, *sorted(DOCS.glob("*.md")), *sorted(study_pages)]


def prose(text: str) -> str:
    """The text without fenced code blocks or code spans, where brackets and parentheses are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def relative_links(text: str) -> list[str]:
    """Link targets that point into this repository (no scheme such as https: or mailto:)."""
    body = prose(text)
    targets = INLINE_LINK.findall(body) + REFERENCE_LINK.findall(body)
    return [t for t in targets if not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", t)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in a markdown page, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def dead_link(page: Path, target: str) -> str | None:
    """Why this link from page leads nowhere, or None when it resolves (file, folder, and heading anchor)."""
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    if not resolved.exists():
        return f"{page}: {target} (no such file or folder)"
    if anchor and resolved.is_file() and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"{page}: {target} (no heading #{anchor} in {resolved})"
    return None


def test_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move detail to a page under docs/ and link it"
    )


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dead_relative_links(page):
    dead = [
        why
        for target in relative_links(page.read_text(encoding="utf-8"))
        if (why := dead_link(page, target)) is not None
    ]
    assert not dead, "dead links:\n" + "\n".join(dead)


def test_every_top_level_page_is_linked_from_the_readme():
    linked = {
        (ROOT / target.partition("#")[0]).resolve() for target in relative_links(README.read_text(encoding="utf-8"))
    }
    orphans = [str(page.relative_to(ROOT)) for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert not orphans, f"pages under docs/ that the README does not link: {orphans}"


def test_study_outputs_live_under_studies():
    """docs/ holds the documents; a study's results sit under studies/<name>/."""
    assert not sorted(DOCS.rglob("results.jsonl")), "study outputs under docs/: move them to studies/<name>/"
    assert sorted(STUDIES.glob("*/results.jsonl")), "no committed study under studies/"


def readme_test_command() -> str:
    """The command under "Set up and run the tests:" in the README's "The two commands" section."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"Set up and run the tests:\s*```bash\n(.*?)\n```", section, re.S)
    assert block, "README.md: no bash block under 'Set up and run the tests:' in 'The two commands'"
    return block.group(1).strip()


def ci_test_command() -> str:
    """The line after .ci/run's '# --- README test command' marker."""
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    marker = next(i for i, line in enumerate(lines) if line.startswith("# --- README test command"))
    return lines[marker + 1].strip()


def test_the_testing_page_names_every_test_file():
    page = (ROOT / "docs" / "testing.md").read_text()
    missing = [path.name for path in sorted((ROOT / "tests").glob("test_*.py")) if f"`{path.name}`" not in page]
    assert not missing, f"docs/testing.md's table lacks {missing}"


def test_readme_test_command_is_the_one_ci_runs():
    assert readme_test_command() == ci_test_command()


def test_link_checker_sees_dead_links_and_ignores_code(tmp_path):
    """The checker itself: a dead file, a dead anchor and a live link told apart; code is not read as links."""
    (tmp_path / "there.md").write_text("# A heading, with `code`\n\n## Again\n\n## Again\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-heading-with-code) [ok](there.md#again-1) [web](https://example.org/x)\n"
        "[gone](missing.md) [bad anchor](there.md#nowhere) `[not](a-link.md)`\n"
        "```\n[nor](this.md)\n```\n[ref]: also-missing/\n",
        encoding="utf-8",
    )
    targets = relative_links(page.read_text(encoding="utf-8"))
    assert targets == [
        "there.md#a-heading-with-code",
        "there.md#again-1",
        "missing.md",
        "there.md#nowhere",
        "also-missing/",
    ]
    dead = [target for target in targets if dead_link(page, target)]
    assert dead == ["missing.md", "there.md#nowhere", "also-missing/"]


def fast_tiny_sweep():
    """studies/fast-tiny-sweep/pick.py, the sweep's rule over its rows (json only)."""
    spec = importlib.util.spec_from_file_location("fast_tiny_sweep_pick", STUDIES / "fast-tiny-sweep" / "pick.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sweep_rule_ties_within_a_hundredth_toward_the_lower_lr_and_never_picks_a_non_finite_cell():
    sweep = fast_tiny_sweep()
    losses = {cell: 5.5 for cell in sweep.CELLS}
    losses |= {"lr=0.003-rate=0.4": 5.300, "lr=0.002-rate=0.3": 5.305, "lr=0.001-rate=0.15": 5.0}
    rows = [
        {
            "arm": cell,
            "seed": seed,
            "eval": {"mlm_loss": float("nan") if (cell, seed) == ("lr=0.001-rate=0.15", 2) else loss},
        }
        for cell, loss in losses.items()
        for seed in sweep.SEEDS
    ]
    assert sweep.pick(rows) == (0.002, 0.3)
    with pytest.raises(ValueError, match="lr=0.003-rate=0.4 seed 2 missing"):
        sweep.pick(rows[:-1])


def test_fast_tiny_trains_at_the_lr_and_rate_its_sweep_picked():
    """The preset's LR and mask rate are the cell fast-tiny-sweep's pre-registered rule picks from the committed
    rows."""
    sweep = fast_tiny_sweep()
    preset = yaml.safe_load((ROOT / "mlmlab" / "configs" / "fast-tiny.yaml").read_text())
    assert (preset["train"]["lr"], preset["masking"]["rate"]) == sweep.pick(sweep.load_rows())
