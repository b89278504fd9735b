"""How one model call is spread over the processes: CFG parallelism over 2 where the batch splits (ComfyUI batches the
conditional and unconditional halves into one call of batch 2), sequence parallelism inside each CFG group over the
rest; a call of a batch that does not split, sequence parallelism over all processes.

Every process makes the same layouts in the same order (new_group's rule) and runs a call under the layout the first
process chose. A layout that cannot take a call (a batch or token count that does not split, a model sequence_parallel
refuses) raises BadInput on every process alike, before the call's first collective, so the processes stay in step and
the first one tries its next layout, or runs the call alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .batch import batch_parallel
from .group import Group, mesh
from .sequence import sequence_parallel


@dataclass(frozen=True)
class Layout:
    name: str
    batch: Group | None  # CFG parallelism over this group; None: every process runs the whole batch
    seq: Group | None  # sequence parallelism over this group; None: whole sequences

    def run(self, model: nn.Module, call: Callable[..., torch.Tensor], *inputs: torch.Tensor | None) -> torch.Tensor:
        """call(*inputs) spread as this layout says (model: the module call runs, which sequence_parallel hooks); every
        process gets the whole output."""
        spread = sequence_parallel(model, self.seq) if self.seq is not None else contextlib.nullcontext()
        with spread:
            return batch_parallel(call, self.batch, *inputs) if self.batch is not None else call(*inputs)


def make_layouts() -> dict[str, Layout]:
    """This process's layouts over the default group, by name. Every process must call it, in step."""
    world = dist.get_world_size()
    layouts = {"sequence": Layout(f"sequence parallel over {world}", None, Group())}
    if world == 2:  # the CFG halves over the default group: no groups of one process to make
        layouts["cfg"] = Layout("CFG parallel over 2", Group(), None)
    elif world % 2 == 0:
        batch, seq = mesh(2)
        name = "CFG parallel over 2" + (f" x sequence parallel over {seq.world}" if seq.world > 1 else "")
        layouts["cfg"] = Layout(name, batch, seq if seq.world > 1 else None)
    return layouts


def candidates(batch: int, layouts: dict[str, Layout]) -> list[str]:
    """The layouts to try for a call of this batch, best first."""
    return (["cfg"] if batch % 2 == 0 and "cfg" in layouts else []) + ["sequence"]


def canonical(runner: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The call a layout runs, on the inputs as they travel, (x, timesteps, context, y, guidance) with y and guidance
    possibly None: runner's canonical call (x, timesteps, context, y, control, guidance=)."""

    def call(x, timesteps, context, y=None, guidance=None):
        return runner(x, timesteps, context, y, None, **({"guidance": guidance} if guidance is not None else {}))

    return call
