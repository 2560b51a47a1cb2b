"""docs/architecture.md's "where to add", done: a throwaway architecture and a throwaway masking strategy, each
added to a copy of the package as that page says, train; the files each one touched are counted."""

import filecmp
import os
import shutil
import subprocess
from pathlib import Path

from conftest import ROOT, TINY_RUN, pretrain_command
from safetensors.torch import load_file

RUN = [*TINY_RUN, "train.batch_size=4", "train.max_steps=2", "train.eval_batches=1"]

# BERT under a model_type of its own: the least an architecture module can be.
ARCHITECTURE_MODULE = '''"""A throwaway architecture: BERT's classes under the model_type "throwaway"."""

from transformers import BertConfig, BertForPreTraining

from mlmlab.model.architectures.bert import Bert


class ThrowawayConfig(BertConfig):
    model_type = "throwaway"


class ThrowawayForPreTraining(BertForPreTraining):
    config_class = ThrowawayConfig


class Throwaway(Bert):
    name = "throwaway"
    label = "Throwaway"
    model_class = ThrowawayForPreTraining

    @staticmethod
    def config(cfg, vocab_size, pad_token_id):
        settings = Bert.config(cfg, vocab_size, pad_token_id).to_dict()
        settings.pop("model_type")
        return ThrowawayConfig(**settings)


ARCHITECTURE = Throwaway
'''

# Targets at odd positions only: a strategy's weights, its class and its entry.
STRATEGY_CODE = '''

class OddPositions(UniformStrategy):
    """Weight 1 at odd positions, 0 at even ones."""

    def weights(self, model, batch, progress, epoch_key=0, step=1):
        ids = batch["input_ids"]  # (B, T)
        return (torch.arange(ids.size(1), device=ids.device) % 2).float().expand_as(ids)  # (B, T)


STRATEGY_ENTRIES["odd-positions"] = StrategyEntry(
    "odd-positions", build=lambda cfg, info, vocab_size, counts: OddPositions(cfg, vocab_size, counts)
)
'''


def package_copy(folder: Path) -> Path:
    """A copy of the mlmlab package in ``folder`` (caches left out)."""
    shutil.copytree(ROOT / "mlmlab", folder / "mlmlab", ignore=shutil.ignore_patterns("__pycache__"))
    return folder / "mlmlab"


def named_in_choices(package: Path, names: str, name: str) -> None:
    """``name`` added to the list ``names`` of the copy's choices.py."""
    path = package / "choices.py"
    text = path.read_text()
    assert f"\n{names} = [" in text, f"choices.{names} is no longer a list literal"
    path.write_text(text.replace(f"\n{names} = [", f'\n{names} = ["{name}", ', 1))


def touched(package: Path) -> list[str]:
    """The files of the copy that differ from the package's or are new."""

    def walk(compared: filecmp.dircmp, prefix: str) -> list[str]:
        found = [prefix + name for name in compared.diff_files + compared.right_only if name != "__pycache__"]
        for name, sub in compared.subdirs.items():
            if name != "__pycache__":
                found += walk(sub, f"{prefix}{name}/")
        return found

    return sorted(walk(filecmp.dircmp(ROOT / "mlmlab", package), "mlmlab/"))


def trains(folder: Path, *overrides: str) -> Path:
    """The run folder of a tiny run of the package copy in ``folder`` under ``overrides``."""
    run = folder / "run"
    env = {**os.environ, "PYTHONPATH": str(folder), "HF_HUB_OFFLINE": "1"}
    argv = pretrain_command(*RUN, *overrides, f"train.out_dir={run}")
    done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def test_an_architecture_is_one_module_and_its_name(tmp_path):
    package = package_copy(tmp_path)
    (package / "model" / "architectures" / "throwaway.py").write_text(ARCHITECTURE_MODULE)
    named_in_choices(package, "ARCHITECTURES", "throwaway")
    assert touched(package) == ["mlmlab/choices.py", "mlmlab/model/architectures/throwaway.py"]
    run = trains(tmp_path, "model.architecture=throwaway")
    assert '"model_type": "throwaway"' in (run / "model" / "config.json").read_text()
    assert "# Throwaway L1/H32" in (run / "model" / "README.md").read_text()
    assert load_file(run / "model" / "model.safetensors")  # the weights were written


def test_a_strategy_is_its_entry_and_its_name(tmp_path):
    package = package_copy(tmp_path)
    strategies = package / "masking" / "strategies.py"
    strategies.write_text(strategies.read_text() + STRATEGY_CODE)
    named_in_choices(package, "STRATEGIES", "odd-positions")
    assert touched(package) == ["mlmlab/choices.py", "mlmlab/masking/strategies.py"]
    run = trains(tmp_path, "masking.strategy=odd-positions")
    assert "masking strategy: `odd-positions`" in (run / "model" / "README.md").read_text()
