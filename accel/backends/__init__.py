"""Backends: one interface.

Each backend module exposes
    available(gpu: GpuInfo) -> tuple[bool, str]        whether it can run here, and why not
    build(unet: CanonicalUNet, options: dict, progress: Progress) -> Engine
An Engine is called like the canonical UNet, `engine(x, timesteps, context, y=None, control=None)`,
has `backend` (its name) and `release()` (frees what it holds on the device).
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch

BACKENDS = {
    "torch": "accel.backends.torch_fused",
    "onnxruntime": "accel.backends.onnxruntime",
    "tensorrt": "accel.backends.tensorrt",
}


class Engine(Protocol):
    backend: str

    def __call__(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                 y: torch.Tensor | None = None, control: dict | None = None, **kwargs: Any) -> torch.Tensor: ...

    def release(self) -> None: ...


def load(name: str):
    """The backend module by name; ImportError when its optional packages are missing."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    try:
        return importlib.import_module(BACKENDS[name])
    except ModuleNotFoundError as e:
        if e.name != BACKENDS[name]:
            raise
        from ..errors import BackendUnavailable

        raise BackendUnavailable(f"the {name} path is not part of this version of sd-accel.",
                                 "The torch path serves instead.") from e


def available(name: str, gpu) -> tuple[bool, str]:
    try:
        mod = load(name)
    except ImportError as e:
        return False, f"the {name} backend could not be imported ({e})"
    return mod.available(gpu)
