"""The Accelerated UNet node: MODEL in, MODEL out (a clone; the input model is never changed).

It works the way ComfyUI's own torch.compile helper does (comfy_api/torch_helpers/torch_compile.py): through
ModelPatcher wrappers, which travel with every clone (LoraLoader downstream included) and are applied only
while this model samples. Two wrappers:

- OUTER_SAMPLE: knows the ModelPatcher that samples (its weight patches, hooks, lowvram state) and ends the
  run: the torch path undoes its in-place module changes, so models that share the UNet see none of them,
  and keeps its CUDA graphs for the next run (freed when ComfyUI unloads the model, an ON_DETACH callback, and
  after every run in ComfyUI's low-VRAM modes).
- DIFFUSION_MODEL: around the UNet's (or Flux's, or Chroma's) forward. A call that carries nothing the engine cannot
  honour goes to the engine, built on the first such call with its real shapes; any other call runs ComfyUI's own forward
  (patches, inner wrappers and all), and the node says why once. SD3's MMDiT has no such wrapper point in ComfyUI:
  an APPLY_MODEL wrapper gives its instance, for that call only, a forward that does the same, inner wrappers aside
  (ComfyUI runs none there).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import time
import weakref
from typing import Any

import torch

from ..accel.errors import AccelError, BadInput
from ..accel.hosts.support import EngineSlot, shape_profile, transformer_patches
from ..accel.models.dit import inspect_dit, is_dit, ltx2_outputs
from ..accel.models.spec import inspect_unet
from ..accel.parallel.spread import GPUS, SPREAD_OPTIONS, Spread, devices_here
from ..accel.plan.options import PRECISION
from . import gpus as gpu_side
from .comfy_ui import CATEGORY, cache_root, current_prompt, node_progress, publish, say
from .conds import sample_with_conds_on_device

KEY = "sd-accel"
# transformer_options entries by which ComfyUI 0.33's LTX-2 nodes change what its blocks run for a call
LTX2_SWITCHES = ("stg_self_attn_blocks", "run_vx", "run_ax", "a2v_cross_attn", "v2a_cross_attn")
BACKENDS = ["auto", "torch", "onnxruntime"]
FAMILIES = ("sd1", "sd2", "sdxl")
# The nine shape widgets are the range of sizes an ONNX Runtime engine is built for; the torch path (auto's choice)
# captures a CUDA graph per shape and reads none of them. So they are optional (a prompt may leave them out) and
# advanced (the front end hides them unless the node shows its advanced inputs, as web/sd_accel.js makes it do when
# backend is onnxruntime). They keep their place in the widget list: the front end gives a saved workflow's
# widgets_values to the widgets by position.
_ONLY_ORT = ("Used only by the onnxruntime backend: {}. The torch path captures CUDA graphs per shape and ignores "
             "it; calls outside min-max run on the torch path.")
_BOUND = {"min": "the smallest {} its engine is built for",
          "opt": "the {} its engine is tuned for (the one used most)",
          "max": "the largest {} its engine is built for"}


def _size(bound: str, side: str, default: int) -> tuple[str, dict]:
    return ("INT", {"default": default, "min": 64, "max": 8192, "step": 8, "advanced": True,
                    "tooltip": _ONLY_ORT.format(_BOUND[bound].format(f"image {side} in pixels"))})


def _batch(bound: str, default: int) -> tuple[str, dict]:
    return ("INT", {"default": default, "min": 1, "max": 64, "advanced": True,
                    "tooltip": _ONLY_ORT.format(_BOUND[bound].format("batch size"))})


class AcceleratedUNetNode:
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"
    DESCRIPTION = ("Runs the diffusion model of an SD1.x, SD2.x or SDXL (UNet) or a Flux.1, Flux.2, Chroma, SD3/SD3.5, "
                   "Wan 2.1/2.2, Qwen-Image, Z-Image, HunyuanVideo 1.5 or LTX-2 (transformer) checkpoint through the "
                   "fastest path for this GPU (fused torch kernels with CUDA graphs; ONNX Runtime for UNets), built on "
                   "the first sampling step and cached. LoRA, ControlNet and other nodes' patches keep working: calls "
                   "an engine cannot serve run on the torch path or the plain model, and the node says why.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The model to accelerate (SD1.x, SD2.x, SDXL, Flux.1, Flux.2, Chroma, "
                                    "SD3/SD3.5, Wan 2.1/2.2, Qwen-Image, Z-Image, HunyuanVideo 1.5, LTX-2); it is not "
                                    "changed: the output is an accelerated copy."}),
                "backend": (BACKENDS, {"default": "auto", "tooltip": (
                    "auto: the torch path (fused kernels, a CUDA graph per shape), or what SD_ACCEL_BACKEND "
                    "names. onnxruntime (SD1.x, SD2.x and SDXL UNets): an ONNX Runtime engine, built once into the "
                    "engine cache (about a minute) for the shape range of the advanced inputs it shows. torch: the "
                    "torch path. A path that cannot run here leaves the call to the torch path and says why.")}),
                "cuda_graphs": ("BOOLEAN", {"default": True, "tooltip": "Replay each shape as a CUDA/HIP graph "
                                            "where the GPU supports it (torch path; not on the CPU). Calls with "
                                            "per-step patches, and LTX-2, run without it. Off: never."}),
                "torch_compile": ("BOOLEAN", {"default": False, "tooltip": "Compile the UNet's repeated blocks "
                                              "with torch.compile (torch path; the first run takes minutes)."}),
            },
            # Optional, so that workflows saved before an input existed (precision, gpus) or that leave out the
            # nine shape inputs still validate; in this order, which is the widgets' order in saved workflows.
            "optional": {
                "min_width": _size("min", "width", 512), "opt_width": _size("opt", "width", 1024),
                "max_width": _size("max", "width", 1536),
                "min_height": _size("min", "height", 512), "opt_height": _size("opt", "height", 1024),
                "max_height": _size("max", "height", 1536),
                "min_batch": _batch("min", 1), "opt_batch": _batch("opt", 1), "max_batch": _batch("max", 4),
                "precision": (list(PRECISION), {"default": "auto", "tooltip": (
                    "The transformers (Flux, Chroma, SD3, Wan, Qwen-Image, Z-Image, HunyuanVideo 1.5, LTX-2): auto "
                    "runs weights loaded in fp8 as fp8 "
                    "matrix products (Hopper and later) and 16-bit weights in 16 bits; fp8 also quantizes 16-bit "
                    "weights (faster, +50% weight memory, slightly different images); int8 quantizes them to int8 "
                    "instead (a little slower than fp8, closer to the 16-bit image: for Z-Image, whose fp8 image "
                    "drifts most); 16bit widens fp8 weights per call, as ComfyUI does. UNets (SD1.x, SDXL) compute "
                    "in 16 bits whatever this says.")}),
                "gpus": (list(GPUS), {"default": "1", "tooltip": (
                    "How many GPUs one sampling run uses: all = every visible GPU; fewer are used where fewer are "
                    "visible. With more than 1, a worker process on each other GPU holds a copy of the model (started "
                    "on the first step: tens of seconds for a 14B model) and every step is split: CFG's two halves on "
                    "two GPUs, the image or video tokens (Wan, Flux, Chroma, SD3/SD3.5, Qwen-Image) over the others. "
                    "Calls that cannot be split run on one GPU. Sequence-parallel calls run without CUDA graphs. "
                    "Linux (NCCL).")})},
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def apply(self, model, backend: str, cuda_graphs: bool, torch_compile: bool,
              min_width: int = 512, opt_width: int = 1024, max_width: int = 1536, min_height: int = 512,
              opt_height: int = 1024, max_height: int = 1536, min_batch: int = 1, opt_batch: int = 1,
              max_batch: int = 4, precision: str = "auto", gpus: str = "1",
              unique_id: str | None = None) -> dict:
        problem = unsupported(model)
        if problem:
            return _result(model, [say(unique_id, problem)])
        resident, why = resident_model(model)
        if resident is None:
            return _result(model, [say(unique_id, why)])
        notes = [say(unique_id, why)] if why else []
        model = resident
        try:
            profile = shape_profile((min_batch, opt_batch, max_batch), (min_height, opt_height, max_height),
                                    (min_width, opt_width, max_width))
        except BadInput as e:
            profile = None  # the other paths never read it: a bad one (an old workflow's values) is said only here
            if backend == "onnxruntime":
                notes.append(say(unique_id, f"{e} Until then the torch path runs, which needs no profile."))
                backend = "torch"
        # On (the default) leaves graphs to the plan, which uses them where the GPU can; only off is the user's
        # choice. Passing on as a request would make every node on a CPU or graph-less GPU say it cannot be honoured.
        options = {"compile": torch_compile, "precision": precision}
        if not cuda_graphs:
            options["cuda_graphs"] = False
        devices, gpus_note = devices_here(gpus, model.load_device)
        if len(devices) > 1:
            options.update(SPREAD_OPTIONS)
        try:
            plan = _plan(backend, options)
        except AccelError as e:
            return _result(model, notes + [say(unique_id, f"{e} The plain model runs.")])
        if backend != "auto" and plan.backend != backend:
            asked = [r for r in plan.reasons if r.startswith(f"{backend} was asked for")]
            say(unique_id, " ".join(asked) or f"the {backend} path cannot run here; the {plan.backend} path runs.")
        notes.append(plan.summary())
        slot = EngineSlot(_preference(backend), options, profile, progress=lambda: node_progress(unique_id),
                          on_change=lambda _status: publish(unique_id, status_payload(session)),
                          cache_root=cache_root())
        session = Session(slot, unique_id)
        out = model.clone()
        attach(out, session)
        if gpus_note:
            slot.tell("gpus", gpus_note)
            notes.append(gpus_note)
        if len(devices) > 1:
            use_devices(out, devices)
        publish(unique_id, {"kind": "planned", "backend": plan.backend, "text": "\n".join(notes)})
        return _result(out, notes)


def _result(model, notes: list[str]) -> dict:
    return {"ui": {"text": ["\n".join(notes)]}, "result": (model,)}


def _preference(backend: str) -> str | None:
    """auto leaves the choice to accel/plan/policy.py, which honours SD_ACCEL_BACKEND (e.g. =off to disable the pack)."""
    return None if backend == "auto" else backend


def _plan(backend: str, options: dict):
    from ..accel.plan.device import detect
    from ..accel.plan.policy import choose

    return choose(detect(), _preference(backend), options=dict(options))


def _kind(model) -> str:
    """"unet", "flux", "chroma", "sd3", "wan", "qwen-image", "z-image", "hunyuan-video" or "ltx2": which forward the
    node's wrappers serve (unsupported() has accepted the model)."""
    unet = model.model.diffusion_model
    return inspect_dit(unet).family if is_dit(unet) else "unet"


def unsupported(model) -> str | None:
    """Why this MODEL is not accelerated (it then passes through unchanged), or None."""
    from comfy.ldm.flux.model import Flux
    from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    transformers = [Flux, OpenAISignatureMMDITWrapper]
    for module, name in (("comfy.ldm.chroma.model", "Chroma"), ("comfy.ldm.wan.model", "WanModel"),
                         ("comfy.ldm.qwen_image.model", "QwenImageTransformer2DModel")):
        try:  # a ComfyUI from before the model has no such class
            transformers.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    # Classes accelerated in one form only: ComfyUI 0.33's Z-Image is Lumina 2's NextDiT in another form, HunyuanVideo
    # 1.5 the HunyuanVideo of 1.0 and HunyuanImage 2.1 in its own, LTX-2 the LTXAVModel of LTX-2.3 in its own
    # (accel/models/dit.py says which)
    in_one_form = []
    for module, name in (("comfy.ldm.lumina.model", "NextDiT"), ("comfy.ldm.hunyuan_video.model", "HunyuanVideo"),
                         ("comfy.ldm.lightricks.av_model", "LTXAVModel")):
        try:
            in_one_form.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    base = getattr(model, "model", None)
    unet = getattr(base, "diffusion_model", None)
    # ComfyUI's name for the model (supported_models: ZImage), which its BaseModel class (Lumina2) may not say
    config = getattr(base, "model_config", None)
    what = type(base if config is None else config).__name__ + ("" if unet is None else f" ({type(unet).__name__})")
    # Subclasses (SVD's VideoUNet, Chroma Radiance's Chroma, VACE's and the camera models' Wan) take other inputs or
    # have other blocks.
    if type(unet) in transformers or (type(unet) in in_one_form and is_dit(unet)):
        try:
            inspect_dit(unet)
        except AccelError as e:
            return f"{e} It passes through unaccelerated."
    elif type(unet) is not UNetModel:
        return (f"{what} is not accelerated (yet): sd-accel takes SD1.x, SD2.x and SDXL UNets and the Flux.1, Flux.2, "
                "Chroma, SD3, Wan 2.1/2.2, Qwen-Image, Z-Image, HunyuanVideo 1.5 and LTX-2 transformers; it passes "
                "through to ComfyUI's own forward.")
    else:
        try:
            family = inspect_unet(unet).family
        except AccelError as e:
            return f"{e} It passes through unaccelerated."
        if family not in FAMILIES:
            return (f"{what} has a {family} layout (not SD1.x, SD2.x or SDXL); it passes through unaccelerated.")
    unread = quantized_formats(unet) - set(READ_FORMATS)
    if unread:
        return (f"{what} was loaded from a quantized checkpoint in the {', '.join(sorted(unread))} format, which "
                f"sd-accel does not read (it reads {', '.join(READ_FORMATS)}); it passes through unaccelerated and "
                "ComfyUI's own kernels run it.")
    return None


# The formats of ComfyUI's quantized checkpoints (0.33 and later: comfy-kitchen layouts) whose layers the engine
# serves: e4m3 weights with one scale per tensor, read as they are by the fp8 products (accel/engine/fp8.py) or, where
# those do not run, by ComfyUI's own layer inside the fused blocks. The others (fp4, block-scaled fp8, int8, e5m2) run
# kernels of comfy-kitchen's that no run of ours has checked under CUDA graphs or timed against ComfyUI's own path.
READ_FORMATS = ("float8_e4m3fn",)


def quantized_formats(unet) -> set[str]:
    """The formats ComfyUI loaded the model's quantized layers in (0.33 and later: each such layer's quant_format, from
    the checkpoint's comfy_quant entries or its scaled_fp8 ones, which it converts); empty for a model without any."""
    return {f for m in unet.modules() if isinstance(f := m.__dict__.get("quant_format"), str)}


# Under DynamicVRAM, the resident copy of each dynamic model (ComfyUI's own clone override: its BaseModel and backups),
# kept while the dynamic model lives, so that a LoRA or widget change upstream does not load the file again
_RESIDENT: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()
RESIDENT_SHARE = 0.75  # of the GPU's memory, at most, for the weights (the rest for activations and graphs)


def resident_model(model) -> tuple[Any, str | None]:
    """The ModelPatcher the node accelerates: (model, None) for ComfyUI's ModelPatcher; under DynamicVRAM (ComfyUI
    0.33 and later, its default on NVIDIA) (a resident copy, what the node says), or (None, why) where the model
    cannot be resident and ComfyUI's own path runs.

    A ModelPatcherDynamic keeps the weights in host memory and faults them into a VRAM arena block by block as they
    run, through cast-on-the-fly layers that fused kernels and CUDA graphs cannot read. ComfyUI's own way out for code
    that needs resident weights is a clone with disable_dynamic (its sampler's get_non_dynamic_delegate, for conds
    with hooks): the same model as a legacy ModelPatcher, loaded once more from its file, with this patcher's patches
    (LoRA) applied to it as ModelPatcher applies them."""
    is_dynamic = getattr(model, "is_dynamic", None)
    if not callable(is_dynamic) or not is_dynamic():
        return model, None
    import comfy.model_management as mm

    size, total = model.model_size(), mm.get_total_memory(model.load_device)
    if size > RESIDENT_SHARE * total:
        return None, (f"ComfyUI runs this model under DynamicVRAM, streaming its {size / 2**30:.1f} GB of weights "
                      f"through the GPU ({total / 2**30:.0f} GB); sd-accel needs them resident with a quarter of the "
                      "GPU's memory to spare, so ComfyUI's own path runs.")
    try:
        resident = model.clone(disable_dynamic=True, model_override=_RESIDENT.get(model.model))
    except RuntimeError as e:  # a custom loader that registered no way to load the model again
        return None, (f"ComfyUI runs this model under DynamicVRAM and cannot load a resident copy of it ({e}); "
                      "ComfyUI's own path runs.")
    _RESIDENT[model.model] = resident.get_clone_model_override()
    return resident, ("ComfyUI runs this model under DynamicVRAM; the node accelerates a resident copy of it "
                      f"(ComfyUI's non-dynamic clone: {size / 2**30:.1f} GB of weights kept on the GPU, loaded from "
                      "its file once), with the same patches and LoRAs.")


def attach(model, session: "Session") -> None:
    """Install the session's wrappers on a ModelPatcher, replacing an earlier Accelerated UNet's."""
    from comfy.patcher_extension import CallbacksMP, WrappersMP

    serve = {"unet": (WrappersMP.DIFFUSION_MODEL, session.diffusion_model),
             "flux": (WrappersMP.DIFFUSION_MODEL, session.flux_diffusion_model),
             "chroma": (WrappersMP.DIFFUSION_MODEL, session.chroma_diffusion_model),
             "wan": (WrappersMP.DIFFUSION_MODEL, session.wan_diffusion_model),
             "qwen-image": (WrappersMP.DIFFUSION_MODEL, session.qwen_image_diffusion_model),
             "z-image": (WrappersMP.DIFFUSION_MODEL, session.z_image_diffusion_model),
             "hunyuan-video": (WrappersMP.DIFFUSION_MODEL, session.hunyuan_video_diffusion_model),
             "ltx2": (WrappersMP.DIFFUSION_MODEL, session.ltx2_diffusion_model),
             "sd3": (WrappersMP.APPLY_MODEL, session.apply_model)}[_kind(model)]
    for kind in (WrappersMP.OUTER_SAMPLE, WrappersMP.SAMPLER_SAMPLE, WrappersMP.DIFFUSION_MODEL,
                 WrappersMP.APPLY_MODEL):
        model.remove_wrappers_with_key(kind, KEY)
    for kind, fn in ((WrappersMP.OUTER_SAMPLE, session.outer_sample),
                     (WrappersMP.SAMPLER_SAMPLE, sample_with_conds_on_device), serve):
        model.add_wrapper_with_key(kind, KEY, fn)
    model.remove_callbacks_with_key(CallbacksMP.ON_DETACH, KEY)
    model.add_callback_with_key(CallbacksMP.ON_DETACH, KEY, session.on_detach)


def _without_serving_wrappers(run_options: dict | None, patcher) -> None:
    """Takes the node's serving wrapper out of one sampling run's model options, for a model TorchCompileModel
    compiles: its compiled forward would trace the wrapper into its graphs (each call then passing the wrapper's
    frames and guards) only for the wrapper to step aside. ComfyUI's guider copies the patcher's wrappers into options
    of its own for each run; where they are the patcher's own, nothing is taken."""
    from comfy.patcher_extension import WrappersMP

    wrappers = (run_options or {}).get("transformer_options", {}).get("wrappers") or {}
    for kind in (WrappersMP.DIFFUSION_MODEL, WrappersMP.APPLY_MODEL):
        keyed = wrappers.get(kind)
        if isinstance(keyed, dict) and keyed is not getattr(patcher, "wrappers", {}).get(kind):
            keyed.pop(KEY, None)


# The diffusion-model wrappers (their keys) of ComfyUI's own nodes that take the forward as a whole: each calls it with
# the arguments it was given, or returns without calling it (a step it takes from its cache), and reaches into no
# block. Added after the node they run around the engine's call; any other wrapper might reach into the blocks, which
# the engine's fused blocks and CUDA graphs would not show it.
WHOLE_FORWARD = frozenset({
    "easycache",  # EasyCache, comfy_extras/nodes_easycache.py
})


def _wrappers_inside(transformer_options: dict, count: int) -> list[str] | None:
    """The keys of the diffusion-model wrappers added after the node's (they run inside it), or None where
    transformer_options does not account for the `count` wrappers the call has inside the node's."""
    from comfy.patcher_extension import WrappersMP

    keyed = transformer_options.get("wrappers", {}).get(WrappersMP.DIFFUSION_MODEL, {})
    keys = list(keyed)
    after = keys[keys.index(KEY) + 1:] if KEY in keys else []
    return [str(k) for k in after] if sum(len(keyed[k]) for k in after) == count else None


def use_devices(model, devices: list[str], timeout: float | None = None) -> None:
    """Spread the calls of an Accelerated UNet's output over devices, the first being the one ComfyUI runs the model on
    (accel/parallel/spread.py). The node passes the GPUs it chose; the tests pass CPU devices (workers over gloo)."""
    session = session_of(model)
    slot = session.slot
    extra = {} if timeout is None else {"timeout": timeout}
    slot.use_spread(Spread(devices, lambda: gpu_side.recipe(session.patcher), slot.options, slot.tell, slot.progress,
                           **extra))


def _replaced_here(objects: tuple) -> str:
    """Why object patches keep the calls on one GPU ('' when they do not): parts of the diffusion model replaced in
    ComfyUI's process, which the workers' copies on the other GPUs do not have."""
    inside = [key for key, _ in objects if key.startswith("diffusion_model.")]
    return (f"other nodes replaced parts of the diffusion model ({', '.join(inside)}), which the copies on the other "
            "GPUs do not have; one GPU serves the run.") if inside else ""


def _memory_to_spare() -> bool:
    """Whether kept CUDA graphs may hold their memory between runs: not when ComfyUI runs in its low-VRAM modes
    (--lowvram, --novram, or chosen for a small GPU), where the VAE decode after sampling needs that memory."""
    import comfy.model_management as mm

    return mm.vram_state not in (mm.VRAMState.LOW_VRAM, mm.VRAMState.NO_VRAM)


def _wait_for(device) -> None:
    """Wait for the work queued on a CUDA device: its calls return before their kernels run, and a run's time is
    their computation's."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@functools.lru_cache(maxsize=None)
def _positional_names(function) -> tuple[str, ...]:
    return tuple(p.name for p in inspect.signature(function).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _named_inputs(forward, args: tuple, kwargs: dict) -> dict:
    """The inputs a diffusion model's forward(x, timesteps, context, *args, **kwargs) gets after context, by the names
    its own signature gives the positions (read once per function: ComfyUI hands a new bound method every call)."""
    function = getattr(forward, "__func__", forward)
    names = list(_positional_names(function)[3 if function is forward else 4:])  # a bound method's self too
    names += [f"input {i + 4}" for i in range(len(names), len(args))]  # unnamed: given, so the call stays plain
    return {**dict(zip(names, args)), **kwargs}


def session_of(model) -> "Session | None":
    """The Session an Accelerated UNet attached to this model (or to a model it was cloned from)."""
    from comfy.patcher_extension import WrappersMP

    for kind in (WrappersMP.DIFFUSION_MODEL, WrappersMP.APPLY_MODEL):
        for fn in model.wrappers.get(kind, {}).get(KEY, []):
            owner = getattr(fn, "__self__", None)
            if isinstance(owner, Session):
                return owner
    return None


def status_payload(session: "Session") -> dict[str, Any]:
    """The node's status for web/sd_accel.js, with the calls of the current (or last) run, as it shows them."""
    status = session.slot.status
    engine_calls, plain_calls, spread_calls = session.run_calls()
    return {"kind": "status", "backend": status.backend, "source": status.source,
            "engine_calls": engine_calls, "plain_calls": plain_calls,
            "gpus": gpu_side.gpus_line(status, spread_calls, engine_calls), "messages": list(status.messages)}


def _other_count(num_tokens, context) -> Any:
    """num_tokens where it is not the context's token count (a masked text's: ComfyUI gives it as a float), else
    None."""
    try:
        same = num_tokens is None or context is None or int(num_tokens) == context.shape[1]
    except (TypeError, ValueError, RuntimeError):
        same = False
    return None if same else num_tokens


class Session:
    """The state one Accelerated UNet node's output carries into every sampling run of it and its clones."""

    def __init__(self, slot: EngineSlot, node_id: str | None = None) -> None:
        self.slot = slot
        self.node_id = node_id
        self.patcher = None  # the ModelPatcher sampling now; None between runs
        self._objects: tuple | None = None  # the last run's object patches (see outer_sample)
        # A run is one prompt's sampling with this model (a hires fix samples twice): its prompt id, and the slot's
        # call counts when it began. The slot counts over the session's life, which spans many prompts.
        self.sampled = False
        self.prompt: str | None = None
        self._counts_before = (0, 0, 0)
        self.sampling_seconds = 0.0  # the run's time in the sampler (Accel Info's speed), a hires fix's passes added

    @staticmethod
    def _counts(status) -> tuple[int, int, int]:
        return status.engine_calls, status.plain_calls, status.spread_calls

    def _begin_run(self) -> None:
        prompt = current_prompt()
        if not self.sampled or prompt is None or prompt != self.prompt:
            self.sampled, self.prompt, self._counts_before = True, prompt, self._counts(self.slot.status)
            self.sampling_seconds = 0.0

    def run_calls(self) -> tuple[int, int, int]:
        """(engine calls, plain calls, engine calls spread over several devices) of the current run, or of the last
        one between runs."""
        return tuple(now - before for now, before in zip(self._counts(self.slot.status), self._counts_before))

    def outer_sample(self, executor, *args, **kwargs):
        outer = self.patcher  # set when a sampler runs inside another sampler's run of this model
        self.patcher = getattr(executor.class_obj, "model_patcher", None)
        compiled = self.patcher is not None and self.patcher.model_options.get("torch_compile_kwargs") is not None
        if outer is None:
            self._begin_run()
            # Kept CUDA graphs replay the modules as they were captured; object patches (other nodes' replaced
            # submodules or methods) that differ from the last run's need the torch path prepared again.
            objects = tuple(sorted((k, id(v)) for k, v in getattr(self.patcher, "object_patches", {}).items()))
            if self._objects is not None and objects != self._objects:
                self.slot.end_run()
            self._objects = objects
            if compiled:
                self.slot.tell("torch.compile", "TorchCompileModel compiles this model: its compiled forward runs, "
                               "not sd-accel's engine. Leave TorchCompileModel out to accelerate (the node's "
                               "torch_compile option compiles the engine's blocks).")
            if self.slot.spread is not None:
                self.slot.spread.hold(_replaced_here(objects))
        if compiled:
            _without_serving_wrappers(getattr(executor.class_obj, "model_options", None), self.patcher)
        device, started = getattr(self.patcher, "load_device", None), time.perf_counter()
        try:
            return executor(*args, **kwargs)
        finally:
            self.patcher = outer
            if outer is None:
                _wait_for(device)
                self.sampling_seconds += time.perf_counter() - started
                self.slot.end_run(keep_graphs=_memory_to_spare())
                publish(self.node_id, status_payload(self))

    def on_detach(self, patcher, unpatch_all: bool) -> None:
        """ComfyUI unloads the model (not the detach and load it does before every run): free the kept graphs; the
        workers on other GPUs go."""
        if unpatch_all:
            self.slot.end_run()
            if self.slot.spread is not None:
                self.slot.spread.close()

    def diffusion_model(self, executor, x, timesteps=None, context=None, y=None, control=None,
                        transformer_options={}, **kwargs):  # noqa: B006 (ComfyUI's own signature)
        def plain(run=executor):
            return run(x, timesteps, context, y, control, transformer_options, **kwargs)

        return self._serve_wrapped(executor, transformer_options, kwargs, plain, x, timesteps, context, y, control)

    def flux_diffusion_model(self, executor, x, timesteps=None, context=None, y=None, guidance=None,
                             ref_latents=None, control=None, transformer_options={}, **kwargs):  # noqa: B006
        def plain(run=executor):
            return run(x, timesteps, context, y, guidance, ref_latents, control, transformer_options, **kwargs)

        extra = dict(kwargs, ref_latents=ref_latents)
        return self._serve_wrapped(executor, transformer_options, extra, plain, x, timesteps, context, y, control,
                                   guidance)

    def chroma_diffusion_model(self, executor, x, timesteps=None, context=None, guidance=None, control=None,
                               transformer_options={}, **kwargs):  # noqa: B006 (ComfyUI's own signature)
        def plain(run=executor):
            return run(x, timesteps, context, guidance, control, transformer_options, **kwargs)

        extra = {k: v for k, v in kwargs.items() if k != "y"}  # a pooled input Chroma's forward ignores
        return self._serve_wrapped(executor, transformer_options, extra, plain, x, timesteps, context, None, control,
                                   guidance)

    def wan_diffusion_model(self, executor, x, timestep=None, context=None, clip_fea=None, time_dim_concat=None,
                            transformer_options={}, **kwargs):  # noqa: B006 (ComfyUI's own signature)
        def plain(run=executor):
            return run(x, timestep, context, clip_fea, time_dim_concat, transformer_options, **kwargs)

        # Image-to-video's CLIP features and Wan 2.2's concatenated frames are inputs the engine does not take yet:
        # such calls run ComfyUI's own forward (why_plain says so once).
        extra = dict(kwargs, clip_fea=clip_fea, time_dim_concat=time_dim_concat)
        return self._serve_wrapped(executor, transformer_options, extra, plain, x, timestep, context, None, None)

    def qwen_image_diffusion_model(self, executor, x, timesteps=None, context=None, *args, **kwargs):
        """ComfyUI passes Qwen-Image's inputs after context by position, in an order that changed: 0.3.6x
        (attention_mask, guidance, ref_latents, transformer_options), 0.33 (attention_mask, ref_latents,
        additional_t_cond, transformer_options). They are read by the names of the forward they go to, so that
        Qwen-Image-Edit's reference latents are never taken for guidance."""
        def plain(run=executor):
            return run(x, timesteps, context, *args, **kwargs)

        extra = _named_inputs(executor.original, args, kwargs)
        transformer_options = extra.pop("transformer_options", {})
        guidance, control = extra.pop("guidance", None), extra.pop("control", None)
        return self._serve_wrapped(executor, transformer_options, extra, plain, x, timesteps, context, None, control,
                                   guidance)

    def z_image_diffusion_model(self, executor, x, timesteps=None, context=None, num_tokens=None,
                                attention_mask=None, transformer_options={}, **kwargs):  # noqa: B006 (ComfyUI's)
        def plain(run=executor):
            return run(x, timesteps, context, num_tokens, attention_mask, transformer_options=transformer_options,
                       **kwargs)

        # The engine calls the model with the context's token count and no mask, which ComfyUI 0.33's NextDiT reads
        # neither of; another count, a mask or reference images (Z-Image Omni) run ComfyUI's own forward.
        extra = dict(kwargs, attention_mask=attention_mask, num_tokens=_other_count(num_tokens, context))
        control = extra.pop("control", None)
        return self._serve_wrapped(executor, transformer_options, extra, plain, x, timesteps, context, None, control)

    def hunyuan_video_diffusion_model(self, executor, x, timestep=None, context=None, *args, **kwargs):
        """HunyuanVideo 1.5's inputs after context, read by the names of ComfyUI's forward (ComfyUI passes them by
        position). The engine calls the model with the latents, timestep, text, pooled text, guidance and ControlNet;
        a call that carries anything else runs ComfyUI's own forward (why_plain says so once): ByT5's glyph text
        (txt_byt5), image-to-video's CLIP vision features (clip_fea), a text attention mask (whose padding the
        model's blocks mask), HunyuanVideo's guiding frame (per-token modulation) or reference latents."""
        def plain(run=executor):
            return run(x, timestep, context, *args, **kwargs)

        extra = _named_inputs(executor.original, args, kwargs)
        transformer_options = extra.pop("transformer_options", None) or {}
        y, guidance, control = extra.pop("y", None), extra.pop("guidance", None), extra.pop("control", None)
        # False, its default, changes nothing: the node serves no MeanFlow model, whose forward alone reads it
        extra["disable_time_r"] = extra.get("disable_time_r") or None
        return self._serve_wrapped(executor, transformer_options, extra, plain, x, timestep, context, y, control,
                                   guidance)

    def ltx2_diffusion_model(self, executor, x, timestep=None, context=None, *args, **kwargs):
        """LTX-2: ComfyUI passes its latents as [video, audio], the video's timestep (the audio's as a_timestep, the
        same tensor in a plain call) and its inputs after context by position, read here by the names of its forward.
        The engine takes the video latent, the timestep, the text, the audio latent and the frame rate; a call that
        carries anything else runs ComfyUI's own forward (why_plain says so once): a text attention mask, guiding
        latents or keyframes (keyframe_idxs, guide_attention_entries, generated_keyframes), a denoise mask (image to
        video: per-token timesteps, and a video timestep not the audio's), reference audio (ID-LoRA); so does a call
        without an audio latent."""
        def plain(run=executor):
            return run(x, timestep, context, *args, **kwargs)

        latents = list(x) if isinstance(x, (list, tuple)) else [x]
        if len(latents) != 2 or not all(isinstance(t, torch.Tensor) for t in latents) or latents[1].numel() == 0:
            return self.slot.run_plain("ltx2:video-only", "LTX-2 calls without an audio latent (video alone) run "
                                       "ComfyUI's own forward.", plain)
        video, audio = latents
        extra = _named_inputs(executor.original, args, kwargs)
        transformer_options = extra.pop("transformer_options", None) or {}
        rate, control = extra.pop("frame_rate", 25), extra.pop("control", None)
        # the audio's timestep: the video's own tensor in a plain call, which the engine gives both
        if extra.get("a_timestep") is timestep:
            extra.pop("a_timestep")
        # what nodes set in transformer_options to switch parts of its blocks off or perturb them for a call (STG's
        # perturbed self-attentions, LTXVModalityGuidance's severed audio-video cross attention), which the engine's
        # call does not carry
        extra.update((k, transformer_options[k]) for k in LTX2_SWITCHES if k in transformer_options)
        try:  # one value per call (ComfyUI's CONDConstant), as a tensor a CUDA graph takes as an input
            rates = torch.full((video.shape[0],), float(rate), dtype=torch.float64, device=video.device)
        except (TypeError, ValueError, RuntimeError):
            rates, extra["frame_rate"] = None, rate
        out = self._serve_wrapped(executor, transformer_options, extra, plain, video, timestep, context, audio,
                                  control, rates)
        return ltx2_outputs(out, video, audio) if isinstance(out, torch.Tensor) else out

    def apply_model(self, executor, *args, **kwargs):
        """SD3: ComfyUI's MMDiT has no diffusion-model wrapper point, so for this call only its instance gets a
        forward that serves the call as diffusion_model() does; the instance is left exactly as it was. Its own
        forward runs no diffusion-model wrapper either (EasyCache's, added for every model, never runs on SD3): the
        engine's call leaves out nothing the plain call would run."""
        mmdit = executor.class_obj.diffusion_model
        had, before = "forward" in mmdit.__dict__, mmdit.__dict__.get("forward")
        own = mmdit.forward

        def forward(x, timesteps, context=None, y=None, control=None, transformer_options={}, **kw):  # noqa: B006
            def plain():
                return own(x, timesteps, context=context, y=y, control=control,
                           transformer_options=transformer_options, **kw)

            return self._serve(mmdit, [], transformer_options, kw, plain, x, timesteps, context, y, control)

        mmdit.forward = forward
        try:
            return executor(*args, **kwargs)
        finally:
            if had:
                mmdit.forward = before
            else:
                del mmdit.forward

    def _serve_wrapped(self, executor, transformer_options: dict, kwargs: dict, plain, x, timesteps, context, y,
                       control, guidance=None):
        """A diffusion-model wrapper's call. Wrappers added after the node run inside it: where each is one that takes
        the forward as a whole (WHOLE_FORWARD), they run first, around the engine's call (the node's wrapper moved
        innermost for this call); any other keeps the call on ComfyUI's own forward (why_plain)."""
        if torch.compiler.is_compiling():  # TorchCompileModel traces the forward: its compiled model serves
            return plain()
        inside = executor.wrappers[executor.idx + 1:]
        names = _wrappers_inside(transformer_options, len(inside)) if inside else []
        if inside and names and WHOLE_FORWARD.issuperset(names):
            from comfy.patcher_extension import WrapperExecutor

            own = executor.wrappers[executor.idx]
            return plain(WrapperExecutor.new_class_executor(executor.original, executor.class_obj,
                                                            [*inside, own]).execute)
        return self._serve(executor.class_obj, names if names is not None else [f"{len(inside)} unnamed"],
                           transformer_options, kwargs, plain, x, timesteps, context, y, control, guidance)

    def _serve(self, module, inner_wrappers: list[str], transformer_options: dict, kwargs: dict, plain, x, timesteps,
               context, y, control, guidance=None):
        if torch.compiler.is_compiling():
            return plain()
        why = self.why_plain(inner_wrappers, transformer_options, kwargs, module)
        if why is not None:
            if why[0] == "lowvram":  # memory is short: the graphs kept from earlier runs go
                self.slot.end_run()
            return self.slot.run_plain(why[0], why[1], plain)
        return self.slot.call(module, self.patcher.patches_uuid, x, timesteps, context, y, control, plain,
                              guidance=guidance)

    def why_plain(self, inner_wrappers: list[str], transformer_options: dict, kwargs: dict,
                  module: Any = None) -> tuple[str, str] | None:
        """(key, message) when this call must run on ComfyUI's own forward, else None. inner_wrappers: the keys of
        the diffusion-model wrappers that run inside the node's for this call; module: the one called."""
        p = self.patcher
        if p is None:
            return ("no-sampler", "the model was called outside a ComfyUI sampler, where sd-accel cannot see the "
                    "model's patches; such calls run on the plain model.")
        if transformer_options.get("multigpu_thread_device") is not None:
            # Its threads run the calls of a step at once, on the other GPUs' own copies of the model: an engine for
            # one of them would make that GPU's half faster and the step no faster.
            return ("multigpu", "MultiGPU CFG Split (MultiGPU_WorkUnits) runs each step's calls on several GPUs at "
                    "once, each on its own copy of the model; those calls run ComfyUI's own forward. The node's "
                    "gpus option splits CFG over GPUs with the engine on each.")
        if module is not None and module is not getattr(p.model, "diffusion_model", module):
            return ("other-copy", f"a call runs another copy of the diffusion model ({type(module).__name__}) than "
                    "the one sd-accel accelerates; such calls run ComfyUI's own forward.")
        if getattr(p.model, "model_lowvram", False) or getattr(p.model, "lowvram_patch_counter", 0):
            return ("lowvram", "the model is only partly loaded on the GPU (lowvram): its weights are streamed in "
                    "and patched per layer, which an engine or CUDA graph would not see, so the plain model runs. "
                    "Free VRAM (lower the resolution or batch, unload other models) to accelerate.")
        if getattr(p, "hook_patches", None):
            return ("hooks", "per-step weight hooks (scheduled LoRA / hook keyframes) change the weights while "
                    "sampling; the plain model runs rather than stale weights.")
        patches = transformer_patches(transformer_options)
        if transformer_options.get("optimized_attention_override") is not None:
            patches.append("attention override")
        if inner_wrappers:
            patches.append(f"diffusion-model wrappers added after this node ({', '.join(inner_wrappers)})")
        given = sorted(k for k, v in kwargs.items() if v is not None)  # an input passed as None carries nothing
        reasons = ([f"other nodes patch the model ({', '.join(patches)})"] if patches else []) \
            + ([f"the calls have inputs the engine does not take ({', '.join(given)})"] if given else [])
        if reasons:
            return (f"patches:{', '.join(patches + given)}", f"{'; '.join(reasons)}: calls that carry these run on "
                    "ComfyUI's own forward, which applies them (no engine, no CUDA graph).")
        return None
