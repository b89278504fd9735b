"""Tiled VAE Decode and Encode: LATENT + VAE -> IMAGE and back, through accel/vae, whose tiles share
GroupNorm statistics over the whole image, so the result matches the untiled one without seams. Wan's video
latents are decoded by accel/vae's tiled video decode (spatial tiles with halos, each with its own temporal cache),
which gives the untiled video as well.

A VAE accel/vae does not take (other video VAEs, audio VAEs, TAESD) runs through ComfyUI's own tiled code, and
the node says so once.
"""

from __future__ import annotations

import logging

from ..accel.errors import AccelError
from ..accel import vae as accel_vae
from .comfy_ui import CATEGORY, node_progress, say

log = logging.getLogger("sd-accel")

_told: set[str] = set()


def _tile_inputs() -> dict:
    return {
        "tile_size": ("INT", {"default": 0, "min": 0, "max": 8192, "step": 64,
                              "tooltip": "Tile size in image pixels; 0 picks it from free VRAM."}),
        "overlap": ("INT", {"default": 0, "min": 0, "max": 1024, "step": 8,
                            "tooltip": "Overlap between tiles in image pixels; 0 picks it."}),
    }


def _memory_input(what: str) -> dict:
    """The memory_gb input of the node that runs `what` ("decode" or "encode")."""
    video = (" A Wan video is decoded in as many spatial tiles as this needs (each recomputes a border: slower)."
             if what == "decode" else "")
    # Optional, so that workflows saved before it existed still run.
    return {"memory_gb": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1024.0, "step": 0.5, "tooltip": (
        f"GPU memory the {what} may use, in GB; 0 uses what is free. Below what the whole image needs, its "
        "activations wait in page-locked CPU memory and the GPU works through them in bands (slower)." + video)})}


def _limit(memory_gb: float) -> float | None:
    return memory_gb if memory_gb and memory_gb > 0 else None


def _latent_units(vae, pixels: int) -> int | None:
    """Pixels to latent units for this VAE (None for 0: let the tiler choose)."""
    return pixels // vae.spacial_compression_decode() if pixels else None


def _why_not(vae, rank: int, encode: bool = False) -> str | None:
    """Why accel/vae cannot take this VAE for an input of this rank, or None (for video latents accel/vae looks at
    the model itself and says why not)."""
    model = vae.first_stage_model
    latent_dim = getattr(vae, "latent_dim", 2)
    if rank == 5 and latent_dim == 3 and not encode:
        return None
    if rank != 4 or latent_dim != 2:
        kind = {1: "an audio", 3: "a video"}.get(latent_dim, f"a {latent_dim}-D")
        takes = "encodes image VAEs" if encode else "decodes image VAEs and Wan video VAEs"
        return f"this is {kind} VAE; accel/vae {takes}"
    if not (hasattr(model, "decoder") and hasattr(model, "encoder")):
        return f"{type(model).__name__} is not an SD-style KL autoencoder"
    return None


def _frames_as_images(images):
    """A video (N, T, H, W, C) as ComfyUI's IMAGE batch of its frames, as its VAEDecode node gives it."""
    return images.reshape(-1, *images.shape[-3:]) if images.ndim == 5 else images


def _fallback_once(node_id: str | None, key: str, message: str) -> None:
    if key not in _told:
        _told.add(key)
        say(node_id, message)


class TiledVAEDecode:
    CATEGORY = CATEGORY
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "decode"
    DESCRIPTION = ("Decodes latents in tiles that share GroupNorm statistics over the whole image: the result "
                   "matches the untiled decode (no seams, no colour shift) in a fraction of the memory. Wan 2.1/2.2 "
                   "video latents: spatial tiles, each through all frames with its own temporal cache, give the "
                   "untiled video too.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": {"samples": ("LATENT",), "vae": ("VAE",), **_tile_inputs()},
                "optional": _memory_input("decode"), "hidden": {"unique_id": "UNIQUE_ID"}}

    def decode(self, samples: dict, vae, tile_size: int, overlap: int, memory_gb: float = 0.0,
               unique_id: str | None = None):
        import comfy.model_management as mm

        z = samples["samples"]
        why = _why_not(vae, z.ndim)
        if why is None:
            try:
                mm.load_models_gpu([vae.patcher])
                z = z.to(vae.device, vae.vae_dtype)
                options = dict(tile=tile_size or None, progress=node_progress(unique_id, "vae"),
                               memory_gb=_limit(memory_gb))
                if z.ndim == 5:  # exact tiles need no overlap
                    out = accel_vae.decode_video(vae.first_stage_model, z, out_device=vae.output_device, **options)
                else:
                    out = accel_vae.decode(vae.first_stage_model, z, overlap=overlap or None, **options)
                images = vae.process_output(out.to(vae.output_device).float())
                return (_frames_as_images(images.movedim(1, -1)),)
            except AccelError as e:
                why = str(e)
        if z.ndim == 5:
            # ComfyUI's own tiled video decode blends tiles cut in time too, which shows; its untiled decode gives the
            # video, and tiles by itself where the GPU's memory runs short.
            _fallback_once(unique_id, f"decode:{why}", f"{why}; ComfyUI's own decode runs instead.")
            return (_frames_as_images(vae.decode(z)),)
        _fallback_once(unique_id, f"decode:{why}", f"{why}; ComfyUI's own tiled decode runs instead.")
        px = tile_size or 512
        ov = min(overlap or 64, px // 4)
        images = vae.decode_tiled(z, tile_x=_latent_units(vae, px), tile_y=_latent_units(vae, px),
                                  overlap=_latent_units(vae, ov))
        return (_frames_as_images(images),)


class TiledVAEEncode:
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "encode"
    DESCRIPTION = ("Encodes an image in tiles that share GroupNorm statistics over the whole image: the latent "
                   "matches the untiled encode in a fraction of the memory.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": {"pixels": ("IMAGE",), "vae": ("VAE",), **_tile_inputs()},
                "optional": _memory_input("encode"), "hidden": {"unique_id": "UNIQUE_ID"}}

    def encode(self, pixels, vae, tile_size: int, overlap: int, memory_gb: float = 0.0,
               unique_id: str | None = None):
        import comfy.model_management as mm

        why = _why_not(vae, pixels.ndim, encode=True)
        if why is None:
            try:
                mm.load_models_gpu([vae.patcher])
                x = vae.process_input(vae.vae_encode_crop_pixels(pixels)[..., :3].movedim(-1, 1))
                z = accel_vae.encode(vae.first_stage_model, x.to(vae.device, vae.vae_dtype),
                                     tile=tile_size or None, overlap=overlap or None,
                                     progress=node_progress(unique_id, "vae"), memory_gb=_limit(memory_gb))
                return ({"samples": z.to(mm.intermediate_device()).float()},)
            except AccelError as e:
                why = str(e)
        _fallback_once(unique_id, f"encode:{why}", f"{why}; ComfyUI's own tiled encode runs instead.")
        px = tile_size or 512
        ov = min(overlap or 64, px // 4)
        return ({"samples": vae.encode_tiled(pixels[..., :3], tile_x=px, tile_y=px, overlap=ov)},)
