"""A ResNet block's bias and residual adds folded into its neighbours.

PyTorch adds a convolution's bias in a pass of its own after cuDNN's kernel, and a UNet ResNet block then adds
the time embedding and, after the second convolution, the residual: four full passes over the activations
(five with a 1x1 shortcut convolution) that do no more than add. Here the convolutions run without bias; the
GroupNorm kernel adds the time embedding (N, C) and conv1's bias (C,) while it reads (stats and normalize), and
conv2's bias (plus the shortcut's) is added with the residual in one pass (ONNX Runtime's SkipGroupNorm and
BiasAdd). The SiLU of the time embedding, the same tensor in every block, runs once per call. SD1.5 has 22 such
blocks, SDXL 35.

Covered: diffusers ResnetBlock2D and ldm/ComfyUI ResBlock in their plain form (no up/down sampling inside the
block, the time embedding added, not scale-shift, output scale 1) on channels_last input where the Triton
kernels run; any other call runs the block's own forward. Weights are read from the modules at every call, so
the host's weight patches (LoRA) apply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Undo, add_bias_residual_nchw, conv_without_bias, kernel_module, patch_forward, plain_conv
from .groupnorm import _SiLUForEmbeddings


def _runs(x: torch.Tensor, convs: list[nn.Module]) -> bool:
    groupnorm = kernel_module("groupnorm")
    return (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and groupnorm.supported(x)
            and all(c.weight.dtype == x.dtype and c.weight.device == x.device for c in convs))


def _block(x: torch.Tensor, norm1: nn.GroupNorm, conv1: nn.Conv2d, t: torch.Tensor | None, norm2: nn.GroupNorm,
           conv2: nn.Conv2d, shortcut: nn.Conv2d | None) -> torch.Tensor:
    """norm1+SiLU -> conv1 -> (+ t + conv1 bias) norm2+SiLU -> conv2 -> + conv2 bias + shortcut(x)."""
    groupnorm = kernel_module("groupnorm")
    h = groupnorm.group_norm(x, norm1.num_groups, norm1.weight, norm1.bias, norm1.eps, silu=True)
    h = conv_without_bias(conv1, h)
    shift = conv1.bias.to(h.dtype).expand(h.shape[0], -1) if t is None else t  # the kernel reads any float dtype
    h = groupnorm.group_norm(h, norm2.num_groups, norm2.weight, norm2.bias, norm2.eps, silu=True, shift=shift,
                             shift_bias=None if t is None else conv1.bias)
    h = conv_without_bias(conv2, h)
    bias = conv2.bias
    if shortcut is not None:
        x, bias = conv_without_bias(shortcut, x), bias + shortcut.bias
    return add_bias_residual_nchw(h, bias, x)


def _is_silu(m: nn.Module) -> bool:
    # after the groupnorm fusion the norms' SiLU is part of the norm: the module left is an Identity or
    # diffusers' embeddings-only SiLU
    return isinstance(m, (nn.SiLU, nn.Identity, _SiLUForEmbeddings))


def _diffusers_covered(m: nn.Module) -> bool:
    return (m.upsample is None and m.downsample is None and m.time_embedding_norm == "default"
            and m.output_scale_factor == 1.0 and _is_silu(m.nonlinearity)
            and isinstance(m.norm1, nn.GroupNorm) and isinstance(m.norm2, nn.GroupNorm)
            and m.norm1.affine and m.norm2.affine and plain_conv(m.conv1) and plain_conv(m.conv2)
            and (m.conv_shortcut is None or plain_conv(m.conv_shortcut)))


class _SharedSiLU:
    """SiLU of the time embedding, once per UNet call: every ResNet block of a call applies it to the same tensor
    (22 launches per SD1.5 step, 35 per SDXL step, become one). Kept as one tuple so that a lookup never pairs
    one call's input with another's output."""

    def __init__(self) -> None:
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, emb: torch.Tensor) -> torch.Tensor:
        last = self.last
        if last is not None and last[0] is emb:
            return last[1]
        out = F.silu(emb)
        self.last = (emb, out)
        return out

    def clear(self) -> None:
        self.last = None


def _diffusers_forward(silu: _SharedSiLU):
    def forward(self, input_tensor, temb, *args, **kwargs):
        convs = [self.conv1, self.conv2] + ([self.conv_shortcut] if self.conv_shortcut is not None else [])
        if args or kwargs or (self.training and self.dropout.p) or not (_diffusers_covered(self)
                                                                         and _runs(input_tensor, convs)):
            return type(self).forward(self, input_tensor, temb, *args, **kwargs)
        t = None
        if self.time_emb_proj is not None and temb is not None:
            t = self.time_emb_proj(temb if self.skip_time_act else silu(temb))
        return _block(input_tensor, self.norm1, self.conv1, t, self.norm2, self.conv2, self.conv_shortcut)
    return forward


def _ldm_parts(m: nn.Module):
    """(norm1, conv1, emb Linear, norm2, conv2, shortcut conv or None) of a plain ldm ResBlock, else None."""
    if getattr(m, "updown", False) or getattr(m, "use_scale_shift_norm", False) or \
            getattr(m, "exchange_temb_dims", False) or getattr(m, "skip_t_emb", False):
        return None
    ins, emb, outs = m.in_layers, m.emb_layers, m.out_layers
    if not (len(ins) == 3 and len(emb) == 2 and len(outs) == 4):
        return None
    norm1, act1, conv1 = ins
    act_e, linear = emb
    norm2, act2, drop, conv2 = outs
    skip = m.skip_connection
    if not (isinstance(norm1, nn.GroupNorm) and isinstance(norm2, nn.GroupNorm) and norm1.affine and norm2.affine
            and _is_silu(act1) and _is_silu(act2) and isinstance(act_e, nn.SiLU) and isinstance(linear, nn.Linear)
            and isinstance(drop, nn.Dropout) and plain_conv(conv1) and plain_conv(conv2)
            and (isinstance(skip, nn.Identity) or plain_conv(skip))):
        return None
    return norm1, conv1, emb, norm2, conv2, None if isinstance(skip, nn.Identity) else skip


def _ldm_forward(silu: _SharedSiLU):
    def forward(self, x, emb):
        parts = _ldm_parts(self)
        if parts is None or (self.training and self.out_layers[2].p):
            return type(self).forward(self, x, emb)
        norm1, conv1, emb_layers, norm2, conv2, skip = parts
        if not _runs(x, [c for c in (conv1, conv2, skip) if c is not None]):
            return type(self).forward(self, x, emb)
        return _block(x, norm1, conv1, emb_layers[1](silu(emb)), norm2, conv2, skip)
    return forward


def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    silu = _SharedSiLU()
    undo.add(silu.clear)
    for m in model.modules():
        name = type(m).__name__
        if name == "ResnetBlock2D" and _diffusers_covered(m):
            patch_forward(m, _diffusers_forward(silu), undo)
            n += 1
        elif name == "ResBlock" and hasattr(m, "in_layers") and _ldm_parts(m) is not None:
            patch_forward(m, _ldm_forward(silu), undo)
            n += 1
    return n
