"""A UNet's weights stored in fp8 (ComfyUI's fp8_e4m3fn weight dtype), widened once to the dtype the model computes in.

ComfyUI's cast-on-the-fly layers widen each weight at every call; the fusions leave such layers to their own forward
(they read a layer's weight directly), so an fp8-stored UNet ran far slower on the torch path than a 16-bit one.
fp8 products do not pay for the UNets' narrow layers (BENCHMARKS.md), so their weights are widened instead, once,
into 16-bit copies the engine keeps: during the engine's calls each such layer holds its copy and computes as a plain
layer, which the fusions and CUDA graphs take like any other; suspend() gives every layer its fp8 weight back. The
copies cost 2 bytes a weight beside the host's fp8 ones (SDXL: 5.2 GB), so they are made only where the GPU keeps a
quarter of its memory free after them; elsewhere the layers keep widening per call, and the console says why.

The copies are derived tensors a CUDA graph reads where they are, so they stay in place: a copy is widened again into
the same memory when its source changed (another Parameter, address or version: ComfyUI's LoRA patching replaces the
fp8 Parameter) or the host said so (`stale`). A copy packing made a view of its pack (fusions/packing.py) is widened
into the pack. Layers with per-call weight functions (lowvram, a LoRA applied per call) or scaled-fp8 weights
(`scale_weight`) keep their own forward.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

from ..models.spec import FP8_DTYPES
from .fusions.base import Undo, instance_attr, own_weights, version
from .graphs import count_registration, registrations

log = logging.getLogger("sd-accel")

# The share of the GPU's memory left free after the copies, below which the weights keep widening per call.
FREE_AFTER = 0.25


def _fp8_names(layer: nn.Module) -> list[str]:
    """The names of the layer's fp8-stored Parameters, read from its parameter dict: attribute lookups that miss are
    slow, and a UNet has thousands of modules."""
    return [n for n in ("weight", "bias") if (p := layer._parameters.get(n)) is not None and p.dtype in FP8_DTYPES]


def _scaled(layer: nn.Module) -> bool:
    """Scaled-fp8 weights (`scale_weight`, `scale_input`), which only the host's forward applies."""
    return getattr(layer, "scale_weight", None) is not None or getattr(layer, "scale_input", None) is not None


def _takes(layer: nn.Module) -> list[str]:
    """The names of the Parameters to widen of a layer found by the walk: a ComfyUI cast-on-the-fly layer with no
    weight functions (lowvram and a LoRA applied per call set them between runs)."""
    names = _fp8_names(layer)
    return names if names and getattr(layer, "comfy_cast_weights", False) and own_weights(layer) else []


def _key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), version(t), tuple(t.shape), t.dtype


class Widened:
    """The 16-bit copies of one engine's fp8-stored weights, kept from one call and one run to the next."""

    def __init__(self) -> None:
        # layer -> name -> (the fp8 source's weak reference and key, the 16-bit Parameter the layer holds in calls)
        self._copies: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple]] = weakref.WeakKeyDictionary()
        self._stale = False
        # (registrations(), the module, its layers with unscaled fp8 weights) at the last walk of the module's tree,
        # which stays the same until something is registered in it: walking SDXL's 2,000 modules costs milliseconds
        self._walked: tuple = (-1, None, [])
        self._held: list[int] = []  # the ids of the copies the layers held after the last swap
        self.declined: str | None = None  # why the weights widen per call, once decided

    def apply(self, module: nn.Module, dtype: torch.dtype, undo: Undo) -> int:
        """Give every fp8-stored cast-on-the-fly layer of module its 16-bit copies (made or brought up to date first)
        and make it a plain layer, with one undo step for all; the number of layers.

        This runs at every resume, so once per sampling run: the copies go into the layers' parameter dicts
        directly, which skips the module registration hooks. When the layers get back the very Parameters they held
        at the engine's last call, the list graphs.WeightsWatch keeps (the CUDA graphs' weight token) is still true;
        otherwise (a new copy, a layer that now keeps its own weight) the swap is counted as a registration, so that
        the list is read again."""
        if self._walked[0] != registrations() or self._walked[1] is not module:
            found = [m for m in module.modules() if _fp8_names(m) and not _scaled(m)]
            self._walked = (registrations(), module, found)
        layers = [(m, names) for m in self._walked[2] if (names := _takes(m))]
        if not layers or self.declined or not self._fits(layers, dtype):
            return 0
        stale, self._stale = self._stale, False
        swapped, cast_flags = [], []
        # Plain tensors, not inference ones, even inside a host's inference_mode: an inference tensor in a Parameter
        # fails the layers' own forward ("Inference tensors do not track version counter").
        with torch.inference_mode(False), torch.no_grad():
            for layer, names in layers:
                kept = self._copies.setdefault(layer, {})
                for name in names:
                    source = layer._parameters[name]
                    entry, key = kept.get(name), _key(source)
                    if entry is None or entry[1].shape != source.shape or entry[1].device != source.device:
                        copy = nn.Parameter(source.to(dtype), requires_grad=False)
                    else:
                        copy = entry[1]
                        if stale or entry[0][0]() is not source or entry[0][1] != key:
                            copy.data.copy_(source)
                            entry = None
                    layer._parameters[name] = copy
                    if entry is None:
                        kept[name] = ((weakref.ref(source), key), copy)
                    swapped.append((layer, name, source, copy))
                cast_flags.append(instance_attr(layer, "comfy_cast_weights"))
                layer.__dict__["comfy_cast_weights"] = False
        # ids stay unique here: every copy held last time is alive in self._copies while a new one is made
        held = [id(copy) for *_, copy in swapped]
        if held != self._held:
            self._held = held
            count_registration()

        def give_back() -> None:
            for layer, name, source, _ in swapped:
                layer._parameters[name] = source
            for put_back in cast_flags:
                put_back()

        undo.add(give_back)
        return len(layers)

    def _fits(self, layers: list[tuple[nn.Module, list[str]]], dtype: torch.dtype) -> bool:
        """Whether the copies not made yet leave FREE_AFTER of the GPU's memory free; decided once, and said."""
        device = getattr(layers[0][0], layers[0][1][0]).device
        if device.type != "cuda" or any(layer in self._copies for layer, _ in layers):
            return True
        need = sum(getattr(m, n).numel() for m, names in layers for n in names) * torch.finfo(dtype).bits // 8
        free, total = torch.cuda.mem_get_info(device)
        if free - need >= FREE_AFTER * total:
            log.info("sd-accel: the UNet's weights stored in fp8 run as 16-bit copies made once (%.1f GB beside them), "
                     "so the fused kernels and CUDA graphs take their layers.", need / 1e9)
            return True
        self.declined = (f"the UNet's weights stored in fp8 are widened at every call, as ComfyUI does: 16-bit copies "
                         f"made once ({need / 1e9:.1f} GB) would leave less than {FREE_AFTER:.0%} of the GPU's memory "
                         "free, and the fused kernels skip those layers")
        log.warning("sd-accel: %s.", self.declined)
        return False

    def stale(self) -> None:
        """The host changed the weights in a way their keys may not show: widen every copy again before the next
        call."""
        self._stale = True

    def refresh(self) -> None:
        """Every copy widened again from its source if the host said the weights changed. Called before each call
        (a replay runs no Python that could notice) and outside any capture."""
        if not self._stale:
            return
        self._stale = False
        with torch.no_grad():
            for kept in list(self._copies.values()):
                for (source, _), copy in kept.values():
                    if source() is not None:
                        copy.data.copy_(source())
