"""The suite's guards (tests/conftest.py) against leaked global state and against reads of ../shared/data that a
test's marks do not name, each run on a small suite of its own: one pytest process runs both."""

import subprocess
import sys
from pathlib import Path

import pytest

LEAKING_SUITE = """
import torch

from mlmlab.train import launch


def test_leaks_a_patched_accelerator():
    launch.Accelerator = object


def test_leaks_tf32():
    torch.backends.cudnn.allow_tf32 = not torch.backends.cudnn.allow_tf32


def test_after_the_leaks_sees_the_real_state():
    from accelerate import Accelerator

    assert launch.Accelerator is Accelerator
"""

SHARED_READING_SUITE = """
import subprocess
import sys
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus" / "train.txt"


def test_reads_it_unmarked():
    CORPUS.read_text()


@pytest.mark.shared_data("glue")
def test_reads_another_folder_than_its_mark_names():
    CORPUS.read_text()


def test_starts_a_command_naming_it():
    subprocess.run([sys.executable, "-c", "pass", f"data.corpus={CORPUS}"], check=True)


@pytest.mark.shared_data("corpus")
def test_reads_the_folder_its_mark_names():
    CORPUS.read_text()


def test_reads_its_own_files(tmp_path):
    (tmp_path / "train.txt").write_text("text")
    (tmp_path / "train.txt").read_text()
"""


@pytest.fixture(scope="module")
def guarded_run(tmp_path_factory) -> str:
    """pytest's report (-rA) of the two small suites in a repository laid out as this one is: repo/tests/ with this
    conftest, beside shared/data/ with the folders corpus/ (one file) and glue/."""
    root = tmp_path_factory.mktemp("guarded")
    for folder in ("corpus", "glue"):
        (root / "shared" / "data" / folder).mkdir(parents=True)
    (root / "shared" / "data" / "corpus" / "train.txt").write_text("text")
    tests = root / "repo" / "tests"
    tests.mkdir(parents=True)
    (tests / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    (tests / "test_leaks.py").write_text(LEAKING_SUITE)
    (tests / "test_reads.py").write_text(SHARED_READING_SUITE)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "repo/tests"]
    return subprocess.run(command, cwd=root, capture_output=True, text=True).stdout


def outcomes(report: str, module: str) -> dict[str, str]:
    """{test name: PASSED, FAILED or ERROR} of ``module``'s tests, from the report's short summary: a test whose call
    passed and whose teardown failed is listed twice there, and is an ERROR."""
    results = {}
    for line in report.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "ERROR", "FAILED") and f"{module}::" in rest:
            name = rest.split("::")[1].split(" ")[0]
            results[name] = word if results.get(name, "PASSED") == "PASSED" else results[name]
    return results


def test_a_leak_is_one_failure_in_the_test_that_leaked(guarded_run):
    """One leak shows as one failure naming the leaking test and what it left changed; the tests after it
    run against the state as it was."""
    assert outcomes(guarded_run, "test_leaks.py") == {
        "test_leaks_a_patched_accelerator": "ERROR",
        "test_leaks_tf32": "ERROR",
        "test_after_the_leaks_sees_the_real_state": "PASSED",
    }, guarded_run
    assert "left global state changed (now put back): mlmlab.train.launch.Accelerator" in guarded_run
    assert "left global state changed (now put back): torch.backends.cudnn.allow_tf32" in guarded_run


def test_a_read_of_the_shared_data_its_mark_does_not_name_fails_the_test(guarded_run):
    """A test reading ../shared/data unmarked (or under a mark naming another folder, or starting a command that
    names it) fails naming the folder to mark: in a clone it would fail, and CI's clone-alone step runs only the
    marked tests."""
    assert outcomes(guarded_run, "test_reads.py") == {
        "test_reads_it_unmarked": "ERROR",
        "test_reads_another_folder_than_its_mark_names": "ERROR",
        "test_starts_a_command_naming_it": "ERROR",
        "test_reads_the_folder_its_mark_names": "PASSED",
        "test_reads_its_own_files": "PASSED",
    }, guarded_run
    # Counted in the error reports only: the short summary repeats the message where the terminal is wide enough.
    error_reports = guarded_run.partition("short test summary info")[0]
    assert error_reports.count("without naming it: mark it shared_data('corpus')") == 3
