"""GPU detection: vendor, architecture family and capabilities, from tables. Never raises.

`detect()` reads the device through torch; `info_from_properties()` does the table work on a
properties object (torch's, or a fake one in tests), so every family can be checked on a CPU machine.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping


@dataclass(frozen=True)
class GpuInfo:
    vendor: str  # nvidia | amd | intel | apple | cpu | unknown
    family: str  # turing ampere ada hopper blackwell rdna2 rdna3 rdna4 cdna1 cdna2 cdna3 xpu mps cpu unknown
    name: str = ""
    arch: str = ""  # "sm_90", "gfx942", ...
    device: str = "cpu"  # torch device string
    vram_bytes: int = 0
    dtypes: tuple[str, ...] = ("float32",)
    attention: tuple[str, ...] = ("math",)  # preferred attention kernels, best first
    graphs: bool = False  # CUDA / HIP graphs usable
    triton: bool = False  # Triton kernels can run here
    driver: str = ""
    known: bool = True
    notes: tuple[str, ...] = field(default_factory=tuple)


# NVIDIA compute capability -> family. A (major, None) entry covers every minor version of that major.
NVIDIA_FAMILIES: dict[tuple[int, int | None], str] = {
    (7, 5): "turing",
    (8, 0): "ampere", (8, 6): "ampere", (8, 7): "ampere",
    (8, 9): "ada",
    (9, 0): "hopper",
    (10, None): "blackwell",
    (11, None): "blackwell",  # Jetson Thor: sm_101 was renumbered sm_110 in CUDA 13
    (12, None): "blackwell",
}

# AMD gcnArchName (feature suffixes stripped) -> family.
AMD_FAMILIES: dict[str, str] = {
    "gfx908": "cdna1",
    "gfx90a": "cdna2",
    "gfx940": "cdna3", "gfx941": "cdna3", "gfx942": "cdna3",
    "gfx950": "cdna3",  # MI350 (marketed as CDNA 4) takes the CDNA3 path here
    **{f"gfx103{i}": "rdna2" for i in range(7)},
    **{f"gfx110{i}": "rdna3" for i in range(4)},
    **{f"gfx115{i}": "rdna3" for i in range(4)},  # RDNA 3.5 APUs (Strix, Krackan)
    "gfx1200": "rdna4", "gfx1201": "rdna4",
}

# What each family can do. attention: kernels best first, before filtering by installed packages, the torch
# version and (ROCm) the experimental switch. aotriton_experimental: PyTorch's flash / mem-efficient SDPA on
# this ROCm arch are only enabled with TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1.
_NV_SDPA = ("flash", "efficient", "math")
FAMILY_TRAITS: dict[str, dict[str, Any]] = {
    "turing": dict(bf16=False, attention=("efficient", "math"), triton=True),
    "ampere": dict(bf16=True, attention=("flash_attn",) + _NV_SDPA, triton=True),
    "ada": dict(bf16=True, attention=("flash_attn",) + _NV_SDPA, triton=True),
    # cuDNN's fused attention is the fastest SDPA kernel on Hopper and Blackwell.
    "hopper": dict(bf16=True, attention=("cudnn", "flash_attn") + _NV_SDPA, triton=True),
    "blackwell": dict(bf16=True, attention=("cudnn", "flash_attn") + _NV_SDPA, triton=True),
    # gfx908 has bf16 matrix cores but no AOTriton/CK attention kernels in PyTorch.
    "cdna1": dict(bf16=True, attention=("math",), triton=True),
    "cdna2": dict(bf16=True, attention=("flash_attn",) + _NV_SDPA, triton=True),
    "cdna3": dict(bf16=True, attention=("flash_attn",) + _NV_SDPA, triton=True),
    "rdna2": dict(bf16=False, attention=("math",), triton=False),
    "rdna3": dict(bf16=True, attention=_NV_SDPA, triton=True, aotriton_experimental=True),
    "rdna4": dict(bf16=True, attention=_NV_SDPA, triton=True, aotriton_experimental=True),
}

# Unrecognised GPUs get the generic path: SDPA picks its own kernel, no Triton.
_GENERIC_NVIDIA = dict(attention=("efficient", "math"), triton=False)
_GENERIC_AMD = dict(bf16=False, attention=("math",), triton=False)

AOTRITON_ENV = "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL"


def has_package(name: str) -> bool:
    """Whether a package is importable, without importing it. A namespace package (a folder without __init__.py)
    does not count: flash-attn-4 installs flash_attn/cute/ alone, which leaves `flash_attn` a namespace without
    FlashAttention-2's functions."""
    spec = _spec(name)
    return spec is not None and spec.origin not in (None, "namespace")


def has_subpackage(package: str, name: str) -> bool:
    """Whether `package`.`name` is an importable package, without importing `package` (FlashAttention-2's
    __init__ loads its CUDA extension)."""
    spec = _spec(package)
    return spec is not None and any((Path(p) / name / "__init__.py").is_file()
                                    for p in spec.submodule_search_locations or ())


def _spec(name: str) -> "importlib.machinery.ModuleSpec | None":
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _torch_version() -> tuple[int, int]:
    import torch

    return _parse_version(torch.__version__)


def _parse_version(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _nvidia_family(major: int, minor: int) -> str | None:
    return NVIDIA_FAMILIES.get((major, minor)) or NVIDIA_FAMILIES.get((major, None))


def amd_arch(gcn_arch_name: str) -> str:
    """"gfx90a:sramecc+:xnack-" -> "gfx90a"."""
    return gcn_arch_name.split(":")[0].strip().lower()


def _unknown(device: str, note: str, vendor: str = "unknown") -> GpuInfo:
    return GpuInfo(vendor, "unknown", device=device, known=False, notes=(note,))


def info_from_properties(props: Any, backend: str = "cuda", index: int = 0, torch_version: str | None = None,
                         packages: Mapping[str, bool] | None = None, env: Mapping[str, str] | None = None,
                         driver: str = "") -> GpuInfo:
    """GpuInfo for a device described by `props` (torch's device properties or anything with the same fields:
    name, total_memory, and major/minor on NVIDIA, gcnArchName on AMD, has_fp16/has_bf16 on Intel XPU).

    backend: "cuda" (NVIDIA), "hip" (AMD ROCm) or "xpu" (Intel). packages: {"triton": bool, "flash_attn": bool},
    probed when not given. env: the environment, os.environ when not given. Never raises."""
    prefix = "xpu" if backend == "xpu" else "cuda"
    device = f"{prefix}:{index}"
    try:
        packages = packages if packages is not None else {"triton": has_package("triton"), "flash_attn": has_package("flash_attn")}
        env = env if env is not None else os.environ
        version = _parse_version(torch_version) if torch_version is not None else _torch_version()
        if backend == "cuda":
            return _nvidia(props, device, version, packages, driver)
        if backend == "hip":
            return _amd(props, device, version, packages, env, driver)
        if backend == "xpu":
            return _intel(props, device, driver)
        return _unknown(device, f"unknown device backend {backend!r}; running the generic torch path.")
    except Exception as e:  # detection must never stop the host from starting
        return _unknown(device, f"could not read the GPU's properties ({type(e).__name__}: {e}); "
                                "running the generic torch path.")


def _filter_attention(kernels: tuple[str, ...], packages: Mapping[str, bool], version: tuple[int, int]) -> tuple[str, ...]:
    keep = []
    for k in kernels:
        if k == "flash_attn" and not packages.get("flash_attn"):
            continue
        if k == "cudnn" and version < (2, 5):  # PyTorch's cuDNN attention arrived in 2.5
            continue
        keep.append(k)
    return tuple(keep)


def _nvidia(props: Any, device: str, version: tuple[int, int], packages: Mapping[str, bool], driver: str) -> GpuInfo:
    major, minor = int(props.major), int(props.minor)
    family = _nvidia_family(major, minor)
    notes: list[str] = []
    if family is None:
        when = "older" if (major, minor) < (7, 5) else "newer"
        notes.append(f"compute capability {major}.{minor} is {when} than the GPUs sd-accel is tuned for "
                     "(Turing 7.5 to Blackwell 12.x); running the generic torch path.")
        traits = dict(_GENERIC_NVIDIA, bf16=major >= 8)
    else:
        traits = FAMILY_TRAITS[family]
    dtypes = ("float16",) if (major, minor) >= (5, 3) else ()
    dtypes += ("bfloat16",) if traits["bf16"] else ()
    return GpuInfo(
        vendor="nvidia", family=family or "unknown", name=str(props.name), arch=f"sm_{major}{minor}", device=device,
        vram_bytes=int(props.total_memory), dtypes=dtypes + ("float32",),
        attention=_filter_attention(traits["attention"], packages, version),
        graphs=True, triton=bool(traits["triton"] and packages.get("triton")), driver=driver,
        known=family is not None, notes=tuple(notes))


def _amd(props: Any, device: str, version: tuple[int, int], packages: Mapping[str, bool], env: Mapping[str, str],
         driver: str) -> GpuInfo:
    arch = amd_arch(str(props.gcnArchName))
    family = AMD_FAMILIES.get(arch)
    notes: list[str] = []
    if family is None:
        notes.append(f"AMD architecture {arch} is not one sd-accel is tuned for (RDNA2-4, CDNA1-3); "
                     "running the generic torch path.")
        traits = _GENERIC_AMD
    else:
        traits = FAMILY_TRAITS[family]
    attention = _filter_attention(traits["attention"], packages, version)
    if traits.get("aotriton_experimental"):
        if env.get(AOTRITON_ENV) == "1":
            notes.append(f"PyTorch's flash attention on {arch} is experimental ({AOTRITON_ENV}=1 is set).")
        else:
            attention = ("math",)
            notes.append(f"PyTorch's flash attention on {arch} is experimental and off; set {AOTRITON_ENV}=1 "
                         "before starting to turn it on (faster, less tested).")
    dtypes = ("float16",) + (("bfloat16",) if traits["bf16"] else ()) + ("float32",)
    return GpuInfo(
        vendor="amd", family=family or "unknown", name=str(props.name), arch=arch, device=device,
        vram_bytes=int(props.total_memory), dtypes=dtypes, attention=attention, graphs=True,
        triton=bool(traits["triton"] and packages.get("triton")), driver=driver, known=family is not None,
        notes=tuple(notes))


def _intel(props: Any, device: str, driver: str) -> GpuInfo:
    dtypes = (("float16",) if getattr(props, "has_fp16", True) else ()) \
        + (("bfloat16",) if getattr(props, "has_bf16", False) else ()) + ("float32",)
    return GpuInfo(vendor="intel", family="xpu", name=str(props.name), arch=str(getattr(props, "arch", "") or "xpu"),
                   device=device, vram_bytes=int(props.total_memory), dtypes=dtypes, attention=("math",),
                   driver=driver or str(getattr(props, "driver_version", "")),
                   notes=("Intel XPU: SDPA picks its own (oneDNN) attention kernel.",))


def _cuda_driver(torch_module: Any) -> str:
    if torch_module.version.hip:
        text = f"hip {torch_module.version.hip}"
    else:
        text = f"cuda {torch_module.version.cuda}"
    get = getattr(torch_module._C, "_cuda_getDriverVersion", None)
    if get is not None:
        try:
            v = int(get())  # e.g. 13000 for 13.0
            text += f", driver api {v // 1000}.{(v % 1000) // 10}"
        except Exception:
            pass  # the driver version only sharpens the cache key; the runtime version is enough without it
    return text


def detect(index: int = 0) -> GpuInfo:
    """The GPU torch would use at `index` (NVIDIA or AMD through torch.cuda, Intel XPU, Apple MPS), or the CPU.
    Never raises: anything unexpected gives a GpuInfo of vendor "unknown" with a note saying what happened."""
    try:
        import torch
    except Exception as e:
        return _unknown("cpu", f"torch could not be imported ({e}).")
    try:
        if torch.cuda.is_available():
            backend = "hip" if torch.version.hip else "cuda"
            count = torch.cuda.device_count()
            if not 0 <= index < count:
                return _unknown(f"cuda:{index}", f"there is no GPU {index}: torch sees {count}. Pick one from 0 to {count - 1}.")
            return info_from_properties(torch.cuda.get_device_properties(index), backend, index,
                                        driver=_cuda_driver(torch))
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and xpu.is_available():
            from types import SimpleNamespace

            p = xpu.get_device_properties(index)
            props = SimpleNamespace(name=p.name, total_memory=p.total_memory, has_fp16=getattr(p, "has_fp16", True),
                                    has_bf16=bool(xpu.is_bf16_supported()),
                                    driver_version=getattr(p, "driver_version", ""))
            return info_from_properties(props, "xpu", index)
        if torch.backends.mps.is_available():
            return _mps(torch)
    except Exception as e:
        return _unknown(f"cuda:{index}", f"GPU detection failed ({type(e).__name__}: {e}); running the generic torch path.")
    return cpu_info()


def _mps(torch_module: Any) -> GpuInfo:
    import platform

    vram = 0
    try:
        vram = int(torch_module.mps.recommended_max_memory())  # torch >= 2.5
    except Exception:
        pass  # unified memory: the figure is advisory only
    return GpuInfo(vendor="apple", family="mps", name=f"Apple {platform.machine()} GPU (MPS)", arch="mps",
                   device="mps", vram_bytes=vram, dtypes=("float16", "float32"), attention=("math",))


def cpu_info() -> GpuInfo:
    import platform

    # Triton's interpreter (TRITON_INTERPRET=1, chosen before triton is imported) runs the kernels on the CPU, slowly:
    # the fused kernels can then be asked for, which is how the tests check them without a GPU.
    interpreter = os.environ.get("TRITON_INTERPRET") == "1" and has_package("triton")
    return GpuInfo(vendor="cpu", family="cpu", name=platform.processor() or platform.machine() or "CPU",
                   arch=platform.machine(), device="cpu", triton=interpreter,
                   notes=("no GPU found: the model runs on the CPU in float32, slowly.",))


_SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def describe(gpu: GpuInfo) -> str:
    """One line for the CLI and the UI."""
    if gpu.vendor == "cpu":
        return f"CPU ({gpu.name}): no GPU found; torch runs on the CPU in float32"
    what = gpu.family if gpu.known else "unrecognised architecture, generic path"
    parts = [f"{gpu.name or gpu.vendor} ({what}{', ' + gpu.arch if gpu.arch else ''})", gpu.device]
    if gpu.vram_bytes:
        parts.append(f"{gpu.vram_bytes / 2**30:.1f} GiB")
    parts.append("/".join(_SHORT_DTYPE.get(d, d) for d in gpu.dtypes))
    parts.append("attention " + ">".join(gpu.attention))
    parts.append(f"graphs {'yes' if gpu.graphs else 'no'}, triton {'yes' if gpu.triton else 'no'}")
    if gpu.driver:
        parts.append(gpu.driver)
    return ", ".join(parts)
