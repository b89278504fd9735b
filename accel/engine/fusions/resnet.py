"""A ResNet block's bias and residual adds folded into its neighbours.

PyTorch adds a convolution's bias in a pass of its own after cuDNN's kernel, and a UNet ResNet block then adds
the time embedding and, after the second convolution, the residual: four full passes over the activations
(five with a 1x1 shortcut convolution) that do no more than add. Here the convolutions run without bias; the
GroupNorm kernel adds the time embedding (N, C) and conv1's bias (C,) while it reads (stats and normalize), and
conv2's bias (plus the shortcut's) is added with the residual in one pass (ONNX Runtime's SkipGroupNorm and
BiasAdd). The time embedding, the same tensor in every block, gets its SiLU once per call and the projections of
all blocks as one GEMM. SD1.5 has 22 such blocks, SDXL 17.

Covered: diffusers ResnetBlock2D and ldm/ComfyUI ResBlock in their plain form (no up/down sampling inside the
block, the time embedding added, not scale-shift, output scale 1) on channels_last input where the Triton
kernels run; any other call runs the block's own forward. Weights are read from the modules at every call, so
the host's weight patches (LoRA) apply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import packing
from .base import (COMFY_UNET, SiLUForEmbeddings, Undo, add_bias_residual_nchw, changed_host_block, conv_without_bias,
                   kernel_module, patch_forward, plain_conv, plain_linear)
from .registry import fusion

# what _ldm_parts and the fused forward read of ComfyUI's ResBlock, and the forward that forward restates
COMFY_ATTRS = ("updown", "use_scale_shift_norm", "exchange_temb_dims", "skip_t_emb", "in_layers", "emb_layers",
               "out_layers", "skip_connection")
COMFY_PARAMS = ("x", "emb")


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
    if shortcut is None:
        return add_bias_residual_nchw(h, conv2.bias, x)
    return add_bias_residual_nchw(h, conv2.bias, conv_without_bias(shortcut, x), shortcut.bias)


def _is_silu(m: nn.Module) -> bool:
    # where the groupnorm fusion ran (before or after this one) the norms' SiLU is part of the norm: the module
    # left is an Identity or diffusers' embeddings-only SiLU
    return isinstance(m, (nn.SiLU, nn.Identity, SiLUForEmbeddings))


def _diffusers_covered(m: nn.Module) -> bool:
    return (m.upsample is None and m.downsample is None and m.time_embedding_norm == "default"
            and m.output_scale_factor == 1.0 and _is_silu(m.nonlinearity)
            and isinstance(m.norm1, nn.GroupNorm) and isinstance(m.norm2, nn.GroupNorm)
            and m.norm1.affine and m.norm2.affine and plain_conv(m.conv1) and plain_conv(m.conv2)
            and (m.conv_shortcut is None or plain_conv(m.conv_shortcut)))


class _TimeProjections:
    """SiLU of the time embedding and every block's projection of it, once per UNet call: every ResNet block of a
    call projects the same tensor, so the SiLU (22 launches per SD1.5 step, 17 per SDXL step) runs once and the
    projections, packed into one weight buffer (packing.py), are one GEMM whose output the blocks slice. The SiLU
    is kept as one tuple so that a lookup never pairs one call's input with another's output."""

    def __init__(self, shared: packing.SharedInput | None, index: dict[int, int]) -> None:
        self.shared, self.index = shared, index
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    def silu(self, emb: torch.Tensor) -> torch.Tensor:
        last = self.last
        if last is not None and last[0] is emb:
            return last[1]
        out = F.silu(emb)
        self.last = (emb, out)
        return out

    def __call__(self, linear: nn.Module, emb: torch.Tensor) -> torch.Tensor:
        """linear(silu(emb))."""
        e = self.silu(emb)
        i = self.index.get(id(linear))
        t = None if i is None else self.shared.output(e, i)
        return linear(e) if t is None else t

    def clear(self) -> None:
        self.last = None


def _diffusers_forward(time: _TimeProjections):
    def forward(self, input_tensor, temb, *args, **kwargs):
        convs = [self.conv1, self.conv2] + ([self.conv_shortcut] if self.conv_shortcut is not None else [])
        if args or kwargs or (self.training and self.dropout.p) or not (_diffusers_covered(self)
                                                                         and _runs(input_tensor, convs)):
            return type(self).forward(self, input_tensor, temb, *args, **kwargs)
        t = None
        if self.time_emb_proj is not None and temb is not None:
            t = self.time_emb_proj(temb) if self.skip_time_act else time(self.time_emb_proj, temb)
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
            and _is_silu(act1) and _is_silu(act2) and isinstance(act_e, nn.SiLU) and plain_linear(linear)
            and isinstance(drop, nn.Dropout) and plain_conv(conv1) and plain_conv(conv2)
            and (isinstance(skip, nn.Identity) or plain_conv(skip))):
        return None
    return norm1, conv1, emb, norm2, conv2, None if isinstance(skip, nn.Identity) else skip


def _ldm_forward(time: _TimeProjections):
    def forward(self, x, emb, *args, **kwargs):
        # Forge passes its transformer_options, where a group_norm_wrapper replaces the block's norms.
        options = args[0] if args else kwargs.get("transformer_options") or {}
        parts = _ldm_parts(self)
        if parts is None or (self.training and self.out_layers[2].p) or "group_norm_wrapper" in options:
            return type(self).forward(self, x, emb, *args, **kwargs)
        norm1, conv1, emb_layers, norm2, conv2, skip = parts
        if not _runs(x, [c for c in (conv1, conv2, skip) if c is not None]):
            return type(self).forward(self, x, emb, *args, **kwargs)
        return _block(x, norm1, conv1, time(emb_layers[1], emb), norm2, conv2, skip)
    return forward


def _time_projection(m: nn.Module) -> nn.Module | None:
    """The Linear a covered block applies to the SiLU of the time embedding, if any."""
    if type(m).__name__ == "ResnetBlock2D":
        return None if m.skip_time_act else m.time_emb_proj
    return _ldm_parts(m)[2][1]


@fusion("resnet")
def apply(model: nn.Module, undo: Undo) -> int:
    blocks = [m for m in model.modules()
              if (type(m).__name__ == "ResnetBlock2D" and _diffusers_covered(m))
              or (type(m).__name__ == "ResBlock"
                  and not changed_host_block(m, "ResBlock", COMFY_UNET, COMFY_ATTRS, COMFY_PARAMS)
                  and hasattr(m, "in_layers") and _ldm_parts(m) is not None)]
    layers = [p for p in map(_time_projection, blocks) if p is not None and plain_linear(p)]
    shared, index = None, {}
    if packing.packable(layers):
        shared = packing.SharedInput(packing.pack(model, layers))
        index = {id(layer): i for i, layer in enumerate(layers)}
        packing.track_calls(model, [shared], undo)
    time = _TimeProjections(shared, index)
    undo.add(time.clear)
    for m in blocks:
        patch_forward(m, (_diffusers_forward if type(m).__name__ == "ResnetBlock2D" else _ldm_forward)(time), undo)
    return len(blocks)
