"""GroupNorm with optional fused SiLU, for NCHW and channels_last (NHWC) tensors.

Small groups (a UNet's lower levels) take one launch: `_group_norm_whole_kernel` holds a whole group in one program's
registers, one read and one write. Larger groups are split, in two passes over memory and three launches:
pass 1 (`_stats_*`) cuts x into chunks and reduces each chunk, in parallel, to partials (count, mean, M2): one per
group for NCHW, where a group is one contiguous run, and one per channel for channels_last, whose tiles are rows of
whole cache lines across 64 channels; `_finalize_kernel` merges a group's partials (Chan et al.) into mean and
rstd; pass 2 (`_apply_*`) normalizes. x is read twice and the output written once, whatever the group size: a VAE
decoder at 4096 px has 64M elements in a group, far more than one program could hold. Means and M2 are merged,
never raw sums of squares, so a large offset (x = 1000 + noise) does not cancel away the variance in fp32.

The tiled VAE needs statistics over the whole image but normalizes tile by tile: it calls `group_norm_stats` on each
tile, adds the results, turns them into mean and rstd with `mean_rstd`, and calls `group_norm_apply` per tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .common import cdiv, jit, on_device, pow2, require, supported_tensor, tile_for, tl, warps
from .errors import BadInput

# A chunk reduced by one stats program holds at least this many elements (fewer only when the group is smaller).
MIN_CHUNK = 4096
# Programs to aim for: two per SM of a large GPU for the stats pass, whose programs each end in one reduction (more
# programs, hence more partials to merge, were slower at most UNet shapes), many more for the apply pass.
STATS_PROGRAMS = 264
APPLY_PROGRAMS = 4096
# Partials one finalize program holds (all of a group's, for as many groups as fit): more, smaller programs finish
# sooner than a few looping ones.
FINALIZE_TILE = 1024
# channels_last: channels per tile row (whole 128-byte lines of fp16), and at most this many per-channel partials
# per group (chunks x channels of a group), which the finalize kernel loads as one tile.
MAX_BLOCK_C = 64
MAX_GROUP_ENTRIES = 512
# Loads the channels_last passes keep in flight (Triton's loop pipelining): 4 stages for the statistics and 2 for the
# normalization were faster than none at most UNet and VAE sizes and slower at none (per call, in a CUDA graph).
STATS_STAGES = 4
APPLY_STAGES = 2
# Elements per thread in the channels_last passes' tiles: 32 (4 warps for a 4096-element tile) rather than 16: faster
# at every UNet size measured and even or better at the VAE's (per call, in a CUDA graph).
NHWC_ELEMS_PER_THREAD = 32
# Under the CPU interpreter every program costs Python time: few, large programs.
INTERPRET_PROGRAMS = 1
# Groups of at most WHOLE_GROUP_ELEMENTS (pixels x channels of the group) are normalized by one program each, in one
# launch, if their tile (both counts padded to powers of two) fits WHOLE_GROUP_MAX. Up to that size one launch beats
# the split passes' three, whose launch costs outweigh the data a small group moves; above it (30720 per group and
# more) one program's share of the bandwidth is the limit and the split passes win.
WHOLE_GROUP_ELEMENTS = 20480
WHOLE_GROUP_MAX = 32768


@jit
def _merge(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    n = n_a + n_b
    w = tl.where(n > 0, n_b / tl.maximum(n, 1.0), 0.0)
    delta = mean_b - mean_a
    return n, mean_a + delta * w, m2_a + m2_b + delta * delta * n_a * w


@jit
def _stats_nchw_kernel(x_ptr, part_ptr, NG, group_len, span, P, BLOCK_GRP: tl.constexpr, BLOCK: tl.constexpr):
    # NCHW: the group n*G+g is one contiguous run of Cg*HW elements; a tile holds BLOCK_GRP of them (more than one
    # only when groups are small) and BLOCK elements of each.
    rows = tl.program_id(0) * BLOCK_GRP + tl.arange(0, BLOCK_GRP)
    rmask = rows < NG
    p = tl.program_id(1)
    row_ptr = x_ptr + rows.to(tl.int64)[:, None] * group_len
    start = p * span
    end = tl.minimum(start + span, group_len)
    offs = tl.arange(0, BLOCK)[None, :]
    n_acc = tl.zeros([BLOCK_GRP], tl.float32)
    mean_acc = tl.zeros([BLOCK_GRP], tl.float32)
    m2_acc = tl.zeros([BLOCK_GRP], tl.float32)
    for i in range(start, end, BLOCK):
        mask = rmask[:, None] & (i + offs < end)
        x = tl.load(row_ptr + i + offs, mask=mask, other=0.0).to(tl.float32)
        cnt = tl.sum(mask.to(tl.float32), 1)
        mean_b = tl.sum(x, 1) / tl.maximum(cnt, 1.0)
        d = tl.where(mask, x - mean_b[:, None], 0.0)
        n_acc, mean_acc, m2_acc = _merge(n_acc, mean_acc, m2_acc, cnt, mean_b, tl.sum(d * d, 1))
    out = part_ptr + (rows * P + p) * 3
    tl.store(out, n_acc, mask=rmask)
    tl.store(out + 1, mean_acc, mask=rmask)
    tl.store(out + 2, m2_acc, mask=rmask)


@jit(do_not_specialize=("HW", "rows_per_prog", "P"))
def _stats_nhwc_kernel(x_ptr, sh_ptr, sb_ptr, part_ptr, HW, C, rows_per_prog, P, sh_stride,
                       HAS_SHIFT: tl.constexpr, SHIFT_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                       STAGES: tl.constexpr):
    # NHWC: rows of C channels, read as [rows, BLOCK_C] tiles of whole cache lines. A program reduces its rows of
    # one sample to a (count, mean, M2) per channel (the finalize kernel merges a group's channels and chunks).
    # The loop only adds up deviations from the chunk's first row and their squares, element by element, and
    # reduces once after it; deviations from a value of the same channel stay of the order of the spread, so
    # the squares do not cancel when |mean| >> std.
    p = tl.program_id(0)
    n = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    r = tl.arange(0, BLOCK_R)[:, None]
    r0 = p * rows_per_prog
    r1 = tl.minimum(r0 + rows_per_prog, HW)
    x_ptr += n.to(tl.int64) * HW * C
    ref = tl.load(x_ptr + r0.to(tl.int64) * C + cols, mask=cmask, other=0.0).to(tl.float32)
    tile = r * C + cols[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    acc_sq = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for i in tl.range(0, r1 - r0, BLOCK_R, num_stages=STAGES):
        # i is a Python int under the interpreter: offset from the tensor r0 before widening to int64.
        row = r0 + i
        mask = (row + r < r1) & cmask[None, :]
        x = tl.load(x_ptr + row.to(tl.int64) * C + tile, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - ref[None, :], 0.0)
        acc += d
        acc_sq += d * d
    rows = (r1 - r0).to(tl.float32)
    total = tl.sum(acc, 0)
    mean = ref + total / rows
    if HAS_SHIFT:  # the same for every pixel of a channel: it moves the mean, not the deviations
        mean += tl.load(sh_ptr + n * sh_stride + cols, mask=cmask, other=0.0).to(tl.float32)
        if SHIFT_BIAS:
            mean += tl.load(sb_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    out = part_ptr + ((n * P + p) * C + cols) * 3
    tl.store(out, tl.zeros_like(mean) + rows, mask=cmask)
    tl.store(out + 1, mean, mask=cmask)
    tl.store(out + 2, tl.maximum(tl.sum(acc_sq, 0) - total * total / rows, 0.0), mask=cmask)


@jit(do_not_specialize=("NG", "E"))
def _finalize_kernel(part_ptr, mean_ptr, rstd_ptr, NG, G, E, stride_n, stride_g, stride_p, eps, PER_CHUNK: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    # Merge the E (<= BLOCK_E) partials of each group (sample n, group g) from one load of them: entry e is
    # chunk e // PER_CHUNK, channel e % PER_CHUNK of the group (NHWC partials are per channel, NCHW per group).
    # Deviations are taken from the first partial's mean, so the weighted sum stays small when the mean is large.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.arange(0, BLOCK_E)[None, :]
    m = (rows < NG)[:, None] & (e < E)
    base = (rows // G).to(tl.int64) * stride_n + (rows % G) * stride_g
    ptr = part_ptr + base[:, None] + (e // PER_CHUNK) * stride_p + (e % PER_CHUNK) * 3
    cnt = tl.load(ptr, mask=m, other=0.0)
    mu = tl.load(ptr + 1, mask=m, other=0.0)
    m2 = tl.load(ptr + 2, mask=m, other=0.0)
    shift = tl.sum(tl.where(e == 0, mu, 0.0), 1)
    total = tl.maximum(tl.sum(cnt, 1), 1.0)
    mean = shift + tl.sum(cnt * (mu - shift[:, None]), 1) / total
    dev = tl.where(m, mu - mean[:, None], 0.0)
    var = tl.sum(m2 + cnt * dev * dev, 1) / total
    tl.store(mean_ptr + rows, mean, mask=rows < NG)
    tl.store(rstd_ptr + rows, tl.rsqrt(var + eps), mask=rows < NG)


@jit
def _silu(y):
    return y / (1.0 + tl.exp(-y))


@jit
def _apply_nchw_kernel(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, C, HW, G, hw_per_prog, CG: tl.constexpr,
                       HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr, BLOCK_CH: tl.constexpr,
                       BLOCK_HW: tl.constexpr):
    # Tile [channels, pixels]; several channels per tile when HW is small, one channel and a pixel range otherwise.
    p = tl.program_id(0)
    n = tl.program_id(1)
    c0 = tl.program_id(2) * BLOCK_CH
    cs = c0 + tl.arange(0, BLOCK_CH)
    cmask = cs < C
    scale = tl.load(rstd_ptr + n * G + cs // CG, mask=cmask, other=0.0)
    if HAS_W:
        scale = scale * tl.load(w_ptr + cs, mask=cmask, other=0.0).to(tl.float32)
    shift = -tl.load(mean_ptr + n * G + cs // CG, mask=cmask, other=0.0) * scale
    if HAS_B:
        shift = shift + tl.load(b_ptr + cs, mask=cmask, other=0.0).to(tl.float32)
    scale = scale[:, None]
    shift = shift[:, None]
    base = (n.to(tl.int64) * C + c0) * HW
    x_ptr += base
    y_ptr += base
    rows = tl.arange(0, BLOCK_CH)[:, None] * HW
    hw = tl.arange(0, BLOCK_HW)[None, :]
    h0 = p * hw_per_prog
    h1 = tl.minimum(h0 + hw_per_prog, HW)
    for i in range(h0, h1, BLOCK_HW):
        mask = cmask[:, None] & (i + hw < h1)
        off = rows + i + hw
        y = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32) * scale + shift
        if SILU:
            y = _silu(y)
        tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=mask)


@jit(do_not_specialize=("HW", "rows_per_prog"))
def _apply_nhwc_kernel(x_ptr, y_ptr, w_ptr, b_ptr, sh_ptr, sb_ptr, mean_ptr, rstd_ptr, HW, C, G, rows_per_prog,
                       sh_stride, CG: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_SHIFT: tl.constexpr,
                       SHIFT_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                       STAGES: tl.constexpr):
    # y = x * scale + shift per channel, both made once per program from its channels' group statistics.
    p = tl.program_id(0)
    n = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    grp = n * G + cols // CG
    scale = tl.load(rstd_ptr + grp, mask=cmask, other=0.0)
    if HAS_W:
        scale = scale * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    shift = -tl.load(mean_ptr + grp, mask=cmask, other=0.0) * scale
    if HAS_B:
        shift = shift + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_SHIFT:  # (x + sh) * scale + shift
        sh = tl.load(sh_ptr + n * sh_stride + cols, mask=cmask, other=0.0).to(tl.float32)
        if SHIFT_BIAS:
            sh += tl.load(sb_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        shift = shift + sh * scale
    scale = scale[None, :]
    shift = shift[None, :]
    r = tl.arange(0, BLOCK_R)[:, None]
    tile = r * C + cols[None, :]
    r0 = p * rows_per_prog
    r1 = tl.minimum(r0 + rows_per_prog, HW)
    x_ptr += n.to(tl.int64) * HW * C
    y_ptr += n.to(tl.int64) * HW * C
    for i in tl.range(0, r1 - r0, BLOCK_R, num_stages=STAGES):
        mask = (r0 + i + r < r1) & cmask[None, :]
        row = (r0 + i).to(tl.int64) * C
        y = tl.load(x_ptr + row + tile, mask=mask, other=0.0).to(tl.float32) * scale + shift
        if SILU:
            y = _silu(y)
        tl.store(y_ptr + row + tile, y.to(y_ptr.dtype.element_ty), mask=mask)


@jit(do_not_specialize=("HW",))
def _group_norm_whole_kernel(x_ptr, y_ptr, w_ptr, b_ptr, sh_ptr, sb_ptr, HW, C, stride_r, stride_c, sh_stride, eps,
                             CG: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_SHIFT: tl.constexpr,
                             SHIFT_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_G: tl.constexpr):
    # One program per (group, sample) holding the whole group, [pixels, channels of the group], in registers:
    # statistics (two passes over registers, exact) and normalization in one launch, for the small groups of a
    # UNet's lower levels, where three launches cost more than the data they move.
    g = tl.program_id(0)
    n = tl.program_id(1)
    cols = g * CG + tl.arange(0, BLOCK_G)
    cmask = tl.arange(0, BLOCK_G) < CG
    r = tl.arange(0, BLOCK_R)[:, None]
    mask = (r < HW) & cmask[None, :]
    offs = n.to(tl.int64) * HW * C + r * stride_r + cols[None, :] * stride_c
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHIFT:
        sh = tl.load(sh_ptr + n * sh_stride + cols, mask=cmask, other=0.0).to(tl.float32)
        if SHIFT_BIAS:
            sh += tl.load(sb_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        x = tl.where(mask, x + sh[None, :], 0.0)
    count = HW * CG
    mean = tl.sum(tl.sum(x, 1), 0) / count
    d = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(tl.sum(d * d, 1), 0) / count + eps)
    scale = tl.zeros([BLOCK_G], tl.float32) + rstd
    if HAS_W:
        scale = scale * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = d * scale[None, :]
    if HAS_B:
        y += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if SILU:
        y = _silu(y)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def supported(x: torch.Tensor) -> bool:
    """True when the Triton kernels can run on `x` (CUDA/ROCm, or CPU under TRITON_INTERPRET=1)."""
    return supported_tensor(x, _apply_nhwc_kernel)


def _check(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> None:
    require(x, _apply_nhwc_kernel, "group_norm")
    if x.dim() < 3:
        raise BadInput(f"group_norm: expected (N, C, ...) with spatial dims, got shape {tuple(x.shape)}.",
                       "Pass a 4-D (N, C, H, W) tensor.")
    C = x.shape[1]
    if num_groups <= 0 or C % num_groups:
        raise BadInput(f"group_norm: {C} channels cannot be split into {num_groups} groups.",
                       "Use a num_groups that divides the channel count (SD uses 32).")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.numel() != C or t.device != x.device):
            raise BadInput(f"group_norm: {name} has {t.numel()} elements on {t.device}, expected {C} on {x.device}.",
                           f"Pass the GroupNorm module's {name} for this tensor's channels, on the same device.")


def _format(x: torch.Tensor) -> torch.memory_format:
    """channels_last when x is laid out so (and not also plain contiguous), else contiguous: what the output gets."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _layout(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(x in a layout the kernels read, copied only when it is in neither, True when that layout is NHWC)."""
    fmt = _format(x)
    return x.contiguous(memory_format=fmt), fmt == torch.channels_last


def _programs(x: torch.Tensor, normal: int) -> int:
    return INTERPRET_PROGRAMS if x.device.type == "cpu" else normal


def _nhwc_tile(C: int, HW: int, tile: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) for the channels_last tiles: the widest power of two up to MAX_BLOCK_C channels that
    divides C (SD's channel counts are multiples of 64), so that no lane is masked off."""
    block_c = min(MAX_BLOCK_C, C & -C)
    return min(pow2(HW), max(1, tile // block_c)), block_c


@dataclass
class _Partials:
    """(count, mean, M2) triples, fp32: per group and chunk (NCHW), or per channel and chunk (NHWC), with the
    strides (in floats) that the finalize kernel walks a group's entries by."""
    data: torch.Tensor
    N: int
    G: int
    entries: int  # per group: chunks x channels of the group
    per_chunk: int  # channels of a group that each chunk has a triple for (1 for NCHW)
    stride_n: int
    stride_g: int
    stride_p: int

    def per_group(self) -> torch.Tensor:
        """The triples as (N*G, entries, 3)."""
        if self.per_chunk == 1:
            return self.data.view(self.N * self.G, self.entries, 3)
        P = self.entries // self.per_chunk
        return (self.data.view(self.N, P, self.G, self.per_chunk, 3).permute(0, 2, 1, 3, 4)
                .reshape(self.N * self.G, self.entries, 3))


def _partials(x: torch.Tensor, G: int, nhwc: bool, shift: Optional[torch.Tensor] = None,
              shift_bias: Optional[torch.Tensor] = None) -> _Partials:
    """Pass 1: the partial statistics of x (+ shift (N, C) + shift_bias (C,), NHWC only)."""
    N, C = x.shape[:2]
    HW = x.numel() // (N * C)
    CG = C // G
    target = _programs(x, STATS_PROGRAMS)
    if nhwc:
        block_r, block_c = _nhwc_tile(C, HW, tile_for(x))
        n_cb = cdiv(C, block_c)
        P = max(1, min(cdiv(target, N * n_cb), cdiv(HW, block_r), MAX_GROUP_ENTRIES // CG))
        rows = cdiv(cdiv(HW, P), block_r) * block_r
        P = cdiv(HW, rows)
        part = torch.empty((N, P, C, 3), device=x.device, dtype=torch.float32)
        _stats_nhwc_kernel[(P, N, n_cb)](x, shift if shift is not None else x,
                                         shift_bias if shift_bias is not None else x, part, HW, C, rows, P,
                                         shift.stride(0) if shift is not None else 0,
                                         HAS_SHIFT=shift is not None, SHIFT_BIAS=shift_bias is not None,
                                         BLOCK_R=block_r, BLOCK_C=block_c, STAGES=STATS_STAGES,
                                         num_warps=warps(block_r * block_c, NHWC_ELEMS_PER_THREAD))
        return _Partials(part, N, G, P * CG, CG, P * C * 3, CG * 3, C * 3)
    L = CG * HW
    block = min(pow2(L), tile_for(x))
    block_grp = min(pow2(N * G), max(1, tile_for(x) // block))
    n_rb = cdiv(N * G, block_grp)
    P = max(1, min(cdiv(target, n_rb), cdiv(L, MIN_CHUNK)))
    span = cdiv(cdiv(L, P), block) * block
    P = cdiv(L, span)
    part = torch.empty((N * G, P, 3), device=x.device, dtype=torch.float32)
    _stats_nchw_kernel[(n_rb, P)](x, part, N * G, L, span, P, BLOCK_GRP=block_grp, BLOCK=block,
                                  num_warps=warps(block_grp * block))
    return _Partials(part, N, G, P, 1, G * P * 3, P * 3, 3)


def _finalize(part: _Partials, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, rstd), each (N*G,) fp32, from the partials."""
    NG = part.N * part.G
    block_e = pow2(part.entries)
    block_n = min(pow2(NG), max(1, FINALIZE_TILE // block_e))
    mean = torch.empty(NG, device=part.data.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    # Not fewer than 4 warps: with one warp, Triton 3.6 on an H100 computed wrong means for some tiles (64 groups x 8
    # partials of unequal counts: mean off by up to 0.2, while 2 and 4 warps were exact).
    _finalize_kernel[(cdiv(NG, block_n),)](part.data, mean, rstd, NG, part.G, part.entries, part.stride_n,
                                           part.stride_g, part.stride_p, eps, PER_CHUNK=part.per_chunk,
                                           BLOCK_N=block_n, BLOCK_E=block_e, num_warps=max(4, warps(block_n * block_e)))
    return mean, rstd


def _whole_groups(x: torch.Tensor, nhwc: bool, G: int, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                  silu: bool, eps: float, shift: Optional[torch.Tensor],
                  shift_bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """GroupNorm in one launch of one program per group and sample, or None when the groups are too large."""
    N, C = x.shape[:2]
    HW = x.numel() // (N * C)
    CG = C // G
    block_r, block_g = pow2(HW), pow2(CG)
    if HW * CG > WHOLE_GROUP_ELEMENTS or block_r * block_g > WHOLE_GROUP_MAX:
        return None
    y = torch.empty_like(x, memory_format=torch.channels_last if nhwc else torch.contiguous_format)
    stride_r, stride_c = (C, 1) if nhwc else (1, HW)
    _group_norm_whole_kernel[(G, N)](
        x, y, weight if weight is not None else x, bias if bias is not None else x,
        shift if shift is not None else x, shift_bias if shift_bias is not None else x, HW, C, stride_r, stride_c,
        shift.stride(0) if shift is not None else 0, eps, CG=CG, HAS_W=weight is not None, HAS_B=bias is not None,
        HAS_SHIFT=shift is not None, SHIFT_BIAS=shift_bias is not None, SILU=silu, BLOCK_R=block_r, BLOCK_G=block_g,
        num_warps=warps(block_r * block_g, per_thread=32))
    return y


def _apply(x: torch.Tensor, nhwc: bool, G: int, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
           silu: bool, mean: torch.Tensor, rstd: torch.Tensor, shift: Optional[torch.Tensor] = None,
           shift_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pass 2: normalize x (+ shift + shift_bias, NHWC only) with mean and rstd, (N*G,) fp32 each, then weight,
    bias and SiLU."""
    N, C = x.shape[:2]
    HW = x.numel() // (N * C)
    CG = C // G
    y = torch.empty_like(x, memory_format=torch.channels_last if nhwc else torch.contiguous_format)
    w = weight.contiguous() if weight is not None else x
    b = bias.contiguous() if bias is not None else x
    flags = dict(CG=CG, HAS_W=weight is not None, HAS_B=bias is not None, SILU=silu)
    target = _programs(x, APPLY_PROGRAMS)
    if nhwc:
        block_r, block_c = _nhwc_tile(C, HW, tile_for(x))
        n_cb = cdiv(C, block_c)
        progs = max(1, min(cdiv(target, N * n_cb), cdiv(HW, block_r)))
        rows = cdiv(cdiv(HW, progs), block_r) * block_r
        _apply_nhwc_kernel[(cdiv(HW, rows), N, n_cb)](
            x, y, w, b, shift if shift is not None else x, shift_bias if shift_bias is not None else x, mean, rstd,
            HW, C, G, rows, shift.stride(0) if shift is not None else 0, HAS_SHIFT=shift is not None,
            SHIFT_BIAS=shift_bias is not None, BLOCK_R=block_r, BLOCK_C=block_c, STAGES=APPLY_STAGES,
            num_warps=warps(block_r * block_c, NHWC_ELEMS_PER_THREAD), **flags)
        return y
    block_hw = min(pow2(HW), tile_for(x))
    block_ch = min(pow2(C), max(1, tile_for(x) // block_hw))
    n_cb = cdiv(C, block_ch)
    progs = max(1, min(cdiv(target, N * n_cb), cdiv(HW, block_hw)))
    span = cdiv(cdiv(HW, progs), block_hw) * block_hw
    _apply_nchw_kernel[(cdiv(HW, span), N, n_cb)](
        x, y, w, b, mean, rstd, C, HW, G, span, BLOCK_CH=block_ch, BLOCK_HW=block_hw,
        num_warps=warps(block_ch * block_hw), **flags)
    return y


def group_norm(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5, silu: bool = False,
               shift: Optional[torch.Tensor] = None, shift_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.group_norm (then F.silu when `silu`) for (N, C, H, W) in NCHW or channels_last; same layout out.

    shift: (N, C), plus shift_bias: (C,) when given, added to x before it is normalized (a ResNet block's time
    embedding and the bias of the convolution before it), without a pass of its own on channels_last input.
    shift's rows need not be contiguous with one another."""
    _check(x, num_groups, weight, bias)
    if shift is not None and (shift.shape != x.shape[:2] or shift.device != x.device):
        raise BadInput(f"group_norm: shift has shape {tuple(shift.shape)} on {shift.device}, expected "
                       f"{tuple(x.shape[:2])} on {x.device}.", "Pass one value per sample and channel, or None.")
    if shift_bias is not None and (shift is None or shift_bias.numel() != x.shape[1]
                                   or shift_bias.device != x.device):
        raise BadInput(f"group_norm: shift_bias has {shift_bias.numel()} elements on {shift_bias.device}"
                       f"{' and no shift' if shift is None else ''}; expected {x.shape[1]} on {x.device}, with a "
                       "shift.", "Pass one value per channel together with shift, or None.")
    if x.numel() == 0:
        return torch.empty_like(x)
    x, nhwc = _layout(x)
    if shift is not None and not nhwc:
        if shift_bias is not None:
            shift, shift_bias = shift + shift_bias.reshape(-1), None
        x, shift = x + shift.reshape(shift.shape + (1,) * (x.dim() - 2)).to(x.dtype), None
    if shift is not None and shift.stride(1) != 1:  # rows may be apart (slices of one projection of all blocks)
        shift = shift.contiguous()
    if shift_bias is not None:
        shift_bias = shift_bias.contiguous()
    with on_device(x):
        y = _whole_groups(x, nhwc, num_groups, weight.contiguous() if weight is not None else None,
                          bias.contiguous() if bias is not None else None, silu, eps, shift, shift_bias)
        if y is not None:
            return y
        part = _partials(x, num_groups, nhwc, shift, shift_bias)
        return _apply(x, nhwc, num_groups, weight, bias, silu, *_finalize(part, eps), shift, shift_bias)


def group_norm_stats(x: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum, sum of squares, count) of each group, each (N, G) fp32: add them over tiles, then `mean_rstd`.

    Summed squares cancel when |mean| >> std (fp32 keeps ~7 digits of mean**2): fine for VAE activations, whose
    means are of the order of their spread; within one call the statistics are merged stably.
    """
    _check(x, num_groups, None, None)
    if x.numel() == 0:
        zeros = torch.zeros((x.shape[0], num_groups), device=x.device, dtype=torch.float32)
        return zeros, zeros.clone(), zeros.clone()
    x, nhwc = _layout(x)
    with on_device(x):
        part = _partials(x, num_groups, nhwc).per_group()
    cnt, mu, m2 = part.unbind(-1)
    total = cnt.sum(1)
    mean = mu[:, 0] + (cnt * (mu - mu[:, :1])).sum(1) / total
    m2_total = m2.sum(1) + (cnt * (mu - mean[:, None]) ** 2).sum(1)
    shape = (x.shape[0], num_groups)
    return (mean * total).view(shape), (m2_total + total * mean * mean).view(shape), total.view(shape)


def mean_rstd(total: torch.Tensor, total_sq: torch.Tensor, count: torch.Tensor,
              eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn (sum, sum of squares, count) from `group_norm_stats` (summed over tiles) into (mean, rstd)."""
    mean = total / count
    var = (total_sq / count - mean * mean).clamp_min(0.0)
    return mean, torch.rsqrt(var + eps)


def group_norm_apply(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: Optional[torch.Tensor] = None,
                     bias: Optional[torch.Tensor] = None, silu: bool = False) -> torch.Tensor:
    """Normalize x with given per-(N, G) mean and rstd (e.g. gathered over all tiles), then affine and SiLU."""
    if mean.dim() != 2 or mean.shape != rstd.shape or mean.shape[0] != x.shape[0]:
        raise BadInput(f"group_norm_apply: mean {tuple(mean.shape)} and rstd {tuple(rstd.shape)} must both be "
                       f"(N, G) with N = {x.shape[0]}.", "Pass the (N, G) tensors that mean_rstd returns.")
    G = mean.shape[1]
    _check(x, G, weight, bias)
    if x.numel() == 0:
        return torch.empty_like(x)
    x, nhwc = _layout(x)
    with on_device(x):
        return _apply(x, nhwc, G, weight, bias, silu, mean.to(x.device, torch.float32).contiguous(),
                      rstd.to(x.device, torch.float32).contiguous())


def group_norm_ref(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None, eps: float = 1e-5, silu: bool = False,
                   shift: Optional[torch.Tensor] = None, shift_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch reference (what the unfused path runs)."""
    if shift is not None:
        if shift_bias is not None:
            shift = shift + shift_bias.reshape(-1)
        x = x + shift.reshape(shift.shape + (1,) * (x.dim() - 2))
    y = F.group_norm(x, num_groups, weight, bias, eps)
    return F.silu(y) if silu else y


def group_norm_stats_ref(x: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of `group_norm_stats` (also the fallback where Triton cannot run)."""
    g = x.reshape(x.shape[0], num_groups, -1).float()
    n = g.shape[-1]
    var, mean = torch.var_mean(g, dim=-1, correction=0)
    count = torch.full_like(mean, float(n))
    return mean * n, (var + mean * mean) * n, count


def group_norm_apply_ref(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: Optional[torch.Tensor] = None,
                         bias: Optional[torch.Tensor] = None, silu: bool = False) -> torch.Tensor:
    """Torch reference of `group_norm_apply` (also the fallback where Triton cannot run)."""
    N, C = x.shape[:2]
    G = mean.shape[1]
    g = x.reshape(N, G, -1).float()
    y = ((g - mean[..., None].float()) * rstd[..., None].float()).reshape(x.shape)
    shape = (1, C) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.float().reshape(shape)
    if bias is not None:
        y = y + bias.float().reshape(shape)
    if silu:
        y = F.silu(y)
    return y.to(x.dtype).contiguous(memory_format=_format(x))


__all__ = ["group_norm", "group_norm_stats", "mean_rstd", "group_norm_apply", "group_norm_ref",
           "group_norm_stats_ref", "group_norm_apply_ref", "supported"]
