"""The suite's guard against leaked global state (tests/conftest.py), run on a small suite of its own."""

from pathlib import Path

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


def test_a_leak_is_one_failure_in_the_test_that_leaked(pytester):
    """One leak shows as one failure naming the leaking test and what it left changed; the tests after it
    run against the state as it was."""
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_leaks=LEAKING_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaks_a_patched_accelerator*",
            "*left global state changed (now put back): mlmlab.train.launch.Accelerator",
            "*ERROR at teardown of test_leaks_tf32*",
            "*left global state changed (now put back): torch.backends.cudnn.allow_tf32",
        ]
    )
