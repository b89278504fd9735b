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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import Undo, forward_takes, patch_forward, plain_linear

_PACKED = "_sd_accel_packed"  # on the attention module: its _Entry


@dataclass(eq=False)
class _Buffer:
    """Projection weights, rows after rows: one module's q, k and v, or the k and v of every cross-attention
    of the model that reads the same context width. A shared buffer also holds the projection of the context
    of the current UNet call (all of its cross-attentions' K and V from one GEMM), dropped when the call ends."""
    weight: torch.Tensor
    shared: bool
    context: torch.Tensor | None = None
    out: torch.Tensor | None = None

    def project(self, context: torch.Tensor) -> torch.Tensor:
        # Within one UNet call the context is not written to (inference tensors keep no version to check).
        if self.context is not context:
            self.out, self.context = F.linear(context, self.weight), context
        return self.out

    def forget(self) -> None:
        self.context = self.out = None


@dataclass(frozen=True)
class _Entry:
    buffer: _Buffer
    start: int  # the module's first row in the buffer
    with_q: bool  # whether to_q's rows lead the module's rows


def _projections(m: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    layers = tuple(getattr(m, name, None) for name in ("to_q", "to_k", "to_v"))
    return layers if all(isinstance(layer, nn.Linear) for layer in layers) else None


def _parts(m: nn.Module, with_q: bool) -> tuple[nn.Module, ...]:
    return (m.to_q, m.to_k, m.to_v) if with_q else (m.to_k, m.to_v)


def _packable(layers: tuple[nn.Module, ...]) -> bool:
    w = layers[0].weight
    return all(plain_linear(l) and l.bias is None and l.weight.dtype == w.dtype and l.weight.device == w.device
               and l.in_features == layers[0].in_features for l in layers)


def packed(m: nn.Module) -> _Entry | None:
    """The module's packing when every packed projection still reads its rows of the buffer, else None."""
    entry = m.__dict__.get(_PACKED)
    if entry is None:
        return None
    weight = entry.buffer.weight
    row = weight.stride(0) * weight.element_size()
    address = weight.data_ptr() + entry.start * row
    for layer in _parts(m, entry.with_q):
        w = layer.weight
        if (not plain_linear(layer) or w.data_ptr() != address or w.device != weight.device
                or w.dtype != weight.dtype or w.stride() != weight.stride()):
            return None
        address += w.shape[0] * row
    return entry


def _pack(modules: list[nn.Module], with_q: bool) -> None:
    layers = [layer for m in modules for layer in _parts(m, with_q)]
    with torch.no_grad():
        buffer = _Buffer(torch.cat([layer.weight.detach() for layer in layers]), shared=not with_q)
        start = 0
        for m in modules:
            m.__dict__[_PACKED] = _Entry(buffer, start, with_q)
            for layer in _parts(m, with_q):
                layer.weight.data = buffer.weight[start:start + layer.out_features]
                start += layer.out_features


def pack(model: nn.Module) -> int:
    """Pack the projections of every attention module whose weights are not packed (or no longer are); returns
    how many modules read packed weights now. A self-attention (to_q, to_k and to_v read the same width) gets a
    buffer of its own; the cross-attentions share one per context width, which is packed again as a whole
    when any of its modules is not packed."""
    own, shared = [], {}
    for m in model.modules():
        layers = _projections(m)
        if layers is None:
            continue
        if _packable(layers):
            own.append(m)
        elif _packable(layers[1:]):
            w = m.to_k.weight
            shared.setdefault((m.to_k.in_features, w.dtype, w.device), []).append(m)
    for m in own:
        if packed(m) is None:
            _pack([m], with_q=True)
    for modules in shared.values():
        if any(packed(m) is None for m in modules):
            _pack(modules, with_q=False)
    return len(own) + sum(map(len, shared.values()))


def unpack(model: nn.Module) -> None:
    """Every packed weight back in a storage of its own (same values, same Parameters)."""
    for m in model.modules():
        entry = m.__dict__.pop(_PACKED, None)
        if entry is None:
            continue
        storage = entry.buffer.weight.untyped_storage().data_ptr()
        for layer in _parts(m, entry.with_q):
            if layer.weight.untyped_storage().data_ptr() == storage:
                layer.weight.data = layer.weight.data.clone()


def project(m: nn.Module, x: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """m.to_q(x), m.to_k(context), m.to_v(context): with packed weights in one GEMM for self-attention (context is
    x), and K and V from one GEMM per module, or from the projection of the context that all of the model's
    cross-attentions share (one GEMM per UNet call)."""
    entry = packed(m)
    if entry is None:
        return m.to_q(x), m.to_k(context), m.to_v(context)
    sizes = [m.to_q.out_features, m.to_k.out_features, m.to_v.out_features]
    weight = entry.buffer.weight
    if entry.with_q and context is x:
        return F.linear(x, weight[:sum(sizes)]).split(sizes, dim=-1)
    kv = entry.start + (sizes[0] if entry.with_q else 0)
    if entry.buffer.shared and _calls.get(id(entry.buffer)) is entry.buffer:
        out = entry.buffer.project(context)
        return m.to_q(x), out[..., kv:kv + sizes[1]], out[..., kv + sizes[1]:kv + sizes[1] + sizes[2]]
    k, v = F.linear(context, weight[kv:kv + sizes[1] + sizes[2]]).split(sizes[1:], dim=-1)
    return m.to_q(x), k, v


# Shared buffers whose context projection may be reused: those of a model inside its forward call (the hooks
# below add and remove them), so that weights updated between calls are always projected anew.
_calls: dict[int, _Buffer] = {}


def _shared_buffers(model: nn.Module) -> list[_Buffer]:
    entries = (m.__dict__.get(_PACKED) for m in model.modules())
    return list({id(e.buffer): e.buffer for e in entries if e is not None and e.buffer.shared}.values())


def _track_calls(model: nn.Module, undo: Undo) -> None:
    buffers = _shared_buffers(model)
    if not buffers:
        return

    def enter(*_args) -> None:
        for b in buffers:
            b.forget()
            _calls[id(b)] = b

    def leave(*_args) -> None:
        for b in buffers:
            b.forget()
            _calls.pop(id(b), None)

    handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]

    def remove() -> None:
        for h in handles:
            h.remove()
        leave()

    undo.add(remove)


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
    n = pack(model)
    _track_calls(model, undo)
    return n
