"""The ONNX Runtime path on the CPU: export + ORT fusions compute the torch function, every fusion the structure
implies is applied, the user's module is left as it was, shape subgraphs fold away with static shapes, LoRA
weights are swapped without a rebuild, and every way it cannot run says what to do."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from sd_accel.accel.build import export, ort_optimize, weights  # noqa: E402
from sd_accel.accel.engine.backends import onnxruntime as ortb  # noqa: E402
from sd_accel.accel.models.configs import build_unet, example_inputs  # noqa: E402
from sd_accel.accel.plan.device import GpuInfo, cpu_info  # noqa: E402
from sd_accel.accel.errors import BackendUnavailable  # noqa: E402
from sd_accel.accel.models.spec import CanonicalUNet  # noqa: E402
from sd_accel.accel.plan.options import OrtOptions, Runtime  # noqa: E402
from ldm_unet import tiny_ldm_unet  # noqa: E402

CPU = Runtime(gpu=cpu_info())
NVIDIA = GpuInfo("nvidia", "hopper", name="H100", device="cuda:0")
AMD = GpuInfo("amd", "cdna3", name="MI300X", device="cuda:0")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class Stages:
    def __init__(self) -> None:
        self.names: list[str] = []

    def stage(self, name: str, total: int = 1) -> None:
        self.names.append(name)

    def advance(self, n: int = 1) -> None:
        pass

    def done(self) -> None:
        pass


def structure(module: nn.Module) -> dict[str, int]:
    names = [type(m).__name__ for m in module.modules()]
    return {"blocks": names.count("BasicTransformerBlock"),
            "transformers": names.count("Transformer2DModel") + names.count("SpatialTransformer"),
            "groupnorms": sum(isinstance(m, nn.GroupNorm) for m in module.modules()),
            "convs": sum(isinstance(m, nn.Conv2d) for m in module.modules()),
            "splitgelu": all(m.proj.out_features in ort_optimize.BIAS_SPLITGELU_WIDTHS
                             for m in module.modules() if type(m).__name__ == "GEGLU")}


def expected_fusions(module: nn.Module, provider: str) -> dict[str, int]:
    """What ORT's UNet fusions must produce for this module. Every transformer block has self and cross attention,
    three LayerNorms (each a SkipLayerNormalization except the first of a transformer, which follows proj_in)
    and a GEGLU. The feed-forward output of a transformer's last block becomes BiasAdd (the others fold into the
    next block's SkipLayerNormalization)."""
    s = structure(module)
    n, t = s["blocks"], s["transformers"]
    counts = dict.fromkeys(ort_optimize.FUSED_OPS, 0)
    counts.update(LayerNormalization=t, SkipLayerNormalization=3 * n - t)
    if provider == "cuda" and s["splitgelu"]:
        counts.update(MultiHeadAttention=2 * n, BiasSplitGelu=n, BiasAdd=t, NhwcConv=s["convs"])
    elif provider == "cuda":  # a GEGLU width ORT's CUDA BiasSplitGelu does not take: plain Gelu, no BiasAdd
        counts.update(MultiHeadAttention=2 * n, Gelu=n, NhwcConv=s["convs"])
    else:  # self attention as Attention (Q/K/V in one matmul), cross attention as MultiHeadAttention
        counts.update(Attention=n, MultiHeadAttention=n, Gelu=n)
    return counts


def group_norms(counts: dict[str, int]) -> int:
    return counts["GroupNorm"] + counts["SkipGroupNorm"]


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    """tiny-sd15 through build(): export (with ControlNet inputs), CPU fusions, weight map, session."""
    unet = CanonicalUNet(build_unet("tiny-sd15", seed=0))
    processors = dict(unet.unet.attn_processors)
    stages = Stages()
    engine = ortb.build(unet, OrtOptions(control=True), Runtime(gpu=cpu_info(), folder=tmp_path_factory.mktemp("sd15")),
                        stages)
    yield unet, engine, processors, stages.names
    engine.release()


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    """tiny-sdxl exported once, optimized for the CPU (fp32) and for CUDA (fp16)."""
    unet = CanonicalUNet(build_unet("tiny-sdxl", seed=0))
    folder = tmp_path_factory.mktemp("sdxl")
    raw = export.export_onnx(unet, folder)
    stages = Stages()
    cpu = ort_optimize.optimize(raw, folder / "cpu.onnx", fp16=False, provider="cpu")
    cuda = ort_optimize.optimize(raw, folder / "cuda.onnx", fp16=True, provider="cuda", progress=stages)
    return unet, raw, cpu, cuda, stages.names


def test_sd15_matches_torch_fp32_at_any_shape(sd15):
    unet, engine, _, _ = sd15
    x, t, ctx, y = example_inputs(unet.unet, batch=2, latent=16, tokens=77, seed=1)
    assert rel(engine(x, t, ctx), unet(x, t, ctx)) <= 1e-4
    # Dynamic batch, height, width and tokens; a scalar timestep is broadcast like the torch UNet does.
    x, t, ctx, y = example_inputs(unet.unet, batch=1, latent=(24, 32), tokens=154, seed=2)
    assert rel(engine(x, torch.tensor(321.5), ctx), unet(x, torch.tensor([321.5]), ctx)) <= 1e-4


def test_sdxl_matches_torch_fp32(sdxl):
    unet, _, cpu, _, _ = sdxl
    engine = ortb.load(cpu, None, CPU)
    x, t, ctx, y = example_inputs(unet.unet, batch=2, latent=16, tokens=77, seed=1)
    assert rel(engine(x, t, ctx, y), unet(x, t, ctx, y)) <= 1e-4
    with pytest.raises(BackendUnavailable, match="y was not given"):
        engine(x, t, ctx)
    engine.release()


def test_build_reports_stages_and_restores_attention_processors(sd15):
    unet, engine, processors, stages = sd15
    assert stages == ["export", "fusion", "weight map", "session"]  # the CPU stays fp32: no fp16 stage
    after = unet.unet.attn_processors
    assert after.keys() == processors.keys() and all(after[k] is processors[k] for k in processors)
    assert all(p.dtype == torch.float32 for p in unet.unet.parameters())


def test_fp16_conversion_on_the_weightless_view_gives_orts_own_result(sdxl):
    """The fp16 step infers types on a copy of the graph without the weights' bytes: the model it gives is the one
    ORT's own conversion of the whole model gives (nodes, weights, inputs, outputs and every tensor's type)."""
    import copy

    from onnxruntime.transformers.onnx_model import OnnxModel

    from sd_accel.accel.build.ort_optimize import (FP16_MAX, FP16_MIN_POSITIVE, _fast_float16, _fuse,
                                                   _quiet_ort_transformers, time_embedding_nodes)

    _, raw, _, _, _ = sdxl
    ours = ort_optimize.optimized_model(raw, fp16=True, provider="cuda")
    with _quiet_ort_transformers():
        fused = _fuse(export._load(raw, external=True), "cuda", True, Stages())
        theirs = OnnxModel(copy.deepcopy(fused.model))
        with _fast_float16():  # the same bytes as ORT's own (test_fast_float16_gives_ort_s_bytes), faster
            theirs.convert_float_to_float16(keep_io_types=["timesteps"],
                                            node_block_list=time_embedding_nodes(fused.model),
                                            min_positive_val=FP16_MIN_POSITIVE, max_finite_val=FP16_MAX)
    a, b = ours.graph, theirs.model.graph
    for part in ("node", "initializer", "input", "output"):
        assert [x.SerializeToString() for x in getattr(a, part)] == [x.SerializeToString() for x in getattr(b, part)]
    types = lambda g: {v.name: v.type.tensor_type.elem_type for v in g.value_info}  # noqa: E731
    assert types(a) == types(b) and len(types(a)) > 100


def serialized(model) -> dict[str, list[bytes]]:
    return {part: [x.SerializeToString() for x in getattr(model.graph, part)]
            for part in ("node", "initializer", "input", "output", "value_info")}


def test_export_with_small_params_for_shape_inference_is_the_same_model(monkeypatch, tmp_path):
    """The exporter's whole-graph shape inference gets only the small parameters: the same exported model."""
    unet = CanonicalUNet(build_unet("tiny-sd15", seed=0))
    ours = export.export_model(unet, tmp_path / "a")
    monkeypatch.setattr(export, "_small_params_for_shape_inference", contextlib.nullcontext)
    theirs = export.export_model(unet, tmp_path / "b")
    assert serialized(ours) == serialized(theirs) and len(ours.graph.initializer) > 100


def test_cpu_fusion_counts(sd15, sdxl):
    for module, path in ((sd15[0].unet, sd15[1].path), (sdxl[0].unet, sdxl[2])):
        counts = ort_optimize.fused_operator_counts(path)
        assert counts == expected_fusions(module, "cpu")


def test_cuda_fusion_counts_and_fp16_io(sdxl):
    unet, _, _, cuda, stages = sdxl
    assert stages == ["fusion", "fp16"]
    counts = ort_optimize.fused_operator_counts(cuda)
    assert group_norms(counts) == structure(unet.unet)["groupnorms"]
    assert {k: v for k, v in counts.items() if k not in ("GroupNorm", "SkipGroupNorm")} == \
        {k: v for k, v in expected_fusions(unet.unet, "cuda").items() if k not in ("GroupNorm", "SkipGroupNorm")}
    info = export.model_info(cuda)
    assert info.float16 and info.has_y and info.size_multiple == 2
    model = onnx.load(str(cuda))
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert types == {"x": onnx.TensorProto.FLOAT16, "timesteps": onnx.TensorProto.FLOAT,
                     "context": onnx.TensorProto.FLOAT16, "y": onnx.TensorProto.FLOAT16}


def test_bias_splitgelu_only_for_widths_the_cuda_kernel_takes():
    sd_widths = (2560, 5120, 10240)  # SD1.5 and SDXL GEGLU projections
    assert ort_optimize.fusion_options("cuda", True, sd_widths).enable_bias_splitgelu
    assert not ort_optimize.fusion_options("cuda", True, (256,)).enable_bias_splitgelu


def test_weight_map_covers_the_fused_cuda_graph(sdxl):
    """Packed Q/K/V and K/V, NHWC convolutions, fp16: every parameter is found in the graph, and every weight of
    the graph is found among the parameters (but the zero Q/K/V biases the fusion adds)."""
    from onnx import numpy_helper

    unet, _, _, cuda, _ = sdxl
    wmap = weights.weight_map(cuda, unet)
    assert wmap.unmapped == []
    model = onnx.load(str(cuda))
    graph_weights = [i.name for i in model.graph.initializer if i.data_type in (onnx.TensorProto.FLOAT16,
                     onnx.TensorProto.FLOAT) and numpy_helper.to_array(i).size > 1]
    assert sorted(set(graph_weights) - set(wmap.sources)) == []
    kinds = {kind for sources in wmap.sources.values() for kind, _, _ in sources}
    assert {"packed", "nhwc", "t", "same"} <= kinds


def test_fast_float16_gives_ort_s_bytes():
    # The weight map matches initializers by their bytes: its fp16 conversion must be ORT's, bit for bit.
    import numpy as np
    from onnxruntime.transformers.float16 import convert_np_to_float16

    rng = np.random.default_rng(0)
    a = np.concatenate([rng.standard_normal(1000).astype(np.float32) * s for s in (1e-9, 1e-7, 1, 1e4, 1e6)])
    # fp16's subnormals and the rounding near its largest values, where a conversion could round differently
    a = np.concatenate([a, rng.uniform(-7e-5, 7e-5, 4000).astype(np.float32),
                        rng.uniform(-65520, 65520, 4000).astype(np.float32),
                        np.array([0, -0.0, 5.96e-08, -5.96e-08, 65504, -65504, 65519, 65520, 7e4, -7e4, np.inf,
                                  -np.inf, np.nan], np.float32)]).reshape(-1, 1)
    ours, theirs = ort_optimize.to_float16(a), convert_np_to_float16(a)
    assert ours.dtype == theirs.dtype == np.float16 and ours.shape == theirs.shape
    assert ours.tobytes() == theirs.tobytes()
    # ORT hands it a weight's read-only buffer
    assert ort_optimize.to_float16(np.frombuffer(a.tobytes(), np.float32)).tobytes() == theirs.tobytes()


def test_fp16_model_keeps_the_timestep_embedding_in_fp32(sdxl):
    model = onnx.load(str(sdxl[3]))
    producer = {o: n for n in model.graph.node for o in n.output}
    sins = [n for n in model.graph.node if n.op_type in ("Sin", "Cos")]
    assert len(sins) == 2

    def casts_to_fp16(name: str) -> bool:
        node = producer.get(name)
        if node is None:
            return False
        if node.op_type == "Cast" and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT16 for a in node.attribute):
            return True
        return any(casts_to_fp16(i) for i in node.input if i)

    assert not any(casts_to_fp16(i) for n in sins for i in n.input)


def test_cuda_model_on_the_cpu_names_the_cause(sdxl):
    with pytest.raises(BackendUnavailable, match="optimized for another provider"):
        ortb.load(sdxl[3], None, CPU)


def test_static_shapes_fold_the_shape_subgraphs(sd15):
    """Dynamic axes leave Shape->Gather->Concat chains feeding every Reshape (on CUDA they run on the CPU behind
    Memcpy nodes); a session with fixed dimensions folds all of them."""
    unet, engine, _, _ = sd15
    x, t, ctx, _ = example_inputs(unet.unet, batch=2, latent=16, seed=3)
    ref = unet(x, t, ctx)
    dynamic = ortb.load(engine.base_path, OrtOptions(inspect=True), CPU)
    static = ortb.load(engine.base_path, OrtOptions(inspect=True, static_shapes=True, max_sessions=1), CPU)
    assert rel(dynamic(x, t, ctx), ref) <= 1e-4 and rel(static(x, t, ctx), ref) <= 1e-4
    assert rel(static(x[:1], t[:1], ctx[:1]), unet(x[:1], t[:1], ctx[:1])) <= 1e-4  # a second shape: new session
    (dyn,) = dynamic.host_nodes.values()
    assert dyn["shape"] > 20
    assert len(static.host_nodes) == 2 and all(v == {"memcpy": 0, "shape": 0} for v in static.host_nodes.values())
    assert len(static._sessions) == 1  # max_sessions
    dynamic.release()
    static.release()


def test_control_residuals_are_inputs(sd15, sdxl):
    unet, engine, _, _ = sd15
    x, t, ctx, _ = example_inputs(unet.unet, batch=2, latent=16, seed=5)
    skips, mid = export.control_shapes(unet, x, t, ctx)
    g = torch.Generator().manual_seed(6)
    control = {"output": [torch.randn(s, generator=g) for s in skips], "middle": [torch.randn(mid, generator=g)]}
    ref = unet(x, t, ctx, None, control)
    assert rel(engine(x, t, ctx, None, control), ref) <= 1e-4 and rel(ref, unet(x, t, ctx)) > 1e-2
    # A missing residual (ComfyUI's None) is a zero; so is ControlNet left out altogether.
    partial = {"output": [None] + control["output"][1:], "middle": [None]}
    assert rel(engine(x, t, ctx, None, partial), unet(x, t, ctx, None, {
        "output": [torch.zeros(skips[0])] + control["output"][1:], "middle": [torch.zeros(mid)]})) <= 1e-4
    with pytest.raises(BackendUnavailable, match="skip residuals"):
        engine(x, t, ctx, None, {"output": control["output"][1:], "middle": control["middle"]})
    plain = ortb.load(sdxl[2], None, CPU)
    xs, ts, cs, ys = example_inputs(sdxl[0].unet, batch=2, latent=16, seed=1)
    with pytest.raises(BackendUnavailable, match="exported without control inputs.*control=True"):
        plain(xs, ts, cs, ys, {"middle": [torch.zeros(2, 64, 8, 8)]})
    plain.release()


def test_ldm_unet_exports_with_fused_attention(tmp_path):
    """ComfyUI/A1111 form: SDPA is exported in the classic form and the head split gets a constant shape, so
    ORT fuses the attention (here cross attention; the test UNet's flatten/transpose before the first block's
    LayerNorm is not ComfyUI's movedim/flatten, which the self-attention pattern expects)."""
    unet = CanonicalUNet(tiny_ldm_unet(sdxl=False, seed=1))
    g = torch.Generator().manual_seed(0)
    x, ctx, t = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 77, 32, generator=g), torch.tensor([900., 20.])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    raw = export.export_onnx(unet, tmp_path)
    assert torch.nn.functional.scaled_dot_product_attention is sdpa
    path = ort_optimize.optimize(raw, tmp_path / "cpu.onnx", fp16=False, provider="cpu")
    assert ort_optimize.fused_operator_counts(path)["MultiHeadAttention"] == structure(unet.unet)["blocks"]
    engine = ortb.load(path, None, CPU)
    assert rel(engine(x, t, ctx), unet(x, t, ctx)) <= 1e-4
    engine.release()


def test_update_weights_swaps_lora_weights_without_rebuild(sd15):
    _, engine, _, _ = sd15
    lora = CanonicalUNet(build_unet("tiny-sd15", seed=0))  # the weights the engine was built from
    x, t, ctx, _ = example_inputs(lora.unet, batch=2, latent=16, seed=7)
    assert ortb.update_weights(engine, lora) is False
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in lora.unet.named_parameters():
            if name.endswith(("to_q.weight", "to_k.weight", "to_v.weight", "to_out.0.weight", "proj_in.weight",
                              "ff.net.0.proj.weight", "conv1.weight")):
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    ref = lora(x, t, ctx)
    assert rel(engine(x, t, ctx), ref) > 1e-2
    assert ortb.update_weights(engine, lora) is True
    assert engine.path != engine.base_path
    assert rel(engine(x, t, ctx), ref) <= 1e-4
    # Back to the built weights: the built file is served again.
    assert ortb.update_weights(engine, CanonicalUNet(build_unet("tiny-sd15", seed=0))) is False
    assert engine.path == engine.base_path


def test_engine_refuses_what_it_cannot_serve(sd15):
    unet, engine, _, _ = sd15
    x, t, ctx, _ = example_inputs(unet.unet, batch=2, latent=16, seed=1)
    with pytest.raises(BackendUnavailable, match="multiple of 2"):
        engine(x[..., :15, :15], t, ctx)
    with pytest.raises(BackendUnavailable, match="not inputs of the ONNX model"):
        engine(x, t, ctx, None, {"input": [torch.zeros(2, 32, 16, 16)]})
    with pytest.raises(BackendUnavailable, match="transformer_options"):
        engine(x, t, ctx, transformer_options={})
    assert ortb.update_weights(engine, CanonicalUNet(build_unet("tiny-sd15", seed=0))) is False
    other = ortb.load(engine.base_path, None, CPU)
    other.release()
    with pytest.raises(BackendUnavailable, match="released"):
        other(x, t, ctx)


def test_external_data_above_the_protobuf_limit(sd15, tmp_path):
    unet, engine, _, _ = sd15
    model = onnx.load(str(engine.base_path))
    path = export.save_model(model, tmp_path / "big.onnx", external=True)
    data = tmp_path / "big.onnx.data"
    assert data.stat().st_size > 10 * path.stat().st_size
    x, t, ctx, _ = example_inputs(unet.unet, batch=2, latent=16, seed=1)
    reloaded = ortb.load(path, OrtOptions(refit=False), CPU)
    assert rel(reloaded(x, t, ctx), unet(x, t, ctx)) <= 1e-4
    with pytest.raises(BackendUnavailable, match="without a weight map"):
        ortb.update_weights(reloaded, unet)
    reloaded.release()


def test_export_failure_restores_the_module_and_says_so(monkeypatch, tmp_path):
    unet = CanonicalUNet(build_unet("tiny-sd15", seed=0).half())
    processors = dict(unet.unet.attn_processors)

    def broken(*args, **kwargs):
        assert all(p.dtype == torch.float32 for p in unet.unet.parameters())  # exported in fp32
        raise RuntimeError("unsupported operator aten::foo")

    monkeypatch.setattr(torch.onnx, "export", broken)
    with pytest.raises(BackendUnavailable, match="could not export.*aten::foo.*torch path"):
        export.export_onnx(unet, tmp_path)
    assert all(p.dtype == torch.float16 for p in unet.unet.parameters())
    assert all(unet.unet.attn_processors[k] is v for k, v in processors.items())
    assert not list(tmp_path.glob("*.onnx"))


def test_providers_per_gpu():
    assert ortb.choose_provider(cpu_info(), ["CPUExecutionProvider"]) == "CPUExecutionProvider"
    assert ortb.choose_provider(NVIDIA, ["CUDAExecutionProvider", "CPUExecutionProvider"]) == "CUDAExecutionProvider"
    assert ortb.choose_provider(AMD, ["MIGraphXExecutionProvider", "CPUExecutionProvider"], "Linux") == \
        "MIGraphXExecutionProvider"
    assert ortb.choose_provider(AMD, ["DmlExecutionProvider", "CPUExecutionProvider"], "Windows") == \
        "DmlExecutionProvider"
    with pytest.raises(BackendUnavailable, match="pip install onnxruntime-migraphx"):
        ortb.choose_provider(AMD, ["CPUExecutionProvider"], "Linux")
    opts = ortb.provider_options("CUDAExecutionProvider", NVIDIA, OrtOptions(cuda_graph=True), stream=1234)
    assert opts["enable_cuda_graph"] == "1" and opts["user_compute_stream"] == "1234"
    # the default device is not named (ORT >= 1.26 warns at every session when device_id is given); another one is
    assert "device_id" not in opts
    second = GpuInfo("nvidia", "hopper", name="H100", device="cuda:1")
    assert ortb.provider_options("CUDAExecutionProvider", second, OrtOptions())["device_id"] == "1"
    assert ortb.provider_options("MIGraphXExecutionProvider", second, OrtOptions()) == {"device_id": "1"}
    # Heuristic algorithms and no cuDNN-frontend bias fusion: neither makes a change of image size cost seconds.
    assert opts["cudnn_conv_algo_search"] == "HEURISTIC" and "fuse_conv_bias" not in opts and "prefer_nhwc" not in opts
    fused = ortb.provider_options("CUDAExecutionProvider", NVIDIA, OrtOptions(fuse_conv_bias=True))
    assert fused["fuse_conv_bias"] == "1" and "user_compute_stream" not in fused


def test_bad_installs_say_what_to_install(monkeypatch):
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        ok, reason = ortb.available(NVIDIA)
        assert not ok and "only the CPU build of onnxruntime" in reason
        assert "pip uninstall onnxruntime && pip install onnxruntime-gpu" in reason
    assert ortb.available(cpu_info())[0]
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now raises ImportError
    assert ortb.available(NVIDIA) == (False, "onnxruntime is not installed: pip install onnxruntime-gpu")


@pytest.mark.filterwarnings("ignore:Specified provider")
def test_session_errors_name_the_cause(sd15, tmp_path):
    from onnx import helper

    with pytest.raises(BackendUnavailable, match="could not start CUDAExecutionProvider.*onnxruntime-gpu"):
        ortb.open_session(sd15[1].base_path, [("CUDAExecutionProvider", {}), "CPUExecutionProvider"])
    graph = helper.make_graph([helper.make_node("Relu", ["a"], ["b"])], "g",
                              [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [1])])
    path = tmp_path / "future.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 99)]), str(path))
    with pytest.raises(BackendUnavailable, match="cannot run this model's ONNX version.*pip install -U onnxruntime"):
        ortb.open_session(path, ["CPUExecutionProvider"])


def test_float32_weights_restores_each_dtype():
    m = nn.Sequential(nn.Linear(2, 2).half(), nn.Linear(2, 2).to(torch.bfloat16), nn.LayerNorm(2))
    before = {n: (p.dtype, p.detach().clone()) for n, p in m.named_parameters()}
    with export.float32_weights(m):
        assert all(p.dtype == torch.float32 for p in m.parameters())
    for n, p in m.named_parameters():
        assert p.dtype == before[n][0] and torch.equal(p, before[n][1])


gpu_ort = pytest.mark.skipif(
    not torch.cuda.is_available() or "CUDAExecutionProvider" not in
    (getattr(sys.modules.get("onnxruntime"), "get_available_providers", lambda: [])()),
    reason="needs a CUDA GPU and onnxruntime-gpu")


@gpu_ort
def test_cuda_fp16_engine_with_cuda_graph(tmp_path):
    from sd_accel.accel.plan.device import detect

    unet = CanonicalUNet(build_unet("tiny-sd15", seed=1, device="cuda"))
    x, t, ctx, _ = example_inputs(unet.unet, latent=32, device="cuda")
    ref = unet(x, t, ctx)
    engine = ortb.build(unet, OrtOptions(cuda_graph=True, inspect=True), Runtime(gpu=detect(), folder=tmp_path))
    for _ in range(3):  # plain run, capture, replay
        out = engine(x, t, ctx)
    assert out.device == x.device and rel(out, ref) <= 2e-2
    assert all(v["memcpy"] == 0 for v in engine.host_nodes.values())
    engine.release()


def test_engine_cache_builds_once_then_loads(tmp_path, monkeypatch):
    """Without a folder the model is built into the engine cache; the next build of the same weights loads it,
    and a LoRA-style change of the weights is a miss."""
    import time

    monkeypatch.setenv("SD_ACCEL_CACHE", str(tmp_path))
    unet = CanonicalUNet(build_unet("tiny-sd15", seed=4))
    x, t, ctx, _ = example_inputs(unet.unet, latent=16, seed=5)
    start = time.perf_counter()
    first = ortb.build(unet, None, CPU)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    second = ortb.build(unet, None, CPU)
    load_s = time.perf_counter() - start
    assert not first.cache_result.hit and second.cache_result.hit
    assert load_s < build_s / 3
    assert rel(second(x, t, ctx), unet(x, t, ctx)) <= 1e-4
    with torch.no_grad():
        unet.unet.conv_in.weight.add_(0.01 * torch.randn_like(unet.unet.conv_in.weight))
    third = ortb.build(unet, None, CPU)
    assert not third.cache_result.hit
    for engine in (first, second, third):
        engine.release()
    print(f"ORT tiny-sd15 on the CPU: build {build_s:.2f} s, cache hit {load_s:.2f} s")


def test_second_checkpoint_of_an_architecture_builds_from_the_cached_graph(tmp_path, monkeypatch):
    """Another checkpoint of a model already in the cache takes that entry's optimized graph with its own weights put
    in (no export, no fusion pass), and computes what a full export of it computes."""
    monkeypatch.setenv("SD_ACCEL_CACHE", str(tmp_path / "cache"))
    first = ortb.build(CanonicalUNet(build_unet("tiny-sd15", seed=4)), None, CPU)
    other = CanonicalUNet(build_unet("tiny-sd15", seed=6))
    x, t, ctx, _ = example_inputs(other.unet, latent=16, seed=7)
    stages = Stages()
    second = ortb.build(other, None, CPU, stages)
    assert "refit" in stages.names and not {"export", "fusion"} & set(stages.names) and not second.cache_result.hit
    full = ortb.build(other, None, Runtime(gpu=cpu_info(), folder=tmp_path / "full"))
    out = second(x, t, ctx)
    assert rel(out, full(x, t, ctx)) <= 1e-5 and rel(out, other(x, t, ctx)) <= 1e-4
    assert rel(out, first(x, t, ctx)) > 1e-2  # the other weights, not the first checkpoint's
    with torch.no_grad():  # its own weight map: a LoRA-style change on top refits from the new weights
        other.unet.conv_in.weight.add_(0.01 * torch.randn_like(other.unet.conv_in.weight))
    assert ortb.update_weights(second, other) and rel(second(x, t, ctx), other(x, t, ctx)) <= 1e-4
    for engine in (first, second, full):
        engine.release()


def test_refit_of_a_model_holding_its_weights_inline_gives_the_same_model(tmp_path):
    """A model file from before weights were kept apart (all of them inline in the protobuf) is refitted the slow way,
    to the same weights as the in-place writer gives a model that keeps them in its data file."""
    import shutil

    import numpy as np
    import onnx
    from onnx import numpy_helper

    from sd_accel.accel.build.export import save_model
    from sd_accel.accel.build.weights import refitted, weight_map_path

    unet = CanonicalUNet(build_unet("tiny-sd15", seed=4))
    apart = ortb.build_model(unet, tmp_path / "apart", OrtOptions(), provider=ortb.CPU)
    assert apart.with_name(apart.name + ".data").exists()
    inline = tmp_path / "inline" / apart.name
    inline.parent.mkdir()
    save_model(onnx.load(str(apart)), inline, external=False)
    shutil.copyfile(weight_map_path(apart), weight_map_path(inline))
    other = CanonicalUNet(build_unet("tiny-sd15", seed=6))
    models = [onnx.load(str(refitted(m, other, tmp_path / f"out-{i}" / m.name))) for i, m in enumerate((apart, inline))]
    weights = [{i.name: numpy_helper.to_array(i) for i in m.graph.initializer} for m in models]
    assert weights[0].keys() == weights[1].keys()
    assert all(np.array_equal(weights[0][n], weights[1][n]) for n in weights[0])
    before = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(apart)).graph.initializer}
    assert sum(not np.array_equal(before[n], weights[0][n]) for n in before) > 10  # the other checkpoint's weights


def test_shape_inference_view_gives_inputs_generic_concrete_sizes(sd15):
    """ORT's shape inference runs over a view whose dynamic inputs have fixed sizes (integers instead of sympy
    expressions); the fused operator counts above are what guards the fusions against that."""
    import onnx

    _, engine, _, _ = sd15
    model = onnx.load(str(engine.path), load_external_data=False)
    view = ort_optimize._shape_view(model)
    info = export.model_info(model)
    dims = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in view.graph.input}
    m = info.size_multiple
    assert dims["x"] == [3, info.in_channels, 9 * m, 11 * m]
    assert dims["timesteps"] == [3] and dims["context"][:2] == [3, 77]
    meta = {p.key: p.value for p in model.metadata_props}
    controls = [n for n in dims if n.startswith("control_")]
    assert controls
    for name in controls:
        f = int(meta[f"sd_accel.{name}_factor"])
        assert dims[name][0] == 3 and dims[name][2:] == [-(-9 * m // f), -(-11 * m // f)]
    # the model itself keeps its symbols
    assert [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim] == ["batch", "", "height", "width"]
