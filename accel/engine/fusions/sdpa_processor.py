"""diffusers' attention without its division by an output scale of 1.

AttnProcessor2_0 ends with `hidden_states / attn.rescale_output_factor`, which PyTorch runs as a full pass over
the attention output even when the factor is 1, as it is in every SD1.x, SD2.x and SDXL UNet: 32 extra kernels
per SD1.5 step, 140 per SDXL step. This processor makes the same calls in the same order and leaves that pass
out; calls it does not cover (an attention mask, 4-D input, extra arguments) go to the module's own processor.
Where the qkv fusion packed the module's projections, they run as its packed GEMMs.

Covered: diffusers Attention modules whose processor is AttnProcessor2_0, with output scale 1 and no residual
connection, group norm, spatial norm, query/key norm or cross-attention norm.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .base import Undo, attend
from .packing import project
from .registry import fusion


class PlainSDPAProcessor:
    def __init__(self, original) -> None:
        self.original = original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args,
                 **kwargs):
        if attention_mask is not None or hidden_states.dim() != 3 or args or kwargs:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = project(attn, hidden_states, context)
        batch, heads = hidden_states.shape[0], attn.heads
        out = attend(attn, q, k, v, heads)
        if out is None:
            q, k, v = (t.view(batch, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
            out = out.transpose(1, 2).reshape(batch, -1, heads * out.shape[-1]).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))


def _covered(m: nn.Module) -> bool:
    return (type(m.processor).__name__ == "AttnProcessor2_0" and m.rescale_output_factor == 1.0
            and not m.residual_connection and m.group_norm is None and m.spatial_norm is None
            and m.norm_q is None and m.norm_k is None and not m.norm_cross)


@fusion("sdpa_processor")
def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if type(m).__name__ == "Attention" and hasattr(m, "set_processor") and hasattr(m, "processor") \
                and _covered(m):
            original = m.processor
            m.set_processor(PlainSDPAProcessor(original))
            undo.add(lambda m=m, original=original: m.set_processor(original))
            n += 1
    return n
