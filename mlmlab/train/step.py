"""One optimizer step's forwards and backwards over its micro-batches, and the sums every process agrees on.

The MLM loss of every micro-batch is normalised by the masked tokens of the whole global batch (all
micro-batches, all ranks), so the summed gradient equals that of one big batch, whatever the split.
"""

from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor

from mlmlab import choices
from mlmlab.config import ModelConfig
from mlmlab.model.pretraining import IGNORE_INDEX
from mlmlab.train.mfu import training_flops


def global_denominators(accelerator, micro: list[dict]) -> tuple[float, float]:
    """Masked tokens and examples over the global batch, divided by the process count.

    DDP averages gradients over processes, so each process divides its sum by
    global count / processes to make the average equal the global-batch mean.
    """
    local = torch.tensor(
        [sum(int((m["labels"] != IGNORE_INDEX).sum()) for m in micro), sum(len(m["input_ids"]) for m in micro)],
        device=accelerator.device,
        dtype=torch.float64,
    )
    total = accelerator.reduce(local, reduction="sum")
    return (total[0] / accelerator.num_processes).item(), (total[1] / accelerator.num_processes).item()


class StepSums:
    """This process's sums over a step's micro-batches, float64: each loss, real tokens, token slots, model FLOPs."""

    def __init__(self, objective: str, model_cfg: ModelConfig, vocab_size: int, device):
        self.keys = ("loss", "mlm_loss", "nsp_loss") if objective == choices.NSP else ("loss", "mlm_loss")
        self.model_cfg, self.vocab_size = model_cfg, vocab_size
        self.values = torch.zeros(len(self.keys) + 3, dtype=torch.float64, device=device)

    def add(self, batch: dict, result: dict) -> None:
        """One micro-batch and its forward's result."""
        mask = batch["attention_mask"]  # (B, T): real tokens, of B * T slots padding included
        # The forward already counted the positions its head projected (mlm_count, on the CPU).
        flops = training_flops(self.model_cfg, self.vocab_size, mask, int(result["mlm_count"]))
        self.values += torch.stack(
            [
                *(result[key].detach().double() for key in self.keys),
                mask.sum().double(),
                torch.tensor(float(mask.numel()), dtype=torch.float64, device=mask.device),
                flops.double(),
            ]
        )

    def agreed(self, accelerator, clock: float, stop_requested: bool) -> dict:
        """The global batch's losses (means over processes), tokens, slots and FLOPs, the main process's ``clock``
        (0 elsewhere) and whether any process was asked to stop, all from the step's one collective.

        The clock and any process's SIGTERM ride on it so that every process takes the same time-budget
        decisions (LR, masking rate, when to stop) and stops at the same step: one acting alone would
        wait forever in a collective the others never join.
        """
        agreed = torch.tensor([clock, float(stop_requested)], dtype=torch.float64, device=self.values.device)
        totals = accelerator.reduce(torch.cat([self.values, agreed]), reduction="sum").tolist()
        tokens, slots, flops, clock, stops = totals[-5:]
        return {
            "losses": {key: value / accelerator.num_processes for key, value in zip(self.keys, totals)},
            "tokens": int(tokens),
            "flops": flops,
            "slots": int(slots),
            "clock": clock,
            "stop": stops > 0,
        }


def forwards_and_backwards(accelerator, module, micro: list[dict], sums: StepSums) -> list[dict]:
    """Each masked micro-batch's forward and backward, gradients summed over them (synchronised over processes
    on the last); every one's result, in order. The losses are normalised over the whole global batch."""
    mlm_denominator, nsp_denominator = global_denominators(accelerator, micro)
    results = []
    for i, batch in enumerate(micro):
        sync = nullcontext() if i == len(micro) - 1 else accelerator.no_sync(module)
        with sync, accelerator.autocast():
            result = module(**batch, mlm_denominator=mlm_denominator, nsp_denominator=nsp_denominator)
            accelerator.backward(result["loss"])
        sums.add(batch, result)
        results.append(result)
    return results


def full_norm(grad_norm) -> float:
    """clip_grad_norm_'s total norm as a number; under FSDP it is a DTensor of sharded gradients."""
    return float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
