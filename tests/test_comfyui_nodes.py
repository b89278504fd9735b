"""The nodes against ComfyUI's real classes (ModelPatcher, model_base, samplers, ControlNet, hooks), in this
process, on tiny seeded models. Skipped unless COMFYUI_ROOT names a ComfyUI checkout.

On the CPU the torch path runs the same kernels as the plain model, so "same" is exact there (on a GPU: within
fp16-level error); what these tests pin down is the routing: which calls reach the engine, which must not, and
that nothing is lost on the way.
"""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch

import comfy_helpers as H
from sd_accel.nodes import accelerated_unet  # the module ComfyUI runs: the pack loads this same package

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))


@pytest.fixture(scope="module")
def tiny():
    H.import_comfy()
    return H.tiny_model(0)


def accelerate(pack, model, backend="torch", **changes):
    node = pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]()
    out = node.apply(model, backend, True, False, **{**H.PROFILE, **changes}, unique_id="1")
    return out["result"][0], out["ui"]["text"][0]


def sample(model, positive, negative, steps=2, size=8, seed=1):
    import comfy.sample

    noise = torch.randn(1, 4, size, size, generator=torch.Generator().manual_seed(seed))
    latent = torch.zeros(1, 4, size, size)
    return comfy.sample.sample(model, noise, steps, 5.0, "euler", "normal", positive, negative, latent,
                               disable_pbar=True, seed=seed)


def status(pack, model):
    return accelerated_unet.session_of(model).slot.status


def attention_out(unet, run) -> tuple:
    """run()'s result, and the outputs of the UNet's attention layers (ComfyUI's CrossAttention) in its first call."""
    layers = [m for m in unet.modules() if type(m).__name__ == "CrossAttention"]
    outs = []
    hooks = [m.register_forward_hook(lambda m, args, out: outs.append(out.clone())) for m in layers]
    try:
        return run(), outs[:len(layers)]
    finally:
        for h in hooks:
            h.remove()


UNET_ASIDE = ("the attention layers that call {it} call {them} as ComfyUI's own forward does, not sd-accel's "
              "attention; the rest of the engine still runs.")


def test_accelerated_equals_plain_and_input_model_is_untouched(pack, tiny):
    pos, neg = H.tiny_conditioning(2)
    wrappers_before = {k: {k1: list(v1) for k1, v1 in v.items()} for k, v in tiny.wrappers.items()}
    uuid_before = tiny.patches_uuid
    acc, text = accelerate(pack, tiny)
    assert acc is not tiny and "backend: torch" in text
    assert H.same(sample(acc, pos, neg), sample(tiny, pos, neg))
    s = status(pack, acc)
    assert s.backend == "torch" and s.engine_calls == 2 and s.plain_calls == 0
    assert tiny.wrappers == wrappers_before and tiny.patches_uuid == uuid_before
    assert accelerated_unet.session_of(tiny) is None


def test_a_run_takes_its_conds_to_the_model_device_once_and_gives_comfyui_its_own_back(pack, tiny):
    """ComfyUI copies each cond from the CPU in every step, a copy that waits for the GPU. The node's sampler wrapper
    hands the sampler the run's conds on the load device (meta here: no CPU test has a second device), the same
    classes and values, and the guider gets its own conds back."""
    from comfy.patcher_extension import WrappersMP
    from sd_accel.nodes import conds as conds_on

    pos, neg = H.tiny_conditioning(2)
    seen = []

    def spy(executor, guider, *args, **kwargs):
        conds = guider.conds
        try:
            return executor(guider, *args, **kwargs)
        finally:
            seen.append((conds, guider.conds is conds))

    spied = tiny.clone()
    spied.add_wrapper_with_key(WrappersMP.SAMPLER_SAMPLE, "test spy", spy)  # added first, it runs outside the node's
    acc, _ = accelerate(pack, spied)
    assert H.same(sample(acc, pos, neg), sample(tiny, pos, neg))
    (processed, given_back), = seen
    assert given_back
    assert acc.wrappers[WrappersMP.SAMPLER_SAMPLE][accelerated_unet.KEY] == [conds_on.sample_with_conds_on_device]

    class Guider:
        model_patcher = type("Patcher", (), {"load_device": torch.device("meta")})()
        conds = processed

    given = []
    assert conds_on.sample_with_conds_on_device(lambda g, *a: given.append(g.conds) or "samples", Guider) == "samples"
    assert Guider.conds is processed
    (moved,) = given
    assert moved.keys() == processed.keys() == {"positive", "negative"}
    crossattn = 0
    for key in processed:
        for before, after in zip(processed[key], moved[key], strict=True):
            assert before.keys() == after.keys() and before["model_conds"].keys() == after["model_conds"].keys()
            for name, cond in before["model_conds"].items():
                now = after["model_conds"][name]
                assert type(now) is type(cond)
                if torch.is_tensor(cond.cond):
                    assert cond.cond.device.type == "cpu" and now.cond.device.type == "meta"
                    assert (now.cond.shape, now.cond.dtype) == (cond.cond.shape, cond.cond.dtype)
                    crossattn += name == "c_crossattn"
    assert crossattn == 2


def test_torch_path_is_kept_between_runs_and_freed_when_comfyui_unloads_the_model(pack, tiny):
    import comfy.model_management

    pos, neg = H.tiny_conditioning(2)
    acc, _ = accelerate(pack, tiny)
    slot = accelerated_unet.session_of(acc).slot
    sample(acc, pos, neg)
    kept = slot.acc
    assert kept is not None and kept.engine.suspended  # module changes undone, graphs kept
    assert H.same(sample(acc, pos, neg), sample(tiny, pos, neg))
    assert slot.acc is kept and kept.engine.suspended

    patched = acc.clone()  # another node replaces a submodule: the kept path is prepared again
    patched.add_object_patch("diffusion_model.out", copy.deepcopy(tiny.model.diffusion_model.out))
    sample(patched, pos, neg)
    assert slot.acc is not kept and slot.acc is not None

    comfy.model_management.unload_all_models()
    assert slot.acc is None


def test_low_vram_mode_frees_the_torch_path_after_each_run(pack, tiny, monkeypatch):
    import comfy.model_management as mm

    pos, neg = H.tiny_conditioning(2)
    acc, _ = accelerate(pack, tiny)
    monkeypatch.setattr(mm, "vram_state", mm.VRAMState.LOW_VRAM)
    assert H.same(sample(acc, pos, neg), sample(tiny, pos, neg))
    slot = accelerated_unet.session_of(acc).slot
    assert slot.acc is None and slot.status.engine_calls == 2  # served, then freed: no graphs held between runs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_gpu_next_run_replays_the_kept_graph_and_a_lora_in_between_is_honoured(pack, tiny):
    import comfy.sd

    pos, neg = H.tiny_conditioning(2)
    lora = H.lora_patches(tiny)
    plain = sample(tiny, pos, neg)
    plain_lora = sample(comfy.sd.load_lora_for_models(tiny, None, lora, 1.0, 0.0)[0], pos, neg)
    assert not H.same(plain_lora, plain)
    acc, _ = accelerate(pack, tiny)
    assert H.same(sample(acc, pos, neg), plain)
    slot = accelerated_unet.session_of(acc).slot
    engine = slot.acc.engine
    captures = engine.graphs.captures
    assert captures >= 1
    assert H.same(sample(acc, pos, neg), plain)
    assert slot.acc.engine is engine and engine.graphs.captures == captures  # the kept graph replayed
    assert H.same(sample(comfy.sd.load_lora_for_models(acc, None, lora, 1.0, 0.0)[0], pos, neg), plain_lora)
    assert H.same(sample(acc, pos, neg), plain)  # and back: no LoRA weights left in a replayed graph


@pytest.mark.parametrize("fusion,block", [("layout", "SpatialTransformer"),
                                          ("skip_layernorm", "BasicTransformerBlock"),
                                          ("qkv", "CrossAttention")])
def test_fusions_that_restate_a_comfyui_forward_cover_its_class(tiny, fusion, block):
    from sd_accel.accel.engine import fusions
    from sd_accel.accel.engine.fusions import packing

    unet = tiny.model.diffusion_model
    device = next(unet.parameters()).device
    n = sum(type(m).__name__ == block for m in unet.modules())
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 8, 8, generator=g).to(device).contiguous(memory_format=torch.channels_last)
    t, ctx = torch.tensor([10.0, 500.0], device=device), torch.randn(2, 77, 768, generator=g).to(device)
    with torch.no_grad():
        ref = unet(x, t, ctx)
        undo, counts = fusions.apply(unet, [fusion, "geglu"])
        try:
            patched = sum("forward" in vars(m) for m in unet.modules() if type(m).__name__ == block)
            out = unet(x, t, ctx)
        finally:
            undo()
            packing.unpack(unet)
    # ComfyUI's forward restated (layout: without its NCHW copy, so on the CPU channels_last all the way out; a
    # GPU's fp32 convolutions with NCHW weights may hand back NCHW): the same function
    assert counts[fusion] == n == patched > 0
    assert fusion != "layout" or device.type == "cuda" or out.is_contiguous(memory_format=torch.channels_last)
    if fusion == "skip_layernorm":  # ComfyUI's own Linear class still takes the residual add into its GEMM
        from sd_accel.accel.engine.fusions.skip_layernorm import _plain_output_linear

        ff = next(m for m in unet.modules() if type(m).__name__ == block).ff
        assert _plain_output_linear(ff, x.dtype) is ff.net[2]
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() <= (1e-2 if device.type == "cuda" else 1e-5)


@pytest.mark.parametrize("host_faster", [False, True])
def test_qkv_fusion_under_another_attention_comfyui_chose_runs_the_faster_and_leaves_an_override_its_call(
        tiny, comfy_pytorch_attention, host_attention, monkeypatch, caplog, host_faster):
    """ComfyUI's CrossAttention with the packed projections while ComfyUI's choice for the whole host is its split
    attention (--use-split-cross-attention; --use-sage-attention chooses sage the same way): the fused forward serves,
    with its own attention where nothing is timed (the CPU) or where that was faster, else with ComfyUI's (the timing,
    which needs a GPU, told here); a model patch's override keeps its call."""
    from sd_accel.accel.engine import fusions
    from sd_accel.accel.engine.fusions import packing

    if host_faster:
        monkeypatch.setattr(host_attention, "_may_time", lambda q: True)
        turns = iter([2.0, 1.0] * 8)  # ours is timed first, then ComfyUI's, per shape
        monkeypatch.setattr(host_attention, "call_ms", lambda fn, q, k, v: next(turns))
    unet = tiny.model.diffusion_model
    g = torch.Generator().manual_seed(5)
    x, t, ctx = torch.randn(2, 4, 8, 8, generator=g), torch.tensor([10.0, 500.0]), torch.randn(2, 77, 768, generator=g)
    override, overrides = H.attention_override()
    with torch.no_grad():
        ref = unet(x, t, ctx)
        split = H.use_comfy_attention("split", monkeypatch.setattr)
        undo, counts = fusions.apply(unet, ["qkv", "cross_attention"])
        try:
            with caplog.at_level(logging.WARNING, logger="sd-accel"):
                out = unet(x, t, ctx)
            served = len(split)
            unet(x, t, ctx, transformer_options={"optimized_attention_override": override})
        finally:
            undo()
            packing.unpack(unet)
    n = sum(type(m).__name__ == "CrossAttention" for m in unet.modules())
    assert counts["qkv"] == n and H.rel(out, ref) <= 1e-5
    assert [f.__name__ for f in overrides] == ["attention_split"] * n
    said = [r.getMessage() for r in caplog.records if "ComfyUI's attention is split" in r.getMessage()]
    assert len(said) == 1, said
    if host_faster:
        assert served == n and "the fused blocks run it: 1.00 ms against 2.00 ms for sd-accel's attention" in said[0]
    elif not torch.cuda.is_available():
        assert served == 0 and "on the cpu nothing is timed" in said[0], said


def test_attention_layers_whose_function_is_another_nodes_call_it_as_comfyui_does_said_once(
        pack, tiny, comfy_pytorch_attention, monkeypatch, caplog):
    """Another node's function where ComfyUI's CrossAttention finds its attention function (not ComfyUI's choice for
    the whole host): the qkv fusion's layers call it as ComfyUI's forward does, run after run, the image plain
    ComfyUI's with that function, and the node says so once, in the console and in the notes Accel Info shows."""
    import comfy.ldm.modules.attention as attention

    from sd_accel.nodes import info

    pos, neg = H.tiny_conditioning(2)
    ours = sample(tiny, pos, neg)
    monkeypatch.setattr(attention, "optimized_attention", H.sage_of_a_node)
    H.NODE_CALLS.clear()
    unet = tiny.model.diffusion_model
    plain, plain_layers = attention_out(unet, lambda: sample(tiny, pos, neg))
    calls = len(H.NODE_CALLS)
    assert calls and H.rel(plain, ours) > 1e-4
    acc, _ = accelerate(pack, tiny)
    session = accelerated_unet.session_of(acc)
    session.slot.options.update(triton_kernels=True, fusions=["qkv", "cross_attention"])
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        (out, layers), again = attention_out(unet, lambda: sample(acc, pos, neg)), sample(acc, pos, neg)
    assert session.slot.acc.engine.fusion_counts["qkv"] == len(plain_layers) > 0
    # the packed q/k/v projections are the engine's: the same products within rounding
    assert len(layers) == len(plain_layers) and all(H.rel(a, b) <= 1e-6 for a, b in zip(layers, plain_layers))
    assert H.rel(out, plain) <= 1e-6 and torch.equal(again, out)
    assert len(H.NODE_CALLS) == 3 * calls  # each layer's attention, as ComfyUI's forward calls it
    where = "comfy.ldm.modules.attention.optimized_attention"
    said = [r.getMessage() for r in caplog.records if r.name == "sd-accel" and where in r.getMessage()]
    assert said == [f"sd-accel: {where} is another node's function ({H.__name__}.sage_of_a_node), not ComfyUI's choice "
                    "for the whole host: " + UNET_ASIDE.format(it="it", them="it")], said
    s = status(pack, acc)
    assert s.engine_calls == 4 and s.plain_calls == 0 and said[0].removeprefix("sd-accel: ") in s.messages, s
    assert f"note: {said[0].removeprefix('sd-accel: ')}" in info.model_state(session, on_cpu=True)


def test_attention_layers_under_an_attention_override_call_it_as_comfyui_does_said_once(tiny, comfy_pytorch_attention,
                                                                                       caplog):
    """A model patch's optimized_attention_override in a call's transformer_options, on an engine that is handed them
    (the node sends such calls to ComfyUI's own forward before they reach it, and says so itself): the qkv fusion's
    layers call the override as ComfyUI's forward does, call after call, said once per engine; with ComfyUI's own
    choice and no override nothing is said."""
    from sd_accel.accel.accelerate import accelerate as engine_for
    from sd_accel.accel.models.spec import CanonicalUNet

    unet = tiny.model.diffusion_model
    g = torch.Generator().manual_seed(5)
    x, t, ctx = torch.randn(2, 4, 8, 8, generator=g), torch.tensor([10.0, 500.0]), torch.randn(2, 77, 768, generator=g)
    patched = {"transformer_options": {"optimized_attention_override": H.override_of_a_patch}}
    H.NODE_CALLS.clear()
    with torch.no_grad():
        ours = CanonicalUNet(unet)(x, t, ctx)
        plain, plain_layers = attention_out(unet, lambda: CanonicalUNet(unet)(x, t, ctx, **patched))
    calls = len(H.NODE_CALLS)
    assert calls and H.rel(plain, ours) > 1e-4
    acc = engine_for(unet, preference="torch", options={"triton_kernels": True, "fusions": ["qkv", "cross_attention"]})
    try:
        with caplog.at_level(logging.WARNING, logger="sd-accel"):
            assert H.rel(acc(x, t, ctx), ours) <= 1e-5
            assert not [r for r in caplog.records if "optimized_attention" in r.getMessage()]  # ComfyUI's choice
            (out, layers), again = attention_out(unet, lambda: acc(x, t, ctx, **patched)), acc(x, t, ctx, **patched)
    finally:
        acc.release()
    assert len(layers) == len(plain_layers) and all(H.rel(a, b) <= 1e-6 for a, b in zip(layers, plain_layers))
    assert H.rel(out, plain) <= 1e-6 and torch.equal(again, out) and len(H.NODE_CALLS) == 3 * calls
    where = "comfy.ldm.modules.attention.optimized_attention"
    said = [r.getMessage() for r in caplog.records if r.name == "sd-accel" and where in r.getMessage()]
    assert said == [f"sd-accel: a model patch sets optimized_attention_override ({H.__name__}.override_of_a_patch) for "
                    "this call: in the calls that carry it, " + UNET_ASIDE.format(it=where, them="the override")], said


def test_sdxl_model_is_accelerated(pack):
    xl = H.tiny_model(5, xl=True)
    pos, neg = H.tiny_conditioning(6, xl=True)
    acc, _ = accelerate(pack, xl)
    assert H.same(sample(acc, pos, neg), sample(xl, pos, neg))
    assert status(pack, acc).engine_calls == 2


def test_sdxl_with_weights_stored_in_fp8_runs_in_the_dtype_comfyui_feeds_it(pack):
    """ComfyUI's fp8_e4m3fn weight dtype: its layers widen each weight per call to the manual-cast dtype it picked
    for the device (float16 for SDXL on most GPUs, float32 on the CPU); the engine computes in that dtype too, not in
    one of its own (bfloat16 before: a GPU without it, or the CPU, got no engine)."""
    import torch

    xl = H.tiny_model(5, xl=True, weight_dtype=torch.float8_e4m3fn)
    fed = xl.model.manual_cast_dtype
    assert fed is not None and {p.dtype for p in xl.model.diffusion_model.parameters()} == {torch.float8_e4m3fn}
    pos, neg = H.tiny_conditioning(6, xl=True)
    acc, _ = accelerate(pack, xl)
    out = sample(acc, pos, neg)
    assert accelerated_unet.session_of(acc).slot.acc.unet.dtype == fed
    s = status(pack, acc)
    assert s.engine_calls == 2 and s.plain_calls == 0 and s.backend == "torch"
    assert H.same(out, sample(xl, pos, neg))


def test_lora_before_or_after_the_node_matches_plain_lora(pack, tiny):
    import comfy.sd

    pos, neg = H.tiny_conditioning(2)
    lora = H.lora_patches(tiny)

    def with_lora(m):
        return comfy.sd.load_lora_for_models(m, None, lora, 1.0, 0.0)[0]

    plain = sample(with_lora(tiny), pos, neg)
    assert not torch.allclose(plain, sample(tiny, pos, neg), atol=1e-3)  # the LoRA does change the result
    after, _ = accelerate(pack, tiny)
    after = with_lora(after)  # LoraLoader downstream: a clone of the accelerated model, same session
    before, _ = accelerate(pack, with_lora(tiny))
    assert H.same(sample(after, pos, neg), plain)
    assert H.same(sample(before, pos, neg), plain)
    assert status(pack, after).engine_calls == 2 and status(pack, before).engine_calls == 2
    # and without the LoRA again the accelerated model is back to the plain result: no weights left behind
    assert H.same(sample(accelerate(pack, tiny)[0], pos, neg), sample(tiny, pos, neg))


def test_controlnet_residuals_reach_the_unet_on_the_torch_path(pack, tiny):
    pos, neg = H.tiny_conditioning(2)
    hint = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(4)).movedim(-1, 1)
    control = H.tiny_controlnet(9).copy().set_cond_hint(hint, 0.8, (0.0, 1.0))
    cpos = [[pos[0][0], {**pos[0][1], "control": control, "control_apply_to_uncond": False}]]
    cneg = [[neg[0][0], {**neg[0][1], "control": control, "control_apply_to_uncond": False}]]
    plain = sample(tiny, cpos, cneg)
    assert not torch.allclose(plain, sample(tiny, pos, neg), atol=1e-3)
    acc, _ = accelerate(pack, tiny)
    assert H.same(sample(acc, cpos, cneg), plain)
    s = status(pack, acc)
    assert s.engine_calls == 2 and s.plain_calls == 0


def test_attention_replace_patch_that_changes_per_step_is_honoured(pack, tiny, caplog):
    pos, neg = H.tiny_conditioning(2)
    plain = sample(H.step_attention_patch(tiny), pos, neg)
    assert not torch.allclose(plain, sample(tiny, pos, neg), atol=1e-3)
    acc, _ = accelerate(pack, tiny)
    for patched in (H.step_attention_patch(acc), accelerate(pack, H.step_attention_patch(tiny))[0]):
        with caplog.at_level(logging.WARNING, logger="sd-accel"):
            assert H.same(sample(patched, pos, neg), plain)
        s = status(pack, patched)
        assert s.plain_calls == 2 and s.engine_calls == 0
        assert any("attn2 replace" in m for m in s.messages)
    assert sum("attn2 replace" in r.getMessage() for r in caplog.records) == 2  # once per node, not per step


def test_model_function_wrapper_outside_the_unet_keeps_the_engine(pack, tiny):
    pos, neg = H.tiny_conditioning(2)

    def per_step(apply_model, args):
        return apply_model(args["input"], args["timestep"], **args["c"]) * (1 + 0.1 * args["timestep"].max())

    def wrapped(m):
        m = m.clone()
        m.set_model_unet_function_wrapper(per_step)
        return m

    plain = sample(wrapped(tiny), pos, neg)
    assert not torch.allclose(plain, sample(tiny, pos, neg), atol=1e-3)
    acc = wrapped(accelerate(pack, tiny)[0])
    assert H.same(sample(acc, pos, neg), plain)
    assert status(pack, acc).engine_calls == 2


def test_weight_hooks_and_lowvram_run_the_plain_model(pack, tiny):
    import comfy.hooks
    from comfy.patcher_extension import CallbacksMP

    pos, neg = H.tiny_conditioning(2)
    hooks = comfy.hooks.create_hook_lora(H.lora_patches(tiny), 1.0, 0.0)
    hpos = comfy.hooks.set_hooks_for_conditioning(pos, hooks)
    acc, _ = accelerate(pack, tiny)
    assert H.same(sample(acc, hpos, neg), sample(tiny, hpos, neg))
    s = status(pack, acc)
    assert s.engine_calls == 0 and any("hooks" in m for m in s.messages)

    low, _ = accelerate(pack, tiny)
    low.add_callback(CallbacksMP.ON_PRE_RUN, lambda patcher: setattr(patcher.model, "model_lowvram", True))
    try:
        assert H.same(sample(low, pos, neg), sample(tiny, pos, neg))
    finally:
        tiny.model.model_lowvram = False
    s = status(pack, low)
    assert s.engine_calls == 0 and s.plain_calls == 2 and any("lowvram" in m for m in s.messages)


def test_other_model_types_pass_through_unchanged(pack, tiny):
    import comfy.model_patcher

    node = pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]()
    other = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), torch.device("cpu"), torch.device("cpu"))
    out = node.apply(other, "auto", True, False, **H.PROFILE, unique_id="3")
    assert out["result"][0] is other
    assert out["ui"]["text"][0].startswith("Linear is not accelerated (yet): sd-accel takes SD1.x, SD2.x and SDXL UNets")

    narrow = H.tiny_model(0)
    for block in narrow.model.diffusion_model.modules():  # a context width no SD family has
        if hasattr(block, "to_k") and block.to_k.in_features == 768:
            block.to_k = torch.nn.Linear(32, block.to_k.out_features, bias=False)
    out = node.apply(narrow, "auto", True, False, **H.PROFILE, unique_id="3")
    assert out["result"][0] is narrow and "custom layout" in out["ui"]["text"][0]


@pytest.mark.parametrize("changes, words", [
    (dict(min_width=1024, max_width=512), "min 1024, opt 128, max 512"),
    (dict(opt_height=100), "height 100 is not a multiple of 8"),
])
def test_bad_profile_says_so_and_still_runs_the_torch_path(pack, tiny, changes, words, caplog):
    pos, neg = H.tiny_conditioning(2)
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        acc, text = accelerate(pack, tiny, backend="onnxruntime", **changes)
    assert words in text and "torch path runs" in text
    assert words in caplog.text
    assert H.same(sample(acc, pos, neg, ), sample(tiny, pos, neg))
    assert status(pack, acc).backend == "torch"
    # the torch path never reads the profile: nothing said there
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        _, text = accelerate(pack, tiny, backend="torch", **changes)
    assert words not in text and words not in caplog.text


def test_backend_not_installed_falls_back_with_the_reason(pack, tiny, caplog, monkeypatch):
    import sd_accel.accel.plan.policy

    monkeypatch.setattr(sd_accel.accel.plan.policy, "probe_packages", lambda: {"onnxruntime": False})
    pos, neg = H.tiny_conditioning(2)
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        acc, text = accelerate(pack, tiny, backend="onnxruntime")
    assert "onnxruntime was asked for, but onnxruntime is not installed" in text
    assert "onnxruntime was asked for, but onnxruntime is not installed" in caplog.text
    assert H.same(sample(acc, pos, neg, ), sample(tiny, pos, neg))
    assert status(pack, acc).backend == "torch"


def test_sd_accel_backend_off_is_honoured_by_auto(pack, tiny, monkeypatch):
    monkeypatch.setenv("SD_ACCEL_BACKEND", "off")
    pos, neg = H.tiny_conditioning(2)
    acc, text = accelerate(pack, tiny, backend="auto")
    assert text.startswith("backend: off")
    assert H.same(sample(acc, pos, neg), sample(tiny, pos, neg))
    s = status(pack, acc)
    assert s.backend == "plain" and s.engine_calls == 0 and s.plain_calls == 2


def test_failed_build_runs_the_plain_model_and_says_why(pack, tiny, monkeypatch):
    import sd_accel.accel.engine.backends.torch_fused as torch_fused

    def broken(*_args, **_kwargs):
        raise RuntimeError("the build ran out of luck")

    monkeypatch.setattr(torch_fused, "build", broken)
    pos, neg = H.tiny_conditioning(2)
    acc, _ = accelerate(pack, tiny)
    assert H.same(sample(acc, pos, neg, ), sample(tiny, pos, neg))
    s = status(pack, acc)
    assert s.backend == "plain" and s.plain_calls == 2
    assert any("ran out of luck" in m for m in s.messages)


def test_accel_info_reports_gpu_plan_cache_and_model(pack, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SD_ACCEL_CACHE", str(tmp_path / "cache"))
    info = pack.NODE_CLASS_MAPPINGS["SDAccelInfo"]()
    acc, _ = accelerate(pack, tiny)
    pos, neg = H.tiny_conditioning(2)
    sample(acc, pos, neg)
    out = info.info("auto", acc)
    text = out["result"][0]
    assert out["ui"]["text"] == [text]
    # what ran, how fast, what to do next; then the machine
    model, machine = text.split("\nGPU: ")
    assert model.startswith("model: ") and "\npackages: " in machine
    lines = model.splitlines()
    assert [line.split(":")[0] for line in lines[1:5]] == ["path", "calls this run", "speed", "next"], lines
    assert re.fullmatch(r"speed: this run's sampling took \d+\.\d\d s for 2 calls, .*", lines[3]), lines[3]
    assert "plan for backend" not in text and text.count("\nbackend: torch") == 1  # the model's own plan, once
    assert f"engine cache: {tmp_path / 'cache'} (empty" in text
    # what doctor shows besides: the settings in force and the versions, with ComfyUI's
    assert f"\nsettings: SD_ACCEL_CACHE={tmp_path / 'cache'}" in text and f"torch {torch.__version__}, ComfyUI " in text
    if torch.cuda.is_available():
        assert "model: accelerated\npath: torch" in text
        assert "calls this run: 2 accelerated, 0 on the plain model" in text
        assert lines[4] == "next: nothing: the engine served every call of this run"
    else:  # the torch path is the plain model on the CPU: nothing is called accelerated
        assert "on the CPU: the torch path runs the plain model there, so nothing is sped up and no speed-up is " \
               "claimed\npath: torch" in text and "accelerated" not in model.split("model: ")[1]
        assert "calls this run: 2 on the torch path (the plain model's computation on the CPU), 0 on ComfyUI's " \
               "own forward" in text
        assert lines[3].endswith("(the CPU: the plain model's speed)")
        assert lines[4] == "next: run ComfyUI on a GPU (without --cpu) for the speed-up"
    sample(acc, pos, neg, steps=3)  # the next run's calls, not the sum of both
    assert "calls this run: 3 " in info.info("auto", acc)["result"][0]
    plain = info.info("auto", tiny)["result"][0]
    assert plain.startswith("model: not accelerated") and "plan for backend=auto:\nbackend: torch" in plain
    assert plain.splitlines()[1].startswith("next: put an Accelerated UNet node between")
    alone = info.info("auto")["result"][0]
    assert alone.startswith("model: none connected\nnext: connect the MODEL output of an Accelerated UNet node")


def test_cuda_graphs_left_on_is_not_a_request_the_node_reports(pack, tiny):
    """On (the default) means graphs where the GPU has them: a CPU or a graph-less GPU says nothing about it."""
    _, text = accelerate(pack, tiny)
    assert "cuda_graphs" not in text
    node = pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]()
    off = node.apply(tiny, "torch", False, False, **H.PROFILE, unique_id="1")["result"][0]
    assert accelerated_unet.session_of(off).slot.options["cuda_graphs"] is False


def test_every_widget_of_every_node_has_a_tooltip(pack):
    """ComfyUI shows an input's tooltip on hover: every value a user sets on a node says what it does."""
    widgets = ("INT", "FLOAT", "BOOLEAN", "STRING")
    missing = []
    for name, cls in pack.NODE_CLASS_MAPPINGS.items():
        inputs = cls.INPUT_TYPES()
        for group in ("required", "optional"):
            for key, spec in inputs.get(group, {}).items():
                is_widget = isinstance(spec[0], list) or spec[0] in widgets
                if is_widget and not (len(spec) > 1 and spec[1].get("tooltip")):
                    missing.append(f"{name}.{key}")
    assert not missing, missing


def test_the_shape_inputs_default_to_what_the_node_declares(pack, tiny):
    """A prompt without the nine shape inputs gets the declared defaults (apply's own), and the node runs with them."""
    import inspect

    node = pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]
    optional = node.INPUT_TYPES()["optional"]
    params = inspect.signature(node.apply).parameters
    assert {name: optional[name][1]["default"] for name in H.PROFILE} == {name: params[name].default
                                                                            for name in H.PROFILE}
    out = node().apply(tiny, "auto", True, False, unique_id="1")
    pos, neg = H.tiny_conditioning(2)
    assert H.same(sample(out["result"][0], pos, neg), sample(tiny, pos, neg))


@pytest.mark.parametrize("channels", [4, 16])  # SD's latents; Flux's and SD3's
def test_tiled_vae_decode_and_encode(pack, channels):
    vae = H.tiny_vae(1, channels)
    latent = torch.randn(1, channels, 16, 16, generator=torch.Generator().manual_seed(3))
    decode = pack.NODE_CLASS_MAPPINGS["SDAccelTiledVAEDecode"]()
    encode = pack.NODE_CLASS_MAPPINGS["SDAccelTiledVAEEncode"]()
    (image,) = decode.decode({"samples": latent}, vae, 64, 16, unique_id="5")
    assert image.shape == (1, 128, 128, 3)
    (z,) = encode.encode(image, vae, 64, 16, unique_id="6")
    assert z["samples"].shape == (1, channels, 16, 16)
    untiled = vae.decode(latent)
    # global GroupNorm statistics: the tiles add up to the untiled decode (a GPU's TF32 convolutions: 1e-2)
    tol = 1e-2 if torch.cuda.is_available() else 2e-3
    assert (image - untiled).abs().max() < tol
    assert (z["samples"] - vae.encode(image)).abs().max() < tol


def test_tiled_vae_decode_of_a_wan_video_is_comfyuis_untiled_decode(pack, monkeypatch, caplog):
    """A Wan 2.1 video latent through the node, in two tiles, gives the frames ComfyUI's own decode gives (what its
    VAEDecode node returns); ComfyUI's tiled decode (tiles in space and time, each from a fresh temporal cache,
    blended) does not."""
    import sd_accel.accel.vae as vt

    seen = []
    original = vt.decode_video
    monkeypatch.setattr(vt, "decode_video", lambda *a, **k: seen.append(k) or original(*a, **k))
    vae = H.tiny_wan_vae(1)
    z = torch.randn(1, 16, 3, 16, 2, generator=torch.Generator().manual_seed(3))
    untiled = vae.decode(z).reshape(-1, 128, 16, 3)
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="sd-accel"):  # as ComfyUI runs its nodes
        (images,) = pack.NODE_CLASS_MAPPINGS["SDAccelTiledVAEDecode"]().decode({"samples": z}, vae, 64, 0,
                                                                              memory_gb=2.5, unique_id="5")
    assert images.shape == untiled.shape == (9, 128, 16, 3)
    assert float((images - untiled).abs().max()) <= 1e-5
    assert [(k["tile"], k["memory_gb"]) for k in seen] == [(64, 2.5)]
    if hasattr(vae.first_stage_model.decoder, "run_up"):
        # ComfyUI 0.33's decoder runs its up blocks chunk by chunk, which the tiles do not take yet: the node says so
        # once and ComfyUI's own decode gives the video
        said = [r.getMessage() for r in caplog.records]
        assert sum("run_up" in m and "ComfyUI's own decode runs instead" in m for m in said) == 1, said
    # what ComfyUI's VAEDecodeTiled runs for a 64 px tile, 16 px overlap, 8 frames with 4 of overlap
    with torch.inference_mode():
        comfy_tiled = vae.decode_tiled(z, tile_x=8, tile_y=8, overlap=2, tile_t=2, overlap_t=1).reshape(-1, 128, 16, 3)
    assert float((comfy_tiled - untiled).abs().max()) > 0.05


def test_tiled_vae_nodes_pass_the_memory_limit_on(pack, monkeypatch):
    import sd_accel.accel.vae as vt

    seen = []
    for name in ("decode", "encode"):
        original = getattr(vt, name)
        monkeypatch.setattr(vt, name, lambda *a, _f=original, **k: seen.append(k["memory_gb"]) or _f(*a, **k))
    vae = H.tiny_vae(1)
    latent = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    decode = pack.NODE_CLASS_MAPPINGS["SDAccelTiledVAEDecode"]()
    encode = pack.NODE_CLASS_MAPPINGS["SDAccelTiledVAEEncode"]()
    (image,) = decode.decode({"samples": latent}, vae, 64, 16, memory_gb=2.5, unique_id="5")
    encode.encode(image, vae, 64, 16, memory_gb=0.0, unique_id="6")
    assert seen == [2.5, None]  # 0 on the node: what is free


def _loaded_tiny(calls: list):
    """The tiny model as a loader returns it under ComfyUI 0.33: a patcher with cached_patcher_init, the factory by
    which ComfyUI loads the model again (a custom loader registers its own; the core loaders re-read the file)."""
    def load(seed: int, disable_dynamic: bool = False):
        calls.append(disable_dynamic)
        return H.tiny_model(seed)

    model = load(0)
    model.cached_patcher_init = (load, (0,))
    return model


def test_under_dynamic_vram_the_node_accelerates_comfyuis_resident_copy(pack, caplog, monkeypatch):
    """ComfyUI 0.33's DynamicVRAM streams the weights through the GPU (ModelPatcherDynamic, which on a CPU load device
    ComfyUI itself turns into a ModelPatcher: here a ModelPatcher says it is dynamic in its place). The node
    accelerates ComfyUI's non-dynamic clone of it, with the LoRA patched before the node, loaded once however often
    the node runs; the input model is untouched; a model too large to keep on the GPU, or one ComfyUI cannot load
    again, passes through with one message."""
    H.import_comfy()
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.sd

    if not hasattr(comfy.model_patcher.ModelPatcher, "is_dynamic"):
        pytest.skip("a ComfyUI before DynamicVRAM (0.33) has no dynamic patcher")
    calls = []
    loaded = _loaded_tiny(calls)
    model = comfy.sd.load_lora_for_models(loaded, None, H.lora_patches(loaded), 0.7, 0.0)[0]
    monkeypatch.setattr(model, "is_dynamic", lambda: True)
    pos, neg = H.tiny_conditioning(2)
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        out, _ = accelerate(pack, model)
        again, _ = accelerate(pack, model)
    assert calls == [False, True]  # loaded by the workflow, then once more, resident
    assert out.model is again.model is not model.model and not out.is_dynamic()
    assert accelerated_unet.session_of(out) is not None and accelerated_unet.session_of(model) is None
    said = [r.getMessage() for r in caplog.records if "DynamicVRAM" in r.getMessage()]
    assert len(said) == 2 and "resident copy" in said[0]  # once per node run
    plain = model.clone()
    plain.is_dynamic = lambda: False
    assert torch.equal(sample(out, pos, neg), sample(plain, pos, neg))  # the LoRA came along
    assert accelerated_unet.session_of(out).slot.status.engine_calls > 0

    caplog.clear()
    monkeypatch.setattr(mm, "get_total_memory", lambda *a, **k: model.model_size())  # no quarter to spare
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        assert accelerate(pack, model)[0] is model
    assert "ComfyUI's own path runs" in caplog.records[-1].getMessage()
    monkeypatch.undo()
    unloadable = H.tiny_model(0)
    unloadable.is_dynamic = lambda: True
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        assert accelerate(pack, unloadable)[0] is unloadable
    assert "cannot load a resident copy" in caplog.records[-1].getMessage()
