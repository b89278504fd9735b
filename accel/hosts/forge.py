"""Forge's UNet served through an engine: the adapter's logic, host-agnostic in the same way as host_a1111 (Forge is
never imported; its objects are used through the attributes named here).

Forge samples `forge_objects.unet`, a patcher in the ComfyUI style: an extension clones it and sets a model function
wrapper, `wrapper(apply_model, {"input", "timestep", "c", "cond_or_uncond"})`, which travels with that clone for one
sampling. apply_model (Forge's KModel) scales the input, calls its diffusion_model (an ldm-style UNet whose forward
takes `x, timesteps, context, y, control, transformer_options`) and turns the output into the denoised latent. The
wrapper runs apply_model as it is and, for that one call, routes its diffusion_model call to the EngineSlot; the
engine's own call of the module reaches the module's class forward. Nothing stays set on the module afterwards.

Calls the engine cannot serve run Forge's own forward, and the user is told once why: per-step patches in
transformer_options (FreeU, attention patches), LoRAs in Forge's online mode (applied inside each layer's forward),
weights cast or streamed per layer (low VRAM, fp8/NF4/GGUF storage).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .support import EngineSlot, transformer_patches

KNOWN_CONDITIONS = {"c_crossattn", "c_concat", "y", "control", "transformer_options"}
# transformer_options entries Forge's UNet applies besides ComfyUI's patches (backend/nn/unet.py).
FORGE_MODIFIERS = ("group_norm_wrapper", "block_modifiers", "block_inner_modifiers")


def weights_key(patcher: Any) -> Any:
    """What changes when Forge merges other LoRAs into the weights: its LoraLoader's hash of the merged patches."""
    loader = getattr(patcher, "lora_loader", None)
    return getattr(loader, "loaded_hash", None)


def why_not_module(patcher: Any, unet: torch.nn.Module) -> tuple[str, str] | None:
    """(key, message) when no call of this sampling can run through an engine, from how Forge loaded the weights."""
    loader = getattr(patcher, "lora_loader", None)
    if getattr(loader, "online_backup", None):
        return ("online-lora", "LoRAs are applied in Forge's online mode (inside each layer's forward, as for fp8 and "
                "NF4 models), which no accelerated path runs; the plain UNet runs. Load the model in fp16/bf16 to "
                "accelerate it with LoRAs.")
    if any(getattr(m, "parameters_manual_cast", False) for m in unet.modules()):
        return ("manual-cast", "Forge casts or streams this UNet's weights layer by layer (low VRAM, or fp8/NF4/GGUF "
                "storage), which an engine or CUDA graph cannot follow; the plain UNet runs. Free VRAM or load the "
                "model in fp16/bf16 to accelerate it.")
    return None


class ForgeSession:
    """The wrapper of one sampling run on one clone of forge_objects.unet; the EngineSlot outlives it."""

    def __init__(self, slot: EngineSlot, patcher: Any) -> None:
        self.slot = slot
        self.patcher = patcher
        self._why_module: tuple[str, str] | None | bool = False  # False: not looked at yet
        self._inner = False

    def __deepcopy__(self, memo: dict) -> "ForgeSession":
        # Forge's patcher.clone() deep-copies model_options, this wrapper with them: a clone must share this session
        # (and its engine), not copy the UNet the engine holds.
        return self

    def wrapper(self, apply_model: Callable, args: dict) -> torch.Tensor:
        x, t, c = args["input"], args["timestep"], args["c"]
        kmodel = getattr(apply_model, "__self__", None)
        unet = getattr(kmodel, "diffusion_model", None)

        def plain() -> torch.Tensor:
            return apply_model(x, t, **c)

        why = self._why_plain(unet, c)
        if why is not None:
            self.slot.suspend()  # the layers' own forwards must run, not fused ones
            return self.slot.run_plain(*why, plain)
        unet.forward = self._forward_for(unet)
        try:
            return apply_model(x, t, **c)
        finally:
            unet.__dict__.pop("forward", None)

    def _why_plain(self, unet: torch.nn.Module | None, c: dict) -> tuple[str, str] | None:
        if not isinstance(unet, torch.nn.Module):
            return ("no-unet", "Forge's model has no diffusion_model to accelerate; the plain model runs.")
        if self._why_module is False:
            self._why_module = why_not_module(self.patcher, unet)
        if self._why_module is not None:
            return self._why_module
        extra = sorted(set(c) - KNOWN_CONDITIONS)
        options = c.get("transformer_options") or {}
        patches = transformer_patches(options) + [k for k in FORGE_MODIFIERS if options.get(k)]
        if extra:
            patches.append("extra inputs " + ", ".join(extra))
        if patches:
            names = ", ".join(patches)
            return (f"patches:{names}", f"other extensions patch the UNet ({names}); calls that carry these run on "
                    "Forge's own forward, which applies them (no engine, no CUDA graph).")
        return None

    def _forward_for(self, unet: torch.nn.Module) -> Callable:
        own = type(unet).forward

        def forward(x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):  # noqa: B006
            def plain() -> torch.Tensor:
                return own(unet, x, timesteps, context, y, control, transformer_options, **kwargs)

            if self._inner or kwargs:  # the engine running the module (or inputs it does not take)
                return plain()
            self._inner = True
            try:
                return self.slot.call(unet, weights_key(self.patcher), x, timesteps, context, y, control, plain)
            finally:
                self._inner = False

        return forward
