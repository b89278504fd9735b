"""Flux.1's and Flux.2's blocks (ComfyUI's comfy.ldm.flux.layers) with the DiT kernels.

Flux.2 (ComfyUI 0.33's image_model "flux2") is the same classes declared otherwise: its blocks take their
modulations from the model (one for all double blocks, one for all single blocks: modulation False, as 0.33's
Chroma), its MLPs are SiLU-gated (SiLUActivation: the first projection twice as wide) and it has no biases. The
shared forwards of transformer.py take those as a parameter of the same pattern (the MLP's activation, SWIGLU), not a
pattern of their own. The Yak MLP of other models on Flux's classes (0.33's Ovis) is not covered: those blocks keep
their forward.

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

from .base import Undo, host_block, kernel_module, patch_forward, reads_comfy_attention
from .registry import fusion
from .transformer import (EPS, FLUX_ATTENTION, covered, double_block, fused_call, linears, plain_layer_norms,
                          single_block)

FLUX = "comfy.ldm.flux"  # the package: its classes are in comfy.ldm.flux.layers


DOUBLE_PARAMS = ("img", "txt", "vec", "pe", "attn_mask", "modulation_dims_img", "modulation_dims_txt",
                 "transformer_options")
SINGLE_PARAMS = ("x", "vec", "pe", "attn_mask", "modulation_dims", "transformer_options")


def _modulated(block: nn.Module) -> bool:
    # ComfyUI 0.33's blocks may take their modulations from the model (Chroma's, Flux.2's: modulation False)
    return getattr(block, "modulation", True) not in (False, None)


def _double_forward(self, img, txt, vec, pe, attn_mask=None, modulation_dims_img=None, modulation_dims_txt=None,
                    transformer_options={}):  # noqa: B006 (ComfyUI's signature)
    if not fused_call(img, transformer_options, attn_mask is not None, modulation_dims_img is not None,
                      modulation_dims_txt is not None, img.dtype != txt.dtype,
                      pe is not None and pe.dtype != torch.float32):
        return type(self).forward(self, img, txt, vec, pe, attn_mask, modulation_dims_img, modulation_dims_txt,
                                  transformer_options)
    if _modulated(self):
        mods = (*self.img_mod(vec), *self.txt_mod(vec))
    else:
        (img_mod1, img_mod2), (txt_mod1, txt_mod2) = vec
        mods = (img_mod1, img_mod2, txt_mod1, txt_mod2)
    # ComfyUI 0.33 dropped flipped_img_txt: the text comes first, as it did where it was False
    return double_block(self, img, txt, pe, mods, getattr(self, "flipped_img_txt", False))


def _single_forward(self, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}):  # noqa: B006
    if not fused_call(x, transformer_options, attn_mask is not None, modulation_dims is not None,
                      pe is not None and pe.dtype != torch.float32):
        return type(self).forward(self, x, vec, pe, attn_mask, modulation_dims, transformer_options)
    return single_block(self, x, pe, self.modulation(vec)[0] if _modulated(self) else vec)


def _last_forward(self, x, vec, modulation_dims=None):
    if modulation_dims is not None or not kernel_module("adaln").supported(x):
        return type(self).forward(self, x, vec, modulation_dims)
    shift, scale = self.adaLN_modulation(vec if vec.ndim == 3 else vec[:, None, :]).chunk(2, dim=-1)
    return self.linear(kernel_module("adaln").modulated_layer_norm(x, scale, shift, EPS))


@fusion("flux")
def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if host_block(m, "DoubleStreamBlock", FLUX, ("num_heads", "img_attn", "txt_attn", "img_mlp", "txt_mlp",
                                                      "img_norm1", "img_norm2", "txt_norm1", "txt_norm2"),
                      DOUBLE_PARAMS):
            modulation = (m.img_mod.lin, m.txt_mod.lin) if _modulated(m) else ()
            if not covered(m, *modulation) or not plain_layer_norms(m.img_norm1, m.img_norm2, m.txt_norm1,
                                                                    m.txt_norm2):
                continue
            patch_forward(m, _double_forward, undo)
        elif host_block(m, "SingleStreamBlock", FLUX, ("num_heads", "linear1", "linear2", "norm", "pre_norm",
                                                        "mlp_act", "mlp_hidden_dim", "hidden_size"), SINGLE_PARAMS):
            modulation = (m.modulation.lin,) if _modulated(m) else ()
            if not covered(m, *modulation) or not plain_layer_norms(m.pre_norm):
                continue
            patch_forward(m, _single_forward, undo)
        elif host_block(m, "LastLayer", FLUX, ("adaLN_modulation", "norm_final", "linear"),
                        ("x", "vec", "modulation_dims")) and linears(m.linear):
            patch_forward(m, _last_forward, undo)
        else:
            continue
        n += 1
    if n:
        reads_comfy_attention(FLUX_ATTENTION)
    return n
