"""The torch path: best attention kernel for the GPU, channels_last, per-shape CUDA/HIP graphs, optional
torch.compile. The fallback for every other path, so it must run wherever torch runs.

Everything it changes on the user's module is recorded and undone by `release()`, like ComfyUI's
ModelPatcher: attention processors, the memory format of the weights and the fused kernels. `suspend()` undoes
the same changes but keeps the CUDA graphs, so a host's next sampling run replays them after `resume()`.

A captured graph replays the memory it was captured with, so every tensor it reads that is derived from the weights
is either updated in place when the weights change (the graph stays valid, no new capture) or part of the token that
decides a recapture (`_weights.token()`: the address of every parameter and buffer, and the set of them):
- the weights themselves, fp8-stored ones included, and the host's buffers: in the token; in-place updates (A1111's
  LoRA merge, ComfyUI's weight_inplace_update) are read by the replay as they are;
- packed projections (fusions/packing.py): the layers' weights are views of the pack, so in-place updates write
  where the packed GEMM reads; a replaced Parameter is no view any more and its layer runs on its own (and changes
  the token); the packs outlive suspend() and are unpacked by release();
- fp8 copies of 16-bit weights and every fp8 layer's scales (fp8.Copies): kept by the engine across suspend(),
  quantized again in place before each replay when their weight changed (object, address or version) or the host
  said so (`weights_changed`);
- 16-bit copies of a UNet's fp8-stored weights (widen.Widened): kept by the engine across suspend(), which gives the
  layers their fp8 weights back; widened again in place when their source changed or the host said so;
- folded biases, the time embedding's SiLU and shared K/V or time projections (fusions/resnet.py, packing.py): made
  from the parameters inside each call, so they are part of what the graph captured, not kept tensors;
- norm weights cast to the activations' dtype (fusions/transformer.py): cast inside each call, likewise.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ...models.dit import CanonicalDiT
from ...models.spec import CanonicalUNet
from ...plan.options import Runtime, TorchOptions
from ...progress import NullProgress, Progress
from ..attention import FlashAttnProcessor, read, said_by, sdpa_kernels
from ..graphs import GraphCache, WeightsWatch
from ..stack_graphs import StackGraphs

log = logging.getLogger("sd-accel")

# Blocks that repeat through the UNet or DiT (diffusers, ldm and ComfyUI names): compiling each of them rather than the whole
# model lets one compiled graph serve every instance of the same shape, so compile time is a fraction.
REPEATED_BLOCKS = ("BasicTransformerBlock", "ResnetBlock2D", "ResBlock", "Transformer2DModel", "SpatialTransformer",
                   "DoubleStreamBlock", "SingleStreamBlock", "JointBlock", "FluxTransformerBlock",
                   "FluxSingleTransformerBlock", "JointTransformerBlock", "WanAttentionBlock",
                   "QwenImageTransformerBlock")


def available(gpu) -> tuple[bool, str]:
    return True, "PyTorch runs on every device"


def build(unet: "CanonicalUNet | CanonicalDiT", options: TorchOptions | None = None, runtime: Runtime | None = None,
          progress: Progress | None = None) -> "TorchEngine":
    """The torch path on `unet` (changed in place, each change with its undo). The default options change nothing
    but the attention kernel: accel.plan.policy chooses what the GPU supports."""
    return TorchEngine(unet, options or TorchOptions(), progress or NullProgress())


def _flatten_control(control: dict | None) -> tuple[list[torch.Tensor], tuple]:
    """ControlNet residuals as a flat tensor list plus the structure to rebuild them (None entries kept)."""
    if not control:
        return [], ()
    tensors, layout = [], []
    for name in sorted(control):
        row = []
        for t in control[name]:
            row.append(t is not None)
            if t is not None:
                tensors.append(t)
        layout.append((name, tuple(row)))
    return tensors, tuple(layout)


def _unflatten_control(tensors: list[torch.Tensor], layout: tuple) -> dict | None:
    if not layout:
        return None
    it = iter(tensors)
    return {name: [next(it) if present else None for present in row] for name, row in layout}


def _strides(shape: torch.Size, memory_format: torch.memory_format) -> tuple[int, ...]:
    return torch.empty(shape, device="meta", memory_format=memory_format).stride()


def restride_tensors(tensors: list[torch.Tensor], memory_format: torch.memory_format) -> None:
    """Rewrite each tensor's values in `memory_format` inside its own storage: unlike `Module.to(memory_format=)`,
    the tensor keeps its address, so CUDA graphs captured on it stay valid, and nothing is allocated but one
    tensor's worth of scratch at a time."""
    with torch.no_grad():
        for t in tensors:
            values = t.detach().clone()
            t.data = values.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                              _strides(t.shape, memory_format))
            t.data.copy_(values)


def restride(module: torch.nn.Module, memory_format: torch.memory_format) -> list[torch.Tensor]:
    """The module's contiguous 4-D parameters and buffers, rewritten in `memory_format` in place (see
    restride_tensors); returns them, for the way back.

    A 1x1 convolution's weight is contiguous in both formats, but only explicit channels_last strides make
    a convolution of NCHW input (ComfyUI's SpatialTransformer hands its proj_out one) return channels_last, as
    `Module.to(memory_format=)` does; with plain strides the rest of the UNet would run on NCHW."""
    tensors = [t for t in (*module.parameters(), *module.buffers())
               if t.dim() == 4 and t.is_contiguous() and t.stride() != _strides(t.shape, memory_format)]
    restride_tensors(tensors, memory_format)
    return tensors


class TorchEngine:
    backend = "torch"

    def __init__(self, unet: "CanonicalUNet | CanonicalDiT", options: TorchOptions, progress: Progress) -> None:
        self.unet = unet
        self.options = options
        module = unet.unet
        self._undo: list = []
        self.on_gpu = unet.device.type == "cuda"
        self.suspended = False
        self.fusion_counts: dict[str, int] | None = None  # modules each fused kernel took, once applied
        self._fp8 = None  # the fp8 operands (accel/engine/fp8.py Copies) of a transformer's marked projections
        self._widened = None  # a UNet's fp8-stored weights as 16-bit copies (accel/engine/widen.py)
        self._layout_at_suspend: list | None = None
        self.said: set = set()  # what the patched forwards said once (attention.said_by), said once for this engine
        self._stack_applied = False  # the block stack's method replays graphs (stack_graphs.py)
        progress.stage("prepare torch path", total=3)
        if options.precision in ("fp8", "int8") and isinstance(unet, CanonicalUNet):
            log.warning("sd-accel: precision %s is for the diffusion transformers; this UNet computes in %s as "
                        "before (fp8 could not make SD1.x or SDXL much faster: BENCHMARKS.md, \"fp8 for the UNets\").",
                        options.precision, str(unet.dtype).removeprefix("torch."))
        self._weights = WeightsWatch(module)
        graphs = options.cuda_graphs and self.on_gpu
        # A model whose whole forward cannot be captured may have a block stack that can (stack_graphs.py): its graphs
        # are made in _apply, with the fused blocks they capture.
        self._stack: StackGraphs | None = None
        if graphs and unet.uncapturable and isinstance(unet, CanonicalDiT):
            self._stack = StackGraphs(lambda: (self._weights.token(), read()), self._refresh_fp8, options.max_graphs)
        self._apply(progress)
        self._forward = unet
        if self._stack is not None and self._stack_applied:
            log.info("sd-accel: %s; CUDA graphs capture its block stack, the rest of each call runs without them.",
                     unet.uncapturable)
            self.graphs = self._stack.graphs
        else:
            if graphs and unet.uncapturable:
                log.warning("sd-accel: %s; this model runs without CUDA graphs.", unet.uncapturable)
                graphs = False
            self._stack = None
            self.graphs = GraphCache(self._graph_fn, max_graphs=options.max_graphs,
                                     run_first=self._compiling_ahead) if graphs else None
        self._layout: tuple = ()
        progress.advance()
        progress.done()

    def _apply(self, progress: Progress) -> None:
        """Make every change to the module, each with its undo step in self._undo."""
        options, module = self.options, self.unet.unet
        widened = 0
        if options.triton_kernels and not options.compile and isinstance(self.unet, CanonicalUNet):
            # first: the copies are what channels_last restrides and the fusions take
            from .. import widen
            from ..fusions.base import Undo

            if self._widened is None:
                self._widened = widen.Widened()
            marks = Undo()
            widened = self._widened.apply(module, self.unet.dtype, marks)
            self._undo.append(marks)
        if options.attention == "flash_attn" and isinstance(self.unet, CanonicalUNet) \
                and self.unet.spec.form == "diffusers":
            try:
                original = dict(module.attn_processors)
                module.set_attn_processor(FlashAttnProcessor())
                self._undo.append(lambda: module.set_attn_processor(original))
            except ImportError:
                log.warning("sd-accel: flash_attn is not importable; using PyTorch's flash attention instead.")
                self.options = options = dataclasses.replace(options, attention="flash")
        progress.advance()
        if options.channels_last and self.on_gpu:
            converted = restride(module, torch.channels_last)
            self._undo.append(lambda: restride_tensors(converted, torch.contiguous_format))
        progress.advance()
        if options.cudnn_benchmark and self.on_gpu:
            # Asked for: time every cuDNN algorithm at each new shape, not only the first 10 of its heuristic list.
            previous = torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit
            torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit = True, 0
            self._undo.append(lambda: (setattr(torch.backends.cudnn, "benchmark", previous[0]),
                                       setattr(torch.backends.cudnn, "benchmark_limit", previous[1])))
        # Inductor makes its own fused kernels for compiled blocks; ours would only be traced through.
        # The policy allows the kernels only where Triton runs (a GPU, or its interpreter on the CPU for tests).
        if options.triton_kernels and not options.compile:
            from .. import fusions

            undo, counts = fusions.apply(module, options.fusions)
            self._undo.append(undo)
            if widened:
                counts["fp8-stored layers widened"] = widened
            if isinstance(self.unet, CanonicalDiT):
                from .. import fp8

                marks = fusions.Undo()
                if self._fp8 is None:
                    self._fp8 = fp8.Copies()
                counts["fp8"] = fp8.apply(module, options.precision, marks, self._fp8)
                self._undo.append(marks)
            if self.fusion_counts is None:
                log.info("sd-accel: fused kernels in %s", ", ".join(f"{n} {k}" for k, n in counts.items()))
            self.fusion_counts = counts
            if self._stack is not None:
                stack = fusions.block_stack(module)
                self._stack_applied = stack is not None
                if stack is not None:
                    marks = fusions.Undo()
                    self._stack.apply(module, stack, marks)
                    self._undo.append(marks)
        if options.compile:
            self._compile_blocks(module)

    def _refresh_fp8(self) -> None:
        if self._fp8 is not None:
            self._fp8.refresh()

    def _undo_changes(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _tensor_layout(self) -> list:
        return [(t.data_ptr(), t.stride()) for t in self._weights.tensors()]

    def suspend(self) -> None:
        """Undo every change to the module (a host's other models share it) but keep the CUDA graphs.

        The graphs read the weights where they were at capture; the memory format is changed inside each
        tensor's own storage, so resume() puts every weight back where the graphs read it and they replay
        with no new capture. Weights the host replaced or moved meanwhile are seen on resume(), which then
        drops the graphs."""
        if self.suspended:
            return
        self._layout_at_suspend = self._tensor_layout() if self.graphs is not None and len(self.graphs) else None
        self._undo_changes()
        self.suspended = True

    def resume(self) -> None:
        """Redo what suspend() undid; keep the graphs only when every weight is where they read it."""
        if not self.suspended:
            return
        self._apply(NullProgress())
        self.suspended = False
        if self._layout_at_suspend is not None and self._tensor_layout() != self._layout_at_suspend:
            self.graphs.clear()
        self._layout_at_suspend = None

    def weights_changed(self) -> None:
        """The host says the module's weights changed (its patches did): derived tensors whose sources may not show
        it (inference tensors keep no version) are made again, in place, before the next call."""
        if self._fp8 is not None:
            self._fp8.stale()
        if self._widened is not None:
            self._widened.stale()

    def _compile_blocks(self, module: torch.nn.Module) -> None:
        blocks = [m for m in module.modules() if type(m).__name__ in REPEATED_BLOCKS]
        # A block inside a compiled block is traced with its parent.
        inner = {id(c) for b in blocks for c in b.modules() if c is not b}
        # Every distinct block shape is one cache entry of the shared code; SD1.5 has ~20, SDXL more.
        import torch._dynamo

        cfg = torch._dynamo.config
        cfg.cache_size_limit = max(cfg.cache_size_limit, 128)
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 1024)
        for b in blocks:
            if id(b) not in inner:
                b.compile(dynamic=False)
                self._undo.append(lambda b=b: setattr(b, "_compiled_call_impl", None))

    def _run(self, x, timesteps, context, y=None, control=None, guidance=None, **kwargs) -> torch.Tensor:
        if self.options.channels_last and self.on_gpu:
            x = x.contiguous(memory_format=torch.channels_last)
        extra = {"guidance": guidance} if guidance is not None else {}
        with torch.inference_mode(), said_by(self.said):
            if not x.is_cuda:  # the SDPA choice is for CUDA/ROCm; other devices keep their own kernels
                return self._forward(x, timesteps, context, y, control, **extra, **kwargs)
            with sdpa_kernels(self.options.attention):
                return self._forward(x, timesteps, context, y, control, **extra, **kwargs)

    def _compiling_ahead(self, fn, *args, **kwargs) -> torch.Tensor:
        """fn(*args, **kwargs) with the Triton kernels it has not compiled yet compiled in parallel first (a new
        image size on a fresh machine), when the fused kernels run on a GPU. Only a plain call (no host patches in
        kwargs, which may keep state between calls) is run twice."""
        if kwargs or not (self.options.parallel_compile and self.options.triton_kernels and self.on_gpu
                          and args[0].is_cuda):
            return fn(*args, **kwargs)
        from ....kernels import ahead

        shape = tuple(args[0].shape)
        return ahead.call(fn, *args, **kwargs, on_compile=lambda n: log.info(
            "sd-accel: compiling %d kernels for input %s, in parallel (once per machine; Triton keeps them on disk)",
            n, shape))

    def _graph_fn(self, x, timesteps, context, *rest) -> torch.Tensor:
        has_y, has_guidance, control_layout = self._layout
        rest = list(rest)
        y = rest.pop(0) if has_y else None
        guidance = rest.pop(0) if has_guidance else None
        return self._run(x, timesteps, context, y, _unflatten_control(rest, control_layout), guidance)

    def __call__(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                 y: torch.Tensor | None = None, control: dict | None = None, guidance: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor:
        self.resume()
        if self._widened is not None:
            self._widened.refresh()
        dtype = self.unet.dtype
        x_in, ctx = x.to(dtype), context.to(dtype)
        y = None if y is None else y.to(dtype)
        if timesteps.dim() == 0:
            timesteps = timesteps.expand(x.shape[0])
        if guidance is not None and guidance.dim() == 0:
            guidance = guidance.expand(x.shape[0])
        if self.graphs is None or self._stack is not None or kwargs or not x.is_cuda or not self.unet.device == x.device:
            return self._compiling_ahead(self._run, x_in, timesteps, ctx, y, control, guidance, **kwargs).to(x.dtype)
        ctrl, layout = _flatten_control(control)
        self._layout = (y is not None, guidance is not None, layout)
        tensors = ([x_in, timesteps, ctx] + ([y] if y is not None else []) + ([guidance] if guidance is not None else [])
                   + [c.to(dtype) for c in ctrl])
        if self._fp8 is not None:
            self._fp8.refresh()
        # The layout is part of the signature: the same shapes with another control structure is another graph; so
        # are the host attention functions the fused forwards read (a graph replays the one they chose to run).
        sig_token = (self._weights.token(), self._layout, read())
        return self.graphs(tensors, sig_token).to(x.dtype)

    def release(self) -> None:
        """Frees every graph and undoes what was changed on the module (in reverse order)."""
        if self.graphs is not None:
            self.graphs.clear()
        self._undo_changes()
        if self._fp8 is not None:
            self._fp8.clear()
        self._widened = None
        # Packed projection weights outlive suspend() (the graphs read them where they are); not release().
        from ..fusions import packing

        packing.unpack(self.unet.unet)
        self.suspended = False
        if self.on_gpu:
            # The graphs' warm-up stream got cuBLAS workspaces of its own; they would outlive the engine.
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()
