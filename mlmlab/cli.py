"""The ``mlmlab`` command: one function per subcommand, no logic beyond parsing and calling.

Each subcommand imports what it runs inside its function: ``mlmlab --help`` and a
mistyped option then answer without first importing torch and transformers (seconds).
"""

import argparse
import dataclasses
import json
import os
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

from mlmlab import choices
from mlmlab.config import (
    BELOW_ONE,
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    SEEDS,
    DataConfig,
    MaskingConfig,
    at_least,
    config_listing,
    frequency_cuts,
    load_config,
    named_keys,
    preset_names,
)
from mlmlab.config import number_argument as number
from mlmlab.data.records import Columns
from mlmlab.errors import UserError, write_refusal
from mlmlab.evaluate.glue_settings import FineTuneSettings, GlueSettings
from mlmlab.utils import jsonio
from mlmlab.utils.allocator import reexec_with_malloc_tuning
from mlmlab.utils.signals import exit_code, sigterm_unwinds


def columns_of(args):
    """--text-column / --id-column as the readers take them."""
    return Columns(args.text_column, args.id_column)


def cmd_tokenizer(args) -> None:
    from mlmlab.data.corpus import named_files, resolve_paths
    from mlmlab.data.tokenizer import adopt_vocab, load_tokenizer, train_tokenizer

    refuse_ignored_tokenizer_options(args)
    if args.vocab:
        out, source = adopt_vocab(args.vocab, args.out, lowercase=not args.cased), f"adopted from {args.vocab}"
    else:
        if not args.corpus:
            raise UserError("give --corpus PATH... to train a tokenizer, or --vocab FILE to adopt a vocab.txt")
        files = resolve_paths(args.corpus)
        kind = args.kind or choices.WORDPIECE
        lowercase = not args.cased if kind == choices.WORDPIECE else args.lowercase
        out = train_tokenizer(
            files,
            args.vocab_size or TOKENIZER_VOCAB_SIZE,
            args.out,
            lowercase=lowercase,
            columns=columns_of(args),
            show_progress=not args.no_progress,
            kind=kind,
        )
        source = f"trained on {named_files(files)}"
    print(f"tokenizer with {len(load_tokenizer(out))} tokens saved to {out}, {source}")


TOKENIZER_VOCAB_SIZE = 30522  # mlmlab tokenizer's default --vocab-size: BERT's


def refuse_ignored_tokenizer_options(args) -> None:
    """Options of ``mlmlab tokenizer`` that cannot apply together, refused rather than dropped without a word."""
    if args.cased and args.lowercase:
        raise UserError("--cased keeps case and --lowercase lowercases; give one of them")
    if not args.vocab:
        return
    given = {
        "--corpus": args.corpus,
        "--kind": args.kind,
        "--vocab-size": args.vocab_size,
        "--text-column": args.text_column != Columns.text,
        "--id-column": args.id_column,
    }
    trains = [option for option, value in given.items() if value]
    if trains:
        named = " and ".join([", ".join(trains[:-1]), trains[-1]] if len(trains) > 1 else trains)
        raise UserError(
            f"--vocab adopts a WordPiece vocab.txt as it is, so {named} would change nothing (they train a "
            f"tokenizer); drop {'them' if len(trains) > 1 else 'it'}, or drop --vocab to train one"
        )


def cmd_prepare(args) -> None:
    from mlmlab.data.build import prepare, token_use
    from mlmlab.data.resolve import tokenizer_dir_for
    from mlmlab.data.store import TokenStore

    out = prepare(
        args.corpus,
        tokenizer_dir=tokenizer_dir_for(args.tokenizer),
        max_seq_length=args.max_seq_length,
        objective=args.objective,
        short_seq_prob=args.short_seq_prob,
        seed=args.seed,
        out_dir=args.out,
        num_workers=args.workers,
        columns=columns_of(args),
        show_progress=not args.no_progress,
    )
    store = TokenStore(out)
    print(f"{len(store)} instances in {out}" + (f" ({use})" if (use := token_use(store.meta)) else ""))


def masking_of(args, first: tuple[str, ...] = ()) -> MaskingConfig:
    """The masking section of --config with ``first``, any old masking option (each said to be its setting) and
    the overrides, in that order, read as pretrain reads its own."""
    settings = []
    for flag, name in OLD_MASKING_FLAGS.items():
        if hasattr(args, f"old_{name}"):
            value = getattr(args, f"old_{name}")
            setting = f"masking.{name}={'true' if value is True else value}"
            print(
                f"mlmlab: note: {flag} is {setting} now, as pretrain takes it; {flag} goes in the next release",
                file=sys.stderr,
            )
            settings.append(setting)
    return load_config(args.config, [*first, *settings, *args.overrides]).masking


def cmd_dump(args) -> None:
    from mlmlab.show import dump_instances, top_ngrams

    if args.ngrams:  # PMI's vocabulary: its masking.pmi_* settings, whatever strategy the config names
        masking = masking_of(args, first=(f"masking.strategy={choices.PMI}",))
        for record in top_ngrams(args.data, args.ngrams, masking):
            print(json.dumps(record, ensure_ascii=False))
        return
    masking = masking_of(args)
    shown = dump_instances(
        args.data,
        args.n,
        masking,
        start=args.start,
        masked=args.masked,
        epoch=args.epoch,
        progress=args.training_progress,
    )
    for record in shown:
        print(json.dumps(record, ensure_ascii=False))


def cmd_mask(args) -> None:
    from mlmlab.show import mask_sentence

    shown = mask_sentence(
        args.text,
        masking_of(args),
        tokenizer=args.tokenizer,
        data=args.data,
        model=args.model,
        progress=args.training_progress,
        epoch=args.epoch,
    )
    print(shown)


def cmd_pretrain(args) -> None:
    from accelerate import PartialState

    from mlmlab.evaluate.perplexity import evaluate_mlm
    from mlmlab.model.architectures import check_config
    from mlmlab.show import pretrain_summary
    from mlmlab.train.loop import Trainer
    from mlmlab.utils.files import require_output, write_text_atomically

    if args.json and args.json != "-":
        require_output(Path(args.json), "--json", folder=False)
    init = [f"train.init={json.dumps(args.init)}"] if args.init else []  # quoted: a folder named 007 stays text
    cfg = load_config(args.config, [*args.overrides, *init])
    check_config(cfg)  # before --processes starts any
    if args.processes > 1:
        from mlmlab.train.launch import over_processes
        from mlmlab.utils.progress import say

        command, env, line = over_processes(args.argv, args.processes, cfg)
        say(line)
        os.execve(command[0], command, env)  # torchrun forwards SIGTERM and Ctrl-C to every process
    trainer = Trainer(
        cfg,
        evaluator=evaluate_mlm,
        resume=args.resume,
        show_progress=not args.no_progress,
        named=named_keys(args.config, args.overrides),
    )
    summary = trainer.train()
    if not PartialState().is_main_process:  # under torchrun every process has the summary: report it once
        return
    if args.json and args.json != "-":
        write_text_atomically(Path(args.json), jsonio.dumps(summary, indent=1) + "\n")
    print(jsonio.dumps(summary, indent=1) if args.json == "-" else pretrain_summary(summary, trainer.cfg))


def cmd_export(args) -> None:
    from mlmlab.evaluate.perplexity import evaluate_mlm
    from mlmlab.train.export import export_run

    out = export_run(Path(args.source), Path(args.out), evaluator=evaluate_mlm)
    print(f"model folder with its model card written to {out} ({out / 'README.md'})")


def cmd_evaluate(args) -> None:
    from mlmlab.evaluate.held_out import evaluate_model, format_eval_table
    from mlmlab.utils.files import lock_beside, require_output, write_text_atomically

    if args.json:
        require_output(Path(args.json), "--json", folder=False)
    # --json is this process's before it evaluates: a second evaluate into it is refused at once.
    json_lock = lock_beside(Path(args.json), f"--json {args.json}", "give --json another file") if args.json else None
    with json_lock or nullcontext():
        report = evaluate_model(
            args.model,
            args.data,
            batch_size=args.batch_size,
            max_batches=args.max_batches,
            max_seq_length=args.max_seq_length,
            columns=columns_of(args),
            freq_cuts=frequency_cuts(args.freq_buckets, "--freq-buckets"),
            recalibrate=args.recalibrate,
            show_progress=not args.no_progress,
        )
        if args.json:
            write_text_atomically(Path(args.json), jsonio.dumps(report, indent=1) + "\n")
    print(format_eval_table(report))
    print(jsonio.dumps(report))


def glue_settings_of(args) -> GlueSettings:
    """The glue command's options as run_glue takes them."""
    return GlueSettings(
        tasks="all" if args.task == ["all"] else args.task,
        seeds=tuple(args.seeds),
        learning_rates=args.lr,
        epochs=args.epochs,
        batch_size=args.batch_size,
        max_length=args.max_length,
        max_train_examples=args.max_train_examples,
        dropout=args.dropout,
    )


def cmd_glue(args) -> None:
    from mlmlab.evaluate.glue import format_glue_table, run_glue
    from mlmlab.utils.files import require_output

    require_output(Path(args.out), "--out", folder=True)
    results = run_glue(
        args.model,
        glue_settings_of(args),
        args.data_dir,
        args.out,
        init=args.init,
        write_test_predictions=args.test_predictions,
        show_progress=not args.no_progress,
    )
    print(format_glue_table(results))


def cmd_probe(args) -> None:
    from mlmlab.evaluate.linear_probe import format_probe_table, run_probes
    from mlmlab.utils.files import require_output

    if args.out:
        require_output(Path(args.out), "--out", folder=True)
    results = run_probes(
        args.model,
        args.task,
        args.data_dir,
        poolings=args.pooling,
        seed=args.seed,
        random_inits=args.random_inits,
        out_dir=args.out,
        show_progress=not args.no_progress,
    )
    print(jsonio.dumps(results, indent=1) if args.json else format_probe_table(results))


def cmd_study(args) -> None:
    from mlmlab.experiments.running.dry_run import dry_run_text
    from mlmlab.experiments.running.runner import parse_only, parse_shard, run_study
    from mlmlab.experiments.study import load_study

    if args.time_steps is not None and not args.dry_run:
        raise UserError(f"--time-steps {args.time_steps} times a dry run's steps; add --dry-run, or leave it out")
    study, shard = load_study(args.study, out_dir=args.out), parse_shard(args.shard)
    only = parse_only(args.only, study)
    if args.dry_run:
        print(dry_run_text(study, shard, timed_steps=args.time_steps, show_progress=not args.no_progress, only=only))
    else:
        run_study(study, shard, show_progress=not args.no_progress, only=only, time_limit=args.time_limit)


def cmd_config(args) -> None:
    # `mlmlab config train.lr=2e-3`: an override in the preset's place belongs to the overrides
    preset, overrides = (
        (None, [args.preset, *args.overrides]) if args.preset and "=" in args.preset else (args.preset, args.overrides)
    )
    from mlmlab.model.architectures import check_config

    cfg = load_config(preset, overrides)
    check_config(cfg)
    print(config_listing(cfg))


def cmd_report(args) -> None:
    from mlmlab.experiments.reporting.report import write_report
    from mlmlab.utils.files import require_output

    results = Path(args.results)
    out = Path(args.out) if args.out else results.parent / "report"
    require_output(out, "--out", folder=True)  # a file there: refused before the report is computed
    print(f"report written to {write_report(results, out, descriptive=args.mixed == 'descriptive')}")


CORPUS_HELP = (
    "text files (plain, WikiExtractor <doc>, JSONL; .gz ok), .parquet / .arrow files, folders of any of "
    "these (every file under them, sorted) or folders written by datasets' save_to_disk"
)


PROBE_DESCRIPTION = """\
Frozen linear probes: what a model's frozen features say about GLUE tasks, a downstream
measure that still ranks weak models. For each task the final hidden states are pooled
(mean over the real tokens, and/or the [CLS] state) once per split; a logistic regression
(ridge for STS-B) on standardised features has its C chosen on a fixed 20% of the training
rows, is refit on all of them and scored once on the dev set. The same runs on a random-init
model of the same config.json and vocabulary (weights from --seed; --random-inits N averages
N such models, as one draw's score varies by 1-2 points). SST-2 trains on a fixed
8,000-row sample. Scores are x100; gain = pretrained - random init in the task's score
(MRPC: the mean of F1 and accuracy; CoLA: Matthews correlation; SST-2: accuracy).

example:
  mlmlab probe --model runs/tiny/model --data-dir ../shared/data/glue --out runs/tiny/probe

In a study file: probe: {tasks: [SST-2, MRPC, CoLA], pooling: mean} (uses glue_dir) puts each
run's figures in its row under probe, e.g. probe.tasks.SST-2.gain and probe.average_gain.
"""


def add_column_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--text-column",
        default=Columns.text,
        help="JSONL and tables: the field holding the text (default: %(default)s)",
    )
    p.add_argument(
        "--id-column",
        default="",
        help="JSONL and tables: consecutive records with the same value in this "
        "field form one document (default: each record is a document)",
    )


def add_progress_option(p: argparse.ArgumentParser) -> None:
    """The one switch of every command that can take long: its bars and progress lines, on stderr."""
    p.add_argument("--no-progress", action="store_true", help="no progress bars or progress lines on stderr")


def add_number_option(p: argparse.ArgumentParser, option: str, kind: type, allowed, default, **options) -> None:
    """A numeric option, range-checked as a config key is; its default is also the value a refusal suggests."""
    p.add_argument(option, type=number(option, kind, allowed, default), default=default, **options)


def add_epoch_option(p: argparse.ArgumentParser) -> None:
    """Which epoch's masks mask and dump show: static masking's key cycles over masking.dupe_factor of them."""
    add_number_option(p, "--epoch", int, at_least(0), 0, help="the epoch whose masks to show (default: %(default)s)")


def add_progress_share_option(p: argparse.ArgumentParser, default: float, which: str) -> None:
    """The point of training whose step mask and dump show: ADM's a and a rate schedule's rate depend on it."""
    add_number_option(
        p,
        "--training-progress",
        float,
        PROBABILITY,
        default,
        metavar="SHARE",
        help=f"the share of training done, in [0, 1], at which the step masks (default: %(default)s, {which})",
    )


def add_masking_settings(p: argparse.ArgumentParser, which: str) -> None:
    """--config and dotted overrides, as pretrain takes them: the masks shown are a training step's under them."""
    p.add_argument(
        "--config",
        default=None,
        help=f"preset name ({', '.join(preset_names())}) or YAML file whose masking section masks (default: the "
        "defaults, = tiny)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help=f"section.key=value as pretrain takes them, e.g. masking.strategy=span masking.span_p=0.3; {which}",
    )


# The options mask and dump took for masking settings before they took --config and overrides: for one more
# release, each is read as its masking.* setting (checked as its field's range, named as the option) with a note
# naming that setting.
OLD_MASKING_FLAGS = {
    "--mask-seed": "seed",
    "--rate": "rate",
    "--strategy": "strategy",
    "--dupe-factor": "dupe_factor",
    "--whole-word": "whole_word",
    "--pmi-vocab-size": "pmi_vocab_size",
    "--scorer": "scorer",
    "--frequency-neutral": "frequency_neutral",
}
DUMP_OLD_FLAGS = ("--mask-seed", "--strategy", "--dupe-factor", "--whole-word", "--pmi-vocab-size")
MASK_OLD_FLAGS = tuple(OLD_MASKING_FLAGS)


def add_old_masking_flags(p: argparse.ArgumentParser, flags: tuple[str, ...]) -> None:
    """``flags`` (of OLD_MASKING_FLAGS), each read as its MaskingConfig field; hidden from --help."""
    for flag in flags:
        field = field_of(MaskingConfig, OLD_MASKING_FLAGS[flag])
        read = reading_of(flag, field)
        p.add_argument(flag, dest=f"old_{field.name}", default=argparse.SUPPRESS, help=argparse.SUPPRESS, **read)


def field_of(section: type, name: str) -> dataclasses.Field:
    return next(field for field in dataclasses.fields(section) if field.name == name)


def reading_of(option: str, field: dataclasses.Field) -> dict:
    """How argparse reads ``option``, which sets config ``field``: a switch for a bool, a number range-checked as
    the key is (a bad value named as the option), else text for the config to check."""
    if field.type is bool:
        return {"action": "store_const", "const": True}
    if "range" in field.metadata:
        return {"type": number(option, field.type, *field.metadata["range"])}
    return {}


def add_field_option(p: argparse.ArgumentParser, option: str, section: type, name: str, **options) -> None:
    """An option that sets config field ``section.name``, generated from it: its reading, range and default."""
    field = field_of(section, name)
    p.add_argument(option, default=field.default, **reading_of(option, field), **options)


def add_tokenizer_parser(sub) -> None:
    p = sub.add_parser("tokenizer", help="train a WordPiece, byte-level BPE or Unigram tokenizer, or adopt a vocab.txt")
    p.add_argument("--corpus", nargs="+", help=CORPUS_HELP)
    add_column_options(p)
    p.add_argument(
        "--kind",
        choices=choices.TOKENIZER_KINDS,
        default=None,
        help="wordpiece (BERT's, the default), bpe (RoBERTa's byte-level BPE) or unigram (SentencePiece's)",
    )
    p.add_argument("--vocab", help="adopt this vocab.txt instead of training (takes no --corpus, --kind, --vocab-size)")
    p.add_argument(
        "--vocab-size",
        type=number("--vocab-size", int, at_least(1), TOKENIZER_VOCAB_SIZE),
        default=None,
        help=f"tokens of the trained vocabulary (default: {TOKENIZER_VOCAB_SIZE}, BERT's)",
    )
    p.add_argument("--cased", action="store_true", help="wordpiece: keep case (default: lowercase, as BERT uncased)")
    p.add_argument("--lowercase", action="store_true", help="bpe, unigram: lowercase (default: cased, as RoBERTa)")
    p.add_argument("--out", required=True)
    add_progress_option(p)
    p.set_defaults(func=cmd_tokenizer)


def add_prepare_parser(sub) -> None:
    p = sub.add_parser("prepare", help="turn raw text into NSP instances / packed blocks (memory-mapped shards)")
    p.add_argument("--corpus", nargs="+", required=True, help=CORPUS_HELP)
    add_column_options(p)
    p.add_argument("--tokenizer", required=True, help="a tokenizer folder (see `mlmlab tokenizer`)")
    add_field_option(p, "--max-seq-length", DataConfig, "max_seq_length")
    p.add_argument("--objective", choices=choices.OBJECTIVES, default=DataConfig.objective)
    add_field_option(p, "--short-seq-prob", DataConfig, "short_seq_prob")
    add_field_option(p, "--seed", DataConfig, "prepare_seed", help="the NSP pairing draws (data.prepare_seed)")
    p.add_argument(
        "--workers",
        type=number("--workers", int, at_least(0), 2),
        default=None,
        help="worker processes (default: every core this process may use); the data do not depend on it",
    )
    p.add_argument("--out", default=None, help="dataset folder (default: the cache, named by a hash of inputs)")
    add_progress_option(p)
    p.set_defaults(func=cmd_prepare)


def add_dump_parser(sub) -> None:
    p = sub.add_parser(
        "dump",
        help="print prepared instances as JSON lines (optionally masked as a training step masks them)",
        epilog="e.g. mlmlab dump --data DIR --masked masking.strategy=span masking.span_p=0.3",
    )
    p.add_argument("--data", required=True)
    add_number_option(p, "-n", int, at_least(1), 5)
    add_number_option(p, "--start", int, at_least(0), 0)
    p.add_argument("--masked", action="store_true", help="add masked input_ids and labels as training makes them")
    add_epoch_option(p)
    add_progress_share_option(p, 0.0, "the start")
    p.add_argument(
        "--ngrams",
        type=int,
        default=0,
        metavar="N",
        help="print the N best n-grams of the dataset's PMI vocabulary instead (built beside it the first time), "
        "under the masking.pmi_* settings",
    )
    add_masking_settings(p, "one whose strategy needs no scorer (adaptive's are shown on a sentence by mlmlab mask)")
    add_old_masking_flags(p, DUMP_OLD_FLAGS)
    p.set_defaults(func=cmd_dump)


def add_mask_parser(sub) -> None:
    p = sub.add_parser(
        "mask",
        help="show how one sentence is masked",
        epilog='e.g. mlmlab mask "The prime minister flew to New York." masking.strategy=span masking.span_p=0.3',
    )
    p.add_argument("text")
    p.add_argument("--tokenizer", default="", help="tokenizer folder or vocab.txt (default: bundled uncased vocab)")
    add_epoch_option(p)
    p.add_argument("--model", help="model folder: its tokenizer, and for adaptive its uncertainty scores")
    p.add_argument(
        "--data",
        help="prepared dataset: its tokenizer, the corpus counts that the frequency scorer "
        "and masking.frequency_neutral read, and the n-grams that masking.strategy=pmi masks",
    )
    add_progress_share_option(p, 1.0, "the end")
    add_masking_settings(p, "scorers: entropy, max_prob and grad_norm need --model; frequency needs --data")
    add_old_masking_flags(p, MASK_OLD_FLAGS)
    p.set_defaults(func=cmd_mask)


def add_pretrain_parser(sub) -> None:
    p = sub.add_parser("pretrain", help="pretrain a BERT (MLM + NSP) or ModernBERT (MLM) encoder")
    p.add_argument(
        "--config",
        default="tiny",
        help=f"preset name ({', '.join(preset_names())}) or YAML file (default: %(default)s)",
    )
    p.add_argument("--resume", default=None, help="'auto' (newest intact checkpoint of the run) or a checkpoint folder")
    p.add_argument(
        "--init",
        default=None,
        metavar="MODEL_DIR",
        help=f"start from this model's weights only (train.init): a HuggingFace model folder "
        f"({choices.listed(choices.ARCHITECTURES)}) or a run's model/; its architecture, model settings and "
        "tokenizer are the run's: a model.* key or data.tokenizer named beside it must agree with the folder's",
    )
    p.add_argument(
        "--processes",
        type=number("--processes", int, at_least(1), 2),
        default=1,
        metavar="N",
        help="train as N DDP processes on this host (torchrun; gloo on CPU), train.batch_size split over "
        "them and the cores shared out as threads: the same run (docs/scale-out.md)",
    )
    add_progress_option(p)
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="the run's summary as JSON: to FILE, or alone on stdout with no FILE (instead of the text summary)",
    )
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.max_steps=100")
    p.set_defaults(func=cmd_pretrain)


def add_export_parser(sub) -> None:
    p = sub.add_parser(
        "export", help="a checkpoint's model folder with its model card (what pretrain leaves in model/)"
    )
    p.add_argument("source", help="a run folder (its newest intact checkpoint) or a checkpoint folder (ckpt-*)")
    p.add_argument("--out", required=True, help="a new folder for the model")
    p.set_defaults(func=cmd_export)


def add_evaluate_parser(sub) -> None:
    p = sub.add_parser("evaluate", help="held-out MLM perplexity (fixed uniform masks) and NSP accuracy")
    p.add_argument("--model", required=True, help="a model folder written by mlmlab")
    p.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="a prepared dataset folder, or a corpus to prepare (as prepare's --corpus; WikiText wiki.*.tokens too)",
    )
    add_column_options(p)
    p.add_argument(
        "--max-seq-length",
        type=number("--max-seq-length", int, at_least(8), 128),
        default=None,
        help="when preparing text files (default: the model's run's)",
    )
    p.add_argument(
        "--batch-size",
        type=number("--batch-size", int, at_least(1), 32),
        default=None,
        help="(default: the model's run's train.eval_batch_size)",
    )
    p.add_argument(
        "--max-batches",
        type=number("--max-batches", int, at_least(1), 20),
        default=None,
        help="(default: every whole batch of the data)",
    )
    p.add_argument(
        "--freq-buckets",
        default=MaskingConfig.freq_buckets,
        help="frequency-rank cut-offs of the per-bucket perplexities (default: %(default)s)",
    )
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="also the prior-free loss: the output bias refitted on half the targets, the other half scored",
    )
    p.add_argument("--json", help="also write the report to this file")
    add_progress_option(p)
    p.set_defaults(func=cmd_evaluate)


def add_glue_parser(sub) -> None:
    glue = GlueSettings()  # the defaults, shared with a study's glue block
    p = sub.add_parser("glue", help="fine-tune on GLUE tasks and report the standard metrics")
    p.add_argument("--model", required=True, help="a model folder written by mlmlab")
    p.add_argument(
        "--task", nargs="+", default=["all"], help="task names (CoLA SST-2 MRPC STS-B QQP MNLI QNLI RTE WNLI) or all"
    )
    p.add_argument("--data-dir", required=True, help="GLUE folder with one subfolder per task")
    p.add_argument("--out", default="glue_results", help="folder for glue_results.json / .md")
    p.add_argument(
        "--seeds",
        type=number("--seeds", int, SEEDS, 0),
        nargs="+",
        default=list(glue.seeds),
        help="fine-tuning seeds; the median over them is reported (default: %(default)s)",
    )
    p.add_argument(
        "--lr",
        type=number("--lr", float, POSITIVE, 2e-5),
        nargs="+",
        default=glue.learning_rates,
        help="learning-rate grid (default: per task)",
    )
    p.add_argument(
        "--epochs", type=number("--epochs", int, at_least(1), 3), default=glue.epochs, help="(default: per task)"
    )
    p.add_argument(
        "--batch-size",
        type=number("--batch-size", int, at_least(1), 32),
        default=glue.batch_size,
        help="(default: per task)",
    )
    p.add_argument(
        "--max-length",
        type=number("--max-length", int, at_least(1), 128),
        default=glue.max_length,
        help="longer inputs are truncated (default: per task)",
    )
    p.add_argument(
        "--dropout",
        type=number("--dropout", float, BELOW_ONE, FineTuneSettings.dropout),
        default=glue.dropout,
        help=f"hidden and attention dropout while fine-tuning (default {FineTuneSettings.dropout:g}, BERT's, whatever "
        "the pretraining's)",
    )
    p.add_argument(
        "--max-train-examples",
        type=number("--max-train-examples", int, at_least(1), 2000),
        default=glue.max_train_examples,
        help="a fixed random sample of N training rows (the same for every seed and model)",
    )
    p.add_argument(
        "--init",
        choices=["pretrained", "random"],
        default="pretrained",
        help="random: the same architecture from fresh weights, the no-pretraining baseline",
    )
    p.add_argument("--test-predictions", action="store_true", help="also write GLUE submission files")
    add_progress_option(p)
    p.set_defaults(func=cmd_glue)


def add_probe_parser(sub) -> None:
    p = sub.add_parser(
        "probe",
        help="frozen linear probes on GLUE tasks, each beside a random-init baseline",
        description=PROBE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="a model folder written by mlmlab (config.json, weights, tokenizer)")
    p.add_argument(
        "--task",
        nargs="+",
        default=None,
        help="GLUE task names, each with train.tsv and dev.tsv (default: SST-2 MRPC CoLA)",
    )
    p.add_argument("--data-dir", required=True, help="GLUE folder with one subfolder per task")
    p.add_argument("--out", default=None, help="also write probe_results.json / .md to this folder")
    p.add_argument(
        "--pooling",
        nargs="+",
        choices=choices.POOLINGS,
        default=list(choices.POOLINGS),
        help="features: mean over the real tokens and/or the [CLS] state (default: both, one forward pass)",
    )
    add_number_option(
        p, "--seed", int, SEEDS, 0, help="the random-init baseline's weights and the training rows held out to choose C"
    )
    p.add_argument(
        "--random-inits",
        type=number("--random-inits", int, at_least(1), 3),
        default=1,
        metavar="N",
        help="average the random-init baseline over N draws (seeds SEED .. SEED+N-1): one draw's probe "
        "varies by 1-2 points; use it to compare gains across architectures",
    )
    add_progress_option(p)
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    p.set_defaults(func=cmd_probe)


def add_study_parser(sub) -> None:
    # "experiment": its name before 2026-12-02, in the commands of reports written then
    p = sub.add_parser(
        "study",
        aliases=["experiment"],
        help="run a study: pretraining runs over arms x seeds, each evaluated, one row each in results.jsonl",
    )
    p.add_argument("study", help="study preset name (mlmlab/configs/studies/) or a study YAML file")
    p.add_argument(
        "--shard",
        default=None,
        help="i/n: every n-th run from the i-th (i from 0) of the study's order, the gate arm's runs first, "
        "to split a study over machines",
    )
    p.add_argument(
        "--only",
        nargs="+",
        metavar="ARM[/seedN]",
        help="only these runs: an arm's every seed, or one seed of it (adm-entropy/seed1); e.g. to run a "
        "long arm's runs side by side",
    )
    p.add_argument(
        "--time-limit",
        type=number("--time-limit", float, NON_NEGATIVE, 60),
        default=0.0,
        metavar="MINUTES",
        help="start only the runs that will finish within MINUTES from now, by their arm's finished runs "
        "(else their FLOPs at the study's finished runs' pace; a job's walltime)",
    )
    p.add_argument("--out", default=None, help="study folder (default: the study's out_dir, else studies/<name>)")
    p.add_argument(
        "--dry-run", action="store_true", help="validate every arm's config and print the estimated cost; train nothing"
    )
    p.add_argument(
        "--time-steps",
        type=number("--time-steps", int, at_least(1), 20),
        default=None,
        metavar="STEPS",
        help="with --dry-run: also time STEPS training steps of each arm here and extrapolate each run's time",
    )
    add_progress_option(p)
    p.set_defaults(func=cmd_study)


def add_config_parser(sub) -> None:
    p = sub.add_parser(
        "config",
        help="print a resolved config: every key with its value, its default where it differs, and what it is for",
    )
    p.add_argument(
        "preset",
        nargs="?",
        default=None,
        help=f"preset name ({', '.join(preset_names())}) or YAML file (default: the defaults, = tiny)",
    )
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.lr=2e-3")
    p.set_defaults(func=cmd_config)


def add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="report.md and PNG plots from a study's results.jsonl")
    p.add_argument("results", help="a results.jsonl (shards' files may be concatenated)")
    p.add_argument(
        "--out", default=None, help="folder for report.md and plots (default: report/ next to results.jsonl)"
    )
    p.add_argument(
        "--mixed",
        choices=["descriptive"],
        default=None,
        help="rows of more than one study (or pre-registration, or decision rule) are refused; descriptive: compare "
        "them anyway, applying no gate and no rule (the report says so at its top)",
    )
    p.set_defaults(func=cmd_report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlmlab", description="Pretrain BERT-style encoders and compare masking strategies."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in (
        add_tokenizer_parser,
        add_prepare_parser,
        add_dump_parser,
        add_mask_parser,
        add_pretrain_parser,
        add_export_parser,
        add_evaluate_parser,
        add_glue_parser,
        add_probe_parser,
        add_study_parser,
        add_config_parser,
        add_report_parser,
    ):
        add_command(sub)
    return parser


def parse_arguments(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """parse_args, but overrides may follow options too (`pretrain a=1 --no-progress b=2`).

    argparse fills a "*" positional from one run of arguments only, and its
    parse_intermixed_args does not support subcommands: overrides left over are appended.
    """
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "overrides") or any(item.startswith("-") for item in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv=None) -> int:
    if argv is None:  # a command line, not a call from Python (tests, notebooks)
        reexec_with_malloc_tuning([sys.executable, "-m", "mlmlab.cli", *sys.argv[1:]])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we fork DataLoader workers
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # "Loading weights" bars would bury our output
    try:
        args = parse_arguments(build_parser(), argv)  # a number option out of range is a UserError (config.py)
        args.argv = sys.argv[1:] if argv is None else list(argv)  # as given: `pretrain --processes` relaunches it
        with sigterm_unwinds():
            args.func(args)
            sys.stdout.flush()  # here, where a closed pipe is caught below, not at exit
    except BrokenPipeError:  # stdout's reader left (`mlmlab dump ... | head`): it has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit has somewhere to go
        return 0
    except UserError as err:
        print(f"mlmlab: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a full disk, a read-only file (as any writer reports it): the user's to fix
        if (line := write_refusal(err)) is None:  # anything else is a bug: its traceback
            raise
        print(f"mlmlab: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM outside training (which saves first: train/loop.py)
        signum = getattr(stop, "signum", signal.SIGINT)
        print(f"mlmlab: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return exit_code(signum)
    return 0


if __name__ == "__main__":
    sys.exit(main())
