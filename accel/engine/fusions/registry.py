"""The fusions' declarations and the one order they run in.

Each fusion module declares its apply function with `@fusion(name, after=(...))`, naming the fusions whose patches
it reads when it runs (they must have run before it). `order` turns the declarations into a topological order once,
when the package is imported; a cycle or an `after` that names no declared fusion fails that import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from torch import nn

from .base import Undo

Apply = Callable[[nn.Module, Undo], int]  # patches the model, records how to undo it, returns how many modules
# where the patched blocks let CUDA graphs capture the model's block stack alone: what stack_graphs.Stack describes
StackOf = Callable[[nn.Module], object]


@dataclass(frozen=True)
class Fusion:
    name: str
    apply: Apply
    after: tuple[str, ...] = ()
    stack: StackOf | None = None  # the model's block stack once patched (None where there is none to capture)


_DECLARED: list[Fusion] = []


def fusion(name: str, after: Iterable[str] = (), stack: StackOf | None = None) -> Callable[[Apply], Apply]:
    """Declare the decorated apply function as the fusion `name`, to run after the fusions in `after`; `stack`, where
    its model's whole forward cannot be captured, finds the block stack CUDA graphs may capture alone."""
    if isinstance(after, str):  # after=("qkv") is the string, not a tuple of one name
        raise TypeError(f"fusion {name!r}: `after` takes a tuple of names, not the string {after!r}")

    def declare(apply: Apply) -> Apply:
        _DECLARED.append(Fusion(name, apply, tuple(after), stack))
        return apply

    return declare


def declared() -> tuple[Fusion, ...]:
    """Every declaration so far, in the order the modules made them."""
    return tuple(_DECLARED)


def order(fusions: Iterable[Fusion]) -> tuple[Fusion, ...]:
    """The fusions in an order where each comes after the ones its `after` names; where that leaves a choice, the one
    listed first. Raises ValueError for a name declared twice, an unknown `after`, or a cycle."""
    listed = list(fusions)
    names = [f.name for f in listed]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"fusions declared more than once: {', '.join(twice)}")
    for f in listed:
        unknown = [a for a in f.after if a not in names]
        if unknown:
            raise ValueError(f"fusion {f.name!r} runs after {', '.join(map(repr, unknown))}, which is no declared "
                             f"fusion (declared: {', '.join(names)})")
    done: list[Fusion] = []
    ran: set[str] = set()
    while len(done) < len(listed):
        ready = next((f for f in listed if f.name not in ran and ran.issuperset(f.after)), None)
        if ready is None:
            waiting = [f"{f.name} (after {', '.join(f.after)})" for f in listed if f.name not in ran]
            raise ValueError(f"no order satisfies the `after`s of these fusions (a cycle): {'; '.join(waiting)}")
        done.append(ready)
        ran.add(ready.name)
    return tuple(done)
