"""ONNX export of a canonical UNet and its ONNX Runtime transformer optimization (fusions, then fp16).

Export goes through the canonical signature `(x, timesteps, context[, y][, control residuals])` with dynamic
batch, height, width and tokens, in fp32, by the TorchScript exporter (`dynamo=False`): ONNX Runtime's UNet
fusions are written against the graphs it produces. What the exported model needs to be served (which inputs
it has, the latent size multiple) is written into the model's metadata, so a cached file is self-describing.

Attention is exported in the "classic" form (batched matmul, softmax, batched matmul over heads folded into the
batch), the one `fusion_attention_unet` recognises: with diffusers' SDPA processor that fusion crashes, with
`AttnProcessor` every fusion applies.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import BackendUnavailable
from ..progress import NullProgress, Progress
from ..models.spec import CanonicalUNet

OPSET = 17
# protobuf refuses to serialise a message over 2 GiB; above this the weights go to one external data file.
PROTOBUF_LIMIT = 2**31 - 1
# fp16 conversion clamps to what fp16 holds; the weight map repeats the same conversion, so both must agree.
FP16_MIN_POSITIVE, FP16_MAX = 5.96e-08, 65504.0
META = "sd_accel."

# Operators the ORT UNet fusions produce, counted after optimization.
FUSED_OPS = ("MultiHeadAttention", "Attention", "GroupNorm", "SkipGroupNorm", "BiasSplitGelu", "BiasAdd",
             "LayerNormalization", "SkipLayerNormalization", "NhwcConv", "Gelu")

# Which fusions each execution provider can run. The contrib operators NhwcConv, GroupNorm, SkipGroupNorm,
# BiasSplitGelu and BiasAdd have CUDA (and ROCm) kernels only; the CPU provider runs Attention,
# MultiHeadAttention with separate Q/K/V, (Skip)LayerNormalization and Gelu. "dml" is Olive's DirectML recipe
# for SD UNets (examples/directml/stable_diffusion/config_unet.json), with SkipGroupNorm (newer than that recipe)
# left out. MIGraphX compiles the graph itself and rejects most com.microsoft operators: no fusions.
_ALL_SD = ("enable_nhwc_conv", "enable_group_norm", "enable_skip_group_norm", "enable_bias_splitgelu",
           "enable_packed_qkv", "enable_packed_kv", "enable_bias_add")
FUSION_PROFILES: dict[str, dict[str, bool]] = {
    "cuda": {},
    "cpu": {k: False for k in _ALL_SD},
    "dml": {"enable_nhwc_conv": False, "enable_bias_splitgelu": False, "enable_bias_add": False,
            "enable_skip_group_norm": False, "enable_skip_layer_norm": False, "enable_bias_skip_layer_norm": False,
            "enable_qordered_matmul": False},
    "migraphx": {k: False for k in _ALL_SD + ("enable_attention", "enable_skip_layer_norm", "enable_layer_norm",
                                               "enable_bias_skip_layer_norm", "enable_gelu", "enable_bias_gelu")},
}


@dataclass(frozen=True)
class OnnxUNetInfo:
    """What an exported UNet takes, read back from its file."""

    inputs: tuple[str, ...]
    in_channels: int
    out_channels: int
    size_multiple: int  # latent height and width must be multiples of this
    control_outputs: int  # number of ControlNet skip residuals taken (0: exported without control)
    control_middle: bool
    float16: bool  # x, context, y and the output are fp16 (timesteps stay fp32)

    @property
    def has_y(self) -> bool:
        return "y" in self.inputs

    @property
    def has_control(self) -> bool:
        return self.control_outputs > 0 or self.control_middle


def control_input_names(outputs: int, middle: bool) -> list[str]:
    return [f"control_out_{i}" for i in range(outputs)] + (["control_mid"] if middle else [])


def size_multiple(unet: CanonicalUNet) -> int:
    """The factor latents must divide by: 2 ** the number of downsampling stages. Off the multiple, the traced
    upsamplers (which scale by 2 rather than to the skip's size) would not line up with the skips."""
    m = unet.unet
    if unet.spec.form == "diffusers":
        stages = sum(1 for b in m.down_blocks if getattr(b, "downsamplers", None))
    else:
        stages = sum(1 for s in m.input_blocks.modules() if type(s).__name__ == "Downsample")
    return 2**stages


def control_shapes(unet: CanonicalUNet, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                   y: torch.Tensor | None = None) -> tuple[list[torch.Size], torch.Size]:
    """Shapes of the ControlNet residuals for these inputs: one per skip connection (in the order of
    `control["output"]`) and the middle block's, read off a forward pass."""
    m = unet.unet
    skips: list[torch.Size] = []
    mid: list[torch.Size] = []
    if unet.spec.form == "diffusers":
        hooks = [m.conv_in.register_forward_hook(lambda mod, a, o: skips.append(o.shape))]
        hooks += [b.register_forward_hook(lambda mod, a, o: skips.extend(s.shape for s in o[1])) for b in m.down_blocks]
        hooks.append(m.mid_block.register_forward_hook(lambda mod, a, o: mid.append(o.shape)))
    else:
        hooks = [b.register_forward_hook(lambda mod, a, o: skips.append(o.shape)) for b in m.input_blocks]
        hooks.append(m.middle_block.register_forward_hook(lambda mod, a, o: mid.append(o.shape)))
    try:
        with torch.inference_mode():
            unet(x, timesteps, context, y)
    finally:
        for h in hooks:
            h.remove()
    return skips, mid[0]


@contextlib.contextmanager
def _patched(*changes: tuple[Any, str, Any]) -> Iterator[None]:
    """Set each (object, attribute, value) for the duration, then restore what was there."""
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
    for obj, name, value in changes:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in reversed(originals):
            setattr(obj, name, value)


def _math_sdpa(original):
    """scaled_dot_product_attention written the way diffusers' AttnProcessor computes it, heads folded into the
    batch, so that the exported graph has the pattern ORT's attention fusion matches."""

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if attn_mask is not None or is_causal or dropout_p or kwargs or query.dim() != 4:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, **kwargs)
        b, h, sq, d = query.shape
        # A Python number, not a traced shape expression: the fusion reads the scaling as a constant.
        scale = float(int(d)) ** -0.5 if scale is None else scale
        q = query.reshape(b * h, sq, d)
        k = key.reshape(b * h, key.shape[2], d)
        v = value.reshape(b * h, value.shape[2], value.shape[3])
        empty = torch.empty(b * h, sq, k.shape[1], dtype=q.dtype, device=q.device)
        probs = torch.baddbmm(empty, q, k.transpose(-1, -2), beta=0, alpha=scale).softmax(dim=-1)
        return torch.bmm(probs, v).reshape(b, h, sq, v.shape[-1])

    return sdpa


@contextlib.contextmanager
def classic_attention(unet: CanonicalUNet) -> Iterator[None]:
    """Attention in the classic form while exporting; the module's own processors are put back afterwards.

    diffusers: every processor is swapped for `AttnProcessor`. ldm (ComfyUI, A1111): their attention calls
    `torch.nn.functional.scaled_dot_product_attention`, which is replaced for the duration of the export."""
    m = unet.unet
    if unet.spec.form == "diffusers" and hasattr(m, "set_attn_processor"):
        from diffusers.models.attention_processor import AttnProcessor

        original = dict(m.attn_processors)
        m.set_attn_processor(AttnProcessor())
        try:
            yield
        finally:
            m.set_attn_processor(original)
        return
    F = torch.nn.functional
    with _patched((F, "scaled_dot_product_attention", _math_sdpa(F.scaled_dot_product_attention))):
        yield


@contextlib.contextmanager
def float32_weights(module: nn.Module) -> Iterator[None]:
    """The module in fp32 while exporting (the fusions and the fp16 pass expect an fp32 graph). Each tensor gets
    its own dtype back afterwards; fp16/bf16 -> fp32 -> fp16/bf16 is exact."""
    tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t.is_floating_point()]
    dtypes = [t.dtype for t in tensors]
    if all(d == torch.float32 for d in dtypes):
        yield
        return
    for t in tensors:
        t.data = t.data.float()
    try:
        yield
    finally:
        for t, d in zip(tensors, dtypes):
            t.data = t.data.to(d)


@contextlib.contextmanager
def _small_params_for_shape_inference() -> Iterator[None]:
    """The TorchScript exporter's whole-graph ONNX shape inference (run twice per export) given only the small
    parameters. Given all of them (3.4 GB for SD1.5) it took a third of the export's time; it reads values only to
    compute shapes, which no float weight of rank 2 or more feeds. The exported model is the same, node for node
    and byte for byte."""
    infer = torch._C._jit_pass_onnx_graph_shape_type_inference

    def light(graph, params: dict, opset: int):
        return infer(graph, {k: v for k, v in params.items() if not v.is_floating_point() or v.dim() < 2
                             or v.numel() * v.element_size() <= _SHAPE_VIEW_BYTES}, opset)

    with _patched((torch._C, "_jit_pass_onnx_graph_shape_type_inference", light)):
        yield


class _ExportForm(nn.Module):
    """The canonical call with flat tensor arguments, as torch.onnx.export wants them."""

    def __init__(self, unet: CanonicalUNet, has_y: bool, control_outputs: int, control_middle: bool) -> None:
        super().__init__()
        self.unet = unet
        self.has_y, self.control_outputs, self.control_middle = has_y, control_outputs, control_middle

    def forward(self, x, timesteps, context, *rest):
        y = rest[0] if self.has_y else None
        ctrl = list(rest[1:] if self.has_y else rest)
        control = None
        if ctrl:
            control = {"output": ctrl[:self.control_outputs],
                       "middle": ctrl[self.control_outputs:] if self.control_middle else []}
        return self.unet(x, timesteps, context, y, control)


def _external_bytes(model) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def save_model(model, path: Path, external: bool | None = None) -> Path:
    """Save an ONNX model; above the 2 GB protobuf limit (or when `external` is True) its weights go to one
    file beside it, `<name>.data`."""
    import onnx

    path = Path(path)
    if external is None:
        external = _external_bytes(model) >= PROTOBUF_LIMIT - 64 * 2**20  # headroom for the graph itself
    data = path.with_name(path.name + ".data")
    for stale in (path, data):
        if stale.exists():
            stale.unlink()
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=1024)
    else:
        onnx.save_model(model, str(path))
    return path


def _constant_head_reshapes(model) -> int:
    """Give the head-splitting Reshapes of the attention a constant shape [0, -1, heads, head_dim].

    ldm attention splits heads with `view(b, -1, heads, dim // heads)`, exported as a shape computed at run time;
    ORT's attention fusion reads the number of heads off a constant shape (what diffusers' reshape folds into)
    and leaves the attention unfused otherwise. 0 copies the batch, so the result is the same tensor."""
    import numpy as np
    from onnx import numpy_helper

    producer = {o: n for n in model.graph.node for o in n.output}
    weights = {i.name: i for i in model.graph.initializer}

    def constant(name: str):
        n = producer.get(name)
        if n is not None and n.op_type == "Constant" and n.attribute:
            return numpy_helper.to_array(n.attribute[0].t)
        return numpy_helper.to_array(weights[name]) if name in weights else None

    changed = 0
    for r in model.graph.node:
        if r.op_type != "Reshape":
            continue
        data, shape = producer.get(r.input[0]), producer.get(r.input[1])
        if data is None or shape is None or data.op_type != "MatMul" or shape.op_type != "Concat" \
                or len(shape.input) != 4 or data.input[1] not in weights:
            continue
        w, heads = weights[data.input[1]], constant(shape.input[2])
        if len(w.dims) != 2 or heads is None or heads.size != 1 or int(heads.item()) <= 0 \
                or w.dims[1] % int(heads.item()):
            continue
        h = int(heads.item())
        name = f"{r.name}/heads_shape"
        model.graph.initializer.append(numpy_helper.from_array(np.array([0, -1, h, w.dims[1] // h], np.int64), name))
        r.input[1] = name
        changed += 1
    return changed


def _set_metadata(model, values: dict[str, Any]) -> None:
    keep = [p for p in model.metadata_props if not p.key.startswith(META)]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    for k, v in values.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = META + k, str(v)


def export_onnx(unet: CanonicalUNet, folder: Path, opset: int = OPSET, control: bool = False,
                progress: Progress | None = None, name: str = "unet.onnx") -> Path:
    """Export `unet` to `folder/name` (fp32, dynamic batch/height/width/tokens) and return the path.

    control: add the ControlNet residuals as inputs (`control_out_<i>` per skip connection, `control_mid`); a
    caller without ControlNet feeds zeros. The module is left as it was: attention processors and dtypes are
    restored even when the export fails."""
    return save_model(export_model(unet, folder, opset, control, progress, name), Path(folder) / name)


def export_model(unet: CanonicalUNet, folder: Path, opset: int = OPSET, control: bool = False,
                 progress: Progress | None = None, name: str = "unet.onnx"):
    """export_onnx's model, in memory (an onnx.ModelProto holding its weights): a build that goes on to fuse it
    saves writing and reading it back (for SD1.5, 3.4 GB each way: 40 of the 90 s an export took on a CPU).
    torch.onnx writes its files into a folder under `folder` on the way, deleted before this returns."""
    import onnx

    progress = progress or NullProgress()
    progress.stage("export", total=1)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    spec = unet.spec
    multiple = size_multiple(unet)
    device = unet.device
    side = 2 * multiple
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, spec.in_channels, side, side, generator=g).to(device)
    t = torch.full((2,), 500.0, device=device)
    context = torch.randn(2, 77, spec.context_dim, generator=g).to(device)
    y = torch.randn(2, spec.adm_channels, generator=g).to(device) if spec.adm_channels else None

    names = ["x", "timesteps", "context"] + (["y"] if y is not None else [])
    args: list[torch.Tensor] = [x, t, context] + ([y] if y is not None else [])
    axes: dict[str, dict[int, str]] = {"x": {0: "batch", 2: "height", 3: "width"}, "timesteps": {0: "batch"},
                                       "context": {0: "batch", 1: "tokens"}, "y": {0: "batch"},
                                       "eps": {0: "batch", 2: "height", 3: "width"}}
    tmp = folder / (name + ".export")
    with float32_weights(unet.unet), classic_attention(unet):
        outputs, middle = 0, False
        factors: dict[str, int] = {}
        if control:
            skips, mid = control_shapes(unet, x, t, context, y)
            outputs, middle = len(skips), True
            for cname, shape in zip(control_input_names(outputs, middle), skips + [mid]):
                names.append(cname)
                args.append(torch.zeros(shape, device=device))
                axes[cname] = {0: "batch", 2: f"{cname}_height", 3: f"{cname}_width"}
                factors[f"{cname}_factor"] = side // shape[2]
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad(), \
                    _small_params_for_shape_inference():
                # Tracer warnings name data-dependent Python branches; the ones in the UNets are shape checks.
                warnings.simplefilter("ignore")
                torch.onnx.export(_ExportForm(unet, y is not None, outputs, middle), tuple(args), str(tmp / name),
                                  input_names=names, output_names=["eps"],
                                  dynamic_axes={k: v for k, v in axes.items() if k in names or k == "eps"},
                                  opset_version=opset, do_constant_folding=True, dynamo=False)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise BackendUnavailable(f"torch.onnx could not export this UNet ({type(e).__name__}: {e}).",
                                     "It runs on the torch path; report the model type to sd-accel.") from e
    # The TorchScript exporter writes one file per weight above 2 GB; gather them into one data file.
    model = onnx.load(str(tmp / name), load_external_data=True)
    if spec.form == "ldm":
        _constant_head_reshapes(model)
    geglu = sorted({m.proj.out_features for m in unet.unet.modules()
                    if type(m).__name__ == "GEGLU" and isinstance(getattr(m, "proj", None), nn.Linear)})
    _set_metadata(model, {"form": spec.form, "in_channels": spec.in_channels, "out_channels": spec.out_channels,
                          "size_multiple": multiple, "control_outputs": outputs, "control_middle": int(middle),
                          "geglu_widths": ",".join(map(str, geglu)), **factors})
    shutil.rmtree(tmp, ignore_errors=True)
    progress.advance()
    progress.done()
    return model


def _load(model_or_path, external: bool = False):
    import onnx

    if isinstance(model_or_path, (str, os.PathLike)):
        return onnx.load(str(model_or_path), load_external_data=external)
    return model_or_path


def model_info(model_or_path) -> OnnxUNetInfo:
    """The inputs and serving constraints of an exported (or optimized) UNet, from its graph and metadata."""
    import onnx

    model = _load(model_or_path)
    meta = {p.key[len(META):]: p.value for p in model.metadata_props if p.key.startswith(META)}
    if "size_multiple" not in meta:
        raise BackendUnavailable("this ONNX file was not exported by sd-accel (its metadata is missing).",
                                 "Delete it so that it is exported again.")
    x = next(i for i in model.graph.input if i.name == "x")
    return OnnxUNetInfo(
        inputs=tuple(i.name for i in model.graph.input), in_channels=int(meta["in_channels"]),
        out_channels=int(meta["out_channels"]), size_multiple=int(meta["size_multiple"]),
        control_outputs=int(meta["control_outputs"]), control_middle=bool(int(meta["control_middle"])),
        float16=x.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16)


# Hidden sizes (the GEGLU projection's width) that ORT's CUDA BiasSplitGelu kernel takes (onnxruntime-gpu 1.31.1
# refuses others: "hidden size should be 2560, 5120, 6144, 10240 or 12288"). SD1.x/2.x/SDXL widths are
# among them; other widths keep the unfused ops.
BIAS_SPLITGELU_WIDTHS = (2560, 5120, 6144, 10240, 12288)


def fusion_options(provider: str, fp16: bool, geglu_widths: tuple[int, ...] = ()):
    """ORT's FusionOptions for SD UNets, restricted to what `provider` can run. Packed Q/K/V only feed fp16
    attention kernels (as Microsoft's SD pipeline does), so an fp32 model keeps them separate."""
    from onnxruntime.transformers.fusion_options import FusionOptions

    if provider not in FUSION_PROFILES:
        raise ValueError(f"unknown provider {provider!r}; choose one of {', '.join(FUSION_PROFILES)}")
    options = FusionOptions("unet")
    for k, v in FUSION_PROFILES[provider].items():
        setattr(options, k, v)
    if not fp16:
        options.enable_packed_qkv = options.enable_packed_kv = False
    if any(w not in BIAS_SPLITGELU_WIDTHS for w in geglu_widths):
        options.enable_bias_splitgelu = False
    return options


class _StageBar:
    """The tqdm-like object ORT's UNet optimizer advances, reporting to our Progress instead of the console."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def update(self, n: int = 1) -> None:
        self.progress.advance(n)


# Initializers up to this many bytes, and all of rank < 2, are kept whole in the graph shape inference sees.
_SHAPE_VIEW_BYTES = 1024
_LEFT_OUT = "sd-accel: bytes left out for shape inference"


def _shape_view(model, concrete: bool = True):
    """The model as symbolic shape inference needs it: nodes and types, and initializers without the bytes of the
    large float weights (marked _LEFT_OUT). It copies the model it is given, and the initializers of every node
    it infers on its own, and ORT's UNet fusions run it five times: with the weights included that copying was a
    large share of the fusions' time. Shape inference reads no weight values: it ignores values of
    rank > 1 (see _light_shape_inference) and the ones it uses are small integer constants, kept here."""
    import onnx

    view = onnx.ModelProto()
    view.ir_version = model.ir_version
    view.opset_import.extend(model.opset_import)
    g, src = view.graph, model.graph
    g.name = src.name
    for part in ("node", "input", "output", "value_info"):
        getattr(g, part).extend(getattr(src, part))
    if concrete:
        _concrete_inputs(g, {p.key[len(META):]: p.value for p in model.metadata_props if p.key.startswith(META)})
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)
    for init in src.initializer:
        if init.data_type in floats and len(init.dims) >= 2 and 2 * math.prod(init.dims) > _SHAPE_VIEW_BYTES:
            t = g.initializer.add()
            t.name, t.data_type, t.doc_string = init.name, init.data_type, _LEFT_OUT
            t.dims.extend(init.dims)
        else:
            g.initializer.append(init)
    return view


# Sizes the shape view gives the dynamic inputs, in units of the model's size multiple for height and width:
# distinct, odd and unlike any channel count, so that two dimensions compare equal in the view only when they
# are equal for every input size. With symbols, ORT's shape inference builds and simplifies a sympy expression
# for every dimension after a strided conv or a resize (most of the time it took on SD1.5); with these it
# computes integers.
_VIEW_SIZES = {"batch": 3, "height": 9, "width": 11, "tokens": 77}


def _concrete_inputs(graph, meta: dict[str, str]) -> None:
    """Give the view's dynamic input dimensions the _VIEW_SIZES (control residual inputs: divided by their
    downscale factor); a model without sd-accel's metadata keeps its symbols."""
    if "size_multiple" not in meta:
        return
    multiple = int(meta["size_multiple"])
    sizes = {"batch": _VIEW_SIZES["batch"], "tokens": _VIEW_SIZES["tokens"],
             "height": _VIEW_SIZES["height"] * multiple, "width": _VIEW_SIZES["width"] * multiple}
    for i in graph.input:
        for d in i.type.tensor_type.shape.dim:
            name = d.dim_param
            if name in sizes:
                d.dim_value = sizes[name]
            elif name.endswith(("_height", "_width")) and f"{i.name}_factor" in meta:
                side = "height" if name.endswith("_height") else "width"
                d.dim_value = -(-sizes[side] // int(meta[f"{i.name}_factor"]))


@contextlib.contextmanager
def _light_shape_inference(concrete: bool = True) -> Iterator[None]:
    """ORT's OnnxModel.infer_runtime_shape run over _shape_view of the current graph (always a fresh one). Where
    shape inference asks for the value of a weight left out, it gets zeros of its shape: it only ever reads
    values to compute shapes, and drops those of rank > 1 (SymbolicShapeInference._get_int_or_float_values).
    concrete: the view's inputs get the _VIEW_SIZES (after the fusions, a graph with NhwcConv needs its symbols)."""
    import numpy as np
    from onnx import helper
    from onnxruntime.transformers.onnx_model_unet import UnetOnnxModel
    import shape_infer_helper  # ORT's transformers folder is on sys.path once onnxruntime.transformers is imported

    # ORT's transformer modules import each other by top-level name, so the classes to patch are the ones in
    # UnetOnnxModel's and the shape helper's bases, not those under onnxruntime.transformers.
    OnnxModel = next(c for c in UnetOnnxModel.__mro__ if "infer_runtime_shape" in c.__dict__)
    Shapes = next(c for c in shape_infer_helper.SymbolicShapeInferenceHelper.__mro__ if "_get_value" in c.__dict__)
    original_infer, original_value = OnnxModel.infer_runtime_shape, Shapes._get_value

    def infer_runtime_shape(self, dynamic_axis_mapping={}, update=False):  # noqa: B006 (ORT's signature)
        full = self.model
        self.model = _shape_view(full, concrete)
        try:
            return original_infer(self, dynamic_axis_mapping, True)
        finally:
            self.model = full

    def get_value(self, node, idx):
        init = self.initializers_.get(node.input[idx])
        if node.input[idx] not in self.sympy_data_ and init is not None and init.doc_string == _LEFT_OUT:
            return np.broadcast_to(np.zeros((), helper.tensor_dtype_to_np_dtype(init.data_type)), tuple(init.dims))
        return original_value(self, node, idx)

    with _patched((OnnxModel, "infer_runtime_shape", infer_runtime_shape), (Shapes, "_get_value", get_value)):
        yield


@contextlib.contextmanager
def _types_from_shape_view() -> Iterator[None]:
    """ORT's OnnxModel.convert_float_to_float16 runs symbolic shape inference on the whole model only to learn each
    tensor's element type (it drops the shapes): run it on _shape_view, which has every node and type but not the
    weights' bytes, which shape inference copied over and over (most of the fp16 step's time on SD1.5). Used with
    _light_shape_inference, which supplies zeros where a left-out weight's value is asked for."""
    import shape_infer_helper  # ORT's transformers folder is on sys.path once onnxruntime.transformers is imported

    helper = shape_infer_helper.SymbolicShapeInferenceHelper
    infer_shapes = helper.infer_shapes  # a staticmethod of its base: the plain function
    own = helper.__dict__.get("infer_shapes")  # restored as the descriptor it was, or removed

    def on_view(in_mp, *args, **kwargs):
        # with the inputs' symbolic sizes: on the fused graph, concrete ones leave an NhwcConv's input shape unknown
        return infer_shapes(_shape_view(in_mp, concrete=False), *args, **kwargs)

    helper.infer_shapes = staticmethod(on_view)
    try:
        yield
    finally:
        if own is None:
            del helper.infer_shapes
        else:
            helper.infer_shapes = own


@contextlib.contextmanager
def _group_norm_children_from_fusion_maps() -> Iterator[None]:
    """ORT's GroupNorm fusion looks for the SiLU's Mul below each candidate Add with find_first_child_by_type
    without the node maps it was handed, and that rebuilds the whole graph's input map for every node it visits
    (about 1000 times for SD1.5, a noticeable share of its fusions' time). A fusion pass changes no node until it
    ends (Fusion.apply removes and adds them after its loop), so the maps it was handed are the graph's."""
    import sys

    from onnxruntime.transformers.onnx_model_unet import UnetOnnxModel

    # ORT's modules import each other by top-level name: patch the class UnetOnnxModel's module uses.
    cls = getattr(sys.modules[UnetOnnxModel.__module__], "FusionGroupNorm", None)
    if cls is None or "fuse" not in cls.__dict__:
        yield
        return
    original = cls.fuse

    def fuse(self, add_node, input_name_to_nodes, output_name_to_node):
        model = self.model
        find = type(model).find_first_child_by_type
        model.find_first_child_by_type = lambda node, child_type, maps=None, recursive=True: find(
            model, node, child_type, input_name_to_nodes if maps is None else maps, recursive)
        try:
            return original(self, add_node, input_name_to_nodes, output_name_to_node)
        finally:
            del model.find_first_child_by_type

    with _patched((cls, "fuse", fuse)):
        yield


@contextlib.contextmanager
def _quiet_ort_transformers() -> Iterator[None]:
    """Drops the INFO and DEBUG records of ORT's transformer optimizer while it runs: a dozen lines per model
    ("Removed 54 Identity nodes", "Fused Gelu: 4") between sd-accel's progress lines. Its modules import each
    other by top-level name, so their loggers are not under "onnxruntime" and no logger level reaches them all:
    records are told apart by the file they come from. Its warnings still show."""
    import onnxruntime.transformers

    folder = os.path.dirname(os.path.abspath(onnxruntime.transformers.__file__)) + os.sep

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not os.path.abspath(record.pathname).startswith(folder)

    handlers = list(logging.getLogger().handlers)
    for h in handlers:
        h.addFilter(keep)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(keep)


def _fuse(model, provider: str, fp16: bool, progress: Progress):
    """optimize_model(model_type="unet", opt_level=0) with its fusion steps reported as progress."""
    with _light_shape_inference(), _group_norm_children_from_fusion_maps():
        return _fuse_steps(model, provider, fp16, progress)


def _fuse_steps(model, provider: str, fp16: bool, progress: Progress):
    from onnxruntime.transformers.onnx_model_unet import UnetOnnxModel
    from onnxruntime.transformers.optimizer import optimize_model

    meta = {p.key[len(META):]: p.value for p in model.metadata_props if p.key.startswith(META)}
    widths = tuple(int(w) for w in meta.get("geglu_widths", "").split(",") if w)
    options = fusion_options(provider, fp16, widths)
    progress.stage("fusion", total=18)  # UnetOnnxModel._optimize's step count
    if not hasattr(UnetOnnxModel, "_optimize"):  # another ORT version: the public call, without step progress
        m = optimize_model(model, model_type="unet", num_heads=0, hidden_size=0, opt_level=0,
                           optimization_options=options, use_gpu=provider != "cpu")
        progress.done()
        return m
    import onnxruntime

    m = UnetOnnxModel(model, 0, 0)
    m._optimize(options, _StageBar(progress))
    m.topological_sort()
    m.model.producer_name, m.model.producer_version = "onnxruntime.transformers", onnxruntime.__version__
    progress.done()
    return m


def time_embedding_nodes(model) -> list[str]:
    """Nodes from the timesteps input up to the first matmul: the sinusoidal embedding. These stay fp32: fp16
    holds 999.4 as 999.5, and sin/cos of timestep * frequency (arguments up to ~1000 rad) would be off by up to
    a quarter radian, where torch computes the embedding in fp32."""
    consumers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    seen: dict[str, None] = {}
    todo = ["timesteps"]
    while todo:
        for n in consumers.get(todo.pop(), []):
            if n.name in seen or n.op_type in ("Gemm", "MatMul", "FusedMatMul"):
                continue
            seen[n.name] = None
            todo.extend(n.output)
    return list(seen)


def optimize(onnx_path: Path, out_path: Path, fp16: bool, provider: str = "cuda",
             progress: Progress | None = None) -> Path:
    """ORT transformer fusions for `provider` ("cuda", "cpu", "dml", "migraphx"), then fp16 when asked; saved
    to out_path. onnx_path: an exported model's file, or the model (export_model)."""
    return save_model(optimized_model(onnx_path, fp16, provider, progress), Path(out_path))


def optimized_model(model_or_path, fp16: bool, provider: str = "cuda", progress: Progress | None = None):
    """optimize's model, in memory. A model passed in is changed in place (the fusions rewrite its graph).

    In fp16, x, context, y and the output become fp16 (Microsoft's SD pipeline uses keep_io_types=False), so the
    graph starts and ends without Cast nodes and the engine hands over the host's fp16 tensors as they are. Only
    `timesteps` stays fp32, with the sinusoidal embedding it feeds (see time_embedding_nodes)."""
    progress = progress or NullProgress()
    model = _load(model_or_path, external=True)
    metadata = list(model.metadata_props)
    with _quiet_ort_transformers():
        m = _fuse(model, provider, fp16, progress)
        if fp16:
            progress.stage("fp16", total=1)
            with _fast_float16(), _light_shape_inference(concrete=False), _types_from_shape_view():
                m.convert_float_to_float16(keep_io_types=["timesteps"], node_block_list=time_embedding_nodes(m.model),
                                           min_positive_val=FP16_MIN_POSITIVE, max_finite_val=FP16_MAX)
            progress.advance()
            progress.done()
    if not m.model.metadata_props:
        m.model.metadata_props.extend(metadata)
    return m.model


def fused_operator_counts(model_or_path) -> dict[str, int]:
    """How many of each fused operator the optimized graph holds."""
    counts = Counter(n.op_type for n in _load(model_or_path).graph.node)
    return {op: counts.get(op, 0) for op in FUSED_OPS}


def host_side_nodes(model_or_path) -> dict[str, int]:
    """What keeps parts of a graph off the GPU, counted in a graph (best: the one ORT saved through
    SessionOptions.optimized_model_filepath, after its own optimizations and partitioning):

    memcpy: MemcpyToHost/MemcpyFromHost nodes ORT inserted between providers. They break ORT's CUDA graph
        ("cannot use CUDA graph: not all nodes are on the CUDA EP") and add a synchronisation each.
    shape: nodes computing tensor shapes (Shape and everything fed only by shapes and constants). With dynamic
        axes every Reshape/Expand/Resize gets such a subgraph, which the CUDA provider prefers to run on the CPU
        (hence Memcpy nodes where it meets GPU tensors). With static dimensions ORT folds them away."""
    model = _load(model_or_path)
    constant = {i.name for i in model.graph.initializer}
    shape_valued: set[str] = set()
    shape_nodes = 0
    for n in model.graph.node:  # the graph is topologically sorted
        if n.op_type == "Constant":
            constant.update(n.output)
            continue
        ins = [i for i in n.input if i]
        from_shape = n.op_type == "Shape" or (
            any(i in shape_valued for i in ins) and all(i in shape_valued or i in constant for i in ins))
        if from_shape:
            shape_valued.update(n.output)
            shape_nodes += 1
    ops = Counter(n.op_type for n in model.graph.node)
    return {"memcpy": ops.get("MemcpyToHost", 0) + ops.get("MemcpyFromHost", 0), "shape": shape_nodes}


# Weight map: which module parameters each initializer of the optimized graph is made of, so that new weights
# (LoRA merged into the module) can replace the initializers without exporting and fusing again. The graph
# holds each parameter as is, transposed (MatMul), in NHWC (NhwcConv), reshaped, or packed with its siblings
# (Q/K/V of self attention, K/V of cross attention), in fp32 or fp16. Initializers are matched to parameters
# by the digest of their bytes under each of these transforms.


def _digest(a) -> str:
    import numpy as np

    return hashlib.blake2b(np.ascontiguousarray(a).data, digest_size=16).hexdigest()


def _transform(kind: str, arrays: list, heads: int):
    import numpy as np

    if kind == "same":
        return arrays[0]
    if kind == "t":
        return arrays[0].T
    if kind == "nhwc":
        return arrays[0].transpose(0, 2, 3, 1)
    ws = [a.T for a in arrays]  # Linear weights as MatMul holds them: (in, out)
    if kind == "stacked":  # Attention (CPU): [q | k | v]
        return np.stack(ws, axis=1)
    c, out = ws[0].shape  # packed for MultiHeadAttention: q/k/v interleaved per head
    return np.dstack([w.reshape(c, heads, out // heads) for w in ws]).reshape(c, -1)


def to_float16(a, min_positive_val: float = FP16_MIN_POSITIVE, max_finite_val: float = FP16_MAX):
    """onnxruntime.transformers.float16.convert_np_to_float16, the same bytes without its debug-logging passes:
    those index every positive and negative element four times each, dominated the weight map's time and slowed
    ORT's own fp16 conversion."""
    import numpy as np

    a = np.asarray(a)
    between = lambda lo, x, hi: np.logical_and(lo < x, x < hi)
    a = np.where(between(0, a, min_positive_val), min_positive_val, a)
    a = np.where(between(-min_positive_val, a, 0), -min_positive_val, a)
    a = np.where(between(max_finite_val, a, float("inf")), max_finite_val, a)
    a = np.where(between(float("-inf"), a, -max_finite_val), -max_finite_val, a)
    return np.float16(a)


@contextlib.contextmanager
def _fast_float16() -> Iterator[None]:
    """ORT's float16 module (under both names it is imported by) converts through to_float16."""
    import sys

    modules = [m for m in (sys.modules.get("float16"), sys.modules.get("onnxruntime.transformers.float16"))
               if m is not None and hasattr(m, "convert_np_to_float16")]
    with _patched(*[(m, "convert_np_to_float16", to_float16) for m in modules]):
        yield


def _as(a, dtype: str):
    import numpy as np

    if dtype == "float16":
        return to_float16(np.asarray(a, np.float32))
    return np.asarray(a, dtype)


def _candidates(module: nn.Module, params: dict) -> Iterator[tuple[str, tuple[str, ...], int]]:
    for name, p in params.items():
        yield "same", (name,), 0
        if p.dim() == 2:
            yield "t", (name,), 0
        if p.dim() == 4:
            yield "nhwc", (name,), 0
    for prefix, m in module.named_modules():
        heads = getattr(m, "heads", None)
        if not (heads and all(isinstance(getattr(m, k, None), nn.Linear) for k in ("to_q", "to_k", "to_v"))):
            continue
        q, k, v = (f"{prefix}.{p}.weight" for p in ("to_q", "to_k", "to_v"))
        if params[q].shape == params[k].shape == params[v].shape:
            yield "stacked", (q, k, v), heads
            yield "packed", (q, k, v), heads
        if params[k].shape == params[v].shape:
            yield "packed", (k, v), heads


@dataclass
class WeightMap:
    """initializer -> the ways it is made of parameters (several when equal bytes make it ambiguous)."""

    sources: dict[str, list[tuple[str, list[str], int]]]
    dtypes: dict[str, str]
    shapes: dict[str, list[int]]
    digests: dict[str, str]  # parameter -> digest of its fp32 bytes when the map was made
    unmapped: list[str] = field(default_factory=list)  # parameters found in no initializer

    def save(self, path: Path) -> Path:
        Path(path).write_text(json.dumps(self.__dict__))
        return Path(path)

    @classmethod
    def load(cls, path: Path) -> "WeightMap":
        return cls(**json.loads(Path(path).read_text()))


def _fp32(t: torch.Tensor):
    """One parameter as fp32 numpy, made when needed: all of SDXL's at once would be 10 GB of host memory."""
    return t.detach().float().cpu().numpy()


def weight_map(model_or_path, unet: CanonicalUNet) -> WeightMap:
    """Map the optimized graph's initializers to `unet`'s parameters; `unet` must hold the weights it was
    exported with."""
    import numpy as np
    from onnx import numpy_helper

    model = _load(model_or_path, external=True)
    arrays = [(init.name, numpy_helper.to_array(init)) for init in model.graph.initializer]
    arrays = [(name, a) for name, a in arrays if a.dtype.kind == "f" and a.size > 1]
    by_digest: dict[str, list[str]] = {}
    with _pool() as pool:
        for (name, _), digest in zip(arrays, pool.map(lambda item: _digest(item[1]), arrays)):
            by_digest.setdefault(digest, []).append(name)
    dtypes = {name: str(a.dtype) for name, a in arrays}
    shapes = {name: list(a.shape) for name, a in arrays}
    del arrays
    sizes = {(dtypes[n], int(np.prod(shapes[n]))) for n in dtypes}
    params = dict(unet.unet.named_parameters())

    def digests(candidate: tuple[str, tuple[str, ...], int]) -> list[tuple[str, str]]:
        """(dtype, digest) of the candidate's value in each dtype an initializer of its size has."""
        kind, names, heads = candidate
        numel = sum(params[n].numel() for n in names)
        wanted = sorted(d for d in set(dtypes.values()) if (d, numel) in sizes)  # none of that size: skip
        if not wanted:
            return []
        value = _transform(kind, [_fp32(params[n]) for n in names], heads)
        return [(dtype, _digest(_as(value, dtype))) for dtype in wanted]

    candidates = list(_candidates(unet.unet, params))
    sources: dict[str, list[tuple[str, list[str], int]]] = {}
    used: set[str] = set()
    with _pool() as pool:
        for (kind, names, heads), found in zip(candidates, pool.map(digests, candidates)):
            for dtype, digest in found:
                for init in by_digest.get(digest, []):
                    if dtypes[init] == dtype:
                        sources.setdefault(init, []).append((kind, list(names), heads))
                        used.update(names)
    return WeightMap(sources, {k: dtypes[k] for k in sources}, {k: shapes[k] for k in sources},
                     parameter_digests(unet), sorted(set(params) - used))


def refitted(model_path: Path, unet: CanonicalUNet, out: Path) -> Path:
    """The optimized model at `model_path` (with its weight map beside it) carrying `unet`'s weights, saved to `out`
    with a weight map for those weights: another checkpoint of the same architecture, without exporting and
    optimizing again. BackendUnavailable where the map cannot place the weights (then export again)."""
    wmap = WeightMap.load(weight_map_path(model_path))
    digests = parameter_digests(unet)
    write_initializers(model_path, refreshed_initializers(wmap, unet, digests), out)
    wmap.digests = {n: digests[n] for n in wmap.digests}
    wmap.save(weight_map_path(out))
    return out


def _pool() -> ThreadPoolExecutor:
    # numpy's passes, the hashing and torch's copies to the host all run outside the GIL
    return ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="sd-accel-weights")


def parameter_digests(unet: CanonicalUNet) -> dict[str, str]:
    """The digest of each parameter's fp32 bytes, as a weight map records them."""
    params = list(unet.unet.named_parameters())
    with _pool() as pool:
        return dict(zip((n for n, _ in params), pool.map(lambda p: _digest(_fp32(p)), (p for _, p in params))))


def write_initializers(model_path: Path, values: dict, out: Path) -> Path:
    """A copy of the model at `model_path` with `values` (initializer name -> array of its dtype and size) in place of
    those initializers, saved as `out` (a file of the same name in another folder). Weights kept in the model's
    external data file (as build_model saves a model with a weight map) are written straight into a copy of that
    file at their offsets, with only the small graph file parsed; a model holding them inline is loaded and saved
    whole (slower: the whole protobuf goes through Python)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model_path, out = Path(model_path), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(model_path), load_external_data=False)
    external: dict[str, tuple[int, int]] = {}
    data = model_path.with_name(model_path.name + ".data")
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            where = {e.key: e.value for e in init.external_data}
            if where.get("location") != data.name:
                external = {}
                break
            external[init.name] = (int(where.get("offset", 0)), int(where["length"]))
    if not external or out.name != model_path.name:
        model = onnx.load(str(model_path), load_external_data=True)
        for init in model.graph.initializer:
            if init.name in values:
                init.CopyFrom(numpy_helper.from_array(values[init.name], init.name))
        return save_model(model, out, external=True)
    for init in model.graph.initializer:
        if init.name in values and init.name not in external:
            init.CopyFrom(numpy_helper.from_array(values[init.name], init.name))
    target = out.with_name(out.name + ".data")
    for stale in (out, target):
        if stale.exists():
            stale.unlink()
    with open(data, "rb") as src, open(target, "wb") as dst:
        for name, (offset, length) in sorted(external.items(), key=lambda kv: kv[1][0]):
            if name in values:
                chunk = memoryview(np.ascontiguousarray(values[name])).cast("B")
            else:
                src.seek(offset)
                chunk = src.read(length)
            if len(chunk) != length:
                raise BackendUnavailable(f"the initializer {name} would change size ({length} -> {len(chunk)} bytes).",
                                         "Rebuild the engine (export and optimize again) for these weights.")
            dst.seek(offset)
            dst.write(chunk)
    onnx.save_model(model, str(out))
    return out


def weight_map_path(model_path: Path) -> Path:
    """Where the weight map of a model file lives: beside it."""
    return Path(model_path).with_name(Path(model_path).name + ".weights.json")


def refreshed_initializers(wmap: WeightMap, unet: CanonicalUNet, digests: dict[str, str] | None = None) -> dict:
    """New values of the initializers made of parameters that changed since the map was made ({} when none
    did). BackendUnavailable when a changed parameter is in no initializer, or an initializer's sources
    (equal at export) now disagree: then only a new export gives the right graph. digests: the parameters'
    digests, when the caller has them already."""
    import numpy as np

    params = dict(unet.unet.named_parameters())
    digests = digests if digests is not None else parameter_digests(unet)
    changed = {n for n in params if wmap.digests.get(n) != digests[n]}
    if not changed:
        return {}
    unknown = sorted(changed & set(wmap.unmapped) | changed - set(wmap.digests))
    if unknown:
        raise BackendUnavailable(f"changed weights {unknown[:3]} have no counterpart in the optimized ONNX graph.",
                                 "Rebuild the engine (export and optimize again) for these weights.")

    def value(init: str, sources: list) -> np.ndarray:
        # Bytes, not shapes, are compared: a 1x1 convolution is the same tensor in NCHW and NHWC.
        values = [np.ascontiguousarray(_as(_transform(kind, [_fp32(params[n]) for n in names], heads),
                                           wmap.dtypes[init])).reshape(wmap.shapes[init])
                  for kind, names, heads in sources]
        if any(not np.array_equal(v, values[0]) for v in values[1:]):
            raise BackendUnavailable(f"the initializer {init} was shared by weights that now differ.",
                                     "Rebuild the engine (export and optimize again) for these weights.")
        return values[0]

    todo = [(init, sources) for init, sources in wmap.sources.items()
            if any(changed & set(names) for _, names, _ in sources)]
    with _pool() as pool:
        return dict(zip((init for init, _ in todo), pool.map(lambda job: value(*job), todo)))
