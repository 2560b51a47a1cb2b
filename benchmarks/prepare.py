"""Data preparation speed: `mlmlab prepare` against the tokenizer's own batch encoding, in one run.

- ``tokenizer``: the corpus's sentences (split as prepare splits them, before the clock
  starts) through ``tokenizers``' ``encode_batch`` with its Rust threads on every core:
  the best a hand-written tokenizing loop gets, doing nothing else.
- ``prepare``: ``mlmlab.data.build.prepare`` from the corpus file into a fresh folder, with
  its default worker count: reading and decompressing, sentence splitting, tokenizing,
  building NSP instances (or packed blocks) and writing the shards.

Both count the same wordpieces: the corpus's tokens, which prepare also counts
(``num_corpus_tokens``; checked equal). The arms alternate, rounds after a warm-up; medians
are printed, with "cores busy": CPU seconds of the process and its workers over wall
seconds. The last line is ``prepare vs tokenizer: N.NN`` (prepare's rate over the tokenizer's).

    python benchmarks/prepare.py                        # the bundled sample: 2,038 documents, 2 chunks
    python benchmarks/prepare.py --corpus ../shared/data/enwiki_sample/train.txt.gz --rounds 3
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from mlmlab import choices
from mlmlab.data.build import prepare
from mlmlab.data.corpus import document_sentences, read_paragraph_documents
from mlmlab.data.resolve import SAMPLE_TRAIN, tokenizer_dir_for
from mlmlab.data.tokenizer import load_tokenizer
from mlmlab.utils.devices import available_cores, describe_cpu


def cpu_seconds() -> float:
    """User + system seconds of this process and of its finished children (prepare's workers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def timed(work) -> tuple[int, float, float]:
    """(wordpieces work returns, wall seconds, cores busy on average)."""
    cpu, started = cpu_seconds(), time.perf_counter()
    wordpieces = work()
    wall = time.perf_counter() - started
    return wordpieces, wall, (cpu_seconds() - cpu) / wall


def tokenizer_arm(tokenizer_dir: Path, corpus: Path):
    """encode_batch over every sentence of the corpus, Rust threads on; returns the wordpieces."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    tokenizer = load_tokenizer(tokenizer_dir).backend_tokenizer
    tokenizer.encode_special_tokens = True  # as prepare: "[MASK]" in the text is text
    sentences = [s for paragraphs in read_paragraph_documents(corpus) for s in document_sentences(paragraphs)]

    def run() -> int:
        return sum(len(encoding) for encoding in tokenizer.encode_batch(sentences, add_special_tokens=False))

    return run


def prepare_arm(tokenizer_dir: Path, corpus: Path, objective: str, scratch: Path):
    """prepare into a fresh folder each time; returns the corpus's wordpieces it counted."""

    def run() -> int:
        out = Path(tempfile.mkdtemp(dir=scratch)) / "data"
        folder = prepare(corpus, tokenizer_dir, 128, objective=objective, out_dir=out)
        wordpieces = json.loads((folder / "meta.json").read_text())["num_corpus_tokens"]
        shutil.rmtree(out.parent)
        return wordpieces

    return run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=SAMPLE_TRAIN)
    parser.add_argument("--tokenizer", default="", help="a tokenizer folder or vocab.txt (default: the bundled one)")
    parser.add_argument("--objective", choices=choices.OBJECTIVES, default=choices.NSP)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"{describe_cpu()}; {available_cores()} cores for this process (prepare's default worker count)")
    tokenizer_dir = tokenizer_dir_for(args.tokenizer)
    with tempfile.TemporaryDirectory() as scratch:
        arms = {
            "tokenizer": tokenizer_arm(tokenizer_dir, args.corpus),
            "prepare": prepare_arm(tokenizer_dir, args.corpus, args.objective, Path(scratch)),
        }
        for work in arms.values():  # warm-up: page cache, allocator, tokenizer threads
            work()
        measured = {name: [] for name in arms}
        for _ in range(args.rounds):
            for name, work in arms.items():
                measured[name].append(timed(work))
    wordpieces = {name: {result[0] for result in results} for name, results in measured.items()}
    if wordpieces["tokenizer"] != wordpieces["prepare"]:
        raise SystemExit(f"the arms counted different wordpieces: {wordpieces}")
    rates = {}
    for name, results in measured.items():
        wall = statistics.median(result[1] for result in results)
        busy = statistics.median(result[2] for result in results)
        rates[name] = results[0][0] / wall
        print(
            f"{name:<10} {rates[name]:>12,.0f} wordpieces/s  (median of {args.rounds}: {wall:.2f} s, "
            f"cores busy {busy:.1f})"
        )
    print(f"prepare vs tokenizer: {rates['prepare'] / rates['tokenizer']:.2f}")


if __name__ == "__main__":
    main()
