"""Qwen-Image's blocks and output norm (ComfyUI's comfy.ldm.qwen_image.model) with the DiT kernels.

A QwenImageTransformerBlock is a double-stream block of joint text+image attention, as Flux's is, with q, k and v
projected by three layers per stream and ComfyUI's RMSNorm modules for q and k: transformer.joint_block computes it
(per stream one adaLN pass into the q, k and v projections, one GEMM where their weights are packed: packing.py; one
pass that RMS-normalizes q and k per head, rotates them and writes q, k and v at their place in the joint sequence,
text first; the attention; one pass that adds the gated attention output and normalizes and modulates the sum for the
MLP; the tanh GELU; one in-place gated residual). Its rotary table is Flux's layout once the heads and tokens axes are
swapped back (a view), in the activations' dtype as the forward casts it. The output norm's LayerNorm and modulation
are one adaLN pass. The projections run as fp8 products where accel/engine/fp8.py marked them (the `precision`
option), a product per layer. The attention is SDPA, or the function ComfyUI chose for the whole host where it was
timed faster (accel/engine/host_attention.py), through the StandIn of sequence parallelism where one stands in its
place.

A call it does not cover runs the block's own forward: a text mask (ComfyUI's block passes it to no attention, but a
forward that does must get it), a modulation of other than one row per sample, an attention override or another
node's attention function in ComfyUI, a rotary table of another shape or dtype, a tensor the kernels cannot run on.
Blocks with per-call weight functions (lowvram, a LoRA applied per call) or a forward of another signature keep their
forward.
"""

from __future__ import annotations

import torch
from torch import nn

from . import packing
from .base import (Undo, comfy_attention, forward_takes, kernel_module, of_class, own_weights, patch_forward,
                   reads_comfy_attention)
from .registry import fusion
from .transformer import EPS, diffusers_stream, joint_block, kernels_run_on, linears, plain_layer_norms

QWEN = "comfy.ldm.qwen_image.model"
ATTENTION = "optimized_attention_masked"  # the function of QWEN that its Attention calls


def _fused(img: torch.Tensor, txt: torch.Tensor, mask, temb: torch.Tensor, pe: torch.Tensor | None,
           transformer_options: dict | None) -> bool:
    return (mask is None and temb.dim() == 2 and img.dtype == txt.dtype and img.shape[0] == txt.shape[0]
            and pe is not None and pe.dim() == 6 and pe.shape[0] in (1, img.shape[0])
            and pe.shape[1:3] == (img.shape[1] + txt.shape[1], 1)
            and pe.dtype in (torch.float32, img.dtype) and kernels_run_on(img)
            and comfy_attention(QWEN, transformer_options, ATTENTION) is not None)


def _block_forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                   image_rotary_emb=None, transformer_options={}):  # noqa: B006 (ComfyUI's signature)
    img, txt, pe = hidden_states, encoder_hidden_states, image_rotary_emb
    if not _fused(img, txt, encoder_hidden_states_mask, temb, pe, transformer_options):
        return type(self).forward(self, img, txt, encoder_hidden_states_mask, temb, pe, transformer_options)
    a = self.attn
    streams = (diffusers_stream(txt, self.txt_mod(temb), (a.add_q_proj, a.add_k_proj, a.add_v_proj), a.norm_added_q,
                                a.norm_added_k, a.to_add_out, self.txt_mlp),
               diffusers_stream(img, self.img_mod(temb), (a.to_q, a.to_k, a.to_v), a.norm_q, a.norm_k, a.to_out[0],
                                self.img_mlp))
    txt, img = joint_block(streams, a.heads, QWEN, pe.transpose(1, 2), ATTENTION)
    return txt, img


def _last_forward(self, x, conditioning_embedding):
    if conditioning_embedding.dim() != 2 or not kernel_module("adaln").supported(x):
        return type(self).forward(self, x, conditioning_embedding)
    scale, shift = self.linear(self.silu(conditioning_embedding)).chunk(2, dim=1)
    return kernel_module("adaln").modulated_layer_norm(x, scale, shift, EPS)


def _qk_norms_covered(a: nn.Module) -> bool:
    """Per-head RMSNorms with weights (the kernel's), one eps per stream."""
    pairs = ((a.norm_q, a.norm_k), (a.norm_added_q, a.norm_added_k))
    return all(isinstance(n, nn.RMSNorm) and n.weight is not None and n.eps is not None
               and tuple(n.normalized_shape) == (a.dim_head,) and own_weights(n) for pair in pairs for n in pair) \
        and all(q.eps == k.eps for q, k in pairs)


def _mlp_covered(mlp: nn.Module) -> bool:
    act = mlp.net[0]
    return of_class(act, "GELU", QWEN, "proj") and act.approximate == "tanh" and linears(act.proj, mlp.net[2])


def _block_covered(m: nn.Module) -> bool:
    a = m.attn
    return (forward_takes(m, "hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb",
                          "image_rotary_emb", "transformer_options")
            and of_class(a, "Attention", QWEN, "add_q_proj", "norm_added_q", "to_add_out") and a.dim_head % 2 == 0
            and a.inner_dim == a.heads * a.dim_head and _qk_norms_covered(a)
            and linears(a.to_q, a.to_k, a.to_v, a.add_q_proj, a.add_k_proj, a.add_v_proj, a.to_out[0], a.to_add_out,
                        m.img_mod[1], m.txt_mod[1])
            and _mlp_covered(m.img_mlp) and _mlp_covered(m.txt_mlp)
            and plain_layer_norms(m.img_norm1, m.img_norm2, m.txt_norm1, m.txt_norm2))


@fusion("qwen_image")
def apply(model: nn.Module, undo: Undo) -> int:
    n, blocks = 0, False
    for m in model.modules():
        if of_class(m, "QwenImageTransformerBlock", QWEN, "attn", "img_mod", "txt_mod", "img_mlp", "txt_mlp") \
                and _block_covered(m):
            patch_forward(m, _block_forward, undo)
            a = m.attn
            for layers in ([a.add_q_proj, a.add_k_proj, a.add_v_proj], [a.to_q, a.to_k, a.to_v]):
                packing.pack_qkv(model, layers, undo)
            blocks = True
        elif of_class(m, "LastLayer", QWEN, "linear", "norm", "silu") and linears(m.linear) \
                and plain_layer_norms(m.norm) and forward_takes(m, "x", "conditioning_embedding"):
            patch_forward(m, _last_forward, undo)
        else:
            continue
        n += 1
    if blocks:
        reads_comfy_attention(QWEN, ATTENTION)
    return n
