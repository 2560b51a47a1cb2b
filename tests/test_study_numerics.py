"""A study under way must not change what its runs compute.

rate-schedule-v4 grows over many sessions while code lands beside it. Its runner refuses a changed
config or prepared-data hash, but not a change in what the same config computes (a masking,
loss, optimizer or data-preparation change). This trains a few steps of the study's own arm
configs, on its own prepared data, and compares with values recorded from the code its first
runs were made with: the prepared shards' bytes (every host), every loss (every host, to 1e-5),
the held-out evaluation of the trained weights on a few batches of the study's fixed masks (every
host to 1e-5), and the final weights and that evaluation bit for bit on the host kinds recorded
(fp32 kernels differ by CPU). The runs' keys are recorded too: a changed key would make the
runner train a finished run again.

When a change is meant to alter the numbers, the study cannot go on with it: finish or close
the study first. Recording (only for a new study, or a host kind not yet recorded):

    python tests/test_study_numerics.py --record
"""

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from mlmlab.utils.restoring import restoring

pytestmark = pytest.mark.shared_data("enwiki_sample")  # the study's corpus

STUDY = "rate-schedule-v4"
# One arm per code path its arms take: uniform masks, a rate schedule, ADM's entropy scorer.
ARMS = ("dynamic", "ankner-decay", "adm-entropy")
STEPS = 20  # at 6, ADM's near-uniform entropy at initialisation drew the same masks as dynamic: no guard of its path
EVAL_BATCHES = 3  # of the study's held-out split, under its fixed uniform 15% masks
WARMUP = 2  # the study's warmup (100 steps) would keep 6 steps near LR 0, where an optimizer change hardly shows
RECORDED = Path(__file__).resolve().parent / "data" / f"{STUDY}-numerics.json"
RECORDED_THREADS = 2  # the weights were recorded with torch's default on a 2-core machine
ROOT = Path(__file__).resolve().parent.parent


def host_kind() -> str:
    """What fp32 bits depend on: torch's kernel level and the CPU (the thread count is pinned: RECORDED_THREADS)."""
    from mlmlab.utils.devices import cpu_features

    features = cpu_features()
    return f"{features['torch_capability']} {features['model']}"


def guarded_config(arm: str, out_dir: Path):
    """The study's config of ``arm`` at its first seed, cut to STEPS steps (WARMUP of them warmup), a log line each."""
    from mlmlab.experiments.running.runner import arm_config
    from mlmlab.experiments.study import load_study

    study = load_study(STUDY)
    cfg, seed = arm_config(study, next(a for a in study.arms if a.name == arm)), study.seeds[0]
    return dataclasses.replace(
        cfg,
        masking=dataclasses.replace(cfg.masking, seed=seed),
        data=dataclasses.replace(cfg.data, loader_workers=0),  # the batches are the same with or without a worker
        train=dataclasses.replace(
            cfg.train,
            seed=seed,
            max_steps=STEPS,
            warmup_steps=WARMUP,
            log_every=1,
            eval_every=0,
            save_every=0,
            out_dir=str(out_dir),
        ),
    )


def numbers(arm: str, out_dir: Path) -> dict:
    """What the arm computes: its prepared shards' sha256, every logged loss, the final weights' sha256 and their
    held-out evaluation (the study's own evaluator, the figures every row's eval.* comes from)."""
    from mlmlab.evaluate.perplexity import evaluate_mlm
    from mlmlab.train.loop import Trainer

    trainer = Trainer(guarded_config(arm, out_dir), evaluator=None, show_progress=False)
    # fp32 sums split by thread: under OMP_NUM_THREADS=1 the bits would differ
    with restoring(torch.get_num_threads, torch.set_num_threads, RECORDED_THREADS):
        trainer.train()
        held_out = evaluate_mlm(
            trainer.model,
            trainer.valid_store,
            trainer.masker.info,
            batch_size=trainer.cfg.train.eval_batch_size,
            max_batches=EVAL_BATCHES,
        )
    records = [json.loads(line) for line in trainer.metrics.path.read_text().splitlines()]
    weights = hashlib.sha256()
    for name, tensor in sorted(trainer.model.state_dict().items()):
        weights.update(name.encode() + tensor.detach().cpu().numpy().tobytes())
    return {
        "shards": shard_digest(trainer.train_store.path),
        "losses": [[r["loss"], r["mlm_loss"]] for r in records if "loss" in r],
        "weights": weights.hexdigest(),
        "eval": [held_out["mlm_loss"], held_out["mlm_accuracy"], held_out["masked_tokens"]],
    }


def shard_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*.npy")):
        digest.update(path.relative_to(folder).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def computed(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.chdir(ROOT)  # the study's paths are relative to the repository root
    folder = tmp_path_factory.mktemp("numerics")
    return {arm: numbers(arm, folder / arm) for arm in ARMS}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.mark.parametrize("arm", ARMS)
def test_the_study_config_computes_what_its_first_runs_computed(computed, arm):
    recorded = json.loads(RECORDED.read_text())
    expected = recorded["hosts"].get(host_kind()) or next(iter(recorded["hosts"].values()))
    got, want = computed[arm], expected[arm]
    assert got["shards"] == want["shards"], "the study's prepared data changed (data preparation code)"
    assert flat(got["losses"]) == pytest.approx(flat(want["losses"]), rel=1e-5), "the study's losses changed"
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-5), "the study's held-out evaluation changed"
    if host_kind() in recorded["hosts"]:  # fp32 bits are only comparable on the host kind they were made on
        assert got["weights"] == want["weights"], "the study's weights changed bit for bit on a recorded host kind"
        assert got["eval"] == want["eval"], (
            "the study's held-out evaluation changed bit for bit on a recorded host kind"
        )


def test_the_study_keys_its_runs_as_its_first_runs_did(monkeypatch):
    """Every run's key (what results.jsonl is looked up by): unchanged, or finished runs would train again."""
    monkeypatch.chdir(ROOT)
    assert planned_keys() == json.loads(RECORDED.read_text())["run_keys"]


def planned_keys() -> list[str]:
    from mlmlab.experiments.running.runner import plan_runs
    from mlmlab.experiments.study import load_study

    return sorted(run.key for run in plan_runs(load_study(STUDY)))


def flat(losses: list[list[float]]) -> list[float]:
    """[[loss, mlm_loss] per step] -> one list, as pytest.approx compares."""
    return [value for step in losses for value in step]


def record() -> None:
    """Add this host kind's numbers to RECORDED (run from the repository root, with the study's data)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        got = {arm: numbers(arm, Path(folder) / arm) for arm in ARMS}
    recorded = json.loads(RECORDED.read_text()) if RECORDED.is_file() else {"study": STUDY, "hosts": {}}
    recorded.setdefault("run_keys", planned_keys())  # a study's keys are the same on every host
    recorded["hosts"][host_kind()] = got
    RECORDED.parent.mkdir(exist_ok=True)
    RECORDED.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"recorded {STUDY} numerics for {host_kind()} in {RECORDED}")


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    record()
