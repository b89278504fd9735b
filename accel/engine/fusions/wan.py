"""Wan 2.1/2.2's blocks and output head (ComfyUI's comfy.ldm.wan.model) with the DiT kernels.

A WanAttentionBlock makes: one adaLN pass into the self-attention's q, k and v projections; one pass that
RMS-normalizes q and k over all heads' channels (Wan's q/k norm spans the row, where Flux's is per head: the qk_rope
kernel's row variant), rotates them (the table is Flux's layout once the swap of the heads and tokens axes in Wan's
rope_encode is undone, a view) and writes q, k and v in SDPA's layout; the attention; one pass that adds the gated
attention output to the stream and applies the cross-attention's affine LayerNorm (its weight as 1 + scale, its bias
as shift); the cross-attention; one pass that adds its output and normalizes and modulates the sum for the FFN; the
tanh GELU; one in-place gated residual. Wan 2.2's modulation per frame or token (e of four dims, a row per run of
tokens) is read by the kernels where ComfyUI's repeat_e spreads it, with no per-token copy.

The self-attention runs as the block's own self_attn module, patched too, so that the hooks on it (sequence
parallelism marks its calls for the exchange, accel/parallel/wan.py) see every call; its attention goes through
transformer.comfy_sdpa, or would run in fp8 where accel/engine/fp8_attention.py takes it (the rope pass writing q and
k in e4m3 under the bound of the row norm's weights, the output going to the o projection as fp8 rows). The projections
run as fp8 products where accel/engine/fp8.py marked them. The text-to-video cross-attention (to the text's tokens)
keeps ComfyUI's projections and norms; its attention runs in 16 bits through transformer.comfy_sdpa, the fastest
kernel for the shape, since ComfyUI's SDPA wrapper orders the backends itself, differently by version.
Image-to-video's keeps ComfyUI's forward. A call they do not cover runs the module's own forward: an attention
override or another node's attention function in ComfyUI, a tensor the kernels cannot run on. Blocks with per-call
weight functions (lowvram, a LoRA applied per call), q/k norms other than torch's RMSNorm, and subclasses (VACE's
blocks, whose forward calls WanAttentionBlock.forward by name) keep their forward.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .. import fp8
from .base import Undo, comfy_attention, host_block, kernel_module, own_weights, patch_forward, reads_comfy_attention
from .registry import fusion
from .transformer import (EPS, Joint, comfy_sdpa, gated_mlp, gated_residual_, kernels_run_on, linears,
                          modulated_norm, norm_weight, part, plain_layer_norms)

WAN = "comfy.ldm.wan.model"  # its blocks' attention function is this module's optimized_attention

# what the fused forwards read of each class, and the forms of forward they restate
BLOCK_ATTRS = ("self_attn", "cross_attn", "norm1", "norm2", "norm3", "ffn", "modulation")
BLOCK_PARAMS = ("x", "e", "freqs", "context", "context_img_len", "transformer_options")
SELF_ATTRS = ("num_heads", "head_dim", "q", "k", "v", "o", "norm_q", "norm_k")
SELF_PARAMS = ("x", "freqs", "transformer_options")
CROSS_PARAMS = ("x", "context", "transformer_options", "kwargs")  # WanT2VCrossAttention's (it reads SELF_ATTRS)
HEAD_ATTRS = ("modulation", "norm", "head")


def _modulations(self: nn.Module, e: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The module's modulation parameter (1, n, C) plus e (B, T, n, C): n (B, T, C) views, as ComfyUI adds them."""
    cast_to = sys.modules["comfy.model_management"].cast_to
    return (cast_to(self.modulation, dtype=x.dtype, device=x.device).unsqueeze(0) + e).unbind(2)


def _fused(x: torch.Tensor, freqs: torch.Tensor | None, transformer_options: dict | None) -> bool:
    return (comfy_attention(WAN, transformer_options) is not None and kernels_run_on(x) and freqs is not None
            and freqs.dtype == torch.float32 and freqs.shape[1] == x.shape[1])


def _attention_inputs(self: nn.Module, x, freqs: torch.Tensor) -> Joint:
    """The self-attention with q, k and v written in SDPA's layout; the projections they are made from are freed on
    return, before the attention (at a video's token counts each is hundreds of MB)."""
    (B, L), H = x.shape[:2], self.num_heads
    projected = tuple(fp8.project(layer, x) for layer in (self.q, self.k, self.v))
    pe = freqs.transpose(1, 2)
    rms = isinstance(self.norm_q, nn.RMSNorm)
    norm = tuple(norm_weight(n.weight, projected[0]) for n in (self.norm_q, self.norm_k)) if rms else (None, None)
    joint = Joint(WAN, B, L, H, projected[0], (self.q, self.k, self.v), [norm], (self.o,))
    if rms:
        joint.write_rows(projected, norm, self.norm_q.eps, pe)
    else:
        joint.write(projected, 0, norm, pe=pe)
    return joint


def _self_attention(self, x, freqs, transformer_options={}):  # noqa: B006 (ComfyUI's signature)
    # x comes as fp8 Rows from a fused block only, which has checked the call
    if not isinstance(x, fp8.Rows) and not _fused(x, freqs, transformer_options):
        return type(self).forward(self, x, freqs, transformer_options=transformer_options)
    return fp8.project(self.o, part(_attention_inputs(self, x, freqs).attend(), 0, None, self.o))


def _cross_attention(self, x, context, transformer_options={}, **kwargs):  # noqa: B006 (ComfyUI's signature)
    # ComfyUI's SDPA wrapper sets its own backend order inside each call, and 0.33's puts FlashAttention-2 before cuDNN
    # (0.3.64's cuDNN first): the engine's choice for the shape (comfy_sdpa) is the fastest kernel in either
    if comfy_attention(WAN, transformer_options) is None:
        return type(self).forward(self, x, context, transformer_options=transformer_options, **kwargs)
    heads = (self.num_heads, self.head_dim)
    q = self.norm_q(self.q(x)).unflatten(-1, heads)
    k = self.norm_k(self.k(context)).unflatten(-1, heads)
    return self.o(comfy_sdpa(WAN, q, k, self.v(context).unflatten(-1, heads)))


def _block_forward(self, x, e, freqs, context, context_img_len=257, transformer_options={}):  # noqa: B006
    if not _fused(x, freqs, transformer_options):
        return type(self).forward(self, x, e, freqs, context, context_img_len=context_img_len,
                                  transformer_options=transformer_options)
    shift, scale, gate, mlp_shift, mlp_scale, mlp_gate = _modulations(self, e if e.dim() == 4 else e.unsqueeze(1), x)
    sa = self.self_attn
    y = sa(modulated_norm(x, scale, shift, sa.q, sa.k, sa.v), freqs, transformer_options=transformer_options)
    if isinstance(self.norm3, nn.LayerNorm):  # affine: LN(s) * w + b is the modulation with scale w - 1, shift b
        w, b = (p.to(device=x.device, dtype=torch.float32).view(1, -1) for p in (self.norm3.weight,
                                                                                 self.norm3.bias))
        h, x = modulated_norm(x, w - 1, b, update=y, gate=gate)
    else:
        h = x = gated_residual_(x.clone(memory_format=torch.contiguous_format), gate, y)
    y = self.cross_attn(h, context, context_img_len=context_img_len, transformer_options=transformer_options)
    y, x = gated_mlp(x, y, None, mlp_scale, mlp_shift, self.ffn[0], self.ffn[2])
    return gated_residual_(x, mlp_gate, y)


def _head_forward(self, x, e):
    if not kernel_module("adaln").supported(x):
        return type(self).forward(self, x, e)
    shift, scale = _modulations(self, (e if e.dim() == 3 else e.unsqueeze(1)).unsqueeze(2), x)
    return self.head(kernel_module("adaln").modulated_layer_norm(x, scale, shift, EPS))


def _qk_norms_covered(sa: nn.Module) -> bool:
    """Wan's q/k RMSNorms (the kernel normalizes over the whole row with their weights and eps), or none."""
    q, k = sa.norm_q, sa.norm_k
    if type(q) is nn.Identity and type(k) is nn.Identity:
        return True
    return (isinstance(q, nn.RMSNorm) and isinstance(k, nn.RMSNorm) and q.weight is not None and k.weight is not None
            and q.eps is not None and q.eps == k.eps and own_weights(q, k))


def _block_covered(m: nn.Module) -> bool:
    sa, ffn, norm3 = m.self_attn, m.ffn, m.norm3
    return (host_block(sa, "WanSelfAttention", WAN, SELF_ATTRS, SELF_PARAMS) and sa.head_dim % 2 == 0
            and _qk_norms_covered(sa) and linears(sa.q, sa.k, sa.v, sa.o, ffn[0], ffn[2])
            and isinstance(ffn[1], nn.GELU) and ffn[1].approximate == "tanh" and plain_layer_norms(m.norm1, m.norm2)
            and (type(norm3) is nn.Identity or (isinstance(norm3, nn.LayerNorm) and norm3.eps == EPS
                                                and norm3.weight is not None and norm3.bias is not None
                                                and own_weights(norm3))))


@fusion("wan")
def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if host_block(m, "WanAttentionBlock", WAN, BLOCK_ATTRS, BLOCK_PARAMS):
            if not _block_covered(m):
                continue
            patch_forward(m, _block_forward, undo)
            patch_forward(m.self_attn, _self_attention, undo)
            if host_block(m.cross_attn, "WanT2VCrossAttention", WAN, SELF_ATTRS, CROSS_PARAMS):
                patch_forward(m.cross_attn, _cross_attention, undo)
        elif host_block(m, "Head", WAN, HEAD_ATTRS, ("x", "e")) and linears(m.head) and plain_layer_norms(m.norm):
            patch_forward(m, _head_forward, undo)
        else:
            continue
        n += 1
    if n:
        reads_comfy_attention(WAN)
    return n
