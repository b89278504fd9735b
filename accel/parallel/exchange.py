"""Ulysses' exchange around a sharded block's attention: every rank holds its share of the tokens (shards.py: of
the image, and of the text, or all the text where the world does not divide it), for all heads; the attention needs
all tokens, for some heads. One all-to-all sends each rank this rank's tokens of that rank's heads (q, k and v in one
message); rows every rank holds anyway (whole text) are taken where they are, of this rank's heads. After the
attention one all-to-all sends each rank its tokens back, with this rank's heads of the whole rows, which every rank
needs. Two all-to-alls per attention. The attention sees the whole rows, then each rank's rows in rank order: the
one-process order where the text is whole, else its text and image tokens interleaved by rank, which attention
without a mask does not tell apart (Flux's blocks keep the text whole for a call with a mask).

The exchange takes the place of the host module's attention function (a StandIn, accel/engine/attention.py) while
sequence parallelism lasts; it exchanges only inside the blocks the model's hooks mark (a text encoder's attention, or
a cross-attention, that call the same function go straight to it). The fused DiT blocks of the torch path, which call
no host attention function, reach it through the StandIn's `around`.

Their fp8 attention (accel/engine/fp8_attention.py) reaches it through the StandIn's `eight` (Eight). q and k come out
of the rope pass in e4m3, under descales that the RMSNorm weights fix (the same on every rank), so they cross as fp8
bytes; v crosses in 16 bits, beside them in the same message (q, k and v side by side per token as bytes, a third
less than three 16-bit tensors), and with it each rank's largest |v| (the rope pass's partial maxima): every rank then
quantizes the v rows it received by the largest of all ranks' maxima, which is the one-process v's, so every rank's
output has the same scale (and the one process's) and the way back carries it as it came out of the kernel, e4m3
bytes or 16 bits. Still one all-to-all each way; the kernel is chosen at the gathered shape, its timing agreed over
the ranks (Eight.agree), so that every rank writes the same dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..engine import graphs
from ..engine.attention import StandIn
from .group import Group
from .shards import Shards


def _all_to_all(x: torch.Tensor, g: Group) -> torch.Tensor:
    """Part i of x (its first dim; a tensor from graphs.empty) goes to rank i; part j of the result came from rank j.
    The result is graphs.empty's too: read it before two more exchanges of its shape."""
    out = graphs.empty(x.shape, x.dtype, x.device)
    graphs.between(lambda: dist.all_to_all_single(out, x, group=g.group))
    return out


def _copy(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """src copied into out (a new contiguous tensor where None), 16 bytes at a time where the rows allow: PyTorch's
    strided copy moves one element per thread, 2 bytes of bf16."""
    out = torch.empty(src.shape, dtype=src.dtype, device=src.device) if out is None else out
    try:
        wide = out.view(torch.complex128), src.view(torch.complex128)
    except RuntimeError:  # a row's bytes, or its start, not a multiple of 16
        return out.copy_(src)
    wide[0].copy_(wide[1])
    return out


def to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, whole: int,
             g: Group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, whole + s, heads, D) q, k and v of this rank -> (B, whole + world * s, heads / world, D), of this rank's
    heads: the `whole` rows every rank holds alike, then every rank's s rows, rank after rank. They come as views of one
    buffer with q, k and v side by side per token (the layout of Flux's own qkv projection), which is the received
    one itself where B is 1 and no row is whole."""
    (B, L, H, D), w = q.shape, g.world
    s, h = L - whole, H // w
    send = graphs.empty((w, B, s, 3, h, D), q.dtype, q.device)
    for i, t in enumerate((q, k, v)):
        _copy(t[:, whole:].unflatten(2, (w, h)).permute(2, 0, 1, 3, 4), send[:, :, :, i])
    got = _all_to_all(send, g).transpose(0, 1)
    got = (_copy(got) if B > 1 else got).reshape(B, w * s, 3, h, D)
    if whole:
        mine = slice(g.rank * h, (g.rank + 1) * h)
        got = torch.cat((torch.stack([t[:, :whole, mine] for t in (q, k, v)], 2), got), 1)
    return got.unbind(2)


def to_tokens(out: torch.Tensor, whole: int, g: Group) -> torch.Tensor:
    """The way back for the attention's output (B, whole + world * s, heads / world * D), in to_heads' order:
    (B, whole + s, heads * D), all heads of this rank's rows. An e4m3 output crosses as its bytes."""
    if out.element_size() == 1 and out.dtype != torch.uint8:  # collectives may not take fp8 dtypes (gloo)
        return to_tokens(out.view(torch.uint8), whole, g).view(out.dtype)
    B, total = out.shape[:2]
    w = g.world
    s = (total - whole) // w
    out = out.reshape(B, total, -1)
    rows = out[:, whole:].unflatten(1, (w, s)).transpose(0, 1)  # (w, B, s, c)
    send = graphs.empty((w, B, whole + s, out.shape[2]), out.dtype, out.device)
    send[:, :, :whole] = out[:, :whole]  # every rank needs this rank's heads of the whole rows
    _copy(rows, send[:, :, whole:])
    return _copy(_all_to_all(send, g).permute(1, 2, 0, 3)).reshape(B, whole + s, w * out.shape[2])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t's elements as bytes (a view: its last dimension element_size() times as long)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def to_heads_fp8(q8: torch.Tensor, k8: torch.Tensor, v: torch.Tensor, amax: torch.Tensor, whole: int,
                 g: Group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """to_heads for fp8 attention: (B, whole + s, heads, D) e4m3 q8 and k8 and 16-bit v of this rank, and amax (float32,
    A values: the partial maxima of |v| over this rank's rows) -> contiguous (B, whole + world * s, heads / world, D)
    q8, k8 and v of this rank's heads, in to_heads' order, and every rank's maxima (world * A values, contiguous),
    whose largest is the largest |v| over all ranks' rows. One all-to-all of bytes: per destination, the maxima
    first, then per token its q8, k8 and v of that rank's heads side by side."""
    (B, L, H, D), w = q8.shape, g.world
    s, h = L - whole, H // w
    c = h * D  # elements of a token's row for one destination
    row = 2 * c + c * v.element_size()  # bytes: q8, k8, v
    spans = ((q8, 0, c), (k8, c, 2 * c), (v, 2 * c, row))
    head = -(-amax.numel() * 4 // 16) * 16  # the maxima, padded: every row starts 16 bytes in where it can
    size = -(-(head + B * s * row) // 16) * 16
    send = graphs.empty((w, size), torch.uint8, q8.device)
    send[:, :amax.numel() * 4].view(torch.float32).copy_(amax.reshape(1, -1).expand(w, -1))
    rows = send[:, head:head + B * s * row].view(w, B, s, row)
    for t, lo, hi in spans:
        _copy(_bytes(t[:, whole:].unflatten(2, (w, h)).permute(2, 0, 1, 3, 4).flatten(3)), rows[..., lo:hi])
    got = _all_to_all(send, g)
    # the maxima of rank after rank (at world 1 a view of the received buffer: read before the next exchange)
    maxima = got[:, :amax.numel() * 4].view(torch.float32).reshape(-1)
    rows = got[:, head:head + B * s * row].view(w, B, s, row).transpose(0, 1)
    mine = slice(g.rank * h, (g.rank + 1) * h)
    out = []
    for t, lo, hi in spans:
        o = torch.empty((B, whole + w * s, h, D), dtype=t.dtype, device=t.device)
        if whole:
            _bytes(o[:, :whole]).copy_(_bytes(t[:, :whole, mine]))
        _copy(rows[..., lo:hi], _bytes(o[:, whole:].view(B, w, s, c)))
        out.append(o)
    return out[0], out[1], out[2], maxima


@dataclass(frozen=True)
class Eight:
    """The exchange as the fused blocks' fp8 attention takes it (StandIn.eight): the shape it attends at, the two ways
    of to_heads_fp8 and to_tokens, and the kernel's timing agreed over the ranks."""

    shards: Shards

    @property
    def world(self) -> int:
        return self.shards.g.world

    def whole(self, tokens: int) -> int | None:
        """Of a sequence of this rank's `tokens`, how many are alike on every rank (Shards.whole), where a block whose
        attention is exchanged runs; None where none does: the attention is this rank's own."""
        return self.shards.whole(tokens) if self.shards.inside else None

    def to_heads(self, q8: torch.Tensor, k8: torch.Tensor, v: torch.Tensor, amax: torch.Tensor,
                 whole: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return to_heads_fp8(q8, k8, v, amax, whole, self.shards.g)

    def to_tokens(self, out: torch.Tensor, whole: int) -> torch.Tensor:
        return to_tokens(out, whole, self.shards.g)

    def agree(self, times: list[float], device: torch.device) -> list[float]:
        """The largest of each of `times` over the ranks (a kernel's milliseconds, timed on each): every rank then
        chooses the same kernel, whose output dtype the way back must share. Outside any CUDA graph capture (the
        first call at a shape)."""
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.shards.g.group)
        return t.tolist()


def stand_in(host: Callable, shards: Shards) -> StandIn:
    """host (a ComfyUI attention function: q, k and v as (B, L, heads * D), or (B, heads, L, D) with skip_reshape)
    exchanging tokens for heads while shards says a marked block runs."""
    g = shards.g

    def call(q, k, v, heads, *args, skip_reshape=False, **kwargs):
        if not shards.inside:
            return host(q, k, v, heads, *args, skip_reshape=skip_reshape, **kwargs)
        views = [t.transpose(1, 2) if skip_reshape else t.reshape(t.shape[0], t.shape[1], heads, -1) for t in (q, k, v)]
        whole = shards.whole(views[0].shape[1])
        qkv = [t.transpose(1, 2) if skip_reshape else t.flatten(2) for t in to_heads(*views, whole, g)]
        return to_tokens(host(*qkv, heads // g.world, *args, skip_reshape=skip_reshape, **kwargs), whole, g)

    def around(attend, q, k, v):
        if not shards.inside:
            return attend(q, k, v)
        whole = shards.whole(q.shape[1])
        return to_tokens(attend(*to_heads(q, k, v, whole, g)), whole, g)

    return StandIn(host, call, around, key=("exchange", host, id(g.group)), eight=Eight(shards))
