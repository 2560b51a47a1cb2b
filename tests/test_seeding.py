"""Counter-based uniforms: in (0, 1), uniform, and independent across every coordinate."""

import numpy as np
import torch
from scipy import stats

from mlmlab.masking import seeding


def draw(seed=5, stream=seeding.STREAM_SELECT, examples=4000, epoch=0, length=64):
    ids = torch.arange(examples)
    return seeding.uniforms(seed, [stream], ids, torch.full_like(ids, epoch), length)[0]  # (B, T)


def test_uniform_and_strictly_inside_the_unit_interval():
    u = draw()
    assert 0 < u.min() and u.max() < 1
    assert stats.kstest(u.flatten().numpy()[:200_000], "uniform").pvalue > 1e-3


def test_every_24_bit_draw_maps_strictly_inside_the_unit_interval():
    # The hash reaches the extreme bits once in 2**24 draws, too rarely for draw() to meet them.
    extremes = torch.tensor([0, 1, 2**23, 2**24 - 2, 2**24 - 1])
    for dtype in (torch.float32, torch.float64):
        u = seeding.unit_floats(extremes, dtype)
        assert (u > 0).all() and (u < 1).all(), dtype
        assert torch.all(u[1:] > u[:-1]), dtype  # distinct draws stay distinct and ordered
    exact = (extremes.double() + 0.5) / 2**24
    assert torch.equal(seeding.unit_floats(extremes, torch.float64), exact)


def test_independent_across_positions_examples_epochs_streams_and_seeds():
    base = draw().flatten().numpy()
    others = [draw(epoch=1), draw(stream=seeding.STREAM_ACTION), draw(seed=6)]
    shifted = draw()
    others += [shifted[:, 1:], shifted[1:]]  # neighbouring positions, neighbouring examples
    for other in others:
        other = other.flatten().numpy()
        n = min(len(base), len(other))
        assert abs(np.corrcoef(base[:n], other[:n])[0, 1]) < 0.01


def test_a_pure_function_of_its_coordinates():
    ids = torch.tensor([5, 17, 2**31 - 1])
    full = seeding.uniforms(1, seeding.MASK_STREAMS, torch.arange(40), torch.zeros(40, dtype=torch.long), 16)
    part = seeding.uniforms(1, seeding.MASK_STREAMS, ids % 40, torch.zeros(3, dtype=torch.long), 16)
    assert torch.equal(part, full[:, ids % 40])
