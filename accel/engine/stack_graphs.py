"""CUDA graphs over a host model's block stack, where its whole forward cannot be captured.

ComfyUI's LTX-2 forward copies its patchifier's coordinates from the CPU at every call, which a graph cannot
capture; without graphs the CPU launching the fused blocks' kernels one at a time is most of an fp8 step
(BENCHMARKS.md, LTX-2). The block stack itself can be captured: the forward's preamble (coordinates, rotary tables,
timestep embeddings) and its output layers run as they are, and the method that runs the blocks replays a graph per
input signature. The fusion of the model's blocks names that method, which of its arguments carry the call's tensors
and which of its calls a graph may serve (fusions/ltx2.py: stack); any other call runs the method as it is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .fusions.base import Undo, patch_method
from .graphs import GraphCache

_CONSTANTS = (type(None), bool, int, float, str)


class Unflattenable(TypeError):
    """An argument holds something other than tensors, constants, tuples, lists and the named host classes."""


def flatten(tree: Any, slotted: tuple[str, ...] = ()) -> tuple[list[torch.Tensor], tuple]:
    """The tensors of a nest of tuples and lists (and instances of the host classes named in `slotted`, whose
    __slots__ hold the values) in order, and its structure with every other value kept: unflatten's spec."""
    tensors: list[torch.Tensor] = []

    def walk(t: Any) -> tuple:
        if isinstance(t, torch.Tensor):
            tensors.append(t)
            return ("tensor",)
        if type(t) in _CONSTANTS:
            return ("value", t)
        if type(t) in (tuple, list):
            return (type(t), tuple(walk(item) for item in t))
        if type(t).__name__ in slotted and hasattr(type(t), "__slots__"):
            return (type(t), tuple((name, walk(getattr(t, name))) for name in type(t).__slots__))
        raise Unflattenable(f"a {type(t).__name__}")

    return tensors, walk(tree)


def unflatten(spec: tuple, tensors: list[torch.Tensor]) -> Any:
    """The nest that flatten() took apart, with `tensors` in its tensors' places."""
    rest = iter(tensors)

    def build(s: tuple) -> Any:
        kind = s[0]
        if kind == "tensor":
            return next(rest)
        if kind == "value":
            return s[1]
        if kind in (tuple, list):
            return kind(build(item) for item in s[1])
        obj = object.__new__(kind)
        for name, item in s[1]:
            setattr(obj, name, build(item))
        return obj

    return build(spec)


@dataclass(frozen=True)
class Stack:
    """What a fusion says of a model's block stack: the method, the arguments whose tensors go through the graph's
    buffers, the host classes those may hold (flatten's `slotted`), and whether a call may be served by a graph
    (given the call's arguments by name: every argument not in `trees` is passed to the captured call as it is)."""

    method: str
    trees: tuple[str, ...]
    slotted: tuple[str, ...]
    serves: Callable[[dict], bool]


class StackGraphs:
    """The block stack's method of one model replayed from `graphs` (a GraphCache whose fn is self.run), keyed by the
    engine's `token()` (its weights and attention choice) and the call's structure; `before()` runs before each
    graphed call (the fp8 copies brought up to date outside any capture). Calls whose tensors are not all on a device
    of `device_type` run the method as it is."""

    def __init__(self, token: Callable[[], tuple], before: Callable[[], None], max_graphs: int,
                 device_type: str = "cuda") -> None:
        # The first call at a signature runs the method itself (GraphCache's run_first): not compiling ahead, which
        # runs a call twice, while the blocks update the streams they are given in place.
        self.graphs = GraphCache(self.run, max_graphs=max_graphs)
        self._token, self._before, self.device_type = token, before, device_type
        self._call: tuple | None = None  # the call served: (model, own method, spec, trees, other arguments)

    def apply(self, model: nn.Module, stack: Stack, undo: Undo) -> None:
        own = getattr(type(model), stack.method)
        signature = inspect.signature(own)

        def blocks(m: nn.Module, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(m, *args, **kwargs)
            bound.apply_defaults()
            named = dict(bound.arguments)
            if not stack.serves(named):
                return own(m, *args, **kwargs)
            try:
                tensors, spec = flatten(tuple(named.pop(name) for name in stack.trees), stack.slotted)
            except Unflattenable:
                return own(m, *args, **kwargs)
            if not tensors or any(t.device.type != self.device_type for t in tensors):
                return own(m, *args, **kwargs)
            self._call = (m, own, spec, stack.trees, named)
            try:
                self._before()
                return self.graphs(tensors, (*self._token(), spec))
            finally:
                self._call = None

        patch_method(model, stack.method, blocks, undo)

    def run(self, *tensors: torch.Tensor) -> Any:
        """The served call's method on `tensors` (the graph's buffers while it is captured)."""
        m, own, spec, trees, named = self._call
        named = {**named, **dict(zip(trees, unflatten(spec, list(tensors))))}
        named.pop("self", None)
        kwargs = named.pop("kwargs", {})
        return own(m, **named, **kwargs)
