"""What the model sees: prepared instances and masked sentences, for people to read."""

import torch

from mlmlab.config import MaskingConfig
from mlmlab.data.loader import collate
from mlmlab.data.store import TokenStore
from mlmlab.data.tokenizer import load_tokenizer
from mlmlab.errors import UserError
from mlmlab.masking.select import IGNORE_INDEX, Corruption, token_info_for
from mlmlab.masking.strategies import UniformStrategy, mask_batch

INSTANCE_KEYS = ("next_sentence_label", "doc_a", "doc_b")


def dump_instances(data_dir, n: int, *, start: int = 0, masked: bool = False, seed: int = 0, epoch: int = 0,
                   strategy: str = "dynamic", dupe_factor: int = 10):
    """Yield instances start..start+n-1 as dicts; with ``masked``, as the training step masks them."""
    store = TokenStore(data_dir)
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


def mask_sentence(text: str, *, tokenizer: str = "", seed: int = 0, epoch: int = 0, rate: float = 0.15) -> str:
    """A table: each token, whether it was selected, what the model sees there, and the label."""
    from mlmlab.train.datasets import tokenizer_dir_for

    if not 0.0 < rate < 1.0:
        raise UserError(f"--rate {rate} is outside (0, 1); use e.g. 0.15")
    tok = load_tokenizer(tokenizer_dir_for(tokenizer))
    ids = torch.tensor([tok(text)["input_ids"]])  # (1, T)
    batch = {"input_ids": ids, "example_ids": torch.zeros(1, dtype=torch.long)}
    masked = mask_batch(batch, seed=seed, epoch_key=epoch, rate=rate, info=token_info_for(tok), corruption=Corruption())
    rows = [f"{'pos':>3}  {'token':<16} {'model sees':<16} {'what':<10} label"]
    for pos, (orig, shown, label) in enumerate(zip(ids[0].tolist(), masked["input_ids"][0].tolist(),
                                                   masked["labels"][0].tolist())):
        selected = label != IGNORE_INDEX
        what = "" if not selected else "[MASK]" if shown == tok.mask_token_id else "unchanged" if shown == orig else "random"
        token, seen = tok.convert_ids_to_tokens([orig, shown])
        rows.append(f"{pos:>3}  {token:<16} {seen if selected else '':<16} {what:<10} {token if selected else '-100'}")
    count = sum(label != IGNORE_INDEX for label in masked["labels"][0].tolist())
    rows.append(f"{count} of {int((masked['labels'] != IGNORE_INDEX).numel())} positions selected "
                f"(rate {rate} of the non-special tokens, seed {seed}, epoch {epoch})")
    return "\n".join(rows)
