"""Accel Info: the detected GPU, the plan and its reasons, the engine cache, and (given a model from an
Accelerated UNet node) the path that model runs on, as a STRING output and as text on the node."""

from __future__ import annotations

from .accelerated_unet import BACKENDS, session_of
from .comfy_ui import CATEGORY, cache_root


def cache_state(root: str) -> str:
    from pathlib import Path

    from ..accel.build.cache import EngineCache, human_bytes

    if not Path(root).is_dir():
        return f"engine cache: {root} (empty: nothing built yet)"
    try:
        entries = EngineCache(root).ls()
    except OSError as e:
        return f"engine cache: {root} cannot be read ({e})"
    size = sum(e.size for e in entries)
    lines = [f"engine cache: {root}, {len(entries)} engine(s), {human_bytes(size)}"]
    for e in entries[:10]:
        lines.append(f"- {e.key[:12]} {e.summary()} {human_bytes(e.size)}" + (f" ({e.problem})" if e.problem else ""))
    if len(entries) > 10:
        lines.append(f"- ... and {len(entries) - 10} more (python -m sd_accel cache ls)")
    return "\n".join(lines)


def report(backend: str = "auto", model=None) -> str:
    from ..accel.errors import AccelError
    from ..accel.plan.device import describe, detect
    from ..accel.plan.policy import choose, probe_packages

    gpu = detect()
    installed = probe_packages()
    lines = [f"GPU: {describe(gpu)}"]
    lines += [f"- {n}" for n in gpu.notes]
    names = ("triton", "onnxruntime", "onnxruntime_gpu", "flash_attn")
    lines.append("packages: " + ", ".join(f"{k} {'yes' if installed.get(k) else 'no'}" for k in names))
    session = session_of(model) if model is not None else None
    if session is None or not session.slot.status.plan:  # a connected model's own plan is shown with it below
        try:
            lines.append(f"plan for backend={backend}:\n" + choose(gpu, backend, installed).summary())
        except AccelError as e:
            lines.append(f"plan for backend={backend}: {e}")
    lines.append(cache_state(cache_root()))
    if model is not None:
        lines.append("model: " + ("not accelerated (connect it through an Accelerated UNet node)" if session is None
                                  else "accelerated\n" + session.slot.status.describe()))
    return "\n".join(lines)


class AccelInfo:
    CATEGORY = CATEGORY
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("info",)
    FUNCTION = "info"
    OUTPUT_NODE = True
    DESCRIPTION = ("Shows the detected GPU, the acceleration plan and its reasons, the engine cache, and the path "
                   "a connected model runs on.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": {"backend": (BACKENDS, {"default": "auto"})},
                "optional": {"model": ("MODEL", {"tooltip": "A model from an Accelerated UNet node: shows its "
                                                 "path and how its last run went."}),
                             "after": ("LATENT", {"tooltip": "The sampler's output: this node then reports after "
                                                  "the run, not before it (ComfyUI orders nodes by their inputs)."})}}

    @classmethod
    def IS_CHANGED(cls, **_kwargs) -> float:
        return float("nan")  # the cache and the model's state change between runs: always report afresh

    def info(self, backend: str, model=None, after=None) -> dict:
        text = report(backend, model)
        return {"ui": {"text": [text]}, "result": (text,)}
