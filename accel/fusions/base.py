"""What every fusion shares: patching an instance's forward or a child module, with a way back."""

from __future__ import annotations

import types
from typing import Callable

from torch import nn


class Undo:
    """Changes made to modules, undone in reverse order."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []

    def add(self, step: Callable[[], None]) -> None:
        self._steps.append(step)

    def __call__(self) -> None:
        while self._steps:
            self._steps.pop()()

    def __len__(self) -> int:
        return len(self._steps)


def patch_method(module: nn.Module, name: str, fn: Callable, undo: Undo) -> None:
    """Give one instance its own method; deleting the instance attribute brings back its class's."""
    setattr(module, name, types.MethodType(fn, module))
    undo.add(lambda: module.__dict__.pop(name, None))


def patch_forward(module: nn.Module, forward: Callable, undo: Undo) -> None:
    patch_method(module, "forward", forward, undo)


def replace_child(parent: nn.Module, name: str, new: nn.Module, undo: Undo) -> None:
    old = parent._modules[name]
    parent._modules[name] = new
    undo.add(lambda: parent._modules.__setitem__(name, old))
