"""Install-time setup, run by ComfyUI-Manager and by A1111 (`python install.py` in this folder): detects the GPU,
installs the packages that fit it, and says what it did. It never breaks start-up: every problem becomes a line of
output, and the exit status is 0.

What it installs:
- the core requirements (requirements.txt) that are missing; A1111 does not read requirements.txt itself;
- Triton for the fused kernels of the torch path, where torch did not bring it (NVIDIA: triton on Linux,
  triton-windows on Windows; AMD ROCm builds of torch bring their own and a PyPI triton would not run there);
- on NVIDIA Hopper and Blackwell GPUs: nvidia-cudnn-frontend, for cuDNN's fp8 attention in the transformers under
  precision fp8 (or fp8 weights), without its dependencies: they are the CuTe DSL (nvidia-cutlass-dsl[cu13], with
  CUDA 13 libraries, hundreds of MB) and apache-tvm-ffi, which only its DSL kernels use; the graph API that runs the
  attention is in its compiled module and uses the cuDNN library torch brings;
- only when asked (--with onnxruntime, or SD_ACCEL_INSTALL=onnxruntime): the ONNX Runtime build for this GPU. It is
  not installed by default: ONNX Runtime is not chosen automatically until it is measured faster than the torch path.
  (A TensorRT path is planned; nothing installs TensorRT until that path exists.)
- only when asked (--with flash-attn-4), on Hopper and Blackwell GPUs under Linux: flash-attn-4, FlashAttention-4's
  kernels for the transformers' 16-bit attention (1.16-1.27x cuDNN's at SD3.5's, Qwen-Image's and Wan's shapes on an
  H200, even at Flux's), with the CuTe DSL for torch's CUDA (hundreds of MB of libraries, so not by default).
- only when asked (--with fa3-fwd), on Hopper GPUs under Linux with torch 2.10 or later built for CUDA 13: fa3-fwd,
  FlashAttention-3's forward kernels (bf16 and fp8), chosen where timed faster than cuDNN's fp8 attention and the
  16-bit kernels (4-12% over cuDNN's fp8 at Wan's, Qwen-Image's and SD3.5's shapes on an H200). It links libtorch and
  CUDA 13, so with another torch it is refused, saying which torch it needs.

No installed package is ever changed: every pip call is constrained to the version of every distribution installed
in this Python (the host's pins: A1111's transformers 4.30.2 and its huggingface_hub, ComfyUI's torch, ...), so pip
either adds what is missing beside them or refuses, and a package it refuses is skipped with pip's reason. --dry-run
asks pip the same question without installing.

    python install.py [--dry-run] [--with onnxruntime,flash-attn-4,fa3-fwd]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXTRAS = ("onnxruntime", "flash-attn-4", "fa3-fwd")
ENV_EXTRAS = "SD_ACCEL_INSTALL"
ENV_SKIP = "SD_ACCEL_SKIP_INSTALL"


@dataclass
class Step:
    packages: list[str]
    why: str
    options: list[str] = field(default_factory=list)  # pip install options


@dataclass
class InstallPlan:
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def say(line: str) -> None:
    print(f"[sd-accel] {line}", flush=True)


def _module_of(requirement: str) -> str:
    """The import name of a requirements.txt line (its distribution name; those in our file import as such)."""
    name = requirement.split(";")[0]
    for sep in "<>=!~[ ":
        name = name.split(sep)[0]
    return name.strip().replace("-", "_").lower()


def core_requirements() -> list[str]:
    lines = (HERE / "requirements.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def plan_installs(vendor: str, system: str, installed: dict[str, bool], extras: set[str],
                  requirements: list[str], family: str = "", cuda: int = 0, torch_version: str = "") -> InstallPlan:
    """What to install for a GPU of `vendor` (nvidia, amd, intel, apple, cpu, unknown) and `family` (plan/device.py:
    hopper, blackwell, ...) on `system` (Linux, Windows, Darwin) with torch `torch_version` built for CUDA `cuda`
    (major version, 0: none), given which import names are installed (and cudnn_frontend, flash_attn_4, fa3_fwd:
    policy.probe_packages). Pure, for tests and --dry-run."""
    plan = InstallPlan()
    missing = [r for r in requirements if not installed.get(_module_of(r), False)]
    if missing:
        plan.steps.append(Step(missing, "core requirements of sd-accel"))
    if vendor == "nvidia" and not installed.get("triton"):
        wheel = {"Linux": "triton", "Windows": "triton-windows"}.get(system)
        if wheel:
            plan.steps.append(Step([wheel], "Triton runs the fused kernels of the torch path"))
        else:
            plan.notes.append(f"no Triton build for {system}; the torch path runs without fused kernels.")
    elif vendor == "amd" and not installed.get("triton"):
        plan.notes.append("Triton comes with the ROCm build of torch (pytorch-triton-rocm), and this torch has none; "
                          "reinstall torch from download.pytorch.org/whl/rocm* to get the fused kernels.")
    if vendor == "nvidia" and family in ("hopper", "blackwell") and system in ("Linux", "Windows") \
            and not installed.get("cudnn_frontend"):
        plan.steps.append(Step(["nvidia-cudnn-frontend"], "cuDNN's fp8 attention for the transformers under precision "
                               "fp8; without its CuTe DSL dependencies, which fp8 attention does not use",
                               ["--no-deps"]))
    if "flash-attn-4" in extras and not installed.get("flash_attn_4"):
        if vendor == "nvidia" and family in ("hopper", "blackwell") and system == "Linux":
            # the CuTe DSL's default libraries are CUDA 12's; torch built for CUDA 13 needs its cu13 ones
            plan.steps.append(Step(["flash-attn-4[cu13]" if cuda >= 13 else "flash-attn-4"],
                                   "FlashAttention-4 for the transformers' 16-bit attention (asked for)"))
        else:
            plan.notes.append("flash-attn-4 runs on NVIDIA Hopper and Blackwell GPUs under Linux; not installed.")
    if "fa3-fwd" in extras and not installed.get("fa3_fwd"):
        refusal = _fa3_refusal(vendor, system, family, cuda, torch_version)
        if refusal:
            plan.notes.append(refusal)
        else:
            plan.steps.append(Step(["fa3-fwd"], "FlashAttention-3 for the transformers' attention (asked for)",
                                   ["--no-deps"]))
    if "onnxruntime" in extras:
        ort = {"nvidia": ["onnx", "onnxruntime-gpu"], "cpu": ["onnx", "onnxruntime"]}.get(vendor)
        if vendor == "intel" and system == "Windows":
            ort = ["onnx", "onnxruntime-directml"]
        if ort is None:
            plan.notes.append(f"no ONNX Runtime build for {vendor} GPUs on PyPI" + (
                "; install AMD's onnxruntime-migraphx wheel from repo.radeon.com." if vendor == "amd" else "."))
        elif installed.get("onnxruntime") and vendor != "cpu" and not installed.get("onnxruntime_gpu"):
            plan.notes.append("the CPU build of onnxruntime is installed and would shadow the GPU build: "
                              "pip uninstall onnxruntime, then run this again.")
        elif not installed.get("onnxruntime"):
            plan.steps.append(Step(ort, "ONNX Runtime path (asked for)"))
    return plan


def _fa3_refusal(vendor: str, system: str, family: str, cuda: int, torch_version: str) -> str:
    """Why fa3-fwd is not installed here, in one line; "" where it is. Its library links libtorch (2.10 or later) and
    CUDA 13's runtime and has Hopper kernels only: with another torch it would not import."""
    if vendor != "nvidia" or family != "hopper" or system != "Linux":
        return "fa3-fwd runs on NVIDIA Hopper GPUs (H100, H200) under Linux only; not installed."
    release = tuple(int(p) for p in re.findall(r"\d+", torch_version.split("+")[0])[:2])
    if cuda != 13 or release < (2, 10):
        return (f"fa3-fwd needs torch 2.10 or later built for CUDA 13 (its library links them); this torch is "
                f"{torch_version or 'unknown'} built for {f'CUDA {cuda}' if cuda else 'no CUDA'}; not installed.")
    return ""


def _extras(asked: str | None) -> set[str]:
    raw = asked if asked is not None else os.environ.get(ENV_EXTRAS, "")
    wanted = {w.strip().lower() for w in raw.split(",") if w.strip()}
    for unknown in sorted(wanted - set(EXTRAS)):
        say(f"ignoring unknown extra {unknown!r}; the extras are: {', '.join(EXTRAS)}.")
    return wanted & set(EXTRAS)


def _installed() -> dict[str, bool]:
    from sd_accel.accel.plan.device import has_package
    from sd_accel.accel.plan.policy import probe_packages

    found = probe_packages()
    for req in core_requirements():
        found[_module_of(req)] = has_package(_module_of(req))
    return found


def installed_pins() -> list[str]:
    """name==version of every distribution installed in this Python: the constraints of every pip call."""
    from importlib.metadata import distributions

    pins = {}
    for dist in distributions():
        name = (dist.metadata["Name"] or "").strip()
        if name and dist.version:
            pins[name.lower()] = f"{name}=={dist.version}"
    return sorted(pins.values())


def _pip(arguments: list[str], dry_run: bool = False) -> tuple[bool, str]:
    """pip install `arguments` (options and packages) with every installed distribution pinned; (ok, last lines of
    pip's output)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(installed_pins()) + "\n")
        constraints = f.name
    try:
        run = subprocess.run([sys.executable, "-m", "pip", "install", "-c", constraints,
                              *(["--dry-run"] if dry_run else []), *arguments],
                             capture_output=True, text=True, timeout=3600)
        tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-3:])
        return run.returncode == 0, tail
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    finally:
        os.unlink(constraints)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Install the packages sd-accel needs for this GPU.")
    parser.add_argument("--dry-run", action="store_true", help="say what would be installed, install nothing")
    parser.add_argument("--with", dest="extras", default=None,
                        help=f"comma-separated optional paths to install: {', '.join(EXTRAS)} (default: "
                             f"${ENV_EXTRAS})")
    args = parser.parse_args(argv)
    if os.environ.get(ENV_SKIP, "").strip() not in ("", "0"):
        say(f"{ENV_SKIP} is set: nothing installed.")
        return 0
    try:
        import torch
    except ImportError:
        say("torch is not installed in this Python; the host (ComfyUI / A1111) installs it. Nothing installed.")
        return 0
    spec = importlib.util.spec_from_file_location("sd_accel_root", HERE / "__init__.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # registers the package `sd_accel`
    from sd_accel.accel.plan.device import describe, detect

    gpu = detect()
    say(f"GPU: {describe(gpu)}")
    cuda = int((torch.version.cuda or "0").split(".")[0])
    plan = plan_installs(gpu.vendor, platform.system(), _installed(), _extras(args.extras), core_requirements(),
                         gpu.family, cuda, torch.__version__)
    for note in plan.notes:
        say(note)
    if not plan.steps:
        say("everything this GPU uses is installed.")
        return 0
    for step in plan.steps:
        arguments = step.options + step.packages
        command = "pip install " + " ".join(arguments)
        if args.dry_run:
            ok, tail = _pip(arguments, dry_run=True)
            say(f"would run: {command}  ({step.why}); " + (
                "pip resolves it without changing any installed package." if ok else
                f"pip cannot add it without changing installed packages, so it would be skipped:\n{tail}"))
            continue
        say(f"running: {command}  ({step.why}; installed packages stay as they are)")
        ok, tail = _pip(arguments)
        say(("installed: " if ok else "not installed (it would change packages the host installed; sd-accel still "
             "runs without it): ") + " ".join(step.packages) + ("" if ok else f"\n{tail}"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # an installer must never stop the host from starting
        say(f"setup stopped early ({type(e).__name__}: {e}); sd-accel still loads and uses what is installed.")
        sys.exit(0)
