"""What a run's checkpoint holds and how each part is gathered from the run and restored into it, in one owner
(torchtitan's CheckpointManager): the weights, the optimizer state keyed by parameter name, the masking
strategy's state, torch's random generators (every process's), the fp16 loss scale and the trainer's progress.

The files themselves (where they go, how they are written atomically and verified, how a resume finds
them) are ``run_folder.py``'s.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mlmlab.config import TrainConfig
from mlmlab.data.loader import LoaderPosition
from mlmlab.errors import UserError
from mlmlab.train import run_folder
from mlmlab.train.optim import resume_lr_note

# Checkpoints hold the whole model and optimizer state, keyed by parameter name, whatever the
# process count and sharding, so that any run can resume any checkpoint.
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass
class Checkpointer:
    """The parts of one run that a checkpoint saves and a resume restores.

    Every process holds one and calls ``save`` and ``load`` together: FSDP gathers the weights and
    optimizer state as they are saved, and shards the optimizer state as it loads.
    """

    run_dir: Path
    accelerator: Accelerator
    keep_last: int  # train.keep_last: how many of the newest checkpoints are kept (0: all)
    model: PreTrainedModel  # with the tokenizer and the corpus's token counts, each checkpoint is a model folder
    module: torch.nn.Module  # the prepared pretraining module around ``model``, whose weights are saved
    optimizer: AcceleratedOptimizer
    masker: Stateful  # the masking strategy's state (ADM's statistics)
    progress: Stateful  # the trainer's step, loader position, token and time counters
    tokenizer: PreTrainedTokenizerBase
    token_counts: np.ndarray

    def state_dict(self) -> dict:
        """What a resume needs besides the weights."""
        return {
            "optimizer": get_optimizer_state_dict(self.module, self.optimizer.optimizer, options=FULL_STATE),
            "strategy": self.masker.state_dict(),
            **rng_states(self.accelerator),
            "trainer": self.progress.state_dict(),
            **scaler_states(self.accelerator),
        }

    def load_state_dict(self, states: dict) -> None:
        load_optimizer_state(self.module, self.optimizer.optimizer, states["optimizer"])
        self.masker.load_state_dict(states["strategy"])
        set_rng_states(states, self.accelerator)
        set_scaler_state(states, self.accelerator)
        self.progress.load_state_dict(states["trainer"])

    def save(self, step: int) -> Path | None:
        """The checkpoint of ``step``, written by the main process: its folder there, None on the others."""
        weights = self.accelerator.get_state_dict(self.module)  # SparsePretraining's names: "model.*"
        states = self.state_dict()
        if not self.accelerator.is_main_process:
            return None
        weights = {name.removeprefix("model."): tensor for name, tensor in weights.items()}
        return run_folder.save_run_state(
            self.run_dir, step, self.model.config, weights, states, self.tokenizer, self.token_counts, self.keep_last
        )

    def load(self, folder: Path) -> None:
        """Everything of checkpoint ``folder`` but its weights, once accelerate has prepared the run (FSDP shards
        the optimizer state as it loads); the weights went into the model before, by
        ``run_folder.load_resumed_weights``."""
        self.load_state_dict(run_folder.read_training_state(folder))


def rng_states(accelerator) -> dict:
    """torch's default generators (weight init and dropout draw from them: transformers offers no other).

    Every process draws its own dropout masks from its own generators, so with several
    processes each one's states are kept too ("<name>_by_process", one row per rank).
    """
    states = {"torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda_rng"] = torch.cuda.get_rng_state_all()
    if accelerator.num_processes > 1:
        states["torch_rng_by_process"] = _gathered(accelerator, torch.get_rng_state())
        if torch.cuda.is_available():
            states["cuda_rng_by_process"] = _gathered(accelerator, torch.cuda.get_rng_state())
    return states


def _gathered(accelerator, state: torch.Tensor) -> torch.Tensor:
    """(N,) bytes of this process -> (processes, N) on the CPU, rank order."""
    return accelerator.gather(state[None].to(accelerator.device)).cpu()


def set_rng_states(states: dict, accelerator) -> None:
    """This process's own states where the checkpoint has them for this process count, else the main one's."""
    own = _own_state(states, "torch_rng", accelerator)
    torch.set_rng_state(states["torch_rng"] if own is None else own)
    if not torch.cuda.is_available():
        return
    own = _own_state(states, "cuda_rng", accelerator)
    if own is None and "cuda_rng" in states:
        # The main process's list holds a state per GPU it could see, its own device (cuda:0 under a
        # launcher) first; restoring the whole list would fail on a host that shows fewer GPUs.
        own = states["cuda_rng"][0]
    if own is not None:
        torch.cuda.set_rng_state(own, accelerator.device)


def _own_state(states: dict, name: str, accelerator) -> torch.Tensor | None:
    """This process's row of "<name>_by_process"; None when the checkpoint has none for this process count."""
    by_process = states.get(f"{name}_by_process")
    if by_process is None or len(by_process) != accelerator.num_processes:
        return None
    # A copy: torch's set_rng_state reads a row view from its storage's start (torch 2.13: "Invalid mt19937
    # state", or a crash).
    return by_process[accelerator.process_index].clone()


def scaler_states(accelerator) -> dict:
    """fp16 on CUDA: the loss scale and its growth counter ("grad_scaler"); otherwise nothing."""
    return {} if accelerator.scaler is None else {"grad_scaler": accelerator.scaler.state_dict()}


def set_scaler_state(states: dict, accelerator) -> None:
    """The checkpoint's loss scale, where it has one and this run scales its loss."""
    if accelerator.scaler is not None and "grad_scaler" in states:
        accelerator.scaler.load_state_dict(states["grad_scaler"])


def load_optimizer_state(module, optimizer, state: dict) -> None:
    """Optimizer state keyed by parameter name into ``optimizer`` (FSDP shards it as it loads)."""
    try:
        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))
    except KeyError as missing:  # e.g. state keyed by index, as mlmlab wrote it before FSDP support
        raise UserError(
            f"the checkpoint holds optimizer state this mlmlab cannot read (no entry {missing}); "
            "resume with the mlmlab version that wrote it, or start a new train.out_dir"
        ) from None


def resume_notes(run_dir: Path, folder: Path, cfg: TrainConfig, state, global_batch: int) -> list[str]:
    """Lines for a resume from checkpoint ``folder`` into ``run_dir`` that changes the global batch (``global_batch``
    examples now) or the LR schedule (train section ``cfg``); ``state``: the trainer's, restored."""
    previous = run_folder.parsed_config(run_folder.previous_config_text(run_dir, folder))
    notes = [global_batch_note(state.position, global_batch), resume_lr_note(previous and previous.train, cfg, state)]
    return [note for note in notes if note]


def global_batch_note(position: LoaderPosition, now: int) -> str | None:
    """A line for a resume whose global batch (``now`` examples) is not the one ``position`` was reached with."""
    if position.global_batch in (0, now):
        return None
    moved = position.for_global_batch(now)
    return (
        f"the global batch changed from {position.global_batch} to {now} examples (processes x train.batch_size): "
        f"epoch {position.epoch} goes on from the same share of it (batch {position.batch} -> {moved.batch}) in the "
        "new size's order, so some of its examples may be seen twice or not at all"
    )
