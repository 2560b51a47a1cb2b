"""The head's cross-entropies chunk by chunk give the eager loss's values and gradients: train.fused_head (the decoder
and its cross-entropy fused), and the eager head's loss on bf16 logits (no (M, V) fp32 copies)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mlmlab.model.head_loss import linear_cross_entropy, logits_cross_entropy
from mlmlab.model.pretraining import SparsePretraining


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


def eager_and_chunked_logits_loss(dtype: torch.dtype, rows: int) -> tuple[list, list]:
    """[per-token losses, grad of the logits] of F.cross_entropy on fp32 copies and of logits_cross_entropy."""
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(300, 500, generator=generator)).to(dtype)  # (M, V)
    targets = torch.randint(0, 500, (300,), generator=generator)  # (M,)
    weights = torch.rand(300, generator=generator)  # a backward that reaches each token's loss differently

    def run(loss_of) -> list:
        leaf = logits.clone().requires_grad_()
        token_losses = loss_of(leaf)
        (token_losses * weights).sum().backward()
        return [token_losses.detach(), leaf.grad]

    eager = run(lambda x: F.cross_entropy(x.float(), targets, reduction="none"))
    return eager, run(lambda x: logits_cross_entropy(x, targets, rows=rows))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [7, 32, 1000])  # chunks that do not divide the 300 rows, and one chunk
def test_the_chunked_logits_loss_gives_the_eager_losses_and_gradients(dtype, rows):
    (want_losses, want_grad), (got_losses, got_grad) = eager_and_chunked_logits_loss(dtype, rows)
    assert got_losses.dtype == torch.float32 and got_grad.dtype == dtype  # fp32 losses, the gradient in the logits'
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad)  # the eager gradient cast to bf16 from the same fp32 values


class LargestFloat32Output(TorchDispatchMode):
    """The most elements of any fp32 tensor an operator returned while it is on."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.elements = max(self.elements, tensor.numel())
        return out


def largest_fp32_tensor_of_a_bf16_step(token_losses_of) -> int:
    """The most elements of an fp32 tensor in the forward and backward of the head's loss on (300, 500) bf16 logits."""
    logits = torch.randn(300, 500, dtype=torch.bfloat16, requires_grad=True)  # (M, V)
    targets = torch.randint(0, 500, (300,))
    with LargestFloat32Output() as seen:
        token_losses_of(logits, targets).sum().backward()
    return seen.elements


def test_the_eager_head_on_bf16_logits_makes_no_fp32_copy_of_them():
    """Training's head (SparsePretraining._token_losses) upcasts a chunk of 32 rows at a time, where
    F.cross_entropy(logits.float()) makes (M, V) fp32 copies; on fp32 logits it is F.cross_entropy, bit for bit."""
    assert largest_fp32_tensor_of_a_bf16_step(SparsePretraining._token_losses) == 32 * 500
    eager = largest_fp32_tensor_of_a_bf16_step(lambda x, t: F.cross_entropy(x.float(), t, reduction="none"))
    assert eager == 300 * 500  # the probe sees the copies where they are made
    logits, targets = torch.randn(12, 40), torch.randint(0, 40, (12,))
    want = F.cross_entropy(logits, targets, reduction="none")
    torch.testing.assert_close(SparsePretraining._token_losses(logits, targets), want, rtol=0, atol=0)
