"""What the diffusion transformers' fusions (flux, chroma, flux_diffusers, mmdit) share: the call conditions, the
attention over the joint sequence (in fp8 where accel/engine/fp8_attention.py takes it), the gated residual /
modulated MLP steps of a DiT block, and the computation of Flux's double and single blocks that ComfyUI's Flux and
Chroma classes share."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from .. import fp8, fp8_attention
from ..attention import StandIn, sdpa_name
from .base import comfy_attend, comfy_attention, kernel_module, plain_linear

EPS = 1e-6  # the LayerNorms and RMSNorms of Flux and MMDiT
FLUX_ATTENTION = "comfy.ldm.flux.math"  # whose optimized_attention ComfyUI's Flux and Chroma blocks call


def linears(*layers: nn.Module) -> bool:
    """Linear layers (ComfyUI's cast-on-the-fly ones included: the fused forwards call them) whose weights have no
    per-call functions (lowvram, a LoRA applied per call), which only the host's forward applies in step."""
    return all(isinstance(layer, nn.Linear) and not getattr(layer, "weight_function", None)
               and not getattr(layer, "bias_function", None) for layer in layers)


def kernels_run_on(x: torch.Tensor) -> bool:
    return kernel_module("adaln").supported(x) and kernel_module("qk_rope").supported(x)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention over (B, L, heads, head_dim) q, k and v, as (B, L, heads * head_dim)."""
    B, L, H, D = q.shape
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).reshape(B, L, H * D)


def comfy_sdpa(module_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """sdpa for a fused block of ComfyUI's `module_name`, or ComfyUI's attention chosen for the whole host where it was
    timed faster for the shape (base.comfy_attend); through the `around` of a StandIn that takes the place of that
    module's attention function (sequence parallelism's exchange), where one does."""
    fn = getattr(sys.modules.get(module_name), "optimized_attention", None)
    host = fn.host if isinstance(fn, StandIn) else fn

    def attend(q, k, v):
        return comfy_attend(host, q, k, v, sdpa, lambda: sdpa_name(*(t.transpose(1, 2) for t in (q, k, v))),
                            lambda q, k, v: host(q.flatten(2), k.flatten(2), v.flatten(2), q.shape[2]))

    return fn.around(attend, q, k, v) if isinstance(fn, StandIn) else attend(q, k, v)


class Joint:
    """One joint sequence's attention in a fused block: the (B, L, heads, head_dim) buffers that each stream's q, k
    and v are written into (kernels/qk_rope.py), and the attention over them: in fp8 where fp8_attention takes it
    (the streams' `projections` make fp8 products, every stream has q/k norm weights `norms`), else comfy_sdpa."""

    def __init__(self, module_name: str, batch: int, tokens: int, heads: int, like: torch.Tensor,
                 projections: tuple[nn.Module, ...], norms: list[tuple], consumers: tuple[nn.Module, ...]) -> None:
        self.module_name, self.heads = module_name, heads
        head_dim = like.shape[-1] // heads
        self.eight = fp8_attention.sequence(module_name, batch, tokens, heads, head_dim, like, projections, norms,
                                            consumers)
        self.qkv = self.eight.qkv if self.eight else kernel_module("qk_rope").empty_qkv(batch, tokens, heads,
                                                                                       head_dim, like)

    def write(self, projected: torch.Tensor, offset: int, norm: tuple, pe: torch.Tensor | None = None) -> None:
        """A stream's qkv projection at its offset: q and k RMS-normalized with norm's weights, rotated by pe."""
        kernel_module("qk_rope").qk_norm_rope(projected, self.heads, self.qkv, offset, *norm, EPS, pe,
                                              **(self.eight.kernel_args() if self.eight else {}))

    def attend(self) -> torch.Tensor | fp8_attention.Output:
        return self.eight.attend() if self.eight else comfy_sdpa(self.module_name, *self.qkv)


def part(out: torch.Tensor | fp8_attention.Output, start: int, stop: int | None,
         consumer: nn.Module | None) -> torch.Tensor | fp8.Rows:
    """Tokens start..stop of an attention output (B, L, heads * head_dim), in the form `consumer` takes (fp8 Rows from
    fp8 attention for a projection making fp8 products; None: 16 bits)."""
    return out.part(start, stop, consumer) if isinstance(out, fp8_attention.Output) else out[:, start:stop]


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


# Flux's block layout: ComfyUI's Flux and Chroma classes (fusions/flux.py, fusions/chroma.py).

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
    """Whether a Flux-layout block call takes the fused forward (every one of `conditions` false, ComfyUI's attention
    chosen for the whole host and not overridden, tensors the kernels run on)."""
    return (not any(conditions) and comfy_attention(FLUX_ATTENTION, transformer_options) is not None
            and kernels_run_on(x))


def double_block(self: nn.Module, img: torch.Tensor, txt: torch.Tensor, pe: torch.Tensor | None, mods: tuple,
                 flipped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A double-stream block's computation with the kernels; mods = (img_mod1, img_mod2, txt_mod1, txt_mod2), each
    with shift, scale and gate of shape (B, 1, C)."""
    img_mod1, img_mod2, txt_mod1, txt_mod2 = mods
    (B, Li, C), Lt, H = img.shape, txt.shape[1], self.num_heads
    streams = [(txt, txt_mod1, self.txt_attn, 0), (img, img_mod1, self.img_attn, Lt)]
    if flipped:
        streams = [(img, img_mod1, self.img_attn, 0), (txt, txt_mod1, self.txt_attn, Li)]
    norms = [(norm_weight(attn.norm.query_norm.scale, x), norm_weight(attn.norm.key_norm.scale, x))
             for x, _, attn, _ in streams]
    joint = Joint(FLUX_ATTENTION, B, Lt + Li, H, img, (self.img_attn.qkv, self.txt_attn.qkv), norms,
                  (self.img_attn.proj, self.txt_attn.proj))
    for (x, mod, attn, offset), norm in zip(streams, norms):
        joint.write(fp8.project(attn.qkv, modulated_norm(x, mod.scale, mod.shift, attn.qkv)), offset, norm, pe)
    out = joint.attend()
    split = streams[0][0].shape[1]
    spans = {streams[0][2]: (0, split), streams[1][2]: (split, None)}

    def update(attn: nn.Module) -> torch.Tensor:
        return fp8.project(attn.proj, part(out, *spans[attn], attn.proj))

    y, img = gated_mlp(img, update(self.img_attn), img_mod1.gate, img_mod2.scale, img_mod2.shift,
                       self.img_mlp[0], self.img_mlp[2])
    gated_residual_(img, img_mod2.gate, y)
    y, txt = gated_mlp(txt, update(self.txt_attn), txt_mod1.gate, txt_mod2.scale, txt_mod2.shift,
                       self.txt_mlp[0], self.txt_mlp[2])
    gated_residual_(txt, txt_mod2.gate, y)
    if txt.dtype == torch.float16:
        txt = torch.nan_to_num(txt, nan=0.0, posinf=65504, neginf=-65504)
    return img, txt


def single_block(self: nn.Module, x: torch.Tensor, pe: torch.Tensor | None, mod) -> torch.Tensor:
    """A single-stream block's computation with the kernels; mod has shift, scale and gate of shape (B, 1, C)."""
    (B, L, C), H = x.shape, self.num_heads
    h = modulated_norm(x, mod.scale, mod.shift, self.linear1)
    # linear1 as two products (q, k, v; the MLP's input), so that the GELU reads a contiguous tensor
    projected, mlp_in = fp8.split_linear(self.linear1, h, (3 * C, self.mlp_hidden_dim))
    norm = norm_weight(self.norm.query_norm.scale, x), norm_weight(self.norm.key_norm.scale, x)
    joint = Joint(FLUX_ATTENTION, B, L, H, x, (self.linear1,), [norm], (self.linear2,))
    joint.write(projected, 0, norm, pe)
    attn = joint.attend()
    # linear2(cat(attention, act)) without writing the concatenation: two products into one output (16-bit: the
    # second accumulates on the first) or two outputs the gated residual adds together (fp8, the GELU in the pass
    # that quantizes its part)
    if fp8.takes_rows(x, self.linear2):
        gated_residual_(x, mod.gate, fp8.matmul(part(attn, 0, None, self.linear2), self.linear2, cols=slice(0, C)),
                        fp8.matmul(fp8.quantized(mlp_in, gelu=True), self.linear2, cols=slice(C, None), bias=False))
    elif plain_linear(self.linear2) and self.linear2.bias is not None:
        w, b = self.linear2.weight, self.linear2.bias
        out = torch.addmm(b, part(attn, 0, None, None).reshape(B * L, C), w[:, :C].t())
        out.addmm_(F.gelu(mlp_in, approximate="tanh").reshape(B * L, -1), w[:, C:].t())
        gated_residual_(x, mod.gate, out.view(B, L, C))
    else:
        gated_residual_(x, mod.gate, self.linear2(torch.cat((part(attn, 0, None, None),
                                                             F.gelu(mlp_in, approximate="tanh")), 2)))
    if x.dtype == torch.float16:
        x = torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
    return x
