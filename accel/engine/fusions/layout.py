"""Keep channels_last through diffusers' Transformer2DModel and ldm/ComfyUI's SpatialTransformer.

Both end in `.permute(0, 3, 1, 2).contiguous()` (ComfyUI: `.movedim(3, 1).contiguous()`), which turns the
(B, H*W, C) tokens back into an NCHW copy; the residual add then mixes NCHW and channels_last, and every op after
it (GroupNorm, conv, upsample, the skip concatenation) pays for layout conversions. The permuted view already is
a channels_last tensor, so dropping the copy keeps the whole UNet in one layout. A 1x1 convolution proj_out
(SD1.x) then runs without its bias, which is added with the residual in one pass, and a 1x1 convolution proj_in
runs as the GEMM it is, with its bias added in the GEMM's epilogue.

ComfyUI's SpatialTransformer.forward is restated below without that copy (the same calls, the same
transformer_options bookkeeping), and so are ldm's and sgm's (A1111's classes); they serve channels_last input only,
anything else runs the original.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import (COMFY_ATTENTION, Undo, changed_host_block, comfy_forward, conv_add, patch_forward, patch_method,
                   plain_conv)
from .registry import fusion

# what _tokens, _image and the restated forward read of a SpatialTransformer; ComfyUI's forward
ATTRS = ("norm", "proj_in", "transformer_blocks", "proj_out", "use_linear")
COMFY_PARAMS = ("x", "context", "transformer_options")


def _gemm_proj_in(self, x: torch.Tensor) -> bool:
    """Whether the 1x1 convolution proj_in (SD1.x) of a channels_last input runs as one GEMM whose epilogue adds
    the bias (cuBLASLt through F.linear) instead of cuDNN's convolution and a bias pass of its own."""
    conv = self.proj_in
    linear = getattr(self, "use_linear_projection", getattr(self, "use_linear", True))
    return (not linear and plain_conv(conv) and conv.kernel_size == (1, 1) and conv.stride == (1, 1)
            and conv.dilation == (1, 1) and conv.padding in ((0, 0), "valid") and conv.groups == 1
            and conv.weight.dtype == x.dtype and x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))


def _proj_in_tokens(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """conv(x) as (B, H*W, C_out) tokens: in channels_last memory the pixels are already rows of channels."""
    b, c, h, w = x.shape
    tokens = x.permute(0, 2, 3, 1).reshape(b * h * w, c)
    return F.linear(tokens, conv.weight.reshape(conv.out_channels, c), conv.bias).view(b, h * w, conv.out_channels)


def _continuous_inputs_channels_last(self, hidden_states):
    if not _gemm_proj_in(self, hidden_states):
        return type(self)._operate_on_continuous_inputs(self, hidden_states)
    tokens = _proj_in_tokens(self.proj_in, self.norm(hidden_states))
    return tokens, tokens.shape[-1]


def _output_channels_last(self, hidden_states, residual, batch_size, height, width, inner_dim):
    if not self.use_linear_projection:
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
        return conv_add(self.proj_out, hidden_states, residual)
    else:
        hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
    return hidden_states + residual


def _channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def _tokens(self, x: torch.Tensor) -> torch.Tensor:
    """norm and proj_in of a SpatialTransformer (ComfyUI's, ldm's, sgm's: the same parts) as (B, H*W, C) tokens."""
    if _gemm_proj_in(self, x):
        return _proj_in_tokens(self.proj_in, self.norm(x))
    x = self.norm(x)
    if not self.use_linear:
        x = self.proj_in(x)
    x = x.movedim(1, 3).flatten(1, 2).contiguous()
    return self.proj_in(x) if self.use_linear else x


def _image(self, x: torch.Tensor, x_in: torch.Tensor) -> torch.Tensor:
    """proj_out of the tokens, as a channels_last view of the image (no NCHW copy), plus the block's input."""
    h, w = x_in.shape[-2:]
    if self.use_linear:
        x = self.proj_out(x)
    x = x.reshape(x.shape[0], h, w, x.shape[-1]).movedim(3, 1)
    if not self.use_linear:
        return conv_add(self.proj_out, x, x_in)
    return x + x_in


def _spatial_transformer_channels_last(self, x, context=None, transformer_options={}):  # noqa: B006 (ComfyUI's)
    if not _channels_last(x):
        return type(self).forward(self, x, context, transformer_options)
    if not isinstance(context, list):
        context = [context] * len(self.transformer_blocks)
    transformer_options["activations_shape"] = list(x.shape)
    x_in, x = x, _tokens(self, x)
    for i, block in enumerate(self.transformer_blocks):
        transformer_options["block_index"] = i
        x = block(x, context=context[i], transformer_options=transformer_options)
    return _image(self, x, x_in)


def _ldm_spatial_transformer_channels_last(self, x, context=None):
    """ldm's (A1111's SD1.x/SD2.x) and sgm's (its SDXL) SpatialTransformer.forward without the NCHW copy."""
    if not _channels_last(x):
        return type(self).forward(self, x, context)
    if not isinstance(context, list):
        context = [context]
    sgm = type(self).__module__.startswith("sgm.")  # sgm gives every block the one context it was given
    x_in, x = x, _tokens(self, x)
    for i, block in enumerate(self.transformer_blocks):
        x = block(x, context=context[0 if sgm and len(context) == 1 else i])
    return _image(self, x, x_in)


def _comfy_spatial_transformer(m: nn.Module) -> bool:
    """ComfyUI's SpatialTransformer as restated above: the same parts and forward(x, context, transformer_options)."""
    if type(m).__name__ != "SpatialTransformer" \
            or changed_host_block(m, "SpatialTransformer", COMFY_ATTENTION, ATTRS, COMFY_PARAMS) \
            or not all(hasattr(m, a) for a in ATTRS):
        return False
    return comfy_forward(m)


def _ldm_spatial_transformer(m: nn.Module) -> bool:
    """ldm's or sgm's SpatialTransformer (the repositories A1111 runs): the same parts, forward(x, context)."""
    return (type(m).__name__ == "SpatialTransformer" and type(m).__module__.startswith(("ldm.", "sgm."))
            and all(hasattr(m, a) for a in ATTRS))


@fusion("layout")
def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if type(m).__name__ == "Transformer2DModel" and hasattr(m, "_get_output_for_continuous_inputs"):
            patch_method(m, "_get_output_for_continuous_inputs", _output_channels_last, undo)
            patch_method(m, "_operate_on_continuous_inputs", _continuous_inputs_channels_last, undo)
            n += 1
        elif _comfy_spatial_transformer(m):
            patch_forward(m, _spatial_transformer_channels_last, undo)
            n += 1
        elif _ldm_spatial_transformer(m):
            patch_forward(m, _ldm_spatial_transformer_channels_last, undo)
            n += 1
    return n
