"""A study's cost measured, not only estimated: a few real training steps of each arm, timed here.

FLOPs misprice what is not a matmul. The entropy scorer, for one, makes several elementwise
passes over (positions x vocabulary) logits: in the CPU study it cost 2.4x dynamic's wall
time where FLOPs said 1.7x. So the dry run can time ``steps`` steps of each arm (after
warm-up steps, from the arm's real config and data) and a few held-out batches, and
extrapolate each run's training and evaluation time; downstream.py times GLUE fine-tuning and probes.
"""

import dataclasses
import tempfile

from mlmlab.config import Config
from mlmlab.evaluate.perplexity import evaluate_mlm, evaluated_batches
from mlmlab.experiments.budget import evaluation_count
from mlmlab.train.loop import Trainer
from mlmlab.utils.devices import clock
from mlmlab.utils.progress import progress_bar

WARMUP_STEPS = 2  # thread pools, allocator, and ADM's first scoring step (a = 0 at step 0 scores nothing)
TIMED_EVAL_BATCHES = 2


def timed_run(cfg: Config, steps: int, show_progress: bool = False, label: str = "") -> dict:
    """{"step_seconds", "eval_batch_seconds", "eval_batches"} of ``cfg`` on this machine (nothing is kept);
    ``show_progress``: the data's preparation and the steps as bars on stderr."""
    with tempfile.TemporaryDirectory() as folder:
        probe = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, out_dir=folder, eval_every=0, save_every=0)
        )
        trainer = Trainer(probe, evaluator=evaluate_mlm, show_progress=show_progress)
        batches = trainer.batches()
        device = trainer.accelerator.device
        with progress_bar(f"time {label}", WARMUP_STEPS + steps, show_progress, unit="step") as bar:
            for _ in range(WARMUP_STEPS):
                trainer.train_step(batches)
                bar.update()
            start = clock(device)
            for _ in range(steps):
                trainer.train_step(batches)
                bar.update()
            step_seconds = (clock(device) - start) / steps
        eval_batches = evaluated_batches(len(trainer.valid_store), cfg.train.eval_batch_size, cfg.train.eval_batches)
        timed = min(TIMED_EVAL_BATCHES, eval_batches)
        start = clock(device)
        trainer.evaluate(timed)
        eval_batch_seconds = (clock(device) - start) / timed
    return {"step_seconds": step_seconds, "eval_batch_seconds": eval_batch_seconds, "eval_batches": eval_batches}


def run_minutes(cfg: Config, probed: dict) -> float:
    """Training plus held-out evaluations (every eval_every steps and at the end) of one run, in minutes."""
    seconds = (
        cfg.train.max_steps * probed["step_seconds"]
        + evaluation_count(cfg) * probed["eval_batches"] * probed["eval_batch_seconds"]
    )
    return seconds / 60
