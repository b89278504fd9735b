"""Batch (CFG) parallelism for any model: the conditional and unconditional halves of a CFG batch on two GPUs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import BadInput
from .group import Group, gather, shard


def batch_parallel(call: Callable[..., torch.Tensor], g: Group, *inputs: torch.Tensor | None) -> torch.Tensor:
    """call(*inputs) with the batch spread over the ranks: each rank runs its share of every input's batch, and every
    rank gets the whole output. None inputs stay None; a batch the world does not divide is BadInput (the caller runs
    it whole)."""
    batch = inputs[0].shape[0]
    if batch % g.world:
        raise BadInput(f"a batch of {batch} does not split over {g.world} processes.", "Run this call on one GPU.")
    return gather(call(*(None if t is None else shard(t, 0, g) for t in inputs)), 0, g)
