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
"""

from __future__ import annotations

from collections.abc import Callable

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
    (B, whole + s, heads * D), all heads of this rank's rows."""
    B, total = out.shape[:2]
    w = g.world
    s = (total - whole) // w
    out = out.reshape(B, total, -1)
    rows = out[:, whole:].unflatten(1, (w, s)).transpose(0, 1)  # (w, B, s, c)
    send = graphs.empty((w, B, whole + s, out.shape[2]), out.dtype, out.device)
    send[:, :, :whole] = out[:, :whole]  # every rank needs this rank's heads of the whole rows
    _copy(rows, send[:, :, whole:])
    return _copy(_all_to_all(send, g).permute(1, 2, 0, 3)).reshape(B, whole + s, w * out.shape[2])


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

    return StandIn(host, call, around, key=("exchange", host, id(g.group)))
