"""Ulysses' exchange around a sharded block's attention: every rank holds its share of the tokens (shards.py: of
the image, and of the text, or all the text where the world does not divide it), for all heads; the attention needs
all tokens, for some heads. One all-to-all sends each rank this rank's tokens of that rank's heads (q, k and v in one
message); rows every rank holds anyway (whole text) are taken where they are, of this rank's heads. After the
attention one all-to-all sends each rank its tokens back, with this rank's heads of the whole rows, which every rank
needs. Two all-to-alls per attention; the sequence the attention sees is the one-process one (an attention mask
still fits it).

The exchange takes the place of the host module's attention function (a StandIn, accel/engine/attention.py) while
sequence parallelism lasts; it exchanges only inside the blocks the model's hooks mark (a text encoder's attention, or
a cross-attention, that call the same function go straight to it). The fused DiT blocks of the torch path, which call
no host attention function, reach it through the StandIn's `around`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..engine.attention import StandIn
from .group import Group
from .shards import Shards


def _all_to_all(x: torch.Tensor, g: Group) -> torch.Tensor:
    """Part i of x (its first dim) goes to rank i; part j of the result came from rank j."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=g.group)
    return out


def to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, whole: int, text: int,
             g: Group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, whole + text + n, heads, D) q, k and v of this rank -> (B, whole + world * (text + n), heads / world, D): of
    this rank's heads, the rows every rank has (whole text), then every rank's text rows, then every rank's image
    rows, each in rank order (the one-process order)."""
    (B, L, H, D), w = q.shape, g.world
    split, h = L - whole, H // w
    send = q.new_empty(w, 3, B, split, h, D)
    out = q.new_empty(3, B, whole + w * split, h, D)
    mine = slice(g.rank * h, (g.rank + 1) * h)
    for i, t in enumerate((q, k, v)):
        send[:, i] = t[:, whole:].unflatten(2, (w, h)).permute(2, 0, 1, 3, 4)
        out[i, :, :whole] = t[:, :whole, mine]
    got = _all_to_all(send, g).permute(1, 2, 0, 3, 4, 5)  # (3, B, from rank, split, h, D)
    start = whole
    for rows in (slice(0, text), slice(text, split)):
        n = rows.stop - rows.start
        out[:, :, start:start + w * n].unflatten(2, (w, n)).copy_(got[:, :, :, rows])
        start += w * n
    return out.unbind(0)


def to_tokens(out: torch.Tensor, whole: int, text: int, g: Group) -> torch.Tensor:
    """The way back for the attention's output (B, whole + world * (text + n), heads / world * D), in to_heads' order:
    (B, whole + text + n, heads * D), all heads of this rank's rows."""
    B, total = out.shape[:2]
    w = g.world
    split = (total - whole) // w
    out = out.reshape(B, total, -1)
    send = out.new_empty(w, B, whole + split, out.shape[2])
    send[:, :, :whole] = out[:, :whole]  # every rank needs this rank's heads of them
    start = whole
    for rows in (slice(whole, whole + text), slice(whole + text, whole + split)):
        n = rows.stop - rows.start
        send[:, :, rows] = out[:, start:start + w * n].unflatten(1, (w, n)).transpose(0, 1)
        start += w * n
    return _all_to_all(send, g).permute(1, 2, 0, 3).reshape(B, whole + split, w * out.shape[2])


def stand_in(host: Callable, shards: Shards) -> StandIn:
    """host (a ComfyUI attention function: q, k and v as (B, L, heads * D), or (B, heads, L, D) with skip_reshape)
    exchanging tokens for heads while shards says a marked block runs."""
    g = shards.g

    def call(q, k, v, heads, *args, skip_reshape=False, **kwargs):
        if not shards.inside:
            return host(q, k, v, heads, *args, skip_reshape=skip_reshape, **kwargs)
        views = [t.transpose(1, 2) if skip_reshape else t.reshape(t.shape[0], t.shape[1], heads, -1) for t in (q, k, v)]
        rows = shards.layout(views[0].shape[1])
        qkv = to_heads(*views, *rows, g)
        qkv = [t.transpose(1, 2) if skip_reshape else t.flatten(2) for t in qkv]
        return to_tokens(host(*qkv, heads // g.world, *args, skip_reshape=skip_reshape, **kwargs), *rows, g)

    def around(attend, q, k, v):
        if not shards.inside:
            return attend(q, k, v)
        rows = shards.layout(q.shape[1])
        return to_tokens(attend(*to_heads(q, k, v, *rows, g)), *rows, g)

    return StandIn(host, call, around)
