"""The UNet's nearest 2x upsampling (before its convolution) through the Triton kernel, in diffusers' Upsample2D
and ldm/ComfyUI's Upsample.

PyTorch's channels_last nearest-upsampling kernel was the slowest memory-bound kernel of an SDXL step on an H100
(two calls, 0.20 ms: about a tenth of the copy bandwidth). Covered: 2-D upsampling by exactly two (the size a host
asks for at odd latent sizes may differ: those calls run the module's own forward), no norm, no transposed
convolution, channels_last input where the kernel runs. The convolution is the module's own, called as before.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import Undo, forward_takes, kernel_module, patch_forward


def _twice(x: torch.Tensor, size) -> bool:
    return size is None or tuple(size) == (2 * x.shape[2], 2 * x.shape[3])


def _diffusers_covered(m: nn.Module) -> bool:
    return getattr(m, "norm", None) is None and not m.use_conv_transpose and m.interpolate


def _diffusers_forward(self, hidden_states, output_size=None, *args, **kwargs):
    upsample = kernel_module("upsample")
    if args or kwargs or not (_diffusers_covered(self) and upsample.supported(hidden_states)
                              and _twice(hidden_states, output_size)):
        return type(self).forward(self, hidden_states, output_size, *args, **kwargs)
    h = upsample.upsample_nearest2x(hidden_states)
    if self.use_conv:
        h = (self.conv if self.name == "conv" else self.Conv2d_0)(h)
    return h


def _ldm_forward(self, x, output_shape=None):
    upsample = kernel_module("upsample")
    size = None if output_shape is None else tuple(output_shape[2:4])
    if self.dims != 2 or not (upsample.supported(x) and _twice(x, size)):
        return type(self).forward(self, x, output_shape)
    h = upsample.upsample_nearest2x(x)
    return self.conv(h) if self.use_conv else h


def _is_ldm(m: nn.Module) -> bool:
    """ldm/ComfyUI's Upsample(channels, use_conv, dims, ...) with forward(x, output_shape)."""
    return (all(hasattr(m, a) for a in ("channels", "use_conv", "dims"))
            and forward_takes(m, "x", "output_shape"))


def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        name = type(m).__name__
        if name == "Upsample2D" and hasattr(m, "use_conv_transpose") and _diffusers_covered(m):
            patch_forward(m, _diffusers_forward, undo)
            n += 1
        elif name == "Upsample" and _is_ldm(m):
            patch_forward(m, _ldm_forward, undo)
            n += 1
    return n
