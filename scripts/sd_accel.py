"""A1111 and Forge extension entry. Thin: the work is in accel/.

A1111: an "sd-accel (fastest path for this GPU)" choice under Settings > Stable Diffusion > SD Unet (ACCEL_LABEL: the
sd_unet option takes that exact text; any other runs A1111's built-in UNet, and a value that names sd-accel otherwise
is told once on the console and in the status), the settings under Settings > sd-accel, the tiled VAE decode, and
GET /sd-accel/status: whether sd-accel serves the UNet now (or why not), its path, the calls served since start, the
attention that ran, and every message. The console says once per model, path and size that the engine served a
call and how long that first call took.

Forge routes nothing to an SdUnet (the choice would do nothing, so it is not offered): every generation's
forge_objects.unet is cloned with a model function wrapper (accel/hosts/forge.py), as Forge's own extensions patch it,
unless Settings > sd-accel > backend is off.

A1111 (1.7 and later) routes UNetModel.forward, at class level, to the active SdUnet's forward. The engine calls
the same module, so its calls come back through that routing; they are told apart and run A1111's original forward.
Nothing is set on the module instance: an instance `forward` would shadow the routing and the extension would never
run (the earlier version's bug, seen on 1.6). A1111 before 1.7 kept the original forward beside the class
(copy_of_UNetModel_forward_for_webui); that name is looked up too, though only 1.10.1 is tested.

A1111 loads this file by path; the pack's root __init__.py loads the rest as the package `sd_accel` (sys.path is left
as it is).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from modules import devices, patches, script_callbacks, scripts, sd_unet, shared


def _load_pack() -> None:
    spec = importlib.util.spec_from_file_location("sd_accel_root", Path(__file__).resolve().parents[1] / "__init__.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # registers the package `sd_accel`


_load_pack()

from sd_accel.accel.build.cache import default_root  # noqa: E402
from sd_accel.accel.hosts.a1111 import LoraSync  # noqa: E402
from sd_accel.accel.hosts.support import LATENT_SCALE, EngineSlot, SlotStatus  # noqa: E402
from sd_accel.accel.progress import CallbackProgress, keep_logs_off_bars, print_off_bars  # noqa: E402

BACKENDS = ["auto", "torch", "onnxruntime", "off"]
TILED_VAE = ["auto", "always", "off"]
SECTION = ("sd_accel", "sd-accel")
ACCEL_NAME = "sd-accel"  # the SD Unet option's model_name: "Automatic" picks it for a checkpoint of that name
ACCEL_LABEL = "sd-accel (fastest path for this GPU)"  # the SD Unet option's text, the value sd_unet must have
keep_logs_off_bars(logging.getLogger("sd-accel"))  # the engine's messages come while the sampler's bars are open


def _option(name: str, default):
    # With --nowebui the options exist too (they are registered below at import), but a config saved by another
    # version may lack them.
    return shared.opts.data.get(name, default)


@functools.cache
def original_forward(unet_class: type) -> Callable:
    """The UNet forward A1111 routes to the SdUnet (the class's own forward before A1111 patched it); looked up once
    per class, not on every step."""
    from modules import sd_hijack

    sgm = unet_class.__module__.startswith("sgm.")
    forward = getattr(sd_hijack, "sgm_original_forward" if sgm else "ldm_original_forward", None)
    if forward is None:  # A1111 before 1.7 kept the original next to the class
        forward = importlib.import_module(unet_class.__module__).copy_of_UNetModel_forward_for_webui
    return forward


class AccelUnet(sd_unet.SdUnet):
    def __init__(self) -> None:
        super().__init__()
        self.backend = _option("sd_accel_backend", "auto")
        self.slot = _slot(self.backend)
        self.lora = LoraSync()
        self._inner = False  # True while the engine runs the module: A1111 routes those calls here again

    def activate(self) -> None:
        global _active
        _active = self
        if not _lowvram():
            # A1111 parks the built-in UNet on the CPU before activating an option; ours runs that same module.
            shared.sd_model.model.diffusion_model.to(devices.device)
        print(f"sd-accel: active (SD Unet '{ACCEL_LABEL}'); the engine is prepared on the first sampling step.")

    def forward(self, x, timesteps=None, context=None, *args, **kwargs):
        unet = shared.sd_model.model.diffusion_model
        original = original_forward(type(unet))
        if self._inner:
            return original(unet, x, timesteps, context, *args, **kwargs)
        backend = _option("sd_accel_backend", "auto")
        if backend != self.backend:  # changed in Settings: the next call is served by the path asked for
            self.slot.release()
            self.backend, self.slot = backend, _slot(backend)

        def plain() -> torch.Tensor:
            return original(unet, x, timesteps, context, *args, **kwargs)

        why = self._why_plain(unet, args, kwargs)
        if why is not None:
            self.slot.suspend()  # the layers' own forwards (A1111's Lora, lowvram hooks) must run, not fused ones
            return self.slot.run_plain(*why, plain)
        self._inner = True
        try:
            return self.slot.call(unet, self.lora.applied, x, timesteps, context, kwargs.get("y"), None, plain)
        finally:
            self._inner = False

    def _why_plain(self, unet: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[str, str] | None:
        """(key, message) when this call must run on A1111's own UNet forward, else None."""
        if _lowvram():
            return ("lowvram", "--medvram / --lowvram move the UNet's layers to the GPU one at a time, which an "
                    "engine or CUDA graph cannot follow; the built-in UNet runs. Start A1111 without them to "
                    "accelerate.")
        extra = sorted(set(kwargs) - {"y"})
        if args or extra:
            names = ", ".join(extra) or f"{len(args)} positional"
            return (f"inputs:{names}", f"the UNet was called with inputs sd-accel does not take ({names}); such "
                    "calls run on the built-in UNet.")
        if not self.lora.sync(unet, bool(getattr(shared.opts, "lora_functional", False))):
            return ("lora-functional", "the Lora setting 'use old method that takes longer when you have multiple "
                    "Loras active' (Settings > Compatibility) is on: it adds each LoRA inside every layer's own "
                    "forward, which no accelerated path runs, so the built-in UNet runs while a LoRA is in use. "
                    "Turn that setting off to get acceleration with LoRAs (they are then merged into the weights).")
        return None

    def deactivate(self) -> None:
        global _active
        self.slot.release()
        if _active is self:
            _active = None


class HostSlot(EngineSlot):
    """The EngineSlot of A1111's and Forge's UNet, which also says on the console, once per model, path and size,
    that the engine served a call and how long that first call took (as the ComfyUI node's progress says why it
    waits), and keeps the attention that ran for the status."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.attention: tuple | None = None  # (host's attention, sd-accel's SDPA kernel order, on CUDA, path)

    def call(self, module, weights_key, x, *args, **kwargs):
        served, engine, start = self.status.engine_calls, self.acc, time.perf_counter()
        out = super().call(module, weights_key, x, *args, **kwargs)
        if self.status.engine_calls == served:  # the plain model ran it: said already, where there is a reason
            return out
        self.attention = (_host_attention(), self.acc.plan.torch.attention, x.is_cuda, self.status.backend)
        key = (_model_name(), self.status.backend, x.shape[0], *x.shape[-2:])
        if key not in _served:
            _served.add(key)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            seconds = time.perf_counter() - start
            prepared = f"; the path was prepared for this model: {self.status.source}" if self.acc is not engine else ""
            cpu = (" On the CPU the torch path runs the plain model's computation: no speed-up."
                   if x.device.type == "cpu" and self.status.backend == "torch" else "")
            print_off_bars(f"sd-accel: the {self.status.backend} path served {key[0]}'s UNet at "
                     f"{key[4] * LATENT_SCALE}x{key[3] * LATENT_SCALE} px (width x height), batch {key[2]}; its first "
                     f"call at this size took {seconds:.1f} s{prepared} (once per model, path and size: later calls "
                     f"do not wait).{cpu}")
        return out


def _slot(backend: str) -> HostSlot:
    slot = HostSlot(None if backend == "auto" else backend, progress=lambda: CallbackProgress(_show_progress),
                    cache_root=str(default_root(_models_dir())))
    _statuses.append(slot.status)
    return slot


def _model_name() -> str:
    info = getattr(getattr(shared, "sd_model", None), "sd_checkpoint_info", None)
    return getattr(info, "model_name", None) or "the model"


def _host_attention() -> str:
    """The attention the host's UNet calls: A1111's cross-attention optimization (its CrossAttention forward), or
    Forge's attention function. The torch path keeps it (in A1111 and Forge no fusion replaces it)."""
    forge = sys.modules.get("backend.attention")
    if forge is not None:
        fn = getattr(forge, "attention_function", None)
        return f"Forge's {getattr(fn, '__name__', 'attention')}"
    hijack = sys.modules.get("modules.sd_hijack")
    optimizer = getattr(hijack, "current_optimizer", None)
    if optimizer is None:
        return "A1111's CrossAttention without an optimization"
    return f"A1111's {optimizer.name}"


def _attention_ran(slot: HostSlot) -> str | None:
    """What ran the attention of the last engine call, in words; None before the engine served one."""
    if slot.attention is None:
        return None
    host, kernel, cuda, path = slot.attention
    if path == "onnxruntime":
        return f"ONNX Runtime's, from the exported {host}"
    # PyTorch's scaled_dot_product_attention takes sd-accel's kernel order on CUDA/ROCm only (the torch path).
    if cuda and host in ("A1111's sdp", "Forge's attention_pytorch"):
        return f"{host} (PyTorch SDPA, {kernel} kernel first)"
    return host


_served: set[tuple] = set()  # (model, path, UNet batch, latent height, latent width) the console was told about
_statuses: list[SlotStatus] = []  # every slot's status since start (a slot per activation or path): the totals


def _lowvram() -> bool:
    return bool(getattr(shared.sd_model, "lowvram", False))


def _models_dir() -> str:
    from modules import paths

    return f"{paths.models_path}/accel"


_active = None  # what serves the UNet now, for GET /sd-accel/status: the A1111 SdUnet, or Forge's script class
_told: set[str] = set()  # SD Unet values the console was told do not choose sd-accel
_tiled_decodes = 0


def _show_progress(stage: str, fraction: float, eta: float | None) -> None:
    # A1111 shows shared.state.textinfo beside its progress bar while a job runs; a finished stage leaves it empty
    # again, so the line does not outlast the wait it explains.
    left = f", {eta:.0f} s left" if eta else ""
    shared.state.textinfo = f"sd-accel: {stage} {fraction:.0%}{left}" if fraction < 1.0 else None


class AccelUnetOption(sd_unet.SdUnetOption):
    model_name = ACCEL_NAME
    label = ACCEL_LABEL

    def create_unet(self) -> AccelUnet:
        return AccelUnet()


def _list_unets(unets: list) -> None:
    unets.append(AccelUnetOption())


# -- tiled VAE decode

def _tiled_decode(vae: torch.nn.Module, original: Callable) -> Callable:
    told: set[str] = set()

    def decode(z, *args, **kwargs):
        mode = _option("sd_accel_tiled_vae", "auto")
        if mode == "off" or args or kwargs:
            return original(z, *args, **kwargs)
        if mode == "auto":
            try:
                return original(z)
            except torch.OutOfMemoryError:
                devices.torch_gc()
                if "oom" not in told:
                    told.add("oom")
                    print("sd-accel: the VAE decode ran out of GPU memory; decoding in tiles (the same image).")
        from sd_accel.accel.errors import AccelError
        from sd_accel.accel import vae as accel_vae

        global _tiled_decodes
        try:
            image = accel_vae.decode(vae, z, progress=CallbackProgress(_show_progress))
        except AccelError as e:
            if str(e) not in told:
                told.add(str(e))
                print(f"sd-accel: the tiled VAE decode cannot run ({e}); A1111's decode runs.")
            return original(z)
        _tiled_decodes += 1
        return image

    return decode


def _hook_vae(sd_model) -> None:
    vae = getattr(sd_model, "first_stage_model", None)
    if vae is None or patches.originals[__name__].get((vae, "decode")) is not None:
        return
    original = vae.decode
    patches.patch(__name__, vae, "decode", _tiled_decode(vae, original))


# -- settings and status

def _settings() -> dict:
    return {
        "sd_accel_backend": shared.OptionInfo(
            "auto", "Acceleration path for the UNet (off: Forge's own UNet)" if FORGE else
            "Acceleration path (choose 'sd-accel' under Stable Diffusion > SD Unet to use it)",
            _dropdown(), {"choices": BACKENDS}).info("auto: the fastest installed path for this GPU"),
        "sd_accel_tiled_vae": shared.OptionInfo(
            "auto", "Tiled VAE decode (same image as the untiled decode)", _dropdown(), {"choices": TILED_VAE})
        .info("auto: only when the untiled decode runs out of GPU memory; always: every decode in tiles"),
    }


def _dropdown():
    try:
        import gradio as gr

        return gr.Dropdown
    except ImportError:
        return None


def _sd_unet_choice() -> str | None:
    """None when A1111's SD Unet setting chooses sd-accel; else why not, in words (A1111 then runs its built-in UNet).
    Read as sd_unet.get_unet_option reads it, without loading a model."""
    value = str(_option("sd_unet", "Automatic"))
    if value == ACCEL_LABEL:
        return None
    choose = f"Choose '{ACCEL_LABEL}' under Settings > Stable Diffusion > SD Unet (sd_unet takes that exact text)."
    if value == "Automatic":
        loaded = getattr(importlib.import_module("modules.sd_models").model_data, "sd_model", None)
        if getattr(getattr(loaded, "sd_checkpoint_info", None), "model_name", None) == ACCEL_NAME:
            return None
        return ("SD Unet is 'Automatic', which takes a UNet named after the checkpoint (none is): A1111 runs its "
                f"built-in UNet. {choose}")
    if value == "None":
        return f"SD Unet is 'None': A1111 runs its built-in UNet. {choose}"
    if value in [o.label for o in sd_unet.unet_options]:
        return f"SD Unet is '{value}', another extension's UNet. {choose}"
    return f"SD Unet is '{value}', which is no SD Unet option: A1111 runs its built-in UNet. {choose}"


def _names_sd_accel(value: str) -> bool:
    """Whether an sd_unet value means sd-accel without being its option's text (A1111 accepts any text)."""
    return value != ACCEL_LABEL and "sdaccel" in "".join(c for c in value.lower() if c.isalnum())


def _inactive_reason() -> str | None:
    """None when sd-accel serves the host's UNet now; else why not."""
    if FORGE:
        if _option("sd_accel_backend", "auto") == "off":
            return "Settings > sd-accel > backend is off: Forge runs its own UNet."
        if _active is None:
            return "no generation yet: sd-accel serves Forge's UNet from the first generation on."
        return None
    why = _sd_unet_choice()
    if why is not None:
        return why
    if _active is None or sd_unet.current_unet is not _active:
        return (f"SD Unet is '{ACCEL_LABEL}': sd-accel serves the UNet from the next generation on (A1111 applies "
                "the setting then).")
    return None


def _status() -> dict:
    why = _inactive_reason()
    last = _active.slot if _active is not None else None
    s = last.status if last is not None else (_statuses[-1] if _statuses else SlotStatus())
    out = {"active": why is None, "backend": s.backend if why is None else "inactive",
           "engine_calls": sum(x.engine_calls for x in _statuses), "plain_calls": sum(x.plain_calls for x in _statuses),
           "source": s.source, "plan": s.plan, "messages": list(s.messages), "tiled_decodes": _tiled_decodes}
    if why is not None:
        out["reason"] = why
        if _statuses:
            out["last_backend"] = s.backend
    ran = _attention_ran(last) if last is not None else None
    if ran is not None:
        out["attention"] = ran
        # The plan names the SDPA kernel sd-accel prefers; the attention that ran is the host's (see _host_attention).
        out["plan"] = s.plan.replace(f"attention {last.attention[1]},", f"attention {ran},", 1)
    return out


def _status_api(_demo, app) -> None:
    @app.get("/sd-accel/status")
    def status() -> dict:
        return _status()


FORGE = importlib.util.find_spec("modules_forge") is not None

if FORGE:
    class AccelForge(scripts.Script):
        """Each sampling (hires fix: both passes) runs on a clone of forge_objects.unet carrying sd-accel's wrapper;
        the engine (one EngineSlot for the loaded model) outlives the generations."""

        slot: EngineSlot | None = None
        backend: str | None = None

        def title(self) -> str:
            return "sd-accel"

        def show(self, is_img2img):
            return scripts.AlwaysVisible

        def process_before_every_sampling(self, p, *args, **kwargs) -> None:
            global _active
            from sd_accel.accel.hosts.forge import ForgeSession

            backend = _option("sd_accel_backend", "auto")
            if backend == "off":
                self.postprocess(p, None)
                _active = None
                return
            if AccelForge.slot is None or backend != AccelForge.backend:
                if AccelForge.slot is not None:
                    AccelForge.slot.release()
                AccelForge.slot, AccelForge.backend = _slot(backend), backend
            _active = AccelForge
            unet = p.sd_model.forge_objects.unet.clone()
            unet.set_model_unet_function_wrapper(ForgeSession(AccelForge.slot, unet).wrapper)
            p.sd_model.forge_objects.unet = unet

        def postprocess(self, p, processed, *args) -> None:
            # The torch path changed the module in place (fused forwards): undone until the next sampling, whose
            # first call redoes it and replays the kept CUDA graphs.
            if AccelForge.slot is not None:
                AccelForge.slot.end_run(keep_graphs=True)

else:  # A1111 (Forge has no SD Unet routing)
    class AccelSdUnetCheck(scripts.Script):
        """Says once on the console when the SD Unet setting names sd-accel in other words than its option's
        (A1111 accepts any text there and runs its built-in UNet)."""

        def title(self) -> str:
            return "sd-accel SD Unet check"

        def show(self, is_img2img):
            return scripts.AlwaysVisible

        def process(self, p, *args) -> None:
            value = str(_option("sd_unet", "Automatic"))
            if _names_sd_accel(value) and value not in _told:
                _told.add(value)
                print(f"sd-accel: not active: {_sd_unet_choice()}")


shared.options_templates.update(shared.options_section(SECTION, _settings()))
script_callbacks.on_app_started(_status_api)
if not FORGE:
    script_callbacks.on_list_unets(_list_unets)
    script_callbacks.on_model_loaded(_hook_vae)
    _loaded = getattr(importlib.import_module("modules.sd_models").model_data, "sd_model", None)
    if _loaded is not None:  # scripts reloaded with a model in memory ("Apply and restart UI")
        _hook_vae(_loaded)
