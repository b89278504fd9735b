"""Linears packed into one weight buffer, so that their products with one input are one GEMM.

Packing moves the weights, not their values: each layer's weight (and bias) is copied once into a buffer, rows
after rows, and becomes a view of its rows (`weight.data = buffer[rows]`). Parameters, their names and values
stay, so the host's weight patching keeps working: an in-place update (ComfyUI's weight_inplace_update) writes into
the buffer, where the packed GEMM reads it; a Parameter replaced by another (ComfyUI's default LoRA patching) is no
view any more, `Pack.intact` says so, and the caller computes that layer on its own until the layers are packed
again, which the fusions do at the start of every run.

Packs outlive the fusions' patched forwards: a host's next run replays CUDA graphs captured on the buffers'
addresses. `unpack` gives every weight its own storage back; the torch path calls it when it is released.

`project` computes an attention module's q, k and v through the packs the qkv fusion made for it; diffusers'
processor (sdpa_processor) and ComfyUI's restated forward (qkv) both call it. The DiT fusions pack each stream's q, k
and v of a joint attention (`pack_qkv`) and find the pack again at each call (`packed`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import Undo, drop_packs, packs, plain_linear, projections, set_projections


def _reads(t: torch.Tensor | None, buffer: torch.Tensor, row: int) -> bool:
    """Whether t is the view of buffer's rows from `row` that packing made it."""
    if t is None or t.device != buffer.device or t.dtype != buffer.dtype or t.stride() != buffer.stride():
        return False
    return t.data_ptr() == buffer.data_ptr() + row * buffer.stride(0) * buffer.element_size()


@dataclass(eq=False)
class Pack:
    weight: torch.Tensor
    bias: torch.Tensor | None
    layers: tuple[nn.Module, ...]
    starts: tuple[int, ...]  # each layer's first row; the buffer's row count last

    def rows(self, i: int, count: int = 1) -> slice:
        return slice(self.starts[i], self.starts[i + count])

    def intact(self, i: int = 0, count: int | None = None) -> bool:
        """Whether layers i.. (count of them, all by default) still compute x @ W.T + b from their rows."""
        for j in range(i, len(self.layers) if count is None else i + count):
            layer = self.layers[j]
            # A bias the host gave a layer packed without one (A1111 assigns one for a LoRA with a bias diff)
            # counts as a change too.
            bias_kept = (layer.bias is None if self.bias is None else _reads(layer.bias, self.bias, self.starts[j]))
            if not plain_linear(layer) or not _reads(layer.weight, self.weight, self.starts[j]) or not bias_kept:
                return False
        return True

    def linear(self, x: torch.Tensor, i: int, count: int = 1) -> torch.Tensor:
        """Layers i..i+count applied to x as one GEMM: their outputs side by side."""
        rows = self.rows(i, count)
        return F.linear(x, self.weight[rows], None if self.bias is None else self.bias[rows])


def packable(layers: list[nn.Module]) -> bool:
    """Plain Linears of one input width, dtype and device, all with a bias or none."""
    if not layers or not all(plain_linear(layer) for layer in layers):
        return False
    w = layers[0].weight
    has_bias = layers[0].bias is not None
    return all(l.in_features == layers[0].in_features and l.weight.dtype == w.dtype and l.weight.device == w.device
               and (l.bias is not None) == has_bias and (not has_bias or l.bias.dtype == w.dtype) for l in layers)


def pack(model: nn.Module, layers: list[nn.Module]) -> Pack:
    """The layers' pack: the one made before when all of them still read it, else a new one (packable layers)."""
    made = packs(model)
    for p in made:
        if list(p.layers) == layers and p.intact():
            return p
    starts = [0]
    for layer in layers:
        starts.append(starts[-1] + layer.out_features)
    with torch.no_grad():
        weight = torch.cat([layer.weight.detach() for layer in layers])
        bias = torch.cat([layer.bias.detach() for layer in layers]) if layers[0].bias is not None else None
        for layer, a, b in zip(layers, starts, starts[1:]):
            layer.weight.data = weight[a:b]
            if bias is not None:
                layer.bias.data = bias[a:b]
    new = Pack(weight, bias, tuple(layers), tuple(starts))
    ids = {id(layer) for layer in layers}
    made[:] = [p for p in made if not ids & {id(layer) for layer in p.layers}] + [new]
    return new


# Packs up to this size are unpacked in place (a layer at a time, the buffer freed after the last); larger ones
# (SDXL's shared cross-attention K/V pack: ~660 MB) through host memory, so that giving the weights back never
# needs more GPU memory than they take: release() runs when the host is short of memory and unloads the model.
UNPACK_IN_PLACE_BYTES = 64 << 20


def unpack(model: nn.Module) -> None:
    """Every packed weight and bias back in a storage of its own (same values, same Parameters)."""
    made = drop_packs(model)
    while made:
        p = made.pop()
        storages = {t.untyped_storage().data_ptr() for t in (p.weight, p.bias) if t is not None}
        views = [t for layer in p.layers for t in (layer.weight, layer.bias)
                 if t is not None and t.untyped_storage().data_ptr() in storages]
        in_place = p.weight.nbytes <= UNPACK_IN_PLACE_BYTES
        del p
        if not views:  # the host replaced every weight of the pack (a LoRA patched, then unpatched): nothing to give back
            continue
        if in_place:
            for t in views:
                t.data = t.data.clone()
            continue
        device = views[0].device
        for t in views:
            t.data = t.data.to("cpu", copy=True)
        for t in views:  # the buffer is gone now: each weight gets GPU memory of its own
            t.data = t.data.to(device)


@dataclass(eq=False)
class SharedInput:
    """A pack whose layers all read the same tensor within one UNet call (every cross-attention's K and V read the
    text context, every ResNet block's time projection the time embedding): their outputs come from one GEMM,
    made at the first layer's call and sliced for the others while the call lasts."""
    pack: Pack
    active: bool = False
    x: torch.Tensor | None = None
    out: torch.Tensor | None = None

    def output(self, x: torch.Tensor, i: int, count: int = 1) -> torch.Tensor | None:
        """Layers i..i+count of x, side by side, from the call's GEMM; None outside a call or when a layer no longer
        reads the pack (the caller computes it on its own)."""
        if not self.active or not self.pack.intact(i, count):
            return None
        # Within one call the input is not written to (inference tensors keep no version counter to check).
        if self.x is not x:
            self.out, self.x = F.linear(x, self.pack.weight, self.pack.bias), x
        return self.out[..., self.pack.rows(i, count)]

    def forget(self) -> None:
        self.x = self.out = None


def track_calls(model: nn.Module, shared: list[SharedInput], undo: Undo) -> None:
    """Let the shared projections serve only inside a call of the model (forward hooks open and close it), so that
    weights changed between calls are always projected anew."""
    if not shared:
        return

    def enter(*_args) -> None:
        for s in shared:
            s.forget()
            s.active = True

    def leave(*_args) -> None:
        for s in shared:
            s.forget()
            s.active = False

    handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]

    def remove() -> None:
        for h in handles:
            h.remove()
        leave()

    undo.add(remove)


@dataclass(frozen=True)
class Projections:
    """Where an attention module's packed projections are (the qkv fusion's entry for it, base.projections)."""
    source: Pack | SharedInput  # the module's own q/k/v pack, or the shared k/v one
    index: int  # the module's first layer in the pack


def project(m: nn.Module, x: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """m.to_q(x), m.to_k(context), m.to_v(context): with packed weights in one GEMM for self-attention (context is
    x), and K and V from one GEMM per module, or from the projection of the context that all of the model's
    cross-attentions share (one GEMM per UNet call). A projection whose weight the host replaced runs alone."""
    entry = projections(m)
    if entry is None:
        return m.to_q(x), m.to_k(context), m.to_v(context)
    sizes = [m.to_q.out_features, m.to_k.out_features, m.to_v.out_features]
    source, i = entry.source, entry.index
    if isinstance(source, Pack):
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


def pack_qkv(model: nn.Module, layers: list[nn.Module], undo: Undo) -> bool:
    """Pack a stream's q, k and v projections (the form kernels/qk_rope.py reads a packed projection in):
    pack_same_width."""
    return pack_same_width(model, layers, undo)


def pack_same_width(model: nn.Module, layers: list[nn.Module], undo: Undo) -> bool:
    """Pack layers of one input and one output width (a stream's q, k and v; a SiLU-gated MLP's two first
    projections), kept under the first layer for `packed`, where they are packable. Returns whether they were."""
    if not packable(layers) or len({layer.out_features for layer in layers}) != 1:
        return False
    set_projections(layers[0], Projections(pack(model, layers), 0), undo)
    return True


def packed(*layers: nn.Module) -> Pack | None:
    """The pack `pack_qkv` made of exactly these layers, in this order (the host may have swapped a module since)."""
    entry = projections(layers[0])
    if entry is None or not isinstance(entry.source, Pack) or entry.source.layers != layers:
        return None
    return entry.source
