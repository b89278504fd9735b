"""Diffusion transformers (Flux.1 and Chroma, SD3/SD3.5 MMDiT, Wan 2.1/2.2 video, Qwen-Image) behind the same
canonical call as the UNets.

The canonical call is `dit(x, timesteps, context, y=None, control=None, guidance=None)`: x the latent image
(batch, channels, height, width), timesteps as the host's sampler passes them (Flux: sigma; SD3: 1000 * sigma),
context the text tokens, y the pooled text embedding, guidance Flux-dev's distilled guidance scale, control ComfyUI's
ControlNet dict. Two forms: ComfyUI's own classes (comfy.ldm.flux.model.Flux, comfy.ldm.chroma.model.Chroma, comfy.ldm.
modules.diffusionmodules.mmdit.MMDiT) and diffusers' (FluxTransformer2DModel, SD3Transformer2DModel), whose
packed-token call the adapter makes. Chroma is Flux's architecture without the pooled text input, its blocks'
modulation computed once per call by a small network (the "approximator") instead of a projection in every block.
Wan (ComfyUI's comfy.ldm.wan.model.WanModel) takes video latents (batch, channels, frames, height, width) and
Qwen-Image (comfy.ldm.qwen_image.model.QwenImageTransformer2DModel) latents of one frame, (batch, channels, 1, height,
width) as ComfyUI passes them, or (batch, channels, height, width). Z-Image (ComfyUI 0.33's comfy.ldm.lumina.model.NextDiT
in the form its supported_models.ZImage builds: Lumina 2's class with Z-Image's modulation) takes the text tokens and
their count, which the canonical call gives as the context's (ComfyUI 0.33's forward reads neither count nor mask).
HunyuanVideo 1.5 (ComfyUI 0.33's comfy.ldm.hunyuan_video.model.HunyuanVideo in the form its supported_models.
HunyuanVideo15 builds: a vision input, 3-D patches) is Flux's double-stream blocks over video latents (batch, channels,
frames, height, width), its channels the latent's with the image condition's and its mask.
LTX-2 (ComfyUI 0.33's comfy.ldm.lightricks.av_model.LTXAVModel in LTX-2's form) denoises a video and an audio latent
together: the canonical call's x is the video latent (batch, channels, frames, height, width), y the audio latent
(batch, 8, frames, 16) and guidance the frame rate (batch,), the one other input of its forward that a call of a plain
text-to-video-and-audio run carries (it places the video's tokens in time), given as a float64 tensor so that a CUDA
graph takes it as an input; both latents are denoised with the timestep given, and the output is the two latents
flattened side by side, (batch, 1, video's values + audio's) as ComfyUI's sampler packs them (ltx2_outputs splits it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import BadInput, UnsupportedModel
from .spec import Canonical


@dataclass(frozen=True)
class DiTSpec:
    form: str  # "comfy" | "diffusers"
    family: str  # "flux" | "chroma" | "sd3" | "wan" | "qwen-image" | "z-image" | "hunyuan-video" | "ltx2"
    in_channels: int  # latent channels
    hidden_size: int
    heads: int
    depth: int  # joint (double-stream) blocks
    single_depth: int  # single-stream blocks (Flux)
    context_dim: int
    pooled_dim: int
    guidance: bool  # takes Flux-dev's guidance input
    patch_size: int
    num_params: int

    def describe(self) -> str:
        blocks = f"{self.depth} joint" + (f" + {self.single_depth} single" if self.single_depth else "") + " blocks"
        return (f"{self.family} DiT ({self.form} form, {self.num_params / 1e9:.2f}B parameters, {blocks}, hidden "
                f"{self.hidden_size}, {self.heads} heads)")


def is_dit(m: nn.Module) -> bool:
    return _kind(m) is not None


def _kind(m: nn.Module) -> tuple[str, str] | None:
    name = type(m).__name__
    if name == "Flux" and hasattr(m, "double_blocks") and hasattr(m, "single_blocks") and hasattr(m, "params"):
        return "comfy", "flux"
    if name == "Chroma" and hasattr(m, "double_blocks") and hasattr(m, "distilled_guidance_layer") \
            and hasattr(m, "params"):
        return "comfy", "chroma"
    if hasattr(m, "joint_blocks") and hasattr(m, "x_embedder") and hasattr(m, "context_embedder") \
            and not hasattr(m, "config"):
        return "comfy", "sd3"
    if name == "WanModel" and hasattr(m, "blocks") and hasattr(m, "patch_embedding") and hasattr(m, "head"):
        return "comfy", "wan"
    if name == "QwenImageTransformer2DModel" and hasattr(m, "transformer_blocks") and hasattr(m, "txt_in") \
            and not hasattr(m, "config"):
        return "comfy", "qwen-image"
    if name == "NextDiT" and type(m).__module__ == "comfy.ldm.lumina.model" and _z_image(m):
        return "comfy", "z-image"
    if name == "HunyuanVideo" and type(m).__module__ == "comfy.ldm.hunyuan_video.model" and _hunyuan_video15(m):
        return "comfy", "hunyuan-video"
    if name == "LTXAVModel" and type(m).__module__ == "comfy.ldm.lightricks.av_model" and _ltx2(m):
        return "comfy", "ltx2"
    if name == "FluxTransformer2DModel":
        return "diffusers", "flux"
    if name == "SD3Transformer2DModel":
        return "diffusers", "sd3"
    return None


def _z_image(m: nn.Module) -> bool:
    """A NextDiT of Z-Image's form: its blocks' modulation a projection of the 256-wide time embedding with no SiLU
    before it (z_image_modulation), no pooled text input. Lumina 2's own form (and NewBie's) is not accelerated."""
    layers = getattr(m, "layers", None)
    if not layers or not all(hasattr(m, a) for a in ("x_embedder", "cap_embedder", "final_layer", "dim", "n_heads")):
        return False
    modulation = getattr(layers[0], "adaLN_modulation", None)
    return (isinstance(modulation, nn.Sequential) and len(modulation) == 1
            and getattr(m, "clip_text_pooled_proj", None) is None)


def _hunyuan_video15(m: nn.Module) -> bool:
    """A HunyuanVideo of version 1.5's form: a vision input (what ComfyUI tells 1.5 by), 3-D patches, Flux's double
    blocks. Not its MeanFlow-distilled forms (time_r_in), whose forward reads the sampler's sigmas from the
    transformer_options that an engine call does not carry; nor HunyuanVideo 1.0 or HunyuanImage 2.1, the same class
    in forms not tested here."""
    params = getattr(m, "params", None)
    return (getattr(m, "vision_in", None) is not None and getattr(m, "time_r_in", None) is None
            and hasattr(m, "double_blocks") and hasattr(m, "single_blocks") and hasattr(m, "txt_in")
            and len(getattr(params, "patch_size", ())) == 3)


def _ltx2(m: nn.Module) -> bool:
    """An LTXAVModel of LTX-2's form: caption projections before its blocks (caption_proj_before_connector false), no
    gated attention, no cross-attention adaLN, no keyframe embedding. LTX-2.3's form (gated attention, adaLN on the text
    cross attention, its projection before the connectors) is not accelerated."""
    return (getattr(m, "caption_proj_before_connector", None) is False and getattr(m, "apply_gated_attention", None)
            is False and getattr(m, "cross_attention_adaln", None) is False
            and getattr(m, "keyframes_abs_pos_embedding", None) is None and hasattr(m, "transformer_blocks")
            and hasattr(m, "audio_patchify_proj"))


def inspect_dit(m: nn.Module) -> DiTSpec:
    """The DiTSpec of a Flux or SD3 transformer in ComfyUI's or diffusers' form; UnsupportedModel otherwise."""
    kind = _kind(m)
    if kind is None:
        raise UnsupportedModel(
            f"{type(m).__name__} is not a supported diffusion transformer (Flux.1, Chroma or SD3/SD3.5, in "
            "ComfyUI's or diffusers' form; Wan 2.1/2.2, Qwen-Image, Z-Image, HunyuanVideo 1.5 or LTX-2 in "
            "ComfyUI's).", "Other model types run unaccelerated.")
    n = sum(p.numel() for p in m.parameters())
    form, family = kind
    if form == "comfy" and family == "flux":
        p = m.params
        return DiTSpec(form, family, p.in_channels, p.hidden_size, p.num_heads, p.depth, p.depth_single_blocks,
                       p.context_in_dim, p.vec_in_dim or 0, bool(p.guidance_embed), p.patch_size, n)
    if form == "comfy" and family == "chroma":  # its in_channels count a patch's values
        p = m.params
        return DiTSpec(form, family, p.in_channels // p.patch_size ** 2, p.hidden_size, p.num_heads, p.depth,
                       p.depth_single_blocks, p.context_in_dim, 0, True, p.patch_size, n)
    if family == "wan":
        return DiTSpec(form, family, m.in_dim, m.dim, m.num_heads, len(m.blocks), 0, m.text_dim, 0, False,
                       m.patch_size[-1], n)
    if family == "qwen-image":  # its in_channels count a 2x2 patch's values
        block = m.transformer_blocks[0]
        return DiTSpec(form, family, m.in_channels // m.patch_size ** 2, m.inner_dim, block.num_attention_heads,
                       len(m.transformer_blocks), 0, m.txt_in.in_features, 0, False, m.patch_size, n)
    if family == "z-image":  # single-stream blocks over the text and image tokens (Lumina's JointTransformerBlock)
        return DiTSpec(form, family, m.in_channels, m.dim, m.n_heads, len(m.layers), 0, m.cap_embedder[-1].in_features,
                       0, False, m.patch_size, n)
    if family == "hunyuan-video":  # its in_channels: the latent's, the image condition's and its mask's
        p = m.params
        return DiTSpec(form, family, p.in_channels, p.hidden_size, p.num_heads, p.depth, p.depth_single_blocks,
                       p.context_in_dim, p.vec_in_dim or 0, bool(p.guidance_embed), p.patch_size[-1], n)
    if family == "ltx2":  # its video stream's; the context holds the video's and the audio's text side by side
        return DiTSpec(form, family, m.in_channels, m.inner_dim, m.num_attention_heads, len(m.transformer_blocks), 0,
                       2 * m.caption_channels, 0, False, 1, n)
    if form == "comfy":
        hidden = m.x_embedder.proj.out_features if hasattr(m.x_embedder.proj, "out_features") \
            else m.x_embedder.proj.out_channels
        heads = m.joint_blocks[0].x_block.attn.num_heads
        pooled = m.y_embedder.mlp[0].in_features if getattr(m, "y_embedder", None) is not None else 0
        return DiTSpec(form, family, m.in_channels, hidden, heads, len(m.joint_blocks), 0,
                       m.context_embedder.in_features, pooled, False, m.patch_size, n)
    c = m.config
    heads, hidden = c["num_attention_heads"], c["num_attention_heads"] * c["attention_head_dim"]
    if family == "flux":
        return DiTSpec(form, family, c["in_channels"] // 4, hidden, heads, c["num_layers"], c["num_single_layers"],
                       c["joint_attention_dim"], c["pooled_projection_dim"], bool(c["guidance_embeds"]), 2, n)
    return DiTSpec(form, family, c["in_channels"], hidden, heads, c["num_layers"], 0, c["joint_attention_dim"],
                   c["pooled_projection_dim"], False, c["patch_size"], n)


class CanonicalDiT(Canonical):
    """Calls a Flux or SD3 transformer through the canonical signature. Holds the module (as `unet`, the name the
    engines read for either kind of diffusion model), changes nothing."""

    def __init__(self, module: nn.Module, fed: torch.dtype | None = None) -> None:
        spec = inspect_dit(module)
        super().__init__(module, fed)
        self.spec = spec

    @property
    def size_multiple(self) -> int:
        return self.spec.patch_size

    @property
    def uncapturable(self) -> str | None:
        if self.spec.family == "ltx2":
            return ("ComfyUI's LTX-2 forward copies constants from the CPU at every call (its patchifier's "
                    "coordinates), which a CUDA graph cannot capture")
        return None

    def check(self, x: torch.Tensor, context: torch.Tensor, y: torch.Tensor | None) -> None:
        s = self.spec
        dims = {"wan": (5,), "hunyuan-video": (5,), "ltx2": (5,), "qwen-image": (4, 5)}.get(s.family, (4,))
        if x.dim() not in dims or x.shape[1] != s.in_channels:
            frames = "frames, " if dims == (5,) else ""
            raise BadInput(f"latent has shape {tuple(x.shape)}; this {s.family} transformer takes (batch, "
                           f"{s.in_channels}, {frames}height, width).", "Feed it latents made for this model's VAE.")
        if context.dim() != 3 or context.shape[-1] != s.context_dim:
            raise BadInput(f"conditioning has shape {tuple(context.shape)}; this {s.family} transformer takes "
                           f"(batch, tokens, {s.context_dim}).", "Use the text encoders that belong to this model.")
        if s.family == "ltx2" and (y is None or y.dim() != 4 or y.shape[0] != x.shape[0]):
            raise BadInput(f"this LTX-2 transformer takes its audio latent (batch, 8, frames, 16) as y; it was given "
                           f"{None if y is None else tuple(y.shape)}.", "Pass the audio latent beside the video's.")
        if s.pooled_dim and s.form == "diffusers" and (y is None or y.shape[-1] != s.pooled_dim):
            raise BadInput(f"this {s.family} transformer needs the pooled text embedding y of width {s.pooled_dim}.",
                           "Pass y (ComfyUI does for Flux and SD3 checkpoints).")

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor, y: torch.Tensor | None = None,
                control: dict | None = None, guidance: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        s = self.spec
        if s.form == "comfy" and s.family == "flux":
            return self.unet(x, timesteps, context, y=y, guidance=guidance, control=control, **kwargs)
        if s.family == "chroma":
            if guidance is None:  # ComfyUI's Chroma model passes 0 unless a node sets it
                guidance = torch.zeros(x.shape[0], device=x.device)
            return self.unet(x, timesteps, context, guidance, control=control, **kwargs)
        if s.family == "wan":
            return self.unet(x, timesteps, context, **kwargs)
        if s.family == "z-image":
            return self.unet(x, timesteps, context, context.shape[1], **kwargs)
        if s.family == "hunyuan-video":
            return self.unet(x, timesteps, context, y, guidance=guidance, control=control, **kwargs)
        if s.family == "ltx2":
            # the frame rate as one value: a 0-d tensor multiplies the positions as ComfyUI's float does
            rate = {} if guidance is None else {"frame_rate": guidance.reshape(-1)[0]}
            out = self.unet([x, y.to(x.dtype)], timesteps, context, control=control, **rate, **kwargs)
            return torch.cat([t.reshape(t.shape[0], 1, -1) for t in (out if isinstance(out, list) else [out])], -1)
        if s.family == "qwen-image":
            extra = {"control": control} if control is not None else {}
            image = x.dim() == 4  # ComfyUI's class takes one frame's latents as (batch, channels, 1, height, width)
            out = self.unet(x.unsqueeze(2) if image else x, timesteps, context, guidance=guidance, **extra, **kwargs)
            return out.squeeze(2) if image else out
        if s.form == "comfy":
            # The class's forward: while the ComfyUI node serves an SD3 call, the instance's own is the node's.
            return type(self.unet).forward(self.unet, x, timesteps, context=context, y=y, control=control, **kwargs)
        if control:
            raise BadInput("ControlNet residuals are passed to diffusers' transformers by their own pipelines.",
                           "Run ControlNet through ComfyUI's form of the model.")
        if s.family == "sd3":
            return self.unet(hidden_states=x, encoder_hidden_states=context, pooled_projections=y, timestep=timesteps,
                             return_dict=False)[0]
        return _diffusers_flux(self.unet, x, timesteps, context, y, guidance)


def _diffusers_flux(model: nn.Module, x, timesteps, context, y, guidance) -> torch.Tensor:
    """diffusers' Flux call on x's 2x2 patches as tokens (its pipeline's _pack_latents), unpacked after."""
    B, C, H, W = x.shape
    h, w = H // 2, W // 2
    tokens = x.view(B, C, h, 2, w, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, h * w, C * 4)
    img_ids = torch.zeros(h, w, 3, device=x.device, dtype=x.dtype)
    img_ids[..., 1] = torch.arange(h, device=x.device, dtype=x.dtype)[:, None]
    img_ids[..., 2] = torch.arange(w, device=x.device, dtype=x.dtype)[None, :]
    txt_ids = torch.zeros(context.shape[1], 3, device=x.device, dtype=x.dtype)
    if guidance is None and model.config["guidance_embeds"]:
        raise BadInput("this Flux transformer takes a guidance scale (Flux-dev); none was given.",
                       "Pass guidance (ComfyUI's FluxGuidance node; 3.5 is usual).")
    out = model(hidden_states=tokens, timestep=timesteps, guidance=guidance, pooled_projections=y,
                encoder_hidden_states=context, txt_ids=txt_ids, img_ids=img_ids.reshape(h * w, 3),
                return_dict=False)[0]
    return out.view(B, h, w, C, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


def ltx2_outputs(out: torch.Tensor, video: torch.Tensor, audio: torch.Tensor) -> list[torch.Tensor]:
    """LTX-2's canonical output (batch, 1, values) as its forward returns it, [video, audio] in the shapes of the
    latents given."""
    n = video[0].numel()
    return [out[:, :, :n].reshape(video.shape), out[:, :, n:].reshape(audio.shape)]
