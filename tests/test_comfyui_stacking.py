"""The Accelerated UNet node stacked with the ComfyUI core nodes users put around it (issue 55): EasyCache and
LazyCache, ModelSamplingFlux / ModelSamplingSD3, TorchCompileModel, ControlNet, MultiGPU CFG Split and ScaleROPE, each
applied before and after the node, inside the real ComfyUI tree (COMFYUI_ROOT), on tiny seeded models and the CPU.

What is pinned down: the latents equal plain ComfyUI's with the same stack (exact on the CPU, where the torch path runs
the plain model's kernels), the caches skip the same steps, and where the node cannot serve a call it runs ComfyUI's
own forward and says why once. `--fast fp16_accumulation` and `--use-sage-attention` need a GPU (tests/gpu).
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

import comfy_helpers as H
from sd_accel.nodes import accelerated_unet

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))

ORDERS = ("before", "after")  # the host node before or after the Accelerated UNet node in the workflow


def host_node(module: str, name: str):
    """ComfyUI's node class `name` from comfy_extras/`module`.py, or a skip where this tree has none."""
    found, why = H.host_node(module, name)
    if found is None:
        pytest.skip(why)
    return found


run_node = H.run_node


def accelerate(pack, model):
    node = pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]()
    return node.apply(model, "torch", True, False, **H.PROFILE, unique_id="55")["result"][0]


def stacked(pack, model, order: str, host):
    """model with the Accelerated UNet node and host(model) -> MODEL, in that workflow order."""
    return host(accelerate(pack, model)) if order == "after" else accelerate(pack, host(model))


def sample(model, positive, negative, channels=4, steps=2, size=8, seed=1, cfg=3.0):
    import comfy.sample

    noise = torch.randn(1, channels, size, size, generator=torch.Generator().manual_seed(seed))
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "normal", positive, negative,
                               torch.zeros(1, channels, size, size), disable_pbar=True, seed=seed)


def status(model):
    return accelerated_unet.session_of(model).slot.status


def said(caplog, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if words in r.getMessage()]


def skipped_steps(caplog, name: str) -> list[int]:
    """The steps the cache says it skipped, one entry per sampling run (its own summary line)."""
    return [int(m.group(1)) for r in caplog.records
            for m in [re.search(rf"{name} - skipped (\d+)/", r.getMessage())] if m]


# ------------------------------------------------------------------------------------------- step caches

CACHES = {"EasyCache": "EasyCacheNode", "LazyCache": "LazyCacheNode"}
# (family, latent channels): an SD1.5 UNet and a Flux transformer
MODELS = (("sd15", 4), ("flux", 16))


def tiny(family: str, seed: int):
    if family == "sd15":
        return H.tiny_model(seed), H.tiny_conditioning(seed + 1)
    return H.tiny_dit(family, seed), H.tiny_dit_conditioning(family, seed + 1)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("family,channels", MODELS)
@pytest.mark.parametrize("cache", list(CACHES))
def test_step_cache_skips_the_same_steps_and_gives_plains_latents(pack, cache, family, channels, order, caplog):
    cls = host_node("nodes_easycache", CACHES[cache])
    model, (pos, neg) = tiny(family, 20)

    def with_cache(m):
        return run_node(cls, m, reuse_threshold=0.5, start_percent=0.0, end_percent=1.0, verbose=False)

    steps = 8
    with caplog.at_level(logging.INFO):
        plain = sample(with_cache(model), pos, neg, channels, steps)
        skipped_plain = skipped_steps(caplog, cache)
        caplog.clear()
        acc = stacked(pack, model, order, with_cache)
        out = sample(acc, pos, neg, channels, steps)
        skipped = skipped_steps(caplog, cache)
    assert skipped_plain and 0 < skipped_plain[0] < steps, skipped_plain  # the cache does skip steps here
    assert skipped == skipped_plain
    assert H.same(out, plain)
    s = status(acc)
    # every step the cache runs reaches the engine (one call: cond and uncond batched)
    assert s.plain_calls == 0 and s.engine_calls == steps - skipped[0], (s, s.messages)


@pytest.mark.parametrize("order", ORDERS)
def test_easycache_on_sd3_which_never_runs_its_forward_wrapper_keeps_the_engine(pack, order, caplog):
    """ComfyUI's SD3 has no diffusion-model wrapper point: EasyCache's forward wrapper never runs there, in plain
    ComfyUI either, and skips no step. The node does not step aside for a wrapper ComfyUI would not run: it serves
    every call, with plain's latents."""
    cls = host_node("nodes_easycache", CACHES["EasyCache"])
    model, (pos, neg) = tiny("sd3", 20)

    def with_cache(m):
        return run_node(cls, m, reuse_threshold=0.5, start_percent=0.0, end_percent=1.0, verbose=False)

    steps = 4
    with caplog.at_level(logging.INFO):
        plain = sample(with_cache(model), pos, neg, 16, steps)
        skipped_plain = skipped_steps(caplog, "EasyCache")
        caplog.clear()
        acc = stacked(pack, model, order, with_cache)
        out = sample(acc, pos, neg, 16, steps)
        skipped = skipped_steps(caplog, "EasyCache")
    assert skipped == skipped_plain == [0]
    assert H.same(out, plain)
    s = status(acc)
    assert s.plain_calls == 0 and s.engine_calls == steps, (s, s.messages)


def test_a_wrapper_that_may_reach_into_the_blocks_runs_comfyuis_forward_once_said(pack, caplog):
    """A diffusion-model wrapper the node does not know, added after it: it might reach into the blocks, which the
    engine's fused blocks would not show it, so the node steps aside for those calls, says so once, and the image is
    plain's with the same wrapper."""
    from comfy.patcher_extension import WrappersMP

    model, (pos, neg) = tiny("sd15", 30)
    seen = []

    def louder(executor, *args, **kwargs):
        seen.append(type(executor.class_obj).__name__)
        return executor(*args, **kwargs) * 1.1

    def with_wrapper(m):
        m = m.clone()
        m.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "louder", louder)
        return m

    plain = sample(with_wrapper(model), pos, neg)
    acc = with_wrapper(accelerate(pack, model))
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        out = sample(acc, pos, neg)
        sample(acc, pos, neg)
    assert H.same(out, plain) and len(seen) == 6
    assert len(said(caplog, "diffusion-model wrappers added after this node (louder)")) == 1
    assert status(acc).engine_calls == 0 and status(acc).plain_calls == 4


# --------------------------------------------------------------------------------------- sampling shift

@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("family,node,inputs", [
    ("flux", "ModelSamplingFlux", {"max_shift": 1.15, "base_shift": 0.5, "width": 256, "height": 256}),
    ("sd3", "ModelSamplingSD3", {"shift": 6.0}),
])
def test_sampling_shift_gives_plains_latents_and_keeps_the_engine(pack, family, node, inputs, order):
    """ModelSamplingFlux / ModelSamplingSD3 replace the model's model_sampling (an object patch outside the diffusion
    model): the engine serves every call, at the shifted sigmas."""
    cls = host_node("nodes_model_advanced", node)
    model, (pos, neg) = tiny(family, 40)

    def shifted(m):
        return run_node(cls, m, **inputs)

    plain = sample(shifted(model), pos, neg, 16, steps=3)
    assert not torch.allclose(plain, sample(model, pos, neg, 16, steps=3), atol=1e-4)  # the shift does change them
    acc = stacked(pack, model, order, shifted)
    assert H.same(sample(acc, pos, neg, 16, steps=3), plain)
    assert status(acc).engine_calls == 3 and status(acc).plain_calls == 0  # one call a step: cond and uncond batched


# ---------------------------------------------------------------------------------------------- compile

# One order: the compile's apply-model wrapper and the node's diffusion-model wrapper nest the same way in both, and each
# case costs a minute of dynamo's tracing on a CPU
@pytest.mark.parametrize("family,order", [("sd15", "after")])
def test_torch_compile_model_runs_its_compiled_forward_once_said(pack, family, order, caplog, monkeypatch):
    """TorchCompileModel compiles the diffusion model, tracing its forward and the wrappers in it: the node steps
    aside (its engine inside a traced forward would be traced too) with one message, its serving wrapper left out of
    the run (traced into the compiled graphs it would cost every call its frames and guards and change nothing), and
    the latents are plain's with the same compile. What the node meets is dynamo's tracing, whatever the backend: on
    the CPU the node's backends (inductor, cudagraphs) take minutes to compile, so torch.compile gets dynamo's eager
    backend here."""
    cls = host_node("nodes_torch_compile", "TorchCompileModel")
    import torch._dynamo

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_(model, **{**kw, "backend": "eager",
                                                                                "options": None}))
    model, (pos, neg) = tiny(family, 50)
    channels = dict(MODELS)[family]

    def compiled(m):
        return run_node(cls, m, backend="inductor")

    served = []
    serve = accelerated_unet.Session._serve_wrapped
    monkeypatch.setattr(accelerated_unet.Session, "_serve_wrapped",
                        lambda *a, **kw: served.append(1) or serve(*a, **kw))
    torch._dynamo.reset()
    plain = sample(compiled(model), pos, neg, channels, steps=1)
    acc = stacked(pack, model, order, compiled)
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        out = sample(acc, pos, neg, channels, steps=1)
        again = sample(acc, pos, neg, channels, steps=1)
    torch._dynamo.reset()
    assert H.same(out, plain) and H.same(again, plain)
    assert len(said(caplog, "TorchCompileModel compiles this model")) == 1
    assert not served, "the compiled forward ran the node's wrapper"
    assert status(acc).engine_calls == 0
    assert not any("forward" in vars(m) for m in model.model.diffusion_model.modules())


# -------------------------------------------------------------------------------------------- ControlNet

@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("family,channels", MODELS)
def test_controlnet_with_easycache_gives_plains_latents(pack, family, channels, order, caplog):
    """A ControlNet (SD1.5's, Flux's) on the conditioning with EasyCache on the model, before or after the node: the
    residuals reach the engine on the steps that run, the cache skips the same steps. (The ControlNet alone with the
    node: tests/test_comfyui_nodes.py and test_comfyui_dit.py.)"""
    cls = host_node("nodes_easycache", "EasyCacheNode")
    model, (pos, neg) = tiny(family, 60)
    hint = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(4))
    control = (H.tiny_controlnet if family == "sd15" else H.tiny_flux_controlnet)(61)
    control = control.copy().set_cond_hint(hint, 0.8, (0.0, 1.0))
    cpos, cneg = ([[c[0][0], {**c[0][1], "control": control, "control_apply_to_uncond": False}]] for c in (pos, neg))

    def with_cache(m):
        return run_node(cls, m, reuse_threshold=0.5, start_percent=0.0, end_percent=1.0, verbose=False)

    steps = 6
    with caplog.at_level(logging.INFO):
        plain = sample(with_cache(model), cpos, cneg, channels, steps)
        skipped_plain = skipped_steps(caplog, "EasyCache")
        caplog.clear()
        acc = stacked(pack, model, order, with_cache)
        out = sample(acc, cpos, cneg, channels, steps)
        skipped = skipped_steps(caplog, "EasyCache")
    assert not torch.allclose(plain, sample(with_cache(model), pos, neg, channels, steps), atol=1e-3)
    assert skipped == skipped_plain and H.same(out, plain)
    assert status(acc).plain_calls == 0 and status(acc).engine_calls == steps - skipped[0]  # cond and uncond batched


# ------------------------------------------------------------------------------------------ MultiGPU split

@pytest.mark.parametrize("order", ORDERS)
def test_multigpu_cfg_split_on_one_device_keeps_the_engine(pack, order):
    """MultiGPU CFG Split (ComfyUI 0.33) where there is no other device (the CPU): it adds no copy, and the node
    serves every call."""
    cls = host_node("nodes_multigpu", "MultiGPUCFGSplitNode")
    model, (pos, neg) = tiny("sd15", 70)
    plain = sample(model, pos, neg)
    acc = stacked(pack, model, order, lambda m: run_node(cls, m, max_gpus=2))
    assert H.same(sample(acc, pos, neg), plain)
    assert status(acc).engine_calls == 2 and status(acc).plain_calls == 0


@pytest.mark.parametrize("order", ORDERS)
def test_multigpu_cfg_split_over_two_devices_runs_comfyuis_forward_once_said(pack, order, monkeypatch,
                                                                             caplog):
    """MultiGPU CFG Split with a second device (a second CPU device index stands for a second GPU): its threads run
    a step's cond and uncond at once, each on its own copy of the model (loaded again from the file, as ComfyUI's
    loader registered); the node steps aside for those calls with one message, and the latents are plain's."""
    import comfy.model_management as mm

    cls = host_node("nodes_multigpu", "MultiGPUCFGSplitNode")
    model = H.tiny_model(80)
    model.cached_patcher_init = (H.tiny_model, (80,))  # what ComfyUI's loaders register: how to load it again
    pos, neg = H.tiny_conditioning(81)
    # models loaded by earlier tests and collected since: 0.33's reuse of loaded copies cannot step over them
    mm.unload_all_models()
    devices = [model.load_device, torch.device("cpu", 1)]
    monkeypatch.setattr(mm, "get_all_torch_devices", lambda exclude_current=False: devices)
    plain = sample(run_node(cls, model, max_gpus=2), pos, neg)  # cond and uncond apart: not batched as without
    acc = stacked(pack, model, order, lambda m: run_node(cls, m, max_gpus=2))
    assert acc.get_additional_models_with_key("multigpu"), "no copy for the second device"
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        out = sample(acc, pos, neg)
        sample(acc, pos, neg)
    assert H.same(out, plain)
    assert len(said(caplog, "MultiGPU CFG Split")) == 1
    assert status(acc).engine_calls == 0 and status(acc).plain_calls == 8


# ------------------------------------------------------------------------------------------------ RoPE

@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("family", ["flux", "wan"])
def test_scale_rope_gives_plains_latents_through_comfyuis_forward_once_said(pack, family, order, caplog):
    """ScaleROPE (ComfyUI 0.33) scales and shifts the positions the transformer's own forward computes, from
    transformer_options' rope_options, which the engine's call does not take: those calls run ComfyUI's forward, said
    once, and the latents are plain's with the same node, never the unscaled image."""
    cls = host_node("nodes_rope", "ScaleROPE")
    model, (pos, neg) = tiny(family, 50)

    def scaled(m):
        return run_node(cls, m, scale_x=2.0, shift_x=3.0, scale_y=0.5, shift_y=-2.0, scale_t=1.0, shift_t=0.0)

    def run(m):
        if family == "wan":
            return H.sample_frames(m, pos, neg, frames=3, steps=3)
        return sample(m, pos, neg, 16, steps=3)

    plain = run(scaled(model))
    assert not torch.allclose(plain, run(model), atol=1e-4)  # the scaling shows
    caplog.set_level(logging.INFO)
    acc = stacked(pack, model, order, scaled)
    assert H.same(run(acc), plain)
    assert status(acc).engine_calls == 0 and status(acc).plain_calls == 3
    assert len(said(caplog, "rope_options")) == 1
