"""The exported model folder with its model card (README.md): what a colleague needs to pick the model up.

The card is made from what the checkpoint and the run record: the model's config.json, the
checkpoint's progress (trainer_state.json: steps, tokens, seconds), the run's config, the prepared
data's meta.json (files, documents, token counts) and the held-out evaluation. The end of
``pretrain`` and ``mlmlab export`` both write the folder through ``export_model_folder``, so
the two give the same folder for the same checkpoint.
"""

import json
import math
import shlex
import shutil
from pathlib import Path

from mlmlab import choices
from mlmlab.config import Config, flat_keys, to_dict
from mlmlab.data.tokenizer import folder_vocab_size
from mlmlab.errors import writes_of
from mlmlab.masking.evaluation import EVAL_RATE
from mlmlab.masking.strategies import strategy_entry
from mlmlab.model.architectures import saved_architecture
from mlmlab.model.folder import VOCAB_HASH_KEY, read_config, saved_weight_shapes
from mlmlab.train.run_folder import MODEL_DIR, read_progress
from mlmlab.utils import jsonio
from mlmlab.utils.files import building, write_text_atomically

CARD = "README.md"


def export_model_folder(
    checkpoint_dir: Path,
    out: Path,
    cfg: Config,
    evaluation: dict | None,
    data: dict[str, dict | None],
    *,
    replace: bool = False,
    ngrams: list | None = None,
) -> Path:
    """The checkpoint's model/ copied to ``out``, with the model card: staged beside ``out`` and renamed when
    whole, so a full disk leaves ``out`` as it was (``replace``: an existing ``out`` is replaced, else it must be
    new or empty).

    ``data``: {"train": meta, "valid": meta} of the prepared datasets (None where unknown); ``ngrams``: the n-gram
    vocabulary a strategy that reads one masked (None where unknown or none).
    """
    kept = f"{out} is left as it was and the checkpoint {checkpoint_dir} is intact"
    with writes_of(f"the model folder {out}", kept), building(out, replace=replace) as staging:
        shutil.copytree(checkpoint_dir / MODEL_DIR, staging, dirs_exist_ok=True)
        state = read_progress(checkpoint_dir)
        card = card_text(staging, cfg, state, jsonio.finite_or_none(evaluation or {}), data, ngrams)
        (staging / CARD).write_text(card, encoding="utf-8")
    return out


def card_text(folder: Path, cfg: Config, state: dict, evaluation: dict, data: dict, ngrams: list | None = None) -> str:
    model = read_config(folder)
    parameters = sum(math.prod(shape) for shape in saved_weight_shapes(folder).values())
    sections = [
        _header(model, cfg, parameters),
        _usage(model, _tokenizer_settings(folder)),
        _architecture(model, parameters),
        _tokenizer(folder, model),
        _data(cfg, data),
        _masking(cfg, ngrams),
        _training(cfg, state),
        _evaluation(cfg, evaluation),
        _provenance(cfg),
    ]
    return "\n\n".join(sections) + "\n"


def _header(model: dict, cfg: Config, parameters: int) -> str:
    objective = (
        "masked language modelling and next sentence prediction"
        if cfg.data.objective == choices.NSP
        else "masked language modelling"
    )
    architecture = saved_architecture(model)
    return (
        "---\nlibrary_name: transformers\npipeline_tag: fill-mask\n"
        f"tags: [{architecture.name}, fill-mask, mlmlab]\n---\n\n"
        f"# {architecture.label} L{model['num_hidden_layers']}/H{model['hidden_size']}, pretrained with mlmlab\n\n"
        f"A {architecture.label} encoder of {parameters / 1e6:.1f}M parameters, pretrained by {objective} "
        f"({'from the weights of ' + cfg.train.init if cfg.train.init else 'from random initialisation'})."
    )


def _tokenizer_settings(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _usage(model: dict, tokenizer_settings: dict) -> str:
    mask = tokenizer_settings.get("mask_token") or "[MASK]"  # the tokenizer's own: [MASK] or <mask>
    mask = mask.get("content", "[MASK]") if isinstance(mask, dict) else mask
    # No path in the card: the folder may be copied anywhere, and export and pretrain write the same card.
    return (
        "## Use it\n\n```python\nfrom transformers import pipeline\n\n"
        'fill = pipeline("fill-mask", model="path/to/this/folder")\n'
        f'print(fill("The capital of France is {mask}."))\n```\n\n'
        f"`AutoModelForMaskedLM`, {saved_architecture(model).loaded_by} and "
        "`AutoModelForSequenceClassification` (to fine-tune; `mlmlab glue` does) load this folder."
    )


def _architecture(model: dict, parameters: int) -> str:
    return (
        "## Architecture\n\n| layers | hidden size | heads | feed-forward | positions | embedding rows | parameters |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| {model['num_hidden_layers']} | {model['hidden_size']} | {model['num_attention_heads']} | "
        f"{model['intermediate_size']} | {model['max_position_embeddings']} | {model['vocab_size']:,} | "
        f"{parameters:,} |\n\n{saved_architecture(model).described(model)}"
    )


_KINDS = {"WordPiece": "WordPiece", "BPE": "Byte-level BPE", "Unigram": "Unigram (SentencePiece-style)"}


def _tokenizer(folder: Path, model: dict) -> str:
    settings = _tokenizer_settings(folder)
    case = {True: "lowercased", False: "cased"}.get(settings.get("do_lower_case"), "case handling as its files say")
    kind = (
        _KINDS.get(json.loads((folder / "tokenizer.json").read_text())["model"].get("type"), "A")
        if (folder / "tokenizer.json").is_file()
        else "WordPiece"
    )
    return (
        f"## Tokenizer\n\n{kind}, {folder_vocab_size(folder):,} tokens, {case}; "
        f"vocabulary hash `{model.get(VOCAB_HASH_KEY, '?')}` "
        "(mlmlab's identity of the (id, token) pairs: data, evaluation and fine-tuning check it)."
    )


def _data(cfg: Config, data: dict) -> str:
    rows = [
        _data_row(name, cfg.data.corpus if name == "training" else cfg.data.valid_corpus, meta)
        for name, meta in (("training", data.get("train")), ("held-out", data.get("valid")))
    ]
    return (
        "## Data\n\n| | files | documents | corpus tokens | instances | tokens in instances |\n"
        "|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + f"\n\nInstances of up to {cfg.data.max_seq_length} tokens"
        + (f", read from the {cfg.data.text_column!r} field" if cfg.data.text_column != "text" else "")
        + (
            f", held-out ones from the {cfg.data.valid_text_column!r} field"
            if cfg.data.valid_text_column not in ("", cfg.data.text_column)
            else ""
        )
        + (f", documents grouped by {cfg.data.id_column!r}" if cfg.data.id_column else "")
        + "."
        + _never_drawn(cfg.data.corpus, data.get("train"))
    )


def _never_drawn(corpus, meta: dict | None) -> str:
    """A mixture's sources whose weight gave them no draw (meta's mixture, in data.corpus's order): named in
    data.corpus, but not trained on, nor counted in the training row."""
    sources = (meta or {}).get("mixture") or []
    never = [source for source, drawn in zip(corpus, sources) if drawn.get("draws") == 0]
    if not never:
        return ""
    return (
        f" Not trained on, though data.corpus names {'them' if len(never) > 1 else 'it'}: "
        + ", ".join(f"`{source}`" for source in never)
        + " (a weight whose share of an epoch rounds to no draw)."
    )


def _data_row(name: str, setting: list[str], meta: dict | None) -> str:
    files = meta["corpus"] if meta else (list(setting) or ["the sample bundled with mlmlab"])  # a mixture: its sources
    shown = ", ".join(f"`{Path(f).name}`" for f in files[:3]) + (
        f" and {len(files) - 3} more" if len(files) > 3 else ""
    )
    if not meta:
        return f"| {name} | {shown} | ? | ? | ? | ? (the prepared data was not at hand at export) |"
    return (
        f"| {name} | {shown} | {meta['num_documents']:,} | {meta.get('num_corpus_tokens', 0):,} | "
        f"{meta['num_instances']:,} | {meta['num_instance_tokens']:,} |"
    )


def _masking(cfg: Config, ngrams: list | None) -> str:
    m, objective = cfg.masking, cfg.data.objective
    kept = 1 - m.mask_prob - m.random_prob
    pairs = (
        "MLM + NSP on sentence pairs, half of them random"
        if objective == choices.NSP
        else "MLM only, packed full sentences"
    )
    lines = [
        f"- objective: `{objective}` ({pairs})",
        f"- masking strategy: `{m.strategy}`; {m.rate:.0%} of the eligible tokens selected per sequence "
        f"({m.mask_prob:.0%} [MASK], {m.random_prob:.0%} random token, {kept:.0%} unchanged)"
        + (", whole words" if m.whole_word else ""),
        f"- mask rate schedule: `{m.rate_schedule}`"
        + (f" from {m.rate_start:.0%}" if m.rate_schedule == choices.LINEAR_DECAY else ""),
        *strategy_entry(m.strategy).card_lines(m),
        *([_ngrams_line(m, ngrams)] if strategy_entry(m.strategy).ngrams else []),
    ]
    return "## Objective and masking\n\n" + "\n".join(lines)


def _ngrams_line(m, ngrams: list | None) -> str:
    """What the n-gram vocabulary really held: none at all makes every unit a single word."""
    if ngrams is None:
        return "- n-grams masked as units: not known (the prepared training data was not at hand)"
    if not ngrams:
        return (
            f"- n-grams masked as units: none (no n-gram was seen {m.pmi_min_count} times or more), so every unit "
            "was a single word: whole-word masking"
        )
    return f"- n-grams masked as units: {len(ngrams):,} found in the training corpus"


def _training(cfg: Config, state: dict) -> str:
    t = cfg.train
    minutes = state.get("seconds", 0.0) / 60
    optimizer = "StableAdamW (update clipping per tensor)" if t.optimizer == choices.STABLE_ADAMW else "AdamW"
    clipping = f"gradients clipped to global norm {t.max_grad_norm:g}" if t.max_grad_norm else "no gradient clipping"
    return (
        "## Training\n\n"
        f"- {state['step']:,} steps, {state.get('tokens', 0):,} tokens seen (non-padding), "
        f"{minutes:.1f} min of training\n"
        f"- batch {t.batch_size} x {t.grad_accum} accumulation per process{_batch_warmup(t)}; "
        f"{optimizer}, peak LR {t.lr:g}, "
        f"{t.warmup_steps} warmup steps, `{t.lr_schedule}` decay over the last {t.decay_fraction:.0%} of the budget; "
        f"weight decay {t.weight_decay}, {clipping}, seed {t.seed}\n"
        f"- started from: {('`' + t.init + '` (weights only)') if t.init else 'random initialisation'}"
    )


def _batch_warmup(t) -> str:
    if not t.batch_warmup_steps:
        return ""
    return (
        f" (batch warmup: {t.batch_warmup_start} micro-batch(es) a step growing to {t.grad_accum} "
        f"over {t.batch_warmup_steps:,} steps)"
    )


def _evaluation(cfg: Config, evaluation: dict) -> str:
    if not evaluation:
        return (
            "## Held-out evaluation\n\nNot measured at this step; `mlmlab evaluate --model THIS_FOLDER --data FILES` "
            "measures it."
        )
    nsp = evaluation.get("nsp_accuracy")
    figures = [
        ("perplexity", f"{evaluation['perplexity']:.2f}"),
        ("MLM accuracy", f"{evaluation['mlm_accuracy']:.4f}"),
        ("NSP accuracy", f"{nsp:.4f}" if nsp is not None else "–"),
        ("masked tokens", f"{evaluation['masked_tokens']:,}"),
    ]
    return (
        "## Held-out evaluation\n\n| "
        + " | ".join(name for name, _ in figures)
        + " |\n|"
        + "---|" * len(figures)
        + "\n| "
        + " | ".join(value for _, value in figures)
        + " |\n\n"
        f"Uniform {EVAL_RATE:.0%} masks from a fixed seed whatever the training strategy (so strategies compare), "
        f"{cfg.train.eval_batches} batches of {cfg.train.eval_batch_size} held-out instances."
    )


def _provenance(cfg: Config) -> str:
    return (
        "## How it was made\n\n```bash\n" + command_for(cfg) + "\n```\n\n"
        "The run's `config.yaml` holds the whole resolved config; this command gives it with the defaults of "
        "the mlmlab version that trained the model."
    )


def command_for(cfg: Config) -> str:
    """``mlmlab pretrain`` with every setting that differs from the defaults: the command that gives this config."""
    ours, defaults = flat_keys(to_dict(cfg)), flat_keys(to_dict(Config()))
    words = ["mlmlab", "pretrain"]
    if cfg.train.init:
        words += ["--init", cfg.train.init]
    words += [f"{key}={_value(value)}" for key, value in ours.items() if value != defaults[key] and key != "train.init"]
    return shlex.join(words)


def _value(value) -> str:
    """A config value as an override spells it (YAML)."""
    if isinstance(value, list):
        return value[0] if len(value) == 1 else "[" + ",".join(value) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def write_finished_run(
    run_dir: Path, saved: Path, cfg: Config, summary: dict, train_store, valid_store, ngrams: list | None
) -> None:
    """The final model folder (the last checkpoint's, ``saved``, copied with its model card, which describes how
    the two token stores were prepared and the n-gram vocabulary that was masked) and summary.json."""
    data = {"train": train_store.meta, "valid": valid_store.meta}
    export_model_folder(saved, run_dir / MODEL_DIR, cfg, summary["eval"], data, replace=True, ngrams=ngrams)
    kept = f"its last checkpoint {saved.name} and model/ are intact"
    with writes_of(f"{run_dir / 'summary.json'}", kept, "rerun the command to write it"):
        write_text_atomically(run_dir / "summary.json", jsonio.dumps(summary, indent=1))
