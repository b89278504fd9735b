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
tokens across all heads.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .common import cdiv, jit, on_device, pow2, require, supported_tensor, tl
from .errors import BadInput


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


@jit(do_not_specialize=("L", "total", "offset", "row_stride", "pe_stride"))
def _qk_rope_kernel(qs_ptr, ks_ptr, vs_ptr, qw_ptr, kw_ptr, pe_ptr, q_ptr, k_ptr, v_ptr, L, total, offset, row_stride,
                    pe_stride, eps,
                    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                    HAS_NORM: tl.constexpr, HAS_PE: tl.constexpr):
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
            x = (x * rstd * w).to(out_ptr.dtype.element_ty).to(tl.float32)
        if HAS_PE:
            x = _rotate(x, m00, m01, m10, m11, BLOCK_L, BLOCK_D)
        tl.store(out_ptr + dst, x.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + dst, tl.load(vs_ptr + src, mask=mask, other=0.0), mask=mask)


@jit(do_not_specialize=("L", "row_stride", "pe_stride"))
def _row_norm_rope_kernel(qs_ptr, ks_ptr, vs_ptr, qw_ptr, kw_ptr, pe_ptr, q_ptr, k_ptr, v_ptr, L, row_stride,
                          pe_stride, eps, H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_L: tl.constexpr):
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
            x = _rotate((x * rstd * w).to(out_ptr.dtype.element_ty).to(tl.float32), m00, m01, m10, m11, BLOCK_L,
                        BLOCK_D)
            tl.store(out_ptr + dst + h * D, x.to(out_ptr.dtype.element_ty), mask=mask)
    for h in range(H):
        tl.store(v_ptr + dst + h * D, tl.load(vs_ptr + src + h * D, mask=mask, other=0.0), mask=mask)


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


def _layout(name: str, sq: torch.Tensor, heads: int, out: tuple[torch.Tensor, ...]) -> tuple[int, int, int, int]:
    """(B, L, head_dim, the outputs' tokens) of a call, its heads and outputs checked."""
    B, L, C = sq.shape
    if C % heads or (C // heads) % 2:
        raise BadInput(f"{name}: {C} channels are not {heads} heads of an even head size.",
                       "Pass the number of heads the projection was made for.")
    D = C // heads
    total = out[0].shape[1]
    for t in out:
        if t.shape != (B, total, heads, D) or not t.is_contiguous() or t.dtype != sq.dtype or t.device != sq.device:
            raise BadInput(f"{name}: an output is {tuple(t.shape)} {t.dtype}; expected contiguous "
                           f"({B}, {total}, {heads}, {D}) {sq.dtype}.", "Make the outputs with empty_qkv.")
    return B, L, D, total


def empty_qkv(batch: int, tokens: int, heads: int, head_dim: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Three (batch, tokens, heads, head_dim) buffers for `qk_norm_rope` to fill."""
    return tuple(torch.empty(batch, tokens, heads, head_dim, dtype=like.dtype, device=like.device) for _ in range(3))


def qk_norm_rope(qkv: Union[torch.Tensor, Sequence[torch.Tensor]], heads: int,
                 out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], offset: int = 0,
                 q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                 pe: Optional[torch.Tensor] = None) -> None:
    """Write qkv's (B, L, 3 * heads * head_dim) q, k and v (or the three (B, L, heads * head_dim) tensors of a
    sequence) into out[0..2][:, offset:offset + L], each (B, total, heads, head_dim): q and k RMS-normalized per head
    with q_weight and k_weight (when given), then rotated by pe's rows offset..offset + L (when given)."""
    sq, sk, sv = _sources(qkv, heads)
    require(sq, _qk_rope_kernel, "qk_norm_rope")
    B, L, D, total = _layout("qk_norm_rope", sq, heads, out)
    qkv = sq
    q, k, v = out
    if not 0 <= offset <= total - L:
        raise BadInput(f"qk_norm_rope: {L} tokens at offset {offset} do not fit {total}.", "Pass a fitting offset.")
    if (q_weight is None) != (k_weight is None):
        raise BadInput("qk_norm_rope: q_weight and k_weight come together.", "Pass both or neither.")
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
    block_d = pow2(D)
    block_l = max(1, min(pow2(L), 4096 // block_d))
    with on_device(qkv):
        _qk_rope_kernel[(cdiv(L, block_l), B, heads)](
            sq, sk, sv, qw, kw, pe if pe is not None else qkv, q, k, v, L, total, offset, qkv.stride(1), pe_stride, eps,
            H=heads, D=D, BLOCK_D=block_d, BLOCK_L=block_l, HAS_NORM=q_weight is not None,
            HAS_PE=pe is not None, num_warps=4)


def qk_row_norm_rope(qkv: Sequence[torch.Tensor], heads: int, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, pe: torch.Tensor) -> None:
    """Write the three (B, L, heads * head_dim) projections q, k and v into out[0..2], each (B, L, heads, head_dim):
    q and k RMS-normalized over all heads' channels with q_weight and k_weight (heads * head_dim each: Wan's
    q/k norm), then rotated by pe (B|1, 1, L, head_dim / 2, 2, 2)."""
    sq, sk, sv = _sources(qkv, heads)
    require(sq, _row_norm_rope_kernel, "qk_row_norm_rope")
    B, L, D, total = _layout("qk_row_norm_rope", sq, heads, out)
    C = heads * D
    if total != L:
        raise BadInput(f"qk_row_norm_rope: the outputs hold {total} tokens; q, k and v have {L}.",
                       "Make the outputs with empty_qkv for these tokens.")
    for w in (q_weight, k_weight):
        if w.numel() != C or w.device != sq.device:
            raise BadInput(f"qk_row_norm_rope: a norm weight has {w.numel()} elements; rows have {C}.",
                           "Pass the RMSNorm weights over all heads.")
    if pe.dtype != torch.float32 or pe.shape[-4:] != (L, D // 2, 2, 2) or pe.shape[0] not in (1, B) \
            or pe.device != sq.device:
        raise BadInput(f"qk_row_norm_rope: pe has shape {tuple(pe.shape)} {pe.dtype}; expected float32 "
                       f"(B|1, 1, {L}, {D // 2}, 2, 2).", "Pass the rotary table of these tokens.")
    pe = pe.contiguous()
    if B * L == 0:
        return
    block_d = pow2(D)
    block_l = max(1, min(pow2(L), 4096 // block_d))
    with on_device(sq):
        _row_norm_rope_kernel[(cdiv(L, block_l), B)](
            sq, sk, sv, q_weight.contiguous(), k_weight.contiguous(), pe, *out, L, sq.stride(1),
            pe.stride(0) if pe.shape[0] > 1 else 0, eps, H=heads, D=D, BLOCK_D=block_d, BLOCK_L=block_l,
            num_warps=4)


def qk_norm_rope_ref(qkv: torch.Tensor, heads: int, q_weight: Optional[torch.Tensor] = None,
                     k_weight: Optional[torch.Tensor] = None, eps: float = 1e-6, pe: Optional[torch.Tensor] = None,
                     offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch reference: (q, k, v), each (B, L, heads, head_dim), as Flux's eager code computes them."""
    B, L, _ = qkv.shape
    q, k, v = qkv.reshape(B, L, 3, heads, -1).unbind(2)
    if q_weight is not None:
        q = torch.nn.functional.rms_norm(q, q_weight.shape, q_weight.to(q.dtype), eps)
        k = torch.nn.functional.rms_norm(k, k_weight.shape, k_weight.to(k.dtype), eps)
    if pe is not None:
        rows = pe[:, 0, offset:offset + L].unsqueeze(2)  # (B|1, L, 1, D/2, 2, 2)

        def rotate(t: torch.Tensor) -> torch.Tensor:
            t2 = t.float().reshape(*t.shape[:-1], -1, 1, 2)
            return (rows[..., 0] * t2[..., 0] + rows[..., 1] * t2[..., 1]).reshape(t.shape).to(t.dtype)

        q, k = rotate(q), rotate(k)
    return q.contiguous(), k.contiguous(), v.contiguous()


__all__ = ["qk_norm_rope", "qk_norm_rope_ref", "qk_row_norm_rope", "empty_qkv", "supported"]
