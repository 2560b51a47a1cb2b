"""Pretraining throughput: mlmlab against honest anchors, every arm measured in one interleaved run.

Arms, each with the same model size, vocabulary, data and batch size:

- ``hf-naive``: transformers' own model class of the preset's architecture (``BertForPreTraining`` with
  NSP, ``BertForMaskedLM`` without, ``RobertaForMaskedLM``, ``ModernBertForMaskedLM``; the full MLM head
  over every position), built from the config mlmlab's architecture adapter makes, fed by
  ``DataCollatorForLanguageModeling`` with the run's own tokenizer (its mask token, padding and special
  tokens) in a plain loop with AdamW, plainly shuffled batches -- what a researcher writes from the
  transformers docs.
- ``hf-sparse``: the anchor. The same transformers modules, but the MLM head applied only to
  the labelled positions (BERT's ``cls.predictions``, RoBERTa's ``lm_head``: a researcher who knows the
  trick writes it in 30 lines, here the encoder and head found through mlmlab's adapter; ModernBERT:
  transformers' own ``sparse_prediction`` option), fused AdamW, the same collator, batches grouped by
  length (as the HF Trainer's ``group_by_length`` does). Most of mlmlab's ratio against ``hf-naive`` is
  this trick alone.
- ``mlmlab-unbucketed``: ``Trainer.train_step`` without length bucketing (data.bucket_batches=0).
- ``mlmlab``: ``Trainer.train_step`` as configured.
- ``hf-sparse-recipe`` and ``mlmlab-as-shipped``: the anchor and mlmlab both at mlmlab's own defaults
  (no dropout, so the anchor's attention also runs torch's fused kernel; ``auto`` precision; mlmlab's
  loader worker) plus ``--set``.
- ``mlmlab+<lever>``, one per ``--lever``: mlmlab-as-shipped plus the lever's overrides (``train.compile=true``),
  an A/B of each lever in the same interleaved run. A compiled arm warms up until 20 steps in a row
  compile nothing new; its warm-up (compiling included) is printed beside its ratio.

The first four arms train at transformers' defaults (dropout 0.1, fp32) plus ``--set``. Every arm draws
the same batches: the bucketed arms one plan (mlmlab's loader order, ``data.loader.epoch_plans``), the
unbucketed ones another, so their tokens match batch by batch, padded alike with the tokenizer's pad id
(RoBERTa counts positions from past it, so each token sits at the same position in both). The transformers
arms take from ``--set`` what a plain loop has: the model, the data, the batch, the precision, the optimizer's
settings and the collator's uniform 80/10/10 corruption at ``masking.rate``; anything else they cannot apply is
named before the preset is timed.

Arms are interleaved, because these shared machines swing +-30% between runs. Each arm's tokens/s and
MFU are its own real (non-padding) tokens and model FLOPs summed over its timed steps, over its summed
time; its padding share is printed beside. MFU is "of measured matmul peak" (mlmlab.train.mfu, the same
matmul size as training's log). Each preset's table is printed as soon as it is measured, then two lines:
mlmlab against hf-sparse at the same recipe (mlmlab's) and at transformers' (dropout 0.1), each with its
precision, threads and host.

    python benchmarks/throughput.py                      # tiny and mini
    python benchmarks/throughput.py --presets mini --steps 30 --rounds 5
    python benchmarks/throughput.py --presets modernbert-tiny   # against ModernBertForMaskedLM(sparse_prediction)
    python benchmarks/throughput.py --presets roberta-tiny      # against RobertaForMaskedLM, lm_head on labels only
    python benchmarks/throughput.py --set train.precision=bf16  # bf16 autocast (on a CPU with AMX, or a GPU)
    python benchmarks/throughput.py --no-malloc-tuning   # every arm with glibc's allocator defaults
    python benchmarks/throughput.py --lever train.compile=true --lever train.fused_head=true   # two levers' A/Bs
"""

import argparse
import copy
import os
import sys
import tempfile
from functools import partial

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from transformers import BertForMaskedLM, DataCollatorForLanguageModeling, ModernBertForMaskedLM

from mlmlab import choices
from mlmlab.config import load_config
from mlmlab.data.loader import epoch_plans
from mlmlab.model.architectures import architecture_of
from mlmlab.model.pretraining import IGNORE_INDEX, encode, predict
from mlmlab.train.launch import Precision
from mlmlab.train.loop import Trainer
from mlmlab.train.mfu import peak_matmul_flops, peak_matmul_size, training_flops
from mlmlab.train.stable_adamw import StableAdamW
from mlmlab.utils.allocator import MALLOC_TUNING, reexec_with_malloc_tuning
from mlmlab.utils.devices import clock, describe_cpu

# transformers' defaults: fp32 on CPU, dropout 0.1 on hidden states and attention (attention_dropout null follows
# model.dropout, so a --set model.dropout=0.0 turns both off)
ANCHOR_SETTINGS = ["train.precision=fp32", "model.dropout=0.1", "model.attention_dropout=null"]
# What the transformers arms take from the config: the model, the data and its order, the batch, the precision,
# the optimizer's settings, the collator's corruption. They collate in the timed step, as a plain loop does.
HF_APPLIES = (
    "model.",
    "data.",
    "train.batch_size",
    "train.seed",
    "train.precision",
    "train.lr",
    "train.weight_decay",
    "train.adam_beta1",
    "train.adam_beta2",
    "train.adam_eps",
    "train.max_grad_norm",
    "train.optimizer",
    "masking.rate",
    "masking.mask_prob",
    "masking.random_prob",
    "masking.whole_word",
)
HF_IGNORES = ("data.loader_workers",)
PEAK_SECONDS = 2.0  # how long each precision's matmul peak is timed
QUIET_STEPS = 20  # a compiled arm warms up until this many steps in a row compile no new graph


def make_trainer(preset: str, args, run_dir: str, overrides=()) -> Trainer:
    cfg = load_config(
        preset,
        [
            f"train.batch_size={args.batch_size}",
            f"data.max_seq_length={args.seq}",
            "train.max_steps=100000",
            "train.eval_every=0",
            "train.save_every=0",
            f"train.out_dir={run_dir}",
            *overrides,
        ],
    )
    return Trainer(cfg, evaluator=None, show_progress=False)


def not_applied_by_hf(overrides) -> list[str]:
    """The --set overrides the transformers arms cannot follow (a masking strategy, gradient accumulation, ...)."""
    keys = [override.split("=", 1)[0] for override in overrides]
    return [override for override, key in zip(overrides, keys) if key in HF_IGNORES or not key.startswith(HF_APPLIES)]


def planned_ids(trainer: Trainer):
    """The example ids of ``trainer.batches()``, batch by batch, without its loader."""
    cfg, store = trainer.cfg, trainer.train_store
    plans = epoch_plans(
        store,
        global_batch=cfg.train.batch_size,
        seed=cfg.train.seed,
        start=trainer.state.position,
        bucket_batches=cfg.data.bucket_batches,
    )
    return (ids for _, _, plan in plans for ids in plan)


class HFArm:
    """transformers' own model class of the run's architecture and objective + DataCollatorForLanguageModeling,
    full or sparse MLM head."""

    def __init__(self, trainer: Trainer, sparse: bool):
        self.device, self.sparse = trainer.accelerator.device, sparse
        cfg = trainer.cfg
        self.nsp = cfg.data.objective == choices.NSP
        self.architecture = architecture_of(trainer.model)
        self.model = self._model(trainer.model.config).to(self.device).train()
        self.model_config, self.store, self.batches = cfg.model, trainer.train_store, planned_ids(trainer)
        self.collator = DataCollatorForLanguageModeling(
            trainer.tokenizer,
            mlm_probability=cfg.masking.rate,
            mask_replace_prob=cfg.masking.mask_prob,
            random_replace_prob=cfg.masking.random_prob,
            whole_word_mask=cfg.masking.whole_word,
        )
        train = cfg.train
        # ModernBERT's recipe trains with StableAdamW (optimi's, in a hand-written loop): the anchor takes the same
        # class
        optimizer = StableAdamW if train.optimizer == choices.STABLE_ADAMW else partial(torch.optim.AdamW, fused=sparse)
        self.optimizer = optimizer(
            self.model.parameters(),
            lr=train.lr,
            betas=(train.adam_beta1, train.adam_beta2),
            eps=train.adam_eps,
            weight_decay=train.weight_decay,
        )
        self.max_grad_norm, self.autocast = train.max_grad_norm, trainer.accelerator.autocast

    def _model(self, config):
        """The adapter's class on mlmlab's own model config (the same shape, vocabulary, padding id, dropout and
        attention); a model with an NSP head trained without NSP is the BertForMaskedLM a plain MLM script builds."""
        if self.architecture.model_class is ModernBertForMaskedLM:  # its sparse head is the library's own option
            config = copy.deepcopy(config)
            config.sparse_prediction = self.sparse
            return ModernBertForMaskedLM(config)
        if self.architecture.has_nsp and not self.nsp:
            return BertForMaskedLM(config)
        return self.architecture.model_class(config)

    def next_batch(self) -> dict:
        """The plan's next examples, padded and corrupted by the collator, on the device: (B, T) tensors."""
        examples = [self.store[int(i)] for i in next(self.batches)]
        fields = ("input_ids", "token_type_ids") if self.nsp else ("input_ids",)
        batch = self.collator([{name: e[name].tolist() for name in fields} for e in examples])
        if self.nsp:
            batch["next_sentence_label"] = torch.tensor([e["next_sentence_label"] for e in examples])
        return {k: v.to(self.device) for k, v in batch.items()}

    def step(self) -> tuple[int, int, float]:
        """One step on the plan's next batch; its real tokens, padded slots and model FLOPs."""
        batch = self.next_batch()  # collated in the timed step, as a plain loop does
        with self.autocast():
            loss, head_positions = self._sparse_loss(batch) if self.sparse else self._full_loss(batch)
        loss.backward()
        if self.max_grad_norm:  # 0: not clipped
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        mask = batch["attention_mask"]
        flops = training_flops(self.model_config, self.model.config.vocab_size, mask, head_positions)
        return int(mask.sum()), mask.numel(), float(flops)

    def _full_loss(self, batch: dict) -> tuple[torch.Tensor, int]:
        # The head projects every slot, padding too; its FLOPs count real tokens only, as every arm's do.
        return self.model(**batch).loss, int(batch["attention_mask"].sum())

    def _sparse_loss(self, batch: dict) -> tuple[torch.Tensor, int]:
        """The MLM head on labelled positions only: ModernBERT's sparse_prediction, or by hand for the others
        (the encoder and head where the adapter finds them: BERT's cls.predictions, RoBERTa's lm_head)."""
        labels = batch["labels"]  # (B, T)
        selected = labels != IGNORE_INDEX  # (B, T)
        if isinstance(self.model, ModernBertForMaskedLM):
            return self.model(**batch).loss, int(selected.sum())
        hidden, pooled = encode(self.model, batch)  # (B, T, H); the pooled (B, H), None without a pooler
        logits = predict(self.model, hidden[selected])  # (M, V) of (M, H)
        loss = F.cross_entropy(logits.float(), labels[selected])
        if self.nsp:
            nsp_logits = self.architecture.nsp_logits(self.model, pooled)  # (B, 2)
            loss = loss + F.cross_entropy(nsp_logits.float(), batch["next_sentence_label"])
        return loss, int(selected.sum())


def mlmlab_step(trainer: Trainer):
    batches = trainer.batches()

    def step():
        out = trainer.train_step(batches)
        return out["tokens"], out["slots"], out["flops"]

    return step


def time_arm(step, steps: int, device) -> list:
    """[tokens, padded slots, FLOPs, seconds] summed over ``steps`` calls of ``step``."""
    totals = [0, 0, 0.0, 0.0]
    for _ in range(steps):
        start = clock(device)
        tokens, slots, flops = step()
        totals = [totals[0] + tokens, totals[1] + slots, totals[2] + flops, totals[3] + clock(device) - start]
    return totals


def warm_up(step, steps: int, compiled: bool, device) -> tuple[float, int]:
    """``steps`` calls of ``step``, and for a compiled arm as many more as it takes to compile every graph it
    meets (QUIET_STEPS in a row without one); the seconds and steps it took."""
    start, done, quiet = clock(device), 0, 0
    while done < steps or (compiled and quiet < QUIET_STEPS):
        graphs = counters["stats"]["unique_graphs"]
        step()
        done, quiet = done + 1, quiet + 1 if counters["stats"]["unique_graphs"] == graphs else 0
    return clock(device) - start, done


def build_arms(preset: str, args, folder: str) -> tuple[dict, dict]:
    """{arm name: step function} and {arm name: the trainer whose settings it trains with}.

    The first four at transformers' defaults plus --set, each loading in the timed step as the transformers arms
    do (data.loader_workers=0); the last two at mlmlab's defaults plus --set, mlmlab's loader as shipped.
    """
    anchor = [*ANCHOR_SETTINGS, *args.set, "data.loader_workers=0"]
    equal = make_trainer(preset, args, f"{folder}/equal", anchor)
    unbucketed = make_trainer(preset, args, f"{folder}/unbucketed", [*anchor, "data.bucket_batches=0"])
    shipped = make_trainer(preset, args, f"{folder}/shipped", args.set)
    trainers = {
        "hf-naive": unbucketed,
        "hf-sparse": equal,
        "mlmlab-unbucketed": unbucketed,
        "mlmlab": equal,
        "hf-sparse-recipe": shipped,
        "mlmlab-as-shipped": shipped,
    }
    for index, lever in enumerate(args.lever):
        trainers[lever_arm(lever)] = make_trainer(preset, args, f"{folder}/lever{index}", [*args.set, *lever])
    arms = {
        name: HFArm(trainer, sparse=name != "hf-naive").step if name.startswith("hf-") else mlmlab_step(trainer)
        for name, trainer in trainers.items()
    }
    return arms, trainers


def benchmark_preset(preset: str, args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        arms, trainers = build_arms(preset, args, folder)
        device = trainers["mlmlab"].accelerator.device
        warm_ups = {
            name: warm_up(step, args.warmup, trainers[name].cfg.train.compile, device) for name, step in arms.items()
        }
        totals = {name: [0, 0, 0.0, 0.0] for name in arms}
        for _ in range(args.rounds):  # interleaved: every arm sees the same machine load
            for name, step in arms.items():
                totals[name] = [a + b for a, b in zip(totals[name], time_arm(step, args.steps, device))]
        precisions = {name: trainer.precision for name, trainer in trainers.items()}
        # Longer than training's start-up timing and up to the largest size: the benchmark can afford it.
        peaks = {
            precision: peak_matmul_flops(device, precision.dtype, seconds=PEAK_SECONDS, big_enough=0.1)
            for precision in set(precisions.values())
        }
        settings = {name: describe_settings(trainer) for name, trainer in trainers.items()}
    return {
        "preset": preset,
        "device": str(device),
        "peaks": peaks,
        "settings": settings,
        "warm_ups": warm_ups,
        "levers": args.lever,
        "arms": {
            name: {
                "tokens_per_s": t[0] / t[3],
                "padding": 1 - t[0] / t[1],
                "precision": precisions[name],
                "mfu": t[2] / t[3] / peaks[precisions[name]],
            }
            for name, t in totals.items()
        },
    }


def describe_settings(trainer: Trainer) -> str:
    model = trainer.model.config.to_dict()
    dropouts = sorted({value for key, value in model.items() if "dropout" in key and isinstance(value, float)})
    return f"dropout {'/'.join(f'{d:g}' for d in dropouts)}, {dtype_name(trainer.precision)}"


def dtype_name(precision: Precision) -> str:
    """A run's precision as the dtype the matmuls run in ("float32", "bfloat16")."""
    return str(precision.dtype).removeprefix("torch.")


def print_preset(result: dict) -> None:
    peaks = ", ".join(
        f"{dtype_name(precision)} {peak / 1e12:.2f} TFLOP/s" for precision, peak in result["peaks"].items()
    )
    print(
        f"\n{result['preset']} on {result['device']}: measured matmul peak {peaks} "
        f"(the fastest of {PEAK_SECONDS:.0f} s of matmuls up to {peak_matmul_size(result['device'])}^2)"
    )
    print(f"  {'arm':<24} {'tokens/s':>10} {'padding':>8} {'precision':>10} {'MFU (of measured matmul peak)':>30}")
    for name, arm in result["arms"].items():
        print(
            f"  {name:<24} {arm['tokens_per_s']:>10.0f} {arm['padding']:>8.1%} {dtype_name(arm['precision']):>10} "
            f"{arm['mfu']:>30.1%}",
            flush=True,
        )


def print_verdicts(result: dict) -> None:
    """The same-recipe line (mlmlab's defaults for both) and the transformers-defaults line (dropout 0.1)."""
    arms, settings = result["arms"], result["settings"]
    threads = torch.get_num_threads()
    device = describe_cpu() if result["device"] == "cpu" else result["device"]
    where = f"{threads} thread{'s' if threads != 1 else ''}, {device}"
    for mlmlab, anchor, name in (
        ("mlmlab-as-shipped", "hf-sparse-recipe", "same recipe"),
        ("mlmlab", "hf-sparse", "transformers' defaults"),
    ):
        ratio = arms[mlmlab]["tokens_per_s"] / arms[anchor]["tokens_per_s"]
        print(f"{result['preset']} vs hf-sparse, {name}: {ratio:.2f}x ({settings[mlmlab]}; {where})", flush=True)
    base_seconds, base_steps = result["warm_ups"]["mlmlab-as-shipped"]
    for lever in result["levers"]:
        ratio = arms[lever_arm(lever)]["tokens_per_s"] / arms["mlmlab-as-shipped"]["tokens_per_s"]
        seconds, steps = result["warm_ups"][lever_arm(lever)]
        print(
            f"{result['preset']} lever {' '.join(lever)}: {ratio:.2f}x of mlmlab-as-shipped; its warm-up "
            f"{seconds:.0f} s over {steps} steps (mlmlab-as-shipped: {base_seconds:.1f} s over {base_steps})",
            flush=True,
        )


def lever_arm(lever: list[str]) -> str:
    """The arm's name: mlmlab+ and the lever's values, e.g. mlmlab+compile=true."""
    return "mlmlab+" + "+".join(override.rsplit(".", 1)[-1] for override in lever)


def describe_environment() -> str:
    """The header line of a measurement: the host, torch, its threads and the allocator settings it ran under."""
    allocator = ", ".join(f"{key}={os.environ.get(key, 'unset')}" for key in MALLOC_TUNING)
    return f"{describe_cpu()}; torch {torch.__version__}, threads {torch.get_num_threads()}, {allocator}"


def add_arm_options(parser: argparse.ArgumentParser, lever_use: str) -> None:
    """--set (overrides for every arm) and --lever (an mlmlab+<lever> arm each), as ``build_arms`` reads them."""
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides for every arm (the HF arms copy mlmlab's model config)",
    )
    parser.add_argument(
        "--lever",
        nargs="+",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"an mlmlab+<lever> arm: mlmlab-as-shipped with these overrides too, {lever_use}; repeat for more levers",
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "mini"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per arm per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    add_arm_options(parser, "A/B in the same run")
    parser.add_argument(
        "--no-malloc-tuning",
        action="store_true",
        help="measure without the glibc settings the mlmlab command applies (every arm alike)",
    )
    args = parser.parse_args(argv)
    if not args.no_malloc_tuning:
        reexec_with_malloc_tuning([sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    presets = list(args.presets)
    if torch.cuda.is_available() and "base" not in presets:
        presets.append("base")
    print(describe_environment())
    unapplied = not_applied_by_hf(args.set)
    if unapplied:
        print(f"hf-naive, hf-sparse, hf-sparse-recipe do not apply: {' '.join(unapplied)}")
    for preset in presets:  # each preset's figures as soon as they are measured
        result = benchmark_preset(preset, args)
        print_preset(result)
        print_verdicts(result)


if __name__ == "__main__":
    main()
