"""ComfyUI for the tests: finding a checkout (COMFYUI_ROOT), tiny seeded models built from ComfyUI's own
classes, a headless server, and test-only nodes.

This file is also loaded by ComfyUI itself as a custom node (the server tests link it into custom_nodes/):
its NODE_CLASS_MAPPINGS give workflows the tiny model, a tiny ControlNet and a step-dependent attention
patch. So it imports comfy only inside functions, and pytest not at all.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
PACK_NAME = "sd-accel"  # the folder name ComfyUI would import the pack under

# A UNet with the SD1.5 layout (context 768, no adm) at a tiny width: 2 levels, 1 res block each.
TINY_SD15 = dict(image_size=32, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=[1, 1],
                 channel_mult=[1, 2], transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1],
                 transformer_depth_middle=1, context_dim=768, use_linear_in_transformer=False, adm_in_channels=None,
                 use_temporal_attention=False, use_temporal_resblock=False, use_spatial_transformer=True,
                 num_heads=2, num_head_channels=-1, legacy=False, use_checkpoint=False)
# The SDXL layout: context 2048, adm 2816 (pooled 1280 + 6 size embeddings of 256).
TINY_SDXL = {**TINY_SD15, "context_dim": 2048, "adm_in_channels": 2816, "use_linear_in_transformer": True,
             "num_classes": "sequential", "transformer_depth": [0, 1], "transformer_depth_output": [0, 0, 1, 1],
             "num_head_channels": 16, "num_heads": -1}
# The shape profile the tests apply the Accelerated UNet node with (min/opt/max width, height and batch).
PROFILE = dict(min_width=64, opt_width=128, max_width=1024, min_height=64, opt_height=128, max_height=1024,
               min_batch=1, opt_batch=1, max_batch=4)
TINY_VAE = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 32,
            "ch_mult": [1, 1, 2, 2], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0}


# ------------------------------------------------------------------------------------------ finding ComfyUI

HOSTS = REPO.parent / "shared" / "hosts"  # the pinned host trees, where a checkout has them beside it
# What the ComfyUI trees import in-process, and what their headless servers need besides (requirements-hosts.txt),
# by module name; 0.33 and later import comfy-aimdo and comfy-kitchen unconditionally
COMFY_NEEDS = ("einops", "torchsde", "scipy", "psutil", "yaml", "transformers")
COMFY_033_NEEDS = ("comfy_aimdo", "comfy_kitchen")
SERVER_NEEDS = ("aiohttp", "av")
SERVER_033_NEEDS = ("blake3", "simpleeval", "requests", "sqlalchemy")


def comfy_root() -> Path | None:
    """The ComfyUI checkout the tests run in: COMFYUI_ROOT, else the pinned 0.3.64 tree beside the checkout
    (../shared/hosts/ComfyUI); None where neither is a ComfyUI checkout."""
    named = os.environ.get("COMFYUI_ROOT", "").strip()
    root = Path(named) if named else HOSTS / "ComfyUI"
    return root if (root / "comfy" / "model_patcher.py").is_file() else None


def comfy_unavailable(server: bool = False) -> str | None:
    """Why the ComfyUI tests cannot run here (the reason their skip gives), or None when they can; server: the tests
    of its headless server, which needs more."""
    root = comfy_root()
    if root is None:
        named = os.environ.get("COMFYUI_ROOT", "").strip()
        return (f"COMFYUI_ROOT={named} is not a ComfyUI checkout" if named else
                f"no ComfyUI checkout: set COMFYUI_ROOT, or put the pinned trees at {HOSTS}")
    later = (root / "comfy" / "memory_management.py").is_file()  # 0.33 and later
    needs = COMFY_NEEDS + (COMFY_033_NEEDS if later else ())
    if server:
        needs += SERVER_NEEDS + (SERVER_033_NEEDS if later else ())
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        return (f"ComfyUI at {root} needs {', '.join(missing)}: pip install -r requirements-dev.txt (it includes "
                "requirements-hosts.txt)")
    return None


# ComfyUI imports torchvision and torchaudio at module level in model files the tests never use. Their PyPI wheels
# are CUDA builds pinned to their own torch, which do not load beside the CPU torch the tests run on: where one is not
# installed, a stand-in package takes its place, with the names those files import; none is ever called.
_NOT_CALLED = "\n\ndef {}(*args, **kwargs):\n    raise NotImplementedError\n"
_NOT_MADE = "\n\nclass {}:\n    def __init__(self, *args, **kwargs):\n        raise NotImplementedError\n"


def _stub_doc(package: str) -> str:
    return f'"""Stand-in for tests: the real {package} is not installed."""\n'


_STUB_FILES = {
    "torchvision": {
        "__init__.py": '__version__ = "0.0.0"\n',  # below any version a feature asks for
        # transformers (imported by diffusers' PEFT loader) takes torchvision for installed once a stand-in is
        # importable, and imports these names
        "transforms/__init__.py": "import enum\n\n\nclass InterpolationMode(enum.Enum):\n" + "".join(
            f"    {m} = {m.lower()!r}\n" for m in ("NEAREST", "NEAREST_EXACT", "BILINEAR", "BICUBIC", "BOX",
                                                 "HAMMING", "LANCZOS"))
        + "".join(_NOT_MADE.format(c) for c in ("ToPILImage", "ToTensor")),
        "transforms/functional.py": _NOT_CALLED.format("pil_to_tensor"),
        "transforms/v2/__init__.py": "",
        "transforms/v2/functional.py": "",
        "io.py": "",
        # ComfyUI 0.33: SAM3's detector, BiRefNet, VOID's optical flow
        "ops/__init__.py": "".join(_NOT_CALLED.format(f) for f in ("roi_align", "deform_conv2d", "nms", "box_iou")),
        "models/__init__.py": "",
        "models/optical_flow.py": _NOT_CALLED.format("raft_large"),
    },
    # ComfyUI 0.33's comfy.sd imports it (LTX-2's audio VAE), as do its audio encoders and nodes
    "torchaudio": {
        "__init__.py": '__version__ = "0.0.0"\nfrom . import functional, transforms  # noqa: F401\n',
        "functional.py": "".join(_NOT_CALLED.format(f) for f in ("resample", "melscale_fbanks")),
        "transforms.py": "".join(_NOT_MADE.format(c) for c in ("MelScale", "MelSpectrogram", "Resample", "Spectrogram")),
    },
}


def temporary_folder(prefix: str) -> str:
    """A folder of this process's own, removed when it exits (the servers started with it are stopped by then)."""
    folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


_STUB: list[Path] = []  # this process's stand-in folder, once made


def stub_packages() -> Path | None:
    """A folder to put on sys.path that holds a stand-in for each of torchvision and torchaudio not installed (see
    _STUB_FILES); None when both are installed."""
    missing = []
    for package in _STUB_FILES:
        found = importlib.util.find_spec(package)
        if found is None or (_STUB and (found.origin or "").startswith(str(_STUB[0]))):
            missing.append(package)
    if not missing:
        return None
    if not _STUB:
        _STUB.append(Path(temporary_folder("sd-accel-host-stubs-")))
    folder = _STUB[0]
    for package in missing:
        for name, body in _STUB_FILES[package].items():
            path = folder / package / name
            text = _stub_doc(package) + body
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
    return folder


def import_comfy() -> None:
    """Make ComfyUI's comfy package importable in this process (CPU when there is no CUDA). The checkout is treated
    as read-only: no bytecode is written into it, and ComfyUI's folders (folder_paths creates input/ when it is
    first imported) go to a temporary base directory, as the server's --base-directory does."""
    root = comfy_root()
    if root is None:
        raise RuntimeError(comfy_unavailable())
    sys.dont_write_bytecode = True
    for p in (str(root), str(stub_packages() or "")):
        if p and p not in sys.path:
            sys.path.append(p)
    import torch

    import comfy.cli_args

    comfy.cli_args.args.cpu = not torch.cuda.is_available()
    if not comfy.cli_args.args.base_directory and "folder_paths" not in sys.modules:
        comfy.cli_args.args.base_directory = temporary_folder("sd-accel-comfyui-base-")


def comfy_version() -> str:
    """The version of the ComfyUI tree the tests run in (its comfyui_version.py)."""
    try:
        return importlib.import_module("comfyui_version").__version__
    except (ImportError, AttributeError):
        return "of unknown version"


NODE_CALLS = []  # the calls of sage_of_a_node and override_of_a_patch


def sage_of_a_node(q, k, v, heads, *args, **kwargs):
    """Another node's attention function, put where a ComfyUI module keeps its optimized_attention (as nodes that bring
    their own sage attention do): ComfyUI's PyTorch attention, scaled so that an image shows whether it ran."""
    import comfy.ldm.modules.attention as attention

    NODE_CALLS.append(q.shape)
    return attention.attention_pytorch(q, k, v, heads, *args, **kwargs) * 0.75


def override_of_a_patch(fn, *args, **kwargs):
    """A model patch's optimized_attention_override: the attention ComfyUI hands it, scaled, counted in NODE_CALLS."""
    NODE_CALLS.append(args[0].shape)
    return fn(*args, **kwargs) * 0.75


def set_up_like_main() -> str:
    """What ComfyUI's main.py sets up in its process before it loads a model, for in-process runs on a GPU: from 0.33,
    on an NVIDIA GPU with torch 2.8 or later, comfy-aimdo initialised and ModelPatcherDynamic made the loaders'
    patcher (DynamicVRAM, its default), unless SD_ACCEL_DISABLE_DYNAMIC_VRAM=1 stands for its --disable-dynamic-vram.
    Call it after import_comfy and before anything is put on the GPU. Returns which patcher the loaders build."""
    import comfy.cli_args

    args = comfy.cli_args.args
    if os.environ.get("SD_ACCEL_DISABLE_DYNAMIC_VRAM") == "1":
        args.disable_dynamic_vram = True
    enables = getattr(comfy.cli_args, "enables_dynamic_vram", None)
    if enables is None or not enables():  # before 0.33, or --cpu, --disable-dynamic-vram, ...
        return "ModelPatcher"
    import comfy_aimdo.control

    headroom = None if args.reserve_vram is None else int(args.reserve_vram * 1024 ** 3)
    comfy_aimdo.control.init(simple_vram_headroom=headroom, nvml_pressure=not args.disable_nvml_pressure)
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher

    if not mm.is_nvidia() or mm.torch_version_numeric < (2, 8):
        return "ModelPatcher"
    if not comfy_aimdo.control.init_devices((d.index, int(args.vram_headroom * 1024 ** 3))
                                            for d in mm.get_all_torch_devices()):
        return "ModelPatcher (comfy-aimdo did not start)"
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    return "ModelPatcherDynamic (DynamicVRAM)"



def comfy_nodes() -> None:
    """ComfyUI's own nodes.py as the module `nodes`, which comfy_extras import: the pack's nodes/ package has that name
    on the tests' path. Its import puts ComfyUI's comfy/ at the front of sys.path; the path is put back."""
    path = list(sys.path)
    spec = importlib.util.spec_from_file_location("nodes", comfy_root() / "nodes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["nodes"] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules["nodes"]
        raise
    finally:
        sys.path[:] = path


def host_node(module: str, name: str):
    """(ComfyUI's node class `name` from comfy_extras/`module`.py, None) or (None, why this tree has none)."""
    if "nodes" not in sys.modules:
        comfy_nodes()
    try:
        found = getattr(importlib.import_module(f"comfy_extras.{module}"), name, None)
    except ImportError as e:
        return None, f"ComfyUI {comfy_version()} cannot import comfy_extras.{module} ({e})"
    return (found, None) if found is not None else (None, f"ComfyUI {comfy_version()} has no {name} node")


def run_node(cls, model, **inputs):
    """The MODEL a host node returns for `model`: its schema-style execute (io.ComfyNode) or its FUNCTION."""
    if hasattr(cls, "define_schema"):
        return cls.execute(model, **inputs).result[0]
    return getattr(cls(), cls.FUNCTION)(model, **inputs)[0]

@contextlib.contextmanager
def layers_with_weights():
    """Within: ComfyUI's layers are built with their weights, to be seeded in place. Under DynamicVRAM (0.33's
    comfy.memory_management.aimdo_enabled) they are built without, for its loader to fill from a file."""
    memory = sys.modules.get("comfy.memory_management")
    before = getattr(memory, "aimdo_enabled", False)
    if memory is not None:
        memory.aimdo_enabled = False
    try:
        yield
    finally:
        if memory is not None:
            memory.aimdo_enabled = before


def load_diffusion_model_file(module, folder: Path, dtype=None):
    """module's weights written as a diffusion-model file (what UNETLoader lists) and loaded by ComfyUI's own loader,
    comfy.sd.load_diffusion_model, as a workflow does: the patcher ComfyUI builds (ModelPatcherDynamic under
    DynamicVRAM), with the weight dtype `dtype` where given (its weight_dtype widget)."""
    return load_diffusion_model_path(write_diffusion_model_file(module, folder), dtype)


def load_diffusion_model_path(path: Path, dtype=None):
    """A diffusion-model file loaded as UNETLoader loads it, with the weight dtype `dtype` where given."""
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(path), model_options={"dtype": dtype} if dtype is not None else {})


def write_diffusion_model_file(module, folder: Path, metadata: dict | None = None) -> Path:
    """module's weights as the diffusion-model file load_diffusion_model_file loads, with the file's `metadata` where
    given (LTX-2's files hold their transformer's config there, which ComfyUI's detection reads)."""
    import safetensors.torch

    path = folder / "diffusion_model.safetensors"
    safetensors.torch.save_file({k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()},
                                str(path), metadata=metadata)
    return path


# The forms of quantized diffusion-model files ComfyUI reads, as published files lay them out (comfy.utils's
# convert_old_quants and detect_layer_quantization, comfy.ops's _load_quantized_module):
# - "scaled_fp8": the "fp8_scaled" files (Comfy-Org's repackaged Wan 2.1, wan2.1_t2v_14B_fp8_scaled): every Linear
#   weight in e4m3 with a float32 per-tensor `scale_weight`, and a `scaled_fp8` key that marks the file. ComfyUI 0.3.6x
#   loads them into its scaled-fp8 layers; 0.33 converts them into its mixed-precision layers (comfy-kitchen
#   QuantizedTensors).
# - "comfy_quant": 0.33's mixed-precision files: each quantized layer's format in a `comfy_quant` entry (JSON bytes)
#   beside its weight and the weight's per-tensor `weight_scale`; the other layers stay 16-bit.
# - "quantization_metadata": the same with the layers' formats in the file's `_quantization_metadata` header instead.
QUANTIZED_FORMS = ("scaled_fp8", "comfy_quant", "quantization_metadata")
# The ComfyUI model class of each tiny_dit family, whose unet_config the model detection matches a file against
DIT_CLASSES = {"flux": "Flux", "chroma": "Chroma", "sd3": "SD3", "wan": "WAN21_T2V", "qwen-image": "QwenImage",
               "z-image": "ZImage", "hunyuan-video": "HunyuanVideo15", "ltx2": "LTXAV"}


def tiny_name(family: str) -> str:
    """The tiny config (accel/models/configs.py) of a tiny_dit family: tiny-<family>, or the one version of it the
    pack accelerates (HunyuanVideo 1.5)."""
    return {"hunyuan-video": "tiny-hunyuan-video15"}.get(family, f"tiny-{family}")


def reads_quantized_form(form: str) -> str | None:
    """Why the ComfyUI tree the tests run in cannot read quantized files of this form, or None where it can."""
    if form != "scaled_fp8" and not (comfy_root() / "comfy" / "quant_ops.py").is_file():
        return f"ComfyUI {comfy_version()} has no mixed-precision checkpoints (comfy/quant_ops.py, 0.33 and later)"
    return None


def tiny_dit_weights(family: str, seed: int = 0):
    """The diffusion model of tiny_dit(family) on the CPU, for writing as a file. Its blocks' residual and modulation
    projections are seeded louder than tiny_dit's, so that what the blocks add (their projections, a LoRA on them)
    shows in the latents of a short sampling run."""
    import comfy.supported_models

    from sd_accel.accel.models import configs

    _, cfg = configs.comfy_dit_config(tiny_name(family))
    config = getattr(comfy.supported_models, DIT_CLASSES[family])(dict(cfg))
    config.unet_config.update(cfg)
    with layers_with_weights():
        model = config.get_model({}, device="cpu")
    return configs.seed_dit_parameters(model.diffusion_model, seed, quiet=0.5).requires_grad_(False)


@contextlib.contextmanager
def detected_as(cls_name: str, config: dict, identify: dict | None = None):
    """Within: ComfyUI's model detection gives a file it takes for a model of supported_models.<cls_name> the unet
    config `config` (a tiny model's). It reads a published model's widths (heads, text width, ...) from constants or
    from head sizes of 128, which a tiny file does not fit; its loader does all else as it does for any file (the
    model class, its dtypes, layers and quantized weights). identify: the detected entries that make a file such a
    model (the class's unet_config where not given); where the class itself would not match the tiny config (Z-Image:
    a Lumina 2 file 3840 wide), the tiny config gets the class too."""
    import comfy.model_detection as md
    import comfy.supported_models

    own, own_config = md.detect_unet_config, md.model_config_from_unet_config
    cls = getattr(comfy.supported_models, cls_name)
    tiny = {**cls.unet_config, **config}
    identify = cls.unet_config if identify is None else identify

    def detect(state_dict, key_prefix, *args, **kwargs):
        found = own(state_dict, key_prefix, *args, **kwargs)
        if found is not None and all(found.get(k) == v for k, v in identify.items()):
            return dict(tiny)
        return found

    def config_of(unet_config, *args, **kwargs):
        if unet_config == tiny and not all(tiny.get(k) == v for k, v in cls.unet_config.items()):
            return cls(dict(unet_config))
        return own_config(unet_config, *args, **kwargs)

    md.detect_unet_config, md.model_config_from_unet_config = detect, config_of
    try:
        yield
    finally:
        md.detect_unet_config, md.model_config_from_unet_config = own, own_config


def quantize_per_tensor(w, fmt: str):
    """(stored weight, float32 per-tensor scale) of w in format `fmt`: weight = stored * scale."""
    import torch

    top = {"float8_e4m3fn": 448.0, "int8_tensorwise": 127.0}[fmt]
    scale = (w.float().abs().amax() / top).reshape(())
    q = w.float() / scale
    return (q.to(torch.float8_e4m3fn) if fmt == "float8_e4m3fn" else q.round().clamp(-127, 127).to(torch.int8)), scale


def write_quantized_file(module, folder: Path, form: str, layers=None, dtype=None, metadata: dict | None = None) -> Path:
    """module's weights written as a quantized diffusion-model file of `form` (QUANTIZED_FORMS), as published ones are
    laid out: the Linear layers `layers(name)` gives a format for ("float8_e4m3fn", "int8_tensorwise"; None: 16-bit)
    stored in it with their per-tensor scales, every other tensor in `dtype` (bfloat16 where not given). "scaled_fp8"
    files quantize every Linear weight to e4m3 (ComfyUI 0.3.6x loads every Linear of such a file in fp8). metadata: the
    file's other metadata (write_diffusion_model_file)."""
    import json

    import safetensors.torch
    import torch

    dtype = dtype or torch.bfloat16
    every = layers is None or form == "scaled_fp8"
    out, formats = {}, {}
    for key, t in module.state_dict().items():
        t = t.detach().contiguous().cpu()
        name = key[: -len(".weight")]
        fmt = ("float8_e4m3fn" if every else layers(name)) if key.endswith(".weight") and t.dim() == 2 else None
        if fmt is None:
            out[key] = t.to(dtype) if t.is_floating_point() else t
            continue
        out[key], scale = quantize_per_tensor(t, fmt)
        out[f"{name}.scale_weight" if form == "scaled_fp8" else f"{name}.weight_scale"] = scale
        formats[name] = {"format": fmt}
        if form == "comfy_quant":
            out[f"{name}.comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)
    metadata = dict(metadata or {})
    if form == "scaled_fp8":
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    elif form == "quantization_metadata":
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": formats})
    path = folder / f"diffusion_model_{form}.safetensors"
    safetensors.torch.save_file(out, str(path), metadata=metadata or None)
    return path


@contextlib.contextmanager
def dtypes_of_a_bf16_gpu():
    """Within: ComfyUI chooses a model's dtypes on the CPU as it does on a GPU with bfloat16 (an NVIDIA one from
    Ampere on), where it otherwise computes in float32: what a loader run inside builds is the model a user's GPU
    gets (Flux: bfloat16 weights and computation, its quantized layers computing in bfloat16), on the CPU."""
    import comfy.model_management as mm

    own = mm.should_use_bf16
    mm.should_use_bf16 = lambda *args, **kwargs: True
    try:
        yield
    finally:
        mm.should_use_bf16 = own


def load_pack():
    """The repository imported the way ComfyUI imports a custom node folder: a package named after the folder."""
    if PACK_NAME in sys.modules:
        return sys.modules[PACK_NAME]
    spec = importlib.util.spec_from_file_location(PACK_NAME, REPO / "__init__.py",
                                                  submodule_search_locations=[str(REPO)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK_NAME] = module
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------- tiny models

def rel(a, b) -> float:
    """Relative L2 distance of a from b, in float64 on the CPU (so that the measure adds no rounding of its own)."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def same(a, b, tol: float = 1e-2) -> bool:
    """Exact on the CPU, where the torch path runs the plain model's kernels; on a GPU, where it runs fused
    kernels, channels_last and CUDA graphs, within `tol` relative L2."""
    import torch

    if not torch.cuda.is_available():
        return torch.equal(a, b)
    return rel(a, b) <= tol


def tiny_model(seed: int = 0, xl: bool = False, weight_dtype=None):
    """A ModelPatcher around ComfyUI's own BaseModel / SDXL with a tiny UNet of the SD1.5 / SDXL layout; weights
    stored in weight_dtype (torch.float8_e4m3fn: ComfyUI's fp8_e4m3fn weight dtype, with the manual-cast dtype its
    loader picks for this device)."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models

    from sd_accel.accel.models import configs

    config = comfy.supported_models.SDXL(dict(TINY_SDXL)) if xl else comfy.supported_models.SD15(dict(TINY_SD15))
    config.unet_config.update(TINY_SDXL if xl else TINY_SD15)  # the classes add their own head counts
    if weight_dtype is not None:
        config.set_inference_dtype(weight_dtype, mm.unet_manual_cast(weight_dtype, mm.get_torch_device(),
                                                                     config.supported_inference_dtypes))
    model = config.get_model({})
    configs.seed_parameters(model.diffusion_model, seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


def tiny_dit(family: str = "flux", seed: int = 0):
    """A ModelPatcher around ComfyUI's own Flux / Chroma / SD3 model with a tiny transformer of that layout
    (models/configs.py tiny-flux, tiny-chroma, tiny-sd3: ComfyUI's own classes, 16 latent channels)."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models

    from sd_accel.accel.models import configs

    _, cfg = configs.comfy_dit_config(tiny_name(family))
    config = getattr(comfy.supported_models, DIT_CLASSES[family])(dict(cfg))
    config.unet_config.update(cfg)
    model = config.get_model({})
    configs.seed_dit_parameters(model.diffusion_model, seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


def tiny_dit_conditioning(family: str = "flux", seed: int = 0, tokens: int = 7):
    """(positive, negative) CONDITIONING for tiny_dit: text tokens and the pooled embedding (Flux: with guidance;
    Chroma: none, as its T5 encoder gives)."""
    import torch

    from sd_accel.accel.models import configs

    _, cfg = configs.COMFY_DIT_CONFIGS[tiny_name(family)]
    ctx = (cfg.get("context_in_dim") or cfg.get("text_dim") or cfg.get("joint_attention_dim")
           or cfg.get("cap_feat_dim") or cfg["context_embedder_config"]["params"]["in_features"])
    pooled = {"flux": cfg.get("vec_in_dim"), "sd3": cfg.get("adm_in_channels")}.get(family)
    g = torch.Generator().manual_seed(seed)

    def cond(scale):
        extra = {"pooled_output": torch.randn(1, pooled, generator=g) * scale if pooled else None}
        if family == "flux":
            extra["guidance"] = 3.5
        return [[torch.randn(1, tokens, ctx, generator=g) * scale, extra]]

    return cond(1.0), cond(0.5)


def sample_frames(model, positive, negative, frames, steps=2, size=8, seed=1, cfg=3.0):
    """comfy.sample.sample on (batch, 16, frames, h, w) latents: Wan's video latents, and Qwen-Image's one frame (the
    KSampler node makes its 4-D latent 5-D for models whose latent format has 3 dimensions)."""
    import torch

    import comfy.sample

    shape = (1, 16, frames, size, size)
    noise = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", positive, negative, torch.zeros(shape),
                               disable_pbar=True, seed=seed)


def tiny_flux_controlnet(seed: int = 0):
    """A ComfyUI Flux ControlNet (XLabs layout: image hint) whose blocks match tiny_dit("flux"), seeded."""
    import comfy.controlnet
    import comfy.ldm.flux.controlnet
    import comfy.model_management as mm
    import comfy.ops

    from sd_accel.accel.models import configs

    _, cfg = configs.comfy_dit_config("tiny-flux")
    control = comfy.ldm.flux.controlnet.ControlNetFlux(operations=comfy.ops.disable_weight_init,
                                                       **{**cfg, "depth_single_blocks": 0})
    configs.seed_dit_parameters(control, seed)
    return comfy.controlnet.ControlNet(control, load_device=mm.get_torch_device(), extra_conds=["y", "guidance"])


def tiny_vae(seed: int = 0, channels: int = 4):
    """ComfyUI's VAE around a tiny KL autoencoder of the SD layout (8x downscale); channels=16: the latent width of
    Flux's and SD3's VAEs."""
    import torch

    import comfy.ldm.models.autoencoder
    import comfy.sd

    from sd_accel.accel.models import configs

    ddconfig = {**TINY_VAE, "z_channels": channels}
    module = comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig=ddconfig, embed_dim=channels)
    configs.seed_parameters(module, seed)
    return comfy.sd.VAE(sd=module.state_dict(), config={"params": {"ddconfig": ddconfig, "embed_dim": channels}},
                        dtype=torch.float32)


def tiny_wan_vae(seed: int = 0):
    """ComfyUI's VAE as it loads a Wan 2.1 VAE, around a model of the same layout at width 4 (tiny-wan21).

    ComfyUI 0.33 builds the Wan 2.1 VAE at the width its file's weights have: it loads the tiny model's weights as a
    user's file. Earlier ComfyUIs recognise it by one key and build it at the published width: the VAE they return is
    kept as it is (latent format, output processing, devices) and only its model, and the patcher that loads it,
    are the tiny one."""
    import torch

    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.sd

    from sd_accel.accel.models import configs

    tiny = configs.build_comfy_video_vae("tiny-wan21", comfy_root(), seed)
    try:
        return comfy.sd.VAE(sd=tiny.state_dict(), dtype=torch.float32)
    except RuntimeError:  # the published width's shapes do not take the tiny weights
        pass
    vae = comfy.sd.VAE(sd={"decoder.middle.0.residual.0.gamma": torch.ones(384, 1, 1, 1)}, dtype=torch.float32)
    vae.first_stage_model = tiny
    vae.patcher = comfy.model_patcher.ModelPatcher(vae.first_stage_model, load_device=vae.device,
                                                   offload_device=mm.vae_offload_device())
    return vae


def tiny_conditioning(seed: int = 0, xl: bool = False, tokens: int = 77):
    """(positive, negative) CONDITIONING lists in ComfyUI's format, seeded."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dim = 2048 if xl else 768

    def cond(scale):
        extra = {"pooled_output": torch.randn(1, 1280, generator=g) * scale} if xl else {}
        return [[torch.randn(1, tokens, dim, generator=g) * scale, extra]]

    return cond(1.0), cond(0.5)


def tiny_controlnet(seed: int = 0, xl: bool = False):
    """A ComfyUI ControlNet (CONTROL_NET) whose control model matches the tiny UNet, seeded."""
    import comfy.cldm.cldm
    import comfy.controlnet
    import comfy.model_management as mm
    import comfy.ops

    from sd_accel.accel.models import configs

    unet_only = ("out_channels", "transformer_depth_output", "use_temporal_attention", "use_temporal_resblock")
    config = {k: v for k, v in (TINY_SDXL if xl else TINY_SD15).items() if k not in unet_only}
    control = comfy.cldm.cldm.ControlNet(hint_channels=3, operations=comfy.ops.disable_weight_init, **config)
    configs.seed_parameters(control, seed)
    return comfy.controlnet.ControlNet(control, load_device=mm.get_torch_device())


def put_comfy_attention(fn, put=setattr) -> None:
    """fn where ComfyUI's start-up puts the attention function its flags choose for the whole host
    (--use-split-cross-attention, --use-sage-attention): attention.py's optimized_attention and
    optimized_attention_masked, and every model module that imported one of them by name (Flux's math, MMDiT, Wan,
    Qwen-Image, Lumina/Z-Image, ...). The model modules are imported first, as ComfyUI's start-up has them before it
    chooses: one imported later would keep the function of the moment, stale once a test puts the old one back.
    put(module, name, value) sets each (monkeypatch.setattr to have them back after a test)."""
    import comfy.ldm.modules.attention as attention
    import comfy.model_base  # noqa: F401 (imports every model module ComfyUI's loaders build)

    names = ("optimized_attention", "optimized_attention_masked")
    current = {id(getattr(attention, n)) for n in names}
    current |= {id(f) for f in getattr(attention, "REGISTERED_ATTENTION_FUNCTIONS", {}).values()}
    for module in [attention] + [m for name, m in sorted(sys.modules.items())
                                 if name.startswith("comfy.ldm.") and m is not None and m is not attention]:
        for attr in names:
            if id(getattr(module, attr, None)) in current or module is attention:
                put(module, attr, fn)


def use_comfy_attention(name: str, put=setattr) -> list:
    """ComfyUI's attention function `name` (its registry's name: "pytorch", "split", "sub_quad", "sage", ...) as the
    choice for the whole host (put_comfy_attention). Returns the calls of the chosen function, appended as they come:
    the function in ComfyUI's registry and module is a counting copy of its own (same name and module), which ComfyUI
    takes for the same choice."""
    import functools

    import comfy.ldm.modules.attention as attention

    own = attention.get_attention_function(name)
    calls = []

    @functools.wraps(own)
    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return own(*args, **kwargs)

    put(attention, "REGISTERED_ATTENTION_FUNCTIONS", {**attention.REGISTERED_ATTENTION_FUNCTIONS, name: counted})
    put(attention, own.__name__, counted)
    put_comfy_attention(counted, put)
    return calls


def attention_override() -> tuple:
    """A model patch's optimized_attention_override (in transformer_options), which hands each call on to the
    attention function ComfyUI gives it, and the list of those functions, appended as they come."""
    given = []

    def override(fn, *args, **kwargs):
        given.append(fn)
        return fn(*args, **kwargs)

    return override, given


def counted_sdpa(put=setattr) -> list:
    """The fused DiT blocks' own attention (transformer.sdpa) counted: the q shape of each call, appended as they
    come. put as put_comfy_attention's."""
    from sd_accel.accel.engine.fusions import transformer

    calls = []
    put(transformer, "sdpa", lambda *a, f=transformer.sdpa: calls.append(a[0].shape) or f(*a))
    return calls


def step_attention_patch(model, strength: float = 0.3):
    """A clone with an attn2 replace patch on every cross-attention whose effect changes with the step: its
    output is the usual attention scaled by 1 + strength * sigma / (1 + sigma), read from transformer_options
    each call (as IPAdapter-style nodes read theirs)."""
    from comfy.ldm.modules.attention import optimized_attention

    def attn2(q, k, v, extra_options):
        sigma = float(extra_options["sigmas"].max())
        return optimized_attention(q, k, v, extra_options["n_heads"]) * (1 + strength * sigma / (1 + sigma))

    patched = model.clone()
    for block, index in (("input", 1), ("input", 2), ("output", 0), ("output", 1), ("output", 2), ("output", 3)):
        for t in range(2):
            patched.set_model_attn2_replace(attn2, block, index, t)
    patched.set_model_attn2_replace(attn2, "middle", 0, 0)
    return patched


def lora_patches(model, seed: int = 3, rank: int = 4, take=None) -> dict:
    """A seeded LoRA in ComfyUI's file format (lora_unet_* keys) for the 2-D weights `take(key)` chooses; by default
    every attention projection of the tiny UNet."""
    import torch

    take = take or (lambda key: ".attn1." in key or ".attn2." in key)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for key, w in model.model.diffusion_model.state_dict().items():
        if w.ndim == 2 and take(key) and key.endswith(".weight"):
            name = "lora_unet_" + key[: -len(".weight")].replace(".", "_")
            sd[f"{name}.lora_up.weight"] = torch.randn(w.shape[0], rank, generator=g) * 0.2
            sd[f"{name}.lora_down.weight"] = torch.randn(rank, w.shape[1], generator=g) * 0.2
            sd[f"{name}.alpha"] = torch.tensor(float(rank))
    return sd


# ------------------------------------------------------------------------------------ test-only nodes

class SDAccelTestTinySD:
    """The tiny SD1.5-layout model, VAE and conditioning, seeded, for workflows in tests."""

    CATEGORY = "sd-accel/testing"
    RETURN_TYPES = ("MODEL", "VAE", "CONDITIONING", "CONDITIONING")
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31})}}

    def build(self, seed):
        pos, neg = tiny_conditioning(seed + 2)
        return tiny_model(seed), tiny_vae(seed + 1), pos, neg


class SDAccelTestTinyWan:
    """The tiny Wan 2.1 text-to-video model (ComfyUI's WanModel, tiny_dit("wan")) and its conditioning, seeded."""

    CATEGORY = "sd-accel/testing"
    RETURN_TYPES = ("MODEL", "CONDITIONING", "CONDITIONING")
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31})}}

    def build(self, seed):
        pos, neg = tiny_dit_conditioning("wan", seed + 1)
        return tiny_dit("wan", seed), pos, neg


class SDAccelTestControlNet:
    CATEGORY = "sd-accel/testing"
    RETURN_TYPES = ("CONTROL_NET",)
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31})}}

    def build(self, seed):
        return (tiny_controlnet(seed),)


class SDAccelTestStepAttention:
    CATEGORY = "sd-accel/testing"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "strength": ("FLOAT", {"default": 0.3})}}

    def patch(self, model, strength):
        return (step_attention_patch(model, strength),)


NODE_CLASS_MAPPINGS = {
    "SDAccelTestTinySD": SDAccelTestTinySD,
    "SDAccelTestTinyWan": SDAccelTestTinyWan,
    "SDAccelTestControlNet": SDAccelTestControlNet,
    "SDAccelTestStepAttention": SDAccelTestStepAttention,
}


# -------------------------------------------------------------------------------------- headless server
