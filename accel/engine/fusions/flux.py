"""Flux.1's blocks (ComfyUI's comfy.ldm.flux.layers) with the DiT kernels.

Per double-stream block, eager Flux makes about 40 passes over the activations; this forward makes the GEMMs,
the attention and: one adaLN pass per stream into the qkv projection; one pass per stream that writes q, k and v
RMS-normalized, rotated and in SDPA's layout at their place in the joint text+image sequence (no concatenation, no
float32 copies); one pass that adds the gated attention output to the stream and normalizes and modulates the sum for
the MLP; the tanh GELU; one in-place gated residual. A single-stream block splits its input projection in two GEMMs
(q, k and v; the MLP's input) and its output projection in two GEMMs into one output (attention part, then the MLP
part accumulated on it) instead of concatenating the attention output and the MLP activation. The projections run
as fp8 products where accel/engine/fp8.py marked them (the `precision` option).

A call it does not cover runs the block's own forward: modulation_dims or an attention mask (Kontext and other
reference-image models), an attention override or another attention than PyTorch's in ComfyUI, Linear layers with
per-call weight functions (lowvram), a tensor the kernels cannot run on. ComfyUI's cast-on-the-fly layers (fp8-loaded
weights) are covered: the fused forward calls them, or takes them as fp8 products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Undo, kernel_module, patch_forward, plain_linear
from .registry import fusion
from .. import fp8
from .transformer import (EPS, gated_mlp, gated_residual_, kernels_run_on, linears, modulated_norm, norm_weight,
                          pytorch_attention, sdpa)

def covered(m: nn.Module, *modulation: nn.Module) -> bool:
    """Whether a double or single block of Flux's layout (ComfyUI's Flux or Chroma classes) takes the fused forward:
    plain or cast-on-the-fly projections (and the block's own modulation projections), tanh GELU."""
    if hasattr(m, "img_mlp"):
        layers = (m.img_attn.qkv, m.img_attn.proj, m.txt_attn.qkv, m.txt_attn.proj, m.img_mlp[0], m.img_mlp[2],
                  m.txt_mlp[0], m.txt_mlp[2])
        act = m.img_mlp[1]
    else:
        layers, act = (m.linear1, m.linear2), m.mlp_act
    return linears(*layers, *modulation) and type(act).__name__ == "GELU" and act.approximate == "tanh"


def fused_call(x: torch.Tensor, transformer_options: dict | None, *conditions: bool) -> bool:
    """Whether a Flux-layout block call takes the fused forward (every one of `conditions` false, ComfyUI's PyTorch
    attention, tensors the kernels run on)."""
    return (not any(conditions) and pytorch_attention("comfy.ldm.flux.math", transformer_options)
            and kernels_run_on(x))


def double_block(self: nn.Module, img: torch.Tensor, txt: torch.Tensor, pe: torch.Tensor | None, mods: tuple,
                 flipped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A double-stream block's computation with the kernels; mods = (img_mod1, img_mod2, txt_mod1, txt_mod2), each
    with shift, scale and gate of shape (B, 1, C)."""
    rope = kernel_module("qk_rope")
    img_mod1, img_mod2, txt_mod1, txt_mod2 = mods
    (B, Li, C), Lt, H = img.shape, txt.shape[1], self.num_heads
    qkv = rope.empty_qkv(B, Lt + Li, H, C // H, img)
    streams = [(txt, txt_mod1, self.txt_attn, 0), (img, img_mod1, self.img_attn, Lt)]
    if flipped:
        streams = [(img, img_mod1, self.img_attn, 0), (txt, txt_mod1, self.txt_attn, Li)]
    for x, mod, attn, offset in streams:
        h = modulated_norm(x, mod.scale, mod.shift, attn.qkv)
        rope.qk_norm_rope(fp8.project(attn.qkv, h), H, qkv, offset, norm_weight(attn.norm.query_norm.scale, x),
                          norm_weight(attn.norm.key_norm.scale, x), EPS, pe)
    out = sdpa(*qkv)
    first, second = out[:, :streams[0][0].shape[1]], out[:, streams[0][0].shape[1]:]
    img_attn, txt_attn = (second, first) if not flipped else (first, second)
    y, img = gated_mlp(img, self.img_attn.proj(img_attn), img_mod1.gate, img_mod2.scale, img_mod2.shift,
                       self.img_mlp[0], self.img_mlp[2])
    gated_residual_(img, img_mod2.gate, y)
    y, txt = gated_mlp(txt, self.txt_attn.proj(txt_attn), txt_mod1.gate, txt_mod2.scale, txt_mod2.shift,
                       self.txt_mlp[0], self.txt_mlp[2])
    gated_residual_(txt, txt_mod2.gate, y)
    if txt.dtype == torch.float16:
        txt = torch.nan_to_num(txt, nan=0.0, posinf=65504, neginf=-65504)
    return img, txt


def single_block(self: nn.Module, x: torch.Tensor, pe: torch.Tensor | None, mod) -> torch.Tensor:
    """A single-stream block's computation with the kernels; mod has shift, scale and gate of shape (B, 1, C)."""
    rope = kernel_module("qk_rope")
    (B, L, C), H = x.shape, self.num_heads
    h = modulated_norm(x, mod.scale, mod.shift, self.linear1)
    # linear1 as two products (q, k, v; the MLP's input), so that the GELU reads a contiguous tensor
    projected, mlp_in = fp8.split_linear(self.linear1, h, (3 * C, self.mlp_hidden_dim))
    qkv = rope.empty_qkv(B, L, H, C // H, x)
    rope.qk_norm_rope(projected, H, qkv, 0, norm_weight(self.norm.query_norm.scale, x),
                      norm_weight(self.norm.key_norm.scale, x), EPS, pe)
    attn = sdpa(*qkv)
    # linear2(cat(attention, act)) without writing the concatenation: two products into one output (16-bit: the
    # second accumulates on the first) or two outputs the gated residual adds together (fp8, the GELU in the pass
    # that quantizes its part)
    if fp8.takes_rows(x, self.linear2):
        gated_residual_(x, mod.gate, fp8.matmul(attn, self.linear2, cols=slice(0, C)),
                        fp8.matmul(fp8.quantized(mlp_in, gelu=True), self.linear2, cols=slice(C, None), bias=False))
    elif plain_linear(self.linear2) and self.linear2.bias is not None:
        w, b = self.linear2.weight, self.linear2.bias
        out = torch.addmm(b, attn.reshape(B * L, C), w[:, :C].t())
        out.addmm_(F.gelu(mlp_in, approximate="tanh").reshape(B * L, -1), w[:, C:].t())
        gated_residual_(x, mod.gate, out.view(B, L, C))
    else:
        gated_residual_(x, mod.gate, self.linear2(torch.cat((attn, F.gelu(mlp_in, approximate="tanh")), 2)))
    if x.dtype == torch.float16:
        x = torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
    return x


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


def _is(m: nn.Module, name: str, *attrs: str) -> bool:
    return type(m).__name__ == name and type(m).__module__.startswith("comfy.ldm.flux") \
        and all(hasattr(m, a) for a in attrs)


@fusion("flux")
def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if _is(m, "DoubleStreamBlock", "img_mod", "txt_mod", "img_mlp") and covered(m, m.img_mod.lin, m.txt_mod.lin):
            patch_forward(m, _double_forward, undo)
        elif _is(m, "SingleStreamBlock", "linear1", "linear2", "modulation") and covered(m, m.modulation.lin):
            patch_forward(m, _single_forward, undo)
        elif _is(m, "LastLayer", "adaLN_modulation", "norm_final") and linears(m.linear):
            patch_forward(m, _last_forward, undo)
        else:
            continue
        n += 1
    return n
