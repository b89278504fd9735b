"""Path policy: which backend and which options for this GPU and these installed packages, with the reasons
in words. Pure: it reads the GpuInfo, the package probe and SD_ACCEL_BACKEND, and never imports a backend.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import BadInput
from .device import GpuInfo, has_package, has_subpackage
from .options import ATTENTION, DTYPES, OrtOptions, TorchOptions, check_names, parse

ENV = "SD_ACCEL_BACKEND"
PREFERENCES = ("auto", "torch", "onnxruntime", "off")

# ONNX Runtime execution providers: the probe key for each, and which providers serve which vendor, best first.
ORT_PROVIDERS = {
    "ort_cuda": "CUDAExecutionProvider",
    "ort_rocm": "ROCMExecutionProvider",
    "ort_migraphx": "MIGraphXExecutionProvider",
    "ort_dml": "DmlExecutionProvider",
}
VENDOR_PROVIDERS = {
    "nvidia": ("ort_cuda", "ort_dml"),
    "amd": ("ort_migraphx", "ort_rocm", "ort_dml"),
    "intel": ("ort_dml",),
}
# The wheel that brings a GPU execution provider for each vendor.
ORT_WHEEL = {
    "cpu": "pip install onnxruntime",
    "nvidia": "pip install onnxruntime-gpu",
    "amd": "install AMD's onnxruntime-migraphx wheel (repo.radeon.com)",
    "intel": "pip install onnxruntime-directml (Windows)",
}

# Families with a tuned path (graphs, channels_last, Triton kernels); others get the generic torch options.
TUNED_VENDORS = ("nvidia", "amd")


@dataclass
class Plan:
    backend: str  # "torch" | "onnxruntime" | "off"
    torch: TorchOptions  # the torch path's options on this GPU: its own, or those of the fallback
    onnxruntime: OrtOptions | None = None  # when backend is onnxruntime
    dtype: str = "float32"  # what the GPU runs the model in
    reasons: list[str] = field(default_factory=list)
    fallback: str = "off"  # what serves a call this path cannot: "torch", or "off" for the plain model

    @property
    def options(self) -> TorchOptions | OrtOptions | None:
        """The chosen backend's options (None when acceleration is off)."""
        return {"torch": self.torch, "onnxruntime": self.onnxruntime}.get(self.backend)

    def summary(self) -> str:
        """A few lines for `doctor` and the nodes."""
        if self.backend == "off":
            return "\n".join(["backend: off (the plain model runs unchanged)"] + [f"- {r}" for r in self.reasons])
        t = self.torch
        flags = [f"attention {t.attention}", f"dtype {self.dtype}"]
        flags += [name for name in ("channels_last", "cuda_graphs", "compile", "triton_kernels") if getattr(t, name)]
        if self.onnxruntime is not None and self.backend == "onnxruntime":
            flags.append(f"provider {self.onnxruntime.provider}")
        # "falls back to the plain model" read as if the torch path went unused: say which calls the fallback serves.
        spare = "the torch path" if self.fallback == "torch" else "the plain model"
        lines = [f"backend: {self.backend} ({spare} serves any call it cannot)", "options: " + ", ".join(flags)]
        lines += [f"- {r}" for r in self.reasons]
        return "\n".join(lines)


def probe_packages() -> dict[str, bool]:
    """Which optional packages are installed, and which ONNX Runtime execution providers the installed build has.
    onnxruntime itself is imported only when it is installed (its import is what lists the providers)."""
    found = {name: has_package(name) for name in ("onnxruntime", "triton", "flash_attn")}
    found["cudnn_frontend"] = has_package("cudnn")  # nvidia-cudnn-frontend: fp8 attention (engine/fp8_attention.py)
    found["flash_attn_4"] = has_subpackage("flash_attn", "cute")  # flash-attn-4: the DiTs' attention (engine/flash4.py)
    found["fa3_fwd"] = has_package("fa3_fwd_interface")  # fa3-fwd: the DiTs' attention (engine/flash3.py)
    providers: list[str] = []
    if found["onnxruntime"]:
        try:
            import onnxruntime

            providers = list(onnxruntime.get_available_providers())
        except Exception:
            found["onnxruntime"] = False  # installed but broken: as good as absent
    for key, provider in ORT_PROVIDERS.items():
        found[key] = provider in providers
    found["onnxruntime_gpu"] = any(found[k] for k in ORT_PROVIDERS)
    return found


def check_preference(preference: str | None) -> str:
    """The backend preference (argument, else SD_ACCEL_BACKEND, else auto), normalised; BadInput when it names
    no backend. Commands call it before their slow work, so a typo is reported at once."""
    return _preference(preference)[0]


def _preference(preference: str | None) -> tuple[str, str]:
    """(preference, where it came from)."""
    source = "the preference given"
    if preference is None:
        preference, source = os.environ.get(ENV, ""), f"{ENV}"
    value = preference.strip().lower() or "auto"
    if value == "tensorrt":
        raise BadInput(f"{source} is {preference!r}: a TensorRT path is planned, but sd-accel has none yet.",
                       f"Use one of: {', '.join(PREFERENCES)}.")
    if value not in PREFERENCES:
        raise BadInput(f"{source} is {preference!r}, which is not a backend sd-accel knows.",
                       f"Use one of: {', '.join(PREFERENCES)}.")
    return value, source


def _what(gpu: GpuInfo) -> str:
    if gpu.vendor == "cpu":
        return "the CPU"
    if gpu.vendor == "apple":
        return "an Apple GPU (MPS)"
    return f"{gpu.name or 'a GPU'} ({gpu.vendor} {gpu.family})"


def _on(gpu: GpuInfo) -> str:
    """The device a reason names: on the CPU, GpuInfo.name is the processor (e.g. "x86_64"), which reads as a GPU."""
    return "the CPU" if gpu.vendor == "cpu" else gpu.name or gpu.family


def _tuned(gpu: GpuInfo) -> bool:
    return gpu.known and gpu.vendor in TUNED_VENDORS


def _ort_provider(gpu: GpuInfo, installed: dict[str, bool]) -> str | None:
    if gpu.vendor == "cpu":
        return "CPUExecutionProvider" if installed.get("onnxruntime") else None
    keys = VENDOR_PROVIDERS.get(gpu.vendor, ())
    for key in keys:
        if installed.get(key):
            return ORT_PROVIDERS[key]
    # A probe given without per-provider keys: trust "onnxruntime_gpu" and take the vendor's usual provider.
    if keys and installed.get("onnxruntime_gpu") and not any(k in installed for k in ORT_PROVIDERS):
        return ORT_PROVIDERS[keys[0]]
    return None


def _why_no_ort(gpu: GpuInfo, installed: dict[str, bool]) -> str:
    wheel = ORT_WHEEL.get(gpu.vendor)
    if wheel is None:
        return f"sd-accel has no ONNX Runtime execution provider for {_what(gpu)}; the torch path runs."
    if installed.get("onnxruntime"):
        return (f"the installed onnxruntime has no GPU execution provider for this {gpu.vendor} GPU (CPU build); "
                f"to use it, uninstall onnxruntime and {wheel}.")
    return f"onnxruntime is not installed; to use it, {wheel}."


def choose(gpu: GpuInfo, preference: str | None = None, installed: dict[str, bool] | None = None,
           options: Mapping[str, Any] | None = None) -> Plan:
    """The backend and options for `gpu`. preference: auto | torch | onnxruntime | off, from the argument, else
    SD_ACCEL_BACKEND, else auto (BadInput for anything else). options: any of accel.plan.options' names (BadInput
    for a name no backend takes). A preferred path that cannot run here gives the torch path with a reason saying
    what to install; it never raises for that."""
    pref, source = _preference(preference)
    asked = dict(options or {})
    check_names(asked)
    installed = probe_packages() if installed is None else installed
    reasons: list[str] = []
    if source == ENV and pref != "auto":
        reasons.append(f"{ENV}={pref} asked for the {pref} path.")

    if pref == "off":
        return Plan("off", TorchOptions(), reasons=reasons + ["acceleration is off: the plain model runs unchanged."])

    backend = "torch"
    provider = None
    ort_provider = _ort_provider(gpu, installed)
    if pref == "onnxruntime":
        if ort_provider is None:
            reasons.append(f"onnxruntime was asked for, but {_why_no_ort(gpu, installed)}")
        else:
            backend, provider = "onnxruntime", ort_provider
            reasons.append(f"onnxruntime was asked for and runs here with {ort_provider}.")
    elif pref == "auto":
        reasons.append("ONNX Runtime is not chosen automatically until it is measured faster than the torch path "
                       f"with graphs; set {ENV}=onnxruntime to use it" + (" (installed with " + ort_provider + ")."
                                                                           if ort_provider else "."))
    else:
        reasons.append("the torch path was asked for.")
    if backend == "torch":
        reasons.append(_torch_reason(gpu))

    dtype = _dtype(gpu, asked.pop("dtype", None), reasons)
    torch_options = _torch_options(gpu, installed, asked, reasons)
    ort_options = parse(OrtOptions, {"provider": provider, **asked})  # checked whichever path runs
    if backend != "onnxruntime":
        ort_options = None
    return Plan(backend, torch_options, ort_options, dtype, reasons, "off" if backend == "torch" else "torch")


def _torch_reason(gpu: GpuInfo) -> str:
    if _tuned(gpu):
        return f"the torch path runs with the kernels tuned for {gpu.vendor} {gpu.family}."
    if gpu.vendor in ("cpu", "apple", "intel"):
        where = "the CPU" if gpu.vendor == "cpu" else gpu.family
        return f"the torch path runs with generic options on {where} (no graphs, no Triton kernels)."
    return "this GPU's architecture is not recognised: the torch path runs with generic options."


def _torch_options(gpu: GpuInfo, installed: dict[str, bool], asked: dict, reasons: list[str]) -> TorchOptions:
    """The torch path's options: what this GPU supports, then what was asked for, where it can run."""
    tuned = _tuned(gpu)
    given = parse(TorchOptions, asked)
    can = {"channels_last": tuned, "cuda_graphs": tuned and gpu.graphs,
           "triton_kernels": gpu.triton and bool(installed.get("triton")), "cudnn_benchmark": tuned}
    # On where the GPU is tuned, except cuDNN's exhaustive search: it costs seconds at every new image size and found
    # no faster step than cuDNN's heuristics (BENCHMARKS.md, first call at a new image size), so only when asked.
    chosen = {name: able and tuned for name, able in can.items()} | {"cudnn_benchmark": False}
    for name in can:
        if name in asked:
            if given.__dict__[name] and not can[name]:
                reasons.append(f"{name} was asked for but is not available on {_on(gpu)}; it stays off.")
            chosen[name] = given.__dict__[name] and can[name]
    compile_ = given.compile
    if compile_ and gpu.vendor in TUNED_VENDORS and not installed.get("triton"):
        reasons.append("torch.compile was asked for but needs Triton on the GPU; pip install triton "
                       "(triton-windows on Windows). It stays off.")
        compile_ = False
    return dataclasses.replace(given, attention=_attention(gpu, installed, asked.get("attention"), reasons),
                               compile=compile_, **chosen)


def _attention(gpu: GpuInfo, installed: dict[str, bool], asked: str | None, reasons: list[str]) -> str:
    usable = [k for k in gpu.attention if k != "flash_attn" or installed.get("flash_attn")] or ["math"]
    if asked is None:
        return usable[0]
    if asked not in ATTENTION:
        raise BadInput(f"attention {asked!r} is not an attention kernel sd-accel knows.",
                       f"Use one of: {', '.join(ATTENTION)}.")
    if asked not in usable:
        hint = " (pip install flash-attn)" if asked == "flash_attn" and asked in gpu.attention else ""
        reasons.append(f"attention {asked} was asked for but cannot run on {_on(gpu)}{hint}; "
                       f"using {usable[0]}.")
        return usable[0]
    return asked


def _dtype(gpu: GpuInfo, asked: str | None, reasons: list[str]) -> str:
    if gpu.vendor == "cpu":
        default = "float32"
    else:
        default = "float16" if "float16" in gpu.dtypes else "float32"
        if default == "float32":
            reasons.append(f"{gpu.name or gpu.family} has no float16 support: the model runs in float32.")
    if asked is None:
        return default
    dtype = DTYPES.get(str(asked).lower().replace("torch.", ""))
    if dtype is None:
        raise BadInput(f"dtype {asked!r} is not one sd-accel runs.", "Use float16, bfloat16 or float32.")
    if dtype not in gpu.dtypes:
        reasons.append(f"{dtype} was asked for but {_on(gpu)} cannot run it; using {default}.")
        return default
    return dtype
