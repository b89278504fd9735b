"""The bias of the UNet's remaining convolutions (conv_in, conv_out, the down- and upsamplers') added in one
vectorized pass of the bias kernel (ONNX Runtime's BiasAdd).

On channels_last fp16, PyTorch runs cuDNN's convolution and then adds the bias in a broadcast kernel that is not
vectorized. The ResNet blocks' and transformers' convolutions already have their bias added by a neighbouring
kernel (fusions/resnet.py, fusions/layout.py); this covers the convolutions whose own forward is still called.

Covered: torch's Conv2d and ComfyUI's Conv2d without cast or weight functions (a LoRA layer's or lowvram's forward
runs as it is), with a bias, on channels_last input where the kernel runs. The weights are read at every call.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import Undo, add_bias_residual_nchw, bias_pass_runs, conv_without_bias, own_conv, patch_forward
from .registry import fusion


def _forward(self: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    # apply() checked the class; bias_pass_runs checks what a host may change later (cast and weight functions).
    if bias_pass_runs(self, x, x):  # the output keeps the input's channels_last layout
        return add_bias_residual_nchw(conv_without_bias(self, x), self.bias, None)
    return type(self).forward(self, x)


@fusion("conv_bias")
def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Conv2d) and m.bias is not None and own_conv(m):
            patch_forward(m, _forward, undo)
            n += 1
    return n
