"""Fused Triton kernels (NVIDIA and AMD ROCm), each beside its torch reference.

groupnorm: GroupNorm (+SiLU) for NCHW and channels_last, and its split statistics for the tiled VAE.
geglu:     diffusers' GEGLU activation (with the projection bias folded in).
swiglu:    the SiLU-gated activation of Flux.2's and Z-Image's MLPs (SiLU of one half times the other).
layernorm: LayerNorm, LayerNorm after a residual add (SkipLayerNorm), bias + residual add.
upsample:  nearest-neighbour 2x upsampling of channels_last activations.
attention: attention over short key sets (a cross-attention's text tokens).
adaln:     a DiT's LayerNorm with the adaLN modulation (and the gated residual before it).
qk_rope:   a DiT's q/k RMSNorm with the rotary embedding, written for SDPA (q and k in e4m3 for fp8 attention).
quant:     per-row fp8 (or int8) quantization of activations (optionally after the tanh GELU or SwiGLU); per-tensor
           by a device amax.
int8_gemm: int8 matrix products with per-row and per-channel scales, bias and 16-bit output in the epilogue.
ahead:     compiling the kernels a call will launch on a thread pool, before it runs.

Importing this package imports nothing heavy; each module imports Triton if it can and says through `supported(x)`
whether its kernel can run on a tensor. Set TRITON_INTERPRET=1 before the first import to run them on the CPU.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "group_norm": "groupnorm", "group_norm_stats": "groupnorm", "group_norm_apply": "groupnorm",
    "mean_rstd": "groupnorm", "geglu": "geglu", "layer_norm": "layernorm", "add_bias_residual": "layernorm",
    "upsample_nearest2x": "upsample",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
