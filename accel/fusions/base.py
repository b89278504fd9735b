"""What every fusion shares: patching an instance's forward or a child module, with a way back."""

from __future__ import annotations

import importlib
import inspect
import importlib.util
import sys
import types
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
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


def plain_weights(m: nn.Module) -> bool:
    """A layer whose forward uses its own weight and bias as stored: not ComfyUI's cast-on-the-fly or lowvram
    weight functions, which its forward applies and a fused kernel reading the weight directly would skip."""
    return (not getattr(m, "comfy_cast_weights", False) and not getattr(m, "weight_function", None)
            and not getattr(m, "bias_function", None))


def forward_takes(m: nn.Module, *params: str) -> bool:
    """Whether the forward of m's class takes exactly these parameters (after self): the form a fusion restates."""
    return list(inspect.signature(type(m).forward).parameters) == ["self", *params]


def comfy_forward(m: nn.Module) -> bool:
    """A ComfyUI transformer module whose forward is (x, context, transformer_options), the form the fusions
    restate."""
    return forward_takes(m, "x", "context", "transformer_options")


def forge_plain(m: nn.Module) -> bool:
    """Forge's layer classes (backend.operations) when their forward is the plain op on their own weight and bias:
    no per-layer cast or streaming, no online LoRA, no fp8 scale."""
    return (hasattr(m, "parameters_manual_cast") and not m.parameters_manual_cast
            and not getattr(m, "forge_online_loras", None) and getattr(m, "scale_weight", None) is None
            and isinstance(getattr(m, "weight", None), torch.Tensor))


def plain_linear(m: nn.Module) -> bool:
    """nn.Linear, or ComfyUI's or Forge's Linear without cast or weight functions: a forward that is F.linear of its
    own weight and bias. Any other subclass (a LoRA layer adds its own terms) is left to its forward."""
    return (type(m) is nn.Linear or (isinstance(m, nn.Linear) and hasattr(m, "comfy_cast_weights") and plain_weights(m))
            or (type(m).__name__ == "Linear" and hasattr(m, "in_features") and forge_plain(m)))


def plain_conv(conv: nn.Module) -> bool:
    """A Conv2d whose forward is F.conv2d of its own weight and bias."""
    return (isinstance(conv, nn.Conv2d) and conv.bias is not None and conv.padding_mode == "zeros"
            and plain_weights(conv))


def own_conv(conv: nn.Module) -> bool:
    """torch's or ComfyUI's Conv2d computing F.conv2d of its own weight and bias: a subclass that restates forward
    (a LoRA-compatible layer) is not."""
    return ((type(conv) is nn.Conv2d or (isinstance(conv, nn.Conv2d) and hasattr(conv, "comfy_cast_weights"))
             or (isinstance(conv, nn.Conv2d) and forge_plain(conv))) and plain_conv(conv))


def conv_without_bias(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)


def add_bias_residual_nchw(h: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None,
                           bias2: torch.Tensor | None = None) -> torch.Tensor:
    """h + bias (+ bias2, per channel) (+ residual) for channels_last (N, C, H, W) tensors, in one pass of the
    Triton kernel."""
    # channels_last (N, C, H, W) is (N, H, W, C) in memory: the bias runs along the last dimension of that view.
    nhwc = (0, 2, 3, 1)
    layernorm = kernel_module("layernorm")
    r = None if residual is None else residual.permute(nhwc)
    return layernorm.add_bias_residual(h.permute(nhwc), bias, r, bias2).permute(0, 3, 1, 2)


def bias_pass_runs(conv: nn.Module, x: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether conv(x)'s bias can be added in the bias kernel's pass over t, a channels_last tensor of its output's
    layout (the output itself, or the residual added to it)."""
    return (plain_conv(conv) and t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
            and not t.is_contiguous() and conv.weight.dtype == x.dtype and kernel_module("layernorm").supported(t))


def conv_add(conv: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """conv(x) + residual, with the conv's bias added in the residual's pass where the kernel runs on them."""
    if bias_pass_runs(conv, x, residual):
        return add_bias_residual_nchw(conv_without_bias(conv, x), conv.bias, residual)
    return conv(x) + residual
