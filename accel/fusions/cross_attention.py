"""Attention over a short key set (a cross-attention's text context, 77 tokens) through the Triton kernel of
kernels/attention.py, where it was measured faster than cuDNN's (`attention.config` says where: 64-wide heads).

The fusion marks the attention modules it covers (diffusers' Attention with the sdpa_processor fusion's processor,
ComfyUI's CrossAttention with the qkv fusion's forward); those two call `attend` in place of SDPA and get None
back wherever the kernel does not cover the call (other head sizes, long key sets, fp32), which then runs as before.
In ComfyUI only calls that would have gone to its PyTorch attention are taken: another attention function chosen by
the user (sage, xformers, ...) or a model patch's attention override keeps its call.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from . import qkv
from .base import Undo, kernel_module

_MARK = "_sd_accel_short_keys"


def attend(m: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor | None:
    """softmax(q k^T / sqrt(d)) v for (B, tokens, heads * d) q, k and v, as (B, Lq, heads * d); None where the
    module is not marked or the kernel does not cover the call."""
    if not m.__dict__.get(_MARK) or q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        return None
    (B, Lq, C), Lk = q.shape, k.shape[1]
    if C % heads or k.shape[2] != C or k.shape[0] != B or q.stride(-1) != 1 or k.stride(-1) != 1 \
            or v.stride(-1) != 1:
        return None
    d = C // heads
    qh, kh, vh = q.view(B, Lq, heads, d), k.view(B, Lk, heads, d), v.view(B, Lk, heads, d)
    attention = kernel_module("attention")
    if not attention.covers(qh, kh):
        return None
    return attention.attention(qh, kh, vh).view(B, Lq, C)


def comfy_pytorch_attention(m: nn.Module, transformer_options: dict) -> bool:
    """Whether a ComfyUI CrossAttention call would go to ComfyUI's PyTorch attention (the default on NVIDIA and
    AMD GPUs), with no attention override from a model patch."""
    module = sys.modules.get(type(m).__module__)
    pytorch = getattr(module, "attention_pytorch", None)
    return (pytorch is not None and getattr(module, "optimized_attention", None) is pytorch
            and "optimized_attention_override" not in (transformer_options or {}))


def _covered(m: nn.Module) -> bool:
    name = type(m).__name__
    return (name == "Attention" and type(getattr(m, "processor", None)).__name__ == "PlainSDPAProcessor") or \
        (name == "CrossAttention" and "forward" in m.__dict__ and qkv._QKV in m.__dict__)


def apply(model: nn.Module, undo: Undo) -> int:
    """Mark the attention modules whose (already fused) forward calls `attend`: run after sdpa_processor and qkv."""
    marked = [m for m in model.modules() if _covered(m)]
    for m in marked:
        m.__dict__[_MARK] = True

    def unmark() -> None:
        for m in marked:
            m.__dict__.pop(_MARK, None)

    undo.add(unmark)
    return len(marked)
