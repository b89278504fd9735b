"""SwiGLU in one pass: SiLU(gate) * up, the activation between the two projections of Flux.2's and Z-Image's MLPs.

Unfused, torch runs it as two kernels over the widest activation of the block (a SiLU writing the gate's half, a
multiply reading it back with the up half); here both halves are read once and the product written once. The math is
float32 and rounds as those two kernels do: SiLU rounded to the tensors' dtype, then the product, so the result is
torch's to within the last bit where the two exponentials differ.

For an fp8 product after it, kernels/quant.py's quantize_rows(swiglu=True) takes the same halves and writes the
product quantized instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import cdiv, jit, on_device, pow2, require, supported_tensor, tile_for, tl, warps
from .errors import BadInput

MAX_BLOCK_H = 1024
# Loaded elements per thread, as kernels/geglu.py's kernel (the same pattern: two halves in, one out).
ELEMS_PER_THREAD = 32
FP16_MAX = 65504.0


@jit(do_not_specialize=("M",))
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, M, H, g_stride, u_stride, FINITE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :]
    mask = (rows < M) & (cols < H)
    # Widen the row offset only: at Flux.2's width (2 x 18432) it passes 2**31 elements from 58,255 rows.
    rows = rows.to(tl.int64)
    g = tl.load(g_ptr + rows * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows * u_stride + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
    y = silu * u
    if FINITE:  # ComfyUI's clamp_fp16 on the float16 result: infinities to the largest finite value, NaN to 0
        y = tl.where(y != y, 0.0, tl.clamp(y, -65504.0, 65504.0))
    tl.store(y_ptr + rows * H + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def supported(x: torch.Tensor) -> bool:
    """True when the Triton kernel can run on `x` (CUDA/ROCm, or CPU under TRITON_INTERPRET=1)."""
    return supported_tensor(x, _swiglu_kernel)


def _rows(t: torch.Tensor, H: int) -> torch.Tensor:
    """t as (rows, H) with contiguous rows: a view where its layout allows (a half of a wider tensor), else a copy."""
    t2 = t.reshape(-1, H)
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def swiglu(gate: torch.Tensor, up: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """SiLU(gate) * up, a new contiguous tensor of their shape and dtype; gate and up may be the halves of one wider
    tensor (views, read in place). finite: float16 results kept finite as ComfyUI's clamp_fp16 keeps them (Z-Image's
    MLP); other dtypes are left as they are, as there."""
    require(gate, _swiglu_kernel, "swiglu")
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device or gate.dim() == 0:
        raise BadInput(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} on {gate.device} and up {tuple(up.shape)} "
                       f"{up.dtype} on {up.device} differ.", "Pass the two halves of the MLP's first projection.")
    H = gate.shape[-1]
    y = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    M = y.numel() // max(H, 1)
    if M == 0 or H == 0:
        return y
    g2, u2 = _rows(gate, H), _rows(up, H)
    block_h = min(pow2(H), MAX_BLOCK_H)
    block_m = min(pow2(M), max(1, tile_for(gate) // 2 // block_h))
    with on_device(gate):
        _swiglu_kernel[(cdiv(M, block_m), cdiv(H, block_h))](
            g2, u2, y, M, H, g2.stride(0), u2.stride(0), FINITE=finite and gate.dtype == torch.float16,
            BLOCK_M=block_m, BLOCK_H=block_h, num_warps=warps(2 * block_m * block_h, ELEMS_PER_THREAD))
    return y


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """The torch reference: ComfyUI's SiLU-gated activation (SiLUActivation; Z-Image's FeedForward with finite)."""
    y = F.silu(gate) * up
    if finite and y.dtype == torch.float16:
        y = torch.nan_to_num(y, nan=0.0, posinf=FP16_MAX, neginf=-FP16_MAX)
    return y


__all__ = ["swiglu", "swiglu_ref", "supported"]
