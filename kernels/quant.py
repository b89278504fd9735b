"""Per-row fp8 (e4m3) quantization of activations for fp8 matrix products: each row scaled so that its largest
magnitude maps to e4m3's largest finite value (448), returned with its float32 scale, as torch._scaled_mm's row-wise
scaling takes them (x = x_fp8 * scale). Optionally an MLP's activation first, in the same pass, so that a transformer
MLP's hidden activation goes from its first projection's output straight to the second projection's fp8 operand: the
tanh GELU, or SwiGLU (SiLU of the row's first half times its second half, Flux.2's and Z-Image's MLPs: the 16-bit
input read once, the half-width product never written in 16 bits).

A row of up to MAX_K loaded elements that fills at least FILL of its power-of-two block is held in registers whole:
one read. A longer one (Flux.2's SwiGLU input, 2 x 18,432) would spill them, and a row that fills less (Wan's 8,960-wide
MLP hidden in a block of 16,384) computes its activation on the masked lanes too, so its program walks it in steps of
LOOP_BLOCK twice: the largest magnitude, then the activation again, scaled and stored (the second read mostly from L2).

The same rows in int8 (`dtype=INT8`: each row's largest magnitude to 127, rounded half away from zero) for int8
products (kernels/int8_gemm.py), which keep 7 bits of a row's values where e4m3 keeps 3.

Also per-tensor quantization by a largest magnitude already on the device (`quantize_tensor`: an attention's v, whose
partial maxima the pass that wrote it gathered), with no host sync, so that a CUDA graph replays it.

The scale is the largest magnitude times float32's 1/448 (what torch's CUDA division by a number computes), the
values are multiplied by its reciprocal (one IEEE division a row, div_rn: Triton's "/" approximates on NVIDIA GPUs; a
division per value made the pass compute-bound, 2.4 times as long at Wan's MLP rows) and converted to e4m3. On NVIDIA
GPUs with fp8 (compute capability 8.9 and later) the conversion is the GPU's own instruction (round to nearest even,
saturating), as torch's; elsewhere (ROCm, older GPUs, Triton's CPU interpreter, which converts to fp8 wrongly) the
values are rounded to e4m3 in float32 first (common.e4m3), so that the conversion is exact. The kernel gives its
reference's values either way; the rounding in float32 took about a fifth of the pass's time at Wan's MLP rows."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .common import cdiv, e4m3, interpreted, jit, on_device, pow2, require, supported_tensor, tile_for, tl, warps
from .errors import BadInput

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8 = torch.int8
INT8_MAX = 127.0
# the most elements of a row (twice the output's with SwiGLU) one program holds in registers at once
MAX_K = 16384
# the least share of its power-of-two block a row held in registers fills
FILL = 0.6
# a walked row's step, 8 elements of each input a thread: the fastest of 512-4096 and 2-8 warps at Wan 2.1's 8,960-wide
# GELU rows on an H200, within 4% of the fastest at 12,288 and 13,824 (BENCHMARKS.md)
LOOP_BLOCK = 1024
LOOP_WARPS = 4
# a row held whole: about 32 elements a thread, at most 8 warps
HELD_PER_THREAD = 32
HELD_MAX_WARPS = 8
# every program of quantize_tensor loads all the partial maxima it is given
MAX_AMAX = 1024
# An all-zero row still gets a scale that divides safely.
MIN_SCALE = 1e-12


@jit
def _to_e4m3(x, q_ptr, NATIVE: tl.constexpr):
    if NATIVE:
        return x.to(q_ptr.dtype.element_ty)
    return e4m3(x).to(q_ptr.dtype.element_ty)


@jit
def to_int8(x):
    """x (already divided by its row's scale) as int8, rounded half away from zero: a shift by a half and a conversion,
    which truncates, in every Triton backend and the interpreter alike (kernels/adaln.py's int8 rows too)."""
    return tl.minimum(tl.maximum(tl.where(x < 0, x - 0.5, x + 0.5), -127.0), 127.0).to(tl.int8)


@jit
def _stored(x, q_ptr, INT8: tl.constexpr, NATIVE: tl.constexpr):
    """x (already divided by its row's scale) as the quantized type: int8 or e4m3."""
    if INT8:
        return to_int8(x)
    return _to_e4m3(x, q_ptr, NATIVE)


@jit
def _activated(x_row, cols, K, GELU: tl.constexpr, SWIGLU: tl.constexpr):
    """A row's values at cols (masked past K) in float32, through the activation. With SWIGLU the row holds 2K values:
    the gate's, then the up projection's."""
    mask = cols < K
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)
        x = x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    if SWIGLU:  # SiLU as torch computes it: x / (1 + exp(-x))
        x = x / (1.0 + tl.exp(-x)) * tl.load(x_row + K + cols, mask=mask, other=0.0).to(tl.float32)
    return x


@jit(do_not_specialize=("M",))
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, row_stride, GELU: tl.constexpr, SWIGLU: tl.constexpr,
                          BLOCK_K: tl.constexpr, LOOP: tl.constexpr, NATIVE: tl.constexpr, INT8: tl.constexpr):
    full = 127.0 if INT8 else 448.0  # INT8_MAX, FP8_MAX
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * row_stride, q_ptr + row * K
    cols = tl.arange(0, BLOCK_K)
    if LOOP:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k in range(0, K, BLOCK_K):
            amax = tl.maximum(amax, tl.abs(_activated(x_row, k + cols, K, GELU, SWIGLU)))
        scale = tl.maximum(tl.max(amax, 0) * (1.0 / full), 1e-12)
        inv = tl.math.div_rn(1.0, scale)
        for k in range(0, K, BLOCK_K):
            x = _activated(x_row, k + cols, K, GELU, SWIGLU)
            tl.store(q_row + k + cols, _stored(x * inv, q_ptr, INT8, NATIVE), mask=k + cols < K)
    else:
        x = _activated(x_row, cols, K, GELU, SWIGLU)
        scale = tl.maximum(tl.max(tl.abs(x), 0) * (1.0 / full), 1e-12)
        inv = tl.math.div_rn(1.0, scale)
        tl.store(q_row + cols, _stored(x * inv, q_ptr, INT8, NATIVE), mask=cols < K)
    tl.store(s_ptr + row, scale)


# N is specialized: a size that Triton knows to be a multiple of 16 keeps the masked loads and stores vectorized (the
# elements of attention heads always are)
@jit
def _quantize_tensor_kernel(x_ptr, amax_ptr, q_ptr, descale_ptr, scale_ptr, N, A, BLOCK: tl.constexpr,
                            BLOCK_A: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a = tl.arange(0, BLOCK_A)
    descale = tl.maximum(tl.max(tl.load(amax_ptr + a, mask=a < A, other=0.0), 0) / 448.0, 1e-12)
    x = tl.load(x_ptr + i, mask=i < N, other=0.0).to(tl.float32)
    tl.store(q_ptr + i, e4m3(x / descale).to(q_ptr.dtype.element_ty), mask=i < N)
    if tl.program_id(0) == 0:
        tl.store(descale_ptr, descale)
        tl.store(scale_ptr, 1.0 / descale)


def _native_fp8(x: torch.Tensor, kernel) -> bool:
    """Whether a kernel launched on x converts float32 to e4m3 with the GPU's own instruction (see the docstring)."""
    return (x.device.type == "cuda" and torch.version.hip is None and not interpreted(kernel)
            and _has_fp8_conversion(x.device.index if x.device.index is not None else torch.cuda.current_device()))


@functools.lru_cache(maxsize=None)
def _has_fp8_conversion(device: int) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def supported(x: torch.Tensor) -> bool:
    """Whether the engine quantizes x with the kernel: on CUDA/ROCm. Triton's CPU interpreter runs it too (its tests
    do), a row program at a time; the CPU's engine takes quantize_rows_ref, the same values at torch's speed."""
    return (x.device.type == "cuda" and supported_tensor(x, _quantize_rows_kernel) and x.dim() == 2
            and x.shape[1] > 0)


def quantize_rows(x: torch.Tensor, gelu: bool = False, swiglu: bool = False, dtype: torch.dtype = FP8
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q (M, K) contiguous, scale (M, 1) float32) for a 2-D x whose rows are contiguous (any row stride); of
    gelu(x) (tanh approximation) with gelu; with swiglu, of SiLU(gate) * up for rows [gate | up] of 2K values (K the
    output's width). The activation is computed in float32. dtype: e4m3 (each row's largest magnitude to 448), or
    int8 (to 127, rounded half away from zero: int8 products, kernels/int8_gemm.py)."""
    require(x, _quantize_rows_kernel, "quantize_rows")
    if dtype not in (FP8, INT8):
        raise BadInput(f"quantize_rows: dtype {dtype}; it quantizes to e4m3 or int8.", "Pass FP8 or INT8.")
    if gelu and swiglu:
        raise BadInput("quantize_rows: gelu and swiglu are two activations; it applies one.", "Pass one of them.")
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0 or (swiglu and x.shape[1] % 2):
        raise BadInput(f"quantize_rows: x has shape {tuple(x.shape)}, strides {x.stride()}; it takes (rows, columns) "
                       "with contiguous rows, an even number of columns with swiglu.",
                       "Use quantize_rows_ref (torch) for this tensor.")
    M, width = x.shape
    K = width // 2 if swiglu else width
    q = torch.empty(M, K, device=x.device, dtype=dtype)
    s = torch.empty(M, 1, device=x.device, dtype=torch.float32)
    if M:
        loop = width > MAX_K or K < FILL * pow2(K)
        block_k = LOOP_BLOCK if loop else pow2(K)
        with on_device(x):
            _quantize_rows_kernel[(M,)](x, q, s, M, K, x.stride(0), GELU=gelu, SWIGLU=swiglu, BLOCK_K=block_k,
                                        LOOP=loop, NATIVE=_native_fp8(x, _quantize_rows_kernel),
                                        INT8=dtype == INT8, num_warps=LOOP_WARPS if loop else
                                        min(HELD_MAX_WARPS, warps(block_k, HELD_PER_THREAD)))
    return q, s


def quantize_rows_ref(x: torch.Tensor, gelu: bool = False, swiglu: bool = False, dtype: torch.dtype = FP8
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `quantize_rows`."""
    xf = x.float()
    if gelu:
        xf = F.gelu(xf, approximate="tanh")
    if swiglu:
        gate, up = xf.chunk(2, dim=1)
        xf = F.silu(gate) * up
    full = INT8_MAX if dtype == INT8 else FP8_MAX
    s = (xf.abs().amax(dim=1, keepdim=True) * (1.0 / full)).clamp_min(MIN_SCALE)
    v = xf * (1.0 / s)
    if dtype == INT8:  # rounded half away from zero (the conversion truncates)
        v = torch.where(v < 0, v - 0.5, v + 0.5)
    return v.clamp(-full, full).to(dtype), s


def quantize_tensor(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_fp8 of x's shape, descale, 1 / descale), the scales (1,) float32 tensors of their own, for a contiguous x
    and its largest magnitude: the largest of `amax` (float32 on x's device, one value or up to MAX_AMAX partial
    maxima), x = x_fp8 * descale, x_fp8 saturated at +-448. Runs under Triton's interpreter too (its values are
    rounded to e4m3 before the conversion)."""
    require(x, _quantize_tensor_kernel, "quantize_tensor")
    if not x.is_contiguous() or amax.dtype != torch.float32 or not 0 < amax.numel() <= MAX_AMAX \
            or not amax.is_contiguous() or amax.device != x.device:
        raise BadInput(f"quantize_tensor: x is {tuple(x.shape)} with strides {x.stride()}, amax {tuple(amax.shape)} "
                       f"{amax.dtype}; it takes a contiguous x and 1 to {MAX_AMAX} contiguous float32 amax on its "
                       "device.", "Use quantize_tensor_ref for other layouts.")
    q = torch.empty(x.shape, device=x.device, dtype=FP8)
    descale, scale = (torch.empty(1, device=x.device, dtype=torch.float32) for _ in range(2))
    n = x.numel()
    block = min(tile_for(x), pow2(max(n, 1)))
    with on_device(x):
        _quantize_tensor_kernel[(max(1, cdiv(n, block)),)](x, amax, q, descale, scale, n, amax.numel(), BLOCK=block,
                                                           BLOCK_A=pow2(amax.numel()), num_warps=warps(block))
    return q, descale, scale


def quantize_tensor_ref(x: torch.Tensor, amax: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch reference of `quantize_tensor` (amax: x's own where not given)."""
    amax = x.float().abs().amax().reshape(1) if amax is None else amax.float().amax().reshape(1)
    descale = (amax / FP8_MAX).clamp_min(MIN_SCALE)
    return (x.float() / descale).clamp(-FP8_MAX, FP8_MAX).to(FP8), descale, 1.0 / descale


__all__ = ["quantize_rows", "quantize_rows_ref", "quantize_tensor", "quantize_tensor_ref", "supported", "FP8",
           "FP8_MAX", "INT8", "INT8_MAX"]
