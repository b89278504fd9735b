"""The UNet's nearest 2x upsampling (before its convolution) through the Triton kernel, in diffusers' Upsample2D
and ldm/ComfyUI's Upsample.

PyTorch's channels_last nearest-upsampling kernel reaches a small fraction of the copy bandwidth, the slowest
memory-bound kernel of an SDXL step. Covered: 2-D upsampling by exactly two (the size a host
asks for at odd latent sizes may differ: those calls run the module's own forward), no norm, no transposed
convolution, channels_last input where the kernel runs. The convolution is the module's own, called as before,
except where the upsampling and a plain 3x3 convolution go together in the sub-pixel form
(kernels/upsample.upsample_conv3x3: 4/9 of the convolution's products).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import COMFY_UNET, Undo, changed_host_block, forward_takes, kernel_module, own_conv, patch_forward
from .registry import fusion

COMFY_PARAMS = ("x", "output_shape")  # ComfyUI's Upsample.forward, which _ldm_forward restates


def _upsample_conv(x: torch.Tensor, conv: nn.Module) -> torch.Tensor:
    """conv(nearest 2x of x): in the sub-pixel form where it covers a plain 3x3 convolution, else as two steps."""
    upsample = kernel_module("upsample")
    if (own_conv(conv) and conv.stride == (1, 1) and conv.padding == (1, 1) and conv.dilation == (1, 1)
            and conv.groups == 1 and upsample.conv_covers(x, conv.weight)):  # conv_covers: 3x3 weights
        return upsample.upsample_conv3x3(x, conv.weight, conv.bias)
    return conv(upsample.upsample_nearest2x(x))


def _twice(x: torch.Tensor, size) -> bool:
    return size is None or tuple(size) == (2 * x.shape[2], 2 * x.shape[3])


def _diffusers_covered(m: nn.Module) -> bool:
    return getattr(m, "norm", None) is None and not m.use_conv_transpose and m.interpolate


def _diffusers_forward(self, hidden_states, output_size=None, *args, **kwargs):
    upsample = kernel_module("upsample")
    if args or kwargs or not (_diffusers_covered(self) and upsample.supported(hidden_states)
                              and _twice(hidden_states, output_size)):
        return type(self).forward(self, hidden_states, output_size, *args, **kwargs)
    if self.use_conv:
        return _upsample_conv(hidden_states, self.conv if self.name == "conv" else self.Conv2d_0)
    return upsample.upsample_nearest2x(hidden_states)


def _ldm_forward(self, x, output_shape=None):
    upsample = kernel_module("upsample")
    size = None if output_shape is None else tuple(output_shape[2:4])
    if self.dims != 2 or not (upsample.supported(x) and _twice(x, size)):
        return type(self).forward(self, x, output_shape)
    return _upsample_conv(x, self.conv) if self.use_conv else upsample.upsample_nearest2x(x)


def _changed_comfy(m: nn.Module) -> bool:
    """ComfyUI's Upsample without what _ldm_forward reads of it (its conv only where it convolves) or its forward."""
    attrs = ("channels", "use_conv", "dims") + (("conv",) if getattr(m, "use_conv", False) else ())
    return changed_host_block(m, "Upsample", COMFY_UNET, attrs, COMFY_PARAMS)


def _is_ldm(m: nn.Module) -> bool:
    """ldm/ComfyUI's Upsample(channels, use_conv, dims, ...) with forward(x, output_shape)."""
    return (all(hasattr(m, a) for a in ("channels", "use_conv", "dims"))
            and forward_takes(m, "x", "output_shape"))


@fusion("upsample")
def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        name = type(m).__name__
        if name == "Upsample2D" and hasattr(m, "use_conv_transpose") and _diffusers_covered(m):
            patch_forward(m, _diffusers_forward, undo)
            n += 1
        elif name == "Upsample" and not _changed_comfy(m) and _is_ldm(m):
            patch_forward(m, _ldm_forward, undo)
            n += 1
    return n
