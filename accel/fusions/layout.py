"""Keep channels_last through diffusers' Transformer2DModel.

Its output path ends in `.permute(0, 3, 1, 2).contiguous()`, which turns the (B, H*W, C) tokens back into an
NCHW copy; the residual add then mixes NCHW and channels_last, and every op after it (GroupNorm, conv,
upsample, the skip concatenation) pays for layout conversions. The permuted view already is a channels_last
tensor, so dropping the copy keeps the whole UNet in one layout.
"""

from __future__ import annotations

from torch import nn

from .base import Undo, patch_method


def _output_channels_last(self, hidden_states, residual, batch_size, height, width, inner_dim):
    if not self.use_linear_projection:
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
        hidden_states = self.proj_out(hidden_states)
    else:
        hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
    return hidden_states + residual


def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if type(m).__name__ == "Transformer2DModel" and hasattr(m, "_get_output_for_continuous_inputs"):
            patch_method(m, "_get_output_for_continuous_inputs", _output_channels_last, undo)
            n += 1
    return n
