"""One step of the program over the whole image: a layer pass tile by tile, or the mid-block attention.

A tile reads its input region plus the halo its convolution needs (through nearest upsampling and strided
downsampling as well), so each output pixel is computed from exactly the inputs the untiled network uses. `_Ctx`
holds where the whole-image activations live (device, or host memory in bands of rows with two streams so that one
band's copies overlap the other's compute) for the length of one run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..progress import Progress
from .attention import _sdpa
from .memory import _host_buffer, _PINNED, _return_host_buffers, _take
from .norm import _norm_params, norm_apply, tile_stats
from .plan import BAND_STREAMS
from .program import _Attn, _Pass, _same, _Term


@dataclass
class _Act:
    data: torch.Tensor | None  # (N, C, H, W) on the store device
    sum: torch.Tensor | None = None  # (N, C) float64 on the compute device, whole image
    sumsq: torch.Tensor | None = None


@dataclass
class _Ctx:
    device: torch.device
    dtype: torch.dtype
    store: torch.device
    grid: tuple[int, int]
    progress: Progress
    bands: bool = False  # whole-image activations in host memory, channels-last, computed in bands of rows
    spare: list[torch.Tensor] = field(default_factory=list)  # host byte buffers free for reuse in this run
    owned: dict[int, torch.Tensor] = field(default_factory=dict)  # data_ptr -> host byte buffer used in this run
    side: list = field(default_factory=list)  # side streams (see streams())

    def param(self, p: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return None if p is None else p.to(self.device, dtype or self.dtype)

    def alloc(self, shape: tuple[int, ...]) -> torch.Tensor:
        if not self.bands:
            return torch.empty(shape, device=self.store, dtype=self.dtype)
        n, c, h, w = shape
        # Channels-last, so that a band of whole rows is one contiguous block.
        size = n * c * h * w * torch.finfo(self.dtype).bits // 8
        buf = _take(self.spare, size)
        if buf is None and self.device.type == "cuda":
            buf = _host_buffer(size)
        if buf is None:
            buf = torch.empty(size, dtype=torch.uint8)
        t = buf[:size].view(self.dtype).view(n, h, w, c)
        self.owned[t.data_ptr()] = buf
        return t.permute(0, 3, 1, 2)

    def streams(self) -> list:
        """The streams tiles alternate between: two side streams for bands on a GPU, so that one band's copies
        to and from host memory overlap the other's compute; [None] (the current stream) otherwise."""
        if not (self.bands and self.device.type == "cuda"):
            return [None]
        if not self.side:
            self.side = [torch.cuda.Stream(self.device) for _ in range(BAND_STREAMS)]
        return self.side

    def keep(self, y: torch.Tensor) -> torch.Tensor:
        """A whole-image activation computed in one piece, moved to the store."""
        if not self.bands:
            return y.to(self.store).contiguous()
        return self.alloc(tuple(y.shape)).copy_(y, non_blocking=True)

    def recycle(self, t: torch.Tensor) -> None:
        """Hand a host activation that no later pass reads back for reuse in this run."""
        buf = self.owned.get(t.data_ptr()) if self.bands else None
        if buf is not None:
            self.spare.append(buf)

    def release(self) -> None:
        """Return this run's page-locked buffers to the process pool (see _host_buffer)."""
        buffers = list({b.data_ptr(): b for b in self.owned.values()}.values())
        self.owned.clear()
        self.spare.clear()
        if self.device.type == "cuda" and buffers:
            torch.cuda.synchronize(self.device)
            _return_host_buffers([b for b in buffers if b.data_ptr() in _PINNED])


# ----- tile geometry: the input region (and zero padding) each tile's conv reads


def _bounds(n: int, parts: int) -> list[tuple[int, int]]:
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


@dataclass
class _Axis:
    r0: int  # stored rows read
    r1: int
    c0: int  # crop of the (upsampled) rows that the conv reads
    c1: int
    z0: int  # zeros added before / after them
    z1: int
    p: int  # padding the conv itself adds
    o0: int  # crop of the conv's output
    o1: int


def _axis(o0: int, o1: int, n: int, t: _Term, a: int) -> _Axis:
    """What conv outputs [o0, o1) along axis a read, with positions outside the image as the zeros the conv pads."""
    k, s, p = t.conv.kernel_size[a], t.conv.stride[a], t.conv.padding[a]
    up = t.up
    if _same(t):
        # Padding the slice by p where it ends inside the image only spoils the p outputs cropped away.
        a0, a1 = max(o0 - p, 0), min(o1 + p, n * up)
        r0, r1 = a0 // up, -(-a1 // up)
        return _Axis(r0, r1, 0, (r1 - r0) * up, 0, 0, p, o0 - r0 * up, o1 - r0 * up)
    pad_lo = t.pad[2] if a == 0 else t.pad[0]
    lo = o0 * s - p - pad_lo
    hi = (o1 - 1) * s - p - pad_lo + k
    a0, a1 = max(lo, 0), min(hi, n * up)
    r0, r1 = a0 // up, -(-a1 // up)
    return _Axis(r0, r1, a0 - r0 * up, a1 - r0 * up, a0 - lo, hi - a1, 0, 0, o1 - o0)


# ----- a layer pass


def _term(t: _Term, act: _Act, box: tuple[int, int, int, int], ctx: _Ctx, prep: dict) -> torch.Tensor:
    y0, y1, x0, x1 = box
    x = act.data
    if t.conv is None:
        return x[:, :, y0:y1, x0:x1].to(ctx.device, non_blocking=True)
    ay, ax = _axis(y0, y1, x.shape[2], t, 0), _axis(x0, x1, x.shape[3], t, 1)
    v = x[:, :, ay.r0:ay.r1, ax.r0:ax.r1].to(ctx.device, non_blocking=True)
    if t.norm is not None:
        v = norm_apply(v, prep["norm"], t.silu)
    elif t.silu:
        v = F.silu(v)
    if t.up > 1:
        v = F.interpolate(v, scale_factor=t.up, mode="nearest")
    if (ay.c0, ay.c1, ax.c0, ax.c1) != (0, v.shape[2], 0, v.shape[3]):
        v = v[:, :, ay.c0:ay.c1, ax.c0:ax.c1]
    if ay.z0 or ay.z1 or ax.z0 or ax.z1:
        v = F.pad(v, (ax.z0, ax.z1, ay.z0, ay.z1))
    y = F.conv2d(v, prep["w"], prep["b"], t.conv.stride, (ay.p, ax.p), 1, t.conv.groups)
    return y[:, :, ay.o0:ay.o1, ax.o0:ax.o1]


def _prepare(t: _Term, env: dict[int, _Act], ctx: _Ctx, count: dict[int, int]) -> dict:
    prep = {}
    if t.conv is not None:
        prep["w"], prep["b"] = ctx.param(t.conv.weight), ctx.param(t.conv.bias)
    if t.norm is not None:
        prep["norm"] = _norm_params(env[t.src].sum, env[t.src].sumsq, t.norm, count[t.src], ctx.device)
    return prep


def _run_pass(step: _Pass, env: dict[int, _Act], ctx: _Ctx, shape: tuple[int, int, int],
              into: tuple[int, bool] | None, stats: bool, count: dict[int, int]) -> _Act:
    n = env[step.terms[0].src].data.shape[0]
    rows, cols = _bounds(shape[1], ctx.grid[0]), _bounds(shape[2], ctx.grid[1])
    single = len(rows) * len(cols) == 1  # the one tile's result is the activation: no buffer to copy it into
    out = _Act(None if single else env[into[0]].data if into is not None else ctx.alloc((n, *shape)))
    delayed = into is not None and into[1]
    preps = [_prepare(t, env, ctx, count) for t in step.terms]
    streams = ctx.streams()
    side = [st for st in streams if st is not None]
    sums = [torch.zeros(2, n, shape[0], dtype=torch.float64, device=ctx.device) for _ in streams] if stats else []
    main = torch.cuda.current_stream(ctx.device) if side else None
    for st in side:
        st.wait_stream(main)
    waiting: list[tuple[int, tuple[int, int, int, int], torch.Tensor, Any]] = []
    for i, (y0, y1) in enumerate(rows):
        for j, (x0, x1) in enumerate(cols):
            done = i * len(cols) + j
            st = streams[done % len(streams)]
            with _on(st):
                box = (y0, y1, x0, x1)
                y = _term(step.terms[0], env[step.terms[0].src], box, ctx, preps[0])
                for t, prep in zip(step.terms[1:], preps[1:]):
                    y = y + _term(t, env[t.src], box, ctx, prep)
                if step.scale != 1.0:
                    y = y / step.scale
                if stats:
                    acc = sums[done % len(streams)]
                    s_, q_ = tile_stats(y)
                    acc[0] += s_
                    acc[1] += q_
                ctx.progress.advance(1)
                if single:
                    out.data = ctx.keep(y)
                    continue
                if ctx.bands:  # one contiguous block each way
                    y = y.contiguous(memory_format=torch.channels_last)
                # A tile overwriting its own conv input waits for the last neighbour reading it: (i+1, j+1) in this
                # order. Its copy is then issued on that neighbour's stream, after the neighbour's reads.
                ready = min(i + 1, len(rows) - 1) * len(cols) + min(j + 1, len(cols) - 1) if delayed else -1
                waiting.append((ready, box, y, _event(st)))
                while waiting and waiting[0][0] <= done:
                    _, (a0, a1, b0, b1), ready_y, made = waiting.pop(0)
                    if st is not None:
                        st.wait_event(made)
                        ready_y.record_stream(st)
                    out.data[:, :, a0:a1, b0:b1].copy_(ready_y, non_blocking=True)
    for st in side:
        main.wait_stream(st)
    if stats:
        total = torch.stack(sums).sum(0)
        out.sum, out.sumsq = total[0], total[1]
    return out


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _event(stream):
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


# ----- the mid-block attention


def _run_attn(step: _Attn, env: dict[int, _Act], ctx: _Ctx, count: dict[int, int], stats: bool) -> _Act:
    src = env[step.src]
    x = src.data.to(ctx.device)
    n, c, h, w = x.shape
    hn = norm_apply(x, _norm_params(src.sum, src.sumsq, step.norm, count[step.src], ctx.device), False)
    tokens = hn.flatten(2).transpose(1, 2)
    del hn
    heads = lambda t: t.view(n, h * w, step.heads, -1).transpose(1, 2)
    proj = lambda t, wb: F.linear(t, ctx.param(wb[0]), ctx.param(wb[1]))
    q, k, v = (heads(proj(tokens, wb)) for wb in (step.q, step.k, step.v))
    del tokens
    o = _sdpa(q, k, v, step.scale)
    del q, k, v
    o = proj(o.transpose(1, 2).reshape(n, h * w, -1), step.out).transpose(1, 2).reshape(n, c, h, w)
    if step.residual:
        o = o + x
    if step.rescale != 1.0:
        o = o / step.rescale
    out = _Act(ctx.keep(o))
    if stats:
        s, sq = tile_stats(o)
        out.sum, out.sumsq = s.double(), sq.double()
    ctx.progress.advance(ctx.grid[0] * ctx.grid[1])
    return out
