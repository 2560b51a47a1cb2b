"""A run's progress: steps, tokens, FLOPs, seconds, the loader's position and the non-finite losses in a row."""

import dataclasses
from dataclasses import dataclass, field

from mlmlab.config import TrainConfig
from mlmlab.data.loader import LoaderPosition
from mlmlab.train.optim import training_progress


@dataclass
class TrainerState:
    """What the run has done so far; checkpointed, so a resume goes on from it."""

    step: int = 0
    position: LoaderPosition = field(default_factory=LoaderPosition)
    tokens: int = 0  # non-padding tokens seen, all ranks
    flops: float = 0.0  # model FLOPs of the applied steps, all ranks (mfu.training_flops)
    seconds: float = 0.0  # training wall-clock (the main process's), excluding evaluation and checkpoints
    elapsed: float = 0.0  # the run's wall-clock, set-up, evaluations and checkpoints included, summed over resumes
    bad_steps: int = 0  # consecutive non-finite losses
    warmup_end_progress: float = 0.0  # time budgets: where LR decay may start

    def advance(self, clock: float, cfg: TrainConfig) -> None:
        """One more step; ``clock``: the training seconds at its collective, the same on every process.

        A time budget learns here where warmup ended.
        """
        self.seconds = clock
        self.step += 1
        if self.step == cfg.warmup_steps:
            self.warmup_end_progress = training_progress(cfg, self.step, self.seconds)

    def skip(self, max_bad_steps: int) -> bool:
        """One more non-finite loss, its step skipped; whether that makes ``max_bad_steps`` in a row: stop."""
        self.bad_steps += 1
        return self.bad_steps >= max_bad_steps

    @property
    def ever_updated(self) -> bool:
        """Whether any step of the run (resumes included) applied an update."""
        return self.tokens > 0

    def apply(self, tokens: int, flops: float) -> None:
        """An applied update, of ``tokens`` non-padding tokens and ``flops`` model FLOPs over all ranks."""
        self.bad_steps = 0
        self.tokens += tokens
        self.flops += flops

    def state_dict(self) -> dict:
        return {**dataclasses.asdict(self), "position": self.position.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if key != "position":
                setattr(self, key, value)
        self.position.load_state_dict(state["position"])
        if "elapsed" not in state:  # a checkpoint from before it was recorded: its training seconds, a lower bound
            self.elapsed = self.seconds
