"""train.fused_head: the decoder and its cross-entropy chunk by chunk give the eager head's loss and gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mlmlab.model.head_loss import linear_cross_entropy


def eager_and_fused(rows: int, autocast: bool = False) -> tuple[list, list]:
    """[summed loss, per-token losses, grads of hidden, weight, bias] of the eager head and of the fused one."""
    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(300, 16, generator=generator), torch.randn(500, 16, generator=generator)
    bias, targets = torch.randn(500, generator=generator), torch.randint(0, 500, (300,), generator=generator)

    def run(loss_of) -> list:
        inputs = [tensor.clone().requires_grad_() for tensor in (hidden, weight, bias)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            total, token_losses = loss_of(*inputs)
        (total / 7).backward()  # a denominator, as training divides by the global count
        return [total.detach(), token_losses.detach(), *(tensor.grad for tensor in inputs)]

    def eager(h, w, b):
        token_losses = F.cross_entropy(F.linear(h, w, b).float(), targets, reduction="none")
        return token_losses.sum(), token_losses

    return run(eager), run(lambda h, w, b: linear_cross_entropy(h, w, b, targets, rows=rows))


@pytest.mark.parametrize("rows", [7, 128, 1000])  # chunks that do not divide the 300 rows, and one chunk
def test_the_fused_head_gives_the_eager_losses_and_gradients(rows):
    eager, fused = eager_and_fused(rows)
    for name, want, got in zip(("loss", "token losses", "hidden grad", "weight grad", "bias grad"), eager, fused):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_under_bf16_autocast_the_fused_head_multiplies_in_bf16_as_the_eager_one():
    eager, fused = eager_and_fused(128, autocast=True)
    torch.testing.assert_close(fused[1], eager[1], rtol=2e-2, atol=2e-2)  # bf16 logits of the same inputs
    assert fused[2].dtype == eager[2].dtype == torch.float32  # the gradients reach fp32 parameters


class MatmulOperands(TorchDispatchMode):
    """The dtypes of every matmul's two factors dispatched while it is on (addmm's bias and addmm_'s sum aside)."""

    FACTORS = {  # each matmul's position of its two factors among its arguments
        torch.ops.aten.mm.default: 0,
        torch.ops.aten.addmm.default: 1,
        torch.ops.aten.addmm_.default: 1,
    }

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.FACTORS:
            first = self.FACTORS[func]
            self.dtypes.append((func.__name__, args[first].dtype, args[first + 1].dtype))
        return func(*args, **(kwargs or {}))


def test_under_bf16_autocast_every_matmul_of_the_fused_head_runs_in_bf16():
    """Its decoder-weight gradient too, summed over chunks in fp32: an fp32 matmul of upcast copies there ran
    several times slower than the eager head's bf16 one on a CPU with AMX."""
    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(300, 16, generator=generator), torch.randn(500, 16, generator=generator)
    bias, targets = torch.randn(500, generator=generator), torch.randint(0, 500, (300,), generator=generator)
    inputs = [tensor.requires_grad_() for tensor in (hidden, weight, bias)]
    with MatmulOperands() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        total, _ = linear_cross_entropy(*inputs, targets, rows=128)
    total.backward()
    assert len(seen.dtypes) == 3 * 3  # logits, hidden and weight gradients, for each of the 3 chunks
    assert {(a, b) for _, a, b in seen.dtypes} == {(torch.bfloat16, torch.bfloat16)}, seen.dtypes
    assert inputs[1].grad.dtype == torch.float32
