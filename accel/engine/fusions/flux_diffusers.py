"""diffusers' Flux blocks (FluxTransformerBlock, FluxSingleTransformerBlock) with the DiT kernels, as fusions/flux.py
does for ComfyUI's: the adaLN LayerNorm and modulation in one pass per stream; q, k and v from diffusers' three
projections (one GEMM where their weights are packed: packing.py) RMS-normalized, rotated and written at their place
in the joint text+image sequence in one pass (its (cos, sin) rotary tables turned into Flux's rotation matrices); the
gated residual added in the pass that normalizes for the MLP; a single block's output projection as two GEMMs into one
output instead of a concatenation. The projections run as fp8 products where accel/engine/fp8.py marked them (the
`precision` option), a product per layer.

A call it does not cover runs the block's own forward: joint_attention_kwargs (IP-Adapter and other processor
inputs), another attention processor or backend than diffusers' default, fused q/k/v projections, layers that are
not plain (a PEFT LoRA adds its own terms), a tensor the kernels cannot run on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import fp8
from . import packing
from .base import Undo, of_class, patch_forward, plain_linear
from .registry import fusion
from .transformer import (Joint, diffusers_stream, joint_block, kernels_run_on, modulated_norm, project_qkv,
                          single_output_)


def rotation_table(rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """diffusers' Flux rotary embedding, (cos, sin) each (tokens, head_dim) with every value repeated for its pair,
    as Flux's (1, 1, tokens, head_dim / 2, 2, 2) float32 rotation matrices [[cos, -sin], [sin, cos]]."""
    cos, sin = (t[:, ::2].float() for t in rotary)
    return torch.stack([cos, -sin, sin, cos], dim=-1).reshape(1, 1, cos.shape[0], cos.shape[1], 2, 2)


def _plain_norm(norm: nn.Module) -> bool:
    return isinstance(norm, nn.LayerNorm) and not norm.elementwise_affine and norm.eps == 1e-6


def _attention_covered(attn: nn.Module, joint: bool) -> bool:
    norms = (attn.norm_q, attn.norm_k) + ((attn.norm_added_q, attn.norm_added_k) if joint else ())
    layers = (attn.to_q, attn.to_k, attn.to_v) + ((attn.add_q_proj, attn.add_k_proj, attn.add_v_proj, attn.to_out[0],
                                                   attn.to_add_out) if joint else ())
    return (type(attn.processor).__name__ == "FluxAttnProcessor" and not getattr(attn, "fused_projections", False)
            and all(isinstance(n, nn.RMSNorm) and n.weight is not None and n.eps == norms[0].eps for n in norms)
            and all(plain_linear(layer) for layer in layers))


def _gelu_mlp(ff: nn.Module) -> bool:
    act = ff.net[0]
    return type(act).__name__ == "GELU" and act.approximate == "tanh" and plain_linear(act.proj) \
        and plain_linear(ff.net[2])


def _double_covered(m: nn.Module) -> bool:
    return (_attention_covered(m.attn, joint=True) and _plain_norm(m.norm1.norm) and _plain_norm(m.norm1_context.norm)
            and _plain_norm(m.norm2) and _plain_norm(m.norm2_context) and _gelu_mlp(m.ff) and _gelu_mlp(m.ff_context)
            and plain_linear(m.norm1.linear) and plain_linear(m.norm1_context.linear) and m.norm1.emb is None)


def _single_covered(m: nn.Module) -> bool:
    return (_attention_covered(m.attn, joint=False) and _plain_norm(m.norm.norm) and plain_linear(m.norm.linear)
            and plain_linear(m.proj_mlp) and plain_linear(m.proj_out) and m.proj_out.bias is not None
            and type(m.act_mlp).__name__ == "GELU" and m.act_mlp.approximate == "tanh")


def _fused_call(x: torch.Tensor, attn: nn.Module, rotary, joint_attention_kwargs) -> bool:
    return (not joint_attention_kwargs and getattr(attn.processor, "_attention_backend", None) is None
            and isinstance(rotary, tuple) and len(rotary) == 2 and kernels_run_on(x))


def _double_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                    joint_attention_kwargs=None):
    img, txt, attn = hidden_states, encoder_hidden_states, self.attn
    if not _fused_call(img, attn, image_rotary_emb, joint_attention_kwargs) or img.dtype != txt.dtype:
        return type(self).forward(self, img, txt, temb, image_rotary_emb, joint_attention_kwargs)
    streams = (diffusers_stream(txt, self.norm1_context.linear(F.silu(temb)),
                                (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj), attn.norm_added_q,
                                attn.norm_added_k, attn.to_add_out, self.ff_context),
               diffusers_stream(img, self.norm1.linear(F.silu(temb)), (attn.to_q, attn.to_k, attn.to_v),
                                attn.norm_q, attn.norm_k, attn.to_out[0], self.ff))
    txt, img = joint_block(streams, attn.heads, None, rotation_table(image_rotary_emb))
    if txt.dtype == torch.float16:
        txt = txt.clip(-65504, 65504)
    return txt, img


def _single_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                    joint_attention_kwargs=None):
    attn = self.attn
    if not _fused_call(hidden_states, attn, image_rotary_emb, joint_attention_kwargs) \
            or hidden_states.dtype != encoder_hidden_states.dtype:
        return type(self).forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                  joint_attention_kwargs)
    Lt = encoder_hidden_states.shape[1]
    x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    (B, L, _), layers = x.shape, (attn.to_q, attn.to_k, attn.to_v)
    shift, scale, gate = self.norm.linear(F.silu(temb)).chunk(3, dim=1)
    h = modulated_norm(x, scale, shift, *layers, self.proj_mlp)
    norm = attn.norm_q.weight, attn.norm_k.weight
    joint = Joint(None, B, L, attn.heads, x, layers, [norm], (self.proj_out,))
    joint.write(project_qkv(layers, h), 0, norm, attn.norm_q.eps, rotation_table(image_rotary_emb))
    mlp = fp8.project(self.proj_mlp, h)
    single_output_(x, gate, joint.attend(), mlp, self.proj_out)
    if x.dtype == torch.float16:
        x = x.clip(-65504, 65504)
    return x[:, :Lt], x[:, Lt:]


@fusion("flux_diffusers")
def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if of_class(m, "FluxTransformerBlock", "diffusers", "norm1", "norm1_context", "ff_context") \
                and _double_covered(m):
            patch_forward(m, _double_forward, undo)
            packing.pack_qkv(model, [m.attn.add_q_proj, m.attn.add_k_proj, m.attn.add_v_proj], undo)
        elif of_class(m, "FluxSingleTransformerBlock", "diffusers", "norm", "proj_mlp", "proj_out") \
                and _single_covered(m):
            patch_forward(m, _single_forward, undo)
        else:
            continue
        packing.pack_qkv(model, [m.attn.to_q, m.attn.to_k, m.attn.to_v], undo)
        n += 1
    return n
