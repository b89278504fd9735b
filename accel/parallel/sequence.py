"""Sequence parallelism (Ulysses) for ComfyUI's Wan transformer, and batch (CFG) parallelism for any model: every rank calls the model with the same full
inputs; the transformer blocks run on each rank's share of the tokens, and the output is the full one on every rank.

Inside a block everything but self-attention works token by token (modulation, q/k RMSNorm over the channels, the
rotary embedding, cross-attention to the text, the feed-forward), so each rank keeps 1/world of the tokens. The
self-attention exchanges them for heads (all-to-all: every rank then holds all tokens of 1/world of the heads), runs
the host's own attention function on those, and exchanges back. Two all-to-alls per block, of a block's q, k, v and
output; nothing else crosses ranks until the tokens are gathered for the output head.

How it attaches, and is taken off again: forward pre-hooks shard the first block's tokens, every block's rotary
table and per-token modulation (Wan 2.2), and gather before the head; hooks around each block's self-attention make
the module's attention function (comfy.ldm.wan.model.optimized_attention) exchange tokens for heads during that call
only. Nothing of the model's own code is restated.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..errors import BadInput


@dataclass(frozen=True)
class Group:
    """The processes one sample is spread over."""

    group: dist.ProcessGroup | None = None  # None: the default group

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)


def mesh(batch_ways: int) -> tuple[Group, Group]:
    """(batch group, sequence group) of this process when the world is batch_ways x (world / batch_ways): CFG
    parallelism over batch_ways, sequence parallelism inside each. Every process must call it (new_group's rule)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % batch_ways:
        raise BadInput(f"{world} processes do not split into {batch_ways} batch groups.",
                       "Use a number of GPUs that the CFG split divides.")
    seq = world // batch_ways
    mine: dict[str, dist.ProcessGroup] = {}
    for c in range(batch_ways):  # sequence groups: consecutive ranks
        ranks = list(range(c * seq, (c + 1) * seq))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["seq"] = group
    for s in range(seq):  # batch groups: one rank of each sequence group
        ranks = list(range(s, world, seq))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["batch"] = group
    return Group(mine["batch"]), Group(mine["seq"])


def shard(x: torch.Tensor, dim: int, g: Group) -> torch.Tensor:
    """This rank's contiguous 1/world of x along dim (which the world divides)."""
    return x.chunk(g.world, dim)[g.rank].contiguous()


def gather(x: torch.Tensor, dim: int, g: Group) -> torch.Tensor:
    """Every rank's share of x along dim, in rank order."""
    parts = [torch.empty_like(x) for _ in range(g.world)]
    dist.all_gather(parts, x.contiguous(), group=g.group)
    return torch.cat(parts, dim)


def _exchange(x: torch.Tensor, g: Group) -> torch.Tensor:
    """all-to-all over the first dim: part i goes to rank i, part j of the result came from rank j."""
    x = x.contiguous()  # and so the output: empty_like keeps a permuted input's strides
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=g.group)
    return out


def tokens_to_heads(x: torch.Tensor, heads: int, g: Group) -> torch.Tensor:
    """(B, L/world, heads*D) of all heads -> (B, L, heads/world*D): all tokens, this rank's heads."""
    b, n, c = x.shape
    w, d = g.world, c // heads
    parts = _exchange(x.view(b, n, w, heads // w, d).permute(2, 0, 1, 3, 4), g)  # (w: from rank, b, n, h, d)
    return parts.permute(1, 0, 2, 3, 4).reshape(b, w * n, heads // w * d)


def heads_to_tokens(x: torch.Tensor, heads: int, g: Group) -> torch.Tensor:
    """The way back: (B, L, heads/world*D) -> (B, L/world, heads*D)."""
    b, length, c = x.shape
    w = g.world
    n, d = length // w, c * w // heads
    parts = _exchange(x.view(b, w, n, heads // w, d).permute(1, 0, 2, 3, 4), g)  # (w: head group, b, n, h, d)
    return parts.permute(1, 2, 0, 3, 4).reshape(b, n, heads * d)


def _is_wan(model: nn.Module) -> bool:
    return type(model).__name__ == "WanModel" and hasattr(model, "blocks") and hasattr(model, "head")


@contextlib.contextmanager
def sequence_parallel(model: nn.Module, g: Group) -> Iterator[None]:
    """While it lasts, model's calls (the same full inputs on every rank) run its blocks on 1/world of the tokens.
    BadInput if the model is not ComfyUI's WanModel or the world does not divide its heads; a call whose token
    count the world does not divide raises BadInput too (the caller runs it on one GPU)."""
    if not _is_wan(model):
        raise BadInput(f"sequence parallelism takes ComfyUI's WanModel, not {type(model).__name__}.",
                       "Run this model on one GPU.")
    heads = model.num_heads
    if heads % g.world:
        raise BadInput(f"{g.world} processes do not divide the model's {heads} attention heads.",
                       "Use a number of GPUs that divides the heads (Wan 14B: 40 heads, 1.3B: 12, 5B: 24).")
    wan = sys.modules[type(model).__module__]
    host_attention = wan.optimized_attention
    inside = [False]  # set while a block's self-attention runs

    def attention(q, k, v, heads, *args, **kwargs):
        if not inside[0]:
            return host_attention(q, k, v, heads, *args, **kwargs)
        out = host_attention(*(tokens_to_heads(t, heads, g) for t in (q, k, v)), heads // g.world, *args, **kwargs)
        return heads_to_tokens(out, heads, g)

    def first_block(_module, args, kwargs):
        x = args[0] if args else kwargs["x"]
        if x.shape[1] % g.world:
            raise BadInput(f"{x.shape[1]} tokens do not split over {g.world} processes.",
                           "Run this size on one GPU.")
        x = shard(x, 1, g)
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "x": x})

    def every_block(_module, args, kwargs):
        kwargs = dict(kwargs)
        kwargs["freqs"] = shard(kwargs["freqs"], 1, g)
        e = kwargs.get("e")
        if e is not None and e.dim() == 4 and e.shape[1] > 1:
            # Wan 2.2's modulation per frame or token: spread over all tokens (as the block's repeat_e does), then
            # this rank's share
            tokens = (args[0] if args else kwargs["x"]).shape[1] * g.world
            kwargs["e"] = shard(torch.repeat_interleave(e, tokens // e.shape[1], dim=1), 1, g)
        return args, kwargs

    def head(_module, args):
        return (gather(args[0], 1, g), *args[1:])

    def enter(*_args):
        inside[0] = True

    def leave(*_args):
        inside[0] = False

    handles = [model.blocks[0].register_forward_pre_hook(first_block, with_kwargs=True),
               model.head.register_forward_pre_hook(head)]
    for block in model.blocks:
        handles.append(block.register_forward_pre_hook(every_block, with_kwargs=True))
        handles.append(block.self_attn.register_forward_pre_hook(enter))
        handles.append(block.self_attn.register_forward_hook(leave, always_call=True))
    wan.optimized_attention = attention
    try:
        yield
    finally:
        wan.optimized_attention = host_attention
        for h in handles:
            h.remove()


def batch_parallel(call: Callable[..., torch.Tensor], g: Group, *inputs: torch.Tensor | None) -> torch.Tensor:
    """call(*inputs) with the batch spread over the ranks (CFG parallelism: the conditional and unconditional halves
    of a CFG batch on two GPUs): each rank runs its share of every input's batch, and every rank gets the whole
    output. None inputs stay None; a batch the world does not divide is BadInput (the caller runs it whole)."""
    batch = inputs[0].shape[0]
    if batch % g.world:
        raise BadInput(f"a batch of {batch} does not split over {g.world} processes.", "Run this call on one GPU.")
    return gather(call(*(None if t is None else shard(t, 0, g) for t in inputs)), 0, g)
