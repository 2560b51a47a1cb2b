#!/bin/bash
# Is it faster to run a study's runs two at a time on one thread each than one at a time on two?
# One run alone (torch's default threads), then two at once with OMP_NUM_THREADS=1, each 300 steps
# of the given run config; prints the median tokens/s after step 50 and the ratio. Idle machine only.
#   benchmarks/parallel_runs.sh studies/adm-study-wp8k-9k/runs/dynamic/seed0/config.yaml
set -e
CFG=${1:?a run config.yaml}
OUT=$(mktemp -d)
COMMON="train.max_steps=300 train.eval_every=0 train.save_every=0 train.log_every=50 train.eval_batches=1"
mlmlab pretrain --config "$CFG" --no-progress $COMMON train.out_dir=$OUT/alone > $OUT/alone.log 2>&1
OMP_NUM_THREADS=1 mlmlab pretrain --config "$CFG" --no-progress $COMMON train.out_dir=$OUT/a > $OUT/a.log 2>&1 &
OMP_NUM_THREADS=1 mlmlab pretrain --config "$CFG" --no-progress $COMMON train.out_dir=$OUT/b train.seed=1 masking.seed=1 > $OUT/b.log 2>&1 &
wait
python - "$OUT" <<'PY'
import json, statistics, sys
def rate(run):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}/{run}/metrics.jsonl")]
    return statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 50)
alone, a, b = rate("alone"), rate("a"), rate("b")
print(f"one run alone: {alone:.0f} tokens/s; two runs at once, 1 thread each: {a:.0f} + {b:.0f} = {a + b:.0f} "
      f"({(a + b) / alone:.2f}x)")
PY
rm -rf "$OUT"
