"""Attention over a short key set (a cross-attention's text context, 77 tokens) through the Triton kernel of
kernels/attention.py where it was measured faster than cuDNN's (`attention.config` says where: 64-wide heads), and
on NVIDIA through PyTorch's flash or memory-efficient kernel for other head sizes, which, unlike cuDNN's, build no
plan per image size (`base.attend`).

The fusion marks the attention modules it covers (diffusers' Attention with the sdpa_processor fusion's processor,
ComfyUI's CrossAttention with the qkv fusion's forward); those two call `base.attend` in place of SDPA and get None
back wherever it does not take the call (long key sets, the CPU, fp32 where the kernel would be chosen), which then
runs as before. In ComfyUI, where the user chose another attention function for the whole host (sage, flash,
xformers, ...), the two are timed against each other per shape and the faster runs (accel/engine/host_attention.py); a
model patch's attention override, or another node's function put in its place, keeps its call.
"""

from __future__ import annotations

from torch import nn

from .base import (COMFY_ATTENTION, CROSS_ATTENTION_ATTRS, CROSS_ATTENTION_PARAMS, Undo, changed_host_block,
                   mark_short_keys, projections)
from .registry import fusion


def _covered(m: nn.Module) -> bool:
    name = type(m).__name__
    return (name == "Attention" and type(getattr(m, "processor", None)).__name__ == "PlainSDPAProcessor") or \
        (name == "CrossAttention" and "forward" in m.__dict__ and projections(m) is not None
         and not changed_host_block(m, "CrossAttention", COMFY_ATTENTION, CROSS_ATTENTION_ATTRS,
                                    CROSS_ATTENTION_PARAMS))


# A module is marked only where the forward another fusion gave it calls `attend`: sdpa_processor's processor, or
# qkv's ComfyUI forward (with the entry qkv keeps for a module whose projections it packed).
@fusion("cross_attention", after=("sdpa_processor", "qkv"))
def apply(model: nn.Module, undo: Undo) -> int:
    marked = [m for m in model.modules() if _covered(m)]
    for m in marked:
        mark_short_keys(m, undo)
    return len(marked)
