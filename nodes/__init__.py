"""ComfyUI nodes: thin adapters from ComfyUI objects (ModelPatcher, VAE) to accel/. They import comfy only
when they run, so this package imports outside ComfyUI too (pytest, scripts)."""

from .accelerated_unet import AcceleratedUNetNode
from .info import AccelInfo
from .tiled_vae import TiledVAEDecode, TiledVAEEncode

NODE_CLASS_MAPPINGS = {
    "SDAccelAcceleratedUNet": AcceleratedUNetNode,
    "SDAccelTiledVAEDecode": TiledVAEDecode,
    "SDAccelTiledVAEEncode": TiledVAEEncode,
    "SDAccelInfo": AccelInfo,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "SDAccelAcceleratedUNet": "Accelerated UNet",
    "SDAccelTiledVAEDecode": "Tiled VAE Decode (sd-accel)",
    "SDAccelTiledVAEEncode": "Tiled VAE Encode (sd-accel)",
    "SDAccelInfo": "Accel Info",
}
