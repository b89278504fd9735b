"""LayerNorm over the last dimension, optionally after a residual add (ONNX Runtime's SkipLayerNorm), and a fused
bias + residual add (BiasAdd).

In a transformer block the residual sum feeds both the next LayerNorm and the next residual: `layer_norm(x,
residual=r)` returns both from one read of x and r; `sum_bias` adds the bias of the layer whose output will be
added to that sum (the feed-forward's output projection, which then adds it in its GEMM). A row (C <= 16384
channels, SD uses up to 2560) is held in registers, so statistics are exact two-pass ones at one read.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from .common import cdiv, jit, on_device, pow2, require, supported_tensor, tile_for, tl, warps
from .errors import BadInput

MAX_C = 16384
# Elements per thread for LayerNorm: 32 beat 16 at SD widths (per call, in a CUDA graph); the bias + residual add
# stays at the default 16, which was faster for it.
LAYER_NORM_ELEMS_PER_THREAD = 32


@jit(do_not_specialize=("M",))
def _layer_norm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, sb_ptr, y_ptr, s_ptr, M, C, eps, HAS_RES: tl.constexpr,
                       HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_SB: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, BLOCK_C)[None, :]
    mask = (rows < M) & (cols < C)
    off = rows.to(tl.int64) * C + cols
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        s = (x + tl.load(r_ptr + off, mask=mask, other=0.0).to(tl.float32)).to(s_ptr.dtype.element_ty)
        if HAS_SB:
            sb = tl.load(sb_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
            tl.store(s_ptr + off, (s.to(tl.float32) + sb).to(s_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(s_ptr + off, s, mask=mask)
        # Normalize the sum as rounded, so that the pair equals (layer_norm(s), s) exactly.
        x = s.to(tl.float32)
    mean = tl.sum(x, 1) / C
    d = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(d * d, 1) / C + eps)
    y = d * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
    tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=mask)


@jit(do_not_specialize=("M",))
def _bias_residual_kernel(x_ptr, b_ptr, b2_ptr, r_ptr, y_ptr, M, C, HAS_B2: tl.constexpr, HAS_RES: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (rows < M) & (cols < C)
    off = rows.to(tl.int64) * C + cols
    y = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    y += tl.load(b_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
    if HAS_B2:
        y += tl.load(b2_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(r_ptr + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=mask)


def supported(x: torch.Tensor) -> bool:
    """True when the Triton kernels can run on `x` (CUDA/ROCm, or CPU under TRITON_INTERPRET=1) and its rows fit."""
    return supported_tensor(x, _layer_norm_kernel) and x.dim() > 0 and x.shape[-1] <= MAX_C


def _vector(t: Optional[torch.Tensor], name: str, x: torch.Tensor, fn: str) -> torch.Tensor:
    """A per-channel parameter as a contiguous vector, or x as a placeholder the kernel never reads."""
    if t is None:
        return x
    if t.numel() != x.shape[-1] or t.device != x.device:
        raise BadInput(f"{fn}: {name} has {t.numel()} elements on {t.device}, expected {x.shape[-1]} on {x.device}.",
                       f"Pass a {name} of the last dimension's size on the tensor's device.")
    return t.contiguous()


def _same(r: torch.Tensor, x: torch.Tensor, fn: str) -> torch.Tensor:
    if r.shape != x.shape or r.dtype != x.dtype or r.device != x.device:
        raise BadInput(f"{fn}: residual {tuple(r.shape)} {r.dtype} on {r.device} does not match x {tuple(x.shape)} "
                       f"{x.dtype} on {x.device}.", "Pass a residual of x's shape, dtype and device.")
    return r.contiguous()


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float = 1e-5,
               residual: Optional[torch.Tensor] = None, sum_bias: Optional[torch.Tensor] = None
               ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """F.layer_norm over the last dim; with `residual`, s = x + residual and returns (layer_norm(s), s), or
    (layer_norm(s), s + sum_bias) when `sum_bias` (over the last dim) is given."""
    require(x, _layer_norm_kernel, "layer_norm")
    if x.dim() == 0 or x.shape[-1] > MAX_C:
        raise BadInput(f"layer_norm: rows of {x.shape[-1] if x.dim() else 0} channels; the kernel holds up to {MAX_C}.",
                       "Use layer_norm_ref (torch) for this tensor.")
    C = x.shape[-1]
    w = _vector(weight, "weight", x, "layer_norm")
    b = _vector(bias, "bias", x, "layer_norm")
    r = _same(residual, x, "layer_norm") if residual is not None else None
    if sum_bias is not None and r is None:
        raise BadInput("layer_norm: sum_bias was given without a residual.", "Pass sum_bias only with residual.")
    sb = _vector(sum_bias, "sum_bias", x, "layer_norm")
    x = x.contiguous()
    M = x.numel() // C if C else 0
    y = torch.empty_like(x)
    s = torch.empty_like(x) if r is not None else y
    if M and C:
        block_c = pow2(C)
        block_m = min(pow2(M), max(1, tile_for(x) // block_c))
        with on_device(x):
            _layer_norm_kernel[(cdiv(M, block_m),)](
                x, r if r is not None else x, w, b, sb, y, s, M, C, eps, HAS_RES=r is not None,
                HAS_W=weight is not None, HAS_B=bias is not None, HAS_SB=sum_bias is not None, BLOCK_M=block_m,
                BLOCK_C=block_c, num_warps=warps(block_m * block_c, LAYER_NORM_ELEMS_PER_THREAD))
    return (y, s) if r is not None else y


def add_bias_residual(x: torch.Tensor, bias: torch.Tensor, residual: Optional[torch.Tensor] = None,
                      bias2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x + bias (+ bias2) (+ residual) in one pass (biases over the last dim), rounded once to x's dtype. bias2: a
    second layer's bias (a ResNet block's shortcut convolution), added without a kernel of its own. Without a
    residual it is the bias add that PyTorch runs after a cuDNN convolution, as one vectorized pass."""
    require(x, _bias_residual_kernel, "add_bias_residual")
    if x.dim() == 0:
        raise BadInput("add_bias_residual: x is a scalar.", "Pass a tensor whose last dimension matches the bias.")
    b = _vector(bias, "bias", x, "add_bias_residual")
    b2 = _vector(bias2, "bias2", x, "add_bias_residual")
    r = _same(residual, x, "add_bias_residual") if residual is not None else None
    x = x.contiguous()
    C = x.shape[-1]
    M = x.numel() // C if C else 0
    y = torch.empty_like(x)
    if M and C:
        block_c = min(pow2(C), 1024)
        block_m = min(pow2(M), max(1, tile_for(x) // block_c))
        with on_device(x):
            _bias_residual_kernel[(cdiv(M, block_m), cdiv(C, block_c))](
                x, b, b2, x if r is None else r, y, M, C, HAS_B2=bias2 is not None, HAS_RES=r is not None,
                BLOCK_M=block_m, BLOCK_C=block_c, num_warps=warps(block_m * block_c))
    return y


def layer_norm_ref(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float = 1e-5,
                   residual: Optional[torch.Tensor] = None, sum_bias: Optional[torch.Tensor] = None
                   ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The torch reference of `layer_norm`."""
    s = x + residual if residual is not None else x
    y = F.layer_norm(s, (x.shape[-1],), weight, bias, eps)
    if residual is None:
        return y
    return (y, s if sum_bias is None else s + sum_bias)


def add_bias_residual_ref(x: torch.Tensor, bias: torch.Tensor, residual: Optional[torch.Tensor] = None,
                          bias2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch reference of `add_bias_residual`."""
    return x + bias + (residual if residual is not None else 0) + (bias2 if bias2 is not None else 0)


__all__ = ["layer_norm", "add_bias_residual", "layer_norm_ref", "add_bias_residual_ref", "supported"]
