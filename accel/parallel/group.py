"""The processes one sample is spread over, and what the parallel schemes do with them: take this rank's share of a
tensor, gather every rank's share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..engine import graphs
from ..errors import BadInput

# torch 2.13 renamed all_gather_into_tensor (and warns at each call of the old name)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
    send = graphs.empty(x.shape, x.dtype, x.device)
    send.copy_(x)
    parts = graphs.empty((g.world * x.shape[0], *x.shape[1:]), x.dtype, x.device)  # rank after rank (gloo's form)
    graphs.between(lambda: _all_gather(parts, send, group=g.group))
    return torch.cat(parts.chunk(g.world), dim)
