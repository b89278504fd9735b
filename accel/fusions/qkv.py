"""Packed QKV: the three self-attention projections as one GEMM, and K/V of cross-attention as one.

For diffusers UNets this is diffusers' own `fuse_qkv_projections()` (it writes the packed weights once and
switches to its fused SDPA processor); `unfuse_qkv_projections()` is the way back.

The packed weights are copies: they do not follow weights changed after the fusion (LoRA), so the torch path
leaves this off unless options["fusions"] names it. Measured on an H100 (BENCHMARKS.md): SDXL 41.87 -> 41.14 ms.
"""

from __future__ import annotations

from torch import nn

from .base import Undo


def apply(model: nn.Module, undo: Undo) -> int:
    if not hasattr(model, "fuse_qkv_projections"):
        return 0
    try:
        model.fuse_qkv_projections()
    except ValueError:  # models with added KV projections are not covered by diffusers' fusion
        return 0
    undo.add(model.unfuse_qkv_projections)
    return sum(1 for m in model.modules() if getattr(m, "fused_projections", False))
