"""The torch path computes the same function as the plain UNet (CPU, fp32, its fused Triton kernels run by Triton's
interpreter) and, on a GPU, keeps its graphs honest: recaptured when weights are swapped, bounded in number and
memory, freed on release."""

from __future__ import annotations

import types

import pytest
import torch

from sd_accel.accel.engine.backends import torch_fused
from sd_accel.accel.models.configs import build_unet, example_inputs
from sd_accel.accel.models.spec import CanonicalUNet
from sd_accel.accel.plan.options import TorchOptions
import comfy_helpers as H
from ldm_unet import tiny_ldm_unet

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")


# On the CPU the kernels run in Triton's interpreter (tests/conftest.py): the engine then takes the same fusions as on
# a GPU, so a wrong kernel or a dropped residual shows here.
FUSED = TorchOptions(triton_kernels=True)


def tuned(**changes) -> TorchOptions:
    """The torch path's options on this GPU, as the policy chooses them (graphs, channels_last, kernels)."""
    import dataclasses

    from sd_accel.accel.plan.device import detect
    from sd_accel.accel.plan.policy import choose

    return dataclasses.replace(choose(detect(), "torch").torch, **changes)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def assert_fused_same_function(unet: CanonicalUNet, x, t, ctx, y) -> None:
    """The torch path with its fused kernels computes the plain UNet's function, and release() gives the plain UNet
    back. The comparison means nothing unless the main fusions took modules, so that is checked first."""
    ref = unet(x, t, ctx, y)
    engine = torch_fused.build(unet, FUSED)
    counts = engine.fusion_counts or {}
    assert all(counts.get(k) for k in ("groupnorm", "geglu", "resnet", "qkv")), counts
    assert rel(engine(x, t, ctx, y), ref) <= 1e-5
    engine.release()
    assert torch.equal(unet(x, t, ctx, y), ref)


@pytest.mark.parametrize("name", ["tiny-sd15", "tiny-sdxl"])
def test_diffusers_unet_same_function_on_cpu(name):
    unet = CanonicalUNet(build_unet(name, seed=3))
    assert_fused_same_function(unet, *example_inputs(unet.unet, latent=16, seed=4))


@pytest.mark.parametrize("sdxl", [False, True])
def test_ldm_unet_same_function_on_cpu(sdxl):
    unet = CanonicalUNet(tiny_ldm_unet(sdxl=sdxl, seed=2))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 16, 16, generator=g)
    ctx = torch.randn(2, 77, unet.spec.context_dim, generator=g)
    y = torch.randn(2, unet.spec.adm_channels, generator=g) if sdxl else None
    assert_fused_same_function(unet, x, torch.tensor([900.0, 20.0]), ctx, y)


def test_precision_fp8_on_a_unet_says_it_computes_in_16_bits_and_does(caplog):
    """The node's precision fp8 is for the transformers: a UNet built with it says once that it computes in its own
    dtype, and gives what the default precision gives."""
    import dataclasses
    import logging

    unet = CanonicalUNet(build_unet("tiny-sd15", seed=3))
    x, t, ctx, y = example_inputs(unet.unet, latent=16, seed=4)
    plain = torch_fused.build(unet, FUSED)
    ref = plain(x, t, ctx, y)
    plain.release()
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        engine = torch_fused.build(unet, dataclasses.replace(FUSED, precision="fp8"))
    said = [r.getMessage() for r in caplog.records if "precision fp8" in r.getMessage()]
    assert len(said) == 1 and "this UNet computes in float32" in said[0], said
    assert torch.equal(engine(x, t, ctx, y), ref)
    engine.release()


def _down_residual_shapes(unet: torch.nn.Module, x, t, ctx):
    """Shapes of the skip connections and of the mid-block output, read off a plain forward pass."""
    skips, mid = [], []
    hooks = [unet.conv_in.register_forward_hook(lambda m, a, o: skips.append(o.shape))]
    for block in unet.down_blocks:
        hooks.append(block.register_forward_hook(lambda m, a, o: skips.extend(s.shape for s in o[1])))
    hooks.append(unet.mid_block.register_forward_hook(lambda m, a, o: mid.append(o.shape)))
    unet(x, t, ctx)
    for h in hooks:
        h.remove()
    return skips, mid[0]


def test_control_residuals_reach_the_unet():
    unet = CanonicalUNet(build_unet("tiny-sd15", seed=5))
    x, t, ctx, _ = example_inputs(unet.unet, latent=16, seed=6)
    skips, mid = _down_residual_shapes(unet.unet, x, t, ctx)
    g = torch.Generator().manual_seed(7)
    control = {"output": [torch.randn(s, generator=g) for s in skips], "middle": [torch.randn(mid, generator=g)]}
    engine = torch_fused.build(unet)
    with_control = engine(x, t, ctx, None, control)
    assert rel(with_control, unet(x, t, ctx, None, control)) <= 1e-5
    assert rel(with_control, unet(x, t, ctx)) > 1e-3


@gpu
def test_fp16_engine_within_1e2_of_fp32_reference():
    ref_unet = CanonicalUNet(build_unet("tiny-sd15", seed=1, device="cuda"))
    x, t, ctx, y = example_inputs(ref_unet.unet, latent=32, device="cuda")
    ref = ref_unet(x, t, ctx, y)
    half = CanonicalUNet(build_unet("tiny-sd15", seed=1, device="cuda", dtype=torch.float16))
    engine = torch_fused.build(half, tuned())
    for _ in range(4):  # plain, capture, then replays
        assert rel(engine(x, t, ctx, y), ref) <= 1e-2
    engine.release()


@gpu
def test_graph_recaptures_when_a_parameter_is_replaced():
    unet = CanonicalUNet(build_unet("tiny-sd15", seed=1, device="cuda", dtype=torch.float16))
    x, t, ctx, y = example_inputs(unet.unet, latent=32, device="cuda", dtype=torch.float16)
    engine = torch_fused.build(unet, tuned())
    engine(x, t, ctx, y)
    before = engine(x, t, ctx, y)
    assert engine.graphs.captures == 1
    lin = unet.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q
    # ComfyUI's LoRA patching assigns a new Parameter: a replayed graph would still read the old one.
    lin.weight = torch.nn.Parameter(lin.weight.detach() * 3, requires_grad=False)
    after = engine(x, t, ctx, y)
    assert rel(after, before) > 1e-3
    assert rel(after, unet(x, t, ctx, y)) <= 1e-2
    assert engine.graphs.captures == 2
    engine.release()


@gpu
def test_first_call_at_a_shape_runs_plain_and_the_second_captures():
    """A new image size gives its first output after one plain step; the graph comes when the size comes again."""
    unet = CanonicalUNet(build_unet("tiny-sd15", seed=1, device="cuda", dtype=torch.float16))
    x, t, ctx, y = example_inputs(unet.unet, latent=32, device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        ref = unet(x, t, ctx, y)
    calls = []
    for run in range(2):  # a host's sampling runs: the torch path is prepared, used, undone
        # (compiling ahead would run a first call twice where a kernel is not compiled yet: a test below)
        engine = torch_fused.build(unet, tuned(parallel_compile=False))
        forward = engine._graph_fn
        engine.graphs.fn = lambda *a: calls.append(run) or forward(*a)
        assert rel(engine(x, t, ctx, y), ref) <= 1e-2 and engine.graphs.captures == 0
        for _ in range(2):
            assert rel(engine(x, t, ctx, y), ref) <= 1e-2 and engine.graphs.captures == 1
        engine.release()
    assert calls.count(0) == 3 and calls.count(1) == 3  # the plain call, then the warm-up and the capture


def test_restride_keeps_addresses_and_values_and_goes_back():
    from sd_accel.accel.engine.backends.torch_fused import restride, restride_tensors

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 3), torch.nn.Linear(4, 4),
                              torch.nn.Conv2d(8, 8, 1))
    already = net[1].weight
    already.data = already.data.contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 9, 9)
    before = net[:2](x)
    ptrs = [p.data_ptr() for p in net.parameters()]
    values = [p.detach().clone() for p in net.parameters()]
    converted = restride(net, torch.channels_last)
    # 4-D and contiguous only (the user's channels_last weight is left alone), 1x1 included: explicit strides
    assert converted == [net[0].weight, net[3].weight]
    assert net[0].weight.is_contiguous(memory_format=torch.channels_last) and not net[0].weight.is_contiguous()
    assert net[3].weight.stride() == (8, 1, 8, 8)
    assert net[3](x.new_ones(1, 8, 2, 2)).is_contiguous(memory_format=torch.channels_last)
    assert [p.data_ptr() for p in net.parameters()] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(values, net.parameters()))
    assert rel(net[:2](x), before) <= 1e-6
    restride_tensors(converted, torch.contiguous_format)
    assert net[0].weight.is_contiguous() and already.is_contiguous(memory_format=torch.channels_last)
    assert net[3].weight.stride() == (8, 1, 1, 1)
    assert [p.data_ptr() for p in net.parameters()] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(values, net.parameters()))


def _changed_modules(module: torch.nn.Module) -> list[str]:
    """Modules carrying an instance-level method or an attention processor of ours (the fusions' patches), or
    a 4-D weight not in contiguous layout."""
    out = [n for n, m in module.named_modules() if any(isinstance(v, types.MethodType) for v in vars(m).values())
           or type(getattr(m, "processor", None)).__module__.startswith("sd_accel.")]
    return out + [n for n, p in module.named_parameters() if p.dim() == 4 and not p.is_contiguous()]


@gpu
def test_suspended_engine_leaves_the_module_plain_and_resumes_on_its_graphs():
    unet = CanonicalUNet(build_unet("tiny-sd15", seed=1, device="cuda", dtype=torch.float16))
    x, t, ctx, y = example_inputs(unet.unet, latent=32, device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        plain = unet(x, t, ctx, y)
    assert not _changed_modules(unet.unet)
    engine = torch_fused.build(unet, tuned())
    engine(x, t, ctx, y)
    first = engine(x, t, ctx, y)
    assert _changed_modules(unet.unet) and engine.graphs.captures == 1
    engine.suspend()
    assert not _changed_modules(unet.unet)
    with torch.inference_mode():
        assert torch.equal(unet(x, t, ctx, y), plain)  # what the host's other models run meanwhile

    assert torch.equal(engine(x, t, ctx, y), first)  # resumed: replayed, not captured again
    assert engine.graphs.captures == 1

    engine.suspend()  # the host scales a weight in place meanwhile: the graph reads the new values
    conv = unet.unet.down_blocks[0].resnets[0].conv1
    with torch.no_grad():
        conv.weight.mul_(3)
    with torch.inference_mode():
        scaled = unet(x, t, ctx, y)
    assert rel(engine(x, t, ctx, y), scaled) <= 1e-2 and rel(scaled, plain) > 1e-3
    assert engine.graphs.captures == 1

    engine.suspend()  # the host replaces a weight (ComfyUI's LoRA patching): captured again
    conv.weight = torch.nn.Parameter(conv.weight.detach() / 3, requires_grad=False)
    assert rel(engine(x, t, ctx, y), plain) <= 1e-2
    assert engine.graphs.captures == 2
    # the attention projections were packed (views of shared buffers); release gives each its own storage back
    projections = [p for n, p in unet.unet.named_parameters() if ".to_k." in n or ".to_v." in n]
    assert len({p.untyped_storage().data_ptr() for p in projections}) < len(projections)
    engine.release()
    assert not _changed_modules(unet.unet)
    assert len({p.untyped_storage().data_ptr() for p in projections}) == len(projections)
    with torch.inference_mode():
        assert rel(unet(x, t, ctx, y), plain) <= 1e-2


@gpu
def test_graph_memory_stays_bounded_over_20_shapes():
    unet = CanonicalUNet(build_unet("tiny-sd15", seed=1, device="cuda", dtype=torch.float16))
    ctx = torch.randn(3, 77, 32, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = torch_fused.build(unet, tuned(max_graphs=4))
    sizes = [(b, s) for b in (1, 2, 3) for s in range(16, 72, 8)][:20]
    sizes.sort(key=lambda bs: -bs[0] * bs[1] ** 2)  # the largest first: they set the bound
    with torch.inference_mode():
        for i, (b, s) in enumerate(sizes):
            x = torch.randn(b, 4, s, s, device="cuda", dtype=torch.float16)
            for _ in range(2):  # plain, then captured
                engine(x, torch.full((b,), 10.0, device="cuda"), ctx[:b])
            torch.cuda.synchronize()
            if i == 3:
                bound = torch.cuda.memory_allocated()
    assert len(engine.graphs) == 4
    assert torch.cuda.memory_allocated() <= 1.1 * bound
    del x
    engine.release()
    assert torch.cuda.memory_allocated() <= before + 8 * 2**20, "release() must give back what the graphs held"


_FIRST_CALLS = r"""
import importlib, json, pkgutil, sys
import torch
import sd_accel.kernels as kernels
from sd_accel.kernels import ahead
from sd_accel.accel.engine.backends import torch_fused
from sd_accel.accel.models.configs import build_unet, example_inputs
from sd_accel.accel.models.spec import CanonicalUNet
from sd_accel.accel.plan.device import detect
from sd_accel.accel.plan.policy import choose
import dataclasses

unet = CanonicalUNet(build_unet("tiny-sd15", seed=1, device="cuda", dtype=torch.float16))
x, t, ctx, y = example_inputs(unet.unet, latent=32, device="cuda", dtype=torch.float16)
engine = torch_fused.build(unet, dataclasses.replace(choose(detect(), "torch").torch,
                                                     parallel_compile=sys.argv[2] == "parallel"))
first = engine(x, t, ctx, y)
compiled = ahead.totals.kernels
later = [engine(x, t, ctx, y) for _ in range(3)]  # the capture, then replays
left = [name for m in pkgutil.iter_modules(kernels.__path__)
        for name, f in vars(importlib.import_module(f"sd_accel.kernels.{m.name}")).items()
        if any(v is ahead._SKIPPED for c in getattr(f, "device_caches", {}).values() for v in c[0].values())]
torch.save({"first": first.cpu(), "later": [o.cpu() for o in later]}, sys.argv[1])
print(json.dumps({"compiled_ahead": compiled, "placeholders_left": left}))
"""


@gpu
def test_kernels_compiled_ahead_give_what_kernels_compiled_in_turn_give(tmp_path):
    """On a fresh machine (an empty Triton cache) the first call compiles the kernels it needs on a thread pool
    before it runs: its output is the one the kernels compiled one after another give, bit for bit, and the plain
    UNet's; nothing skipped is left behind for a later call."""
    import json
    import os
    import subprocess
    import sys

    outputs = {}
    for how in ("parallel", "in turn"):
        path = tmp_path / f"{how}.pt"
        env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / f"triton {how}"))
        run = subprocess.run([sys.executable, "-c", _FIRST_CALLS, str(path), how], env=env, capture_output=True,
                             text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        report = json.loads(run.stdout.strip().splitlines()[-1])
        assert report["placeholders_left"] == []
        if how == "parallel":
            assert report["compiled_ahead"] >= 5
        else:
            assert report["compiled_ahead"] == 0
        outputs[how] = torch.load(path)
    assert torch.equal(outputs["parallel"]["first"], outputs["in turn"]["first"])
    unet = CanonicalUNet(build_unet("tiny-sd15", seed=1, device="cuda", dtype=torch.float16))
    x, t, ctx, y = example_inputs(unet.unet, latent=32, device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        ref = unet(x, t, ctx, y).cpu()
    for out in (outputs["parallel"]["first"], *outputs["parallel"]["later"]):
        assert rel(out, ref) <= 1e-2


@pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test (Triton's interpreter, float32); on the GPU the "
                    "suite's sdxl-fp8weights runs the same inside ComfyUI (tests/gpu/run)")
def test_comfyuis_fp8_stored_unet_runs_its_fused_kernels_on_16_bit_copies_and_gets_its_fp8_weights_back():
    """ComfyUI's fp8_e4m3fn weight dtype: cast-on-the-fly layers holding fp8 weights, which the fusions decline. The
    torch path widens them once into copies it keeps, so the fusions take the layers; suspend() and release() give
    every layer its own fp8 Parameter back; a weight the host replaced meanwhile (ComfyUI's LoRA patching) is
    widened again into the same copy at the next run."""
    import comfy_helpers as H

    H.import_comfy()
    import comfy.utils

    xl = H.tiny_model(5, xl=True, weight_dtype=torch.float8_e4m3fn).model
    module = xl.diffusion_model
    unet = CanonicalUNet(module, fed=xl.manual_cast_dtype)
    own = {name: p for name, p in module.named_parameters()}
    cast_layers = [m for m in module.modules() if getattr(m, "comfy_cast_weights", False)]
    assert {p.dtype for p in own.values()} == {torch.float8_e4m3fn} and cast_layers
    g = torch.Generator().manual_seed(0)
    x, ctx = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 77, unet.spec.context_dim, generator=g)
    y = torch.randn(2, module.label_emb[0][0].in_features, generator=g)
    t = torch.tensor([900.0, 20.0])
    ref = unet(x, t, ctx, y)

    def host_left_as_it_was():
        return (all(p is own[name] for name, p in module.named_parameters()) and len(own) == len(
            list(module.parameters())) and all(m.comfy_cast_weights for m in cast_layers)
            and not any("comfy_cast_weights" in vars(m) for m in cast_layers))  # ComfyUI's class attribute says it

    engine = torch_fused.build(unet, FUSED)

    def graphs_see_what_the_layers_hold():
        # the tensors whose addresses are the CUDA graphs' weight token, against what the module holds now
        return [id(t) for t in engine._weights.tensors()] == [id(t) for t in (*module.parameters(), *module.buffers())]

    counts = engine.fusion_counts or {}
    assert counts.get("fp8-stored layers widened") == len(cast_layers), counts
    assert all(counts.get(k) for k in ("groupnorm", "geglu", "resnet", "qkv")), counts
    assert rel(engine(x, t, ctx, y), ref) <= 1e-5
    assert graphs_see_what_the_layers_hold()
    copies = {id(p) for p in module.parameters()}
    engine.suspend()
    assert host_left_as_it_was()
    assert torch.equal(unet(x, t, ctx, y), ref)

    # the host's LoRA patching replaces a Parameter while the engine is suspended
    name = next(n for n in own if n.endswith("attn1.to_q.weight"))
    patched = torch.nn.Parameter((own[name].float() * 1.5).to(torch.float8_e4m3fn), requires_grad=False)
    comfy.utils.set_attr_param(module, name, patched)
    own[name] = dict(module.named_parameters())[name]  # set_attr_param wraps it in a Parameter of its own
    changed = unet(x, t, ctx, y)
    assert rel(changed, ref) > 1e-4
    assert rel(engine(x, t, ctx, y), changed) <= 1e-5
    assert {id(p) for p in module.parameters()} == copies  # the same copies: a CUDA graph still reads them
    assert graphs_see_what_the_layers_hold()

    # lowvram, or a LoRA applied per call, gives a layer weight functions between runs, and nothing is registered:
    # that layer keeps its fp8 weight and its own forward, which applies them
    engine.suspend()
    layer = next(m for m in cast_layers if isinstance(m, torch.nn.Linear) and m.out_features == m.in_features)
    layer.weight_function = [lambda w: w * 2]
    doubled = unet(x, t, ctx, y)
    assert rel(doubled, changed) > 1e-4
    assert rel(engine(x, t, ctx, y), doubled) <= 1e-5
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.comfy_cast_weights
    assert graphs_see_what_the_layers_hold()  # else a graph captured on the layer's copy would replay
    engine.suspend()
    del layer.weight_function
    assert rel(engine(x, t, ctx, y), changed) <= 1e-5
    assert graphs_see_what_the_layers_hold()
    engine.release()
    assert host_left_as_it_was()
    assert torch.equal(unet(x, t, ctx, y), changed)
