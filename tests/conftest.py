import gzip
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite checks the CPU path, to the bit where it promises bits, on any machine: on a GPU host
# mlmlab would otherwise pick CUDA, where float atomics vary. tests/gpu_check.py checks the GPU path.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
SAMPLE = ROOT / "mlmlab" / "resources" / "sample"


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory):
    """Prepared data and tokenizers go to a fresh cache, never the user's."""
    os.environ["MLMLAB_CACHE"] = str(tmp_path_factory.mktemp("mlmlab-cache") / "prepared")


@pytest.fixture(autouse=True)
def fp32_on_every_host(monkeypatch):
    """train.precision=auto picks bf16 on CPUs with AMX: here every CPU reads as one without, so what
    the tests check does not depend on the host (the commands test_distributed starts pin fp32 instead).
    The detection itself is tested with its own patch."""
    from mlmlab.utils.devices import cpu_features
    from mlmlab.train import launch

    monkeypatch.setattr(launch, "cpu_features", lambda: {**cpu_features(), "amx_bf16": False})


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
def sample_paragraphs():
    """Real Wikipedia paragraphs from the bundled sample (body lines of <doc> blocks)."""
    with gzip.open(SAMPLE / "train.txt.gz", "rt", encoding="utf-8") as handle:
        return [line.strip() for line in handle if len(line) > 200 and not line.startswith("<")]
