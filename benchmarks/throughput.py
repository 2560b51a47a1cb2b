"""Pretraining throughput: mlmlab vs transformers' own pretraining loop, measured in one run.

Baseline: ``BertForPreTraining`` (full MLM head over every position) fed by
``DataCollatorForLanguageModeling`` in a plain PyTorch loop with AdamW -- what a
researcher writes from the transformers docs. mlmlab: ``Trainer.train_step`` (masking
in the step, MLM head on selected positions only). Same model size, vocabulary, data,
batch and precision. Arms are interleaved, because these shared machines swing +-30%
between runs; each arm's tokens/s and MFU are its own real (non-padding) tokens and
model FLOPs summed over its timed steps, over its summed time. MFU is against the matmul
FLOP/s measured here; bf16 tokens/s of the base preset are added when a GPU is present.

    python benchmarks/throughput.py                 # tiny and mini, both arms with mlmlab's malloc settings
    python benchmarks/throughput.py --no-malloc-tuning   # both arms with glibc's defaults
    python benchmarks/throughput.py --presets mini --steps 30 --rounds 5
    python benchmarks/throughput.py --presets mini --set model.dropout=0.0   # config overrides, both arms
"""

import argparse
import os
import sys
import tempfile

import torch
from transformers import BertForPreTraining, DataCollatorForLanguageModeling

from mlmlab import choices
from mlmlab.cli import reexec_with_malloc_tuning
from mlmlab.config import load_config
from mlmlab.data.loader import epoch_batches
from mlmlab.devices import clock
from mlmlab.train.loop import Trainer
from mlmlab.train.mfu import matmul_dtype, peak_matmul_flops, training_flops


def make_trainer(preset: str, batch_size: int, seq: int, run_dir: str, precision: str, overrides=()) -> Trainer:
    cfg = load_config(preset, [f"train.batch_size={batch_size}", f"data.max_seq_length={seq}",
                               "train.max_steps=100000", "train.eval_every=0", "train.save_every=0",
                               f"train.out_dir={run_dir}", f"train.precision={precision}", "data.loader_workers=0",
                               *overrides])
    return Trainer(cfg, validate=None, show_progress=False)


class Baseline:
    """transformers' BertForPreTraining + DataCollatorForLanguageModeling + AdamW."""

    def __init__(self, trainer: Trainer):
        self.device = trainer.accelerator.device
        self.model = BertForPreTraining(trainer.model.config).to(self.device).train()
        self.model_config = trainer.cfg.model
        self.collator = DataCollatorForLanguageModeling(trainer.tokenizer, mlm_probability=0.15)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.autocast = trainer.accelerator.autocast

    def step(self, examples: list[dict]) -> tuple[int, float]:
        """One step; its real tokens and model FLOPs (the full head projects every padded position)."""
        batch = self.collator([{"input_ids": e["input_ids"].tolist(), "token_type_ids": e["token_type_ids"].tolist()}
                               for e in examples])
        batch["next_sentence_label"] = torch.tensor([e["next_sentence_label"] for e in examples])
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with self.autocast():
            loss = self.model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        mask = batch["attention_mask"]
        flops = training_flops(self.model_config, self.model.config.vocab_size, mask, mask.numel())
        return int(mask.sum()), float(flops)


def time_arm(step, steps: int, device) -> list[float]:
    """[tokens, FLOPs, seconds] summed over ``steps`` calls of ``step`` (which returns its tokens and FLOPs)."""
    totals = [0, 0.0, 0.0]
    for _ in range(steps):
        start = clock(device)
        tokens, flops = step()
        totals = [totals[0] + tokens, totals[1] + flops, totals[2] + clock(device) - start]
    return totals


def benchmark_preset(preset: str, args) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = make_trainer(preset, args.batch_size, args.seq, run_dir, args.precision, args.set)
        device = trainer.accelerator.device
        store = trainer.train_store
        baseline = Baseline(trainer)
        batches = trainer.batches()
        # The baseline gets plainly shuffled batches (no length bucketing: that is one of mlmlab's savings).
        plain = iter(epoch_batches(len(store), args.batch_size, seed=0, epoch=0))

        def baseline_step():
            return baseline.step([store[int(i)] for i in next(plain)])

        def mlmlab_step():
            out = trainer.train_step(batches)
            return out["tokens"], out["flops"]

        time_arm(baseline_step, args.warmup, device)
        time_arm(mlmlab_step, args.warmup, device)
        base, ours = [0, 0.0, 0.0], [0, 0.0, 0.0]
        for _ in range(args.rounds):  # interleaved: both arms see the same machine load
            base = [a + b for a, b in zip(base, time_arm(baseline_step, args.steps, device))]
            ours = [a + b for a, b in zip(ours, time_arm(mlmlab_step, args.steps, device))]
        peak = peak_matmul_flops(device, matmul_dtype(trainer.accelerator.mixed_precision))
        return {
            "preset": preset, "device": str(device), "precision": trainer.accelerator.mixed_precision,
            "baseline_tokens_per_s": base[0] / base[2], "mlmlab_tokens_per_s": ours[0] / ours[2],
            "ratio": (ours[0] / ours[2]) / (base[0] / base[2]),
            "mlmlab_mfu": ours[1] / ours[2] / peak, "baseline_mfu": base[1] / base[2] / peak,
            "peak_matmul_tflops": peak / 1e12,
        }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "mini"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per arm per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", default=choices.AUTO, choices=choices.PRECISIONS)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for both arms (the baseline copies mlmlab's model config)")
    parser.add_argument("--no-malloc-tuning", action="store_true",
                        help="measure without the glibc settings the mlmlab command applies (both arms alike)")
    args = parser.parse_args(argv)
    if not args.no_malloc_tuning:
        reexec_with_malloc_tuning([sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    presets = list(args.presets)
    if torch.cuda.is_available() and "base" not in presets:
        presets.append("base")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"MALLOC_TRIM_THRESHOLD_={os.environ.get('MALLOC_TRIM_THRESHOLD_', 'unset')}", file=sys.stderr)
    header = f"{'preset':<6} {'device':<6} {'prec':<5} {'baseline tok/s':>15} {'mlmlab tok/s':>13} {'ratio':>6} {'MFU':>6} {'base MFU':>8}"
    print(header)
    for preset in presets:
        r = benchmark_preset(preset, args)
        print(f"{r['preset']:<6} {r['device']:<6} {r['precision']:<5} {r['baseline_tokens_per_s']:>15.0f} "
              f"{r['mlmlab_tokens_per_s']:>13.0f} {r['ratio']:>5.2f}x {r['mlmlab_mfu']:>6.1%} {r['baseline_mfu']:>8.1%}",
              flush=True)


if __name__ == "__main__":
    main()
