"""Reference implementations that library code must agree with (tests) or beat (benchmarks/masking.py)."""

import torch

from mlmlab.masking.scorers import unwrap
from mlmlab.model.pretraining import encode, eval_mode


def naive_entropy_scores(model, batch, eligible, vocab_size: int) -> torch.Tensor:
    """The entropy scorer written plainly: the full (B, T, V) softmax at once, which the library chunks."""
    model = unwrap(model)
    with torch.no_grad(), eval_mode(model):
        hidden, _ = encode(model, batch)  # (B, T, H)
        logits = model.cls.predictions(hidden)[..., :vocab_size].float()  # (B, T, V)
        probs = torch.softmax(logits, dim=-1)
        entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(dim=-1)  # (B, T)
    return torch.where(eligible, entropy, torch.zeros_like(entropy))


def quadratic_split_sentences(paragraph: str) -> list[str]:
    """mlmlab's sentence splitter before it became linear: each boundary sliced the sentence from its start.

    Kept as the reference the linear one must match sentence for sentence: prepared datasets are
    identified by a hash of their inputs, so a changed split would change data under an unchanged hash.
    """
    from mlmlab.data.corpus import _ABBREVIATIONS, _BOUNDARY, _LAST_WORD

    def ends_with_abbreviation(text: str) -> bool:
        match = _LAST_WORD.search(text[-40:])
        if match is None:
            return False
        word = match.group(1)
        return len(word) == 1 or "." in word or word.lower() in _ABBREVIATIONS

    sentences = []
    start = 0
    for boundary in _BOUNDARY.finditer(paragraph):
        if ends_with_abbreviation(paragraph[start : boundary.start() + 1]):
            continue
        sentences.append(paragraph[start : boundary.end()].strip())
        start = boundary.end()
    sentences.append(paragraph[start:].strip())
    return [s for s in sentences if s]
