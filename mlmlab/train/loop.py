"""The pretraining loop: mask, step, log, evaluate, checkpoint.

One step = ``grad_accum`` micro-batches per process (fewer during a batch warmup). All micro-batches of a step are
masked first, so the MLM loss can be normalised by the number of masked tokens of the
whole global batch (all micro-batches, all ranks): the gradient then equals that of
one big batch, whatever the split.

The Trainer only trains. What it calls owns its own part, torchtitan-style: the masking
(``masking/masker.py``: one call masks a step's micro-batches, one learns from their results), a step's forwards,
backwards and the sums the processes agree on (``step.py``), the launch
(``launch.py``), what a checkpoint holds and how a resume restores it (``checkpointer.py``), the run
folder and the checkpoint files (``run_folder.py``), the start from another model's weights (``init.py``),
the final model folder and its card (``model_card.py``), the metrics files (``metrics.py``), the LR
schedule (``optim.py``), stop signals (``utils/signals.py``), and held-out evaluation,
which the caller hands over as ``evaluator`` (a function with the signature of
``evaluate.perplexity.evaluate_mlm``; evaluation sits in a higher layer than training). A caller that
watches the run as it goes (a benchmark evaluating at wall-clock intervals, stopping at a target loss)
hands over ``on_step_end`` instead of driving the steps itself.
"""

import math
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
from accelerate.utils import DistributedType

from mlmlab import choices
from mlmlab.config import Config, TrainConfig, report_targets
from mlmlab.data.loader import iterate_batches
from mlmlab.data.resolve import prepare_datasets
from mlmlab.errors import UserError
from mlmlab.masking.masker import Masker
from mlmlab.masking.strategies import refuse_other_strategies_settings
from mlmlab.model.architectures import check_config
from mlmlab.model.folder import record_held_out_form
from mlmlab.model.pretraining import COMPILED_LENGTH_MULTIPLE, SparsePretraining
from mlmlab.train import run_folder
from mlmlab.train.checkpointer import Checkpointer, resume_notes
from mlmlab.train.init import initial_model, resolve_init
from mlmlab.train.launch import (
    concat_over_processes,
    fused_head_on,
    make_accelerator,
    resolve_precision,
    say_precision,
    sum_over_processes,
)
from mlmlab.train.memory import refuse_unfitting
from mlmlab.train.metrics import MetricsWriter, run_summary
from mlmlab.train.mfu import MeasuredPeak, SpeedWindow
from mlmlab.train.model_card import write_finished_run
from mlmlab.train.optim import (
    build_optimizer,
    learning_rate,
    micro_batches_at,
    refuse_warmup_without_decay,
    set_lr,
    training_progress,
    work_done,
)
from mlmlab.train.run_state import TrainerState
from mlmlab.train.step import StepSums, forwards_and_backwards, full_norm
from mlmlab.train.trackers import finish_trackers, start_trackers
from mlmlab.utils.progress import Pace, progress_bar, say, say_once
from mlmlab.utils.signals import StopRequest


def progress_line(cfg: TrainConfig, step: int, progress: float, loss: float, evaluation: dict, pace: Pace) -> str:
    """The bar's news as one line, at each evaluation, where stderr is a log file and no bar is drawn."""
    budget = f" of a {cfg.max_minutes:g}-minute budget" if cfg.max_minutes > 0 else f"/{cfg.max_steps}"
    held_out = (
        f"; held-out MLM loss {evaluation['mlm_loss']:.3f}, accuracy {evaluation['mlm_accuracy']:.3f}"
        if {"mlm_loss", "mlm_accuracy"} <= evaluation.keys()
        else ""
    )
    time_left = pace.time_left(work_done(cfg, step, progress))
    return f"step {step}{budget} ({progress:.0%}): loss {loss:.3f}{held_out}{time_left}"


def non_finite_stop(state: TrainerState, run_dir: Path) -> str:
    """Why training stopped on non-finite losses, what it can be and what is kept: only what is true of this run."""
    saved = run_folder.complete_checkpoints(run_dir, check=False)
    kept = f"its checkpoints are kept, the newest {saved[-1]}" if saved else f"{run_dir} holds no checkpoint of it"
    cause = (
        "lower train.lr (or set train.max_grad_norm), or look for a damaged batch in the data"
        if state.ever_updated
        else "every loss of the run was non-finite, before any update changed the weights, so train.lr is not the "
        "cause: a model.* setting, train.precision or train.init's weights make the forward pass overflow (compare "
        "the config with a preset that trains: mlmlab config)"
    )
    return f"{state.bad_steps} non-finite losses in a row up to step {state.step + 1}; {cause}; {kept}"


def any_process(accelerator, flag: bool) -> bool:
    """Whether ``flag`` is set on any process: what all of them then act on together."""
    return sum_over_processes(accelerator, torch.tensor([float(flag)])).item() > 0


def prepared_model(cfg: Config, tokenizer, accelerator, folder: Path | None) -> tuple:
    """(model, module, optimizer): the model (with the checkpoint's weights when resuming from ``folder``), the
    pretraining module around it and its optimizer, the last two prepared by accelerate."""
    model = initial_model(cfg, tokenizer, resuming=folder is not None, log=partial(say_once, accelerator))
    record_held_out_form(model.config, cfg)  # every model folder of the run says how its held-out set was measured
    module = SparsePretraining(
        model,
        use_nsp=cfg.data.objective == choices.NSP,
        length_multiple=COMPILED_LENGTH_MULTIPLE if cfg.train.compile else 1,
        fused_head=fused_head_on(cfg.train.fused_head),
    )
    optimizer = build_optimizer(module, cfg.train, accelerator.device)
    if folder is not None:
        say_once(accelerator, f"resuming from {folder}")
        # Every process, before FSDP (if any) shards the model; another architecture or vocabulary is refused.
        run_folder.load_resumed_weights(model, folder, tokenizer)
    module, optimizer = accelerator.prepare(module, optimizer)
    return model, module, optimizer


class Trainer:
    """One pretraining run; each method does one part of the loop."""

    def __init__(
        self,
        cfg: Config,
        *,
        evaluator: Callable[..., dict] | None,
        resume: str | None = None,
        show_progress: bool = True,
        on_step_end: Callable[["Trainer"], bool] | None = None,
        named: frozenset[str] = frozenset(),
    ):
        """A run set up to ``train()``; its folder is this process's until ``train()`` ends (or ``close()``).

        ``named``: the dotted keys the user chose (config.named_keys); one that this run would not read (another
        strategy's masking key, a model key that train.init's folder decides otherwise) is refused.

        ``on_step_end``: called with the trainer on every process after each step (once its logging, evaluation
        and checkpoint are done), outside the training seconds a time budget counts; a true return on any
        process ends training after that step as a spent budget does (final checkpoint and evaluation).
        """
        self._lock, self._stop, self.accelerator, self.on_step_end = None, StopRequest(), None, on_step_end
        try:
            self._set_up(cfg, evaluator, resume, show_progress, named)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let another process write the run folder: the end of ``train()``, or of a Trainer that never trains."""
        if self._lock is not None:
            self._lock.release()
        if self.accelerator is not None:
            finish_trackers(self.accelerator)

    def _set_up(
        self,
        cfg: Config,
        evaluator: Callable[..., dict] | None,
        resume: str | None,
        show_progress: bool,
        named: frozenset[str],
    ):
        self._started = time.perf_counter()
        check_config(cfg)  # what its architecture asks of the config, before train.init replaces the model section
        refuse_warmup_without_decay(cfg.train)
        refuse_other_strategies_settings(cfg.masking.strategy, named)
        cfg = resolve_init(cfg, named)  # train.init: checked, and the model section taken from it, before anything
        self.cfg, self.evaluator, self.show_progress = cfg, evaluator, show_progress
        # This run's precision, resolved once: accelerate's mixed_precision is per process (launch.py).
        self.precision = resolve_precision(cfg.train.precision)
        self.accelerator = make_accelerator(cfg, self.precision)
        self.run_dir = run_folder.run_dir_for(cfg)
        # Before the slow set-up: an unwritable or busy run folder, or a refused resume, stops here.
        self._lock = run_folder.lock_run(self.run_dir) if self.accelerator.is_main_process else None
        folder = run_folder.open_run(self.run_dir, cfg, resume, self.accelerator.is_main_process)
        self.metrics = MetricsWriter(
            self.run_dir,
            enabled=self.accelerator.is_main_process,
            tensorboard=choices.TENSORBOARD in report_targets(cfg.train.report_to),
            trackers=self.accelerator.log,
        )
        with self.accelerator.main_process_first():
            self.train_store, self.valid_store, self.tokenizer = prepare_datasets(
                cfg.data, cfg.train.init, show_progress=show_progress and self.accelerator.is_main_process
            )
        # before allocating any of it (ADM's tables too)
        refuse_unfitting(cfg, len(self.tokenizer), self.accelerator, self.precision)
        say_precision(self.accelerator, cfg, self.precision)
        with self.accelerator.main_process_first():  # pmi: the first run on a corpus builds its n-gram vocabulary
            self.masker = Masker(cfg.masking, self.tokenizer, self.train_store.token_counts, corpus=self.train_store)
        self.model, self.module, self.optimizer = prepared_model(cfg, self.tokenizer, self.accelerator, folder)
        # MFU denominator of every process together (~0.25 s; timed again as the run goes, mfu.MeasuredPeak).
        self.peak = MeasuredPeak(self.accelerator.device, self.precision.dtype, self.accelerator.num_processes)
        self.state = TrainerState()
        self.checkpointer = Checkpointer(
            self.run_dir,
            self.accelerator,
            cfg.train.keep_last,
            model=self.model,
            module=self.module,
            optimizer=self.optimizer,
            masker=self.masker,
            progress=self.state,
            tokenizer=self.tokenizer,
            token_counts=self.train_store.token_counts,
        )
        if folder is not None:  # after prepare: FSDP shards the optimizer state as it loads
            self.checkpointer.load(folder)
            global_batch = cfg.train.batch_size * self.accelerator.num_processes
            for note in resume_notes(self.run_dir, folder, cfg.train, self.state, global_batch):
                say_once(self.accelerator, note)
        self._elapsed_before = self.state.elapsed  # what earlier processes spent on this run
        self._clock_base = self.state.seconds  # the training seconds before the step that runs next (main process)
        with self._stop:  # from the first rewrite on, a stop signal waits for the step boundary
            if self.accelerator.is_main_process:  # only now: a refused resume leaves the run folder as it was
                run_folder.record_config(self.run_dir, cfg, folder, self.state.step)
            start_trackers(self.accelerator, self.run_dir, cfg)
            # Steps after the checkpoint are redone, and so is the final evaluation of a finished run rerun.
            self.metrics.drop_after(self.state.step, evaluation_too=self.progress() >= 1.0)

    def _save(self) -> Path | None:
        """A checkpoint of this step (written by the main process; every process must call this)."""
        self.accelerator.wait_for_everyone()
        self._update_elapsed()
        return self.checkpointer.save(self.state.step)

    def _update_elapsed(self) -> None:
        self.state.elapsed = self._elapsed_before + time.perf_counter() - self._started

    def progress(self) -> float:
        return training_progress(self.cfg.train, self.state.step, self.state.seconds)

    def batches(self) -> Iterator[dict]:
        """This process's training batches (unmasked) from where the run stands; the state keeps the position."""
        cfg = self.cfg
        for position, batch in iterate_batches(
            self.train_store,
            batch_size=cfg.train.batch_size,
            seed=cfg.train.seed,
            start=self.state.position,
            rank=self.accelerator.process_index,
            world_size=self.accelerator.num_processes,
            workers=cfg.data.loader_workers,
            pad_id=self.tokenizer.pad_token_id,
            bucket_batches=cfg.data.bucket_batches,
        ):
            self.state.position = position
            yield batch

    def _next_micro_batches(self, batches: Iterator[dict]) -> list[tuple[int, dict]]:
        """The step's next grad_accum batches (fewer while the batch warms up) on the device, each with its epoch (a
        step may span two)."""
        micro = []
        for _ in range(micro_batches_at(self.cfg.train, self.state.step + 1)):
            batch = next(batches)  # moves the state's position on
            micro.append((self.state.position.epoch, {k: v.to(self.accelerator.device) for k, v in batch.items()}))
        return micro

    def train_step(self, batches: Iterator[dict], stop_requested: bool = False) -> dict:
        """One optimizer step on the next micro-batches of ``batches`` (an iterator from ``self.batches()``).

        Its "clock" (the main process's training seconds at the step's collective) and "stop"
        (whether any process was asked to stop) are the same on every process.
        """
        started = time.perf_counter()
        micro = self._next_micro_batches(batches)
        with self.accelerator.autocast():  # ADM's scoring forward in the precision the step trains in
            micro = self.masker.mask_step(micro, self.model, progress=self.progress(), step=self.state.step + 1)
        sums = StepSums(self.cfg.data.objective, self.cfg.model, self.model.config.vocab_size, self.accelerator.device)
        results = forwards_and_backwards(self.accelerator, self.module, micro, sums)
        self.masker.learn_step(micro, results, partial(concat_over_processes, self.accelerator))
        clock = self._clock_base + time.perf_counter() - started if self.accelerator.is_main_process else 0.0
        agreed = sums.agreed(self.accelerator, clock, stop_requested)
        update = self._apply_update(agreed.pop("losses"), agreed.pop("tokens"), agreed.pop("flops"))
        return {**update, **agreed}  # and the step's "slots", "clock" and "stop"

    def _apply_update(self, losses: dict, tokens: int, flops: float) -> dict:
        """Optimizer step, or skip it when the loss is not finite (and abort after too many)."""
        if not math.isfinite(losses["loss"]):
            self.optimizer.zero_grad(set_to_none=True)
            if self.state.skip(self.cfg.train.max_bad_steps):
                raise UserError(non_finite_stop(self.state, self.run_dir))
            return {**losses, "skipped": True}
        # max_grad_norm 0 (no clipping): an infinite bound still returns the norm, for the metrics
        bound = self.cfg.train.max_grad_norm or math.inf
        grad_norm = self.accelerator.clip_grad_norm_(self.module.parameters(), bound)
        set_lr(
            self.optimizer,
            learning_rate(self.cfg.train, self.state.step, self.progress(), self.state.warmup_end_progress),
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.apply(tokens, flops)
        return {**losses, "grad_norm": full_norm(grad_norm), "tokens": tokens, "flops": flops}

    def train(self) -> dict:
        # A stop signal is caught until the very end (the final evaluation too): it must never lose the run.
        try:
            with self._stop as stop:
                if self._train_steps(stop):
                    say_once(
                        self.accelerator, f"{stop.name}: saving a checkpoint at step {self.state.step} before exiting"
                    )
                    self._save()
                    raise stop.exit()
                return self._finish(stop)
        finally:
            self.close()

    def _train_steps(self, stop: StopRequest) -> bool:
        """Steps until the budget is spent or a stop signal asks to stop; whether it did (on any process)."""
        batches, window, stopping = self.batches(), SpeedWindow(), False
        shown = self.show_progress and self.accelerator.is_main_process
        total = None if self.cfg.train.max_minutes > 0 else self.cfg.train.max_steps
        with progress_bar("pretrain", total, shown, initial=self.state.step) as bar:
            # No bar where stderr is a log file (nohup, a scheduler): a line at each evaluation instead.
            done = work_done(self.cfg.train, self.state.step, self.progress())
            self._pace = Pace(done) if shown and bar.disable else None
            while self.progress() < 1.0 and not stopping:
                started = time.perf_counter()
                out = self.train_step(batches, stop.requested)
                elapsed = time.perf_counter() - started
                self._clock_base += elapsed
                stopping = out.pop("stop")
                self.state.advance(out.pop("clock"), self.cfg.train)
                window.add(out, elapsed)
                window.show(bar, out["loss"], self.peak)
                window = self._after_step(out, window)
                if self.on_step_end is not None and any_process(self.accelerator, bool(self.on_step_end(self))):
                    break  # the caller's stop: the run ends here as if its budget were spent
        return stopping

    def _after_step(self, out: dict, window: SpeedWindow) -> SpeedWindow:
        """Log, evaluate and checkpoint as the config asks; the window to measure the next steps over."""
        cfg, step = self.cfg.train, self.state.step
        if step % cfg.log_every == 0 or out.get("skipped"):
            self.metrics.write(
                {
                    "step": step,
                    "lr": self.optimizer.param_groups[0]["lr"],
                    **out,
                    **window.rates(self.peak),
                    "tokens_seen": self.state.tokens,
                    **self.masker.stats(partial(sum_over_processes, self.accelerator)),
                }
            )
            window = SpeedWindow()
            self.peak.refresh_if_due()  # outside the timed steps
        unfinished = self.progress() < 1.0
        if cfg.eval_every and step % cfg.eval_every == 0 and unfinished:
            evaluation = self.evaluate(cfg.eval_batches)
            self.metrics.write({"step": step, "eval": evaluation})
            if self._pace:
                say(progress_line(self.cfg.train, step, self.progress(), out["loss"], evaluation, self._pace))
        if cfg.save_every and step % cfg.save_every == 0 and unfinished:
            self._save()
        return window

    def evaluate(self, max_batches: int | None = None) -> dict:
        """Held-out evaluation by ``evaluator`` ({} without one) of the model itself, in fp32 whatever the run
        trains in, as `mlmlab evaluate` of its export: the prepared module's forward runs in the run's autocast
        (bf16 on AMX CPUs and GPUs). Under FSDP through the prepared module, whose forward gathers the shards
        (in the bf16 of its mixed-precision policy where the run trains in bf16)."""
        if self.evaluator is None:
            return {}  # the caller handed no validator: training only
        sharded = self.accelerator.distributed_type == DistributedType.FSDP
        return self.evaluator(
            self.module if sharded else self.model,
            self.valid_store,
            self.masker.info,
            batch_size=self.cfg.train.eval_batch_size,
            max_batches=max_batches,
            device=self.accelerator.device,
            token_counts=self.train_store.token_counts,
            freq_cuts=self.cfg.masking.freq_cuts,
        )

    def _finish(self, stop: StopRequest) -> dict:
        saved = self._save()  # before the final evaluation, so a stop signal during it leaves the run resumable
        if any_process(self.accelerator, stop.requested):
            say_once(
                self.accelerator,
                f"{stop.name}: the final checkpoint (step {self.state.step}) is saved; "
                "exiting before the final evaluation (rerun the command to finish the run)",
            )
            raise stop.exit()
        final_eval = self.evaluate(self.cfg.train.eval_batches)
        self._update_elapsed()
        summary = run_summary(self.state, self.peak, self.accelerator, final_eval, self.run_dir)
        self.metrics.write({"step": self.state.step, "eval": final_eval})
        if self.accelerator.is_main_process:
            write_finished_run(
                self.run_dir, saved, self.cfg, summary, self.train_store, self.valid_store, self.masker.ngrams
            )
        return summary
