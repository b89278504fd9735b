"""Packed QKV: a self-attention's three projections as one GEMM, and the K and V of every cross-attention as one
GEMM per UNet call.

The weights are packed (packing.py: each Linear's weight becomes a view of its rows in one buffer, so the host's
weight patching keeps working): a self-attention's q, k and v in a buffer of its own, and the k and v of all the
model's cross-attentions that read the same context width in one shared buffer. Every cross-attention of a UNet
call reads the same text context, so the first one projects it through the whole shared buffer and the others
take their slices (SD1.5: 16 K/V GEMMs become one, SDXL: 140). A call with another context (a host's per-block
conditioning) gets a K/V GEMM of its own module's rows.

Used by the diffusers processor of sdpa_processor and by ComfyUI's CrossAttention, whose forward is restated here
(the same calls: ComfyUI's optimized_attention of the module's own namespace); a call with a separate value
tensor, or a module whose weights are not plain (lowvram casts, LoRA layers), runs as it did.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from . import cross_attention, packing
from .base import Undo, forward_takes, patch_forward, plain_linear

_QKV = "_sd_accel_qkv"  # on the attention module: its _Entry


@dataclass(frozen=True)
class _Entry:
    source: packing.Pack | packing.SharedInput  # the module's own q/k/v pack, or the shared k/v one
    index: int  # the module's first layer in the pack


def _projections(m: nn.Module) -> list[nn.Module] | None:
    layers = [getattr(m, name, None) for name in ("to_q", "to_k", "to_v")]
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
        m.__dict__[_QKV] = _Entry(packing.pack(model, [m.to_q, m.to_k, m.to_v]), 0)
    shared = []
    for modules in cross.values():
        shared.append(packing.SharedInput(packing.pack(model, [l for m in modules for l in (m.to_k, m.to_v)])))
        for i, m in enumerate(modules):
            m.__dict__[_QKV] = _Entry(shared[-1], 2 * i)
    packing.track_calls(model, shared, undo)
    entries = own + [m for modules in cross.values() for m in modules]

    def forget() -> None:
        for m in entries:
            m.__dict__.pop(_QKV, None)

    undo.add(forget)
    return len(entries)


def project(m: nn.Module, x: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """m.to_q(x), m.to_k(context), m.to_v(context): with packed weights in one GEMM for self-attention (context is
    x), and K and V from one GEMM per module, or from the projection of the context that all of the model's
    cross-attentions share (one GEMM per UNet call). A projection whose weight the host replaced runs alone."""
    entry = m.__dict__.get(_QKV)
    if entry is None:
        return m.to_q(x), m.to_k(context), m.to_v(context)
    sizes = [m.to_q.out_features, m.to_k.out_features, m.to_v.out_features]
    source, i = entry.source, entry.index
    if isinstance(source, packing.Pack):
        if context is x and source.intact():
            return source.linear(x, 0, 3).split(sizes, dim=-1)
        pack, i = source, 1
        kv = None
    else:
        pack = source.pack
        kv = source.output(context, i, 2)
    if kv is None and pack.intact(i, 2):
        kv = pack.linear(context, i, 2)
    if kv is None:
        return m.to_q(x), m.to_k(context), m.to_v(context)
    k, v = kv.split(sizes[1:], dim=-1)
    return m.to_q(x), k, v


def _comfy_forward(self, x, context=None, value=None, mask=None, transformer_options={}):  # noqa: B006 (ComfyUI's)
    if value is not None or _QKV not in self.__dict__:
        return type(self).forward(self, x, context, value, mask, transformer_options)
    q, k, v = project(self, x, x if context is None else context)
    # ComfyUI's attention functions, looked up at call time in the module's namespace as its own forward does.
    attention = sys.modules[type(self).__module__]
    if mask is not None:
        out = attention.optimized_attention_masked(q, k, v, self.heads, mask, attn_precision=self.attn_precision,
                                                   transformer_options=transformer_options)
    else:
        out = cross_attention.attend(self, q, k, v, self.heads) \
            if cross_attention.comfy_pytorch_attention(self, transformer_options) else None
        if out is None:
            out = attention.optimized_attention(q, k, v, self.heads, attn_precision=self.attn_precision,
                                                transformer_options=transformer_options)
    return self.to_out(out)


def _comfy_attention(m: nn.Module) -> bool:
    """ComfyUI's CrossAttention in the form restated above."""
    module = sys.modules.get(type(m).__module__)
    return (type(m).__name__ == "CrossAttention" and hasattr(m, "to_out") and hasattr(m, "attn_precision")
            and hasattr(module, "optimized_attention") and hasattr(module, "optimized_attention_masked")
            and forward_takes(m, "x", "context", "value", "mask", "transformer_options"))


def apply(model: nn.Module, undo: Undo) -> int:
    for m in model.modules():
        if _comfy_attention(m):
            patch_forward(m, _comfy_forward, undo)
    return _pack(model, undo)
