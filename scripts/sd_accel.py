"""A1111 / Forge extension entry: an "sd-accel" choice under Settings > Stable Diffusion > SD Unet, and a
setting for the backend. Thin: all the work is in accel/.

A1111 runs this file with the extension folder first on sys.path, so `accel` imports from the checkout.
"""

from __future__ import annotations

import logging
import types

import ldm.modules.diffusionmodules.openaimodel as openaimodel
from modules import devices, script_callbacks, sd_unet, shared

from accel.accelerate import accelerate
from accel.errors import AccelError
from accel.host_a1111 import LoraSync
from accel.host_support import refit
from accel.progress import CallbackProgress

log = logging.getLogger("sd-accel")
BACKENDS = ["auto", "torch", "onnxruntime", "tensorrt", "off"]


class AccelUnet(sd_unet.SdUnet):
    def __init__(self) -> None:
        super().__init__()
        self.acc = None
        self.lora = LoraSync()
        self._told_functional = False
        self._engine_networks = None  # the networks a weight-baking engine was last brought to
        self._engine_current = True  # whether that engine serves the weights as they are now

    def activate(self) -> None:
        diffusion_model = shared.sd_model.model.diffusion_model
        # A1111 parks the built-in UNet on the CPU before activating an option; ours runs that same module.
        diffusion_model.to(devices.device)
        # A1111 routes UNetModel.forward to the active SdUnet; the engine must call the real forward, or every
        # step would come back here.
        diffusion_model.forward = types.MethodType(openaimodel.copy_of_UNetModel_forward_for_webui, diffusion_model)
        try:
            self.acc = accelerate(diffusion_model, preference=shared.opts.data.get("sd_accel_backend", "auto"),
                                  progress=CallbackProgress(_show_progress))
            print(f"sd-accel: {self.acc.backend} path active\n" + self.acc.plan.summary())
        except AccelError as e:
            print(f"sd-accel: {e} The built-in UNet runs.")
            self.acc = None

    def forward(self, x, timesteps, context, *args, **kwargs):
        diffusion_model = shared.sd_model.model.diffusion_model
        if self.acc is None:
            return diffusion_model(x, timesteps, context, *args, **kwargs)
        if not self.lora.sync(diffusion_model, getattr(shared.opts, "lora_functional", False)):
            if not self._told_functional:
                self._told_functional = True
                print("sd-accel: the Lora setting 'use old method that takes longer when you have multiple Loras "
                      "active' (Settings > Compatibility) is on: it adds each LoRA inside every layer's own forward, "
                      "which no accelerated path runs, so the built-in UNet runs while a LoRA is in use. Turn that "
                      "setting off to get acceleration with LoRAs (they are then merged into the weights).")
            # The layers' own (patched) forwards must run: the torch path's fused forwards would bypass them.
            self.acc.suspend()
            return diffusion_model(x, timesteps, context, *args, **kwargs)
        runner = self.acc
        if self.acc.backend != "torch":
            if self.lora.applied != self._engine_networks:
                self._engine_networks = self.lora.applied
                why = refit(self.acc)
                self._engine_current = why is None
                if why is not None:
                    print(f"sd-accel: the {self.acc.backend} engine could not take the new LoRA weights ({why}); "
                          "the torch path serves these calls. Choose the torch backend in the sd-accel settings to "
                          "keep using LoRAs without this.")
            if not self._engine_current:
                runner = self.acc.fallback or self.acc.unet
        y = kwargs.pop("y", None)
        control = kwargs.pop("control", None)
        return runner(x, timesteps, context, y, control, **kwargs)

    def deactivate(self) -> None:
        if self.acc is not None:
            self.acc.release()
            self.acc = None
        shared.sd_model.model.diffusion_model.__dict__.pop("forward", None)


def _show_progress(stage: str, fraction: float, eta: float | None) -> None:
    # A1111 shows shared.state.textinfo beside its progress bar while a job runs.
    left = f", {eta:.0f} s left" if eta else ""
    shared.state.textinfo = f"sd-accel: {stage} {fraction:.0%}{left}"


class AccelUnetOption(sd_unet.SdUnetOption):
    model_name = "sd-accel"
    label = "sd-accel (fastest path for this GPU)"

    def create_unet(self) -> AccelUnet:
        return AccelUnet()


def _list_unets(unets: list) -> None:
    unets.append(AccelUnetOption())


def _settings() -> None:
    import gradio as gr

    section = ("sd_accel", "sd-accel")
    shared.opts.add_option("sd_accel_backend", shared.OptionInfo(
        "auto", "Acceleration path (choose 'sd-accel' under SD Unet to use it)", gr.Dropdown,
        {"choices": BACKENDS}, section=section))


script_callbacks.on_list_unets(_list_unets)
script_callbacks.on_ui_settings(_settings)
