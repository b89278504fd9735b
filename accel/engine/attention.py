"""Attention kernel choice: which PyTorch SDPA backends may run, best first, or the flash_attn package; the form
of a function that stands in for a host's attention function; which host attention functions patched forwards
read, which a CUDA graph depends on; and what the patched forwards said of them, once per engine.

Choosing happens around the UNet call (a context), so diffusers' default SDPA processor and ComfyUI's
PyTorch attention both pick it up without any module being replaced.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator

import torch

_SDPA = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def sdpa_order(preferred: str) -> list[str]:
    """SDPA backends to allow, `preferred` first; the others stay allowed so that a head size or dtype the
    preferred kernel does not cover still runs."""
    order = ["cudnn", "flash", "efficient", "math"]
    if preferred in order:
        order.remove(preferred)
        order.insert(0, preferred)
    return order


@contextlib.contextmanager
def sdpa_kernels(preferred: str) -> Iterator[None]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = [n for n in sdpa_order(preferred) if hasattr(SDPBackend, _SDPA[n])]
    backends = [getattr(SDPBackend, _SDPA[n]) for n in names]
    try:
        ctx = sdpa_kernel(backends, set_priority=True)
    except TypeError:  # torch < 2.6 has no priority order: keep the preferred one and math as the safety net
        ctx = sdpa_kernel([backends[0], SDPBackend.MATH])
    with ctx:
        yield


def sdpa_name(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The SDPA kernel PyTorch takes now (under sdpa_kernels) for (B, heads, L, D) q, k and v, in words, for a
    message."""
    try:  # private API: the words are worth no failure
        from torch.nn.attention import SDPBackend

        chosen = SDPBackend(torch._fused_sdp_choice(q, k, v)).name
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return "PyTorch's SDPA"
    name = next((n for n, backend in _SDPA.items() if backend == chosen), None)
    return f"PyTorch's SDPA ({name})" if name else "PyTorch's SDPA"


# (module, name) of every host attention function a patched forward of this process has read. Kept when the patches
# are undone: an engine's graph token must not change because another engine's fusions came or went.
_READ: set[tuple[str, str]] = set()


def reads(module: str, name: str) -> None:
    """Note that a patched forward reads the host's attention function `name` of `module` at each call (what a
    ComfyUI block calls: its module's optimized_attention)."""
    _READ.add((module, name))


def read() -> tuple:
    """The functions those places hold now: which one runs, or which one a fused block timed its own attention
    against (accel/engine/host_attention.py), is part of what a CUDA graph captured, so a graph serves only while the
    same ones are there. A stand-in, made afresh for each call, counts as what it does (its key)."""
    return tuple(_what(getattr(sys.modules.get(m), n, None)) for m, n in sorted(_READ))


def _what(fn) -> Hashable:
    return fn.key if isinstance(fn, StandIn) and fn.key is not None else id(fn)


# What the patched forwards have said once (fusions.base.comfy_attention): the keys of the engine whose call runs now
# (said_by: the torch path's engine, around each call), else this process's (fusions applied by hand, as the tests
# do).
_SAID: set[Hashable] = set()
_SAYING: contextvars.ContextVar[set[Hashable] | None] = contextvars.ContextVar("sd_accel_said", default=None)


@contextlib.contextmanager
def said_by(keys: set[Hashable]) -> Iterator[None]:
    """While it lasts, what the patched forwards say once is said once in `keys` (an engine's)."""
    token = _SAYING.set(keys)
    try:
        yield
    finally:
        _SAYING.reset(token)


def said() -> set[Hashable]:
    """The keys of what was said once, of the engine whose call runs now (said_by), else of the process."""
    keys = _SAYING.get()
    return _SAID if keys is None else keys


@dataclass(frozen=True)
class StandIn:
    """A function put for a while in a host module's place of its attention function (sequence parallelism does:
    accel/parallel/exchange.py) that the fused DiT blocks honour, though they call no host attention: their gate
    judges `host`, the function it stands in for, and their own attention runs through `around` (or, in fp8,
    through `eight`)."""

    host: Callable
    call: Callable  # what the host's blocks call in host's place, with host's arguments
    # around(attend, q, k, v) for (B, L, heads, head_dim) q, k and v, where attend(q, k, v) -> (B, L, heads * head_dim)
    around: Callable
    # alike for stand-ins that do the same, so that a CUDA graph captured with one replays for another; None: its own
    key: Hashable = None
    # what the fused blocks' fp8 attention exchanges its e4m3 q and k and 16-bit v through in host's place
    # (sequence parallelism's exchange: accel/parallel/exchange.py Eight); None: under this stand-in the attention
    # stays 16-bit
    eight: object | None = None

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)


@contextlib.contextmanager
def standing_in(module, name: str, fn: StandIn) -> Iterator[None]:
    """fn in the place of module's attention function `name` (fn.host) while it lasts."""
    setattr(module, name, fn)
    try:
        yield
    finally:
        setattr(module, name, fn.host)


class FlashAttnProcessor:
    """diffusers attention processor that calls the flash_attn package (NVIDIA Ampere+, fp16/bf16)."""

    def __init__(self) -> None:
        from flash_attn import flash_attn_func

        self._fa = flash_attn_func

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        residual = hidden_states
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            b, c, h, w = hidden_states.shape
            hidden_states = hidden_states.view(b, c, h * w).transpose(1, 2)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        if encoder_hidden_states is not None and attn.norm_cross:
            context = attn.norm_encoder_hidden_states(context)
        q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        bsz, heads = q.shape[0], attn.heads
        q, k, v = (t.view(bsz, -1, heads, t.shape[-1] // heads) for t in (q, k, v))
        if attention_mask is not None or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > 256:
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attention_mask).transpose(1, 2)
        else:
            out = self._fa(q, k, v, softmax_scale=attn.scale)
        out = attn.to_out[1](attn.to_out[0](out.reshape(bsz, -1, heads * out.shape[-1])))
        if input_ndim == 4:
            out = out.transpose(-1, -2).reshape(b, c, h, w)
        if attn.residual_connection:
            out = out + residual
        # a division by 1 would still be a pass over the output
        return out if attn.rescale_output_factor == 1.0 else out / attn.rescale_output_factor
