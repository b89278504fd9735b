"""Module-level fusions that put the Triton kernels of kernels/ into a UNet or VAE, one fusion per module.

Each fusion patches `forward` on the module instances it covers (or swaps a parameterless child), so
parameter names, state dicts and the host's weight patching (ComfyUI's LoRA keys) stay exactly as they
were. Every change is recorded in an Undo; `undo()` restores the original modules. A patched forward falls
back to the original computation for any input its kernel does not cover.
"""

from __future__ import annotations

from torch import nn

from .base import Undo
from . import conv_bias, cross_attention, geglu, groupnorm, layout, qkv, resnet, sdpa_processor, skip_layernorm, upsample

FUSIONS = {"layout": layout.apply, "groupnorm": groupnorm.apply, "geglu": geglu.apply, "resnet": resnet.apply,
           "skip_layernorm": skip_layernorm.apply, "sdpa_processor": sdpa_processor.apply, "qkv": qkv.apply,
           "upsample": upsample.apply, "cross_attention": cross_attention.apply, "conv_bias": conv_bias.apply}


def apply(model: nn.Module, names: list[str] | None = None) -> tuple[Undo, dict[str, int]]:
    """Apply the named fusions (all by default). Returns the undo record and how many modules each one patched."""
    undo = Undo()
    counts = {name: FUSIONS[name](model, undo) for name in (names or list(FUSIONS))}
    return undo, counts
