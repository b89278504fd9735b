"""Loading a user's SD checkpoint (.safetensors, never pickle) into diffusers modules, offline.

The architecture is recognised from the weights themselves and the published config is used, so no
config is fetched from a hub.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import BadInput, UnsupportedModel
from .configs import UNET_CONFIGS, VAE_CONFIGS

_UNET_PREFIX = "model.diffusion_model."


def _architecture(shapes: dict[str, list[int]]) -> str:
    key = _UNET_PREFIX + "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"
    if key in shapes:
        return {768: "sd15", 1024: "sd21"}.get(shapes[key][1], "unknown")
    xl = _UNET_PREFIX + "input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight"
    if xl in shapes and shapes[xl][1] == 2048:
        return "sdxl"
    return "unknown"


def check_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(path, architecture name) of a checkpoint the demo can load, else BadInput / UnsupportedModel naming the
    file and the fix. Reads only the safetensors header, so a bad file is reported before any slow work."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    fix = "Give the path of an SD1.x, SD2.x or SDXL .safetensors file."
    if not path.exists():
        raise BadInput(f"checkpoint {path} not found.", fix)
    if not path.is_file():
        raise BadInput(f"checkpoint {path} is a folder, not a file.", fix)
    if path.suffix.lower() != ".safetensors":
        raise BadInput(f"{path.name} is not a .safetensors file; pickled checkpoints (.ckpt, .pt) are not loaded "
                       "because unpickling can run code.", "Convert it to .safetensors or download that version.")
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    except (SafetensorError, OSError) as e:
        detail = " ".join(str(e).split())  # the error stays on the one line the CLI prints
        raise BadInput(f"{path} is not a readable .safetensors file ({detail}).",
                       "Download it again: it is cut short, damaged or not a safetensors file.") from None
    arch = _architecture(shapes)
    if arch == "unknown":
        raise UnsupportedModel(f"{path.name} is not an SD1.x, SD2.x or SDXL checkpoint in the ldm format.",
                               "Use a single-file SD1.5, SD2.1 or SDXL checkpoint.")
    return path, arch


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float16) -> tuple[str, nn.Module, nn.Module]:
    """(architecture name, diffusers UNet, diffusers VAE) from an ldm-format .safetensors checkpoint."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint
    from safetensors.torch import load_file

    path, arch = check_checkpoint(path)
    sd = load_file(str(path))
    with torch.device("meta"):
        unet = UNet2DConditionModel(**UNET_CONFIGS[arch])
        vae = AutoencoderKL(**VAE_CONFIGS["sd"])
    try:
        unet.load_state_dict(convert_ldm_unet_checkpoint(sd, unet.config), assign=True)
        vae.load_state_dict(convert_ldm_vae_checkpoint(sd, vae.config), assign=True)
    except (KeyError, RuntimeError) as e:  # a pruned or merged file without some of the weights the model needs
        raise UnsupportedModel(f"{path.name} is laid out as an {arch} checkpoint but lacks weights that model "
                               "needs.", "Use a complete single-file checkpoint (UNet and VAE included).") from e
    return arch, _cast(unet, device, dtype).eval(), _cast(vae, device, dtype).eval()


def _cast(model: nn.Module, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    """model.to(device, dtype). diffusers' own to() warns at every dtype cast about the model's modules that should
    stay in float32, even when it has none ("...: []"): only a model that has some goes through it."""
    if getattr(model, "_keep_in_fp32_modules", None):
        return model.to(device, dtype)
    return nn.Module.to(model, device, dtype)
