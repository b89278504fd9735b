"""Chroma's blocks (ComfyUI's comfy.ldm.chroma.layers) with the DiT kernels: Flux's block layout (fusions/transformer.py
computes them), with the modulations handed in by the model (its approximator runs once per call) instead of
projected in each block, and LayerNorm modules in place of Flux's functional ones (the same normalization: no affine,
eps 1e-6).

A call it does not cover runs the block's own forward: an attention mask, an attention override or another node's
attention function in ComfyUI, Linear layers with per-call weight functions (lowvram), a tensor the kernels cannot run
on.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import Undo, host_block, kernel_module, patch_forward, reads_comfy_attention
from .registry import fusion
from .transformer import (EPS, FLUX_ATTENTION, covered, double_block, fused_call, linears, plain_layer_norms,
                          single_block)

LAYERS = "comfy.ldm.chroma.layers"  # until ComfyUI 0.3.6x; 0.33's Chroma builds its blocks from Flux's classes

# what the fused forwards (transformer.covered, double_block, single_block) read of each block
DOUBLE_ATTRS = ("num_heads", "img_attn", "txt_attn", "img_mlp", "txt_mlp", "img_norm1", "img_norm2", "txt_norm1",
                "txt_norm2")
DOUBLE_PARAMS = ("img", "txt", "pe", "vec", "attn_mask", "transformer_options")
SINGLE_ATTRS = ("num_heads", "linear1", "linear2", "norm", "pre_norm", "mlp_act", "mlp_hidden_dim")
SINGLE_PARAMS = ("x", "pe", "vec", "attn_mask", "transformer_options")
LAST_ATTRS = ("norm_final", "linear")


def _double_forward(self, img, txt, pe, vec, attn_mask=None, transformer_options={}):  # noqa: B006 (ComfyUI's)
    if not fused_call(img, transformer_options, attn_mask is not None, img.dtype != txt.dtype,
                      pe is not None and pe.dtype != torch.float32):
        return type(self).forward(self, img, txt, pe, vec, attn_mask, transformer_options)
    (img_mod1, img_mod2), (txt_mod1, txt_mod2) = vec
    # Chroma's forward puts the text first whatever flipped_img_txt says
    return double_block(self, img, txt, pe, (img_mod1, img_mod2, txt_mod1, txt_mod2), flipped=False)


def _single_forward(self, x, pe, vec, attn_mask=None, transformer_options={}):  # noqa: B006 (ComfyUI's)
    if not fused_call(x, transformer_options, attn_mask is not None, pe is not None and pe.dtype != torch.float32):
        return type(self).forward(self, x, pe, vec, attn_mask, transformer_options)
    return single_block(self, x, pe, vec)


def _last_forward(self, x, vec):
    if not kernel_module("adaln").supported(x):
        return type(self).forward(self, x, vec)
    shift, scale = vec
    return self.linear(kernel_module("adaln").modulated_layer_norm(x, scale, shift, EPS))


@fusion("chroma")
def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if host_block(m, "DoubleStreamBlock", LAYERS, DOUBLE_ATTRS, DOUBLE_PARAMS):
            if not covered(m) or not plain_layer_norms(m.img_norm1, m.img_norm2, m.txt_norm1, m.txt_norm2):
                continue
            patch_forward(m, _double_forward, undo)
        elif host_block(m, "SingleStreamBlock", LAYERS, SINGLE_ATTRS, SINGLE_PARAMS):
            if not covered(m) or not plain_layer_norms(m.pre_norm):
                continue
            patch_forward(m, _single_forward, undo)
        elif host_block(m, "LastLayer", LAYERS, LAST_ATTRS, ("x", "vec")) and linears(m.linear) \
                and plain_layer_norms(m.norm_final):
            patch_forward(m, _last_forward, undo)
        else:
            continue
        n += 1
    if n:
        reads_comfy_attention(FLUX_ATTENTION)
    return n
