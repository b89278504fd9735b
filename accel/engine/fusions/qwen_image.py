"""Qwen-Image's blocks and output norm (ComfyUI's comfy.ldm.qwen_image.model) with the DiT kernels.

A QwenImageTransformerBlock is a double-stream block of joint text+image attention, as Flux's is, with q, k and v
projected by three layers per stream and RMSNorm modules for q and k: transformer.joint_block computes it (per stream
one adaLN pass into the q, k and v projections, one GEMM where their weights are packed: packing.py; one pass that
RMS-normalizes q and k per head, rotates them and writes q, k and v at their place in the joint sequence, text first;
the attention; one pass that adds the gated attention output and normalizes and modulates the sum for the MLP; the
tanh GELU; one in-place gated residual). The output norm's LayerNorm and modulation are one adaLN pass. The
projections run as fp8 products where accel/engine/fp8.py marked them (the `precision` option), a product per layer.
The attention is SDPA, or the function ComfyUI chose for the whole host where it was timed faster
(accel/engine/host_attention.py), through the StandIn of sequence parallelism where one stands in its place.

Both of ComfyUI's forms of the block are served. Until 0.3.6x the model hands the blocks its rotary table as
(B, tokens, 1, head_dim / 2, 2, 2), Flux's layout with the heads and tokens axes swapped (swapped back: a view), in the
activations' dtype. ComfyUI 0.33 hands it in Flux's layout, and its forward takes timestep_zero_index: where a
Qwen-Image-Edit model's reference images are modulated at timestep zero ("index_timestep_zero"), the image tokens from
that index on take the image modulation of the second half of temb's rows and the text the first half's. The fused
forward computes those tokens as a stream of their own (the same layers, the next rows of the joint sequence).

A call it does not cover runs the block's own forward: a text mask (0.33's attention applies it; 0.3.6x's passes it
to no attention, but a forward that does must get it), attn1 patches in transformer_options (0.33's attention calls
them on q, k, v and the rotary table), a modulation of other than one row per sample (two halves with
timestep_zero_index), an attention override or another node's attention function in ComfyUI, a rotary table of
another shape or dtype, a tensor the kernels cannot run on. Blocks with per-call weight functions (lowvram, a LoRA
applied per call) or a forward of another signature keep their forward.
"""

from __future__ import annotations

import torch
from torch import nn

from . import packing
from .base import (Undo, comfy_attention, forward_takes, host_block, kernel_module, of_class, own_weights,
                   patch_forward, reads_comfy_attention)
from .registry import fusion
from .transformer import EPS, Stream, diffusers_stream, joint_block, kernels_run_on, linears, plain_layer_norms

QWEN = "comfy.ldm.qwen_image.model"
ATTENTION = "optimized_attention_masked"  # the function of QWEN that its Attention calls

BLOCK_ATTRS = ("attn", "img_mod", "txt_mod", "img_mlp", "txt_mlp", "img_norm1", "img_norm2", "txt_norm1", "txt_norm2")
PARAMS = ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb", "image_rotary_emb",
          "transformer_options")  # ComfyUI 0.3.6x
PARAMS_ZERO = (*PARAMS[:-1], "timestep_zero_index", PARAMS[-1])  # ComfyUI 0.33
LAST_ATTRS = ("linear", "norm", "silu")


def _fused(img: torch.Tensor, txt: torch.Tensor, mask, temb: torch.Tensor, pe: torch.Tensor | None,
           transformer_options: dict | None, zero=None) -> bool:
    """Whether the kernels serve a block call; pe is the rotary table in Flux's layout, `zero` the call's
    timestep_zero_index."""
    B, rows = img.shape[0], temb.shape[0] if temb.dim() == 2 else 0
    per_sample = rows in (1, B) if zero is None else \
        (rows % 2 == 0 and rows // 2 in (1, B) and type(zero) is int and 0 <= zero <= img.shape[1])
    return (mask is None and per_sample and img.dtype == txt.dtype and B == txt.shape[0]
            and pe is not None and pe.dim() == 6 and pe.shape[0] in (1, B)
            and pe.shape[1:3] == (1, img.shape[1] + txt.shape[1])
            and pe.dtype in (torch.float32, img.dtype) and kernels_run_on(img)
            and comfy_attention(QWEN, transformer_options, ATTENTION) is not None)


def _block_forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                   image_rotary_emb=None, transformer_options={}):  # noqa: B006 (ComfyUI 0.3.6x's signature)
    img, txt, pe = hidden_states, encoder_hidden_states, image_rotary_emb
    table = pe.transpose(1, 2) if isinstance(pe, torch.Tensor) and pe.dim() == 6 else None
    if not _fused(img, txt, encoder_hidden_states_mask, temb, table, transformer_options):
        return type(self).forward(self, img, txt, encoder_hidden_states_mask, temb, pe, transformer_options)
    return _joint(self, img, txt, temb, table, None)


def _block_forward_zero(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                        image_rotary_emb=None, timestep_zero_index=None,
                        transformer_options={}):  # noqa: B006 (ComfyUI 0.33's signature)
    img, txt, pe, zero = hidden_states, encoder_hidden_states, image_rotary_emb, timestep_zero_index
    if "attn1_patch" in (transformer_options or {}).get("patches", {}) \
            or not _fused(img, txt, encoder_hidden_states_mask, temb, pe, transformer_options, zero):
        return type(self).forward(self, img, txt, encoder_hidden_states_mask, temb, pe, zero, transformer_options)
    return _joint(self, img, txt, temb, pe, zero)


def _joint(self, img: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor, pe: torch.Tensor,
           zero: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's (text, image) output; the image tokens from `zero` on (where not None) are modulated by the second
    half of temb's rows, all other tokens by the first half."""
    a = self.attn
    mods = self.img_mod(temb)
    if zero is None:
        runs = [(img, mods)]
    else:
        half = temb.shape[0] // 2
        temb = temb[:half]
        # a sequence-parallel rank may hold the tokens of one side of the index only
        runs = [(x, m) for x, m in ((img[:, :zero], mods[:half]), (img[:, zero:], mods[half:])) if x.shape[1]]

    def image(x: torch.Tensor, m: torch.Tensor) -> Stream:
        return diffusers_stream(x, m, (a.to_q, a.to_k, a.to_v), a.norm_q, a.norm_k, a.to_out[0], self.img_mlp)

    streams = [diffusers_stream(txt, self.txt_mod(temb), (a.add_q_proj, a.add_k_proj, a.add_v_proj), a.norm_added_q,
                                a.norm_added_k, a.to_add_out, self.txt_mlp), *(image(x, m) for x, m in runs)]
    txt, *imgs = joint_block(streams, a.heads, QWEN, pe, ATTENTION)
    return txt, imgs[0] if len(imgs) == 1 else torch.cat(imgs, 1)


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
    return (of_class(a, "Attention", QWEN, "add_q_proj", "norm_added_q", "to_add_out") and a.dim_head % 2 == 0
            and a.inner_dim == a.heads * a.dim_head and _qk_norms_covered(a)
            and linears(a.to_q, a.to_k, a.to_v, a.add_q_proj, a.add_k_proj, a.add_v_proj, a.to_out[0], a.to_add_out,
                        m.img_mod[1], m.txt_mod[1])
            and _mlp_covered(m.img_mlp) and _mlp_covered(m.txt_mlp)
            and plain_layer_norms(m.img_norm1, m.img_norm2, m.txt_norm1, m.txt_norm2))


def _block_params(m: nn.Module) -> tuple[str, ...]:
    """The form of the block's forward that m's class has, 0.33's or 0.3.6x's: any other is declined, said against
    0.3.6x's."""
    return PARAMS_ZERO if forward_takes(m, *PARAMS_ZERO) else PARAMS


@fusion("qwen_image")
def apply(model: nn.Module, undo: Undo) -> int:
    n, blocks = 0, False
    for m in model.modules():
        params = _block_params(m)
        if host_block(m, "QwenImageTransformerBlock", QWEN, BLOCK_ATTRS, params):
            if not _block_covered(m):
                continue
            patch_forward(m, _block_forward_zero if params is PARAMS_ZERO else _block_forward, undo)
            a = m.attn
            for layers in ([a.add_q_proj, a.add_k_proj, a.add_v_proj], [a.to_q, a.to_k, a.to_v]):
                packing.pack_qkv(model, layers, undo)
            blocks = True
        elif host_block(m, "LastLayer", QWEN, LAST_ATTRS, ("x", "conditioning_embedding")) and linears(m.linear) \
                and plain_layer_norms(m.norm):
            patch_forward(m, _last_forward, undo)
        else:
            continue
        n += 1
    if blocks:
        reads_comfy_attention(QWEN, ATTENTION)
    return n
