"""ONNX Runtime's transformer optimizer on an exported UNet: its UNet fusions for the execution provider, then
fp16. ORT's own passes, run with sd-accel's speed-ups (each gives the model ORT's code gives: shape inference on a
view without the weights' bytes, node maps handed down, fp16 conversion on all cores without debug passes) and progress."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Iterator

import torch

from ..progress import NullProgress, Progress
from .export import META, SHAPE_VALUE_BYTES, _load, _patched, save_model

# fp16 conversion clamps to what fp16 holds; the weight map repeats the same conversion, so both must agree.
FP16_MIN_POSITIVE, FP16_MAX = 5.96e-08, 65504.0

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
        if init.data_type in floats and len(init.dims) >= 2 and 2 * math.prod(init.dims) > SHAPE_VALUE_BYTES:
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


def to_float16(a, min_positive_val: float = FP16_MIN_POSITIVE, max_finite_val: float = FP16_MAX):
    """onnxruntime.transformers.float16.convert_np_to_float16 for float32 values, the same bytes: magnitudes between 0
    and min_positive_val become min_positive_val, finite ones above max_finite_val become max_finite_val (signs kept;
    zeros, infinities and NaNs as they are), then IEEE rounding to fp16. ORT's version makes eight single-threaded
    numpy passes and four more for debug logging; these are torch's multi-threaded kernels (the fp16 step converts
    every weight of the model)."""
    import numpy as np

    with warnings.catch_warnings():  # a weight's read-only buffer (np.frombuffer): read here, never written
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        t = torch.from_numpy(np.ascontiguousarray(a, np.float32))
    size = t.abs()
    t = torch.where((size < min_positive_val) & (size > 0), torch.copysign(torch.tensor(min_positive_val), t), t)
    t = torch.where((size > max_finite_val) & (size < float("inf")), torch.copysign(torch.tensor(max_finite_val), t), t)
    return t.half().numpy()


@contextlib.contextmanager
def _fast_float16() -> Iterator[None]:
    """ORT's float16 module (under both names it is imported by) converts through to_float16."""
    import sys

    modules = [m for m in (sys.modules.get("float16"), sys.modules.get("onnxruntime.transformers.float16"))
               if m is not None and hasattr(m, "convert_np_to_float16")]
    with _patched(*[(m, "convert_np_to_float16", to_float16) for m in modules]):
        yield
