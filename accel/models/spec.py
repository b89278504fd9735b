"""UNet adapters: one canonical call for diffusers and ldm-style (ComfyUI / A1111) UNets.

The canonical call is the ldm signature `unet(x, timesteps, context, y=None, control=None)`, where
`y` is the ldm "adm" vector (SDXL: pooled text embedding followed by the Fourier-embedded size and
crop conditioning) and `control` is ComfyUI's dict of ControlNet residuals
({"input": [...], "middle": [...], "output": [...]}).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import BadInput, UnsupportedModel

if TYPE_CHECKING:
    from .dit import CanonicalDiT


@dataclass(frozen=True)
class UNetSpec:
    form: str  # "diffusers" | "ldm"
    family: str  # "sd1" | "sd2" | "sdxl" | "custom"
    in_channels: int
    out_channels: int
    model_channels: int
    context_dim: int
    adm_channels: int  # 0 when the model takes no `y`
    num_params: int

    def describe(self) -> str:
        return (f"{self.family} UNet ({self.form} form, {self.num_params / 1e6:.0f}M parameters, "
                f"context {self.context_dim}, {self.in_channels}->{self.out_channels} channels)")


def _family(context_dim: int, adm: int) -> str:
    if adm == 2816 or context_dim == 2048:
        return "sdxl"
    if context_dim == 1024:
        return "sd2"
    if context_dim == 768:
        return "sd1"
    return "custom"  # same block structure, other widths (the tiny test configs)


def _is_diffusers(m: nn.Module) -> bool:
    return hasattr(m, "config") and hasattr(m, "down_blocks") and hasattr(m, "conv_in") and hasattr(m, "up_blocks")


def _is_ldm(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("input_blocks", "middle_block", "output_blocks", "model_channels"))


def _ldm_context_dim(m: nn.Module) -> int:
    for name, sub in m.named_modules():
        if name.endswith("attn2") and hasattr(sub, "to_k"):
            return sub.to_k.in_features
    return int(getattr(m, "context_dim", 0) or 0)


def inspect_unet(m: nn.Module) -> UNetSpec:
    """The UNetSpec of a diffusers or ldm-style UNet; UnsupportedModel for anything else."""
    n = sum(p.numel() for p in m.parameters())
    if _is_diffusers(m):
        c = m.config
        adm = int(c.get("projection_class_embeddings_input_dim") or 0) if c.get("addition_embed_type") == "text_time" else 0
        ctx = int(c["cross_attention_dim"] if not isinstance(c["cross_attention_dim"], (list, tuple)) else c["cross_attention_dim"][0])
        return UNetSpec("diffusers", _family(ctx, adm), c["in_channels"], c["out_channels"], c["block_out_channels"][0], ctx, adm, n)
    if _is_ldm(m):
        adm = int(getattr(m, "adm_in_channels", 0) or 0) if getattr(m, "num_classes", None) == "sequential" else 0
        ctx = _ldm_context_dim(m)
        return UNetSpec("ldm", _family(ctx, adm), m.in_channels, m.out_channels, m.model_channels, ctx, adm, n)
    raise UnsupportedModel(
        f"{type(m).__name__} is not a supported UNet (expected a diffusers UNet2DConditionModel or an "
        "ldm/ComfyUI/A1111 UNetModel).",
        "Connect the model output of a checkpoint loader for SD1.x, SD2.x or SDXL; other model types run unaccelerated.")


FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


class Canonical(nn.Module):
    """What the engines read of a wrapped diffusion model (UNet or DiT): the module as `unet`, its dtype and device."""

    # Why a CUDA graph cannot capture the host's forward of this model, where it cannot: the torch path then runs
    # without graphs and says this once.
    uncapturable: str | None = None

    def __init__(self, module: nn.Module, fed: torch.dtype | None = None) -> None:
        super().__init__()
        self.unet = module
        self.fed = fed

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in: its weights'; for weights stored in fp8, which its layers widen per call,
        the dtype the host feeds it (`fed`: ComfyUI's manual-cast dtype for its fp8_e4m3fn weight dtype, float16 for
        SDXL on most GPUs, bfloat16 for Flux), bfloat16 where that is not known. Layers a host keeps in float32
        whatever the model's dtype (ComfyUI's Wan patch embedding, the first parameter) do not decide it."""
        dtype = next((p.dtype for p in self.unet.parameters() if p.dtype != torch.float32), torch.float32)
        if dtype not in FP8_DTYPES:
            return dtype
        return self.fed if self.fed in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16

    @property
    def device(self) -> torch.device:
        return next(self.unet.parameters()).device


class CanonicalUNet(Canonical):
    """Calls a diffusers or ldm UNet through the canonical signature. Holds the module, changes nothing."""

    size_multiple = 8  # latent pixels: three 2x downsamplings must divide the size evenly

    def __init__(self, unet: nn.Module, fed: torch.dtype | None = None) -> None:
        spec = inspect_unet(unet)
        super().__init__(unet, fed)
        self.spec = spec

    def check(self, x: torch.Tensor, context: torch.Tensor, y: torch.Tensor | None) -> None:
        s = self.spec
        if x.dim() != 4 or x.shape[1] != s.in_channels:
            raise BadInput(f"latent has shape {tuple(x.shape)}; this UNet takes (batch, {s.in_channels}, height, width).",
                           "Feed it latents made for this model (an SD latent has 4 channels).")
        if context.dim() != 3 or context.shape[-1] != s.context_dim:
            raise BadInput(f"conditioning has shape {tuple(context.shape)}; this UNet takes (batch, tokens, {s.context_dim}).",
                           "Use the text encoder that belongs to this checkpoint.")
        if s.adm_channels and (y is None or y.shape[-1] != s.adm_channels):
            raise BadInput(f"this {s.family} UNet needs the pooled/size conditioning y of width {s.adm_channels}.",
                           "Pass y (ComfyUI and A1111 do this for SDXL checkpoints).")

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                y: torch.Tensor | None = None, control: dict | None = None, guidance: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        if guidance is not None:
            raise BadInput("a guidance input was given to a UNet; only guidance-distilled transformers (Flux-dev) "
                           "take one.", "Leave guidance out for SD UNets.")
        if self.spec.form == "ldm":
            extra = {"y": y} if y is not None else {}
            if control is not None:
                extra["control"] = control
            return self.unet(x, timesteps=timesteps, context=context, **extra, **kwargs)
        return _diffusers_call(self.unet, self.spec, x, timesteps, context, y, control)


def canonical(model: nn.Module, fed: torch.dtype | None = None) -> "CanonicalUNet | CanonicalDiT":
    """The canonical-call wrapper of a UNet (CanonicalUNet) or a diffusion transformer (CanonicalDiT); a model
    already wrapped as is. fed: the dtype the host feeds the model (Canonical.dtype). UnsupportedModel for anything
    else."""
    from .dit import CanonicalDiT, is_dit

    if isinstance(model, (CanonicalUNet, CanonicalDiT)):
        return model
    return CanonicalDiT(model, fed) if is_dit(model) else CanonicalUNet(model, fed)


class _IdentityTimeProj(nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t


def _diffusers_call(unet: nn.Module, spec: UNetSpec, x, timesteps, context, y, control) -> torch.Tensor:
    kw: dict[str, Any] = {}
    if control is not None:
        if control.get("output"):
            kw["down_block_additional_residuals"] = tuple(c for c in control["output"])
        if control.get("middle"):
            kw["mid_block_additional_residual"] = control["middle"][0]
    if not spec.adm_channels:
        return unet(x, timesteps, context, return_dict=False, **kw)[0]
    # ldm's y already holds the Fourier-embedded size conditioning; diffusers embeds time_ids itself.
    # Feeding that part as time_ids through an identity projection gives exactly ldm's add_embedding input.
    text_dim = _text_embed_dim(unet)
    original = unet.add_time_proj
    unet.add_time_proj = _IdentityTimeProj()
    try:
        kw["added_cond_kwargs"] = {"text_embeds": y[:, :text_dim], "time_ids": y[:, text_dim:]}
        return unet(x, timesteps, context, return_dict=False, **kw)[0]
    finally:
        unet.add_time_proj = original


def _text_embed_dim(unet: nn.Module) -> int:
    c = unet.config
    return c["projection_class_embeddings_input_dim"] - 6 * c["addition_time_embed_dim"]


def sdxl_y(unet: nn.Module, text_embeds: torch.Tensor, time_ids: torch.Tensor) -> torch.Tensor:
    """ldm-style y from diffusers' SDXL conditioning (pooled text embedding and the six size/crop ids)."""
    te = unet.add_time_proj(time_ids.flatten()).reshape(text_embeds.shape[0], -1)
    return torch.cat([text_embeds, te.to(text_embeds.dtype)], dim=-1)
