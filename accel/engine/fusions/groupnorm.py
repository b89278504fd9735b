"""GroupNorm, and GroupNorm followed by SiLU, as one Triton pass over channels_last activations.

PyTorch's GroupNorm kernel wants NCHW-contiguous input, so on a channels_last UNet every GroupNorm costs two
layout copies besides its own passes; the SiLU after it is one more. Covered: diffusers ResnetBlock2D (norm1
and norm2, whose `nonlinearity` is shared with the time embedding), ldm/ComfyUI ResBlock (in_layers and
out_layers: GroupNorm, SiLU, ...), and every other GroupNorm (transformer and attention norms, the VAE).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .base import COMFY_UNET, SiLUForEmbeddings, Undo, changed_host_block, kernel_module, patch_forward, replace_child
from .registry import fusion

# ComfyUI's ResBlock gives up the SiLUs of in_layers and out_layers, which its forward applies in turn
COMFY_ATTRS = ("in_layers", "out_layers")
COMFY_PARAMS = ("x", "emb")


def _fused_forward(silu: bool):
    def forward(self: nn.GroupNorm, x):
        groupnorm = kernel_module("groupnorm")

        if x.dim() == 4 and groupnorm.supported(x):
            return groupnorm.group_norm(x, self.num_groups, self.weight, self.bias, self.eps, silu=silu)
        y = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return F.silu(y) if silu else y
    return forward


def _is_silu(m: nn.Module | None) -> bool:
    return isinstance(m, nn.SiLU)


@fusion("groupnorm")
def apply(model: nn.Module, undo: Undo) -> int:
    fused: set[int] = set()
    for m in model.modules():
        name = type(m).__name__
        if name == "ResnetBlock2D" and _is_silu(getattr(m, "nonlinearity", None)) \
                and isinstance(m.norm1, nn.GroupNorm) and isinstance(m.norm2, nn.GroupNorm):
            for norm in (m.norm1, m.norm2):
                patch_forward(norm, _fused_forward(silu=True), undo)
                fused.add(id(norm))
            replace_child(m, "nonlinearity", SiLUForEmbeddings(), undo)
        elif name == "ResBlock" and not changed_host_block(m, "ResBlock", COMFY_UNET, COMFY_ATTRS, COMFY_PARAMS) \
                and hasattr(m, "in_layers") and hasattr(m, "out_layers"):
            for seq in (m.in_layers, m.out_layers):
                if isinstance(seq[0], nn.GroupNorm) and _is_silu(seq[1]):
                    patch_forward(seq[0], _fused_forward(silu=True), undo)
                    fused.add(id(seq[0]))
                    replace_child(seq, "1", nn.Identity(), undo)
    for m in model.modules():
        if isinstance(m, nn.GroupNorm) and id(m) not in fused and m.affine:
            patch_forward(m, _fused_forward(silu=False), undo)
            fused.add(id(m))
    return len(fused)
