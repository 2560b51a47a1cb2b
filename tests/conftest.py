import gzip
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite checks the CPU path, to the bit where it promises bits, on any machine: on a GPU host
# mlmlab would otherwise pick CUDA, where float atomics vary. tests/gpu_check.py checks the GPU path.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# In a pytest-xdist worker (pyproject's addopts: -n 2), torch and every run the worker starts train on one thread: two
# workers then use a core each, where two thread pools on two cores would spin at each barrier for a thread the other
# worker holds (launch.time_bf16_speedup's note). Set before torch is first imported here.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
# The project's data folder beside the repository (docs/data.md says where each of its folders comes from). A clone
# has none: every test that reads it is marked shared_data(FOLDER, ...) and skipped, naming the folder, where one is
# absent; .ci/run runs those tests in a copy of the repository with no ../shared beside it and requires the skips.
SHARED_DATA = ROOT.parent / "shared" / "data"
SAMPLE = ROOT / "mlmlab" / "resources" / "sample"
SHARED_MARK = "shared_data"
STUDY_PRESETS = ROOT / "mlmlab" / "configs" / "studies"
CORPUS = SAMPLE / "valid.txt.gz"  # 0.4 MB of text: prepares in about a second

# The suite's tiny model as model.* overrides: one layer of 32 wide, two heads (tiny_encoder's shape).
TINY_MODEL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64"]
# A run that trains a step of it in well under a second: the small validation sample to train and hold out on, in
# blocks (or NSP pairs) of 64 tokens, no evaluation during training, fp32 named (a run in a subprocess does not get
# fp32_on_every_host's patch). No model.* key: a run that starts from a folder (train.init) takes its model from it.
QUICK_RUN = [
    "train.batch_size=8",
    "train.eval_batches=2",
    "train.eval_every=0",
    "train.warmup_steps=1",
    "train.log_every=1",
    "train.precision=fp32",
    "data.loader_workers=0",
    f"data.corpus={CORPUS}",
    f"data.valid_corpus={CORPUS}",
    "data.max_seq_length=64",
]
# The tiny model's quick run. A test adds what it is about after it: a later key=value of the same key wins.
TINY_RUN = [*TINY_MODEL, *QUICK_RUN]


def pytest_configure(config):
    config.addinivalue_line("markers", f"{SHARED_MARK}(*folders): reads these folders of {SHARED_DATA}")
    sys.addaudithook(audit_shared_reads)  # for the whole process: an audit hook cannot be removed


def pytest_collection_modifyitems(items):
    """A test marked shared_data(FOLDER, ...) is skipped, naming the first folder missing, where one is absent."""
    for item in items:
        marks = list(item.iter_markers(SHARED_MARK))
        if any(not mark.args for mark in marks):
            raise pytest.UsageError(f"{item.nodeid}: name the folders of {SHARED_DATA} it reads in {SHARED_MARK}(...)")
        missing = [SHARED_DATA / name for mark in marks for name in mark.args if not (SHARED_DATA / name).is_dir()]
        if missing:
            item.add_marker(pytest.mark.skip(reason=f"{missing[0]} is not there: the project's data (docs/data.md)"))


# A test that reads ../shared/data without naming the folder in its shared_data mark passes here and fails in a
# user's clone, and CI's clone-alone step runs only the marked tests, so it would never be seen: the read itself is
# caught instead. An audit hook sees each file this process opens or lists, and each command it starts, while a test
# runs; the test then fails naming the folder. A subprocess's own reads (and the Rust tokenizers') are not seen.
AUDITED_EVENTS = {"open", "os.listdir", "os.scandir", "subprocess.Popen"}
running_test: dict = {"item": None, "reads": set()}


def shared_folder(name, cwd=None) -> str | None:
    """The folder of SHARED_DATA that the path ``name`` (or a ``key=path`` override naming one) lies in, else None."""
    if isinstance(name, int):  # a file descriptor: its path was seen when it was opened
        return None
    text = os.fsdecode(name) if isinstance(name, (str, bytes, os.PathLike)) else None
    if text is None:
        return None
    text = text.partition("=")[2] if "=" in text and not os.path.exists(text) else text
    try:
        relative = Path(os.path.abspath(os.path.join(cwd or os.getcwd(), text))).relative_to(SHARED_DATA)
    except ValueError:
        return None
    return relative.parts[0] if relative.parts else "."


def audit_shared_reads(event: str, args: tuple) -> None:
    if running_test["item"] is None or event not in AUDITED_EVENTS:
        return
    if event == "subprocess.Popen":
        _, command, cwd, _ = args
        names = [command] if isinstance(command, (str, bytes, os.PathLike)) else list(command or [])
        folders = {shared_folder(name, os.fsdecode(cwd) if cwd else None) for name in names}
    else:
        folders = {shared_folder(args[0])}
    running_test["reads"].update(folders - {None})


def undeclared_shared_reads(item) -> list[str]:
    """The folders of SHARED_DATA the running test read that its shared_data marks do not name."""
    declared = {name for mark in item.iter_markers(SHARED_MARK) for name in mark.args}
    return sorted(running_test["reads"] - declared)


def corpus_folders(study: str) -> list[str]:
    """The folders of ../shared/data the study preset ``study`` trains and holds out on (its data.corpus and
    data.valid_corpus): what planning its runs reads, to hash their data."""
    text = (STUDY_PRESETS / f"{study}.yaml").read_text(encoding="utf-8")
    return list(dict.fromkeys(re.findall(r"corpus:.*?\.\./shared/data/([\w.-]+)", text)))


def shipped_study(name: str):
    """The study preset ``name`` as a test parameter that plans its runs: marked with its corpus_folders."""
    folders = corpus_folders(name)
    return pytest.param(name, marks=[pytest.mark.shared_data(*folders)] if folders else [], id=name)


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory):
    """Prepared data and tokenizers go to a fresh cache, never the user's."""
    os.environ["MLMLAB_CACHE"] = str(tmp_path_factory.mktemp("mlmlab-cache") / "prepared")


def global_state() -> dict:
    """Process-wide settings a test could change and forget: each a (read, write back) pair."""
    import torch

    from mlmlab.train import launch

    def attribute(owner, name):
        return lambda: getattr(owner, name), lambda value: setattr(owner, name, value)

    return {
        "mlmlab.train.launch.Accelerator": attribute(launch, "Accelerator"),
        "mlmlab.train.launch.cpu_bf16_speedup": attribute(launch, "cpu_bf16_speedup"),
        "torch.cuda.is_available": attribute(torch.cuda, "is_available"),
        "torch.backends.cuda.matmul.allow_tf32": attribute(torch.backends.cuda.matmul, "allow_tf32"),
        "torch.backends.cudnn.allow_tf32": attribute(torch.backends.cudnn, "allow_tf32"),
        "torch default dtype": (torch.get_default_dtype, torch.set_default_dtype),
        "torch threads": (torch.get_num_threads, torch.set_num_threads),
        "torch deterministic algorithms": (
            torch.are_deterministic_algorithms_enabled,
            torch.use_deterministic_algorithms,
        ),
    }


STATE_BEFORE = pytest.StashKey[dict]()


# As hooks, not a fixture: the state is read before the test's first fixture is set up and compared after its
# last one is torn down, whatever order pytest gives fixtures (autouse ones go by name).
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[STATE_BEFORE] = {name: read() for name, (read, _) in global_state().items()}
    running_test.update(item=item, reads=set())
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """One leak is one failure, in the test that leaked: the state is put back, then the test fails naming
    what it left changed, instead of every later test failing for a reason far from its own code. A read of
    SHARED_DATA its marks do not name fails it too."""
    result = yield
    undeclared = undeclared_shared_reads(item)
    running_test.update(item=None, reads=set())
    before, state = item.stash.get(STATE_BEFORE, {}), global_state()
    changed = [name for name, value in before.items() if state[name][0]() != value]
    for name in changed:
        state[name][1](before[name])
    problems = [f"the test left global state changed (now put back): {', '.join(changed)}"] if changed else []
    if undeclared:
        marks = ", ".join(repr(name) for name in undeclared)
        problems.append(f"the test read {SHARED_DATA} without naming it: mark it shared_data({marks})")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
    return result


@pytest.fixture(autouse=True)
def fp32_on_every_host(monkeypatch):
    """train.precision=auto picks bf16 on CPUs whose bf16 matmuls measure clearly faster: here every CPU
    reads as one where bf16 is no faster, so what the tests check does not depend on the host (the commands
    test_distributed starts pin fp32 instead). The measurement itself is tested with its own patch."""
    from mlmlab.train import launch

    monkeypatch.setattr(launch, "cpu_bf16_speedup", lambda: 1.0)


@pytest.fixture(scope="module")
def no_progress_bars():
    """As on a command line: there mlmlab.cli sets HF_HUB_DISABLE_PROGRESS_BARS before transformers is
    imported, which reads it once; in this process it was imported earlier."""
    from mlmlab.evaluate.glue import progress_bars_off

    with progress_bars_off():
        yield


@pytest.fixture(scope="session")
def bert_tokenizer(tmp_path_factory):
    from mlmlab.data.tokenizer import adopt_vocab, load_tokenizer

    return load_tokenizer(adopt_vocab(SAMPLE / "vocab.txt", tmp_path_factory.mktemp("tok") / "uncased"))


@pytest.fixture(scope="session")
def trained_tokenizers(tmp_path_factory) -> dict:
    """{kind: tokenizer folder} of every kind of choices.TOKENIZER_KINDS, each trained through `mlmlab tokenizer`
    on the bundled validation sample: 2,000 tokens, a second each."""
    from mlmlab import choices
    from mlmlab.cli import main

    root = tmp_path_factory.mktemp("tokenizers")
    for kind in choices.TOKENIZER_KINDS:
        argv = ["tokenizer", "--kind", kind, "--corpus", str(CORPUS), "--vocab-size", "2000", "--out", str(root / kind)]
        assert main([*argv, "--no-progress"]) == 0
    return {kind: root / kind for kind in choices.TOKENIZER_KINDS}


@pytest.fixture(scope="session")
def sample_paragraphs():
    """Real Wikipedia paragraphs from the bundled sample (body lines of <doc> blocks)."""
    with gzip.open(SAMPLE / "train.txt.gz", "rt", encoding="utf-8") as handle:
        return [line.strip() for line in handle if len(line) > 200 and not line.startswith("<")]


def tiny_encoder(tokenizer, **entries) -> dict:
    """The config entries (transformers' names) of the suite's tiny encoders: one layer of 32 wide, two heads, the
    tokenizer's vocabulary and padding id; ``entries`` add to them or replace them."""
    shape = dict(num_hidden_layers=1, num_attention_heads=2, hidden_size=32, intermediate_size=64)
    return {"vocab_size": len(tokenizer), **shape, "pad_token_id": tokenizer.pad_token_id, **entries}


PMI_TEST_VOCAB = 2000  # masking.pmi_vocab_size of every test that masks n-grams: one vocabulary, built once


@pytest.fixture(scope="session")
def sample_store():
    """The bundled training sample, prepared as a default run prepares it (the session's cache, shared with the
    runs of other tests)."""
    from mlmlab.config import DataConfig
    from mlmlab.data.resolve import prepare_datasets

    return prepare_datasets(DataConfig())[0]


def pretrain_command(*overrides: str) -> list[str]:
    """`mlmlab pretrain` with ``overrides`` as a command for a fresh interpreter (subprocess.run): what a test that
    kills or signals a run starts. In this process, ``main(["pretrain", "--no-progress", ...])`` runs the same."""
    return [sys.executable, "-m", "mlmlab.cli", "pretrain", "--no-progress", *overrides]


def one_line_error(argv: list[str], capsys) -> str:
    """The error line of ``mlmlab ARGV`` run in this process, which must exit 2 with exactly one error line
    (after any lines for people: the run's precision, "starting from the weights of")."""
    from mlmlab.cli import main

    code = main(argv)
    said = capsys.readouterr().err
    err = said.splitlines()[-1]
    assert code == 2 and err.startswith("mlmlab: error: ") and said.count("mlmlab: error") == 1, said
    return err


def _newest_step(run_dir: Path) -> int:
    from mlmlab.train import run_folder

    found = run_folder.complete_checkpoints(run_dir, check=False)
    return int(found[-1].name.split("-")[1]) if found else 0


def _final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model" / "model.safetensors"))


def assert_killed_run_resumes_bitwise(tmp_path: Path, command, steps: int = 10) -> None:
    """command(out_dir, steps) (a pretrain_command) trained straight, and again SIGKILLed after a random checkpoint
    then resumed, ends in the same weights bit for bit."""
    import torch

    # The straight run trains beside the other (their folders apart; prepared data is published by a rename either
    # may win): most of a tiny run is its interpreter's imports, one core's work, so the pair takes little longer
    # than one run. Its output goes to a file: a pipe nobody reads would stall it once full.
    with open(tmp_path / "straight.log", "w") as log:
        straight_run = subprocess.Popen(command(tmp_path / "straight", steps), stdout=log, stderr=subprocess.STDOUT)
    try:
        _kill_and_resume(command, tmp_path / "killed", steps)
        assert straight_run.wait() == 0, (tmp_path / "straight.log").read_text()[-2000:]
    finally:
        straight_run.kill()
    straight, again = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "killed")
    assert straight.keys() == again.keys() and all(torch.equal(straight[name], again[name]) for name in straight)


def _kill_and_resume(command, run_dir: Path, steps: int) -> None:
    """command(run_dir, steps) SIGKILLed after a random checkpoint, then run again to its end: it must resume."""
    import numpy as np

    kill_at = int(np.random.default_rng().integers(2, steps - 2) // 2 * 2) or 2
    proc = subprocess.Popen(command(run_dir, steps), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while _newest_step(run_dir) < kill_at and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "model").exists(), "the run finished before it was killed"
    resumed = subprocess.run(command(run_dir, steps), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout + resumed.stderr
