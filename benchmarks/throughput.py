"""Pretraining throughput: mlmlab against honest anchors, every arm measured in one interleaved run.

Arms, each with the same model size, vocabulary, data and batch size:

- ``hf-naive``: transformers' own model class (``BertForPreTraining`` with NSP, ``BertForMaskedLM``
  without, ``ModernBertForMaskedLM``; the full MLM head over every position) fed by
  ``DataCollatorForLanguageModeling`` in a plain loop with AdamW, plainly shuffled batches --
  what a researcher writes from the transformers docs.
- ``hf-sparse``: the anchor. The same transformers modules, but the MLM head applied only to
  the labelled positions (BERT: a researcher who knows the trick writes it in 30 lines;
  ModernBERT: transformers' own ``sparse_prediction`` option), fused AdamW, the same collator,
  batches grouped by length as the HF Trainer's ``group_by_length`` does. Most of mlmlab's ratio
  against ``hf-naive`` is this trick alone.
- ``mlmlab-unbucketed``: ``Trainer.train_step`` without length bucketing (data.bucket_batches=0).
- ``mlmlab``: ``Trainer.train_step`` as configured.

Arms are interleaved, because these shared machines swing +-30% between runs. Each arm's
tokens/s and MFU are its own real (non-padding) tokens and model FLOPs summed over its timed
steps, over its summed time; its padding share is printed beside. MFU is "of measured matmul
peak" (mlmlab.train.mfu, the same matmul size as training's log). The last lines compare
mlmlab with hf-sparse at equal settings (same precision and dropout) and as shipped
(mlmlab's defaults against the anchor with transformers' defaults: fp32 on CPU, dropout 0.1).

    python benchmarks/throughput.py                      # tiny and mini
    python benchmarks/throughput.py --presets mini --steps 30 --rounds 5
    python benchmarks/throughput.py --presets modernbert-tiny   # against ModernBertForMaskedLM(sparse_prediction)
    python benchmarks/throughput.py --set model.dropout=0.0   # overrides for every arm (equal settings)
    python benchmarks/throughput.py --set train.precision=bf16  # bf16 autocast (on a CPU with AMX, or a GPU)
    python benchmarks/throughput.py --no-malloc-tuning   # every arm with glibc's allocator defaults
"""

import argparse
import copy
import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from transformers import (
    BertForMaskedLM, BertForPreTraining, DataCollatorForLanguageModeling, ModernBertConfig, ModernBertForMaskedLM,
)
from transformers.trainer_pt_utils import get_length_grouped_indices

from mlmlab import choices
from mlmlab.cli import reexec_with_malloc_tuning
from mlmlab.config import load_config
from mlmlab.data.loader import epoch_batches
from mlmlab.model import IGNORE_INDEX
from mlmlab.train.loop import Trainer
from mlmlab.train.mfu import matmul_dtype, peak_matmul_flops, peak_matmul_size, training_flops
from mlmlab.utils.devices import clock, describe_cpu

ANCHOR_SETTINGS = ["train.precision=fp32", "model.dropout=0.1", "model.attention_dropout=0.1"]  # transformers' defaults
PEAK_SECONDS = 2.0  # how long each precision's matmul peak is timed


def make_trainer(preset: str, args, run_dir: str, overrides=()) -> Trainer:
    cfg = load_config(preset, [f"train.batch_size={args.batch_size}", f"data.max_seq_length={args.seq}",
                               "train.max_steps=100000", "train.eval_every=0", "train.save_every=0",
                               f"train.out_dir={run_dir}", "data.loader_workers=0", *overrides])
    return Trainer(cfg, evaluator=None, show_progress=False)


class HFArm:
    """transformers' own model class of the run's architecture and objective + DataCollatorForLanguageModeling,
    full or sparse MLM head."""

    def __init__(self, trainer: Trainer, sparse: bool):
        self.device, self.sparse = trainer.accelerator.device, sparse
        self.nsp = trainer.cfg.data.objective == choices.NSP
        self.model = self._model(trainer.model.config).to(self.device).train()
        self.model_config = trainer.cfg.model
        self.collator = DataCollatorForLanguageModeling(trainer.tokenizer, mlm_probability=0.15)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=sparse)
        self.autocast = trainer.accelerator.autocast

    def _model(self, config):
        if isinstance(config, ModernBertConfig):  # its sparse head is the library's own option
            config = copy.deepcopy(config)
            config.sparse_prediction = self.sparse
            return ModernBertForMaskedLM(config)
        return BertForPreTraining(config) if self.nsp else BertForMaskedLM(config)

    def step(self, examples: list[dict]) -> tuple[int, int, float]:
        """One step; its real tokens, padded slots and model FLOPs."""
        fields = ("input_ids", "token_type_ids") if self.nsp else ("input_ids",)
        batch = self.collator([{name: e[name].tolist() for name in fields} for e in examples])
        if self.nsp:
            batch["next_sentence_label"] = torch.tensor([e["next_sentence_label"] for e in examples])
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with self.autocast():
            loss, head_positions = self._sparse_loss(batch) if self.sparse else self._full_loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        mask = batch["attention_mask"]
        flops = training_flops(self.model_config, self.model.config.vocab_size, mask, head_positions)
        return int(mask.sum()), mask.numel(), float(flops)

    def _full_loss(self, batch: dict) -> tuple[torch.Tensor, int]:
        return self.model(**batch).loss, batch["input_ids"].numel()  # the head projects every position

    def _sparse_loss(self, batch: dict) -> tuple[torch.Tensor, int]:
        """The MLM head on labelled positions only: ModernBERT's sparse_prediction, or BERT's by hand."""
        labels = batch["labels"]  # (B, T)
        selected = labels != IGNORE_INDEX  # (B, T)
        if isinstance(self.model, ModernBertForMaskedLM):
            return self.model(**batch).loss, int(selected.sum())
        encoder = self.model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  token_type_ids=batch.get("token_type_ids"))
        logits = self.model.cls.predictions(encoder[0][selected])  # (M, V) of (B, T, H)
        loss = F.cross_entropy(logits.float(), labels[selected])
        if self.nsp:
            nsp_logits = self.model.cls.seq_relationship(encoder[1])  # (B, 2) of the pooled (B, H)
            loss = loss + F.cross_entropy(nsp_logits.float(), batch["next_sentence_label"])
        return loss, int(selected.sum())


def length_grouped_batches(store, batch_size: int):
    """Batches as the HF Trainer's group_by_length forms them (megabatches of 50 sorted by length)."""
    order = get_length_grouped_indices(store.lengths.tolist(), batch_size, generator=torch.Generator().manual_seed(0))
    for start in range(0, len(order) - batch_size + 1, batch_size):
        yield order[start:start + batch_size]


def hf_step(arm: HFArm, store, batches):
    return lambda: arm.step([store[int(i)] for i in next(batches)])


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


def build_arms(preset: str, args, folder: str) -> tuple[dict, Trainer, dict]:
    """{arm name: step function}, the equal-settings trainer, and {arm name: its precision}.

    Equal settings: every arm with the anchor's settings plus --set. The as-shipped arm may train in
    another precision (auto is bf16 on CPUs with AMX), so its MFU needs that precision's peak.
    """
    equal = [*ANCHOR_SETTINGS, *args.set]
    shipped = make_trainer(preset, args, f"{folder}/shipped", args.set)
    trainer = make_trainer(preset, args, f"{folder}/equal", equal)
    unbucketed = make_trainer(preset, args, f"{folder}/unbucketed", [*equal, "data.bucket_batches=0"])
    store, batch = trainer.train_store, args.batch_size
    arms = {
        "hf-naive": hf_step(HFArm(trainer, sparse=False), store, iter(epoch_batches(len(store), batch, 0, 0))),
        "hf-sparse": hf_step(HFArm(trainer, sparse=True), store, length_grouped_batches(store, batch)),
        "mlmlab-unbucketed": mlmlab_step(unbucketed),
        "mlmlab": mlmlab_step(trainer),
    }
    precisions = dict.fromkeys(arms, trainer.precision)
    if _differs(shipped, trainer):  # else the mlmlab arm is also the as-shipped one
        arms["mlmlab-as-shipped"], precisions["mlmlab-as-shipped"] = mlmlab_step(shipped), shipped.precision
    return arms, trainer, precisions


def _differs(a: Trainer, b: Trainer) -> bool:
    """Whether two trainers would train differently: model (dropout included), masking, data or precision."""
    def resolved(trainer: Trainer) -> tuple:
        cfg = trainer.cfg
        return trainer.model.config.to_dict(), cfg.masking, cfg.data, trainer.precision
    return resolved(a) != resolved(b)


def benchmark_preset(preset: str, args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        arms, trainer, precisions = build_arms(preset, args, folder)
        device = trainer.accelerator.device
        for step in arms.values():
            time_arm(step, args.warmup, device)
        totals = {name: [0, 0, 0.0, 0.0] for name in arms}
        for _ in range(args.rounds):  # interleaved: every arm sees the same machine load
            for name, step in arms.items():
                totals[name] = [a + b for a, b in zip(totals[name], time_arm(step, args.steps, device))]
        # Longer than training's start-up timing and up to the largest size: the benchmark can afford it.
        peaks = {precision: peak_matmul_flops(device, matmul_dtype(precision), seconds=PEAK_SECONDS, big_enough=0.1)
                 for precision in set(precisions.values())}
    return {"preset": preset, "device": str(device), "peaks": peaks,
            "arms": {name: {"tokens_per_s": t[0] / t[3], "padding": 1 - t[0] / t[1], "precision": precisions[name],
                            "mfu": t[2] / t[3] / peaks[precisions[name]]} for name, t in totals.items()}}


def dtype_name(precision: str) -> str:
    """accelerate's precision name ("no", "bf16") as the dtype the matmuls run in ("float32", "bfloat16")."""
    return str(matmul_dtype(precision)).removeprefix("torch.")


def print_preset(result: dict) -> None:
    peaks = ", ".join(f"{dtype_name(precision)} {peak / 1e12:.2f} TFLOP/s" for precision, peak in result["peaks"].items())
    print(f"\n{result['preset']} on {result['device']}: measured matmul peak {peaks} "
          f"(the fastest of {PEAK_SECONDS:.0f} s of matmuls up to {peak_matmul_size(result['device'])}^2)")
    print(f"  {'arm':<20} {'tokens/s':>10} {'padding':>8} {'precision':>10} {'MFU (of measured matmul peak)':>30}")
    for name, arm in result["arms"].items():
        print(f"  {name:<20} {arm['tokens_per_s']:>10.0f} {arm['padding']:>8.1%} {dtype_name(arm['precision']):>10} "
              f"{arm['mfu']:>30.1%}", flush=True)


def print_verdicts(results: list[dict]) -> None:
    for result in results:
        arms, anchor = result["arms"], result["arms"]["hf-sparse"]["tokens_per_s"]
        shipped = arms.get("mlmlab-as-shipped", arms["mlmlab"])["tokens_per_s"]
        print(f"{result['preset']} vs hf-sparse, equal settings: {arms['mlmlab']['tokens_per_s'] / anchor:.2f}x")
        print(f"{result['preset']} vs hf-sparse, as shipped: {shipped / anchor:.2f}x")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "mini"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per arm per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for every arm (the HF arms copy mlmlab's model config)")
    parser.add_argument("--no-malloc-tuning", action="store_true",
                        help="measure without the glibc settings the mlmlab command applies (every arm alike)")
    args = parser.parse_args(argv)
    if not args.no_malloc_tuning:
        reexec_with_malloc_tuning([sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    presets = list(args.presets)
    if torch.cuda.is_available() and "base" not in presets:
        presets.append("base")
    print(f"{describe_cpu()}; torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"MALLOC_TRIM_THRESHOLD_={os.environ.get('MALLOC_TRIM_THRESHOLD_', 'unset')}")
    results = [benchmark_preset(preset, args) for preset in presets]
    for result in results:
        print_preset(result)
    print()
    print_verdicts(results)


if __name__ == "__main__":
    main()
