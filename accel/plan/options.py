"""What a user may set for each backend, as frozen dataclasses read strictly, and what a build is given at run time
(the GPU, the cache folder, the shape profile), which is not a user's option and travels apart from them.

A misspelt or unknown option is an error naming the valid ones: silently ignoring it would leave the user
believing it took effect.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from ..errors import BadInput

ATTENTION = ("flash_attn", "cudnn", "flash", "efficient", "math")
DTYPES = {"float16": "float16", "fp16": "float16", "half": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float32": "float32", "fp32": "float32", "float": "float32"}
CONV_ALGO_SEARCH = ("EXHAUSTIVE", "HEURISTIC", "DEFAULT")
PRECISION = ("auto", "16bit", "fp8", "int8")  # see accel/engine/fp8.py


@dataclass(frozen=True)
class TorchOptions:
    """The torch path. The defaults change nothing but the attention kernel; accel.plan.policy turns on what the GPU
    supports."""

    attention: str = field(default="math", metadata={"choices": ATTENTION})
    channels_last: bool = False
    cuda_graphs: bool = False
    triton_kernels: bool = False  # the fused Triton kernels (accel/engine/fusions)
    fusions: tuple[str, ...] | None = None  # None: every fusion, in the registry's order
    compile: bool = False  # regional torch.compile of the repeated blocks (then no fused kernels)
    max_graphs: int = 4
    cudnn_benchmark: bool = False  # time every cuDNN convolution algorithm at each new shape (seconds, once per size)
    # Compile the Triton kernels a new shape needs on a thread pool before its first step (kernels/ahead.py) rather
    # than one after another as the step reaches them.
    parallel_compile: bool = True
    # Diffusion transformers' block projections: "auto" runs fp8 products for weights loaded in fp8 and 16-bit ones
    # for 16-bit weights; "fp8" quantizes 16-bit weights too; "16bit" widens fp8 weights as the host does; "int8"
    # quantizes 16-bit weights to int8 (closer than e4m3, for Z-Image).
    precision: str = field(default="auto", metadata={"choices": PRECISION})


@dataclass(frozen=True)
class OrtOptions:
    """The ONNX Runtime path."""

    provider: str | None = None  # the execution provider; None: the best installed one for the GPU
    fp16: bool | None = None  # None: fp16 on a GPU, fp32 on the CPU
    opset: int = 17
    control: bool = False  # export ControlNet residual inputs
    static_shapes: bool = False
    cuda_graph: bool = False
    max_sessions: int = 2
    # cuDNN's convolution algorithms by heuristics: ORT's default, EXHAUSTIVE, times every algorithm at each new image
    # size (SD1.5 on an H100: first call 12.6 s, a new size 7.8 s) for no faster step; DEFAULT is 11x slower per step.
    conv_algo_search: str = field(default="HEURISTIC", metadata={"choices": CONV_ALGO_SEARCH})
    prefer_nhwc: bool = False
    # cuDNN adds the convolution's bias in the convolution (cuDNN frontend): a step 6% faster, but ORT builds its
    # plans again at every change of image size, sizes seen before included (SD1.5: about 4 s each time, so twice
    # per image with a hires-fix pass). Worth it only when every image has one size.
    fuse_conv_bias: bool = False
    inspect: bool = False  # save each session's ORT-optimized graph and count its host-side nodes
    refit: bool = True  # write the weight map that lets update_weights() swap weights (LoRA) without a rebuild


BACKEND_OPTIONS: dict[str, type] = {"torch": TorchOptions, "onnxruntime": OrtOptions}
# Options of the plan itself rather than of one backend.
PLAN_OPTIONS = ("dtype",)


@dataclass(frozen=True)
class Runtime:
    """What a build is given besides the user's options."""

    gpu: Any = None  # accel.plan.device.GpuInfo; detected when None
    cache_root: str | None = None  # the host's cache folder (ComfyUI / A1111: models/accel); see build.cache
    profile: dict | None = None  # the shape profile the host asked for; part of an engine's cache key
    folder: str | None = None  # ONNX Runtime: build the model files here instead of into the engine cache


def valid_names() -> list[str]:
    return sorted({*PLAN_OPTIONS, *(f.name for cls in BACKEND_OPTIONS.values() for f in fields(cls))})


def check_names(values: Mapping[str, Any]) -> None:
    """BadInput for a name no backend takes, with the closest valid name and the full list."""
    valid = valid_names()
    for name in values:
        if name not in valid:
            close = difflib.get_close_matches(str(name), valid, n=1)
            raise BadInput(f"{name!r} is not an sd-accel option" + (f" (did you mean {close[0]!r}?)" if close else "")
                           + ".", f"The options are: {', '.join(valid)}.")


def parse(cls: type, values: Mapping[str, Any]) -> Any:
    """`cls` (TorchOptions or OrtOptions) from those of `values` that it has, each checked against its type and
    choices. Names of the other backend and of the plan are left to them; check_names catches the rest."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        if f.name in values:
            kwargs[f.name] = _checked(cls, f, hints[f.name], values[f.name])
    return cls(**kwargs)


# What each field type accepts, and how the fix names it.
_KINDS = (
    (bool, lambda v: isinstance(v, bool), "true or false"),
    (int, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a whole number of 1 or more"),
    (str, lambda v: isinstance(v, str), "a name"),
)


def _checked(cls: type, f, hint, value: Any) -> Any:
    backend = next(name for name, c in BACKEND_OPTIONS.items() if c is cls)
    where = f"the {backend} option {f.name}"
    choices = f.metadata.get("choices")
    allowed = typing.get_args(hint) or (hint,)
    if value is None and type(None) in allowed:
        return None
    if choices is not None:
        if value not in choices:
            raise BadInput(f"{where} is {value!r}.", f"Use one of: {', '.join(choices)}.")
        return value
    for kind, ok, words in _KINDS:
        if kind in allowed:
            if not ok(value):
                raise BadInput(f"{where} is {value!r}, not {words}.", f"Set {f.name} to {words}.")
            return value
    # tuple[str, ...]
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise BadInput(f"{where} is {value!r}, not a list of names.", f"Set {f.name} to a list of names.")
    return tuple(value)
