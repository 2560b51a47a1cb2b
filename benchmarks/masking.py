"""Masking cost: mlmlab vs transformers' collator, ADM scorer overhead, entropy peak memory.

Prints ratios measured in this one run (medians over interleaved repetitions):

1. time to mask one batch (32 x 128, bert-base-uncased vocab): mlmlab's uniform
   ``mask_batch`` vs ``DataCollatorForLanguageModeling`` (its masking method and its
   whole call on pre-tokenised examples);
2. step-time overhead of span and PMI masking and of each ADM scorer relative to dynamic
   masking, at the tiny (L2/H128) and mini (L4/H256) sizes, seq 128, batch 32; a step = a
   training step's masking (``Masker``: weights, units, selection) + pretraining_loss +
   backward + AdamW step + what ADM learns, timed in blocks of ``score_every`` steps;
3. peak RSS of the entropy scorer, chunked vs naive full softmax, at batch 64 of mini.

Usage: python benchmarks/masking.py [--rounds N] [--quick]
"""

import argparse
import gzip
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlmlab import choices  # noqa: E402
from mlmlab.config import MaskingConfig, ModelConfig  # noqa: E402
from mlmlab.data.build import prepare  # noqa: E402
from mlmlab.data.store import TokenStore  # noqa: E402
from mlmlab.data.tokenizer import adopt_vocab, load_tokenizer  # noqa: E402
from mlmlab.masking.masker import Masker  # noqa: E402
from mlmlab.masking.scorers import scorer_names  # noqa: E402
from mlmlab.masking.select import Corruption, mask_batch, token_info_for  # noqa: E402
from mlmlab.masking.variants import READS_LOSSES, READS_MODEL  # noqa: E402
from mlmlab.model.pretraining import build_model, pretraining_loss  # noqa: E402

VOCAB = ROOT.parent / "shared" / "data" / "bert_vocab" / "bert-base-uncased-vocab.txt"
SAMPLE = ROOT / "mlmlab" / "resources" / "sample"
SIZES = {
    "tiny": ModelConfig(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=512),
    "mini": ModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024),
}
SEQ, BATCH = 128, 32
COST_CONTROL_EVERY = (4, 10)  # entropy "with cost control": score every K-th step, uniform masks between
# Units of whole words: SpanBERT's spans, and PMI n-grams (a vocabulary sized for the 600k-word sample)
UNIT_ARMS = {
    choices.SPAN: MaskingConfig(strategy=choices.SPAN),
    choices.PMI: MaskingConfig(strategy=choices.PMI, pmi_vocab_size=20000),
}


def prepared_sample(folder: Path):
    """The bundled training sample prepared with the bert-base vocabulary: the corpus PMI masking's n-grams come
    from (built beside it when the pmi arm is set up, before any timing)."""
    return TokenStore(
        prepare(
            [SAMPLE / "train.txt.gz"], tokenizer_dir=folder / "uncased", max_seq_length=SEQ, out_dir=folder / "data"
        )
    )


def load_bert_tokenizer(folder: Path):
    vocab = VOCAB if VOCAB.exists() else SAMPLE / "vocab.txt"
    tokenizer = load_tokenizer(adopt_vocab(vocab, folder / "uncased"))  # a folder + from_pretrained
    assert len(tokenizer) == 30522, f"expected the 30522-token bert-base-uncased vocab, got {len(tokenizer)}"
    return tokenizer


def real_batch(tokenizer, batch_size: int, offset: int = 0) -> dict:
    with gzip.open(SAMPLE / "train.txt.gz", "rt", encoding="utf-8") as handle:
        lines = [line.strip() for line in handle if len(line) > 600 and not line.startswith("<")]
    text = lines[offset : offset + batch_size]
    enc = tokenizer(text, truncation=True, max_length=SEQ, padding="max_length", return_tensors="pt")
    n = len(text)
    return {
        "input_ids": enc["input_ids"],
        "attention_mask": enc["attention_mask"],
        "token_type_ids": torch.zeros_like(enc["input_ids"]),
        "example_ids": torch.arange(offset, offset + n),
        "next_sentence_label": torch.zeros(n, dtype=torch.long),
    }


def median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_mask_time(tokenizer, reps: int) -> None:
    from transformers import DataCollatorForLanguageModeling

    info, batch = token_info_for(tokenizer), real_batch(tokenizer, BATCH)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, seed=0)
    examples = [{"input_ids": row[row != tokenizer.pad_token_id].tolist()} for row in batch["input_ids"]]
    arms = {
        "mlmlab mask_batch": lambda: mask_batch(
            batch, seed=0, epoch_key=1, rate=0.15, info=info, corruption=Corruption()
        ),
        "HF torch_mask_tokens": lambda: collator.torch_mask_tokens(batch["input_ids"].clone()),
        "HF collator(examples)": lambda: collator(examples),
    }
    for fn in arms.values():
        fn()
    times = {name: [] for name in arms}
    for _ in range(reps):  # interleaved
        for name, fn in arms.items():
            times[name].append(median_seconds(fn, 1))
    ours = statistics.median(times["mlmlab mask_batch"])
    print(f"\n[1] masking one {BATCH}x{SEQ} batch (median of {reps}, interleaved)")
    for name, values in times.items():
        m = statistics.median(values)
        print(f"  {name:24s} {m * 1e3:8.2f} ms   ratio to mlmlab {m / ours:5.2f}")


def bench_overhead(tokenizer, size: str, arms: dict, rounds: int, corpus) -> None:
    vocab = len(tokenizer)
    torch.manual_seed(0)  # benchmark only: model init
    bert = build_model(SIZES[size], vocab, tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(bert.parameters(), lr=1e-4)
    batches = [real_batch(tokenizer, BATCH, offset=i * BATCH) for i in range(4)]
    # a training step's masking (masker.py): weights, units of words (span, pmi), selection, what ADM learns
    maskers = {name: Masker(cfg, tokenizer, None, corpus=corpus) for name, cfg in arms.items()}
    counter = {"step": 0}

    def block(name: str) -> float:
        """Seconds per step over one scoring period of the arm (score_every steps)."""
        masker, cfg = maskers[name], arms[name]
        start = time.perf_counter()
        for step in range(1, cfg.score_every + 1):  # the first step of the period is scored
            batch = batches[counter["step"] % len(batches)]
            counter["step"] += 1
            masked, _ = masker.mask(batch, counter["step"], bert, progress=1.0, step=step)  # ADM: a = a_max
            result = pretraining_loss(bert, masked)
            result["loss"].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            masker.learn_step([masked], [result])
        return (time.perf_counter() - start) / cfg.score_every

    for name in arms:  # warm up (and fill the loss tables)
        block(name)
    times = {name: [] for name in arms}
    for _ in range(rounds):
        for name in arms:
            times[name].append(block(name))
    base = statistics.median(times[choices.DYNAMIC])
    print(
        f"\n[2] step time, {size} ({SIZES[size].num_layers}L/H{SIZES[size].hidden_size}), "
        f"batch {BATCH} x seq {SEQ}, vocab {vocab}, median of {rounds} interleaved blocks"
    )
    for name, values in times.items():
        m = statistics.median(values)
        print(f"  {name:28s} {m * 1e3:8.1f} ms/step   overhead vs dynamic {100 * (m / base - 1):+6.1f}%")


_PEAK = """
import resource, sys, torch
sys.path[:0] = [{root!r}, {root!r} + "/tests"]
from reference import naive_entropy_scores
from mlmlab.config import ModelConfig
from mlmlab.masking import scorers
from mlmlab.masking.select import eligible_positions
from mlmlab.model.pretraining import build_model
V, B, T = 30522, 64, 128
model = build_model(ModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024), V, 0)
g = torch.Generator().manual_seed(0)
ids = torch.randint(999, V, (B, T), generator=g)
batch = {{"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}}
eligible = eligible_positions(ids, (0, 100, 101, 102, 103))
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base = rss()
a = scorers.entropy_scores(model, batch, eligible, V, chunk=2048)  # chunked first: the high-water mark only rises
chunked = rss() - base
b = naive_entropy_scores(model, batch, eligible, V)
print(chunked, rss() - base, float((a - b).abs().max()))
"""


def bench_peak_memory() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PEAK.format(root=str(ROOT))], capture_output=True, text=True, check=True
    )
    chunked, naive, diff = map(float, out.stdout.split()[-3:])
    print("\n[3] entropy scorer peak RSS above baseline, mini, batch 64 x seq 128, vocab 30522")
    print(f"  chunked (2048 positions)  {chunked:8.0f} MiB")
    print(
        f"  naive full softmax        {naive:8.0f} MiB   ratio naive/chunked {naive / max(chunked, 1):.1f}x"
        f"   max |diff| {diff:.1e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing blocks per arm and size")
    parser.add_argument("--quick", action="store_true", help="tiny size only, no memory measurement")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = load_bert_tokenizer(Path(tmp))
        bench_mask_time(tokenizer, reps=30)
        corpus = prepared_sample(Path(tmp))
        adm = dict(strategy=choices.ADAPTIVE, adapt_schedule=choices.CONSTANT)
        tiny_arms = {
            choices.DYNAMIC: MaskingConfig(strategy=choices.DYNAMIC),
            **UNIT_ARMS,
            **{scorer: MaskingConfig(**adm, scorer=scorer) for scorer in scorer_names(READS_LOSSES)},
            **{
                f"{choices.ENTROPY} every {k}": MaskingConfig(**adm, scorer=choices.ENTROPY, score_every=k)
                for k in COST_CONTROL_EVERY
            },
            **{f"{scorer} every step": MaskingConfig(**adm, scorer=scorer) for scorer in scorer_names(READS_MODEL)},
        }
        bench_overhead(tokenizer, "tiny", tiny_arms, args.rounds, corpus)
        if not args.quick:
            dear = (choices.MAX_PROB, choices.GRAD_NORM)
            mini_arms = {k: v for k, v in tiny_arms.items() if not k.startswith(dear)}
            bench_overhead(tokenizer, "mini", mini_arms, max(2, args.rounds - 1), corpus)
            bench_peak_memory()


if __name__ == "__main__":
    main()
