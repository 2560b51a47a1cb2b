"""Whether a run can fit: a lower bound on one training process's memory, checked before it trains.

Without it, batch sizes that needed 36-128 GB were tried instead of refused. The
estimate counts only what a training step must hold at once (per process; train.batch_size
is per process):

- weights, gradients and AdamW's two moments: 16 bytes per parameter (fp32 each, whatever
  the autocast), a share of them under FSDP; the parameters are counted on the model itself,
  built on the meta device (no memory, no random draws), so BERT and ModernBERT are both exact;
- activations kept for backward: per token and layer, 8 vectors of the hidden size (the
  attention input, Q, K, V, the attention output, two LayerNorm inputs, the FFN input)
  and 2 of the intermediate size (before and after GELU), 2 bytes each under bf16/fp16
  autocast, else 4. That is BERT's layer; ModernBERT's (6 hidden-size vectors, 3 of the
  intermediate size around its GLU) differs by under 5% at its presets;
- the MLM logits of the selected positions (the mask rate at its highest times the
  sequence length, per sequence) over the padded vocabulary, and their fp32 log-softmax,
  both kept for backward;
- what the masking strategy keeps beside the model, as its entry counts it (ADM's context
  scorer: its table, a float32 value and an int64 count per bucket).

Attention scores (eager attention), temporaries and the allocator's slack come on top, so
a run this estimate refuses cannot fit; one it lets through may still not.
"""

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from mlmlab.config import Config, ModelConfig
from mlmlab.errors import UserError
from mlmlab.masking.schedules import rate_at
from mlmlab.masking.strategies import strategy_entry
from mlmlab.model.pretraining import build_model, padded_vocab_size
from mlmlab.train.launch import Precision
from mlmlab.utils.devices import memory_capacity

OPTIMIZER_BYTES_PER_PARAMETER = 16  # fp32 weight, gradient, exp_avg, exp_avg_sq
GB = 1e9


def training_bytes(cfg: Config, vocab_size: int, bytes_per_value: int, weight_shards: int = 1) -> dict[str, int]:
    """The estimate's parts (see the module docstring), in bytes, for a tokenizer of ``vocab_size`` ids.

    ``weight_shards``: the processes that share the weights and optimizer state (FSDP), else 1.
    """
    m, t = cfg.model, cfg.data.max_seq_length
    h, i, layers = m.hidden_size, m.intermediate_size, m.num_layers
    vocab = padded_vocab_size(vocab_size, m.pad_vocab_multiple)
    parameters = parameter_count(m, vocab_size)
    selected = max(rate_at(cfg.masking, 0.0), rate_at(cfg.masking, 1.0)) * t  # the schedule's highest rate
    return {
        "weights and AdamW state": OPTIMIZER_BYTES_PER_PARAMETER * parameters // weight_shards,
        "activations": cfg.train.batch_size * t * layers * (8 * h + 2 * i) * bytes_per_value,
        "MLM logits": int(cfg.train.batch_size * selected * vocab * (bytes_per_value + 4)),
        **strategy_entry(cfg.masking.strategy).state_bytes(cfg.masking),
    }


def parameter_count(cfg: ModelConfig, vocab_size: int) -> int:
    """The parameters of the model ``cfg`` builds for ``vocab_size`` ids (the meta device: milliseconds, and
    torch's generator untouched, so the run's weight initialisation draws what it drew without this check)."""
    with torch.device("meta"):
        model = build_model(cfg, vocab_size, pad_token_id=0)
    return sum(parameter.numel() for parameter in model.parameters())


def refuse_unfitting(cfg: Config, vocab_size: int, accelerator: Accelerator, precision: Precision) -> None:
    """A one-line UserError, with the estimate and the limit, when the run cannot fit on the accelerator's device
    training in ``precision``."""
    capacity = memory_capacity(accelerator.device)
    if capacity is None:  # a device whose memory torch does not report: nothing to compare with
        return
    limit, where = capacity
    sharded = accelerator.distributed_type == DistributedType.FSDP
    value_bytes = precision.dtype.itemsize  # 2 under bf16/fp16 autocast, else 4
    parts = training_bytes(
        cfg, vocab_size, bytes_per_value=value_bytes, weight_shards=accelerator.num_processes if sharded else 1
    )
    need = sum(parts.values())
    if need > limit:
        listed = ", ".join(f"{name} {size / GB:.3g} GB" for name, size in parts.items())
        raise UserError(
            f"this run needs at least {need / GB:.3g} GB ({listed}; train.batch_size="
            f"{cfg.train.batch_size} per process), more than the {limit / GB:.3g} GB of {where}; lower "
            "train.batch_size (raising train.grad_accum keeps the global batch), data.max_seq_length or "
            "the model's size"
        )
