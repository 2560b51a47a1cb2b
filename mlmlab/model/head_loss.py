"""The MLM decoder and its cross-entropy fused, chunk by chunk: ``train.fused_head`` (a throughput lever).

The eager head writes the (M, V) logits, then log-softmax writes another (M, V), and the backward
reads both and writes a third. Here each chunk of rows computes its logits, its losses and, in
the same pass, its gradient (softmax minus one-hot), then leaves: at most (rows, V) floats live
at once, and the backward only scales the gradients the forward already summed. The matmuls are
the eager head's three (logits, and the gradients of the hidden states and of the decoder).

The price of computing gradients in the forward: the summed loss is the one differentiable
output (the per-token losses come back detached), which is all that training differentiates.
"""

import torch

ROWS_PER_CHUNK = 128  # (128, V) fp32 logits: 4 MB at an 8k vocabulary, 16 MB at 30k


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows):
        wants_grads = any(ctx.needs_input_grad[:3])
        token_losses = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)  # (M,)
        grad_hidden = torch.empty_like(hidden) if wants_grads else None  # (M, H)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants_grads else None  # (V, H)
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if wants_grads else None  # (V,)
        for start in range(0, len(targets), rows):
            chunk = slice(start, start + rows)
            h, t = hidden[chunk], targets[chunk]  # (c, H), (c,)
            logits = torch.addmm(bias, h, weight.t()).float()  # (c, V)
            target_logits = logits.gather(1, t[:, None]).squeeze(1)  # (c,)
            top = logits.amax(1, keepdim=True)  # (c, 1)
            probs = logits.sub_(top).exp_()  # (c, V), unnormalised, in place of the logits
            total = probs.sum(1, keepdim=True)  # (c, 1)
            token_losses[chunk] = (top + total.log()).squeeze(1) - target_logits
            if wants_grads:
                probs.div_(total)
                probs[torch.arange(len(t), device=t.device), t] -= 1  # d loss_i / d logits_i = softmax - one-hot
                probs = probs.to(hidden.dtype)
                grad_hidden[chunk] = probs @ weight
                accumulate_product(grad_weight, probs.t(), h)
                grad_bias += probs.sum(0, dtype=torch.float32)
        if wants_grads:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype), grad_bias.to(bias.dtype))
        ctx.mark_non_differentiable(token_losses)
        return token_losses.sum(), token_losses

    @staticmethod
    def backward(ctx, grad_sum, _grad_token_losses):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        return grad_hidden * grad_sum, grad_weight * grad_sum, grad_bias * grad_sum, None, None


def accumulate_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total`` (fp32) += a @ b, the product in a and b's dtype: under autocast a bf16 matmul (as the eager head's
    weight gradient), its result added in fp32, rather than an fp32 matmul of upcast copies, several times slower
    where bf16 units are (AMX). In fp32 one addmm_ into the total."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total += (a @ b).float()


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, targets: torch.Tensor, rows: int = ROWS_PER_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over i of cross_entropy(hidden_i W^T + b, target_i), the (M,) per-token losses, detached).

    hidden (M, H), weight (V, H), bias (V,), targets (M,). Under autocast the matmuls run in its dtype, as
    the eager head's would; the softmax and the losses in fp32, as the eager loss's ``logits.float()``.
    """
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight, bias = hidden.to(dtype), weight.to(dtype), bias.to(dtype)
    with torch.autocast(device, enabled=False):
        return _LinearCrossEntropy.apply(hidden, weight, bias, targets, rows)
