"""The one entry point hosts use: detect the GPU, choose a plan, build the engine, and always keep a way to
produce an image: whatever an accelerated path cannot serve runs on the torch path or the plain model, and
the user is told once, in words, why.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Mapping

import torch
from torch import nn

from .engine import backends
from .errors import AccelError, BackendUnavailable
from .models.dit import CanonicalDiT
from .models.spec import CanonicalUNet, canonical
from .plan.device import GpuInfo, detect
from .plan.options import Runtime
from .plan.policy import Plan, choose
from .progress import NullProgress, Progress

log = logging.getLogger("sd-accel")


class AcceleratedUNet:
    """Canonical-call UNet that runs through the chosen engine and falls back instead of failing."""

    def __init__(self, unet: CanonicalUNet | CanonicalDiT, plan: Plan, gpu: GpuInfo, engine=None, fallback=None,
                 build_seconds: float = 0.0) -> None:
        self.unet = unet
        self.plan = plan
        self.gpu = gpu
        self.engine = engine
        self.fallback = fallback  # a torch engine, when the main engine is another backend
        self.build_seconds = build_seconds
        self._told: set[str] = set()
        self.fallback_calls = 0  # calls the engine could not serve (BackendUnavailable), and the last reason
        self.fallback_reason = ""

    @property
    def backend(self) -> str:
        return self.engine.backend if self.engine is not None else "off"

    def tell_once(self, key: str, message: str) -> None:
        if key not in self._told:
            self._told.add(key)
            log.warning("sd-accel: %s", message)

    def __call__(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                 y: torch.Tensor | None = None, control: dict | None = None, guidance: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor:
        self.unet.check(x, context, y)
        if guidance is not None:
            kwargs["guidance"] = guidance  # only DiTs take it; a UNet says so
        if self.engine is None:
            return self.unet(x, timesteps, context, y, control, **kwargs)
        n = self.unet.size_multiple
        if x.shape[-1] % n or x.shape[-2] % n:
            self.tell_once(f"multiple-of-{n}", (
                f"the latent's width x height {x.shape[-1]}x{x.shape[-2]} is not a multiple of {n} (image "
                f"{8 * x.shape[-1]}x{8 * x.shape[-2]} px, not a multiple of {8 * n}); this call runs on the plain "
                f"model. Pick a width and height that are multiples of {8 * n} to accelerate."))
            return self.unet(x, timesteps, context, y, control, **kwargs)
        try:
            return self.engine(x, timesteps, context, y, control, **kwargs)
        except BackendUnavailable as e:
            self.fallback_calls += 1
            self.fallback_reason = str(e)
            self.tell_once(f"fallback:{e.problem}", f"{e} This call and others like it run on the torch path.")
        except torch.OutOfMemoryError:
            self.tell_once("oom", f"out of GPU memory on the {self.backend} path; freeing its graphs and running "
                           "this call on the plain model. Lower the batch or resolution, or set max_graphs lower.")
            self.engine.release()
            return self.unet(x, timesteps, context, y, control, **kwargs)
        runner = self.fallback if self.fallback is not None else self.unet
        return runner(x, timesteps, context, y, control, **kwargs)

    def suspend(self) -> None:
        """Undo the torch path's changes to the module, keeping its graphs: a torch engine resumes on its next
        call."""
        for e in (self.engine, self.fallback):
            if e is not None and e.backend == "torch":
                e.suspend()

    def resume(self) -> None:
        """Redo what suspend() undid now, rather than inside the next call (the bench times that call alone)."""
        for e in (self.engine, self.fallback):
            if e is not None and e.backend == "torch":
                e.resume()

    def release(self) -> None:
        for e in (self.engine, self.fallback):
            if e is not None:
                e.release()


def _transformer_plan(plan: Plan) -> Plan:
    """A diffusion transformer's plan: the torch path (the ONNX Runtime path builds UNets only), no channels_last (its
    only 4-D weight is a patch embedding)."""
    torch_options = dataclasses.replace(plan.torch, channels_last=False)
    if plan.backend != "onnxruntime":
        return dataclasses.replace(plan, torch=torch_options)
    return dataclasses.replace(plan, backend="torch", torch=torch_options, onnxruntime=None, fallback="off", reasons=[
        *plan.reasons, "the ONNX Runtime path builds UNets only: this diffusion transformer runs on the torch path."])


def accelerate(model: nn.Module, preference: str | None = None, options: Mapping[str, Any] | None = None,
               progress: Progress | None = None, gpu: GpuInfo | None = None, cache_root: str | None = None,
               profile: dict | None = None) -> AcceleratedUNet:
    """Wrap a diffusers or ldm-style UNet, or a Flux or SD3 transformer (ComfyUI's or diffusers' form), in the best
    available engine for this GPU.

    options: names of accel/plan/options.py (BadInput for one no backend takes). cache_root: the host's engine
    cache folder; profile: the shape profile the host asked for (both only matter to paths that build files).
    Raises UnsupportedModel for a module that is neither (the host then keeps its plain model)."""
    progress = progress or NullProgress()
    unet = canonical(model)
    gpu = gpu or detect()
    plan = choose(gpu, preference, options=options)
    if isinstance(unet, CanonicalDiT):
        plan = _transformer_plan(plan)
    runtime = Runtime(gpu=gpu, cache_root=cache_root, profile=profile)
    dtype_name = str(unet.dtype).replace("torch.", "")
    if plan.backend != "off" and dtype_name not in gpu.dtypes:
        log.warning("sd-accel: %s cannot run %s on %s; the plain model runs. Load the model in one of: %s.",
                    plan.backend, dtype_name, gpu.name or gpu.family, ", ".join(gpu.dtypes))
        return AcceleratedUNet(unet, plan, gpu)
    if plan.backend == "off":
        return AcceleratedUNet(unet, plan, gpu)
    start = time.perf_counter()
    fallback = None
    try:
        engine = backends.load(plan.backend).build(unet, plan.options, runtime, progress)
    except (AccelError, ImportError, RuntimeError) as e:
        if plan.backend == "torch":
            log.warning("sd-accel: building the torch path failed (%s); the plain model runs.", e)
            return AcceleratedUNet(unet, plan, gpu)
        log.warning("sd-accel: building the %s path failed (%s); the torch path runs instead.", plan.backend, e)
        engine = backends.load("torch").build(unet, plan.torch, runtime, progress)
    if engine.backend != "torch":
        fallback = backends.load("torch").build(unet, plan.torch, runtime, NullProgress())
    return AcceleratedUNet(unet, plan, gpu, engine, fallback, time.perf_counter() - start)
