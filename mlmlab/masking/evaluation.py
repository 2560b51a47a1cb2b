"""The masks held-out evaluation scores every model with: uniform, 15%, from a fixed seed.

They are the same whatever strategy trained the model, so strategies compare on one footing.
"""

from mlmlab.masking.select import Corruption, TokenInfo, mask_batch

EVAL_SEED = 20190611
EVAL_RATE = 0.15


def eval_masks(batch: dict, info: TokenInfo) -> dict:
    """``batch`` with the fixed uniform masks (BERT's 80/10/10), as ``mask_batch`` returns it."""
    return mask_batch(batch, seed=EVAL_SEED, epoch_key=0, rate=EVAL_RATE, info=info, corruption=Corruption())
