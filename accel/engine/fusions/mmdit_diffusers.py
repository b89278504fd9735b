"""diffusers' SD3/SD3.5 joint blocks (JointTransformerBlock) with the DiT kernels, as fusions/mmdit.py does for
ComfyUI's: the adaLN LayerNorm and modulation in one pass per stream; q, k and v from diffusers' three projections
RMS-normalized (SD3.5) and written at their place in the joint image+text sequence in one pass; the gated residual
added in the pass that normalizes for the MLP. SD3.5-medium's blocks with a second, image-only attention (MMDiT-X)
and the last block, whose text stream stops after the attention (context_pre_only), are covered. The projections run
as fp8 products where accel/engine/fp8.py marked them (the `precision` option).

A call it does not cover runs the block's own forward: joint_attention_kwargs, another attention processor than
diffusers' default, chunked feed-forward, layers that are not plain (a PEFT LoRA adds its own terms), a tensor the
kernels cannot run on.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .. import fp8
from .base import Undo, kernel_module, patch_forward, plain_linear
from .registry import fusion
from .transformer import gated_mlp, gated_residual_, kernels_run_on, modulated_norm, sdpa

PROCESSOR = "JointAttnProcessor2_0"


def _plain_norm(norm: nn.Module) -> bool:
    return isinstance(norm, nn.LayerNorm) and not norm.elementwise_affine and norm.eps == 1e-6


def _qk_norms_covered(*norms) -> bool:
    if all(n is None for n in norms):
        return True
    return all(type(n).__name__ == "RMSNorm" and getattr(n, "weight", None) is not None
               and getattr(n, "bias", None) is None and n.eps == norms[0].eps for n in norms)


def _attention_covered(attn: nn.Module, joint: bool) -> bool:
    layers = [attn.to_q, attn.to_k, attn.to_v, attn.to_out[0]]
    norms = [attn.norm_q, attn.norm_k]
    if joint:
        layers += [attn.add_q_proj, attn.add_k_proj, attn.add_v_proj] + ([] if attn.context_pre_only else
                                                                        [attn.to_add_out])
        norms += [attn.norm_added_q, attn.norm_added_k]
    return (type(attn.processor).__name__ == PROCESSOR and not getattr(attn, "fused_projections", False)
            and _qk_norms_covered(*norms) and all(plain_linear(layer) for layer in layers))


def _gelu_mlp(ff: nn.Module) -> bool:
    act = ff.net[0]
    return type(act).__name__ == "GELU" and act.approximate == "tanh" and plain_linear(act.proj) \
        and plain_linear(ff.net[2])


def _covered(m: nn.Module) -> bool:
    context = m.norm1_context
    context_ok = (_plain_norm(context.norm) and plain_linear(context.linear)
                  and (m.context_pre_only or (_plain_norm(m.norm2_context) and _gelu_mlp(m.ff_context)
                                              and getattr(context, "emb", None) is None)))
    return (_attention_covered(m.attn, joint=True) and (m.attn2 is None or _attention_covered(m.attn2, joint=False))
            and _plain_norm(m.norm1.norm) and plain_linear(m.norm1.linear) and getattr(m.norm1, "emb", None) is None
            and _plain_norm(m.norm2) and _gelu_mlp(m.ff) and context_ok)


def _qk_weights(attn: nn.Module, added: bool) -> tuple:
    q, k = (attn.norm_added_q, attn.norm_added_k) if added else (attn.norm_q, attn.norm_k)
    return (None, None, 1e-6) if q is None else (q.weight, k.weight, q.eps)


def _project(attn: nn.Module, h, added: bool) -> tuple:
    layers = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj) if added else (attn.to_q, attn.to_k, attn.to_v)
    return tuple(fp8.project(layer, h) for layer in layers)


def _forward(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs=None):
    x, ctx, attn = hidden_states, encoder_hidden_states, self.attn
    if joint_attention_kwargs or self._chunk_size is not None or not kernels_run_on(x) or x.dtype != ctx.dtype:
        return type(self).forward(self, x, ctx, temb, joint_attention_kwargs)
    rope = kernel_module("qk_rope")
    # shift, scale, gate of the attention, of the MLP (and of the second attention): (B, C) views
    xm = self.norm1.linear(F.silu(temb)).chunk(9 if self.use_dual_attention else 6, dim=1)
    pre_only = self.context_pre_only
    if pre_only:  # AdaLayerNormContinuous: scale, then shift
        cscale, cshift = self.norm1_context.linear(F.silu(temb).to(ctx.dtype)).chunk(2, dim=1)
    else:
        cm = self.norm1_context.linear(F.silu(temb)).chunk(6, dim=1)
        cscale, cshift = cm[1], cm[0]
    (B, Lx, C), Lc, H = x.shape, ctx.shape[1], attn.heads
    qkv = rope.empty_qkv(B, Lx + Lc, H, C // H, x)
    h = modulated_norm(x, xm[1], xm[0], attn.to_q, attn.to_k, attn.to_v)
    qw, kw, eps = _qk_weights(attn, False)
    rope.qk_norm_rope(_project(attn, h, False), H, qkv, 0, qw, kw, eps)
    hc = modulated_norm(ctx, cscale, cshift, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
    qw, kw, eps = _qk_weights(attn, True)
    rope.qk_norm_rope(_project(attn, hc, True), H, qkv, Lx, qw, kw, eps)
    out = sdpa(*qkv)
    update = attn.to_out[0](out[:, :Lx])
    gate = xm[2]
    if self.use_dual_attention:  # MMDiT-X: the image-only attention from the same norm, its own modulation
        h2 = modulated_norm(x, xm[7], xm[6], self.attn2.to_q, self.attn2.to_k, self.attn2.to_v)
        own = rope.empty_qkv(B, Lx, H, C // H, x)
        qw, kw, eps = _qk_weights(self.attn2, False)
        rope.qk_norm_rope(_project(self.attn2, h2, False), H, own, 0, qw, kw, eps)
        x = gated_residual_(x.clone(), xm[2], update)
        update, gate = self.attn2.to_out[0](sdpa(*own)), xm[8]
    y, x = gated_mlp(x, update, gate, xm[4], xm[3], self.ff.net[0].proj, self.ff.net[2])
    gated_residual_(x, xm[5], y)
    if pre_only:
        return None, x
    y, ctx = gated_mlp(ctx, attn.to_add_out(out[:, Lx:]), cm[2], cm[4], cm[3], self.ff_context.net[0].proj,
                       self.ff_context.net[2])
    gated_residual_(ctx, cm[5], y)
    return ctx, x


@fusion("mmdit_diffusers")
def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if type(m).__name__ == "JointTransformerBlock" and type(m).__module__.startswith("diffusers.") \
                and all(hasattr(m, a) for a in ("norm1", "norm1_context", "attn", "attn2", "_chunk_size")) \
                and _covered(m):
            patch_forward(m, _forward, undo)
            n += 1
    return n
