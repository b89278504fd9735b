"""Packed QKV: a self-attention's three projections as one GEMM, and the K and V of every cross-attention as one
GEMM per UNet call.

The weights are packed (packing.py: each Linear's weight becomes a view of its rows in one buffer, so the host's
weight patching keeps working): a self-attention's q, k and v in a buffer of its own, and the k and v of all the
model's cross-attentions that read the same context width in one shared buffer. Every cross-attention of a UNet
call reads the same text context, so the first one projects it through the whole shared buffer and the others
take their slices (SD1.5: 16 K/V GEMMs become one, SDXL: 140). A call with another context (a host's per-block
conditioning) gets a K/V GEMM of its own module's rows.

The packed projections (packing.project) are used by the diffusers processor of sdpa_processor and by ComfyUI's
CrossAttention, whose forward is restated here (the same calls: ComfyUI's optimized_attention of the module's own
namespace, or, where that is ComfyUI's choice for the whole host, sd-accel's attention when it was timed faster:
accel/engine/host_attention.py); a call with a separate value tensor, or a module whose weights are not plain (lowvram
casts, LoRA layers), runs as it did.
"""

from __future__ import annotations

import sys

from torch import nn

from . import packing
from .base import (COMFY_ATTENTION, CROSS_ATTENTION_ATTRS, CROSS_ATTENTION_PARAMS, LAYERS, Undo, attend,
                   changed_host_block, comfy_attend, comfy_attention, forward_takes, patch_forward, plain_linear,
                   projections, reads_comfy_attention, set_projections)
from .registry import fusion


def _projections(m: nn.Module) -> list[nn.Module] | None:
    # read from the child dict: a missed attribute lookup is slow, and this runs over every module at every resume
    layers = [m._modules.get(name) for name in ("to_q", "to_k", "to_v")]
    return layers if all(plain_linear(layer) for layer in layers) and layers[0].bias is None else None


def _pack(model: nn.Module, undo: Undo) -> int:
    """Pack the projections of every attention module (again where the host replaced a weight since): a
    self-attention's q, k and v (they read the same width) in a pack of its own, the k and v of the
    cross-attentions in one pack per context width. Returns how many modules read packed weights."""
    own, cross = [], {}
    for m in model.modules():
        layers = _projections(m)
        if layers is None:
            continue
        if packing.packable(layers):
            own.append(m)
        elif packing.packable(layers[1:]):
            w = m.to_k.weight
            cross.setdefault((m.to_k.in_features, w.dtype, w.device), []).append(m)
    for m in own:
        set_projections(m, packing.Projections(packing.pack(model, [m.to_q, m.to_k, m.to_v]), 0), undo)
    shared = []
    for modules in cross.values():
        shared.append(packing.SharedInput(packing.pack(model, [l for m in modules for l in (m.to_k, m.to_v)])))
        for i, m in enumerate(modules):
            set_projections(m, packing.Projections(shared[-1], 2 * i), undo)
    packing.track_calls(model, shared, undo)
    return len(own) + sum(map(len, cross.values()))


def _comfy_forward(self, x, context=None, value=None, mask=None, transformer_options={}):  # noqa: B006 (ComfyUI's)
    if value is not None or projections(self) is None:
        return type(self).forward(self, x, context, value, mask, transformer_options)
    q, k, v = packing.project(self, x, x if context is None else context)
    # ComfyUI's attention functions, looked up at call time in the module's namespace as its own forward does.
    attention = sys.modules[type(self).__module__]
    if mask is not None:
        out = attention.optimized_attention_masked(q, k, v, self.heads, mask, attn_precision=self.attn_precision,
                                                   transformer_options=transformer_options)
    else:
        host = comfy_attention(type(self).__module__, transformer_options, aside=LAYERS)
        if host is None:  # a model patch's override, or another node's function: the host's call
            out = attention.optimized_attention(q, k, v, self.heads, attn_precision=self.attn_precision,
                                                transformer_options=transformer_options)
        else:
            def ours(q, k, v):
                out = attend(self, q, k, v, self.heads)
                return attention.attention_pytorch(q, k, v, self.heads) if out is None else out

            out = comfy_attend(host, q, k, v, ours, lambda: "sd-accel's attention (its kernel or PyTorch's SDPA)",
                               lambda q, k, v: host(q, k, v, self.heads, attn_precision=self.attn_precision))
    return self.to_out(out)


def _comfy_attention(m: nn.Module) -> bool:
    """ComfyUI's CrossAttention in the form restated above."""
    module = sys.modules.get(type(m).__module__)
    return (type(m).__name__ == "CrossAttention" and hasattr(m, "to_out") and hasattr(m, "attn_precision")
            and hasattr(module, "optimized_attention") and hasattr(module, "optimized_attention_masked")
            and forward_takes(m, "x", "context", "value", "mask", "transformer_options"))


@fusion("qkv")
def apply(model: nn.Module, undo: Undo) -> int:
    homes = set()
    for m in model.modules():
        if not changed_host_block(m, "CrossAttention", COMFY_ATTENTION, CROSS_ATTENTION_ATTRS, CROSS_ATTENTION_PARAMS) \
                and _comfy_attention(m):
            patch_forward(m, _comfy_forward, undo)
            homes.add(type(m).__module__)
    for home in sorted(homes):
        reads_comfy_attention(home)
    return _pack(model, undo)
