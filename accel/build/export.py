"""ONNX export of a canonical UNet (torch -> ONNX): the first stage of the ONNX Runtime path.

Export goes through the canonical signature `(x, timesteps, context[, y][, control residuals])` with dynamic
batch, height, width and tokens, in fp32, by the TorchScript exporter (`dynamo=False`): ONNX Runtime's UNet
fusions (ort_optimize.py) are written against the graphs it produces. What the exported model needs to be served
(which inputs it has, the latent size multiple) is written into the model's metadata, so a cached file is
self-describing.

Attention is exported in the "classic" form (batched matmul, softmax, batched matmul over heads folded into the
batch), the one `fusion_attention_unet` recognises: with diffusers' SDPA processor that fusion crashes, with
`AttnProcessor` every fusion applies.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import BackendUnavailable
from ..models.spec import CanonicalUNet
from ..progress import NullProgress, Progress

OPSET = 17
# protobuf refuses to serialise a message over 2 GiB; above this the weights go to one external data file.
PROTOBUF_LIMIT = 2**31 - 1
META = "sd_accel."
# Shape inference reads values only to compute shapes, which no float tensor of rank 2 or more over this many bytes
# feeds: the exporter's and ORT's shape inference are given such weights without their bytes.
SHAPE_VALUE_BYTES = 1024


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
                             or v.numel() * v.element_size() <= SHAPE_VALUE_BYTES}, opset)

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
