"""Module-level fusions that put the Triton kernels of kernels/ into a UNet or VAE, one fusion per module.

Each fusion patches `forward` on the module instances it covers (or swaps a parameterless child), so
parameter names, state dicts and the host's weight patching (ComfyUI's LoRA keys) stay exactly as they
were. Every change is recorded in an Undo; `undo()` restores the original modules. A patched forward falls
back to the original computation for any input its kernel does not cover.

Each module declares its fusion (registry.fusion) with the fusions it must run after; ORDER is the one order
they run in, whichever of them a caller asks for.
"""

from __future__ import annotations

import importlib
from typing import Iterable

from torch import nn

from ...errors import BadInput
from . import base, packing, registry
from .base import Undo

# Importing a fusion module declares its fusion. Where no `after` orders two fusions, they run in this listing's
# order.
MODULES = ("layout", "groupnorm", "geglu", "resnet", "skip_layernorm", "sdpa_processor", "upsample", "qkv",
           "cross_attention", "conv_bias", "flux", "chroma", "flux_diffusers", "mmdit", "mmdit_diffusers", "wan",
           "qwen_image", "z_image", "ltx2")
for _module in MODULES:
    importlib.import_module(f".{_module}", __name__)
del _module

FUSIONS: dict[str, registry.Fusion] = {f.name: f for f in registry.order(registry.declared())}
ORDER: tuple[str, ...] = tuple(FUSIONS)
# The diffusion transformers' fusions; the others are the UNets' and the VAE's. Unnamed, a model gets its kind's.
DIT: tuple[str, ...] = ("flux", "chroma", "flux_diffusers", "mmdit", "mmdit_diffusers", "wan", "qwen_image",
                         "z_image", "ltx2")

__all__ = ["FUSIONS", "ORDER", "Undo", "apply", "block_stack", "base", "packing", "registry"]


def block_stack(model: nn.Module):
    """The block stack CUDA graphs may capture alone (accel/engine/stack_graphs.py), as the fusion that patched the
    model's blocks declares it; None where none does."""
    for f in FUSIONS.values():
        stack = f.stack(model) if f.stack is not None else None
        if stack is not None:
            return stack
    return None


def apply(model: nn.Module, names: Iterable[str] | None = None) -> tuple[Undo, dict[str, int]]:
    """Apply the named fusions (None: all of its kind, DiT or not) in ORDER, whatever order they are named in. Returns
    the undo record and how many modules each one patched. A fusion that fails leaves the model as it was."""
    if names is None:
        from ...models.dit import is_dit

        dit = is_dit(model)
        chosen = tuple(n for n in ORDER if (n in DIT) == dit)
    else:
        if isinstance(names, str):
            raise BadInput(f"The fusions to apply are given as the string {names!r}.",
                           f"Give a list of names; the fusions are: {', '.join(ORDER)}.")
        wanted = list(names)
        unknown = [n for n in wanted if n not in FUSIONS]
        if unknown:
            raise BadInput(f"No fusion is named {', '.join(map(repr, unknown))}.",
                           f"The fusions are: {', '.join(ORDER)}.")
        chosen = tuple(n for n in ORDER if n in wanted)
    undo = Undo()
    counts = {}
    try:
        for name in chosen:
            counts[name] = FUSIONS[name].apply(model, undo)
    except BaseException:
        undo()
        raise
    return undo, counts
