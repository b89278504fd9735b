"""Nearest-neighbour 2x upsampling of channels_last (NHWC) activations, the UNet's Upsample before its conv,
and the two together in the sub-pixel form.

PyTorch's channels_last nearest kernel (`upsample_nearest2d_nhwc_out_frame`) computes a source index per output
element and reaches only about a tenth of the copy bandwidth at SD's shapes. Here each program reads a tile of input
pixels once, with whole rows of channels, and writes it to the four output pixels it covers.

A 3x3 convolution of the upsampled image repeats work: each output pixel of row parity a and column parity b
sees only a 2x2 window of the input, its taps sums of the 3x3 taps. So the pair is one 2x2 convolution (cuDNN)
of the input with 4 x C_out outputs, one weight set per parity (4/9 of the products), whose outputs the
interleave kernel puts in place with the bias added. The 2x2 weights are made from the 3x3 ones at every call,
so that in-place weight updates (a host's LoRA patching) are always seen.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .common import cdiv, jit, on_device, pow2, require, supported_tensor, tile_for, tl, warps
from .errors import BadInput

MAX_BLOCK_C = 1024
SUBPIXEL_MIN_PIXELS = 512


@jit(do_not_specialize=("P", "W"))
def _nearest2x_nhwc_kernel(x_ptr, y_ptr, P, W, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # x is (N*H*W, C) pixel rows; input pixel p = (n*H + h)*W + w goes to output rows (n*2H + 2h + i)*2W + 2w + j.
    pix = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)[:, None]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (pix < P) & (cols < C)
    v = tl.load(x_ptr + pix.to(tl.int64) * C + cols, mask=mask)
    pix = pix.to(tl.int64)
    out = y_ptr + ((pix // W) * (4 * W) + 2 * (pix % W)) * C + cols
    row = 2 * W * C
    tl.store(out, v, mask=mask)
    tl.store(out + C, v, mask=mask)
    tl.store(out + row, v, mask=mask)
    tl.store(out + row + C, v, mask=mask)


# Row (or column) parity a, tap u: the 3x3 taps k whose sum it is ({0}, {1, 2} for a = 0; {0, 1}, {2} for a = 1).
@jit
def _taps(w0, w1, w2, A: tl.constexpr, U: tl.constexpr):
    if A == 0:
        if U == 0:
            return w0
        return w1 + w2
    if U == 0:
        return w0 + w1
    return w2


@jit
def _subpixel_weight_kernel(w_ptr, y_ptr, CO, CI, s_o, s_i, s_k, s_l, BLOCK_I: tl.constexpr):
    # One output channel o and BLOCK_I input channels: reads the 3x3 taps, writes the 16 taps of the four 2x2
    # kernels to y, (4*CO, CI, 2, 2) in channels_last order, kernel (2a+b)*CO + o.
    o = tl.program_id(0)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    m = i < CI
    src = w_ptr + o.to(tl.int64) * s_o + i * s_i
    w00 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    w01 = tl.load(src + s_l, mask=m, other=0.0).to(tl.float32)
    w02 = tl.load(src + 2 * s_l, mask=m, other=0.0).to(tl.float32)
    w10 = tl.load(src + s_k, mask=m, other=0.0).to(tl.float32)
    w11 = tl.load(src + s_k + s_l, mask=m, other=0.0).to(tl.float32)
    w12 = tl.load(src + s_k + 2 * s_l, mask=m, other=0.0).to(tl.float32)
    w20 = tl.load(src + 2 * s_k, mask=m, other=0.0).to(tl.float32)
    w21 = tl.load(src + 2 * s_k + s_l, mask=m, other=0.0).to(tl.float32)
    w22 = tl.load(src + 2 * s_k + 2 * s_l, mask=m, other=0.0).to(tl.float32)
    for a in tl.static_range(2):
        for u in tl.static_range(2):
            r0 = _taps(w00, w10, w20, a, u)  # the rows summed, per column tap
            r1 = _taps(w01, w11, w21, a, u)
            r2 = _taps(w02, w12, w22, a, u)
            for b in tl.static_range(2):
                for v in tl.static_range(2):
                    dst = y_ptr + (((2 * a + b) * CO + o).to(tl.int64) * 4 + 2 * u + v) * CI + i
                    tl.store(dst, _taps(r0, r1, r2, b, v).to(y_ptr.dtype.element_ty), mask=m)


@jit(do_not_specialize=("Q", "H", "W"))
def _subpixel_interleave_kernel(o_ptr, b_ptr, y_ptr, Q, H, W, C, HAS_B: tl.constexpr, BLOCK_Q: tl.constexpr,
                                BLOCK_C: tl.constexpr):
    # Output pixel q = (n*2H + y)*2W + x of parity (a, b) = (y % 2, x % 2) is the 2x2 convolution's output pixel
    # (y//2 + a, x//2 + b) of the (H+1, W+1) grid, channels (2a+b)*C.. of its 4*C.
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)[:, None]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (q < Q) & (cols < C)
    q = q.to(tl.int64)
    x = q % (2 * W)
    y = (q // (2 * W)) % (2 * H)
    n = q // (4 * H * W)
    a = y % 2
    b = x % 2
    src = ((n * (H + 1) + y // 2 + a) * (W + 1) + x // 2 + b) * (4 * C) + (2 * a + b) * C
    v = tl.load(o_ptr + src + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        v += tl.load(b_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
    tl.store(y_ptr + q * C + cols, v.to(y_ptr.dtype.element_ty), mask=mask)


def supported(x: torch.Tensor) -> bool:
    """True when the kernel can run on `x`: a 4-D channels_last tensor where Triton runs (CUDA/ROCm, or the CPU
    under TRITON_INTERPRET=1)."""
    return (supported_tensor(x, _nearest2x_nhwc_kernel) and x.dim() == 4
            and x.is_contiguous(memory_format=torch.channels_last))


def upsample_nearest2x(x: torch.Tensor) -> torch.Tensor:
    """F.interpolate(x, scale_factor=2, mode="nearest") for a channels_last (N, C, H, W) tensor; channels_last out."""
    require(x, _nearest2x_nhwc_kernel, "upsample_nearest2x")
    if x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last):
        raise BadInput(f"upsample_nearest2x: expected a channels_last (N, C, H, W) tensor, got shape {tuple(x.shape)} "
                       f"with strides {x.stride()}.", "Pass x.contiguous(memory_format=torch.channels_last), or use "
                       "upsample_nearest2x_ref.")
    N, C, H, W = x.shape
    y = torch.empty((N, C, 2 * H, 2 * W), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    P = N * H * W
    if P and C:
        block_c = min(pow2(C), MAX_BLOCK_C)
        block_p = min(pow2(P), max(1, tile_for(x) // block_c))
        with on_device(x):
            _nearest2x_nhwc_kernel[(cdiv(P, block_p), cdiv(C, block_c))](
                x, y, P, W, C, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=warps(block_p * block_c))
    return y


def upsample_nearest2x_ref(x: torch.Tensor) -> torch.Tensor:
    """The torch reference (what the unfused path runs)."""
    return F.interpolate(x, scale_factor=2.0, mode="nearest")


def conv_covers(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether upsample_conv3x3 pays for x: the 2x2 weights, made at every call, cost a pass over the weights
    (C_in x C_out x 25 values), and the convolution saves 5/9 of N x 4HW x C_in x C_out x 9 products. At SD's
    channel counts the saving outweighs making the weights from 512 input pixels over the batch (SD1.5's 16x16
    upsampler with batch 2); at 8x8 it does not (docs/perf-notes.md, Convolutions)."""
    return (supported(x) and x.dim() == 4 and x.shape[0] * x.shape[2] * x.shape[3] >= SUBPIXEL_MIN_PIXELS
            and weight.dim() == 4 and tuple(weight.shape[2:]) == (3, 3) and weight.shape[1] == x.shape[1]
            and weight.dtype == x.dtype and weight.device == x.device)


def subpixel_weight(weight: torch.Tensor) -> torch.Tensor:
    """(C_out, C_in, 3, 3) -> (4 C_out, C_in, 2, 2) channels_last: kernel (2a+b) C_out + o is what output channel o
    of a 3x3 convolution of a nearest-2x-upsampled image applies, at row parity a and column parity b, to the 2x2
    input window (i-1+a.., j-1+b..) of output pixel (2i+a, 2j+b)."""
    require(weight, _subpixel_weight_kernel, "subpixel_weight")
    if weight.dim() != 4 or tuple(weight.shape[2:]) != (3, 3):
        raise BadInput(f"subpixel_weight: expected a (C_out, C_in, 3, 3) weight, got {tuple(weight.shape)}.",
                       "Pass the weight of the 3x3 convolution that follows the upsampling.")
    CO, CI = weight.shape[:2]
    y = torch.empty((4 * CO, CI, 2, 2), device=weight.device, dtype=weight.dtype, memory_format=torch.channels_last)
    if CO and CI:
        block_i = min(pow2(CI), 512)
        with on_device(weight):
            _subpixel_weight_kernel[(CO, cdiv(CI, block_i))](weight, y, CO, CI, *weight.stride(), BLOCK_I=block_i,
                                                              num_warps=warps(block_i * 4))
    return y


def upsample_conv3x3(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.conv2d(F.interpolate(x, scale_factor=2, mode="nearest"), weight, bias, padding=1) for a channels_last
    (N, C, H, W) x, computed in the sub-pixel form (see the module's docstring); channels_last out."""
    require(x, _subpixel_interleave_kernel, "upsample_conv3x3")
    if x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last):
        raise BadInput(f"upsample_conv3x3: expected a channels_last (N, C, H, W) tensor, got shape {tuple(x.shape)} "
                       f"with strides {x.stride()}.", "Pass x.contiguous(memory_format=torch.channels_last), or use "
                       "upsample_conv3x3_ref.")
    if weight.dim() != 4 or tuple(weight.shape[1:]) != (x.shape[1], 3, 3) or weight.dtype != x.dtype:
        raise BadInput(f"upsample_conv3x3: weight {tuple(weight.shape)} {weight.dtype} does not fit x with "
                       f"{x.shape[1]} channels of {x.dtype}.", "Pass a (C_out, C_in, 3, 3) weight of x's dtype.")
    if bias is not None and (bias.numel() != weight.shape[0] or bias.device != x.device):
        raise BadInput(f"upsample_conv3x3: bias has {bias.numel()} elements on {bias.device}, expected "
                       f"{weight.shape[0]} on {x.device}.", "Pass the convolution's bias, or None.")
    N, _, H, W = x.shape
    C = weight.shape[0]
    y = torch.empty((N, C, 2 * H, 2 * W), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    Q = N * 4 * H * W
    if Q == 0 or C == 0:
        return y
    o = F.conv2d(x, subpixel_weight(weight), None, padding=1).contiguous(memory_format=torch.channels_last)
    block_c = min(pow2(C), MAX_BLOCK_C)
    block_q = min(pow2(Q), max(1, tile_for(x) // block_c))
    with on_device(x):
        _subpixel_interleave_kernel[(cdiv(Q, block_q), cdiv(C, block_c))](
            o, bias.contiguous() if bias is not None else o, y, Q, H, W, C, HAS_B=bias is not None,
            BLOCK_Q=block_q, BLOCK_C=block_c, num_warps=warps(block_q * block_c))
    return y


def upsample_conv3x3_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch reference: upsample, then the 3x3 convolution."""
    return F.conv2d(upsample_nearest2x_ref(x), weight, bias, padding=1)


__all__ = ["upsample_nearest2x", "upsample_nearest2x_ref", "upsample_conv3x3", "upsample_conv3x3_ref",
           "subpixel_weight", "conv_covers", "supported"]
