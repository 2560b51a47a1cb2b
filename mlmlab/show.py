"""What people read: prepared instances and masked sentences as the model sees them, and the end of a run."""

import shlex

import torch

from mlmlab import choices
from mlmlab.config import Config, MaskingConfig
from mlmlab.data.loader import collate
from mlmlab.data.resolve import tokenizer_dir_for
from mlmlab.data.store import TokenStore
from mlmlab.data.tokenizer import load_tokenizer
from mlmlab.errors import UserError
from mlmlab.masking.select import Corruption, token_info_for
from mlmlab.masking.strategies import UniformStrategy, build_strategy, mask_batch
from mlmlab.model import IGNORE_INDEX
from mlmlab.model_folder import load_pretrained

INSTANCE_KEYS = ("next_sentence_label", "doc_a", "doc_b")


def dump_instances(data_dir, n: int, *, start: int = 0, masked: bool = False, seed: int = 0, epoch: int = 0,
                   strategy: str = choices.DYNAMIC, dupe_factor: int = 10):
    """Yield instances start..start+n-1 as dicts; with ``masked``, as the training step masks them."""
    store = TokenStore(data_dir)
    if not 0 <= start < len(store):
        raise UserError(f"--start {start} is past the end: {data_dir} holds {len(store)} instances "
                        f"(0 to {len(store) - 1})")
    tokenizer = load_tokenizer(store.tokenizer_dir)
    info = token_info_for(tokenizer)
    epoch_key = UniformStrategy(MaskingConfig(strategy=strategy, dupe_factor=dupe_factor)).epoch_key(epoch)
    for index in range(start, min(start + n, len(store))):
        example = store[index]
        record = {"index": index, "tokens": tokenizer.convert_ids_to_tokens(example["input_ids"].tolist()),
                  "input_ids": example["input_ids"].tolist(), "token_type_ids": example["token_type_ids"].tolist(),
                  **{key: int(example[key]) for key in INSTANCE_KEYS}}
        if masked:
            batch = mask_batch(collate([example], [index], tokenizer.pad_token_id), seed=seed, epoch_key=epoch_key,
                               rate=MaskingConfig.rate, info=info, corruption=Corruption())
            record["masked_input_ids"] = batch["input_ids"][0].tolist()
            record["masked_tokens"] = tokenizer.convert_ids_to_tokens(record["masked_input_ids"])
            record["labels"] = batch["labels"][0].tolist()
        yield record


def mask_sentence(text: str, *, tokenizer: str = "", seed: int = 0, epoch: int = 0, rate: float = 0.15,
                  strategy: str = choices.DYNAMIC, model: str | None = None, scorer: str = choices.ENTROPY,
                  progress: float = 1.0) -> str:
    """A table: each token, its masking weight, whether it was selected, what the model sees, the label.

    ``strategy="adaptive"`` scores the sentence with the model in ``model`` (entropy,
    max_prob or grad_norm: the loss-table scorers need a training run's state) and shows
    the ADM weights at training progress ``progress``.
    """
    cfg = Config(masking=MaskingConfig(strategy=strategy, rate=rate, scorer=scorer)).masking  # validated
    tok, pretrained = _tokenizer_and_model(tokenizer, model, strategy, scorer)
    info = token_info_for(tok)
    ids = torch.tensor([tok(text)["input_ids"]])  # (1, T)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids),
             "example_ids": torch.zeros(1, dtype=torch.long)}
    weights = None
    if strategy == choices.ADAPTIVE:
        weights = build_strategy(cfg, info=info, vocab_size=len(tok)).weights(pretrained, batch, progress)  # (1, T)
    masked = mask_batch(batch, seed=seed, epoch_key=epoch, rate=rate, info=info, corruption=Corruption(), weights=weights)
    return _mask_table(tok, ids[0], masked, weights, f"{strategy} masking, rate {rate}, seed {seed}, epoch {epoch}")


def _tokenizer_and_model(tokenizer: str, model: str | None, strategy: str, scorer: str):
    if strategy != choices.ADAPTIVE:
        return load_tokenizer(tokenizer_dir_for(model or tokenizer)), None
    if model is None or scorer not in choices.MODEL_SCORERS:
        raise UserError("--strategy adaptive needs --model DIR and a model scorer "
                        f"(--scorer {choices.listed(choices.MODEL_SCORERS)})")
    pretrained, tok = load_pretrained(model)
    return tok, pretrained


def _mask_table(tok, ids, masked, weights, title: str) -> str:
    shown, labels = masked["input_ids"][0].tolist(), masked["labels"][0].tolist()
    rows = [title, f"{'pos':>3}  {'token':<16} {'weight':>7}  {'model sees':<16} {'what':<10} label"]
    for pos, (orig, seen, label) in enumerate(zip(ids.tolist(), shown, labels)):
        selected = label != IGNORE_INDEX
        what = "" if not selected else "[MASK]" if seen == tok.mask_token_id else "unchanged" if seen == orig else "random"
        token, seen_token = tok.convert_ids_to_tokens([orig, seen])
        weight = "" if weights is None else f"{weights[0, pos].item():.3f}"
        rows.append(f"{pos:>3}  {token:<16} {weight:>7}  {seen_token if selected else '':<16} {what:<10} "
                    f"{token if selected else '-100'}")
    eligible = int((~torch.isin(ids, torch.tensor(token_info_for(tok).special_ids))).sum())
    rows.append(f"{sum(label != IGNORE_INDEX for label in labels)} of {eligible} eligible positions selected")
    return "\n".join(rows)


def pretrain_summary(summary: dict, cfg: Config) -> str:
    """What ``pretrain`` prints at the end: where the model is, what it cost, how good it is, what to try next."""
    from mlmlab.data.resolve import SAMPLE_VALID

    model = f"{summary['run_dir']}/model"
    held_out = summary.get("eval") or {}
    lines = [f"pretrained {summary['steps']:,} steps, {summary['tokens_seen']:,} tokens, "
             f"{_duration(summary['train_seconds'])} of training ({summary.get('tokens_per_s', 0):,.0f} tokens/s{_mfu(summary)})",
             f"model: {model} (model card: {model}/README.md; run folder: {summary['run_dir']})"]
    if held_out:
        nsp = held_out.get("nsp_accuracy")
        lines.append(f"held-out: perplexity {held_out['perplexity']:,.2f}, MLM accuracy {held_out['mlm_accuracy']:.4f}"
                     + (f", NSP accuracy {nsp:.4f}" if nsp is not None else "")
                     + f" ({held_out['masked_tokens']:,} masked tokens, fixed masks)")
    valid = " ".join(shlex.quote(p) for p in cfg.data.valid_corpus) or shlex.quote(str(SAMPLE_VALID))
    fill = (f"\"from transformers import pipeline; print(pipeline('fill-mask', model={model!r})"
            f"('The capital of France is {_mask_token(model)}.'))\"")  # double quotes outside: pastes into any shell
    lines += ["next:",
              f"  mlmlab evaluate --model {shlex.quote(model)} --data {valid}",
              f"  mlmlab glue --model {shlex.quote(model)} --task RTE MRPC --data-dir GLUE_DIR",
              f"  python -c {fill}",
              "(--json: this summary as JSON)"]
    return "\n".join(lines)


def _mask_token(model: str) -> str:
    """The model folder's own mask token ([MASK], <mask>), as its tokenizer_config.json names it."""
    import json
    from pathlib import Path

    path = Path(model) / "tokenizer_config.json"
    mask = json.loads(path.read_text(encoding="utf-8")).get("mask_token") if path.is_file() else None
    return (mask.get("content") if isinstance(mask, dict) else mask) or "[MASK]"


def _mfu(summary: dict) -> str:
    """", MFU 31% of a measured 0.11 TFLOP/s matmul peak": which peak the figure is of, as it varies by host and load."""
    if not summary.get("peak_flops"):
        return ""
    return f", MFU {summary['mfu']:.0%} of a measured {summary['peak_flops'] / 1e12:.2f} TFLOP/s matmul peak"


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{seconds:.1f} s"
