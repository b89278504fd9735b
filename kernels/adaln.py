"""adaLN: LayerNorm without affine, then the diffusion transformer's modulation `LN(x) * (1 + scale) + shift`, in one
pass (or an RMS norm, LTX-2's without weight, Z-Image's with its weight, with or without the modulation); optionally
after the gated residual that precedes it, `s = x + gate * update` (Z-Image's: `x + gate * RMSNorm(update)`),
returning (y, s), s written over x where asked; y optionally quantized per row for the next product (e4m3 or int8).
And the gated residual alone, in place (`gated_add_`), where no norm follows in the same block.

In a DiT block (Flux, SD3/MMDiT) the attention output's gated residual feeds the MLP's modulated LayerNorm: one read
of x and the update gives both the new residual stream and the MLP's input. scale, shift and gate are per sample and
channel, (B, 1, C) or (B, C) views of the modulation projection's output (any batch stride, channels contiguous), or
per run of consecutive tokens, (B, T, C), spread over the L tokens as ComfyUI's repeat_e spreads Wan 2.2's
modulation. Wan's stream after the cross-attention takes its update ungated.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from .common import cdiv, jit, on_device, pow2, require, supported_tensor, tile_for, tl, warps
from .errors import BadInput
from .quant import to_int8

MAX_C = 16384
FP8 = torch.float8_e4m3fn


@jit(do_not_specialize=("M", "L"))
def _adaln_kernel(x_ptr, u_ptr, g_ptr, sc_ptr, sh_ptr, y_ptr, s_ptr, ys_ptr, w_ptr, uw_ptr, M, L, C, R, g_stride,
                  g_tstride, sc_stride, sc_tstride, sh_stride, sh_tstride, eps, u_eps, HAS_UPDATE: tl.constexpr,
                  HAS_GATE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr, RMS: tl.constexpr,
                  OUT_FP8: tl.constexpr, OUT_INT8: tl.constexpr, HAS_WEIGHT: tl.constexpr, UPDATE_RMS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, BLOCK_C)[None, :]
    mask = (rows < M) & (cols < C)
    off = rows.to(tl.int64) * C + cols
    batch, run = rows // L, (rows % L) // R
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if HAS_UPDATE:
        u = tl.load(u_ptr + off, mask=mask, other=0.0).to(tl.float32)
        if UPDATE_RMS:  # the update's own RMSNorm with its weight (Z-Image's post-norm), before the gate
            u *= tl.rsqrt(tl.sum(u * u, 1) / C + u_eps)[:, None]
            u *= tl.load(uw_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
        if HAS_GATE:
            u *= tl.load(g_ptr + batch * g_stride + run * g_tstride + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + u).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + off, s, mask=mask)
        x = s.to(tl.float32)  # normalize the stream as stored, so that (y, s) are consistent
    if RMS:
        d = x
    else:
        d = tl.where(mask, x - (tl.sum(x, 1) / C)[:, None], 0.0)
    y = d * tl.rsqrt(tl.sum(d * d, 1) / C + eps)[:, None]
    if HAS_WEIGHT:
        y *= tl.load(w_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
    if HAS_SCALE:
        y *= 1.0 + tl.load(sc_ptr + batch * sc_stride + run * sc_tstride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHIFT:
        y += tl.load(sh_ptr + batch * sh_stride + run * sh_tstride + cols, mask=mask, other=0.0).to(tl.float32)
    if OUT_FP8:  # each row scaled to e4m3's range, as kernels/quant.py's quantize_rows does
        row_scale = tl.maximum(tl.max(tl.where(mask, tl.abs(y), 0.0), 1) / 448.0, 1e-12)
        y = tl.clamp(y / row_scale[:, None], -448.0, 448.0)
        tl.store(ys_ptr + rows, row_scale[:, None], mask=rows < M)
    if OUT_INT8:  # each row on 127 steps, rounded half away from zero, as kernels/quant.py's int8 rows
        row_scale = tl.maximum(tl.max(tl.where(mask, tl.abs(y), 0.0), 1) * (1.0 / 127.0), 1e-12)
        y = to_int8(y * tl.math.div_rn(1.0, row_scale)[:, None])
        tl.store(ys_ptr + rows, row_scale[:, None], mask=rows < M)
    tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=mask)


@jit(do_not_specialize=("M", "L"))
def _gated_add_kernel(x_ptr, u_ptr, u2_ptr, g_ptr, M, L, C, R, g_stride, g_tstride, HAS_U2: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (rows < M) & (cols < C)
    off = rows.to(tl.int64) * C + cols
    g = tl.load(g_ptr + (rows // L) * g_stride + ((rows % L) // R) * g_tstride + cols, mask=mask,
                other=0.0).to(tl.float32)
    u = tl.load(u_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if HAS_U2:
        u += tl.load(u2_ptr + off, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + off, (x + g * u).to(x_ptr.dtype.element_ty), mask=mask)


def supported(x: torch.Tensor) -> bool:
    """True when the kernel can run on x (CUDA/ROCm, or CPU under TRITON_INTERPRET=1) and its rows fit."""
    return supported_tensor(x, _adaln_kernel) and x.dim() == 3 and 0 < x.shape[-1] <= MAX_C


def _modulation(t: Optional[torch.Tensor], name: str, x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """A modulation tensor, per sample ((B|1, 1, C) or (B|1, C)) or per run of tokens ((B|1, T, C), Wan 2.2), as
    (tensor with contiguous channels, batch stride, run stride, T)."""
    if t is None:
        return x, 0, 0, 1
    B, _, C = x.shape
    v = t.unsqueeze(1) if t.dim() == 2 else t
    if v.dim() != 3 or v.shape[2] != C or v.shape[0] not in (1, B) or v.device != x.device:
        raise BadInput(f"adaln: {name} has shape {tuple(t.shape)} on {t.device}; expected (B, 1, {C}), (B, {C}) or "
                       f"(B, tokens, {C}) with B 1 or {B}, on {x.device}.",
                       f"Pass the modulation's {name} for each sample, or for each run of tokens.")
    if v.stride(2) != 1:
        v = v.contiguous()
    T = v.shape[1]
    return v, (v.stride(0) if v.shape[0] > 1 else 0), (v.stride(1) if T > 1 else 0), T


def _run_length(L: int, *runs: int) -> int:
    """How many consecutive tokens of L share a row of a modulation with T rows: ComfyUI's repeat_e (Wan) repeats each
    row L // T times, or once more and cuts the end where T does not divide L. Every per-token modulation of a call
    has the same T."""
    T = max(runs)
    if any(r not in (1, T) for r in runs):
        raise BadInput(f"adaln: the modulations have {sorted(set(runs))} rows; per-token ones must have the same.",
                       "Pass the chunks of one modulation.")
    per = L // T
    return per if per * T == L and per else per + 1


def modulated_layer_norm(x: torch.Tensor, scale: Optional[torch.Tensor], shift: Optional[torch.Tensor],
                         eps: float = 1e-6, update: Optional[torch.Tensor] = None, gate: Optional[torch.Tensor] = None,
                         out_fp8: bool = False, rms: bool = False, in_place: bool = False,
                         weight: Optional[torch.Tensor] = None, update_weight: Optional[torch.Tensor] = None,
                         update_eps: float = 1e-6, out_int8: bool = False) -> Union[torch.Tensor, tuple]:
    """LN(x) * (1 + scale) + shift over the last dim of x (B, L, C) (no scale or shift when None; with rms, the
    norm divides by the RMS alone, as RMSNorm; times `weight` (C,) before the modulation where given: RMSNorm's own
    weight); with `update` (and `gate`), s = x + (gate *) update first and returns (LN(s) * (1 + scale) + shift, s), s
    written into x with in_place (x contiguous); with update_weight (C,), the update is RMS-normalized with that weight
    and update_eps first (Z-Image's post-norm: s = x + gate * RMSNorm(update)). With out_fp8 (CUDA only: the Triton
    interpreter converts to fp8 wrongly) the normalized output comes quantized for an fp8 matrix product, as (e4m3 rows
    (B * L, C), float32 row scales (B * L, 1)) in place of the tensor; with out_int8 likewise as int8 rows (each row's
    largest magnitude to 127, rounded half away from zero: kernels/quant.py's int8 rows)."""
    require(x, _adaln_kernel, "modulated_layer_norm")
    if out_fp8 and x.device.type != "cuda":
        raise BadInput("modulated_layer_norm: out_fp8 runs on CUDA only (the Triton interpreter converts to fp8 "
                       "wrongly).", "Quantize modulated_layer_norm_ref's output on the CPU.")
    if out_fp8 and out_int8:
        raise BadInput("modulated_layer_norm: out_fp8 and out_int8 are two formats; it writes one.", "Pass one.")
    C = x.shape[-1]
    for name, w in (("weight", weight), ("update_weight", update_weight)):
        if w is not None and (w.shape != (C,) or w.device != x.device or not w.is_contiguous()):
            raise BadInput(f"modulated_layer_norm: {name} has shape {tuple(w.shape)} on {w.device}; it takes ({C},) "
                           f"contiguous on {x.device}.", f"Pass the norm's weight of {C} channels.")
    if update_weight is not None and update is None:
        raise BadInput("modulated_layer_norm: update_weight normalizes an update.", "Pass the update, or no weight.")
    if x.dim() != 3 or not 0 < x.shape[-1] <= MAX_C:
        raise BadInput(f"modulated_layer_norm: x has shape {tuple(x.shape)}; it takes (batch, tokens, channels) with "
                       f"up to {MAX_C} channels.", "Use modulated_layer_norm_ref (torch) for this tensor.")
    if update is None and gate is not None:
        raise BadInput("modulated_layer_norm: a gate goes with an update.", "Pass the update it gates, or no gate.")
    if in_place and (update is None or not x.is_contiguous()):
        raise BadInput("modulated_layer_norm: in_place writes x + (gate *) update into a contiguous x.",
                       "Pass an update and a contiguous x, or leave in_place off.")
    if update is not None and (update.shape != x.shape or update.dtype != x.dtype or update.device != x.device):
        raise BadInput(f"modulated_layer_norm: update {tuple(update.shape)} {update.dtype} does not match x "
                       f"{tuple(x.shape)} {x.dtype}.", "Pass an update of x's shape, dtype and device.")
    B, L, C = x.shape
    sc, sc_stride, sc_tstride, sc_runs = _modulation(scale, "scale", x)
    sh, sh_stride, sh_tstride, sh_runs = _modulation(shift, "shift", x)
    g, g_stride, g_tstride, g_runs = _modulation(gate, "gate", x)
    R = _run_length(L, sc_runs, sh_runs, g_runs)
    x = x.contiguous()
    u = update.contiguous() if update is not None else x
    M = B * L
    rows = out_fp8 or out_int8
    y = torch.empty(M, C, device=x.device, dtype=FP8 if out_fp8 else torch.int8) if rows else torch.empty_like(x)
    ys = torch.empty(M, 1, device=x.device, dtype=torch.float32) if rows else y
    s = torch.empty_like(x) if update is not None and not in_place else x
    if M:
        block_c = pow2(C)
        block_m = min(pow2(M), max(1, tile_for(x) // block_c))
        with on_device(x):
            _adaln_kernel[(cdiv(M, block_m),)](
                x, u, g, sc, sh, y, s, ys, x if weight is None else weight,
                x if update_weight is None else update_weight, M, L, C, R, g_stride, g_tstride, sc_stride,
                sc_tstride, sh_stride, sh_tstride, eps, update_eps, HAS_UPDATE=update is not None,
                HAS_GATE=gate is not None, HAS_SCALE=scale is not None, HAS_SHIFT=shift is not None, RMS=rms,
                OUT_FP8=out_fp8, OUT_INT8=out_int8, HAS_WEIGHT=weight is not None,
                UPDATE_RMS=update_weight is not None, BLOCK_M=block_m, BLOCK_C=block_c,
                num_warps=warps(block_m * block_c, 32))
    out = (y, ys) if rows else y
    return (out, s) if update is not None else out


def gated_add_(x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
               update2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x += gate * update in place (gate * (update + update2) with a second update: a projection computed in two
    parts), for x and the updates (B, L, C) and a gate per sample, (B, 1, C) or (B, C), or per run of tokens
    (B, T, C): the gated residual, as one
    vectorized pass (torch's addcmul_ with a broadcast gate takes its slow strided path)."""
    require(x, _gated_add_kernel, "gated_add_")
    if x.dim() != 3 or update.shape != x.shape or not x.is_contiguous() \
            or (update2 is not None and update2.shape != x.shape):
        raise BadInput(f"gated_add_: x {tuple(x.shape)} (contiguous: {x.is_contiguous()}) and update "
                       f"{tuple(update.shape)} must be the same contiguous (batch, tokens, channels) tensors.",
                       "Use x.addcmul_(gate, update) for other layouts.")
    B, L, C = x.shape
    g, g_stride, g_tstride, runs = _modulation(gate, "gate", x)
    u = update.contiguous()
    u2 = update2.contiguous() if update2 is not None else u
    M = B * L
    if M and C:
        block_c = min(pow2(C), 1024)
        block_m = min(pow2(M), max(1, tile_for(x) // block_c))
        with on_device(x):
            _gated_add_kernel[(cdiv(M, block_m), cdiv(C, block_c))](
                x, u, u2, g, M, L, C, _run_length(L, runs), g_stride, g_tstride, HAS_U2=update2 is not None,
                BLOCK_M=block_m, BLOCK_C=block_c, num_warps=warps(block_m * block_c))
    return x


def modulated_layer_norm_ref(x: torch.Tensor, scale: Optional[torch.Tensor], shift: Optional[torch.Tensor],
                             eps: float = 1e-6, update: Optional[torch.Tensor] = None,
                             gate: Optional[torch.Tensor] = None, rms: bool = False,
                             weight: Optional[torch.Tensor] = None, update_weight: Optional[torch.Tensor] = None,
                             update_eps: float = 1e-6) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The torch reference of `modulated_layer_norm` (computed in float32, rounded once; its 16-bit output, which
    kernels/quant.py's references quantize)."""
    L = x.shape[1]

    def view(t: torch.Tensor) -> torch.Tensor:  # (B|1, L|1, C): per-token rows spread as the kernel spreads them
        t = t.unsqueeze(1) if t.dim() == 2 else t
        if t.shape[1] > 1:
            t = t[:, torch.arange(L, device=t.device) // _run_length(L, t.shape[1])]
        return t.float()

    if update is not None:
        u = update.float()
        if update_weight is not None:
            u = F.rms_norm(u, (x.shape[-1],), update_weight.float(), eps=update_eps)
        s = (x.float() + (u if gate is None else view(gate) * u)).to(x.dtype)
    else:
        s = x
    y = (F.rms_norm if rms else F.layer_norm)(s.float(), (x.shape[-1],), eps=eps)
    if weight is not None:
        y = y * weight.float()
    if scale is not None:
        y = y * (1 + view(scale))
    if shift is not None:
        y = y + view(shift)
    return y.to(x.dtype) if update is None else (y.to(x.dtype), s)


__all__ = ["modulated_layer_norm", "modulated_layer_norm_ref", "gated_add_", "supported"]
