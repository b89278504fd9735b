"""int8 matrix products with a scale per row of the activations and per output channel of the weights, bias and
16-bit output in the epilogue: y = (a_q @ w_q.T) * a_scale * w_scale + bias.

a_q (M, K) int8 is an activation quantized a row at a time (kernels/quant.py, `dtype=INT8`), w_q (N, K) int8 a weight
quantized per output channel. The products accumulate in int32 (exactly); the scales and the bias apply in float32 to
the accumulator, rounded once to 16 bits. Why int8: on Hopper its tensor-core rate is e4m3's, and with these scales it
keeps about 7 bits of a row's values where e4m3 keeps 3, which is what Z-Image's blocks need (BENCHMARKS.md).

On NVIDIA GPUs of compute capability 9.0 and later the operands are read through TMA tensor descriptors (Triton's
host-side TensorDescriptor), elsewhere (ROCm, older GPUs, the CPU interpreter) by pointers. The tile is chosen by the
product's shape, not autotuned: a CUDA graph may capture the first call of a shape, and autotuning runs its candidates
then. Tiles as timed at Z-Image's and Wan's shapes on an H200 (BENCHMARKS.md)."""

from __future__ import annotations

import functools

import torch

from .common import cdiv, interpreted, jit, on_device, tl, triton
from .errors import BadInput, Unavailable

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # Triton before 3.4, or none: the pointer kernel serves
    TensorDescriptor = None

OUT_DTYPES = (torch.float16, torch.bfloat16)
# TMA reads an operand whose rows start 16-byte aligned (int8: strides in multiples of 16); the pointer kernel any.
ALIGN = 16
# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) by the product's rows, the fastest of 8 tiles on an H200 at Z-Image's and
# Wan's shapes (BENCHMARKS.md): 128 x 256 at 4,608 and 15,600 rows (and 128: one row of tiles), 64 x 128 at 512 (a
# text's rows: 128 x 256 would leave half the GPU's SMs without a tile).
LARGE = (128, 256, 128, 4, 8)
MEDIUM = (64, 128, 128, 4, 4)
MEDIUM_ROWS = (256, 2048)
GROUP_M = 8  # tiles of GROUP_M row blocks walk the columns together, so that a weight tile is read from L2
INTERPRET = (32, 32, 32, 1, 1)


@jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    per_group = GROUP * tl.cdiv(N, BLOCK_N)
    first = (pid // per_group) * GROUP
    size = tl.minimum(tl.cdiv(M, BLOCK_M) - first, GROUP)
    return first + (pid % per_group) % size, (pid % per_group) // size


@jit
def _epilogue(acc, y_ptr, sa_ptr, sw_ptr, b_ptr, M, N, pid_m, pid_n, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
    sw = tl.load(sw_ptr + rn, mask=rn < N, other=0.0)
    y = acc.to(tl.float32) * sa[:, None] * sw[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@jit(do_not_specialize=("M",))
def _gemm_pointers(a_ptr, w_ptr, y_ptr, sa_ptr, sw_ptr, b_ptr, M, N, K, a_stride, w_stride, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * a_stride + rk[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * w_stride + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (k + rk[None, :] < K), other=0)
        w = tl.load(w_ptrs, mask=(rn[None, :] < N) & (k + rk[:, None] < K), other=0)
        acc += tl.dot(a, w, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _epilogue(acc, y_ptr, sa_ptr, sw_ptr, b_ptr, M, N, pid_m, pid_n, HAS_BIAS, BLOCK_M, BLOCK_N)


@jit(do_not_specialize=("M",))
def _gemm_tma(a_desc, w_desc, y_ptr, sa_ptr, sw_ptr, b_ptr, M, N, K, HAS_BIAS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
        w = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
        acc += tl.dot(a, w.T, out_dtype=tl.int32)
    _epilogue(acc, y_ptr, sa_ptr, sw_ptr, b_ptr, M, N, pid_m, pid_n, HAS_BIAS, BLOCK_M, BLOCK_N)


def supported(a: torch.Tensor) -> bool:
    """Whether the kernel runs on a's device: CUDA or ROCm; the CPU under Triton's interpreter (its tests)."""
    if triton is None:
        return False
    return a.device.type == "cuda" or (a.device.type == "cpu" and interpreted(_gemm_pointers)
                                       and interpreted(tl.zeros))


@functools.lru_cache(maxsize=None)
def _tma(device: int) -> bool:
    return TensorDescriptor is not None and torch.version.hip is None \
        and torch.cuda.get_device_capability(device) >= (9, 0)


def tile(M: int, interpret: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) for a product of M rows."""
    if interpret:
        return INTERPRET
    return MEDIUM if MEDIUM_ROWS[0] <= M < MEDIUM_ROWS[1] else LARGE


def _check(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
           bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:
    M, K = a.shape if a.dim() == 2 else (-1, -1)
    problems = []
    if a.dtype != torch.int8 or w.dtype != torch.int8 or a.dim() != 2 or w.dim() != 2 or w.shape[1] != K:
        problems.append(f"a {tuple(a.shape)} {a.dtype} and w {tuple(w.shape)} {w.dtype}: int8 (M, K) and (N, K)")
    elif a.stride(1) != 1 or w.stride(1) != 1:
        problems.append("the rows of a and w must be contiguous")
    if a_scale.dtype != torch.float32 or a_scale.numel() != M or not a_scale.is_contiguous():
        problems.append(f"a_scale {tuple(a_scale.shape)} {a_scale.dtype}: M float32 values")
    if w_scale.dtype != torch.float32 or w_scale.numel() != w.shape[0] or not w_scale.is_contiguous():
        problems.append(f"w_scale {tuple(w_scale.shape)} {w_scale.dtype}: N float32 values")
    if bias is not None and (bias.numel() != w.shape[0] or not bias.is_contiguous()):
        problems.append(f"bias {tuple(bias.shape)}: N contiguous values")
    if out_dtype not in OUT_DTYPES:
        problems.append(f"out_dtype {out_dtype}: float16 or bfloat16")
    if problems:
        raise BadInput("int8_matmul: " + "; ".join(problems) + ".", "Use int8_matmul_ref for other operands.")


def int8_matmul(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """(a @ w.T) * a_scale * w_scale (+ bias) as an (M, N) tensor of out_dtype (written into `out`, contiguous, where
    given): a (M, K) and w (N, K) int8 with contiguous rows (w may be a column slice of a wider weight), a_scale M
    and w_scale N float32 values (any shape), bias N values."""
    if not supported(a):
        raise Unavailable(f"int8_matmul: Triton cannot run on a {a.device.type} tensor here.",
                          "Use int8_matmul_ref, or a CUDA/ROCm GPU.")
    _check(a, a_scale, w, w_scale, bias, out_dtype)
    (M, K), N = a.shape, w.shape[0]
    y = out if out is not None else torch.empty(M, N, device=a.device, dtype=out_dtype)
    if y.shape != (M, N) or y.dtype != out_dtype or not y.is_contiguous():
        raise BadInput(f"int8_matmul: out is {tuple(y.shape)} {y.dtype}; it takes a contiguous ({M}, {N}) "
                       f"{out_dtype} tensor.", "Pass such a tensor, or none.")
    if M == 0:
        return y
    interpret = a.device.type == "cpu"
    bm, bn, bk, stages, num_warps = tile(M, interpret)
    grid = (cdiv(M, bm) * cdiv(N, bn),)
    b = bias if bias is not None else a_scale  # never read without HAS_BIAS
    with on_device(a):
        if not interpret and all(t.stride(0) % ALIGN == 0 and t.data_ptr() % ALIGN == 0 for t in (a, w)) \
                and _tma(a.device.index if a.device.index is not None else torch.cuda.current_device()):
            a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
            w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
            _gemm_tma[grid](a_desc, w_desc, y, a_scale, w_scale, b, M, N, K, HAS_BIAS=bias is not None,
                            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP=GROUP_M, num_stages=stages,
                            num_warps=num_warps)
        else:
            _gemm_pointers[grid](a, w, y, a_scale, w_scale, b, M, N, K, a.stride(0), w.stride(0),
                                 HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP=GROUP_M,
                                 num_stages=stages, num_warps=num_warps)
    return y


def int8_matmul_ref(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The torch reference of `int8_matmul`: the exact int32 product (torch._int_mm), scaled and biased in float32."""
    _check(a, a_scale, w, w_scale, bias, out_dtype)
    acc = torch._int_mm(a, w.t()) if a.shape[0] > 0 else a.new_zeros(0, w.shape[0], dtype=torch.int32)
    y = acc.float() * a_scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.reshape(1, -1).float()
    return y.to(out_dtype)


__all__ = ["int8_matmul", "int8_matmul_ref", "supported", "tile"]
