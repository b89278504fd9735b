"""The Accelerated UNet node's gpus option on ComfyUI's side: how a worker process makes ComfyUI's diffusion model (the
engine's Recipe), and what the node says about the GPUs a run used.

A worker rebuilds the model the way ComfyUI built it: ComfyUI's settings (its command-line arguments decide operations,
attention and devices) first, then the model config ComfyUI loaded the checkpoint with (its class, unet_config, weight
dtype and operations), on the worker's device; the values then come from ComfyUI's process, patches merged.
"""

from __future__ import annotations

import functools
import pickle
from typing import Any


def recipe(patcher):
    """How a worker makes the diffusion model of this ModelPatcher."""
    import comfy.cli_args

    from ..accel.parallel.workers import Recipe

    config = patcher.model.model_config
    # the config's class and state, not the object: ComfyUI 0.33's configs answer any attribute they lack with None
    # (__getattr__), which unpickling takes for their __setstate__
    return Recipe(functools.partial(apply_settings, dict(vars(comfy.cli_args.args))),
                  pickle.dumps((diffusion_model, (type(config), dict(vars(config))))))


def apply_settings(settings: dict[str, Any]) -> None:
    """In a worker, before comfy.model_management is imported: ComfyUI's arguments as the host process has them."""
    import comfy.cli_args

    vars(comfy.cli_args.args).update(settings)


def diffusion_model(config_class: type, state: dict[str, Any], device):
    """ComfyUI's diffusion model of the config with this class and state (as the host's process holds it), its tensors
    on device and uninitialised (the host sends them)."""
    model_config = object.__new__(config_class)
    vars(model_config).update(state)
    return model_config.get_model({}, "", device=device).diffusion_model


def gpus_line(status, spread_calls: int, engine_calls: int) -> str:
    """What a run's GPUs were, for the node's status and Accel Info; '' when the node asked for one."""
    if status.devices == 1:
        return ""
    if spread_calls and spread_calls == engine_calls:
        return f"GPUs: {status.devices} served every accelerated call of the run ({status.layout})"
    if spread_calls:
        return (f"GPUs: {status.devices} served {spread_calls} of {engine_calls} accelerated calls; the others ran on "
                f"one: {status.one_device}")
    return f"GPUs: one served the run: {status.one_device or 'no call was accelerated.'}"
