"""A DiT's attention inputs from its fused qkv projection in one pass: per-head RMSNorm of q and k (Flux, SD3.5),
the rotary embedding (Flux), and the (batch, tokens, heads, head_dim) layout that SDPA reads through a transpose,
written at a token offset so that a joint text+image sequence is assembled without a concatenation.

qkv holds (3, heads, head_dim) per token, as Flux's and MMDiT's projections do (rows may be strided: Flux's single
blocks project qkv and the MLP input together), or comes as three (batch, tokens, heads * head_dim) projections (q, k
and v, as diffusers' attention makes them). The rotary table `pe` is Flux's (B|1, 1, tokens, head_dim / 2, 2, 2)
rotation matrices over the whole joint sequence, in float32 or in q's dtype (Qwen-Image's forward casts them to it).
Like the eager code, the normalized q and k are rounded to the input dtype before the rotation, which is computed in
float32.

Wan normalizes q and k over all heads' channels, not per head: `qk_row_norm_rope` takes its three projections and
its rotary table (Wan's rope_encode, heads and tokens axes swapped back: Flux's layout), one program per run of
tokens across all heads. LTX-2 normalizes the same way and rotates with a table per token and head that pairs
element j of a head with element j + head_dim / 2 (its split rotary embedding): `qk_row_norm_split_rope`, and
`row_norm_split_rope` for a cross attention's q or k alone.

For fp8 attention each pass may write q and k in e4m3 instead, each divided by a per-tensor descale read from the
device: after an RMSNorm over n channels with weight w every element is bounded by sqrt(n) * max|w| (n is head_dim
per head, heads * head_dim for Wan's row; a rotation keeps the norm of each pair), so a descale set from that bound
never overflows, and e4m3, a floating-point format, keeps its relative precision below the bound. v, which no norm
bounds, stays 16-bit; the pass folds its largest magnitude into AMAX_SLOTS partial maxima on the device (atomic max)
for the pass that quantizes it (kernels/quant.py quantize_tensor takes their largest).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .common import cdiv, e4m3, jit, on_device, pow2, require, supported_tensor, tl
from .errors import BadInput
from .quant import MAX_AMAX

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_SLOTS = 64


@jit
def _rotations(pe_ptr, rows, tok, L, D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    """The 2x2 rotations [[m00, m01], [m10, m11]] of pe's `rows` (one per pair of elements), for tokens `tok`."""
    c = tl.arange(0, 2 * BLOCK_D)[None, :]
    pe = tl.load(pe_ptr + rows * (2 * D) + c, mask=(tok < L) & (c < 2 * D), other=0.0).to(tl.float32)
    left, right = tl.split(tl.reshape(pe, (BLOCK_L, BLOCK_D // 2, 2, 2)))
    m00, m10 = tl.split(left)
    m01, m11 = tl.split(right)
    return m00, m01, m10, m11


@jit
def _rotate(x, m00, m01, m10, m11, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    # the rotation pairs adjacent elements through split and join
    e, o = tl.split(tl.reshape(x, (BLOCK_L, BLOCK_D // 2, 2)))
    return tl.reshape(tl.join(m00 * e + m01 * o, m10 * e + m11 * o), (BLOCK_L, BLOCK_D))


@jit
def _store_qk(out_ptr, x, mask, descale_ptr, QK_FP8: tl.constexpr):
    if QK_FP8:
        x = e4m3(x / tl.load(descale_ptr))
    tl.store(out_ptr, x.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _copy_v(src_ptr, dst_ptr, mask):
    """Copies a tile of v; returns its largest magnitude."""
    v = tl.load(src_ptr, mask=mask, other=0.0)
    tl.store(dst_ptr, v, mask=mask)
    return tl.max(tl.max(tl.abs(v.to(tl.float32)), 1), 0)


@jit
def _fold_amax(amax_ptr, m, program, SLOTS: tl.constexpr):
    # thousands of programs folding into one address wait on each other: spread over SLOTS partial maxima
    tl.atomic_max(amax_ptr + program % SLOTS, m)


# row_stride and pe_stride stay specialized: aligned rows keep the loads vectorized (common.jit)
@jit(do_not_specialize=("L", "total", "offset"))
def _qk_rope_kernel(qs_ptr, ks_ptr, vs_ptr, qw_ptr, kw_ptr, pe_ptr, q_ptr, k_ptr, v_ptr, descale_ptr, amax_ptr, L,
                    total, offset, row_stride, pe_stride, descale_stride, eps,
                    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                    HAS_NORM: tl.constexpr, HAS_PE: tl.constexpr, QK_FP8: tl.constexpr, V_AMAX: tl.constexpr,
                    SLOTS: tl.constexpr):
    # Whole rows are loaded and stored (coalesced).
    b = tl.program_id(1)
    h = tl.program_id(2)
    tok = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (tok < L) & (d < D)
    src = (b * L + tok).to(tl.int64) * row_stride + h * D + d
    dst = ((b * total + offset + tok).to(tl.int64) * H + h) * D + d
    if HAS_PE:
        m00, m01, m10, m11 = _rotations(pe_ptr + b * pe_stride, (offset + tok).to(tl.int64), tok, L, D, BLOCK_L,
                                        BLOCK_D)
    for part in tl.static_range(2):
        w_ptr = qw_ptr if part == 0 else kw_ptr
        out_ptr = q_ptr if part == 0 else k_ptr
        in_ptr = qs_ptr if part == 0 else ks_ptr
        x = tl.load(in_ptr + src, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
            w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
            x = (x * rstd * w).to(in_ptr.dtype.element_ty).to(tl.float32)
        if HAS_PE:
            x = _rotate(x, m00, m01, m10, m11, BLOCK_L, BLOCK_D)
        _store_qk(out_ptr + dst, x, mask, descale_ptr + part * descale_stride, QK_FP8)
    v_max = _copy_v(vs_ptr + src, v_ptr + dst, mask)
    if V_AMAX:
        _fold_amax(amax_ptr, v_max, (tl.program_id(0) * tl.num_programs(1) + b) * H + h, SLOTS)


# row_stride and pe_stride stay specialized, as above
@jit(do_not_specialize=("L",))
def _row_norm_rope_kernel(qs_ptr, ks_ptr, vs_ptr, qw_ptr, kw_ptr, pe_ptr, q_ptr, k_ptr, v_ptr, descale_ptr, amax_ptr, L,
                          row_stride, pe_stride, descale_stride, eps, H: tl.constexpr, D: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, QK_FP8: tl.constexpr, V_AMAX: tl.constexpr,
                          SLOTS: tl.constexpr):
    # One program holds BLOCK_L tokens of every head: the RMS over the whole row is summed head by head, then each
    # head is read again (from cache), normalized, rotated and stored.
    b = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (tok < L) & (d < D)
    row = (b * L + tok).to(tl.int64)
    src = row * row_stride + d
    dst = row * (H * D) + d
    m00, m01, m10, m11 = _rotations(pe_ptr + b * pe_stride, tok.to(tl.int64), tok, L, D, BLOCK_L, BLOCK_D)
    for part in tl.static_range(2):
        w_ptr = qw_ptr if part == 0 else kw_ptr
        out_ptr = q_ptr if part == 0 else k_ptr
        in_ptr = qs_ptr if part == 0 else ks_ptr
        squares = tl.zeros((BLOCK_L,), dtype=tl.float32)
        for h in range(H):
            x = tl.load(in_ptr + src + h * D, mask=mask, other=0.0).to(tl.float32)
            squares += tl.sum(x * x, 1)
        rstd = tl.rsqrt(squares / (H * D) + eps)[:, None]
        for h in range(H):
            x = tl.load(in_ptr + src + h * D, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + h * D + d, mask=d < D, other=0.0).to(tl.float32)
            x = _rotate((x * rstd * w).to(in_ptr.dtype.element_ty).to(tl.float32), m00, m01, m10, m11, BLOCK_L,
                        BLOCK_D)
            _store_qk(out_ptr + dst + h * D, x, mask, descale_ptr + part * descale_stride, QK_FP8)
    v_max = 0.0
    for h in range(H):
        v_max = tl.maximum(v_max, _copy_v(vs_ptr + src + h * D, v_ptr + dst + h * D, mask))
    if V_AMAX:
        _fold_amax(amax_ptr, v_max, tl.program_id(0) * tl.num_programs(1) + b, SLOTS)


@jit
def _row_rstd(in_ptr, src, mask, eps, H: tl.constexpr, D: tl.constexpr, BLOCK_L: tl.constexpr):
    """1 / RMS over the H * D channels of BLOCK_L rows, read as the heads' halves (src: element j of each row)."""
    squares = tl.zeros((BLOCK_L,), dtype=tl.float32)
    for h in range(2 * H):
        x = tl.load(in_ptr + src + h * (D // 2), mask=mask, other=0.0).to(tl.float32)
        squares += tl.sum(x * x, 1)
    return tl.rsqrt(squares / (H * D) + eps)[:, None]


@jit
def _split_rotate_store(in_ptr, w_ptr, out_ptr, src, dst, j, mask, rstd, m00, m01, m10, m11, descale_ptr,
                        D: tl.constexpr, QK_FP8: tl.constexpr):
    """One head of BLOCK_L rows normalized (rounded to the input dtype, as the eager norm's output is) and rotated,
    element j with element j + D / 2, and stored."""
    x1 = tl.load(in_ptr + src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(in_ptr + src + D // 2, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + j, mask=j < D // 2, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + D // 2 + j, mask=j < D // 2, other=0.0).to(tl.float32)
    x1 = (x1 * rstd * w1).to(in_ptr.dtype.element_ty).to(tl.float32)
    x2 = (x2 * rstd * w2).to(in_ptr.dtype.element_ty).to(tl.float32)
    _store_qk(out_ptr + dst, m00 * x1 + m01 * x2, mask, descale_ptr, QK_FP8)
    _store_qk(out_ptr + dst + D // 2, m10 * x1 + m11 * x2, mask, descale_ptr, QK_FP8)


# row_stride and pe_stride stay specialized, as above
@jit(do_not_specialize=("L",))
def _row_norm_split_rope_kernel(qs_ptr, ks_ptr, vs_ptr, qw_ptr, kw_ptr, pe_ptr, q_ptr, k_ptr, v_ptr, descale_ptr,
                                amax_ptr, L, row_stride, pe_stride, descale_stride, eps, H: tl.constexpr,
                                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                                QK_FP8: tl.constexpr, V_AMAX: tl.constexpr, SLOTS: tl.constexpr,
                                QK: tl.constexpr):
    # As _row_norm_rope_kernel, with a table per token and head whose rotations pair element j of a head with
    # element j + D / 2 (LTX-2's split rotary embedding): each head is read as its two halves, and each head's table
    # is read once for q and k. Without QK, q alone (a cross attention's q or k: k and v are not read).
    b = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)[:, None]
    j = tl.arange(0, BLOCK_D // 2)[None, :]
    mask = (tok < L) & (j < D // 2)
    row = (b * L + tok).to(tl.int64)
    src = row * row_stride + j
    dst = row * (H * D) + j
    q_rstd = _row_rstd(qs_ptr, src, mask, eps, H, D, BLOCK_L)
    k_rstd = q_rstd
    if QK:
        k_rstd = _row_rstd(ks_ptr, src, mask, eps, H, D, BLOCK_L)
    for h in range(H):
        m00, m01, m10, m11 = _rotations(pe_ptr + b * pe_stride, tok.to(tl.int64) * H + h, tok, L, D, BLOCK_L,
                                        BLOCK_D)
        _split_rotate_store(qs_ptr, qw_ptr + h * D, q_ptr, src + h * D, dst + h * D, j, mask, q_rstd, m00, m01, m10,
                            m11, descale_ptr, D, QK_FP8)
        if QK:
            _split_rotate_store(ks_ptr, kw_ptr + h * D, k_ptr, src + h * D, dst + h * D, j, mask, k_rstd, m00, m01,
                                m10, m11, descale_ptr + descale_stride, D, QK_FP8)
    if QK:
        v_max = 0.0
        for h in range(2 * H):
            v_max = tl.maximum(v_max, _copy_v(vs_ptr + src + h * (D // 2), v_ptr + dst + h * (D // 2), mask))
        if V_AMAX:
            _fold_amax(amax_ptr, v_max, tl.program_id(0) * tl.num_programs(1) + b, SLOTS)


def supported(qkv: torch.Tensor) -> bool:
    return supported_tensor(qkv, _qk_rope_kernel) and qkv.dim() == 3


def _sources(qkv, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v as (B, L, heads * head_dim) views sharing one row stride, from a packed projection or three."""
    if isinstance(qkv, torch.Tensor):
        if qkv.dim() != 3 or qkv.stride(-1) != 1:
            raise BadInput(f"qk_norm_rope: qkv has shape {tuple(qkv.shape)}, strides {qkv.stride()}; it takes "
                           "(batch, tokens, 3 * heads * head_dim) with contiguous channels.",
                           "Pass the qkv projection.")
        if qkv.shape[-1] % (3 * heads):
            raise BadInput(f"qk_norm_rope: {qkv.shape[-1]} channels are not 3 x {heads} heads.",
                           "Pass the number of heads the projection was made for.")
        return tuple(qkv.chunk(3, dim=-1))
    parts = tuple(qkv)
    first = parts[0]
    if len(parts) != 3 or any(t.dim() != 3 or t.shape != first.shape or t.stride() != first.stride()
                              or t.stride(-1) != 1 or t.dtype != first.dtype or t.device != first.device
                              for t in parts):
        raise BadInput("qk_norm_rope: q, k and v must be three (batch, tokens, heads * head_dim) tensors of one shape, "
                       f"layout and dtype; got {[tuple(t.shape) for t in parts]}.", "Pass the three projections.")
    return parts


def _layout(name: str, sq: torch.Tensor, heads: int, out: tuple[torch.Tensor, ...], descales: Optional[torch.Tensor],
            v_amax: Optional[torch.Tensor]) -> tuple[int, int, int, int]:
    """(B, L, head_dim, the outputs' tokens) of a call, its heads, outputs and fp8 arguments checked."""
    B, L, C = sq.shape
    if C % heads or (C // heads) % 2:
        raise BadInput(f"{name}: {C} channels are not {heads} heads of an even head size.",
                       "Pass the number of heads the projection was made for.")
    D = C // heads
    total = out[0].shape[1]
    qk_dtype = FP8 if descales is not None else sq.dtype
    for t, dtype in zip(out, (qk_dtype, qk_dtype, sq.dtype)):
        if t.shape != (B, total, heads, D) or not t.is_contiguous() or t.dtype != dtype or t.device != sq.device:
            raise BadInput(f"{name}: an output is {tuple(t.shape)} {t.dtype}; expected contiguous "
                           f"({B}, {total}, {heads}, {D}) {dtype}.", "Make the outputs with empty_qkv.")
    for t, what in ((descales, "descales"), (v_amax, "v_amax")):
        if t is not None and (t.dtype != torch.float32 or t.device != sq.device or not t.is_contiguous()
                              or (t.dim() != 2 or t.shape[0] != 2 if what == "descales"
                                  else t.dim() != 1 or not 0 < t.numel() <= MAX_AMAX)):
            raise BadInput(f"{name}: {what} is {tuple(t.shape)} {t.dtype}; expected float32 on {sq.device}, "
                           f"(2, n) descales, a v_amax of 1 to {MAX_AMAX} values.",
                           "Make descales with qk_descales and v_amax with new_v_amax.")
    return B, L, D, total


def _fp8_args(descales: Optional[torch.Tensor], v_amax: Optional[torch.Tensor], like: torch.Tensor) -> tuple:
    """The kernels' descale_ptr, amax_ptr and descale_stride (unread stand-ins where not given)."""
    return (descales if descales is not None else like, v_amax if v_amax is not None else like,
            descales.stride(0) if descales is not None else 0)


def new_v_amax(device: torch.device | str) -> torch.Tensor:
    """The partial maxima that `qk_norm_rope` and `qk_row_norm_rope` fold v's largest magnitude into, for one
    sequence: zeros, (AMAX_SLOTS,) float32."""
    return torch.zeros(AMAX_SLOTS, device=device)


def _slots(v_amax: Optional[torch.Tensor]) -> int:
    return v_amax.numel() if v_amax is not None else 1


def empty_qkv(batch: int, tokens: int, heads: int, head_dim: int, like: torch.Tensor,
              qk_fp8: bool = False) -> tuple[torch.Tensor, ...]:
    """Three (batch, tokens, heads, head_dim) buffers for `qk_norm_rope` to fill; q and k in e4m3 with qk_fp8."""
    dtypes = (FP8 if qk_fp8 else like.dtype,) * 2 + (like.dtype,)
    return tuple(torch.empty(batch, tokens, heads, head_dim, dtype=dt, device=like.device) for dt in dtypes)


def qk_descales(q_weights: Sequence[torch.Tensor], k_weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The descales of q and k for the e4m3 output of `qk_norm_rope` / `qk_row_norm_rope` / `qk_row_norm_split_rope`
    in column 0 of a (2, 4) float32 tensor on the weights' device (each row 16 bytes: a library reading them as
    tensors of their own may want them aligned), from the RMSNorm weights of every stream written into the sequence (one q and one k weight per
    stream, all of one size: the streams normalize the same channels): an RMSNorm over a weight's n elements bounds
    max|x| by sqrt(n) * max|w|, with room for the rounding to the input dtype before the rotation and for a 16-bit
    rotary table. Computed on the device: no host sync, and a CUDA graph that replays it follows a changed weight."""
    weights = (*q_weights, *k_weights)
    n = weights[0].numel()
    if len(q_weights) != len(k_weights) or any(w.numel() != n for w in weights):
        raise BadInput(f"qk_descales: {len(q_weights)} q and {len(k_weights)} k weights of "
                       f"{sorted({w.numel() for w in weights})} elements; expected one of each per stream, of one "
                       "size.", "Pass the q and k RMSNorm weights of the streams of one sequence.")
    # one reduction over all weights, q's in row 0 and k's in row 1: the largest sqrt(n) * max|w| of a row is
    # sqrt(n) times the row's largest |w|, to the bit (rounding is monotonic)
    stacked = torch.stack([w.reshape(n) for w in weights]).view(2, -1)
    amax = torch.linalg.vector_norm(stacked, float("inf"), dim=1, keepdim=True, dtype=torch.float32)
    return ((amax * n ** 0.5).expand(2, 4) * ((1 + 2 ** -6) / FP8_MAX)).clamp_min(1e-12)


def qk_norm_rope(qkv: Union[torch.Tensor, Sequence[torch.Tensor]], heads: int,
                 out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], offset: int = 0,
                 q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                 pe: Optional[torch.Tensor] = None, descales: Optional[torch.Tensor] = None,
                 v_amax: Optional[torch.Tensor] = None) -> None:
    """Write qkv's (B, L, 3 * heads * head_dim) q, k and v (or the three (B, L, heads * head_dim) tensors of a
    sequence) into out[0..2][:, offset:offset + L], each (B, total, heads, head_dim): q and k RMS-normalized per head
    with q_weight and k_weight (when given), then rotated by pe's rows offset..offset + L (when given). With
    `descales` ((2, n) float32, column 0: `qk_descales`) q and k are written in e4m3 (out from empty_qkv(...,
    qk_fp8=True)) as their values divided by the descales, saturated; with `v_amax` (new_v_amax: float32 partial
    maxima) max|v| of these rows is folded into it (atomic max: start a sequence with zeros)."""
    sq, sk, sv = _sources(qkv, heads)
    require(sq, _qk_rope_kernel, "qk_norm_rope")
    B, L, D, total = _layout("qk_norm_rope", sq, heads, out, descales, v_amax)
    qkv = sq
    q, k, v = out
    if not 0 <= offset <= total - L:
        raise BadInput(f"qk_norm_rope: {L} tokens at offset {offset} do not fit {total}.", "Pass a fitting offset.")
    if (q_weight is None) != (k_weight is None):
        raise BadInput("qk_norm_rope: q_weight and k_weight come together.", "Pass both or neither.")
    if descales is not None and q_weight is None:
        raise BadInput("qk_norm_rope: e4m3 q and k need the RMSNorm weights, whose bound sets their scale.",
                       "Pass q_weight and k_weight, or write q and k in 16 bits.")
    for w in (q_weight, k_weight):
        if w is not None and (w.numel() != D or w.device != qkv.device):
            raise BadInput(f"qk_norm_rope: a norm weight has {w.numel()} elements; heads have {D}.",
                           "Pass the per-head RMSNorm weights.")
    pe_stride = 0
    if pe is not None:
        if pe.dtype not in (torch.float32, qkv.dtype) or pe.shape[-3:] != (D // 2, 2, 2) or pe.shape[-4] != total \
                or pe.shape[0] not in (1, B) or pe.device != qkv.device:
            raise BadInput(f"qk_norm_rope: pe has shape {tuple(pe.shape)} {pe.dtype}; expected float32 or "
                           f"{qkv.dtype} (B|1, 1, {total}, {D // 2}, 2, 2).",
                           "Pass Flux's rotary table for the joint sequence.")
        pe = pe.contiguous()
        pe_stride = pe.stride(0) if pe.shape[0] > 1 else 0
    qw = q_weight.contiguous() if q_weight is not None else qkv
    kw = k_weight.contiguous() if k_weight is not None else qkv
    if B * L == 0:
        return
    fp8_args = _fp8_args(descales, v_amax, qkv)
    block_d = pow2(D)
    block_l = max(1, min(pow2(L), 4096 // block_d))
    with on_device(qkv):
        _qk_rope_kernel[(cdiv(L, block_l), B, heads)](
            sq, sk, sv, qw, kw, pe if pe is not None else qkv, q, k, v, *fp8_args[:2], L, total, offset, qkv.stride(1),
            pe_stride, fp8_args[2], eps, H=heads, D=D, BLOCK_D=block_d, BLOCK_L=block_l, HAS_NORM=q_weight is not None,
            HAS_PE=pe is not None, QK_FP8=descales is not None, V_AMAX=v_amax is not None,
            SLOTS=_slots(v_amax), num_warps=4)


def _row_inputs(name: str, kernel, qkv: Sequence[torch.Tensor], heads: int, out: tuple[torch.Tensor, ...],
                q_weight: torch.Tensor, k_weight: torch.Tensor, descales: Optional[torch.Tensor],
                v_amax: Optional[torch.Tensor]) -> tuple:
    """(q, k, v, B, L, head_dim) of a row-norm call (the norm over all heads' channels), its arguments but the
    rotary table checked."""
    sq, sk, sv = _sources(qkv, heads)
    require(sq, kernel, name)
    B, L, D, total = _layout(name, sq, heads, out, descales, v_amax)
    if total != L:
        raise BadInput(f"{name}: the outputs hold {total} tokens; q, k and v have {L}.",
                       "Make the outputs with empty_qkv for these tokens.")
    for w in (q_weight, k_weight):
        if w.numel() != heads * D or w.device != sq.device:
            raise BadInput(f"{name}: a norm weight has {w.numel()} elements; rows have {heads * D}.",
                           "Pass the RMSNorm weights over all heads.")
    return sq, sk, sv, B, L, D


def _launch_rows(kernel, sources: tuple, heads: int, out: tuple[torch.Tensor, ...], q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, pe: torch.Tensor, descales: Optional[torch.Tensor],
                 v_amax: Optional[torch.Tensor], table_per_head: bool = False, **constants: bool) -> None:
    """A row-norm kernel over its checked arguments (and the kernel's own `constants`): one program per run of tokens
    of a sample, all heads."""
    sq = sources[0]
    B, L, C = sq.shape
    if B * L == 0:
        return
    pe = pe.contiguous()
    block_d = pow2(C // heads)
    block_l, warps = max(1, min(pow2(L), 4096 // block_d)), 4
    if table_per_head:
        # A table per token and head is read as much as q and k together, and one warp per run of at most 8 tokens
        # is the launch that reads it fastest (an H200 at LTX-2's video shape: BENCHMARKS.md, 2026-12-01); runs are
        # shortened until the grid has at least 512 programs, so a sequence as short as LTX-2's audio fills the GPU.
        block_l, warps = min(8, pow2(max(1, B * L // 512) + 1) // 2), 1
    descale_ptr, amax_ptr, descale_stride = _fp8_args(descales, v_amax, sq)
    with on_device(sq):
        kernel[(cdiv(L, block_l), B)](
            *sources, q_weight.contiguous(), k_weight.contiguous(), pe, *out, descale_ptr, amax_ptr, L, sq.stride(1),
            pe.stride(0) if pe.shape[0] > 1 else 0, descale_stride, eps, H=heads, D=C // heads, BLOCK_D=block_d,
            BLOCK_L=block_l, QK_FP8=descales is not None, V_AMAX=v_amax is not None, SLOTS=_slots(v_amax),
            num_warps=warps, **constants)


def qk_row_norm_rope(qkv: Sequence[torch.Tensor], heads: int, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, pe: torch.Tensor,
                     descales: Optional[torch.Tensor] = None, v_amax: Optional[torch.Tensor] = None) -> None:
    """Write the three (B, L, heads * head_dim) projections q, k and v into out[0..2], each (B, L, heads, head_dim):
    q and k RMS-normalized over all heads' channels with q_weight and k_weight (heads * head_dim each: Wan's
    q/k norm), then rotated by pe (B|1, 1, L, head_dim / 2, 2, 2). `descales` and `v_amax` as for qk_norm_rope."""
    sq, sk, sv, B, L, D = _row_inputs("qk_row_norm_rope", _row_norm_rope_kernel, qkv, heads, out, q_weight,
                                      k_weight, descales, v_amax)
    if pe.dtype != torch.float32 or pe.shape[-4:] != (L, D // 2, 2, 2) or pe.shape[0] not in (1, B) \
            or pe.device != sq.device:
        raise BadInput(f"qk_row_norm_rope: pe has shape {tuple(pe.shape)} {pe.dtype}; expected float32 "
                       f"(B|1, 1, {L}, {D // 2}, 2, 2).", "Pass the rotary table of these tokens.")
    _launch_rows(_row_norm_rope_kernel, (sq, sk, sv), heads, out, q_weight, k_weight, eps, pe, descales, v_amax)


def qk_row_norm_split_rope(qkv: Sequence[torch.Tensor], heads: int,
                           out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], q_weight: torch.Tensor,
                           k_weight: torch.Tensor, eps: float, pe: torch.Tensor, descales: Optional[torch.Tensor] = None,
                           v_amax: Optional[torch.Tensor] = None) -> None:
    """As qk_row_norm_rope, with LTX-2's split rotary table: pe (B|1, L, heads, head_dim / 2, 2, 2), float32 or the
    projections' dtype, a rotation per token and head that pairs element j of a head with element j + head_dim / 2."""
    sq, sk, sv, B, L, D = _row_inputs("qk_row_norm_split_rope", _row_norm_split_rope_kernel, qkv, heads, out,
                                      q_weight, k_weight, descales, v_amax)
    _check_split_table("qk_row_norm_split_rope", pe, sq, heads, D)
    _launch_rows(_row_norm_split_rope_kernel, (sq, sk, sv), heads, out, q_weight, k_weight, eps, pe, descales,
                 v_amax, table_per_head=True, QK=True)


def row_norm_split_rope(x: torch.Tensor, heads: int, out: torch.Tensor, weight: torch.Tensor, eps: float,
                        pe: torch.Tensor) -> None:
    """One projection x (B, L, heads * head_dim) of a cross attention (its q or its k: LTX-2's audio-video
    attentions), RMS-normalized over all heads' channels with weight and rotated by the split table pe (B|1, L,
    heads, head_dim / 2, 2, 2) as qk_row_norm_split_rope does, written into out (B, L, heads, head_dim) in x's
    dtype."""
    sx, _, _, B, L, D = _row_inputs("row_norm_split_rope", _row_norm_split_rope_kernel, (x, x, x), heads,
                                    (out, out, out), weight, weight, None, None)
    _check_split_table("row_norm_split_rope", pe, sx, heads, D)
    _launch_rows(_row_norm_split_rope_kernel, (sx, sx, sx), heads, (out, out, out), weight, weight, eps, pe, None,
                 None, table_per_head=True, QK=False)


def _check_split_table(name: str, pe: torch.Tensor, x: torch.Tensor, heads: int, D: int) -> None:
    B, L = x.shape[:2]
    if pe.dtype not in (torch.float32, x.dtype) or pe.shape[1:] != (L, heads, D // 2, 2, 2) \
            or pe.shape[0] not in (1, B) or pe.device != x.device:
        raise BadInput(f"{name}: pe has shape {tuple(pe.shape)} {pe.dtype}; expected float32 or {x.dtype} "
                       f"(B|1, {L}, {heads}, {D // 2}, 2, 2).", "Pass the split rotary table of these tokens.")


def qk_norm_rope_ref(qkv: torch.Tensor, heads: int, q_weight: Optional[torch.Tensor] = None,
                     k_weight: Optional[torch.Tensor] = None, eps: float = 1e-6, pe: Optional[torch.Tensor] = None,
                     offset: int = 0, descales: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch reference: (q, k, v), each (B, L, heads, head_dim), as Flux's eager code computes them; with
    `descales` q and k in e4m3, quantized from the float32 rotation as the kernel does."""
    B, L, _ = qkv.shape
    q, k, v = qkv.reshape(B, L, 3, heads, -1).unbind(2)
    if q_weight is not None:
        q = torch.nn.functional.rms_norm(q, q_weight.shape, q_weight.to(q.dtype), eps)
        k = torch.nn.functional.rms_norm(k, k_weight.shape, k_weight.to(k.dtype), eps)
    if pe is not None:
        rows = pe[:, 0, offset:offset + L].unsqueeze(2)  # (B|1, L, 1, D/2, 2, 2)

        def rotate(t: torch.Tensor) -> torch.Tensor:
            t2 = t.float().reshape(*t.shape[:-1], -1, 1, 2)
            return (rows[..., 0] * t2[..., 0] + rows[..., 1] * t2[..., 1]).reshape(t.shape)

        q, k = (rotate(t) if descales is not None else rotate(t).to(t.dtype) for t in (q, k))
    if descales is not None:
        q, k = ((t.float() / d).clamp(-FP8_MAX, FP8_MAX).to(FP8) for t, d in zip((q, k), descales[:, 0].float()))
    return q.contiguous(), k.contiguous(), v.contiguous()


__all__ = ["qk_norm_rope", "qk_norm_rope_ref", "qk_row_norm_rope", "qk_row_norm_split_rope", "row_norm_split_rope",
           "empty_qkv", "new_v_amax", "qk_descales", "supported", "AMAX_SLOTS", "FP8"]
