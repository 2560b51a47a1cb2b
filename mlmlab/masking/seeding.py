"""Counter-based random numbers: a pure function of (seed, stream, example, epoch, position).

Masks must not depend on batch composition, DataLoader workers, the number of ranks or
the resume point, so no draw may come from a stateful generator. Instead every uniform
number is a hash of its coordinates (like fairseq's ``numpy_seed(seed, epoch, index)``,
but vectorised in torch so it runs on the device that runs the model).

The hash is Chris Wellons' "lowbias32" integer mixer, with both multipliers chosen
below 2**31 so that a 32-bit value times a multiplier stays below 2**63: int64 torch
arithmetic then never overflows, on CPU or CUDA.
"""

import functools

import torch

_MASK32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D
_MUL2 = 0x6C8E9CF5
_GOLDEN = 0x1E3779B9  # decorrelates consecutive keys before mixing

# Independent streams for the independent decisions of one masking step.
STREAM_SELECT = 1
STREAM_ACTION = 2
STREAM_TOKEN = 3
MASK_STREAMS = (STREAM_SELECT, STREAM_ACTION, STREAM_TOKEN)
STREAM_SCORE = 4  # the uniformly masked copy that the grad_norm scorer differentiates
STREAM_QUOTA = 5  # frequency-neutral ADM: one number per sequence that rounds the bucket quotas
STREAM_SCORED_ROWS = 6  # ADM with masking.score_fraction < 1: which sequences a model scorer scores
STREAM_SPAN = 7  # span masking: the length in words of a span that would begin at a word


def mix32(x):
    """Bijective 32-bit mixer; works on Python ints and on int64 tensors alike."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)


def absorb(state, key):
    """Fold one more coordinate into a hash state."""
    return mix32(state ^ mix32(key + _GOLDEN))


@functools.lru_cache(maxsize=32)
def _position_keys(length: int, device: torch.device) -> torch.Tensor:
    """(T,) mixed positions: shared by every batch of this length, so computed once."""
    return mix32(torch.arange(length, device=device) + _GOLDEN)


def key_hash(seed: int, streams, example_ids: torch.Tensor, epoch_keys: torch.Tensor, length: int) -> torch.Tensor:
    """32-bit hashes of every (seed, stream, example, epoch, position): (S, B, T) int64.

    ``streams`` is a sequence of S stream ids; they share every op, so drawing the three
    streams of one masking step costs one pass.
    """
    streams = torch.as_tensor(streams, device=example_ids.device)[:, None]  # (S, 1)
    per_example = absorb(
        absorb(absorb(absorb(0, seed), streams), example_ids.long()[None, :]), epoch_keys.long()[None, :]
    )  # (S, B)
    return mix32(per_example[:, :, None] ^ _position_keys(length, example_ids.device))  # (S, B, T)


def uniforms(seed: int, streams, example_ids: torch.Tensor, epoch_keys: torch.Tensor, length: int) -> torch.Tensor:
    """Uniform floats strictly inside (0, 1): (S, B, T) float32, 24 random bits each."""
    return unit_floats(key_hash(seed, streams, example_ids, epoch_keys, length) >> 8, torch.float32)


def row_uniforms(seed: int, stream: int, example_ids: torch.Tensor, epoch_keys: torch.Tensor) -> torch.Tensor:
    """One uniform per (seed, stream, example, epoch), strictly inside (0, 1): (B,) float64.

    Position 0's hash of the stream, so it does not depend on the padded length; float64,
    where every 24-bit draw keeps its own value (see ``unit_floats``).
    """
    return unit_floats(key_hash(seed, [stream], example_ids, epoch_keys, 1)[0, :, 0] >> 8, torch.float64)


def unit_floats(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Integers in [0, 2**24) -> the centres of 2**24 equal bins of (0, 1), as ``dtype`` (rounded to it).

    float32 cannot hold the top bin's centre 1 - 2**-25: it rounds to exactly 1 (log(1) = 0
    would turn a Gumbel key infinite), so that one value in 2**24 is clamped to the largest
    float32 below 1. float64 holds every centre; its clamp (1 - 2**-53) changes nothing.
    """
    largest_below_one = 1 - torch.finfo(dtype).eps / 2
    return ((bits.to(dtype) + 0.5) / float(1 << 24)).clamp_max(largest_below_one)
