"""What every kernel module shares: the optional Triton import, where a kernel can run, block-size arithmetic.

Triton is optional: without it the kernel modules still import (so `supported()` can say no), their `@jit`
functions stay plain Python and are never launched.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from .errors import BadInput
from .errors import Unavailable as BackendUnavailable

try:
    import triton
    import triton.language as tl

    TRITON_ERROR = ""
except Exception as e:  # a broken install can raise more than ImportError; either way we run without it
    triton = None
    TRITON_ERROR = f"{type(e).__name__}: {e}"

    class tl:  # type: ignore[no-redef]  # only what kernel signatures evaluate when they are defined
        constexpr = Any

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Elements one program holds in registers per step: 16 per thread at 8 warps, enough loads in flight to hide latency.
TILE = 4096
# Under the CPU interpreter every program and every loop step costs Python time, while numpy takes large blocks in
# its stride: one big step instead.
INTERPRET_TILE = 1 << 16


def jit(fn: Callable | None = None, *, do_not_specialize: tuple[str, ...] = ()) -> Callable:
    """triton.jit where Triton is installed. do_not_specialize: the integer arguments that follow the image size
    (pixel and row counts): Triton would compile another variant of the kernel whenever one of them stops being a
    multiple of 16 or becomes 1, so a new image size would wait for compilation. Name only counts whose variants gain
    nothing: a row stride, or a length that bounds a flattened contiguous range, left unspecialized costs the
    kernel its vectorized loads and stores (Triton no longer knows rows start 16-element aligned)."""
    if fn is None:
        return lambda f: jit(f, do_not_specialize=do_not_specialize)
    if triton is None:
        return fn
    # Our kernel modules import annotations lazily, so a parameter's annotation is the string "tl.constexpr". Triton's
    # compiler reads that as constexpr, but the CPU interpreter of Triton 3.0 only knows "constexpr" and
    # would pass such a parameter as a tensor (tl.arange then refuses it): give it the class itself, as any Triton reads.
    fn.__annotations__ = {name: tl.constexpr if ty in ("tl.constexpr", "constexpr") else ty
                          for name, ty in fn.__annotations__.items()}
    return triton.jit(fn, do_not_specialize=do_not_specialize)


def interpreted(kernel: Callable) -> bool:
    """Whether `kernel` was built for Triton's CPU interpreter.

    Triton decides this when the function is defined (TRITON_INTERPRET=1 at that moment), not at launch time: for
    its own library when triton is first imported, for ours when the kernel module is.
    """
    return type(kernel).__name__ == "InterpretedFunction"


def supported_tensor(x: torch.Tensor, kernel: Callable) -> bool:
    """True when `kernel` can run on `x`: a CUDA or ROCm tensor (torch calls both "cuda"), or a CPU tensor when the
    kernel and Triton's own library (tl.zeros stands for it) were both built for the interpreter."""
    if triton is None or x.dtype not in DTYPES:
        return False
    return x.device.type == "cuda" or (x.device.type == "cpu" and interpreted(kernel) and interpreted(tl.zeros))


def require(x: torch.Tensor, kernel: Callable, name: str) -> None:
    if triton is None:
        raise BackendUnavailable(f"{name}: Triton is not importable ({TRITON_ERROR}).",
                                 "Install it (pip install triton; on ROCm, PyTorch's wheel brings pytorch-triton-rocm) "
                                 "or use the torch reference.")
    if x.dtype not in DTYPES:
        raise BadInput(f"{name}: tensor dtype {x.dtype} is not supported.", "Pass float16, bfloat16 or float32.")
    if not supported_tensor(x, kernel):
        raise BackendUnavailable(f"{name}: Triton cannot run on a {x.device.type} tensor here.",
                                 "Move the tensor to a CUDA/ROCm GPU (or, for tests, set TRITON_INTERPRET=1 before "
                                 "triton is first imported to run on the CPU, slowly).")


def on_device(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current device: make it the tensor's."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def tile_for(x: torch.Tensor) -> int:
    """Elements per program step for a launch on x's device (CPU means the interpreter)."""
    return INTERPRET_TILE if x.device.type == "cpu" else TILE


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def warps(elems: int, per_thread: int = 16) -> int:
    """num_warps for a tile of `elems` elements: about `per_thread` per thread, 1 to 16 warps."""
    return max(1, min(16, elems // (32 * per_thread)))


@jit
def e4m3(x):
    """x (float32) rounded to the nearest e4m3 (float8_e4m3fn) value, ties to even, saturated at +-448, still in
    float32: its conversion to fp8 is then exact. Triton's CPU interpreter rounds fp8 conversions wrongly (125.9
    becomes 64), so a kernel that rounds here first gives the GPU's result under the interpreter too."""
    bits = x.to(tl.int32, bitcast=True)
    # the spacing of e4m3 values around |x|: 2^(exponent - 3), and 2^-9 among the subnormals below 2^-6
    step_exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
    # |x| / step < 16: adding and taking away 2^23 rounds it to an integer, ties to even (both steps are exact
    # powers of two apart from that one rounding)
    r = tl.minimum(((tl.abs(x) * inv + 8388608.0) - 8388608.0) * step, 448.0)
    return tl.where(x < 0, -r, r)
