"""train.fused_qkv: BERT's self-attention projects Q, K and V with one matmul instead of three.

transformers' BertSelfAttention calls three (H, H) linears on the same hidden states; on a CPU
three small matmuls each pay their own dispatch and blocking. ModernBERT's attention is fused
already (its ``Wqkv``). The weights stay where they are (``query``, ``key``, ``value``): the
forward concatenates them, an (3H, H) copy per call against the (B*T, H) x (H, 3H) matmul it
saves, so checkpoints, exports and the Auto classes do not change, and the gradients reach the
three linears through the concatenation.
"""

from types import MethodType

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.models.bert.modeling_bert import ALL_ATTENTION_FUNCTIONS, eager_attention_forward

from mlmlab.model.architectures import architecture_of


def fuse_qkv(model: PreTrainedModel) -> int:
    """Swap the forward of the model's separate Q/K/V attention modules in place; how many it swapped."""
    modules = architecture_of(model).separate_qkv(model)
    for module in modules:
        module.forward = MethodType(fused_qkv_forward, module)
    return len(modules)


def fused_qkv_forward(
    self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None, **kwargs
) -> tuple:
    """BertSelfAttention.forward (transformers 5) of an encoder, with one projection; self is the module."""
    if cache is not None:  # a decoder's key/value cache: mlmlab trains encoders only
        raise ValueError("train.fused_qkv is for encoders: this attention was given a key/value cache")
    weight = torch.cat((self.query.weight, self.key.weight, self.value.weight))  # (3H, H)
    bias = torch.cat((self.query.bias, self.key.bias, self.value.bias))  # (3H,)
    head_shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)  # (B, T, heads, d)
    query, key, value = (
        part.view(head_shape).transpose(1, 2)  # each (B, heads, T, d)
        for part in F.linear(hidden_states, weight, bias).chunk(3, dim=-1)
    )  # (B, T, 3H)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    output, weights = attention(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=self.dropout.p if self.training else 0.0,
        scaling=self.scaling,
        **kwargs,
    )
    return output.reshape(*hidden_states.shape[:-1], -1).contiguous(), weights  # (B, T, H)
