"""Backends: one interface.

Each backend module exposes
    available(gpu: GpuInfo) -> tuple[bool, str]        whether it can run here, and why not
    build(unet: CanonicalUNet, options, runtime: Runtime, progress: Progress) -> Engine
where options is the backend's dataclass in accel/plan/options.py (TorchOptions, OrtOptions).
An Engine is called like the canonical UNet, `engine(x, timesteps, context, y=None, control=None)`,
has `backend` (its name) and `release()` (frees what it holds on the device).
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch

# A TensorRT backend is planned; it is offered nowhere until it exists and has run.
BACKENDS = {"torch": ".torch_fused", "onnxruntime": ".onnxruntime"}


class Engine(Protocol):
    backend: str

    def __call__(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                 y: torch.Tensor | None = None, control: dict | None = None, **kwargs: Any) -> torch.Tensor: ...

    def release(self) -> None: ...


def load(name: str):
    """The backend module by name."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name], __name__)

