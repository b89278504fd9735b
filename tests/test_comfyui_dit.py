"""The Accelerated UNet node on diffusion transformers (Flux.1, Chroma, SD3/SD3.5) against ComfyUI's real classes
(ModelPatcher, model_base.Flux / SD3, samplers, LoRA loading), in this process, on tiny seeded models. Skipped unless
COMFYUI_ROOT names a ComfyUI checkout.

On the CPU the torch path runs the plain model's own kernels unless the fused kernels are asked for (they then run
under Triton's interpreter): "same" is exact for the routing tests, within 1e-5 for the fused ones.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

import comfy_helpers as H
from sd_accel.nodes import accelerated_unet

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))

FAMILIES = ("flux", "chroma", "sd3")
# the module whose optimized_attention each family's blocks call
ATTENTION_OF = {"flux": "comfy.ldm.flux.math", "chroma": "comfy.ldm.flux.math",
                "sd3": "comfy.ldm.modules.diffusionmodules.mmdit"}
def blocks_out(module, run) -> tuple:
    """run()'s result, and the outputs of the diffusion model `module`'s transformer blocks in its first call, in
    order."""
    blocks = [m for m in module.modules()
              if type(m).__name__ in ("DoubleStreamBlock", "SingleStreamBlock", "JointBlock")]
    outs = []

    def keep(m, args, out):
        outs.append([t.clone() for t in (out if isinstance(out, tuple) else (out,)) if t is not None])

    hooks = [m.register_forward_hook(keep) for m in blocks]
    try:
        return run(), outs[:len(blocks)]
    finally:
        for h in hooks:
            h.remove()


def accelerate(pack, model):
    node = pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]()
    out = node.apply(model, "torch", True, False, **H.PROFILE, unique_id="7")
    return out["result"][0], out["ui"]["text"][0]


def sample(model, positive, negative, steps=2, size=8, seed=1, cfg=3.0):
    import comfy.sample

    noise = torch.randn(1, 16, size, size, generator=torch.Generator().manual_seed(seed))
    latent = torch.zeros(1, 16, size, size)
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "normal", positive, negative, latent,
                               disable_pbar=True, seed=seed)


def status(model):
    return accelerated_unet.session_of(model).slot.status


@pytest.mark.parametrize("family", FAMILIES)
def test_transformer_is_accelerated_and_equals_plain(pack, family):
    model = H.tiny_dit(family, 0)
    pos, neg = H.tiny_dit_conditioning(family, 1)
    wrappers_before = {k: {k1: list(v1) for k1, v1 in v.items()} for k, v in model.wrappers.items()}
    acc, text = accelerate(pack, model)
    assert acc is not model and "backend: torch" in text
    assert H.same(sample(acc, pos, neg), sample(model, pos, neg))
    s = status(acc)
    assert s.backend == "torch" and s.engine_calls == 2 and s.plain_calls == 0, s
    assert model.wrappers == wrappers_before
    # SD3's forward is served through a per-call instance attribute: none is left behind
    assert "forward" not in vars(model.model.diffusion_model)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_kernels_inside_comfyui_sampling_match_plain(pack, comfy_pytorch_attention, family, monkeypatch,
                                                           caplog):
    """The DiT fusions, asked for on the CPU (Triton's interpreter), in a real ComfyUI sampling run: ComfyUI on a GPU
    uses its PyTorch attention, which the fused blocks require; on the CPU it picks another one unless told. With
    ComfyUI's own choice nothing is said of the attention function."""
    model = H.tiny_dit(family, 2)
    pos, neg = H.tiny_dit_conditioning(family, 3)
    plain = sample(model, pos, neg)
    acc, _ = accelerate(pack, model)
    slot = accelerated_unet.session_of(acc).slot
    slot.options["triton_kernels"] = True
    seen = []
    original = slot._build

    def build(*a, **k):
        original(*a, **k)
        seen.append(dict(slot.acc.engine.fusion_counts or {}))

    monkeypatch.setattr(slot, "_build", build)
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        out = sample(acc, pos, neg)
    assert seen and seen[0].get({"sd3": "mmdit"}.get(family, family), 0) > 0, seen
    assert ((out - plain).norm() / plain.norm()).item() <= 1e-5
    assert status(acc).engine_calls == 2
    assert not [r for r in caplog.records if r.name == "sd-accel" and "optimized_attention" in r.getMessage()]
    # and the blocks are ComfyUI's own again once the run ended
    assert not any("forward" in vars(m) for m in model.model.diffusion_model.modules())


@pytest.mark.parametrize("family", ["flux", "chroma"])
def test_an_engine_call_that_raises_runs_on_comfyuis_forward_once_said(pack, comfy_pytorch_attention, family, caplog,
                                                                       monkeypatch):
    """A fused block that raises in the middle of an engine call (a host class changed in a way no check caught): the
    call, and the rest of the run, run ComfyUI's own forward with its blocks as ComfyUI wrote them, the image is
    plain's, it is said once (and kept for Accel Info), and the next run tries the engine again."""
    from sd_accel.accel.engine.fusions import chroma, flux

    model = H.tiny_dit(family, 6)
    pos, neg = H.tiny_dit_conditioning(family, 7)
    plain = sample(model, pos, neg)
    acc, _ = accelerate(pack, model)
    accelerated_unet.session_of(acc).slot.options["triton_kernels"] = True

    def broken(*args, **kwargs):
        raise AttributeError("'DoubleStreamBlock' object has no attribute 'gone'")

    for fusion in (flux, chroma):  # ComfyUI 0.3.64's Chroma blocks are its own; 0.33's are Flux's
        monkeypatch.setattr(fusion, "double_block", broken)
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        out = sample(acc, pos, neg)
        again = sample(acc, pos, neg)
    assert torch.equal(out, plain) and torch.equal(again, plain)
    said = [r.getMessage() for r in caplog.records if "failed on a call" in r.getMessage()]
    assert len(said) == 1 and "AttributeError" in said[0] and "plain model" in said[0], said
    s = status(acc)
    assert s.engine_calls == 0 and s.plain_calls == 4 and any("failed on a call" in m for m in s.messages), s
    assert not any("forward" in vars(m) for m in model.model.diffusion_model.modules())


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_blocks_serve_under_another_attention_comfyui_chose_and_an_override_runs_comfyuis_forward(
        pack, comfy_pytorch_attention, host_attention, family, monkeypatch, caplog):
    """ComfyUI started with --use-split-cross-attention (as with --use-sage-attention, whose sage needs a GPU): the
    node's fused blocks still serve, equal to plain ComfyUI with its PyTorch attention, and say once what they run (on
    the CPU: SDPA, nothing timed); a model patch's optimized_attention_override runs ComfyUI's own forward."""
    model = H.tiny_dit(family, 2)
    pos, neg = H.tiny_dit_conditioning(family, 3)
    plain = sample(model, pos, neg)
    split = H.use_comfy_attention("split", monkeypatch.setattr)
    fused = H.counted_sdpa(monkeypatch.setattr)
    acc, _ = accelerate(pack, model)
    accelerated_unet.session_of(acc).slot.options["triton_kernels"] = True
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        out, again = sample(acc, pos, neg), sample(acc, pos, neg)
    assert H.rel(out, plain) <= 1e-5 and torch.equal(out, again)
    assert fused and status(acc).engine_calls == 4 and status(acc).plain_calls == 0
    said = [r.getMessage() for r in caplog.records if "ComfyUI's attention is split" in r.getMessage()]
    assert len(said) == 1 and any(said[0].endswith(m) for m in status(acc).messages), (said, status(acc).messages)
    assert not [r for r in caplog.records if "not ComfyUI's choice" in r.getMessage()]  # split is its choice
    if not torch.cuda.is_available():
        assert not split and "nothing is timed: the fused blocks run PyTorch's SDPA" in said[0]
    override, overrides = H.attention_override()
    calls = len(fused)
    patched = acc.clone()
    patched.model_options["transformer_options"]["optimized_attention_override"] = override
    assert H.rel(sample(patched, pos, neg), plain) <= 1e-5  # ComfyUI's split attention, through the override
    assert overrides and {f.__name__ for f in overrides} == {"attention_split"} and len(fused) == calls
    assert status(patched).plain_calls == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_whose_attention_is_another_nodes_function_run_comfyuis_forward_said_once(
        pack, comfy_pytorch_attention, family, monkeypatch, caplog):
    """Another node's function where the blocks find their attention function (not ComfyUI's choice for the whole
    host): the fused blocks run ComfyUI's own forward with it, run after run, the image plain ComfyUI's with that
    function, and the node says so once, in the console and in the notes Accel Info shows."""
    from sd_accel.nodes import info

    where = f"{ATTENTION_OF[family]}.optimized_attention"
    model = H.tiny_dit(family, 2)
    pos, neg = H.tiny_dit_conditioning(family, 3)
    ours = sample(model, pos, neg)
    monkeypatch.setattr(importlib.import_module(ATTENTION_OF[family]), "optimized_attention", H.sage_of_a_node)
    H.NODE_CALLS.clear()
    plain, plain_blocks = blocks_out(model.model.diffusion_model, lambda: sample(model, pos, neg))
    calls = len(H.NODE_CALLS)
    assert calls and H.rel(plain, ours) > 1e-4  # the node's function runs in ComfyUI's blocks (fused: 1e-5)
    acc, _ = accelerate(pack, model)
    session = accelerated_unet.session_of(acc)
    session.slot.options["triton_kernels"] = True
    fused = H.counted_sdpa(monkeypatch.setattr)
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        (out, blocks), again = blocks_out(model.model.diffusion_model, lambda: sample(acc, pos, neg)), \
            sample(acc, pos, neg)
    # the blocks' outputs exactly ComfyUI's; the image within what the engine's final layer (the adaLN kernel) rounds
    assert len(blocks) == len(plain_blocks) and all(torch.equal(a, b) for mine, theirs in zip(blocks, plain_blocks)
                                                    for a, b in zip(mine, theirs, strict=True))
    assert H.rel(out, plain) <= 1e-6 and torch.equal(again, out)
    assert len(H.NODE_CALLS) == 3 * calls and not fused  # each block's attention, as ComfyUI's forward calls it
    said = [r.getMessage() for r in caplog.records if r.name == "sd-accel" and where in r.getMessage()]
    assert said == [f"sd-accel: {where} is another node's function ({H.__name__}.sage_of_a_node), not ComfyUI's choice "
                    "for the whole host: the blocks that call it run ComfyUI's own forward with it, not sd-accel's "
                    "fused blocks; the rest of the engine still runs."], said
    s = status(acc)
    assert s.engine_calls == 4 and s.plain_calls == 0 and said[0].removeprefix("sd-accel: ") in s.messages, s
    assert f"note: {said[0].removeprefix('sd-accel: ')}" in info.model_state(session, on_cpu=True)


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_blocks_under_an_attention_override_run_comfyuis_forward_said_once_per_engine(comfy_pytorch_attention, family,
                                                                                     monkeypatch, caplog):
    """A model patch's optimized_attention_override in a call's transformer_options, on an engine that is handed them
    (the node sends such calls to ComfyUI's own forward before they reach it, and says so itself): the fused blocks run
    ComfyUI's own forward with the override, call after call, as ComfyUI's model does, said once per engine."""
    from sd_accel.accel.accelerate import accelerate as engine_for
    from sd_accel.accel.models import configs
    from sd_accel.accel.models.dit import CanonicalDiT

    name = H.tiny_name(family)
    model = configs.build_dit(name, "comfy", comfyui_root=H.comfy_root(), device="cpu")
    inp = configs.dit_example_inputs(name, batch=1, latent=(8, 10), device="cpu")
    patched = {"transformer_options": {"optimized_attention_override": H.override_of_a_patch}}
    H.NODE_CALLS.clear()
    with torch.no_grad():
        ours = CanonicalDiT(model)(**inp)
        plain, plain_blocks = blocks_out(model, lambda: CanonicalDiT(model)(**inp, **patched))
    calls = len(H.NODE_CALLS)
    assert calls and H.rel(plain, ours) > 1e-4
    fused = H.counted_sdpa(monkeypatch.setattr)
    acc = engine_for(model, preference="torch", options={"triton_kernels": True})
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        (out, blocks), again = blocks_out(model, lambda: acc(**inp, **patched)), acc(**inp, **patched)
        assert not fused and len(H.NODE_CALLS) == 3 * calls
        acc.release()
        acc = engine_for(model, preference="torch", options={"triton_kernels": True})
        acc(**inp, **patched)  # another engine: said once more
        acc.release()
    assert len(blocks) == len(plain_blocks) and all(torch.equal(a, b) for mine, theirs in zip(blocks, plain_blocks)
                                                    for a, b in zip(mine, theirs, strict=True))
    assert H.rel(out, plain) <= 1e-6 and torch.equal(again, out)
    where = {"flux": "comfy.ldm.flux.math", "sd3": "comfy.ldm.modules.diffusionmodules.mmdit"}[family]
    said = [r.getMessage() for r in caplog.records if r.name == "sd-accel" and "optimized_attention" in r.getMessage()]
    assert said == 2 * [f"sd-accel: a model patch sets optimized_attention_override ({H.__name__}.override_of_a_patch) "
                        f"for this call: in the calls that carry it, the blocks that call {where}.optimized_attention "
                        "run ComfyUI's own forward with the override, not sd-accel's fused blocks; the rest of the "
                        "engine still runs."], said


@pytest.mark.parametrize("family", ["flux", "chroma"])
def test_flux_lora_after_the_node_matches_plain_lora(pack, family):
    import comfy.sd

    model = H.tiny_dit(family, 4)
    pos, neg = H.tiny_dit_conditioning(family, 5)
    lora = H.lora_patches(model, 6, take=lambda key: key.endswith(("qkv.weight", "linear1.weight")))

    def with_lora(m):
        return comfy.sd.load_lora_for_models(m, None, lora, 1.0, 0.0)[0]

    plain = sample(with_lora(model), pos, neg)
    assert not torch.allclose(plain, sample(model, pos, neg), atol=1e-3)  # the LoRA reaches the transformer
    after = with_lora(accelerate(pack, model)[0])
    assert H.same(sample(after, pos, neg), plain)
    assert status(after).engine_calls == 2


def test_flux_controlnet_residuals_reach_the_transformer_on_the_torch_path(pack):
    model = H.tiny_dit("flux", 10)
    pos, neg = H.tiny_dit_conditioning("flux", 11)
    hint = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(4))
    control = H.tiny_flux_controlnet(12).copy().set_cond_hint(hint, 0.8, (0.0, 1.0))
    cpos, cneg = ([[c[0][0], {**c[0][1], "control": control, "control_apply_to_uncond": False}]] for c in (pos, neg))
    plain = sample(model, cpos, cneg)
    assert not torch.allclose(plain, sample(model, pos, neg), atol=1e-3)  # the ControlNet changes the image
    acc, _ = accelerate(pack, model)
    assert H.same(sample(acc, cpos, cneg), plain)
    s = status(acc)
    assert s.engine_calls == 2 and s.plain_calls == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_block_replace_patch_runs_comfyuis_forward_and_says_why(pack, family, caplog):
    model = H.tiny_dit(family, 7)
    pos, neg = H.tiny_dit_conditioning(family, 8)

    def louder(args, extra):
        out = extra["original_block"](args)
        return {k: v * 1.1 if k == "img" else v for k, v in out.items()}

    patched = model.clone()
    patched.set_model_patch_replace(louder, "dit", "double_block", 0)
    plain = sample(patched, pos, neg)
    assert not torch.allclose(plain, sample(model, pos, neg), atol=1e-4)
    acc = accelerate(pack, model)[0].clone()
    acc.set_model_patch_replace(louder, "dit", "double_block", 0)
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        assert H.same(sample(acc, pos, neg), plain)
    s = status(acc)
    assert s.plain_calls == 2 and s.engine_calls == 0
    assert any("dit replace" in m for m in s.messages), s.messages


def test_other_transformers_pass_through_with_a_reason(pack):
    import comfy.ldm.flux.model

    model = H.tiny_dit("flux", 9)

    class FluxVariant(comfy.ldm.flux.model.Flux):  # a subclass with inputs or blocks of its own
        pass

    model.model.diffusion_model.__class__ = FluxVariant
    node = pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]()
    out = node.apply(model, "auto", True, False, **H.PROFILE, unique_id="8")
    text = out["ui"]["text"][0]
    assert out["result"][0] is model and "FluxVariant) is not accelerated (yet)" in text


@pytest.mark.parametrize("family,frames", [("wan", 3), ("qwen-image", 1)])
def test_wan_and_qwen_image_are_accelerated_and_equal_plain(pack, family, frames):
    """ComfyUI's WanModel (text-to-video, through supported_models.WAN21_T2V) and Qwen-Image through the node: every
    call served by the engine, the latents plain ComfyUI's; a LoRA after the node changes them as it does plain's."""
    import comfy.sd

    model = H.tiny_dit(family, 7)
    pos, neg = H.tiny_dit_conditioning(family, 8)
    acc, text = accelerate(pack, model)
    assert "backend: torch" in text
    plain = H.sample_frames(model, pos, neg, frames)
    assert H.same(H.sample_frames(acc, pos, neg, frames), plain)
    s = status(acc)
    assert s.engine_calls == 2 and s.plain_calls == 0, s
    lora = H.lora_patches(model, 9, take=lambda key: key.endswith((".q.weight", "to_q.weight", "ffn.0.weight",
                                                                     "img_mlp.net.0.proj.weight")))
    assert lora

    def with_lora(m):
        return comfy.sd.load_lora_for_models(m, None, lora, 1.0, 0.0)[0]

    plain_lora = H.sample_frames(with_lora(model), pos, neg, frames)
    assert not torch.allclose(plain_lora, plain, atol=1e-3)  # the LoRA reaches the transformer
    after = with_lora(acc)
    assert H.same(H.sample_frames(after, pos, neg, frames), plain_lora)
    assert status(after).engine_calls == 4


def test_wan_image_to_video_inputs_run_comfyuis_own_forward_and_say_so(pack):
    """Wan's image-to-video CLIP features are an input the engine does not take: ComfyUI's forward serves those calls,
    the image is plain's, and the node says why."""
    model = H.tiny_dit("wan", 10)
    pos, neg = H.tiny_dit_conditioning("wan", 11)
    acc, _ = accelerate(pack, model)
    session = accelerated_unet.session_of(acc)
    session.patcher = acc
    why = session.why_plain(0, {}, {"clip_fea": torch.zeros(1, 257, 1280)})
    assert why is not None and "clip_fea" in why[1]
