"""A compact re-implementation, for tests only, of the ldm / ComfyUI openaimodel `UNetModel`.

Same module tree and attribute names as ComfyUI's (so state-dict keys and `accel/models/spec.py inspect_unet` see the
real thing), same forward signature and ControlNet residual handling. Attention is PyTorch SDPA. Unlike ldm,
no layer is zero-initialised: with random weights every branch must reach the output for the tests to see it.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def timestep_embedding(timesteps: torch.Tensor, dim: int, max_period: int = 10000) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half)
    args = timesteps[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(groups, channels, eps=1e-5)


class TimestepEmbedSequential(nn.Sequential):
    def forward(self, x, emb, context=None, output_shape=None):
        for layer in self:
            if isinstance(layer, ResBlock):
                x = layer(x, emb)
            elif isinstance(layer, SpatialTransformer):
                x = layer(x, context)
            elif isinstance(layer, Upsample):
                x = layer(x, output_shape)
            else:
                x = layer(x)
        return x


class Downsample(nn.Module):
    def __init__(self, channels: int, out_channels: int | None = None) -> None:
        super().__init__()
        self.op = nn.Conv2d(channels, out_channels or channels, 3, stride=2, padding=1)

    def forward(self, x):
        return self.op(x)


class Upsample(nn.Module):
    def __init__(self, channels: int, out_channels: int | None = None) -> None:
        super().__init__()
        self.channels, self.out_channels, self.use_conv, self.dims = channels, out_channels or channels, True, 2
        self.conv = nn.Conv2d(channels, self.out_channels, 3, padding=1)

    def forward(self, x, output_shape=None):
        # ComfyUI upsamples to the skip's size, so odd latent sizes line up again.
        shape = [x.shape[2] * 2, x.shape[3] * 2] if output_shape is None else [output_shape[2], output_shape[3]]
        x = F.interpolate(x, size=shape, mode="nearest")
        return self.conv(x) if self.use_conv else x


class ResBlock(nn.Module):
    def __init__(self, channels: int, emb_channels: int, out_channels: int, groups: int,
                 use_scale_shift_norm: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.use_scale_shift_norm = use_scale_shift_norm
        self.in_layers = nn.Sequential(_norm(channels, groups), nn.SiLU(), nn.Conv2d(channels, out_channels, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, 2 * out_channels if use_scale_shift_norm else out_channels))
        self.out_layers = nn.Sequential(_norm(out_channels, groups), nn.SiLU(), nn.Dropout(dropout),
                                        nn.Conv2d(out_channels, out_channels, 3, padding=1))
        self.skip_connection = nn.Identity() if out_channels == channels else nn.Conv2d(channels, out_channels, 1)

    def forward(self, x, emb):
        h = self.in_layers(x)
        e = self.emb_layers(emb).type(h.dtype)[..., None, None]
        if self.use_scale_shift_norm:
            scale, shift = e.chunk(2, dim=1)
            h = self.out_layers[1:](self.out_layers[0](h) * (1 + scale) + shift)
        else:
            h = self.out_layers(h + e)
        return self.skip_connection(x) + h


def optimized_attention(q, k, v, heads, attn_precision=None, transformer_options=None):
    """ComfyUI's attention function in its PyTorch form: (B, tokens, heads * dim) in and out."""
    b = q.shape[0]
    q, k, v = (t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, q.shape[-1] * heads)


# ComfyUI's default on NVIDIA and AMD GPUs: optimized_attention is its PyTorch attention function.
attention_pytorch = optimized_attention


def optimized_attention_masked(q, k, v, heads, mask, attn_precision=None, transformer_options=None):
    b = q.shape[0]
    q, k, v = (t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, -1, q.shape[-1] * heads)


class CrossAttention(nn.Module):
    def __init__(self, query_dim: int, context_dim: int | None, heads: int, dim_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.attn_precision = None
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(context_dim or query_dim, inner, bias=False)
        self.to_v = nn.Linear(context_dim or query_dim, inner, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None, value=None, mask=None, transformer_options={}):  # noqa: B006 (ComfyUI's)
        q = self.to_q(x)
        context = x if context is None else context
        k = self.to_k(context)
        v = self.to_v(context if value is None else value)
        if mask is None:
            out = optimized_attention(q, k, v, self.heads, attn_precision=self.attn_precision,
                                      transformer_options=transformer_options)
        else:
            out = optimized_attention_masked(q, k, v, self.heads, mask, attn_precision=self.attn_precision,
                                             transformer_options=transformer_options)
        return self.to_out(out)


class GEGLU(nn.Module):
    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(GEGLU(dim, dim * mult), nn.Dropout(dropout), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, d_head: int, context_dim: int) -> None:
        super().__init__()
        self.attn1 = CrossAttention(dim, None, n_heads, d_head)
        self.ff = FeedForward(dim)
        self.attn2 = CrossAttention(dim, context_dim, n_heads, d_head)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        # ComfyUI's options, in their text-to-image settings
        self.ff_in, self.disable_self_attn, self.switch_temporal_ca_to_sa, self.is_res = False, False, False, True

    def forward(self, x, context=None, transformer_options={}):  # noqa: B006 (ComfyUI's signature)
        x = self.attn1(self.norm1(x)) + x
        x = self.attn2(self.norm2(x), context) + x
        return self.ff(self.norm3(x)) + x


class SpatialTransformer(nn.Module):
    def __init__(self, in_channels: int, n_heads: int, d_head: int, depth: int, context_dim: int,
                 use_linear: bool, groups: int) -> None:
        super().__init__()
        inner = n_heads * d_head
        self.use_linear = use_linear
        self.norm = nn.GroupNorm(groups, in_channels, eps=1e-6)
        self.proj_in = nn.Linear(in_channels, inner) if use_linear else nn.Conv2d(in_channels, inner, 1)
        self.transformer_blocks = nn.ModuleList(
            [BasicTransformerBlock(inner, n_heads, d_head, context_dim) for _ in range(depth)])
        self.proj_out = nn.Linear(inner, in_channels) if use_linear else nn.Conv2d(inner, in_channels, 1)

    def forward(self, x, context=None, transformer_options={}):  # noqa: B006 (ComfyUI's signature and body)
        if not isinstance(context, list):
            context = [context] * len(self.transformer_blocks)
        b, c, h, w = x.shape
        transformer_options["activations_shape"] = list(x.shape)
        x_in = x
        x = self.norm(x)
        if not self.use_linear:
            x = self.proj_in(x)
        x = x.movedim(1, 3).flatten(1, 2).contiguous()
        if self.use_linear:
            x = self.proj_in(x)
        for i, block in enumerate(self.transformer_blocks):
            transformer_options["block_index"] = i
            x = block(x, context=context[i], transformer_options=transformer_options)
        if self.use_linear:
            x = self.proj_out(x)
        x = x.reshape(x.shape[0], h, w, x.shape[-1]).movedim(3, 1).contiguous()
        if not self.use_linear:
            x = self.proj_out(x)
        return x + x_in


def _apply_control(h: torch.Tensor, control: dict | None, name: str) -> torch.Tensor:
    if control is not None and control.get(name):
        ctrl = control[name].pop()
        if ctrl is not None:
            h = h + ctrl
    return h


class UNetModel(nn.Module):
    def __init__(self, in_channels: int = 4, model_channels: int = 320, out_channels: int = 4, num_res_blocks: int = 2,
                 attention_resolutions: Sequence[int] = (4, 2, 1), channel_mult: Sequence[int] = (1, 2, 4, 4),
                 num_heads: int = -1, num_head_channels: int = -1, context_dim: int | None = 768,
                 transformer_depth: int | Sequence[int] = 1, transformer_depth_middle: int | None = None,
                 use_linear_in_transformer: bool = False, num_classes: int | str | None = None,
                 adm_in_channels: int | None = None, use_scale_shift_norm: bool = False, norm_groups: int = 32,
                 dropout: float = 0.0, **unused) -> None:
        # unused: ComfyUI's other kwargs (image_size, legacy, dtype, device, operations, ...) change nothing here.
        super().__init__()
        if num_heads == -1 and num_head_channels == -1:
            raise ValueError("give num_heads or num_head_channels")
        depths = [transformer_depth] * len(channel_mult) if isinstance(transformer_depth, int) else list(transformer_depth)
        depth_middle = depths[-1] if transformer_depth_middle is None else transformer_depth_middle
        self.in_channels, self.out_channels, self.model_channels = in_channels, out_channels, model_channels
        self.num_classes, self.adm_in_channels, self.context_dim = num_classes, adm_in_channels, context_dim
        ted = model_channels * 4
        self.time_embed = nn.Sequential(nn.Linear(model_channels, ted), nn.SiLU(), nn.Linear(ted, ted))
        if num_classes == "sequential":
            self.label_emb = nn.Sequential(nn.Sequential(nn.Linear(adm_in_channels, ted), nn.SiLU(), nn.Linear(ted, ted)))
        elif num_classes is not None:
            self.label_emb = nn.Embedding(num_classes, ted)

        def res(ch_in: int, ch_out: int) -> ResBlock:
            return ResBlock(ch_in, ted, ch_out, norm_groups, use_scale_shift_norm, dropout)

        def attn(ch: int, depth: int) -> SpatialTransformer:
            heads, d_head = (ch // num_head_channels, num_head_channels) if num_head_channels != -1 else (num_heads, ch // num_heads)
            return SpatialTransformer(ch, heads, d_head, depth, context_dim, use_linear_in_transformer, norm_groups)

        self.input_blocks = nn.ModuleList([TimestepEmbedSequential(nn.Conv2d(in_channels, model_channels, 3, padding=1))])
        chans, ch, ds = [model_channels], model_channels, 1
        for level, mult in enumerate(channel_mult):
            for _ in range(num_res_blocks):
                layers: list[nn.Module] = [res(ch, mult * model_channels)]
                ch = mult * model_channels
                if ds in attention_resolutions and depths[level] > 0:
                    layers.append(attn(ch, depths[level]))
                self.input_blocks.append(TimestepEmbedSequential(*layers))
                chans.append(ch)
            if level != len(channel_mult) - 1:
                self.input_blocks.append(TimestepEmbedSequential(Downsample(ch)))
                chans.append(ch)
                ds *= 2
        self.middle_block = TimestepEmbedSequential(res(ch, ch), attn(ch, depth_middle), res(ch, ch))
        self.output_blocks = nn.ModuleList([])
        for level, mult in list(enumerate(channel_mult))[::-1]:
            for i in range(num_res_blocks + 1):
                layers = [res(ch + chans.pop(), model_channels * mult)]
                ch = model_channels * mult
                if ds in attention_resolutions and depths[level] > 0:
                    layers.append(attn(ch, depths[level]))
                if level and i == num_res_blocks:
                    layers.append(Upsample(ch))
                    ds //= 2
                self.output_blocks.append(TimestepEmbedSequential(*layers))
        self.out = nn.Sequential(_norm(ch, norm_groups), nn.SiLU(), nn.Conv2d(model_channels, out_channels, 3, padding=1))

    def forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):
        # ComfyUI pops residuals off these lists; copying them leaves the caller's dict as it was.
        control = {k: list(v) for k, v in control.items()} if control is not None else None
        emb = self.time_embed(timestep_embedding(timesteps, self.model_channels).to(x.dtype))
        if self.num_classes is not None:
            if y is None or y.shape[0] != x.shape[0]:
                raise ValueError("this UNet needs y with one row per latent")
            emb = emb + self.label_emb(y)
        hs, h = [], x
        for module in self.input_blocks:
            h = _apply_control(module(h, emb, context), control, "input")
            hs.append(h)
        h = _apply_control(self.middle_block(h, emb, context), control, "middle")
        for module in self.output_blocks:
            hsp = _apply_control(hs.pop(), control, "output")
            h = module(torch.cat([h, hsp], dim=1), emb, context, hs[-1].shape if hs else None)
        return self.out(h.type(x.dtype))


def sd15_kwargs() -> dict:
    """ComfyUI's SD1.5 UNet configuration."""
    return dict(in_channels=4, model_channels=320, out_channels=4, num_res_blocks=2, attention_resolutions=(4, 2, 1),
                channel_mult=(1, 2, 4, 4), num_heads=8, context_dim=768, transformer_depth=1)


def sdxl_kwargs() -> dict:
    """ComfyUI's SDXL base UNet configuration."""
    return dict(in_channels=4, model_channels=320, out_channels=4, num_res_blocks=2, attention_resolutions=(4, 2),
                channel_mult=(1, 2, 4), num_head_channels=64, context_dim=2048, transformer_depth=(0, 2, 10),
                transformer_depth_middle=10, use_linear_in_transformer=True, num_classes="sequential",
                adm_in_channels=2816)


def tiny_ldm_unet(sdxl: bool = False, seed: int = 0) -> UNetModel:
    """A small ldm UNet with SD1.5's (or SDXL's) block layout and seeded random weights, in eval mode."""
    torch.manual_seed(seed)
    if sdxl:
        m = UNetModel(model_channels=32, num_res_blocks=1, attention_resolutions=(2,), channel_mult=(1, 2),
                      num_head_channels=8, context_dim=48, transformer_depth=(0, 2), use_linear_in_transformer=True,
                      num_classes="sequential", adm_in_channels=80, norm_groups=8)
    else:
        m = UNetModel(model_channels=32, num_res_blocks=1, attention_resolutions=(1,), channel_mult=(1, 2),
                      num_heads=4, context_dim=32, transformer_depth=1, norm_groups=8)
    return m.eval().requires_grad_(False)
