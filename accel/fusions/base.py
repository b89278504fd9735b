"""What every fusion shares: patching an instance's forward or a child module, with a way back."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Callable

from torch import nn

_KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
_KERNELS_NAME = "sd_accel_kernels"


def kernel_module(name: str) -> types.ModuleType:
    """kernels/<name>.py of this checkout. Another package may own the name `kernels` (Hugging Face's does,
    and ComfyUI puts custom-node folders behind site-packages), so ours is loaded under a name of its own
    unless `kernels` already is this folder."""
    owner = sys.modules.get("kernels")
    if owner is not None and Path(getattr(owner, "__file__", "") or "").resolve().parent == _KERNELS_DIR:
        return importlib.import_module(f"kernels.{name}")
    if _KERNELS_NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(_KERNELS_NAME, _KERNELS_DIR / "__init__.py",
                                                      submodule_search_locations=[str(_KERNELS_DIR)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[_KERNELS_NAME] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"{_KERNELS_NAME}.{name}")


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
