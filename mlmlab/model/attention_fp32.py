"""model.attention=sdpa_fp32: torch's SDPA on fp32 copies of its inputs when the model runs under bf16/fp16 autocast.

On a CPU, torch's fused attention kernel can run slower in bf16 than in fp32: fast-tiny's bf16 step spent 23.0 ms
per step in attention operators against 14.3 ms in fp32 (benchmarks/profile_step.py, AMD EPYC with AVX512-BF16).
The upcast costs fp32 copies of the (B, heads, T, d) query, key and value and a cast of the output back, against the
(M, V)-sized work of the head. Whether it pays is the host's to say: `benchmarks/throughput.py --lever
model.attention=sdpa_fp32` measures it. In fp32 it is transformers' "sdpa", unchanged.

Registered under its name with transformers' attention and mask interfaces (the documented way to add one), so
every architecture's attention modules reach it through ``config._attn_implementation``, as they reach "sdpa".
"""

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_fp32"


def sdpa_fp32_attention_forward(module, query, key, value, attention_mask, **kwargs) -> tuple:
    """transformers' sdpa_attention_forward on fp32 query, key, value (each (B, heads, T, d)) and a float mask; the
    (B, T, heads, d) output back in the query's dtype."""
    dtype = query.dtype  # in fp32 every cast below returns its input: transformers' sdpa, unchanged
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()  # its large negatives stay large in fp32
    with torch.autocast(query.device.type, enabled=False):
        output, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return output.to(dtype), weights


AttentionInterface.register(NAME, sdpa_fp32_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
