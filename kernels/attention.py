"""Attention without a mask, softmax(q k^T * scale) v, in one pass over the keys (FlashAttention's online softmax).

q, k and v come as (batch, tokens, heads, head_dim) views with any row and head strides and contiguous head
dimensions: the packed projections' output split per head, as the UNet's attention modules hold it, so nothing is
copied into (batch, heads, tokens, dim) first. The output is written (batch, tokens, heads, head_dim) contiguous,
which is (batch, tokens, heads * head_dim) for the output projection with no transpose.

Statistics and the output accumulate in fp32; the probabilities go to the second product in the input's dtype, as
every flash kernel does.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .common import cdiv, jit, on_device, pow2, require, supported_tensor, tl
from .errors import BadInput

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 128
# Key sets up to this long count as short (a text context of 77 tokens; `config`).
SHORT_KEYS = 128


@jit(do_not_specialize=("Lq",))
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, qk_scale, Lq, Lk, H,
                      sq_b, sq_l, sq_h, sk_b, sk_l, sk_h, sv_b, sv_l, sv_h, so_b, so_l, so_h,
                      HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      EVEN_N: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    dmask = rd < HEAD_D
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + h * sq_h + rm[:, None] * sq_l + rd[None, :],
                mask=(rm < Lq)[:, None] & dmask[None, :], other=0.0)
    k_rows = k_ptr + b.to(tl.int64) * sk_b + h * sk_h + rd[:, None]
    v_rows = v_ptr + b.to(tl.int64) * sv_b + h * sv_h + rd[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, Lk, BLOCK_N):
        cols = start + rn
        if EVEN_N:
            kt = tl.load(k_rows + cols[None, :] * sk_l, mask=dmask[:, None], other=0.0)
            v = tl.load(v_rows + cols[:, None] * sv_l, mask=dmask[None, :], other=0.0)
        else:
            kt = tl.load(k_rows + cols[None, :] * sk_l, mask=dmask[:, None] & (cols < Lk)[None, :], other=0.0)
            v = tl.load(v_rows + cols[:, None] * sv_l, mask=(cols < Lk)[:, None] & dmask[None, :], other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if not EVEN_N:
            s = tl.where((cols < Lk)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + b.to(tl.int64) * so_b + h * so_h + rm[:, None] * so_l + rd[None, :],
             out.to(o_ptr.dtype.element_ty), mask=(rm < Lq)[:, None] & dmask[None, :])


def supported(q: torch.Tensor) -> bool:
    """True when the Triton kernel can run on `q` (CUDA/ROCm, or CPU under TRITON_INTERPRET=1)."""
    return supported_tensor(q, _attention_kernel)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise BadInput(f"attention: q, k and v must be (batch, tokens, heads, head_dim), got shapes "
                       f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.",
                       "View the projections as (batch, tokens, heads, head_dim) before the call.")
    B, _, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != H or k.shape[3] != D:
        raise BadInput(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} do not match q {tuple(q.shape)} in "
                       "batch, heads and head size.",
                       "Pass keys and values of the same shape, with q's batch, heads and head_dim.")
    if k.shape[1] == 0:
        raise BadInput("attention: there are no keys (k has 0 tokens).", "Pass at least one key and value.")
    if D > MAX_HEAD_DIM:
        raise BadInput(f"attention: head_dim {D} is over the kernel's {MAX_HEAD_DIM}.",
                       "Use torch's scaled_dot_product_attention for larger heads.")
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        raise BadInput(f"attention: q, k and v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
                       f"{q.device}/{k.device}/{v.device}.", "Cast and move them to one dtype and device.")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise BadInput("attention: the head dimension of q, k and v must be contiguous (stride 1).",
                       "Call .contiguous() on a tensor whose last dimension is strided.")


def covers(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `attention` is the faster kernel for these (B, L, H, D) tensors: fp16/bf16 where `config` has a
    measured tile for their head size and key count."""
    return (supported(q) and q.dtype in (torch.float16, torch.bfloat16)
            and config(q.shape[-1], k.shape[1]) is not None)


def config(head_dim: int, keys: int) -> Optional[dict]:
    """Tiles for a head size and key count, or None where cuDNN's attention was measured the faster.

    Timed per call in a CUDA graph against cuDNN through SDPA (docs/perf-notes.md, Attention), the kernel wins for
    cross-attention over the text tokens with 64-wide heads (SDXL, SD2.x). Not where keys are many (self-attention:
    even or slower), nor for head sizes it must pad to a power of two (SD1.5's 40 to 64). The tiles were the best of
    18 configurations at SDXL's shapes."""
    if head_dim != 64 or keys > SHORT_KEYS:
        return None
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
              tiles: Optional[dict] = None) -> torch.Tensor:
    """softmax(q k^T * scale) v per batch and head, q (B, Lq, H, D), k and v (B, Lk, H, D) -> (B, Lq, H, D)
    contiguous. scale defaults to 1/sqrt(D)."""
    require(q, _attention_kernel, "attention")
    _check(q, k, v)
    B, Lq, H, D = q.shape
    Lk = k.shape[1]
    out = torch.empty((B, Lq, H, D), device=q.device, dtype=q.dtype)
    if out.numel() == 0:
        return out
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    t = dict(tiles or config(D, Lk) or dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2))
    if q.device.type == "cpu":  # the interpreter: fewer, larger programs
        t.update(BLOCK_M=max(t["BLOCK_M"], min(pow2(Lq), 256)), num_stages=1)
    block_n = t.pop("BLOCK_N")
    block_m = t.pop("BLOCK_M")
    grid = (cdiv(Lq, block_m), B * H)
    with on_device(q):
        _attention_kernel[grid](q, k, v, out, scale * LOG2E, Lq, Lk, H,
                                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                                v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                                HEAD_D=D, BLOCK_D=max(16, pow2(D)), BLOCK_M=block_m, BLOCK_N=block_n,
                                EVEN_N=Lk % block_n == 0,
                                # fp32 inputs get fp32 products (tl.dot's default for them is TF32, ~1e-3 off);
                                # None leaves each backend its default for fp16/bf16
                                PRECISION="ieee" if q.dtype == torch.float32 else None, **t)
    return out


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """The torch reference: scaled_dot_product_attention on (B, H, L, D) views, back to (B, Lq, H, D)."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           scale=scale)
    return out.transpose(1, 2).contiguous()


__all__ = ["attention", "attention_ref", "covers", "config", "supported"]
