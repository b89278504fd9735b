"""What the tiled stage of a Wan video decoder reaches and holds, and the tile grid that follows from it.

The layers are walked in the order data flows through them (`_walk`) into a flat list of `_Op`s: convolutions with
their spatial radius, channels and the frames a chunk has at that point, and nearest 2x upsamplings. From that list
come the halo (how far a tile's output reaches back into its input: each 3x3 conv widens it by one pixel of its
resolution, each 2x upsampling halves it, rounded up) and the memory a tile needs per pixel: the temporal
cache every causal conv keeps (its input's last two frames, for as long as the tile runs), the largest working set of
one layer (the host's forward concatenates the cache, pads and convolves, keeping the block's input for the residual)
and the decoded frames the host's decode gathers. A layer the walk does not know is refused, and so is attention in
the tiled stage (it mixes the whole frame: `_halo`), so that a VAE the tiles would decode wrongly never runs.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UnsupportedModel
from .plan import _free_bytes, DEFAULT_TILE, MEMORY_USE

# Frames of its input each causal conv keeps between chunks (the host's CACHE_T).
CACHE_FRAMES = 2


@dataclass(frozen=True)
class _Op:
    kind: str  # "conv", "up" (nearest 2x) or "attn" (self-attention over each frame)
    radius: int = 0  # pixels of its resolution a conv reads beyond the one it writes
    c_in: int = 0
    c_out: int = 0
    scale: int = 1  # its resolution over that of the walk's input
    frames: int = 1  # frames of a chunk at its input (after the first chunk)
    cached: bool = False  # a causal conv that keeps its input's last frames between chunks
    residual: int = 0  # channels of the block input kept for a residual add while it runs (0: none)


def _unsupported(what: str, m: nn.Module) -> UnsupportedModel:
    return UnsupportedModel(f"{what} is a {type(m).__name__}, which the tiled video decode does not know.",
                            "Decode this VAE with its own decode().")


def _same_padding(kernel: tuple[int, int], pad: tuple[int, int], what: str) -> int:
    if any(k != 2 * p + 1 for k, p in zip(kernel, pad)) or kernel[0] != kernel[1]:
        raise UnsupportedModel(f"{what} is a {kernel} conv padded by {pad}: not one that keeps the frame's size.",
                               "Decode this VAE with its own decode().")
    return pad[0]


def _conv(m: nn.Module, scale: int, frames: int, residual: int, what: str) -> _Op:
    if tuple(m.dilation[-2:]) != (1, 1) or tuple(m.stride[-2:]) != (1, 1) or m.padding_mode != "zeros":
        raise UnsupportedModel(f"{what} is strided, dilated or not zero-padded.",
                               "Decode this VAE with its own decode().")
    if type(m).__name__ == "CausalConv3d":
        # ComfyUI pads it in its forward: until 0.3.6x every side by F.pad, _padding being (left, right, top, bottom,
        # past frames, 0); from 0.33 the past frames alone (_padding, a number), the conv its own height and width.
        pad = m._padding
        spatial = (pad[2], pad[0]) if isinstance(pad, (tuple, list)) else tuple(m.padding[1:])
        radius = _same_padding(tuple(m.kernel_size[1:]), spatial, what)
        cached = m.kernel_size[0] > 1
        if m.stride[0] != 1:
            raise UnsupportedModel(f"{what} is strided in time.", "Decode this VAE with its own decode().")
    elif isinstance(m, nn.Conv2d):
        radius, cached = _same_padding(tuple(m.kernel_size), tuple(m.padding), what), False
    else:
        raise _unsupported(what, m)
    return _Op("conv", radius, m.in_channels, m.out_channels, scale, frames, cached, residual)


def _walk(m: nn.Module, scale: int, frames: int, what: str, residual: int = 0) -> tuple[list[_Op], int, int]:
    """(ops, scale, frames after m) for module m entered at `scale` with `frames` per chunk."""
    name = type(m).__name__
    if isinstance(m, (nn.SiLU, nn.Dropout, nn.Identity)) or (name == "RMS_norm" and m.channel_first):
        return [], scale, frames  # per pixel
    if isinstance(m, nn.Sequential):
        ops = []
        for i, child in enumerate(m):
            more, scale, frames = _walk(child, scale, frames, f"{what}.{i}", residual)
            ops += more
        return ops, scale, frames
    if isinstance(m, nn.Upsample):
        factor = m.scale_factor if isinstance(m.scale_factor, tuple) else (m.scale_factor,) * 2
        if m.mode not in ("nearest", "nearest-exact") or tuple(float(f) for f in factor) != (2.0, 2.0):
            raise UnsupportedModel(f"{what} upsamples {factor} by {m.mode}: not nearest 2x.",
                                   "Decode this VAE with its own decode().")
        return [_Op("up", scale=scale * 2, frames=frames)], scale * 2, frames
    if name == "ResidualBlock":
        ops, out_scale, out_frames = _walk(m.residual, scale, frames, f"{what}.residual", m.in_dim)
        if not isinstance(m.shortcut, nn.Identity):
            ops.append(_conv(m.shortcut, scale, frames, 0, f"{what}.shortcut"))
            if ops[-1].radius or ops[-1].cached:
                raise UnsupportedModel(f"{what}.shortcut is not a 1x1 conv.", "Decode this VAE with its own decode().")
        return ops, out_scale, out_frames
    if name == "Resample" and m.mode in ("none", "upsample2d", "upsample3d"):
        ops = []
        if m.mode == "upsample3d":
            ops.append(_conv(m.time_conv, scale, frames, 0, f"{what}.time_conv"))
            frames *= 2  # the time conv's two outputs per frame become two frames
        more, scale, frames = _walk(m.resample, scale, frames, f"{what}.resample")
        return ops + more, scale, frames
    if name == "Up_ResidualBlock":
        ops, out_scale, out_frames = _walk(m.upsamples, scale, frames, f"{what}.upsamples")
        short = m.avg_shortcut
        if short is not None and (type(short).__name__ != "DupUp3D" or short.factor_s * scale != out_scale
                                  or short.factor_t * frames != out_frames):
            raise UnsupportedModel(f"{what}'s shortcut does not resample as its main path does.",
                                   "Decode this VAE with its own decode().")
        return ops, out_scale, out_frames
    if name == "AttentionBlock":
        return [_Op("attn", c_in=m.dim, c_out=m.dim, scale=scale, frames=frames)], scale, frames
    if name == "CausalConv3d" or isinstance(m, nn.Conv2d):
        return [_conv(m, scale, frames, residual, what)], scale, frames
    raise _unsupported(what, m)


def _halo(ops: list[_Op], what: str) -> int:
    """Pixels (of the ops' input) a tile must read beyond its core on each side for every output pixel of the core
    to be exact."""
    if any(op.kind == "attn" for op in ops):
        raise UnsupportedModel(f"{what} has attention past the latent resolution: it mixes the whole frame, so "
                               "tiles cannot compute it.", "Decode this VAE with its own decode().")
    h = 0
    for op in reversed(ops):
        h = h + op.radius if op.kind == "conv" else math.ceil(h / 2)
    return h


def _elements_per_px(ops: list[_Op], frames_out: int = 0) -> float:
    """Elements a run of `ops` holds at its peak per pixel of its input, for one video of the batch.

    A causal conv's working set, in the host's forward: the block input kept for the residual, its own input, the
    cache it just cloned, and the larger of (concatenation with the previous cache, padded copy) and (padded copy,
    output). A 2D conv after an upsampling: its input at half resolution, the upsampled copy and the output. An
    attention: its input, the normalized copy, q/k/v as one tensor and as three, the output and its projection
    (a fused kernel keeps no score matrix). frames_out: frames of the decoded video the run gathers, by
    concatenation (two copies at once) and a final rearrangement, at the last op's channels and resolution.
    The count errs high (every copy a layer may make, at once, and each cache at two frames from the start), and
    that margin is what is left for convolution workspaces."""
    held = sum(CACHE_FRAMES * op.c_in * op.scale ** 2 for op in ops if op.kind == "conv" and op.cached)
    peak = 0.0
    for op in ops:
        f = op.frames
        if op.kind == "attn":
            work = 10 * op.c_in * f
        elif op.kind == "conv" and op.cached:
            span = f + CACHE_FRAMES
            work = op.residual * f + op.c_in * span + max(2 * op.c_in * span, op.c_in * span + op.c_out * f)
        elif op.kind == "conv":
            work = op.c_in * f / 4 + op.c_in * f + op.c_out * f
        else:
            continue
        peak = max(peak, work * op.scale ** 2)
    gathered = 3 * ops[-1].c_out * frames_out * ops[-1].scale ** 2 if ops and frames_out else 0
    return held + peak + gathered


def _spans(n: int, parts: int, halo: int) -> list[tuple[int, int, int, int]]:
    """`parts` tiles along an axis of n pixels: (core start, core end, read start, read end) of each.

    A tile at the border reads a halo on one side only, so its core is wider by a halo than the others' and every
    tile reads the same span (the memory a tile needs follows its read span), where the cores allow it."""
    offset, step = halo, (n - 2 * halo) / parts
    if step < 1:  # too narrow for that: even cores
        offset, step = 0, n / parts
    cuts = [0] + [round(offset + i * step) for i in range(1, parts)] + [n]
    return [(a, b, max(0, a - halo), min(n, b + halo)) for a, b in zip(cuts, cuts[1:])]


@dataclass(frozen=True)
class _Costs:
    """Bytes a decode needs on the device: `fixed` whatever the grid (the stored whole stage, the output when it is
    on the device), `whole` at the end of the whole stage's run, `per_px` per pixel of the largest tile's input."""

    fixed: float
    whole: float
    per_px: float

    def peak(self, area: int) -> float:
        return max(self.whole, self.fixed + self.per_px * area)


@dataclass(frozen=True)
class VideoPlan:
    """How a tiled video decode will run: a grid of spatial tiles, each decoded through all frames in turn.

    tile: the largest core (h, w) and halo: how far a tile reads beyond its core on inner sides, both in output
    pixels. work: pixels decoded (halos included) over the video's pixels, >= 1. peak_gb: estimated device memory
    the decode needs beyond what was allocated before it."""

    grid: tuple[int, int]
    halo: int
    tile: tuple[int, int]
    work: float
    peak_gb: float

    @property
    def tiles(self) -> int:
        return self.grid[0] * self.grid[1]


def _axis(n: int, parts: int, halo: int) -> tuple[int, int, int]:
    """(largest core, largest read span, sum of read spans) of `parts` tiles along an axis of n pixels."""
    spans = _spans(n, parts, halo)
    return max(b - a for a, b, _, _ in spans), max(e - s for _, _, s, e in spans), sum(e - s for _, _, s, e in spans)


def _grid_plan(hw: tuple[int, int], halo: int, scale: int, grid: tuple[int, int], costs: _Costs,
               axes: tuple[dict, dict] | None = None) -> VideoPlan:
    """hw and halo in tile pixels, `scale` output pixels each; costs.per_px per tile pixel."""
    (ty, ey, sy), (tx, ex, sx) = ((_axis(hw[a], grid[a], halo) if axes is None else axes[a][grid[a]]) for a in (0, 1))
    return VideoPlan(grid, halo * scale, (ty * scale, tx * scale), sy * sx / (hw[0] * hw[1]),
                     costs.peak(ey * ex) / 1e9)


def _side_plan(hw: tuple[int, int], halo: int, scale: int, side: int, costs: _Costs) -> VideoPlan:
    return _grid_plan(hw, halo, scale, (math.ceil(hw[0] / side), math.ceil(hw[1] / side)), costs)


def _choose(hw: tuple[int, int], halo: int, scale: int, costs: _Costs, budget: float) -> VideoPlan:
    """The grid that decodes the fewest pixels (halos included) within `budget` bytes, fewer tiles on a tie; when
    none fits, the one that needs the least memory."""
    axes = tuple({g: _axis(hw[a], g, halo) for g in range(1, hw[a] + 1)} for a in (0, 1))
    plans = [_grid_plan(hw, halo, scale, g, costs, axes) for g in itertools.product(axes[0], axes[1])]
    fits = [p for p in plans if p.peak_gb * 1e9 <= budget]
    if not fits:
        return min(plans, key=lambda p: (p.peak_gb, p.work))
    return min(fits, key=lambda p: (p.work, p.tiles))


def _plan(hw: tuple[int, int], halo: int, scale: int, costs: _Costs, device: torch.device, tile: int | None,
          memory_gb: float | None) -> VideoPlan:
    """hw: the frame the tiles cut up and halo, in tile pixels; scale: output pixels per tile pixel; tile: core side
    in output pixels, or None to choose the grid from free memory and `memory_gb` (GB above what is allocated; off
    CUDA, tiles of DEFAULT_TILE unless memory_gb is given)."""
    if tile is not None:
        return _side_plan(hw, halo, scale, max(1, tile // scale), costs)
    free = _free_bytes(device)
    if free is None and memory_gb is None:
        return _side_plan(hw, halo, scale, max(1, DEFAULT_TILE // scale), costs)
    limit = memory_gb * 1e9 if free is None else free if memory_gb is None else min(free, memory_gb * 1e9)
    return _choose(hw, halo, scale, costs, MEMORY_USE * limit)
