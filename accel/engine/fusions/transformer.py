"""What the diffusion transformers' fusions (flux, mmdit) share: the call conditions, the attention over the joint
sequence, and the gated residual / modulated MLP steps of a DiT block."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from .. import fp8
from .base import kernel_module

EPS = 1e-6  # the LayerNorms and RMSNorms of Flux and MMDiT


def linears(*layers: nn.Module) -> bool:
    """Linear layers (ComfyUI's cast-on-the-fly ones included: the fused forwards call them) whose weights have no
    per-call functions (lowvram, a LoRA applied per call), which only the host's forward applies in step."""
    return all(isinstance(layer, nn.Linear) and not getattr(layer, "weight_function", None)
               and not getattr(layer, "bias_function", None) for layer in layers)


def pytorch_attention(module_name: str, transformer_options: dict | None) -> bool:
    """Whether ComfyUI's attention for the blocks of `module_name` is its PyTorch SDPA one, with no override."""
    module = sys.modules.get(module_name)
    attention = sys.modules.get("comfy.ldm.modules.attention")
    return (module is not None and attention is not None
            and getattr(module, "optimized_attention", None) is getattr(attention, "attention_pytorch", object())
            and "optimized_attention_override" not in (transformer_options or {}))


def kernels_run_on(x: torch.Tensor) -> bool:
    return kernel_module("adaln").supported(x) and kernel_module("qk_rope").supported(x)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention over (B, L, heads, head_dim) q, k and v, as (B, L, heads * head_dim)."""
    B, L, H, D = q.shape
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).reshape(B, L, H * D)


def modulated_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, *consumers: nn.Module,
                   update: torch.Tensor | None = None, gate: torch.Tensor | None = None):
    """The adaLN pass (kernels/adaln.py) for the projections `consumers` read its output with: when fp8 products
    serve all of them on CUDA, the output comes as fp8.Rows, quantized in the same pass."""
    rows = x.device.type == "cuda" and fp8.takes_rows(x, *consumers)
    out = kernel_module("adaln").modulated_layer_norm(x, scale, shift, EPS, update=update, gate=gate, out_fp8=rows)
    h, s = out if update is not None else (out, None)
    if rows:
        h = fp8.Rows(h[0], h[1], tuple(x.shape[:-1]), x.dtype)
    return h if update is None else (h, s)


def gated_mlp(x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor,
              shift: torch.Tensor | None, fc1: nn.Module, fc2: nn.Module) -> torch.Tensor:
    """(MLP(LN(s) * (1 + scale) + shift), s) for the stream s = x + gate * update; the caller adds the MLP's gated
    output to s. With fp8 products the GELU runs in the pass that quantizes fc2's input."""
    h, x = modulated_norm(x, scale, shift, fc1, update=update, gate=gate)
    a = fp8.project(fc1, h)
    if fp8.takes_rows(a, fc2):
        return fp8.matmul(fp8.quantized(a, gelu=True), fc2), x
    return fc2(F.gelu(a, approximate="tanh")), x


def gated_residual_(x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
                    update2: torch.Tensor | None = None) -> torch.Tensor:
    """x += gate * (update (+ update2)) in place (gate per sample: (B, 1, C) or (B, C))."""
    if x.is_contiguous() and update.shape == x.shape:
        return kernel_module("adaln").gated_add_(x, gate, update, update2)
    return x.addcmul_(gate if gate.dim() == 3 else gate.unsqueeze(1), update if update2 is None else update + update2)


def norm_weight(p: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """A q/k RMSNorm weight in x's dtype (a model loaded in fp8 stores these in fp8 too)."""
    return p if p is None or p.dtype == x.dtype else p.to(x.dtype)
