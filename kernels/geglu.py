"""GEGLU as diffusers computes it, in one pass: `hidden, gate = (h + bias).chunk(2, -1); hidden * gelu(gate)`.

The unfused form runs a bias add, a chunk, an erf GELU and a multiply as separate kernels over the (tokens, 2*D)
projection output; here h is read once, the (tokens, D) result written once, and the math stays in fp32 throughout
(ONNX Runtime's BiasSplitGelu does the same).

`geglu_linear` also takes the projection's GEMM: x @ W_hidden.T and x @ W_gate.T in one program, only
hidden * gelu(gate) written, so the (tokens, 2*D) projection never goes to memory. On GPUs with TMA (NVIDIA Hopper
and later) the kernel loads its tiles through tensor descriptors, in tiles small enough that two programs can share
an SM (one's GELU epilogue can then overlap the other's main loop). Where the GEMM is large, one program per SM
walks the tiles in one flattened loop instead, so that Triton's pipelining issues the next tile's loads while this
tile's epilogue runs, and loads a tile's hidden and gate rows as one 3-D box into one wide accumulator. That beats
cuBLAS + the GEGLU kernel from 2048 rows whatever the width. Elsewhere a plain pointer-load GEMM only pays where the
GEMM is short (small input width K). `linear_covers` says where.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from .common import cdiv, jit, on_device, pow2, require, supported_tensor, tile_for, tl, warps
from .errors import BadInput

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # no Triton, or one older than tensor descriptors (3.3): the pointer-load kernel only
    TensorDescriptor = None

MAX_BLOCK_D = 1024
# Loaded elements per thread: 32 (half the warps of the other kernels' 16) moved more bytes per second than 16 or 64
# at SD1.5 and SDXL widths (per call, in a CUDA graph).
ELEMS_PER_THREAD = 32


# geglu_linear without TMA: inputs up to this width (K), and its tiles (each of hidden and gate columns). This GEMM is
# slower than cuBLAS's, so the fusion pays only where the GEMM is short next to the GEGLU pass it saves: at SD1.5's
# first level (K = 320) it beats cuBLAS + the GEGLU kernel; from K = 640 it is even or slower.
LINEAR_MAX_K = 320
LINEAR_TILES = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
# With TMA: from this many rows, any width, faster than cuBLAS + the GEGLU kernel at every SD shape from 2048 rows
# (with fewer rows, e.g. 512 x 1280 -> 2 x 5120, it lost). 128 x 64 tiles (x 2) with 4 warps and 3 stages fit two
# programs in an SM, so one's GELU epilogue overlaps the other's main loop. From 2^33 multiply-adds per half (rows x K
# x D: SDXL's 70 calls, not SD1.5's) the persistent kernel, whose flattened tile loop issues the next tile's loads
# during this tile's epilogue: faster per call, and SDXL's step faster in every A/B. At SD1.5's shapes it was faster
# per call too but the step was slower, hence the threshold. Figures: docs/perf-notes.md, GEGLU.
LINEAR_TMA_MIN_ROWS = 2048
LINEAR_TMA_TILES = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, STAGES=3, num_warps=4)
LINEAR_TMA_PERSISTENT_WORK = 1 << 33
LINEAR_TMA_PERSISTENT_TILES = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, STAGES=4, num_warps=8)
# Programs of the persistent kernel under the CPU interpreter: more than one, so that the tests walk the strided loop.
INTERPRET_PROGRAMS = 2


@jit
def _gelu_gate(a, g):
    return a * (0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476)))


@jit
def _tile(tile, M, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Tiles in groups of GROUP_M rows of tiles, so that the programs running together share their W columns in L2.
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(D, BLOCK_N)
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % rows_in_group, (tile % per_group) // rows_in_group


@jit
def _bias_gelu_gate(acc_h, acc_g, b_ptr, rn, D, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc_h += tl.load(b_ptr + rn, mask=rn < D, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(b_ptr + D + rn, mask=rn < D, other=0.0).to(tl.float32)[None, :]
    return _gelu_gate(acc_h, acc_g)


@jit(do_not_specialize=("M",))
def _geglu_linear_tma_kernel(x_desc, w_desc, y_desc, b_ptr, M, D, K, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                             STAGES: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), M, D, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc_h = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # Out-of-range rows and K columns load as zeros. Where D is not a multiple of BLOCK_N, the hidden tile's last
    # rows are gate rows: their columns are past D, which the store drops.
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        a = x_desc.load([off_m, k])
        acc_h = tl.dot(a, w_desc.load([off_n, k]).T, acc_h)
        acc_g = tl.dot(a, w_desc.load([D + off_n, k]).T, acc_g)
    y = _bias_gelu_gate(acc_h, acc_g, b_ptr, off_n + tl.arange(0, BLOCK_N), D, HAS_BIAS)
    y_desc.store([off_m, off_n], y.to(y_desc.dtype))


@jit(do_not_specialize=("M",))
def _geglu_linear_persistent_kernel(x_desc, w_desc, y_desc, b_ptr, M, D, K, HAS_BIAS: tl.constexpr,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                    GROUP_M: tl.constexpr, STAGES: tl.constexpr, PROGRAMS: tl.constexpr):
    # w_desc views W (2D, K) as (2, D, K): a box holds the tile's hidden rows and, below them, its gate rows.
    # Out-of-range rows and K columns load as zeros; the store drops columns past D.
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(D, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile(tile, M, D, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            w = w_desc.load([0, off_n, k]).reshape([2 * BLOCK_N, BLOCK_K])
            acc = tl.dot(x_desc.load([off_m, k]), w.T, acc)
        acc_h, acc_g = tl.split(acc.reshape([BLOCK_M, 2, BLOCK_N]).permute(0, 2, 1))
        y = _bias_gelu_gate(acc_h, acc_g, b_ptr, off_n + tl.arange(0, BLOCK_N), D, HAS_BIAS)
        y_desc.store([off_m, off_n], y.to(y_desc.dtype))


@jit(do_not_specialize=("M",))
def _geglu_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, D, K, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), M, D, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
    w_tile = w_ptr + rn[None, :] * K + rk[:, None]  # W is (2D, K): its rows n and D + n, as [K, N] tiles
    acc_h = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        kmask = rk + k < K
        a = tl.load(x_tile + k, mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & (rn < D)[None, :]
        acc_h = tl.dot(a, tl.load(w_tile + k, mask=wmask, other=0.0), acc_h)
        acc_g = tl.dot(a, tl.load(w_tile + D * K + k, mask=wmask, other=0.0), acc_g)
    y = _bias_gelu_gate(acc_h, acc_g, b_ptr, rn, D, HAS_BIAS)
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * D + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < D)[None, :])


@jit(do_not_specialize=("M",))
def _geglu_kernel(h_ptr, b_ptr, y_ptr, M, D, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < M) & (cols < D)
    # Rows can be many (2 x 16384 tokens x 2*5120 channels > 2**31 elements): widen the row offset only.
    h_row = h_ptr + rows.to(tl.int64) * (2 * D)
    a = tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(h_row + D + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(b_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        g += tl.load(b_ptr + D + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = _gelu_gate(a, g)
    tl.store(y_ptr + rows.to(tl.int64) * D + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def supported(x: torch.Tensor) -> bool:
    """True when the Triton kernel can run on `x` (CUDA/ROCm, or CPU under TRITON_INTERPRET=1)."""
    return supported_tensor(x, _geglu_kernel)


def geglu(h: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(..., 2*D) -> (..., D): (h[..., :D] + bias[:D]) * gelu_erf(h[..., D:] + bias[D:])."""
    require(h, _geglu_kernel, "geglu")
    two_d = h.shape[-1] if h.dim() else 0
    if two_d % 2 or two_d == 0:
        raise BadInput(f"geglu: the last dimension must be even (hidden and gate halves), got shape {tuple(h.shape)}.",
                       "Pass the GEGLU projection output, whose last dimension is 2 * inner_dim.")
    if bias is not None and (bias.numel() != two_d or bias.device != h.device):
        raise BadInput(f"geglu: bias has {bias.numel()} elements on {bias.device}, expected {two_d} on {h.device}.",
                       "Pass the projection's bias (2 * inner_dim elements) on the same device, or None.")
    D = two_d // 2
    h = h.contiguous()
    M = h.numel() // two_d
    y = torch.empty(h.shape[:-1] + (D,), device=h.device, dtype=h.dtype)
    if M == 0:
        return y
    block_d = min(pow2(D), MAX_BLOCK_D)
    block_m = min(pow2(M), max(1, tile_for(h) // 2 // block_d))
    b = bias.contiguous() if bias is not None else h
    with on_device(h):
        _geglu_kernel[(cdiv(M, block_m), cdiv(D, block_d))](
            h, b, y, M, D, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_D=block_d,
            num_warps=warps(2 * block_m * block_d, ELEMS_PER_THREAD))
    return y


def _tma(x: torch.Tensor) -> bool:
    """Whether x's device loads through tensor descriptors (TMA): NVIDIA compute capability 9.0 and later. The CPU
    interpreter, which the tests run on, emulates them."""
    if TensorDescriptor is None:
        return False
    return x.device.type == "cpu" or _tma_gpu(x.device)


@functools.lru_cache(maxsize=None)
def _tma_gpu(device: torch.device) -> bool:
    # once per device: linear_covers and geglu_linear both ask at every call outside a CUDA graph
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tma_aligned(*rows: torch.Tensor) -> bool:
    """TMA's rule for 2-D row-major tensors: 16-byte-aligned start and row stride."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in rows)


def linear_covers(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `geglu_linear` serves x @ weight.T: the kernel runs there, fp16 on both sides (bf16 GEMMs are left to
    cuBLAS: Triton's CPU interpreter, which the tests run on, computes bf16 dot products wrongly), and the shape is
    one where the fused kernel is the faster: with TMA many rows (and TMA-aligned widths), without it a short K."""
    if not (supported(x) and x.dtype == torch.float16 and weight.dtype == x.dtype
            and weight.device == x.device and weight.dim() == 2 and x.shape[-1] == weight.shape[1]
            and weight.shape[0] % 2 == 0):
        return False
    two_d, K = weight.shape
    if _tma(x):
        return x.numel() // max(K, 1) >= LINEAR_TMA_MIN_ROWS and K % 8 == 0 and two_d % 16 == 0
    return K <= LINEAR_MAX_K


def geglu_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """geglu(F.linear(x, weight), bias) in one kernel: (..., K) -> (..., D) with weight (2*D, K)."""
    require(x, _geglu_linear_kernel, "geglu_linear")
    if weight.dim() != 2 or weight.shape[0] % 2 or x.shape[-1] != weight.shape[1] or weight.device != x.device:
        raise BadInput(f"geglu_linear: weight of shape {tuple(weight.shape)} on {weight.device} does not project "
                       f"input of shape {tuple(x.shape)} on {x.device} to hidden and gate halves.",
                       "Pass the GEGLU projection's weight (2 * inner_dim, in_features) on the input's device.")
    two_d, K = weight.shape
    if bias is not None and (bias.numel() != two_d or bias.device != x.device):
        raise BadInput(f"geglu_linear: bias has {bias.numel()} elements on {bias.device}, expected {two_d} on "
                       f"{x.device}.",
                       "Pass the projection's bias (2 * inner_dim elements) on the same device, or None.")
    D = two_d // 2
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    y = torch.empty(x.shape[:-1] + (D,), device=x.device, dtype=x.dtype)
    if M == 0:
        return y
    w = weight.contiguous()
    b = bias.contiguous() if bias is not None else x2
    y2 = y.view(M, D)
    with on_device(x):
        if _tma(x) and _tma_aligned(x2, w, y2):
            persistent = M * K * D >= LINEAR_TMA_PERSISTENT_WORK
            t = LINEAR_TMA_PERSISTENT_TILES if persistent else LINEAR_TMA_TILES
            bm, bn, bk = t["BLOCK_M"], t["BLOCK_N"], t["BLOCK_K"]
            tiles = cdiv(M, bm) * cdiv(D, bn)
            x_desc, y_desc = TensorDescriptor.from_tensor(x2, [bm, bk]), TensorDescriptor.from_tensor(y2, [bm, bn])
            if persistent:
                programs = min(tiles, INTERPRET_PROGRAMS if x.device.type == "cpu" else _sms(x.device))
                _geglu_linear_persistent_kernel[(programs,)](
                    x_desc, TensorDescriptor.from_tensor(w.view(2, D, K), [2, bn, bk]), y_desc, b, M, D, K,
                    HAS_BIAS=bias is not None, PROGRAMS=programs, **t)
            else:
                _geglu_linear_tma_kernel[(tiles,)](
                    x_desc, TensorDescriptor.from_tensor(w, [bn, bk]), y_desc, b, M, D, K, HAS_BIAS=bias is not None,
                    **t)
        else:
            t = LINEAR_TILES
            _geglu_linear_kernel[(cdiv(M, t["BLOCK_M"]) * cdiv(D, t["BLOCK_N"]),)](
                x2, w, b, y2, M, D, K, HAS_BIAS=bias is not None, **t)
    return y


def geglu_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch reference of `geglu_linear` (what the unfused path runs)."""
    return geglu_ref(F.linear(x, weight), bias)


def geglu_ref(h: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch reference: diffusers' GEGLU after its projection (exact erf GELU)."""
    if bias is not None:
        h = h + bias
    hidden, gate = h.chunk(2, dim=-1)
    return hidden * F.gelu(gate)


__all__ = ["geglu", "geglu_ref", "geglu_linear", "geglu_linear_ref", "linear_covers", "supported"]
