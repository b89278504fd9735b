"""Packed QKV: the three self-attention projections as one GEMM, and K/V of cross-attention as one.

Packing changes where the weights live, not what they are: to_q, to_k and to_v's weights are copied once into one
buffer, rows after rows, and each Linear's weight becomes a view of its rows (`weight.data = buffer[rows]`). The
Parameters, their names and values stay, so the host's weight patching keeps working: an in-place update (ComfyUI's
weight_inplace_update) writes into the buffer, where the packed GEMM reads it; a Parameter replaced by another
(ComfyUI's default LoRA patching) is no view any more, and that module's calls go through its three Linears until
`pack` runs again, which the torch path does at the start of every run. A cross-attention whose context width
differs from the query's packs K and V only.

The packing outlives the patched forwards: a host's next run replays CUDA graphs captured on the buffers'
addresses. `unpack` gives every weight its own storage back; the torch path calls it when it is released.

Used by the diffusers processor of sdpa_processor and by ComfyUI's CrossAttention, whose forward is restated here
(the same calls: ComfyUI's optimized_attention of the module's own namespace); a call with a separate value
tensor, or a module whose weights are not plain (lowvram casts, LoRA layers), runs as it did.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from .base import Undo, forward_takes, patch_forward, plain_linear

_PACKED = "_sd_accel_packed"  # on the attention module: the buffer and whether to_q's rows lead it


def _projections(m: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    layers = tuple(getattr(m, name, None) for name in ("to_q", "to_k", "to_v"))
    return layers if all(isinstance(layer, nn.Linear) for layer in layers) else None


def _parts(m: nn.Module, with_q: bool) -> tuple[nn.Module, ...]:
    return (m.to_q, m.to_k, m.to_v) if with_q else (m.to_k, m.to_v)


def _packable(layers: tuple[nn.Module, ...]) -> bool:
    w = layers[0].weight
    return all(plain_linear(l) and l.bias is None and l.weight.dtype == w.dtype and l.weight.device == w.device
               and l.in_features == layers[0].in_features for l in layers)


def packed(m: nn.Module) -> tuple[torch.Tensor, bool] | None:
    """(buffer, whether to_q is in it) when every packed projection still reads its rows of the buffer, else None."""
    entry = m.__dict__.get(_PACKED)
    if entry is None:
        return None
    buffer, with_q = entry
    address, row = buffer.data_ptr(), buffer.stride(0) * buffer.element_size()
    for layer in _parts(m, with_q):
        w = layer.weight
        if (not plain_linear(layer) or w.data_ptr() != address or w.device != buffer.device
                or w.dtype != buffer.dtype or w.stride() != buffer.stride()):
            return None
        address += w.shape[0] * row
    return entry


def _pack_one(m: nn.Module) -> bool:
    layers = _projections(m)
    if layers is None:
        return False
    with_q = _packable(layers)
    if not with_q and not _packable(layers[1:]):
        return False
    parts = layers if with_q else layers[1:]
    with torch.no_grad():
        buffer = torch.cat([l.weight.detach() for l in parts])
        start = 0
        for layer in parts:
            rows = layer.out_features
            layer.weight.data = buffer[start:start + rows]
            start += rows
    m.__dict__[_PACKED] = (buffer, with_q)
    return True


def pack(model: nn.Module) -> int:
    """Pack the projections of every attention module whose weights are not packed (or no longer are); returns
    how many modules read packed weights now."""
    return sum(1 for m in model.modules() if packed(m) is not None or _pack_one(m))


def unpack(model: nn.Module) -> None:
    """Every packed weight back in a storage of its own (same values, same Parameters)."""
    for m in model.modules():
        entry = m.__dict__.pop(_PACKED, None)
        if entry is None:
            continue
        storage = entry[0].untyped_storage().data_ptr()
        for layer in _parts(m, entry[1]):
            if layer.weight.untyped_storage().data_ptr() == storage:
                layer.weight.data = layer.weight.data.clone()


def project(m: nn.Module, x: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """m.to_q(x), m.to_k(context), m.to_v(context): with packed weights in one GEMM for self-attention (context is
    x) and one for K and V."""
    entry = packed(m)
    if entry is None:
        return m.to_q(x), m.to_k(context), m.to_v(context)
    buffer, with_q = entry
    sizes = [m.to_q.out_features, m.to_k.out_features, m.to_v.out_features]
    if with_q and context is x:
        return F.linear(x, buffer).split(sizes, dim=-1)
    k, v = F.linear(context, buffer[buffer.shape[0] - sizes[1] - sizes[2]:]).split(sizes[1:], dim=-1)
    return m.to_q(x), k, v


def _comfy_forward(self, x, context=None, value=None, mask=None, transformer_options={}):  # noqa: B006 (ComfyUI's)
    if value is not None or packed(self) is None:
        return type(self).forward(self, x, context, value, mask, transformer_options)
    q, k, v = project(self, x, x if context is None else context)
    # ComfyUI's attention functions, looked up at call time in the module's namespace as its own forward does.
    attention = sys.modules[type(self).__module__]
    if mask is None:
        out = attention.optimized_attention(q, k, v, self.heads, attn_precision=self.attn_precision,
                                            transformer_options=transformer_options)
    else:
        out = attention.optimized_attention_masked(q, k, v, self.heads, mask, attn_precision=self.attn_precision,
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
    return pack(model)
