"""What every fusion shares: patching an instance's forward or a child module, with a way back; what the fusions
keep about a module; the helpers more than one fusion calls."""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
import types
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import host_attention
from ..attention import StandIn, reads, said
from ..host_attention import Attend

log = logging.getLogger("sd-accel")


def kernel_module(name: str) -> types.ModuleType:
    """kernels/<name>.py, imported when a fusion first needs it: Triton is slow to import and optional."""
    return importlib.import_module(f"....kernels.{name}", __package__)


class Undo:
    """Changes made to modules, undone in reverse order."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []

    def add(self, step: Callable[[], None]) -> None:
        self._steps.append(step)

    def __call__(self) -> None:
        while self._steps:
            self._steps.pop()()

    def __len__(self) -> int:
        return len(self._steps)


def patch_method(module: nn.Module, name: str, fn: Callable, undo: Undo) -> None:
    """Give one instance its own method; deleting the instance attribute brings back its class's (or the instance's
    own, where the host had given it one)."""
    undo.add(instance_attr(module, name))
    setattr(module, name, types.MethodType(fn, module))


def instance_attr(module: nn.Module, name: str) -> Callable[[], None]:
    """What puts module's own attribute `name` back as it is now: its value, or none (its class's shows again)."""
    had, before = name in module.__dict__, module.__dict__.get(name)
    return lambda: module.__dict__.__setitem__(name, before) if had else module.__dict__.pop(name, None)


def patch_forward(module: nn.Module, forward: Callable, undo: Undo) -> None:
    patch_method(module, "forward", forward, undo)


# What the fusions know about a module is kept here, keyed by the module, and never in its __dict__: that belongs to
# the host, which copies modules (a deep copy would carry entries that point at the original's weights) and reads
# their attributes, and undo would have to find every key again. A module the host drops takes its entries with it.
_PACKS: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()
_PROJECTIONS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
_SHORT_KEYS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def packs(model: nn.Module) -> list[Any]:
    """The packs made for the model's layers (packing.py), a list to update in place."""
    return _PACKS.setdefault(model, [])


def drop_packs(model: nn.Module) -> list[Any]:
    """Forget the model's packs; returns them."""
    return _PACKS.pop(model, [])


def projections(m: nn.Module) -> Any | None:
    """Where an attention module's projections read their packed weights (the qkv fusion's entry), or a joint
    attention stream's q, k and v, kept under its q projection (packing.pack_qkv), if anywhere."""
    return _PROJECTIONS.get(m)


def set_projections(m: nn.Module, entry: Any, undo: Undo) -> None:
    _PROJECTIONS[m] = entry
    undo.add(lambda: _PROJECTIONS.pop(m, None))


def mark_short_keys(m: nn.Module, undo: Undo) -> None:
    """Let `attend` run the attention kernel for this module's calls."""
    _SHORT_KEYS.add(m)
    undo.add(lambda: _SHORT_KEYS.discard(m))


def replace_child(parent: nn.Module, name: str, new: nn.Module, undo: Undo) -> None:
    old = parent._modules[name]
    parent._modules[name] = new
    undo.add(lambda: parent._modules.__setitem__(name, old))


def version(t: torch.Tensor) -> int | None:
    """t's version counter (in-place updates bump it), None for an inference tensor, which keeps none: how derived
    tensors (fp8 copies, widened copies) tell that their source changed in place."""
    return None if t.is_inference() else t._version


def own_weights(*layers: nn.Module) -> bool:
    """Layers whose weights have no per-call functions (lowvram, a LoRA applied per call), which only the host's
    forward applies in step."""
    return all(not getattr(layer, "weight_function", None) and not getattr(layer, "bias_function", None)
               for layer in layers)


def plain_weights(m: nn.Module) -> bool:
    """A layer whose forward uses its own weight and bias as stored: not ComfyUI's cast-on-the-fly or lowvram
    weight functions, which its forward applies and a fused kernel reading the weight directly would skip."""
    return not getattr(m, "comfy_cast_weights", False) and own_weights(m)


def forward_takes(m: nn.Module, *params: str) -> bool:
    """Whether the forward of m's class takes exactly these parameters (after self): the form a fusion restates."""
    return _parameters(type(m).forward) == ("self", *params)


@functools.lru_cache(maxsize=256)
def _parameters(fn: Callable) -> tuple[str, ...]:
    # once per function: the fusions ask at every resume (every sampling run), for each of thousands of modules
    return tuple(inspect.signature(fn).parameters)


def of_class(m: nn.Module, name: str, package: str, *attrs: str) -> bool:
    """Whether m's class is `name` from `package` (the module itself or one below it) and m has these attributes: how
    a fusion recognises the host class whose forward it restates, and not a look-alike of another library."""
    module = type(m).__module__
    return (type(m).__name__ == name and (module == package or module.startswith(package + "."))
            and all(hasattr(m, a) for a in attrs))


# the modules of ComfyUI's SD UNet classes, which the UNet fusions restate
COMFY_ATTENTION = "comfy.ldm.modules.attention"
COMFY_UNET = "comfy.ldm.modules.diffusionmodules.openaimodel"
# what the qkv fusion's forward reads of ComfyUI's CrossAttention (packing.project: its projections) and the forward it
# restates; the cross_attention fusion marks the modules that forward serves
CROSS_ATTENTION_ATTRS = ("heads", "attn_precision", "to_q", "to_k", "to_v", "to_out")
CROSS_ATTENTION_PARAMS = ("x", "context", "value", "mask", "transformer_options")

_DECLINED: set[type] = set()  # host classes a fusion declined, said once per process


def host_block(m: nn.Module, name: str, package: str, attrs: tuple[str, ...], params: tuple[str, ...]) -> bool:
    """Whether m is the host's class `name` from `package` (of_class) with every attribute in `attrs` and a forward
    taking exactly `params` (after self): what a fusion reads of the block it restates. A class of that name that
    lacks any of it has changed in the host: it is declined, said once in one line naming the class and the host's
    version, and the host's own forward runs for it."""
    if not of_class(m, name, package):
        return False
    missing = [a for a in attrs if not hasattr(m, a)]
    takes = _parameters(type(m).forward)[1:]
    if not missing and takes == params:
        return True
    cls = type(m)
    if cls not in _DECLINED:
        _DECLINED.add(cls)
        what = [f"it has no {', '.join(missing)}"] if missing else []
        if takes != params:
            what.append(f"its forward takes ({', '.join(takes)}), not ({', '.join(params)})")
        log.warning("sd-accel: %s.%s of %s is not the block sd-accel's fused kernels restate (%s); ComfyUI's own "
                    "forward runs for it.", cls.__module__, name, host_version(package), "; ".join(what))
    return False


def changed_host_block(m: nn.Module, name: str, package: str, attrs: tuple[str, ...], params: tuple[str, ...]) -> bool:
    """Whether m is the host's class `name` from `package` and host_block declines it: a fusion that also recognises
    other libraries' classes of that name (A1111's, Forge's, diffusers') by what they have must not take a changed
    ComfyUI class on one of those paths."""
    return of_class(m, name, package) and not host_block(m, name, package, attrs, params)


def host_version(package: str) -> str:
    """The host's version, for a message about one of its classes ("ComfyUI 0.33.0"), as far as it can be told."""
    if package.split(".")[0] != "comfy":
        return package
    try:
        return f"ComfyUI {importlib.import_module('comfyui_version').__version__}"
    except (ImportError, AttributeError):
        return "this ComfyUI"


def comfy_forward(m: nn.Module) -> bool:
    """A ComfyUI transformer module whose forward is (x, context, transformer_options), the form the fusions
    restate."""
    return forward_takes(m, "x", "context", "transformer_options")


def forge_plain(m: nn.Module) -> bool:
    """Forge's layer classes (backend.operations) when their forward is the plain op on their own weight and bias:
    no per-layer cast or streaming, no online LoRA, no fp8 scale."""
    return (hasattr(m, "parameters_manual_cast") and not m.parameters_manual_cast
            and not getattr(m, "forge_online_loras", None) and getattr(m, "scale_weight", None) is None
            and isinstance(getattr(m, "weight", None), torch.Tensor))


def linear_layer(m: nn.Module) -> bool:
    """nn.Linear (ComfyUI's cast-on-the-fly ones included), or ComfyUI's mixed-precision Linear, which is no nn.Linear:
    from 0.33 every Linear of a model loaded from a quantized checkpoint, its quantized layers (comfy-kitchen
    QuantizedTensor weights) and its 16-bit ones. Either's forward is the product of its weight, as the layer keeps it,
    and its bias: a fused forward may call it where it calls an nn.Linear (reading its weight takes plain_linear)."""
    cls = type(m)
    return isinstance(m, nn.Linear) or (cls.__name__ == "Linear" and cls.__module__ == "comfy.ops"
                                        and "MixedPrecisionOps" in cls.__qualname__)


def plain_linear(m: nn.Module) -> bool:
    """nn.Linear, or ComfyUI's or Forge's Linear without cast or weight functions: a forward that is F.linear of its
    own weight and bias. Any other subclass (a LoRA layer adds its own terms) is left to its forward."""
    return (type(m) is nn.Linear or (isinstance(m, nn.Linear) and hasattr(m, "comfy_cast_weights") and plain_weights(m))
            or (type(m).__name__ == "Linear" and hasattr(m, "in_features") and forge_plain(m)))


def plain_conv(conv: nn.Module) -> bool:
    """A Conv2d whose forward is F.conv2d of its own weight and bias."""
    return (isinstance(conv, nn.Conv2d) and conv.bias is not None and conv.padding_mode == "zeros"
            and plain_weights(conv))


def own_conv(conv: nn.Module) -> bool:
    """torch's or ComfyUI's Conv2d computing F.conv2d of its own weight and bias: a subclass that restates forward
    (a LoRA-compatible layer) is not."""
    return ((type(conv) is nn.Conv2d or (isinstance(conv, nn.Conv2d) and hasattr(conv, "comfy_cast_weights"))
             or (isinstance(conv, nn.Conv2d) and forge_plain(conv))) and plain_conv(conv))


def conv_without_bias(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)


def add_bias_residual_nchw(h: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None,
                           bias2: torch.Tensor | None = None) -> torch.Tensor:
    """h + bias (+ bias2, per channel) (+ residual) for channels_last (N, C, H, W) tensors, in one pass of the
    Triton kernel."""
    # channels_last (N, C, H, W) is (N, H, W, C) in memory: the bias runs along the last dimension of that view.
    nhwc = (0, 2, 3, 1)
    layernorm = kernel_module("layernorm")
    r = None if residual is None else residual.permute(nhwc)
    return layernorm.add_bias_residual(h.permute(nhwc), bias, r, bias2).permute(0, 3, 1, 2)


def bias_pass_runs(conv: nn.Module, x: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether conv(x)'s bias can be added in the bias kernel's pass over t, a channels_last tensor of its output's
    layout (the output itself, or the residual added to it)."""
    return (plain_conv(conv) and t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
            and not t.is_contiguous() and conv.weight.dtype == x.dtype and kernel_module("layernorm").supported(t))


def conv_add(conv: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """conv(x) + residual, with the conv's bias added in the residual's pass where the kernel runs on them."""
    if bias_pass_runs(conv, x, residual):
        return add_bias_residual_nchw(conv_without_bias(conv, x), conv.bias, residual)
    return conv(x) + residual


class SiLUForEmbeddings(nn.Module):
    """diffusers' ResnetBlock2D applies one `nonlinearity` to both norms' outputs (4-D) and to the time embedding
    (2-D). Where the groupnorm fusion put the SiLU into the norms, this takes the nonlinearity's place: the time
    embedding still needs it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.dim() == 4 else F.silu(x)


def attend(m: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor | None:
    """softmax(q k^T / sqrt(d)) v for (B, tokens, heads * d) q, k and v, as (B, Lq, heads * d), over a short key set
    (a text context) of a module the cross_attention fusion marked: through the Triton kernel where it is the faster,
    else on NVIDIA through PyTorch's flash kernel (heads up to 128 wide) or its memory-efficient one (wider) rather
    than cuDNN's. cuDNN's attention builds an execution plan per sequence length, some 55 ms at every new image size
    (SD1.5: 4 of its 8 per size are cross-attention's), and is no faster on 77 keys (BENCHMARKS.md, run S). None
    where the module is not marked or the call is not one of these."""
    if m not in _SHORT_KEYS or q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        return None
    (B, Lq, C), Lk = q.shape, k.shape[1]
    if C % heads or k.shape[2] != C or k.shape[0] != B or q.stride(-1) != 1 or k.stride(-1) != 1 \
            or v.stride(-1) != 1:
        return None
    d = C // heads
    qh, kh, vh = q.view(B, Lq, heads, d), k.view(B, Lk, heads, d), v.view(B, Lk, heads, d)
    attention = kernel_module("attention")
    if attention.covers(qh, kh):
        return attention.attention(qh, kh, vh).view(B, Lq, C)
    if not q.is_cuda or torch.version.hip is not None or Lk > attention.SHORT_KEYS:
        return None
    from ..attention import sdpa_kernels

    with sdpa_kernels("flash" if d <= 128 else "efficient"):
        out = F.scaled_dot_product_attention(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2))
    return out.transpose(1, 2).reshape(B, Lq, C)


# The flags by which ComfyUI's start-up chooses an attention function for the whole host, by the name its registry
# gives the function; the others come without one (sub-quadratic where its PyTorch attention is off, as on the CPU;
# xformers wherever it is installed)
COMFY_FLAGS = {"sage": "--use-sage-attention", "flash": "--use-flash-attention",
               "split": "--use-split-cross-attention", "comfy_kitchen_int8": "--use-ck-attention"}


def comfy_function(module_name: str, name: str = "optimized_attention") -> tuple[Callable | None, Callable | None]:
    """The attention function `name` of ComfyUI's `module_name` as it stands there (a StandIn, where one takes its
    place), and the host's function: the one a StandIn stands in for, else the same."""
    fn = getattr(sys.modules.get(module_name), name, None)
    return fn, fn.host if isinstance(fn, StandIn) else fn


def comfy_pytorch(fn: Callable | None) -> bool:
    """Whether `fn` is ComfyUI's PyTorch attention (its module's attention_pytorch; a StandIn is not): what
    comfy_choice names "pytorch", in one look-up rather than a scan of the registry, since the fused blocks ask at
    every call."""
    home = sys.modules.get(getattr(fn, "__module__", None) or "")
    return fn is not None and getattr(home, "attention_pytorch", None) is fn


def comfy_choice(fn: Callable | None) -> str | None:
    """The name ComfyUI's attention registry gives `fn` ("pytorch", "sage", "flash", "xformers", "split", "sub_quad")
    when it is one of ComfyUI's own attention functions that its start-up may choose for the whole host: a preference,
    not a patch. None for any other function (a node's own, put in a module's place). A ComfyUI from before the
    registry: its PyTorch attention alone."""
    if comfy_pytorch(fn):
        return "pytorch"
    home = sys.modules.get(getattr(fn, "__module__", None) or "")
    registry = getattr(home, "REGISTERED_ATTENTION_FUNCTIONS", None) or {}
    return next((name for name, f in registry.items()
                 if f is fn and getattr(home, getattr(f, "__name__", ""), None) is f), None)


# What leaves its call to the host where comfy_attention finds no function of ComfyUI's choice, in words: the fused DiT
# blocks (their host's whole forward runs), or the UNet's attention layers (qkv: the packed projections still run, the
# host's function gets the attention). {it}: what they call, {them}: what then computes the attention.
BLOCKS = "the blocks that call {it} run ComfyUI's own forward with {them}, not sd-accel's fused blocks"
LAYERS = "the attention layers that call {it} call {them} as ComfyUI's own forward does, not sd-accel's attention"


def comfy_attention(module_name: str, transformer_options: dict | None, name: str = "optimized_attention",
                    aside: str = BLOCKS) -> Callable | None:
    """The attention function ComfyUI's blocks of `module_name` call (its `name`; under a StandIn, the function it
    stands in for) when it is ComfyUI's choice for the whole host and no model patch overrides it for the call: the
    fused forwards then serve the call. None where they must leave it to the host's forward, said once per engine
    and reason (`aside`: what steps aside, BLOCKS or LAYERS)."""
    if "optimized_attention_override" in (transformer_options or {}):
        _aside("override", module_name, name, transformer_options["optimized_attention_override"], aside)
        return None
    _, fn = comfy_function(module_name, name)
    if comfy_choice(fn) is not None:
        return fn
    _aside("function", module_name, name, fn, aside)
    return None


def _aside(reason: str, module_name: str, name: str, fn: Callable | None, aside: str) -> None:
    """Say once per engine (attention.said) and reason that the calls of module_name's attention `name` step aside for
    `fn`: a model patch's override ("override") or the function found there ("function"). Never in a CUDA graph's
    capture (the call before it, outside, says it); the fused blocks ask at every call: when said, one set look-up."""
    key = (reason, module_name, name)
    keys = said()
    if key in keys or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return
    keys.add(key)
    where = f"{module_name}.{name}"
    if reason == "override":
        log.warning("sd-accel: a model patch sets optimized_attention_override (%s) for this call: in the calls that "
                    "carry it, %s; the rest of the engine still runs.", _named(fn),
                    aside.format(it=where, them="the override"))
        return
    comfy = (getattr(fn, "__module__", None) or "").startswith("comfy.")
    whose = "ComfyUI's function" if comfy else "another node's function"
    log.warning("sd-accel: %s is %s (%s), not ComfyUI's choice for the whole host: %s; the rest of the engine still "
                "runs.", where, whose, _named(fn), aside.format(it="it", them="it"))


def _named(fn: Callable | None) -> str:
    """A function as a message names it: its module and qualified name ("my_node.sage")."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else name


def reads_comfy_attention(module_name: str, name: str = "optimized_attention") -> None:
    """A patched forward reads the attention function `name` of ComfyUI's `module_name` at each call
    (comfy_attention)."""
    reads(module_name, name)


def comfy_attend(host: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ours: Attend,
                 ours_name: Callable[[], str], theirs: Attend) -> torch.Tensor:
    """ours(q, k, v) where `host` (a comfy_attention) is ComfyUI's PyTorch attention; else the faster of ours and
    theirs(q, k, v), host called in the form of q, k and v (host_attention.py). ours_name() says what ours runs."""
    if comfy_pytorch(host):
        return ours(q, k, v)
    return host_attention.attend(q, k, v, ours, ours_name, comfy_host(host, theirs))


def comfy_host(host: Callable, theirs: Attend) -> host_attention.Host:
    """ComfyUI's attention function `host`, its choice for the whole host, as host_attention takes it: `theirs`
    calls it in the form of the caller's q, k and v; the message says where it comes from."""
    name = comfy_choice(host)
    flag = COMFY_FLAGS.get(name)
    return host_attention.Host(host, name, f"ComfyUI's attention is {name}" + (f" ({flag})" if flag else ""), theirs)
