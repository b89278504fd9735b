"""Residual add + LayerNorm as one pass in diffusers' BasicTransformerBlock (ONNX Runtime's SkipLayerNorm).

Inside the block the residual stream goes attention -> add -> LayerNorm twice (before cross-attention and
before the feed-forward); each add and each norm reads and writes the whole (tokens, channels) stream.
kernels/layernorm.layer_norm(x, residual=r) returns both the sum and its normalization from one read of x and r.
SD1.5 has 16 such blocks, SDXL 70.

Covered: the plain text-to-image block (norm_type "layer_norm", self- and cross-attention, no positional
embedding, no GLIGEN, feed-forward not chunked) where the Triton kernels run; any other call runs the block's
own forward. Attention processors are still called, so attention patches apply.
"""

from __future__ import annotations

from torch import nn

from .base import Undo, kernel_module, patch_forward


def _covered(m: nn.Module) -> bool:
    return (m.norm_type == "layer_norm" and m.pos_embed is None and m.attn2 is not None
            and not m.only_cross_attention and m._chunk_size is None
            and all(isinstance(n, nn.LayerNorm) and n.elementwise_affine for n in (m.norm2, m.norm3)))


def _forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
             timestep=None, cross_attention_kwargs=None, class_labels=None, added_cond_kwargs=None):
    layernorm = kernel_module("layernorm")
    kwargs = dict(cross_attention_kwargs or {})
    if hidden_states.dim() != 3 or "gligen" in kwargs or not _covered(self) or not layernorm.supported(hidden_states):
        return type(self).forward(self, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                  timestep, cross_attention_kwargs, class_labels, added_cond_kwargs)
    attn = self.attn1(self.norm1(hidden_states), encoder_hidden_states=None, attention_mask=attention_mask, **kwargs)
    n2, h = layernorm.layer_norm(attn, self.norm2.weight, self.norm2.bias, self.norm2.eps, residual=hidden_states)
    attn = self.attn2(n2, encoder_hidden_states=encoder_hidden_states, attention_mask=encoder_attention_mask,
                      **kwargs)
    n3, h = layernorm.layer_norm(attn, self.norm3.weight, self.norm3.bias, self.norm3.eps, residual=h)
    return self.ff(n3) + h


def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if type(m).__name__ == "BasicTransformerBlock" and hasattr(m, "norm_type") and _covered(m):
            patch_forward(m, _forward, undo)
            n += 1
    return n
