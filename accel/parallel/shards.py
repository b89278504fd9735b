"""What a sequence-parallel model's hooks keep during one call: how many image and text tokens this rank holds, this
rank's rows of the per-token tables (rotary embeddings), and whether a block whose attention is exchanged is running;
and reading and replacing a hooked call's arguments by name.

A rank holds 1/world of the image tokens (a count the world does not divide is refused) and 1/world of the text
tokens, or, where the world does not divide their count (SD3.5's 333), all of them: every rank then computes them
whole, which costs little beside the image.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..errors import BadInput
from .group import Group, shard


class Shards:
    """One sequence-parallel model's state during a call, kept by its hooks and read by the exchange."""

    def __init__(self, g: Group) -> None:
        self.g = g
        self.image: int | None = None  # this rank's image tokens in the running call, once split
        self.text: int | None = None  # this rank's text tokens where they are split, 0 where whole; None: undecided
        self.inside = False  # while a block whose attention is exchanged runs
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin(self, *_args) -> None:
        """A model call starts: nothing is split yet."""
        self.image, self.text, self.inside = None, None, False
        self._tables.clear()

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The image tokens x (B, N, C) a block takes: this rank's share at the call's first block (BadInput where the
        world does not divide N), as they come at the blocks after it."""
        if self.image is not None:
            return x
        if x.shape[1] % self.g.world:
            raise BadInput(f"{x.shape[1]} image tokens do not split over {self.g.world} processes.",
                           "Run this size on one GPU.")
        x = shard(x, 1, self.g)
        self.image = x.shape[1]
        return x

    def text_tokens(self, t: torch.Tensor | None, split: bool = True) -> torch.Tensor | None:
        """The text tokens t (B, T, C) a block takes: at the call's first block, this rank's share where `split` and
        the world divides T, else t whole; as they come at the blocks after it."""
        if self.text is not None or t is None:
            return t
        split = split and t.shape[1] % self.g.world == 0
        t = shard(t, 1, self.g) if split else t
        self.text = t.shape[1] if split else 0
        return t

    def table(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """A per-token table along dim over the text and then the image tokens (a rotary embedding): this rank's rows
        (its text rows, or all of them where the text is whole, then its image rows), made once per call and table."""
        def make() -> torch.Tensor:
            text = t.shape[dim] - self.image * self.g.world
            rows = t.narrow(dim, 0, text)
            return torch.cat((shard(rows, dim, self.g) if self.text else rows,
                              shard(t.narrow(dim, text, t.shape[dim] - text), dim, self.g)), dim)

        return self._once(t, make)

    def rows(self, t: torch.Tensor, dim: int, tokens: int) -> torch.Tensor:
        """A table along dim with a row per run of consecutive tokens (Wan 2.2's modulation per frame), spread over all
        `tokens` as ComfyUI's repeat_e spreads it on one process, as this rank's share of them: a slice of t (which the
        block repeats as on one process) where the share starts and ends on a row's edge, else one row per token. Made
        once per call and table: the blocks of a call share it."""
        def make() -> torch.Tensor:
            per = -(-tokens // t.shape[dim])
            share = tokens // self.g.world
            start = self.g.rank * share
            if share % per == 0:
                return t.narrow(dim, start // per, share // per)
            return t.index_select(dim, torch.arange(start, start + share, device=t.device) // per)

        return self._once(t, make)

    def _once(self, t: torch.Tensor, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """make() for table t, made once per call (kept with t, whose id another tensor may take later)."""
        held = self._tables.get(id(t))
        if held is None or held[0] is not t:
            held = t, make()
            self._tables[id(t)] = held
        return held[1]

    def whole(self, tokens: int) -> int:
        """How many of this rank's `tokens` of an exchanged attention come first and are alike on every rank (the text
        where it is whole); the rest are split. An attention over the image tokens alone has none."""
        return tokens - self.image - (self.text or 0) if tokens > self.image else 0

    def exchanging(self, module: nn.Module) -> list[RemovableHandle]:
        """Hooks that mark module's calls as those whose attention the exchange serves."""
        return [module.register_forward_pre_hook(lambda *_: setattr(self, "inside", True)),
                module.register_forward_hook(lambda *_: setattr(self, "inside", False), always_call=True)]


@functools.cache
def parameters(forward: Callable) -> tuple[str, ...]:
    """The names a forward takes after self."""
    return tuple(inspect.signature(forward).parameters)[1:]


def argument(names: Sequence[str], args: tuple, kwargs: dict, name: str):
    """The value of argument `name` of a call made with args and kwargs to a function taking `names` (None where the
    call gives none)."""
    if name in kwargs:
        return kwargs[name]
    i = names.index(name) if name in names else len(args)
    return args[i] if i < len(args) else None


def replaced(names: Sequence[str], args: tuple, kwargs: dict, **values) -> tuple[tuple, dict]:
    """args and kwargs with the named arguments given these values, where the call put them."""
    args, kwargs = list(args), dict(kwargs)
    for name, value in values.items():
        i = names.index(name)
        if name not in kwargs and i < len(args):
            args[i] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs
