"""The pretraining loop: prepare data, build model, train, evaluate, checkpoint, resume.

One step = ``grad_accum`` micro-batches per process. All micro-batches of a step are
masked first, so the MLM loss can be normalised by the number of masked tokens of the
whole global batch (all micro-batches, all ranks): the gradient then equals that of
one big batch, whatever the split.
"""

import dataclasses
import json
import math
import shutil
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, parse_flag_from_env, set_seed
from safetensors.torch import load_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.tensorboard import SummaryWriter
from tqdm.auto import tqdm
from transformers import BertForPreTraining

from mlmlab import jsonio
from mlmlab.config import Config, config_text
from mlmlab.data.loader import LoaderPosition, iterate_batches
from mlmlab.errors import UserError
from mlmlab.evaluate.perplexity import evaluate_mlm
from mlmlab.masking.select import IGNORE_INDEX, Corruption, continuation_table, token_info_for
from mlmlab.masking.schedules import rate_at
from mlmlab.masking.scorers import LOSS_SCORERS
from mlmlab.masking.strategies import build_strategy, mask_batch
from mlmlab.model import SparsePretraining, build_model, compile_model
from mlmlab.train import checkpoint
from mlmlab.train.datasets import prepare_datasets, run_dir_for
from mlmlab.train.mfu import matmul_dtype, peak_matmul_flops, training_flops
from mlmlab.train.optim import build_optimizer, lr_factor, set_lr


@dataclass
class TrainerState:
    step: int = 0
    position: LoaderPosition = field(default_factory=LoaderPosition)
    tokens: int = 0  # non-padding tokens seen, all ranks
    flops: float = 0.0  # model FLOPs of the applied steps, all ranks (mfu.training_flops)
    seconds: float = 0.0  # training wall-clock, excluding evaluation and checkpoints
    bad_steps: int = 0  # consecutive non-finite losses
    warmup_end_progress: float = 0.0  # time budgets: where LR decay starts

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "position": self.position.state_dict()}

    @classmethod
    def from_json(cls, data: dict) -> "TrainerState":
        return cls(**{**data, "position": LoaderPosition(**data["position"])})


class _StopRequest:
    """SIGTERM sets a flag; the loop saves a checkpoint at the next step boundary and exits."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self):
        signal.signal(signal.SIGTERM, self._previous)


def _mixed_precision(precision: str) -> str:
    if precision == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    return {"fp32": "no"}.get(precision, precision)


def refuse_deepspeed() -> None:
    """Stop a DeepSpeed launch before it trains: nothing here has run or tested it."""
    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):  # as accelerate itself reads its launch flags
        raise UserError("DeepSpeed is not supported; launch with FSDP (an accelerate config with "
                        "distributed_type FSDP and fsdp_version 2) or with DDP (torchrun)")


# Checkpoints hold the whole model and optimizer state, keyed by parameter name, whatever the
# process count and sharding, so that any run can resume any checkpoint.
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Trainer:
    """Holds what one run needs; each method does one part of the loop."""

    def __init__(self, cfg: Config, resume: str | None = None, progress: bool = True):
        self.cfg = cfg
        self.show_progress = progress
        refuse_deepspeed()
        ddp_kwargs = DistributedDataParallelKwargs(find_unused_parameters=cfg.data.objective == "mlm")
        # cpu=True is what makes accelerate run several CPU processes (gloo) under torchrun.
        self.accelerator = Accelerator(mixed_precision=_mixed_precision(cfg.train.precision), kwargs_handlers=[ddp_kwargs],
                                       cpu=not torch.cuda.is_available())
        if self.accelerator.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self._check_fsdp()
        self.run_dir = run_dir_for(cfg)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.tensorboard = None  # opened on first write, on the main process only
        with self.accelerator.main_process_first():
            self.train_store, self.valid_store, self.tokenizer = prepare_datasets(cfg)
        self.info = token_info_for(self.tokenizer, cfg.masking.mask_unk)
        self.corruption = Corruption(cfg.masking.mask_prob, cfg.masking.random_prob)
        # Weight init and dropout draw from torch's default generator: transformers offers no
        # other, so seed it here and save/restore its state in checkpoints.
        set_seed(cfg.train.seed)
        self.bert = build_model(cfg.model, len(self.tokenizer), self.tokenizer.pad_token_id)
        if cfg.train.compile:
            compile_model(self.bert)
        self.module = SparsePretraining(self.bert, use_nsp=cfg.data.objective == "nsp")
        self.optimizer = build_optimizer(self.module, cfg.train, self.accelerator.device)
        self.strategy = build_strategy(cfg.masking, info=self.info, vocab_size=len(self.tokenizer),
                                       token_counts=self.train_store.token_counts)
        self.continuation = continuation_table(self.tokenizer) if cfg.masking.whole_word else None
        self.peak_flops = self._measure_peak_flops()
        self.state = TrainerState()
        folder = self._start(resume)
        if folder is not None:
            self._log_line(f"resuming from {folder}")
            # Every process loads the whole model before FSDP (if any) shards it.
            load_model(self.bert, folder / "model" / "model.safetensors", strict=False)
        self.module, self.optimizer = self.accelerator.prepare(self.module, self.optimizer)
        if folder is not None:
            self._load_training_state(folder)
        # Records of steps after the checkpoint (or of a run killed before its first one) are redone.
        self._truncate_metrics(self.state.step)

    def _check_fsdp(self) -> None:
        """Refuse the FSDP set-ups that would silently go wrong or that nothing here has tested."""
        if self.accelerator.distributed_type != DistributedType.FSDP:
            if parse_flag_from_env("ACCELERATE_USE_FSDP"):
                # accelerate 1.15 shards only on accelerators: on CPU it runs an FSDP config as DDP, silently.
                raise UserError("this FSDP launch would not shard (accelerate runs FSDP only on GPUs and other "
                                "accelerators); on CPUs launch with DDP instead: torchrun, or accelerate with "
                                "distributed_type MULTI_CPU")
            return
        if not self.accelerator.is_fsdp2:
            raise UserError("FSDP version 1 is not supported; set fsdp_version: 2 in the accelerate config "
                            "(FSDP_VERSION=2)")
        masking = self.cfg.masking
        if masking.strategy == "adaptive" and masking.scorer not in LOSS_SCORERS:
            # Scorers call the encoder's parts directly, outside the wrapped forward that gathers them.
            raise UserError(f"masking.scorer={masking.scorer} needs the whole model on each process, which FSDP "
                            "shards; under FSDP use scorer loss_ema or context, or launch with DDP")
        if self.cfg.train.compile:
            raise UserError("train.compile with FSDP is untested; set train.compile=false or launch with DDP")

    def _measure_peak_flops(self) -> float:
        """This device's dense-matmul FLOP/s at the training precision (MFU denominator).

        Smaller than the benchmark's measurement (1024^2 matmuls, best of 4 rounds of 3: ~0.3 s
        on 2 CPU cores) so that every run can afford it.
        """
        return peak_matmul_flops(self.accelerator.device, matmul_dtype(self.accelerator.mixed_precision),
                                 size=1024, repeats=3, rounds=4)

    # ----- run folder and resume -------------------------------------------------------
    def _start(self, resume: str | None) -> Path | None:
        """Prepare the run folder; the checkpoint to resume from, if any."""
        config_path = self.run_dir / "config.yaml"
        existing = checkpoint.complete_checkpoints(self.run_dir, check=False)
        if resume is None and existing:
            if config_path.read_text() != config_text(self.cfg):
                raise UserError(f"{self.run_dir} holds a run with a different config; choose another train.out_dir "
                                "or pass --resume auto to continue it with this config")
            resume = "auto"
        folder = checkpoint.resolve_resume(resume, self.run_dir)
        if self.accelerator.is_main_process:
            checkpoint.remove_partial(self.run_dir)
        if folder is None and self.accelerator.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            config_path.write_text(config_text(self.cfg))
        return folder

    def _load_training_state(self, folder: Path) -> None:
        """Everything but the weights, after ``prepare``: FSDP shards the optimizer state as it loads."""
        states = checkpoint.load_torch(folder / "training_state.pt")
        try:
            set_optimizer_state_dict(self.module, self.optimizer.optimizer, states["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
        except KeyError as missing:  # e.g. state keyed by index, as mlmlab wrote it before FSDP support
            raise UserError(f"{folder} holds optimizer state this mlmlab cannot read (no entry {missing}); resume "
                            "with the mlmlab version that wrote it, or start a new train.out_dir") from None
        self.strategy.load_state_dict(states["strategy"])
        torch.set_rng_state(states["torch_rng"])
        if torch.cuda.is_available() and "cuda_rng" in states:
            torch.cuda.set_rng_state_all(states["cuda_rng"])
        if self.accelerator.scaler is not None and "grad_scaler" in states:
            self.accelerator.scaler.load_state_dict(states["grad_scaler"])
        self.state = TrainerState.from_json(json.loads((folder / "trainer_state.json").read_text()))

    def _truncate_metrics(self, step: int) -> None:
        """Drop records of steps after ``step``."""
        if self.accelerator.is_main_process and self.metrics_path.exists():
            lines = self.metrics_path.read_text().splitlines()
            kept = [line for line in lines if line and json.loads(line)["step"] <= step]
            self.metrics_path.write_text("".join(line + "\n" for line in kept))

    def _save(self) -> Path | None:
        self.accelerator.wait_for_everyone()
        model_state, optimizer_state = self._full_states()
        if not self.accelerator.is_main_process:
            return None

        def write(folder: Path) -> None:
            self.export_model(folder / "model", model_state)
            states = {"optimizer": optimizer_state,
                      "strategy": self.strategy.state_dict(), "torch_rng": torch.get_rng_state()}
            if torch.cuda.is_available():
                states["cuda_rng"] = torch.cuda.get_rng_state_all()
            if self.accelerator.scaler is not None:  # fp16 on CUDA: the loss scale and its growth counter
                states["grad_scaler"] = self.accelerator.scaler.state_dict()
            checkpoint.save_torch(states, folder / "training_state.pt")
            (folder / "trainer_state.json").write_text(json.dumps(self.state.to_json()))

        return checkpoint.save(self.run_dir, self.state.step, write, self.cfg.train.keep_last)

    def _full_states(self) -> tuple[dict, dict]:
        """The whole model's weights (by BertForPreTraining name) and optimizer state (by parameter name).

        Every process must call it: under FSDP it gathers the shards, to the main process only.
        """
        model_state = self.accelerator.get_state_dict(self.module)  # names of SparsePretraining: "bert.*"
        optimizer_state = get_optimizer_state_dict(self.module, self.optimizer.optimizer, options=FULL_STATE)
        return {name.removeprefix("bert."): tensor for name, tensor in model_state.items()}, optimizer_state

    def export_model(self, folder: Path, state_dict: dict) -> None:
        """A HuggingFace folder: safetensors weights, config and tokenizer.

        Saved from a plain copy, built on the meta device (no init, no RNG draw) and given the
        gathered weights: ``save_pretrained`` inspects the model's own parameters, which under
        FSDP are shards whose gathering would wait for the other processes forever.
        """
        with torch.device("meta"):
            plain = BertForPreTraining(self.bert.config)
        plain.load_state_dict(state_dict, assign=True)
        plain.tie_weights()
        plain.save_pretrained(folder, safe_serialization=True)
        self.tokenizer.save_pretrained(folder)
        # Frequency buckets of later evaluations are defined by the pretraining corpus.
        np.save(folder / "token_counts.npy", self.train_store.token_counts)

    # ----- schedules ----------------------------------------------------------------------
    def progress(self) -> float:
        """Share of the budget spent: training seconds under train.max_minutes, else steps."""
        cfg = self.cfg.train
        if cfg.max_minutes > 0:
            return min(1.0, self.state.seconds / (cfg.max_minutes * 60))
        return self.state.step / cfg.max_steps

    def lr(self) -> float:
        """The learning rate of the update about to be applied (a pure function of the state)."""
        cfg = self.cfg.train
        if self.state.step == cfg.warmup_steps:
            self.state.warmup_end_progress = self.progress()
        warmup_end = self.state.warmup_end_progress if cfg.max_minutes > 0 else cfg.warmup_steps / cfg.max_steps
        return cfg.lr * lr_factor(self.state.step, cfg.warmup_steps, self.progress(), warmup_end, cfg.decay_fraction)

    # ----- one step ----------------------------------------------------------------------
    def masked_micro_batches(self, batches) -> list[dict]:
        progress = self.progress()
        masking = self.cfg.masking
        micro = []
        for _ in range(self.cfg.train.grad_accum):
            self.state.position, batch = next(batches)
            batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
            weights = self.strategy.weights(self.bert, batch, progress)
            micro.append(mask_batch(batch, seed=masking.seed, epoch_key=self.strategy.epoch_key(self.state.position.epoch),
                                    rate=rate_at(masking, progress), info=self.info, corruption=self.corruption,
                                    weights=weights, whole_word=masking.whole_word, continuation=self.continuation))
        return micro

    def _global_denominators(self, micro: list[dict]) -> tuple[float, float]:
        """Masked tokens and examples over the global batch, divided by the process count.

        DDP averages gradients over processes, so each process divides its sum by
        global count / processes to make the average equal the global-batch mean.
        """
        local = torch.tensor([sum(int((m["labels"] != IGNORE_INDEX).sum()) for m in micro),
                              sum(len(m["input_ids"]) for m in micro)], device=self.accelerator.device, dtype=torch.float64)
        total = self.accelerator.reduce(local, reduction="sum")
        world = self.accelerator.num_processes
        return (total[0] / world).item(), (total[1] / world).item()

    def train_step(self, batches) -> dict:
        micro = self.masked_micro_batches(batches)
        mlm_denominator, nsp_denominator = self._global_denominators(micro)
        keys = ("loss", "mlm_loss", "nsp_loss") if self.cfg.data.objective == "nsp" else ("loss", "mlm_loss")
        sums = torch.zeros(len(keys) + 2, dtype=torch.float64, device=self.accelerator.device)  # losses, tokens, FLOPs
        for i, batch in enumerate(micro):
            sync = nullcontext() if i == len(micro) - 1 else self.accelerator.no_sync(self.module)
            with sync, self.accelerator.autocast():
                result = self.module(**batch, mlm_denominator=mlm_denominator, nsp_denominator=nsp_denominator)
                self.accelerator.backward(result["loss"])
            # The forward already counted the positions its head projected (mlm_count, on the CPU).
            flops = training_flops(self.cfg.model, self.bert.config.vocab_size, batch["attention_mask"],
                                   int(result["mlm_count"]))
            sums += torch.stack([*(result[key].detach().double() for key in keys),
                                 batch["attention_mask"].sum().double(), flops.double()])
            self.strategy.observe(batch, result)
        self.strategy.learn(self._concat_over_processes)
        totals = self.accelerator.reduce(sums, reduction="sum").tolist()  # one collective per step
        losses = {key: value / self.accelerator.num_processes for key, value in zip(keys, totals)}
        tokens, flops = totals[-2:]
        return self._apply_update(losses, int(tokens), flops)

    def _concat_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        """(N,) here, N differing between processes -> (all N,) of every process, in rank order."""
        if self.accelerator.num_processes == 1:
            return tensor
        lengths = self.accelerator.gather(torch.tensor([len(tensor)], device=tensor.device)).tolist()
        padded = self.accelerator.gather(self.accelerator.pad_across_processes(tensor, dim=0))  # (P * max N,)
        rows = padded.view(self.accelerator.num_processes, -1)
        return torch.cat([row[:length] for row, length in zip(rows, lengths)])

    def _apply_update(self, losses: dict, tokens: int, flops: float) -> dict:
        """Optimizer step, or skip it when the loss is not finite (and abort after too many)."""
        if not math.isfinite(losses["loss"]):
            self.optimizer.zero_grad(set_to_none=True)
            self.state.bad_steps += 1
            if self.state.bad_steps >= self.cfg.train.max_bad_steps:
                raise UserError(f"{self.state.bad_steps} non-finite losses in a row at step {self.state.step}; "
                                f"lower train.lr or check the data; the last good checkpoint is kept in {self.run_dir}")
            return {**losses, "skipped": True}
        grad_norm = self.accelerator.clip_grad_norm_(self.module.parameters(), self.cfg.train.max_grad_norm)
        set_lr(self.optimizer, self.lr())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.bad_steps = 0
        self.state.tokens += tokens
        self.state.flops += flops
        if isinstance(grad_norm, DTensor):  # FSDP: the norm of sharded gradients
            grad_norm = grad_norm.full_tensor()
        return {**losses, "grad_norm": float(grad_norm), "tokens": tokens, "flops": flops}

    # ----- the loop ----------------------------------------------------------------------
    def train(self) -> dict:
        cfg = self.cfg.train
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        batches = iterate_batches(self.train_store, batch_size=cfg.batch_size, seed=cfg.seed, start=self.state.position,
                                  rank=rank, world_size=world, workers=self.cfg.data.loader_workers,
                                  pad_id=self.tokenizer.pad_token_id, bucket_batches=self.cfg.data.bucket_batches)
        stop = _StopRequest()
        bar = tqdm(total=None if cfg.max_minutes > 0 else cfg.max_steps, initial=self.state.step,
                   disable=not (self.show_progress and self.accelerator.is_main_process),
                   dynamic_ncols=True, desc="pretrain")
        window = {"tokens": 0, "flops": 0.0, "seconds": 0.0}
        try:
            while self.progress() < 1.0 and not stop.requested:
                started = time.perf_counter()
                out = self.train_step(batches)
                elapsed = time.perf_counter() - started
                self.state.seconds += elapsed
                self.state.step += 1
                window["tokens"] += out.get("tokens", 0)
                window["flops"] += out.get("flops", 0.0)
                window["seconds"] += elapsed
                bar.update(1)
                rates = self.rates(window["tokens"], window["flops"], window["seconds"])
                bar.set_postfix(loss=f"{out['loss']:.3f}", tok_s=f"{rates['tokens_per_s']:.0f}", mfu=f"{rates['mfu']:.0%}")
                self._after_step(out, window)
            if stop.requested:
                self._log_line(f"SIGTERM: saving a checkpoint at step {self.state.step} before exiting")
                self._save()
                raise SystemExit(143)
        finally:
            bar.close()
            stop.restore()
        return self._finish()

    def _after_step(self, out: dict, window: dict) -> None:
        cfg, step = self.cfg.train, self.state.step
        if step % cfg.log_every == 0 or out.get("skipped"):
            record = {"step": step, "lr": self.optimizer.param_groups[0]["lr"], **{k: v for k, v in out.items()},
                      **self.rates(window["tokens"], window["flops"], window["seconds"]), "tokens_seen": self.state.tokens,
                      **self.strategy.stats()}
            self._write_metrics(record)
            window.update(tokens=0, flops=0.0, seconds=0.0)
        unfinished = self.progress() < 1.0
        if cfg.eval_every and step % cfg.eval_every == 0 and unfinished:
            self._write_metrics({"step": step, "eval": self.evaluate(cfg.eval_batches)})
        if cfg.save_every and step % cfg.save_every == 0 and unfinished:
            self._save()

    def rates(self, tokens: int, flops: float, seconds: float) -> dict:
        """tokens/s and MFU (all ranks' model FLOPs over all ranks' measured peak) over ``seconds``."""
        seconds = max(seconds, 1e-9)
        return {"tokens_per_s": tokens / seconds,
                "mfu": flops / seconds / (self.peak_flops * self.accelerator.num_processes)}

    def evaluate(self, max_batches: int | None = None) -> dict:
        # Through the (wrapped) training module: FSDP gathers sharded weights only in its forward.
        return evaluate_mlm(self.module, self.valid_store, self.info, batch_size=self.cfg.train.batch_size,
                            max_batches=max_batches, device=self.accelerator.device,
                            token_counts=self.train_store.token_counts, freq_cuts=self.cfg.masking.freq_cuts)

    def _finish(self) -> dict:
        final_eval = self.evaluate(self.cfg.train.eval_batches)
        summary = {"steps": self.state.step, "tokens_seen": self.state.tokens, "train_seconds": self.state.seconds,
                   **self.rates(self.state.tokens, self.state.flops, self.state.seconds), "eval": final_eval,
                   "distributed": self.accelerator.distributed_type.value, "processes": self.accelerator.num_processes,
                   "run_dir": str(self.run_dir)}
        self._write_metrics({"step": self.state.step, "eval": final_eval})
        saved = self._save()
        if self.accelerator.is_main_process:  # the final model is the last checkpoint's: copy, not re-export
            shutil.copytree(saved / "model", self.run_dir / "model", dirs_exist_ok=True)
            (self.run_dir / "summary.json").write_text(jsonio.dumps(summary, indent=1))
        return summary

    def _write_metrics(self, record: dict) -> None:
        """One JSON line per record, and the same numbers as TensorBoard scalars."""
        if not self.accelerator.is_main_process:
            return
        with open(self.metrics_path, "a") as handle:
            handle.write(jsonio.dumps(record) + "\n")
        if self.tensorboard is None:
            self.tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))
        for name, value in _flat_scalars(record):
            self.tensorboard.add_scalar(name, value, record["step"])
        self.tensorboard.flush()

    def _log_line(self, text: str) -> None:
        if self.accelerator.is_main_process:
            tqdm.write(text)


def _flat_scalars(record: dict, prefix: str = ""):
    """(name, value) for every number in a (nested) metrics record, except the step itself."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from _flat_scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            yield prefix + key, value


def pretrain(cfg: Config, resume: str | None = None, progress: bool = True) -> dict:
    return Trainer(cfg, resume=resume, progress=progress).train()
