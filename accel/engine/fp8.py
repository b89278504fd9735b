"""fp8 matrix products for a diffusion transformer's block projections: torch._scaled_mm on e4m3 operands, each
activation row scaled on the fly (kernels/quant.py), each weight output channel scaled once, the products
accumulated as the tensor cores do (`use_fast_accum`).

Which projections take them follows the torch path's `precision` option:
- "auto": the layers whose weights the host loaded in fp8 (ComfyUI's fp8_e4m3fn weight dtype: its cast-on-the-fly
  layers, which would otherwise widen every weight to 16 bits at every call; the e4m3 layers of its quantized
  checkpoints, below); 16-bit weights stay 16-bit;
- "fp8": every block projection; 16-bit weights are quantized into a copy kept beside them (+50% of their memory);
- "16bit": none (fp8-loaded weights run through the host's own layers: widened per call, or its own fp8 kernels);
- "int8": every block projection as "fp8" does, but 16-bit weights quantized to int8 (per output channel) and their
  inputs to int8 rows (kernels/quant.py, kernels/int8_gemm.py): 7 bits of each row where e4m3 keeps 3, at e4m3's
  tensor-core rate on Hopper (sd-accel's Triton product takes about 1.2x cuBLAS's e4m3 time); for models whose fp8
  error is too large (Z-Image, BENCHMARKS.md). Weights stored in e4m3 stay e4m3 products. Producers that write e4m3
  rows for the next product (the adaLN pass, fp8 attention) hand int8 layers 16 bits instead (`takes_rows`), which
  the product quantizes.
The adaLN modulation projections (one row per sample) take fp8 products only where their weights are stored in fp8
(widening billions of them per call costs more than the product); 16-bit ones stay 16-bit. Layers with weight or
bias functions (lowvram, a LoRA applied per call) are never taken: their forward applies them. A marked layer's own
forward makes the fp8 product, so every caller gets it: the fused blocks and the modules they call.

Weights stored in e4m3 come in three forms, each taken as it is stored (no copy), with its scale: a plain fp8 tensor
(ComfyUI's fp8_e4m3fn weight dtype), the same with a per-tensor `scale_weight` (the "fp8_scaled" checkpoints as
ComfyUI 0.3.6x loads them), and comfy-kitchen's QuantizedTensor of its per-tensor e4m3 layout (ComfyUI 0.33 loads the
"fp8_scaled" and mixed-precision checkpoints into such weights, held by its own Linear class, which is no nn.Linear).
Other quantized layouts (block-scaled, fp4, int8) are not read here: their layers keep the host's forward.

The quantized copies (and the per-channel scales, also those of weights stored in fp8) are derived tensors that an
engine's CUDA graphs read where they were at capture. So they belong to the engine (`Copies`), not to the marks:
they outlive suspend() (the host's next run replays the graphs), and `Copies.refresh()`, called before every graph
replay, quantizes a changed weight again into the same memory. A weight counts as changed when the Parameter object,
its address or its version differs (a LoRA merged in place bumps the version; ComfyUI's patching replaces the
Parameter), or when the host says its weights changed (`Copies.stale()`: inference tensors, which ComfyUI's loaders
make, keep no version counter).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .fusions.base import Undo, kernel_module, linear_layer, own_weights, patch_forward, plain_linear, version

log = logging.getLogger("sd-accel")

PRECISIONS = ("auto", "16bit", "fp8", "int8")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
INT8 = torch.int8
# The blocks whose projections may run in fp8, and the projections that stay 16-bit (per-sample modulation).
# ComfyUI's Flux/Chroma, MMDiT, Wan and Qwen-Image blocks, then diffusers' Flux and SD3 blocks; the last name is also
# ComfyUI's Z-Image (Lumina) block's; then ComfyUI's LTX-2 block. (Wan's and LTX-2's modulations are parameters added
# to the time projection, not projections of their own.)
BLOCKS = ("DoubleStreamBlock", "SingleStreamBlock", "DismantledBlock", "WanAttentionBlock",
          "QwenImageTransformerBlock", "FluxTransformerBlock", "FluxSingleTransformerBlock", "JointTransformerBlock",
          "BasicAVTransformerBlock")
MODULATION = ("img_mod", "txt_mod", "modulation", "adaLN_modulation", "norm1", "norm1_context", "norm")


class _Weight(NamedTuple):
    source: weakref.ref  # the weight tensor it was made from
    key: tuple  # and that tensor's address, version, dtype and shape then, and its scale_weight's
    q: torch.Tensor  # (N, K) e4m3 or int8: the weight itself when it is stored in fp8, else a copy owned here
    scale: torch.Tensor  # (1, N) float32: weight = q * scale per output channel
    owned: bool  # q is a copy of ours (may be written to), not the host's weight


class Rows(NamedTuple):
    """Activations quantized for fp8 (or int8) products: what a fused kernel hands the next projection instead of a
    tensor."""
    q: torch.Tensor  # (M, K) e4m3 or int8
    scale: torch.Tensor  # (M, 1) float32: row = q * scale
    shape: tuple  # the leading dims of the activation (M = their product)
    dtype: torch.dtype  # the 16-bit dtype the products return


_PLAIN_TENSORS = (torch.Tensor, nn.Parameter, type(None))


def kitchen_e4m3(w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(e4m3 data (N, K), float32 scale of one element) of a comfy-kitchen QuantizedTensor of a per-tensor e4m3 layout
    (its TensorCoreFP8Layout and ComfyUI's subclasses of it), stored unpadded and row-major as the products read it;
    None for any other tensor. Read through the layout's own accessor, so that comfy-kitchen need not be importable."""
    if type(w) in _PLAIN_TENSORS:  # asked for every marked layer before every replay: the common case first
        return None
    layout = getattr(w, "layout_cls", None)
    if not isinstance(layout, type) or not _per_tensor_fp8(layout):
        return None
    q, scale = layout.get_plain_tensors(w)
    if q.dtype != FP8 or q.shape != w.shape or not q.is_contiguous() or scale.numel() != 1:
        return None
    return q, scale


@functools.cache
def _per_tensor_fp8(layout: type) -> bool:
    return any(c.__name__ == "TensorCoreFP8Layout" and c.__module__.startswith("comfy_kitchen.")
               for c in layout.__mro__)


def stored_in_fp8(layer: nn.Module) -> bool:
    """Whether the layer's weight is stored in e4m3 in a form the products read as it is."""
    w = layer.weight
    return w.dtype == FP8 or kitchen_e4m3(w) is not None


def _key(layer: nn.Module) -> tuple:
    w = layer.weight
    kitchen = kitchen_e4m3(w)
    # a QuantizedTensor's data and scale are tensors of their own, which a host may update in place
    w, s = kitchen if kitchen is not None else (w, getattr(layer, "scale_weight", None))
    return (w.data_ptr(), version(w), w.dtype, tuple(w.shape),
            None if s is None else (s.data_ptr(), version(s), tuple(s.shape)))


def _quantize(layer: nn.Module, int8: bool = False) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The layer's weight as (e4m3 (N, K), float32 scale (1, N), whether the e4m3 tensor is a copy made here); a weight
    stored in e4m3 as it is, with its per-tensor scale if it has one; a 16-bit weight in int8 with `int8`."""
    w = layer.weight
    kitchen = kitchen_e4m3(w)
    if kitchen is not None or w.dtype == FP8:
        q, scale = kitchen if kitchen is not None else (w, getattr(layer, "scale_weight", None))
        scale = scale.float().reshape(1, -1) if scale is not None else torch.ones(1, 1, device=q.device)
        return q, scale.expand(1, q.shape[0]).contiguous(), False
    if int8:
        q, scale = kernel_module("quant").quantize_rows_ref(w, dtype=INT8)
        return q, scale.reshape(1, -1), True
    amax = w.float().abs().amax(dim=1).clamp_min(1e-12)
    scale = (amax / FP8_MAX).reshape(1, -1)
    return (w.float() / scale.t()).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale, True


class Copies:
    """The fp8 operands of one engine's marked layers: quantized copies of 16-bit weights and every layer's scales.

    Kept from one call and one run to the next, and brought up to date in place (same memory), so that CUDA graphs
    captured on them stay right across LoRA changes without a new capture; freed with the engine (`clear`)."""

    def __init__(self) -> None:
        self.layers: list[nn.Linear] = []
        self.int8 = False  # 16-bit weights quantized to int8 (precision "int8"), else to e4m3
        self._entries: weakref.WeakKeyDictionary[nn.Module, _Weight] = weakref.WeakKeyDictionary()
        self._stale = False

    def weight(self, layer: nn.Linear) -> _Weight:
        entry = self._entries.get(layer)
        w, key = layer.weight, _key(layer)
        if entry is not None and entry.source() is w and entry.key == key:
            return entry
        # inference_mode: the copies may be inference tensors (made inside a host's inference_mode), which only an
        # inference-mode op may write to.
        with torch.inference_mode():
            q, scale, owned = _quantize(layer, self.int8)
            if entry is not None and entry.scale.shape == scale.shape and entry.scale.device == scale.device:
                entry.scale.copy_(scale)
                scale = entry.scale
                # only into a copy of ours: the host's e4m3 tensors (its weights, its backups) are never written
                if owned and entry.owned and entry.q.shape == q.shape and entry.q.device == q.device \
                        and entry.q.dtype == q.dtype:
                    entry.q.copy_(q)
                    q = entry.q
        entry = _Weight(weakref.ref(w), key, q, scale, owned)
        self._entries[layer] = entry
        return entry

    def stale(self) -> None:
        """The host changed the weights in a way their versions may not show: quantize every layer again at the next
        refresh."""
        self._stale = True

    def refresh(self) -> None:
        """Every marked layer's copy up to date, in place where one exists. Called before a CUDA graph replays (the
        replay itself runs no Python that could notice a changed weight) and outside any capture (so that a capture
        never allocates a copy in the graph's private pool)."""
        if self._stale:
            self._stale = False
            for layer in list(self._entries.keys()):
                entry = self._entries[layer]
                self._entries[layer] = entry._replace(key=())
        for layer in self.layers:
            self.weight(layer)

    def clear(self) -> None:
        self.layers = []
        self._entries = weakref.WeakKeyDictionary()


# The layers that make fp8 products now, each with the Copies of the engine that marked it.
_MARKED: weakref.WeakKeyDictionary[nn.Module, Copies] = weakref.WeakKeyDictionary()
# (rows, K, N) of the products cuBLASLt declined in fp8 on this GPU (CUBLAS_STATUS_NOT_SUPPORTED from its heuristic:
# LTX-2's audio MLP, 34 rows of 8192 into 2048, on an H200, where 68 rows ran), each tried once; they run as 16-bit
# products of the same e4m3 operands.
_DECLINED: set[tuple[int, int, int]] = set()


@functools.lru_cache(maxsize=None)
def _cpu_row_wise() -> bool:
    """Whether torch's CPU _scaled_mm takes row-wise scales, as matmul() gives it: torch 2.6 and 2.7 have no CPU
    kernel, 2.8's takes per-tensor scales only (both raise); 2.13's runs it. One 16x16 product, once."""
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16,
                         use_fast_accum=True)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def supported(device: torch.device, int8: bool = False) -> tuple[bool, str]:
    """Whether fp8 products run on `device`: NVIDIA Hopper or later (Ada's row-wise scaled products are not verified
    here), or the CPU (tests). int8: whether int8 products do: NVIDIA GPUs with Triton (kernels/int8_gemm.py), or
    the CPU (torch's int32 product)."""
    if int8:
        if device.type == "cpu":
            return True, ""
        if device.type != "cuda" or torch.version.hip is not None:
            return False, "int8 products are supported on NVIDIA GPUs only here"
        if kernel_module("int8_gemm").triton is None:
            return False, "Triton is not importable, and the int8 products are its kernel"
        return True, ""
    if not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no fp8 matrix product (torch._scaled_mm)"
    if device.type == "cpu":
        if not _cpu_row_wise():
            return False, f"torch {torch.__version__} has no row-wise scaled fp8 matrix product on the CPU"
        return True, ""
    if device.type != "cuda" or torch.version.hip is not None:
        return False, "fp8 products are supported on NVIDIA GPUs only here"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return False, (f"this GPU (compute capability {major}.{minor}) has no row-wise fp8 products here; Hopper or "
                       "later")
    return True, ""


def _linear(layer: nn.Module) -> bool:
    """A layer whose forward is the product of its weight and its bias: nn.Linear, or ComfyUI's mixed-precision Linear
    (fusions/base.py's linear_layer) holding a 16-bit weight or a per-tensor e4m3 QuantizedTensor (the other layouts
    keep their own forward)."""
    if isinstance(layer, nn.Linear):
        return True
    w = getattr(layer, "weight", None)
    return (linear_layer(layer) and (type(w) in (torch.Tensor, nn.Parameter) or kitchen_e4m3(w) is not None)
            and getattr(layer, "pre_quant_scale", None) is None)  # an input smoothing its forward applies


def _plain(layer: nn.Module) -> bool:
    return (_linear(layer) and own_weights(layer) and layer.weight.dim() == 2
            and layer.in_features % 16 == 0 and layer.out_features % 16 == 0)


def projections(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """The block projections of a DiT that fp8 may take, each with whether it is a modulation projection."""
    out = []
    for block in model.modules():
        if type(block).__name__ not in BLOCKS:
            continue
        for name, layer in block.named_modules():
            if _linear(layer):
                out.append((layer, any(part in MODULATION for part in name.split("."))))
    return out


def apply(model: nn.Module, precision: str, undo: Undo, copies: Copies | None = None) -> int:
    """Mark the projections `precision` gives fp8 products, their operands kept in `copies` (the engine's, which
    outlive the marks); returns how many."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == "16bit":
        return 0
    chosen = [layer for layer, modulation in projections(model) if _plain(layer)
              and (stored_in_fp8(layer) or (precision in ("fp8", "int8") and not modulation))]
    if not chosen:
        return 0
    device = chosen[0].weight.device
    if precision == "int8":
        ok, why = supported(device, int8=True)
        if not ok:
            log.warning("sd-accel: int8 matrix products cannot run: %s; the projections run as the host's own layers.",
                        why)
            return 0
        if not supported(device)[0]:  # weights stored in e4m3 stay the host's where no fp8 product runs
            chosen = [layer for layer in chosen if not stored_in_fp8(layer)]
    else:
        ok, why = supported(device)
        if not ok:
            if precision == "fp8" or any(stored_in_fp8(layer) for layer in chosen):
                log.warning("sd-accel: fp8 matrix products cannot run: %s; the fp8 weights run through the host's own "
                            "layers (widened to 16 bits per call, or its own fp8 kernels).", why)
            return 0
    if not chosen:
        return 0
    copies = copies if copies is not None else Copies()
    copies.layers = chosen
    copies.int8 = precision == "int8"
    for layer in chosen:
        _MARKED[layer] = copies
        undo.add(lambda layer=layer: _MARKED.pop(layer, None))
        patch_forward(layer, _forward, undo)
    return len(chosen)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype in (torch.bfloat16, torch.float16) and x.dim() >= 2 and self in _MARKED:
        return matmul(x, self)
    return type(self).forward(self, x)


def _weight(layer: nn.Linear) -> _Weight:
    return _MARKED[layer].weight(layer)


def marked(layer: nn.Module) -> bool:
    return layer in _MARKED


def rows_dtype(layer: nn.Module) -> torch.dtype | None:
    """What a marked layer's products take their input rows in (e4m3, or int8 for a 16-bit weight under precision
    "int8"); None for a layer not marked."""
    copies = _MARKED.get(layer)
    if copies is None:
        return None
    return INT8 if copies.int8 and not stored_in_fp8(layer) else FP8


def takes_e4m3(layer: nn.Module) -> bool:
    """Whether a marked layer's products take e4m3 rows (what fp8 attention may write as its output)."""
    return rows_dtype(layer) == FP8


def takes_rows(x: torch.Tensor, *layers: nn.Module, dtype: torch.dtype = FP8) -> bool:
    """Whether the 16-bit activation x feeds only marked layers that take rows of `dtype`, so that a kernel may hand
    them such Rows (the fused kernels write e4m3 ones)."""
    return x.dtype in (torch.bfloat16, torch.float16) and bool(layers) and all(rows_dtype(layer) == dtype
                                                                               for layer in layers)


def quantized(x: torch.Tensor, gelu: bool = False, swiglu: bool = False, dtype: torch.dtype = FP8) -> Rows:
    """x (..., K) in 16 bits as Rows of `dtype` (e4m3 or int8); tanh-GELU'd first with gelu; with swiglu x is
    (..., 2K), the halves gate and up, and the Rows are SiLU(gate) * up's (kernels/quant.py)."""
    quant = kernel_module("quant")
    x2d = x.reshape(-1, x.shape[-1])
    fn = quant.quantize_rows if quant.supported(x2d) else quant.quantize_rows_ref
    q, s = fn(x2d, gelu, swiglu, dtype)
    return Rows(q, s, tuple(x.shape[:-1]), x.dtype)


def matmul(x: torch.Tensor | Rows, layer: nn.Linear, rows: slice = slice(None), cols: slice = slice(None),
           bias: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W[rows, cols].T (+ the bias's rows) as an fp8 product, for a marked layer; x (..., K) in 16 bits, or
    already quantized; the result in x's dtype (written into `out`, (M, N) contiguous, where given). rows and cols
    select output channels and input features (a split projection)."""
    entry = _weight(layer)
    w, scale = entry.q[rows, cols], entry.scale[:, rows]
    if w.dtype == INT8:
        return _int8_product(x, w, scale, layer.bias[rows] if bias and layer.bias is not None else None, out)
    x = x if isinstance(x, Rows) else quantized(x)
    b = layer.bias[rows].to(x.dtype) if bias and layer.bias is not None else None
    extra = {} if out is None else {"out": out}
    # The fp8 tensor cores accumulate with fewer bits than float32; without fast accumulation cuBLAS adds their partial
    # sums into float32 every few steps of K, a cost the product pays throughout, for a gain in accuracy far below
    # what rounding its operands to e4m3 has already lost (BENCHMARKS.md).
    key = (x.q.shape[0], x.q.shape[1], w.shape[0])
    if key not in _DECLINED:
        try:
            y = torch._scaled_mm(x.q, w.t(), scale_a=x.scale, scale_b=scale, bias=b, out_dtype=x.dtype,
                                 use_fast_accum=True, **extra)
            return y.view(*x.shape, y.shape[-1])
        except RuntimeError as e:
            if "CUBLAS_STATUS_NOT_SUPPORTED" not in str(e):
                raise
            _DECLINED.add(key)
    y = _widened_product(x, w, scale, b)
    if out is not None:
        y = out.copy_(y)
    return y.view(*x.shape, y.shape[-1])


def _int8_product(x: torch.Tensor | Rows, w: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None,
                  out: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ b) for int8 w (N, K) with its per-channel scale: x quantized to int8 rows, the product by
    kernels/int8_gemm.py on a GPU, torch's int32 product elsewhere."""
    if isinstance(x, Rows) and x.q.dtype != INT8:  # e4m3 rows made for another consumer: back to 16 bits first
        x = (x.q.float() * x.scale).to(x.dtype).view(*x.shape, -1)
    x = x if isinstance(x, Rows) else quantized(x, dtype=INT8)
    gemm = kernel_module("int8_gemm")  # both take a column slice of a weight (a split projection) as it is
    b = None if b is None else b.to(x.dtype).contiguous()
    if x.q.device.type == "cuda" and gemm.supported(x.q):
        y = gemm.int8_matmul(x.q, x.scale, w, scale, b, x.dtype, out=out)
    else:
        y = gemm.int8_matmul_ref(x.q, x.scale, w, scale, b, x.dtype)
        y = y if out is None else out.copy_(y)
    return y.view(*x.shape, y.shape[-1])


def _widened_product(x: Rows, w: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The fp8 product of x and w computed as a 16-bit one of the same e4m3 values (exact in 16 bits), scaled after,
    for a shape cuBLASLt declined."""
    y = torch.mm(x.q.to(x.dtype), w.t().to(x.dtype)).float() * x.scale * scale
    return (y if b is None else y + b).to(x.dtype)


def project(layer: nn.Module, x: torch.Tensor | Rows) -> torch.Tensor:
    """layer(x), for x a tensor or Rows a kernel quantized for it."""
    return matmul(x, layer) if isinstance(x, Rows) else layer(x)


def split_linear(layer: nn.Module, x: torch.Tensor | Rows, parts: tuple[int, ...]) -> list[torch.Tensor]:
    """layer(x) split into its output-channel `parts`, each computed as a product of its own (no strided slices of one
    output): plain layers through F.linear on weight row slices, marked ones as fp8 products (x quantized once);
    other layers run their forward once and are split."""
    edges = [0]
    for p in parts:
        edges.append(edges[-1] + p)
    spans = [slice(a, b) for a, b in zip(edges, edges[1:])]
    dtype = rows_dtype(layer)
    if isinstance(x, Rows) or (dtype is not None and takes_rows(x, layer, dtype=dtype)):
        x = x if isinstance(x, Rows) else quantized(x, dtype=dtype)
        return [matmul(x, layer, rows=s) for s in spans]
    if plain_linear(layer):
        b = layer.bias
        return [F.linear(x, layer.weight[s], None if b is None else b[s]) for s in spans]
    return list(layer(x).split(parts, dim=-1))

