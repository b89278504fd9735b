"""Flux.1's blocks (ComfyUI's comfy.ldm.flux.layers) with the DiT kernels.

Per double-stream block, eager Flux makes about 40 passes over the activations; this forward makes the GEMMs,
the attention and: one adaLN pass per stream into the qkv projection; one pass per stream that writes q, k and v
RMS-normalized, rotated and in SDPA's layout at their place in the joint text+image sequence (no concatenation, no
float32 copies); one pass that adds the gated attention output to the stream and normalizes and modulates the sum for
the MLP; the tanh GELU; one in-place gated residual. A single-stream block splits its input projection in two GEMMs
(q, k and v; the MLP's input) and its output projection in two GEMMs into one output (attention part, then the MLP
part accumulated on it) instead of concatenating the attention output and the MLP activation. The projections run
as fp8 products where accel/engine/fp8.py marked them (the `precision` option). The attention is SDPA, or the function
ComfyUI chose for the whole host (--use-sage-attention, ...) where it was timed faster (accel/engine/host_attention.py).

A call it does not cover runs the block's own forward: modulation_dims or an attention mask (Kontext and other
reference-image models), an attention override or another node's attention function in ComfyUI, Linear layers with
per-call weight functions (lowvram), a tensor the kernels cannot run on. ComfyUI's cast-on-the-fly layers (fp8-loaded
weights) are covered: the fused forward calls them, or takes them as fp8 products.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import Undo, kernel_module, of_class, patch_forward, reads_comfy_attention
from .registry import fusion
from .transformer import EPS, FLUX_ATTENTION, covered, double_block, fused_call, linears, single_block

FLUX = "comfy.ldm.flux"  # the package: its classes are in comfy.ldm.flux.layers


def _double_forward(self, img, txt, vec, pe, attn_mask=None, modulation_dims_img=None, modulation_dims_txt=None,
                    transformer_options={}):  # noqa: B006 (ComfyUI's signature)
    if not fused_call(img, transformer_options, attn_mask is not None, modulation_dims_img is not None,
                      modulation_dims_txt is not None, img.dtype != txt.dtype,
                      pe is not None and pe.dtype != torch.float32):
        return type(self).forward(self, img, txt, vec, pe, attn_mask, modulation_dims_img, modulation_dims_txt,
                                  transformer_options)
    return double_block(self, img, txt, pe, (*self.img_mod(vec), *self.txt_mod(vec)), self.flipped_img_txt)


def _single_forward(self, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}):  # noqa: B006
    if not fused_call(x, transformer_options, attn_mask is not None, modulation_dims is not None,
                      pe is not None and pe.dtype != torch.float32):
        return type(self).forward(self, x, vec, pe, attn_mask, modulation_dims, transformer_options)
    return single_block(self, x, pe, self.modulation(vec)[0])


def _last_forward(self, x, vec, modulation_dims=None):
    if modulation_dims is not None or not kernel_module("adaln").supported(x):
        return type(self).forward(self, x, vec, modulation_dims)
    shift, scale = self.adaLN_modulation(vec if vec.ndim == 3 else vec[:, None, :]).chunk(2, dim=-1)
    return self.linear(kernel_module("adaln").modulated_layer_norm(x, scale, shift, EPS))


@fusion("flux")
def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if of_class(m, "DoubleStreamBlock", FLUX, "img_mod", "txt_mod", "img_mlp") \
                and covered(m, m.img_mod.lin, m.txt_mod.lin):
            patch_forward(m, _double_forward, undo)
        elif of_class(m, "SingleStreamBlock", FLUX, "linear1", "linear2", "modulation") \
                and covered(m, m.modulation.lin):
            patch_forward(m, _single_forward, undo)
        elif of_class(m, "LastLayer", FLUX, "adaLN_modulation", "norm_final") and linears(m.linear):
            patch_forward(m, _last_forward, undo)
        else:
            continue
        n += 1
    if n:
        reads_comfy_attention(FLUX_ATTENTION)
    return n
