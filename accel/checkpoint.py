"""Loading a user's SD checkpoint (.safetensors, never pickle) into diffusers modules, offline.

The architecture is recognised from the weights themselves and the published config is used, so no
config is fetched from a hub.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .configs import UNET_CONFIGS, VAE_CONFIGS
from .errors import BadInput, UnsupportedModel

_UNET_PREFIX = "model.diffusion_model."


def _architecture(sd: dict) -> str:
    key = _UNET_PREFIX + "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"
    if key in sd:
        return {768: "sd15", 1024: "sd21"}.get(sd[key].shape[1], "unknown")
    xl = _UNET_PREFIX + "input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight"
    if xl in sd and sd[xl].shape[1] == 2048:
        return "sdxl"
    return "unknown"


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float16) -> tuple[str, nn.Module, nn.Module]:
    """(architecture name, diffusers UNet, diffusers VAE) from an ldm-format .safetensors checkpoint."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint
    from safetensors.torch import load_file

    path = Path(path)
    if path.suffix != ".safetensors":
        raise BadInput(f"{path.name} is not a .safetensors file; pickled checkpoints (.ckpt, .pt) are not loaded "
                       "because unpickling can run code.", "Convert it to .safetensors or download that version.")
    if not path.is_file():
        raise BadInput(f"checkpoint {path} does not exist.", "Give the path of a .safetensors file.")
    sd = load_file(str(path))
    arch = _architecture(sd)
    if arch == "unknown":
        raise UnsupportedModel(f"{path.name} is not an SD1.x, SD2.x or SDXL checkpoint in the ldm format.",
                               "Use a single-file SD1.5, SD2.1 or SDXL checkpoint.")
    with torch.device("meta"):
        unet = UNet2DConditionModel(**UNET_CONFIGS[arch])
        vae = AutoencoderKL(**VAE_CONFIGS["sd"])
    unet.load_state_dict(convert_ldm_unet_checkpoint(sd, unet.config), assign=True)
    vae.load_state_dict(convert_ldm_vae_checkpoint(sd, vae.config), assign=True)
    return arch, unet.to(device, dtype).eval(), vae.to(device, dtype).eval()
