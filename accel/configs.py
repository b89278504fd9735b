"""Published architecture configs (SD1.5, SD2.1, SDXL UNets, the SD VAE) and tiny ones for the CPU.

Models are built from these with seeded random weights: nothing is downloaded.
"""

from __future__ import annotations

import torch
from torch import nn

UNET_CONFIGS: dict[str, dict] = {
    # runwayml/stable-diffusion-v1-5 unet/config.json
    "sd15": dict(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32),
    # stabilityai/stable-diffusion-2-1 unet/config.json
    "sd21": dict(
        sample_size=96, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20), use_linear_projection=True, norm_num_groups=32),
    # stabilityai/stable-diffusion-xl-base-1.0 unet/config.json
    "sdxl": dict(
        sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816, norm_num_groups=32),
    # Small versions with the same block types, for the CPU and for tests.
    "tiny-sd15": dict(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8),
    "tiny-sdxl": dict(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2), attention_head_dim=(4, 8), cross_attention_dim=48,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8, norm_num_groups=8),
}

VAE_CONFIGS: dict[str, dict] = {
    # runwayml/stable-diffusion-v1-5 vae/config.json (the SD1.x/SD2.x VAE; SDXL's has the same architecture)
    "sd": dict(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=32, sample_size=512, scaling_factor=0.18215),
    "tiny": dict(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=8, sample_size=32, scaling_factor=0.18215),
}

# Token count and context width of each UNet's text conditioning, and the latent side at its native resolution.
SHAPES = {"sd15": (77, 64), "sd21": (77, 96), "sdxl": (77, 128), "tiny-sd15": (77, 16), "tiny-sdxl": (77, 16)}


def _seeded(build, seed: int, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    from diffusers.utils import logging

    logging.set_verbosity_error()  # its warning about casting with .to() concerns pretrained checkpoints
    torch.manual_seed(seed)
    with torch.device(device):
        m = build()
    return m.to(dtype=dtype).eval().requires_grad_(False)


def build_unet(name: str, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """A diffusers UNet2DConditionModel of a published architecture with seeded random weights."""
    from diffusers import UNet2DConditionModel

    if name not in UNET_CONFIGS:
        raise ValueError(f"unknown UNet config {name!r}; choose one of {', '.join(UNET_CONFIGS)}")
    return _seeded(lambda: UNet2DConditionModel(**UNET_CONFIGS[name]), seed, device, dtype)


def build_vae(name: str = "sd", seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """A diffusers AutoencoderKL of a published architecture with seeded random weights."""
    from diffusers import AutoencoderKL

    if name not in VAE_CONFIGS:
        raise ValueError(f"unknown VAE config {name!r}; choose one of {', '.join(VAE_CONFIGS)}")
    return _seeded(lambda: AutoencoderKL(**VAE_CONFIGS[name]), seed, device, dtype)


def example_inputs(unet: nn.Module, batch: int = 2, latent: int | tuple[int, int] | None = None, tokens: int = 77,
                   seed: int = 1, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """Seeded (x, timesteps, context, y) for the canonical call of a diffusers UNet."""
    c = unet.config
    h, w = (latent, latent) if isinstance(latent, int) else (latent or (c["sample_size"], c["sample_size"]))
    g = torch.Generator().manual_seed(seed)
    ctx_dim = c["cross_attention_dim"]
    x = torch.randn(batch, c["in_channels"], h, w, generator=g)
    t = torch.full((batch,), 500.0)
    context = torch.randn(batch, tokens, ctx_dim, generator=g)
    y = None
    if c.get("addition_embed_type") == "text_time":
        y = torch.randn(batch, c["projection_class_embeddings_input_dim"], generator=g)
    move = lambda v: None if v is None else v.to(device=device, dtype=dtype)
    return move(x), t.to(device), move(context), move(y)
