"""Diffusion transformers (Flux.1, Chroma, SD3/SD3.5) behind the canonical call, on the torch path, on the CPU: their
specs, diffusers' packed-token call against its own pipeline's packing, the plan (torch only), and ComfyUI's and
diffusers' classes with the fused DiT kernels (Triton's interpreter) against their own forward; fp8 products."""

from __future__ import annotations

import re

import pytest
import torch

import comfy_helpers as H
from sd_accel.accel.accelerate import accelerate
from sd_accel.accel.errors import BadInput
from sd_accel.accel.models import configs
from sd_accel.accel.models.dit import CanonicalDiT, inspect_dit
from sd_accel.accel.models.spec import CanonicalUNet, canonical
from sd_accel.accel.plan.device import GpuInfo

CPU = GpuInfo(vendor="cpu", family="cpu", name="cpu", dtypes=("float32",))
# Where the fused kernels run: a GPU, else the CPU under Triton's interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED_TOL = 1e-4 if DEVICE == "cuda" else 1e-5


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("name,family,depths", [("tiny-flux", "flux", (2, 2)), ("tiny-sd3", "sd3", (2, 0))])
def test_diffusers_transformers_are_recognised(name, family, depths):
    model = configs.build_dit(name, "diffusers")
    spec = inspect_dit(model)
    assert (spec.form, spec.family, (spec.depth, spec.single_depth), spec.in_channels) == \
        ("diffusers", family, depths, 16)
    assert isinstance(canonical(model), CanonicalDiT) and spec.num_params == sum(p.numel() for p in model.parameters())


def test_diffusers_flux_call_packs_latents_as_its_pipeline_does():
    from diffusers import FluxPipeline

    model = configs.build_dit("tiny-flux", "diffusers")
    inp = configs.dit_example_inputs("tiny-flux", batch=2, latent=(8, 12))
    x, ctx = inp["x"], inp["context"]
    B, C, H, W = x.shape
    with torch.no_grad():
        out = CanonicalDiT(model)(**inp)
        packed = FluxPipeline._pack_latents(x, B, C, H, W)
        ids = FluxPipeline._prepare_latent_image_ids(B, H // 2, W // 2, x.device, x.dtype)
        want = model(hidden_states=packed, timestep=inp["timesteps"], guidance=inp["guidance"],
                     pooled_projections=inp["y"], encoder_hidden_states=ctx,
                     txt_ids=torch.zeros(ctx.shape[1], 3), img_ids=ids, return_dict=False)[0]
        # the pipeline's unpacking takes pixel sizes (8 pixels per latent)
        want = FluxPipeline._unpack_latents(want, H * 8, W * 8, 8)
    assert out.shape == x.shape and torch.equal(out, want)


def test_transformer_runs_on_the_torch_path_even_when_onnxruntime_is_asked_for():
    model = configs.build_dit("tiny-sd3", "diffusers")
    inp = configs.dit_example_inputs("tiny-sd3", batch=2)
    with torch.no_grad():
        ref = CanonicalDiT(model)(**inp)
    acc = accelerate(model, preference="onnxruntime", gpu=CPU)
    assert acc.backend == "torch" and any("UNets only" in r for r in acc.plan.reasons)
    with torch.no_grad():
        out = acc(inp["x"], inp["timesteps"], inp["context"], inp["y"])
    assert torch.equal(out, ref)
    acc.release()


def test_odd_latent_size_runs_the_plain_model_and_says_how_to_fix_it(caplog):
    model = configs.build_dit("tiny-flux", "diffusers")
    inp = configs.dit_example_inputs("tiny-flux", batch=1, latent=(8, 8))
    acc = accelerate(model, preference="torch", gpu=CPU)
    x = torch.randn(1, 16, 8, 7)
    with torch.no_grad():
        with pytest.raises(Exception):  # the plain diffusers call cannot take an odd width either
            acc(x, inp["timesteps"], inp["context"], inp["y"], guidance=inp["guidance"])
    assert any("multiple of 2" in r.getMessage() for r in caplog.records)


def test_a_unet_refuses_a_guidance_input():
    unet = CanonicalUNet(configs.build_unet("tiny-sd15"))
    x, t, ctx, y = configs.example_inputs(unet.unet, batch=1)
    with pytest.raises(BadInput, match="guidance"):
        unet(x, t, ctx, y, guidance=torch.ones(1))


def test_bad_conditioning_names_the_width_it_needs():
    dit = CanonicalDiT(configs.build_dit("tiny-flux", "diffusers"))
    with pytest.raises(BadInput, match="takes \\(batch, tokens, 32\\)"):
        dit.check(torch.zeros(1, 16, 8, 8), torch.zeros(1, 7, 31), torch.zeros(1, 24))


@pytest.mark.parametrize("name,fusion,blocks", [("tiny-flux", "flux", 5), ("tiny-sd3", "mmdit", 3),
                                                ("tiny-chroma", "chroma", 5), ("tiny-wan", "wan", 3),
                                                ("tiny-qwen-image", "qwen_image", 3)])
def test_comfyuis_transformers_with_fused_kernels_match_their_own_forward(comfy_pytorch_attention, name, fusion,
                                                                           blocks):
    pytest.importorskip("triton")
    from sd_accel.accel.engine import fusions

    model = configs.build_dit(name, "comfy", comfyui_root=H.comfy_root(), device=DEVICE)
    inp = configs.dit_example_inputs(name, batch=2, latent=(8, 10), device=DEVICE)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    canon = CanonicalDiT(model)
    with torch.no_grad():
        ref = canon(**inp)
        undo, counts = fusions.apply(model)
        if fusion == "chroma" and counts["flux"]:
            # ComfyUI 0.33's Chroma builds its blocks from Flux's classes (modulations handed in): the flux fusion
            # takes those, the chroma fusion Chroma's own last layer
            assert counts == {f: {"flux": blocks - 1, "chroma": 1}.get(f, 0) for f in fusions.DIT}
        else:
            assert counts == {f: blocks if f == fusion else 0 for f in fusions.DIT}
        out = canon(**inp)
        undo()
        back = canon(**inp)
    assert rel(out, ref) <= FUSED_TOL
    assert torch.equal(back, ref) and not any("forward" in vars(m) for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name,fusion,blocks", [("tiny-flux", "flux_diffusers", 4), ("tiny-sd3", "mmdit_diffusers", 2)])
def test_diffusers_transformers_with_fused_kernels_match_their_own_forward(name, fusion, blocks, monkeypatch):
    """diffusers' form: its blocks with the DiT kernels against its own forward, in fp32 (Triton's interpreter on the
    CPU); undone, the model is its own again. Flux's q, k and v are packed (packing.py): one GEMM per stream."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    import torch.nn.functional as F

    from sd_accel.accel.engine import fusions
    from sd_accel.accel.engine.fusions import packing

    model = configs.build_dit(name, "diffusers", device=DEVICE)
    inp = configs.dit_example_inputs(name, batch=2, latent=(8, 10), device=DEVICE)
    canon = CanonicalDiT(model)
    gemms = []
    monkeypatch.setattr(packing, "F", SimpleNamespace(linear=lambda *args: gemms.append(1) or F.linear(*args)))
    with torch.no_grad():
        ref = canon(**inp)
        undo, counts = fusions.apply(model)
        assert counts[fusion] == blocks and sum(counts.values()) == blocks
        out = canon(**inp)
        undo()
        back = canon(**inp)
    assert rel(out, ref) <= FUSED_TOL and not torch.equal(out, ref)  # close, and from the fused forwards
    assert torch.equal(back, ref) and not any("forward" in vars(m) for m in model.modules())
    if fusion == "flux_diffusers":  # a double block's two streams, a single block's one
        streams = 2 * len(model.transformer_blocks) + len(model.single_transformer_blocks)
        assert len(gemms) == streams and len(packing.packs(model)) == streams
    packing.unpack(model)


def test_comfyuis_chroma_is_flux_without_pooled_input(comfy_pytorch_attention):
    model = configs.build_dit("tiny-chroma", "comfy", comfyui_root=H.comfy_root())
    spec = inspect_dit(model)
    assert (spec.form, spec.family, spec.depth, spec.single_depth, spec.in_channels, spec.pooled_dim) == \
        ("comfy", "chroma", 2, 2, 16, 0)
    inp = configs.dit_example_inputs("tiny-chroma", batch=2, latent=(8, 10))
    assert "y" not in inp
    with torch.no_grad():
        out = CanonicalDiT(model)(**inp)
        without_guidance = CanonicalDiT(model)(**{k: v for k, v in inp.items() if k != "guidance"})
    assert out.shape == inp["x"].shape and torch.equal(out, without_guidance)  # ComfyUI's default guidance is 0
    with pytest.raises(ValueError, match="ComfyUI's form only"):
        configs.build_dit("tiny-chroma", "diffusers")


def test_comfy_flux_torch_path_with_kernels_matches_plain_and_honours_a_weight_change(comfy_pytorch_attention):
    """accelerate() on ComfyUI's Flux with the fused kernels (asked for: the CPU plan leaves them off), and the same
    engine after the weights change in place (a LoRA merged by ComfyUI)."""
    pytest.importorskip("triton")
    model = configs.build_dit("tiny-flux", "comfy", comfyui_root=H.comfy_root(), device=DEVICE)
    inp = configs.dit_example_inputs("tiny-flux", batch=1, device=DEVICE)
    plain = CanonicalDiT(model)
    acc = accelerate(model, preference="torch", options={"triton_kernels": True})  # on the CPU: Triton interpreted
    args = (inp["x"], inp["timesteps"], inp["context"], inp["y"])
    with torch.no_grad():
        out = acc(*args, guidance=inp["guidance"])
        assert acc.engine.fusion_counts["flux"] == 5
        acc.suspend()
        ref = plain(*args, guidance=inp["guidance"])
        assert rel(out, ref) <= FUSED_TOL
        model.double_blocks[0].img_attn.qkv.weight.mul_(1.5)
        ref2 = plain(*args, guidance=inp["guidance"])
        out2 = acc(*args, guidance=inp["guidance"])
    assert rel(ref2, ref) > 1e-3 and rel(out2, ref2) <= FUSED_TOL
    acc.release()


def _counted_adaln(monkeypatch) -> list:
    """The adaLN kernel's calls (one per fused block's stream), counted."""
    from sd_accel.accel.engine.fusions.base import kernel_module

    adaln = kernel_module("adaln")
    calls = []
    monkeypatch.setattr(adaln, "modulated_layer_norm", lambda *a, f=adaln.modulated_layer_norm, **k:
                        calls.append(1) or f(*a, **k))
    return calls


def test_fused_blocks_leave_calls_they_do_not_cover_to_comfyuis_forward(comfy_pytorch_attention, monkeypatch):
    """Flux Kontext-style modulation_dims, and Linear layers with per-call weight functions (lowvram)."""
    pytest.importorskip("triton")
    from sd_accel.accel.engine import fusions

    model = configs.build_dit("tiny-flux", "comfy", comfyui_root=H.comfy_root(), device=DEVICE)
    block = model.double_blocks[0]
    calls = _counted_adaln(monkeypatch)
    img, txt, vec = (torch.randn(*shape, device=DEVICE) for shape in ((1, 12, 64), (1, 5, 64), (1, 64)))
    pe = model.pe_embedder(torch.zeros(1, 17, 3, device=DEVICE))
    with torch.no_grad():
        undo, _ = fusions.apply(model)
        dims = [(0, 12, 0)]
        out = block(img.clone(), txt.clone(), vec, pe, modulation_dims_img=dims, modulation_dims_txt=[(0, 5, 0)])
        assert not calls
        undo()
        ref = block(img.clone(), txt.clone(), vec, pe, modulation_dims_img=dims, modulation_dims_txt=[(0, 5, 0)])
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    model.single_blocks[0].linear1.weight_function = [lambda w: w]
    undo, counts = fusions.apply(model)
    assert counts["flux"] == 4  # that block keeps its own forward
    undo()


def _tiny_wan(**cfg):
    """ComfyUI's WanModel of tiny-wan's layout, changed by cfg, seeded."""
    import comfy.ldm.wan.model
    import comfy.ops

    _, tiny = configs.COMFY_DIT_CONFIGS["tiny-wan"]
    model = comfy.ldm.wan.model.WanModel(**{**{k: v for k, v in tiny.items() if k != "image_model"}, **cfg},
                                         operations=comfy.ops.disable_weight_init, device=DEVICE)
    return configs.seed_dit_parameters(model, 0).eval()


@pytest.mark.parametrize("case", ["per frame", "per token", "runs that do not divide the tokens", "image to video",
                                  "no cross-attention norm", "no q/k norm"])
def test_comfyuis_wan_variants_with_fused_kernels_match_their_own_forward(comfy_pytorch_attention, case):
    """Wan 2.2's timesteps per latent frame or per token (a modulation row per run of tokens, as ComfyUI's repeat_e
    spreads it; 7 rows over 60 tokens: 9 each, the end cut), image-to-video's cross-attention to CLIP image tokens, and
    blocks without the cross-attention's LayerNorm or the q/k norms: every block fused, within float32 rounding of
    ComfyUI's own."""
    pytest.importorskip("triton")
    from sd_accel.accel.engine import fusions

    model = _tiny_wan(**{"image to video": {"model_type": "i2v"},
                         "no cross-attention norm": {"cross_attn_norm": False},
                         "no q/k norm": {"qk_norm": False}}.get(case, {}))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 3, 8, 10, generator=g).to(DEVICE)  # 3 x 4 x 5 = 60 tokens
    ctx = torch.randn(2, 7, 32, generator=g).to(DEVICE)
    t = {"per frame": torch.tensor([[0.2, 0.5, 0.9], [0.1, 0.1, 0.7]]), "per token": torch.rand(2, 60, generator=g),
         "runs that do not divide the tokens": torch.rand(2, 7, generator=g)}.get(case, torch.tensor([0.3, 0.8]))
    clip = torch.randn(2, 4, 1280, generator=g).to(DEVICE) if case == "image to video" else None
    with torch.no_grad():
        ref = model(x, t.to(DEVICE), ctx, clip_fea=clip)
        undo, counts = fusions.apply(model, ["wan"])
        out = model(x, t.to(DEVICE), ctx, clip_fea=clip)
        undo()
    assert counts["wan"] == 3 and H.rel(out, ref) <= FUSED_TOL and not torch.equal(out, ref)


def test_fused_wan_attention_runs_the_engines_kernel_not_comfyuis_sdpa_wrapper(comfy_pytorch_attention, monkeypatch):
    """ComfyUI's SDPA wrapper (comfy.ops.scaled_dot_product_attention) sets its own backend order inside each call, and
    ComfyUI 0.33's puts FlashAttention-2 before cuDNN, the slower of the two on Hopper: with the blocks fused, neither
    their self- nor their cross-attention goes through it, and the model still matches ComfyUI's own forward."""
    pytest.importorskip("triton")
    import comfy.ops
    from sd_accel.accel.engine import fusions

    wrapper, calls = comfy.ops.scaled_dot_product_attention, []
    monkeypatch.setattr(comfy.ops, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(args[0].shape) or wrapper(*args, **kwargs))
    model = _tiny_wan()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 16, 3, 8, 10, generator=g).to(DEVICE)
    ctx = torch.randn(2, 7, 32, generator=g).to(DEVICE)
    t = torch.tensor([0.3, 0.8]).to(DEVICE)
    with torch.no_grad():
        ref = model(x, t, ctx)
        plain = len(calls)
        undo, counts = fusions.apply(model, ["wan"])
        out = model(x, t, ctx)
        undo()
    assert plain == 2 * len(model.blocks) and len(calls) == plain  # ComfyUI's forward: self and cross, every block
    assert counts["wan"] == 3 and H.rel(out, ref) <= FUSED_TOL and not torch.equal(out, ref)
    assert not any("forward" in vars(b.cross_attn) for b in model.blocks)  # undone


def test_fused_wan_blocks_leave_calls_they_do_not_cover_to_comfyuis_forward(comfy_pytorch_attention):
    """An attention override in transformer_options: the block's own forward serves the call, and calls it for the
    self- and the cross-attention; a block whose cross-attention LayerNorm has a per-call weight function (lowvram)
    keeps its forward."""
    pytest.importorskip("triton")
    from sd_accel.accel.engine import fusions

    model = _tiny_wan()
    block = model.blocks[0]
    g = torch.Generator().manual_seed(4)
    x, e, ctx = (torch.randn(*shape, generator=g).to(DEVICE) for shape in ((1, 48, 64), (1, 1, 6, 64), (1, 7, 64)))
    freqs = model.rope_encode(3, 8, 8, device=DEVICE)  # 3 x 4 x 4 = 48 tokens
    override, overrides = H.attention_override()
    options = {"optimized_attention_override": override}
    with torch.no_grad():
        undo, _ = fusions.apply(model, ["wan"])
        out = block(x, e, freqs, ctx, transformer_options=options)
        assert len(overrides) == 2
        fused = block(x, e, freqs, ctx)
        undo()
        ref = block(x, e, freqs, ctx, transformer_options=options)
    assert len(overrides) == 4 and torch.equal(out, ref) and H.rel(fused, ref) <= FUSED_TOL
    block.norm3.weight_function = [lambda w: w]
    undo, counts = fusions.apply(model, ["wan"])
    assert counts["wan"] == 2 and "forward" not in vars(block)
    undo()


def _qwen_image_sampled(model, x, cond, uncond, ref_latents=None, **kwargs) -> torch.Tensor:
    """Four Euler steps of flow matching with CFG (scale 4) on ComfyUI's Qwen-Image: the conditional and unconditional
    halves in one batch of 2, as ComfyUI's sampler runs them."""
    sigmas = (1.0, 0.75, 0.45, 0.2, 0.0)
    context = torch.cat((cond, uncond))
    refs = None if ref_latents is None else [torch.cat((r, r)) for r in ref_latents]
    for now, then in zip(sigmas, sigmas[1:]):
        c, u = model(torch.cat((x, x)), torch.full((2,), now, device=DEVICE), context, ref_latents=refs,
                     **kwargs).chunk(2)
        x = x + (then - now) * (u + 4.0 * (c - u))
    return x


def _qwen_block_takes_timestep_zero(model) -> bool:
    """Whether the model's blocks are ComfyUI 0.33's: their forward takes timestep_zero_index, and the model hands them
    its rotary table in Flux's layout (0.3.6x's: heads and tokens axes swapped)."""
    import inspect

    return "timestep_zero_index" in inspect.signature(type(model.transformer_blocks[0]).forward).parameters


def _qwen_table(model, ids: torch.Tensor) -> torch.Tensor:
    """The rotary table for positions `ids` as the model's forward hands it to its blocks."""
    pe = model.pe_embedder(ids)
    return pe if _qwen_block_takes_timestep_zero(model) else pe.squeeze(1).unsqueeze(2)


@pytest.mark.parametrize("case", ["text to image", "edit (reference latents)", "edit, references at timestep zero"])
def test_comfyuis_qwen_image_with_fused_kernels_matches_its_own_sampling(comfy_pytorch_attention, monkeypatch, case):
    """A sampling run of Qwen-Image, CFG batch 2 at each step's timestep, and Qwen-Image-Edit's reference latents
    (their tokens join the image stream, with rows of the rotary table of their own), in ComfyUI 0.33 also modulated at
    timestep zero (Qwen-Image-Edit-2511's "index_timestep_zero": the blocks get timestep_zero_index): every block and
    the output norm fused, no call left to ComfyUI's forward, the sample within float32 rounding of ComfyUI's own. The
    modulation and output projections are drawn at full scale (not quieted), so that every block's part shows in the
    sample."""
    import functools

    pytest.importorskip("triton")
    from sd_accel.accel.engine import fusions

    model = configs.build_dit("tiny-qwen-image", "comfy", comfyui_root=H.comfy_root(), device=DEVICE)
    zero = case.endswith("timestep zero")
    if zero and not _qwen_block_takes_timestep_zero(model):
        pytest.skip("ComfyUI 0.3.6x has no index_timestep_zero reference method")
    configs.seed_dit_parameters(model, 0, quiet=1.0)
    cls = type(model.transformer_blocks[0])
    hosts = []
    # wraps: the fusion reads the forward's signature through it
    monkeypatch.setattr(cls, "forward", functools.wraps(cls.forward)(
        lambda *a, f=cls.forward, **k: hosts.append(1) or f(*a, **k)))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 16, 1, 8, 10, generator=g).to(DEVICE)
    cond, uncond = (torch.randn(1, 7, 32, generator=g).to(DEVICE) for _ in range(2))
    refs = [torch.randn(1, 16, 1, 6, 6, generator=g).to(DEVICE)] if case.startswith("edit") else None
    method = {"ref_latents_method": "index_timestep_zero"} if zero else {}
    with torch.no_grad():
        ref = _qwen_image_sampled(model, x, cond, uncond, refs, **method)
        assert len(hosts) == 4 * 2
        undo, counts = fusions.apply(model, ["qwen_image"])
        out = _qwen_image_sampled(model, x, cond, uncond, refs, **method)
        undo()
    assert counts["qwen_image"] == 3 and len(hosts) == 4 * 2
    assert rel(out, ref) <= FUSED_TOL and not torch.equal(out, ref)


@pytest.mark.parametrize("index", [8, 0, 12])
def test_fused_qwen_image_blocks_modulate_tokens_from_timestep_zero_index_as_comfyuis_forward_does(
        comfy_pytorch_attention, monkeypatch, index):
    """ComfyUI 0.33's block with timestep_zero_index (temb's rows: the timestep's, then timestep zero's; the image
    tokens from the index on take the second half's image modulation): the fused forward runs the kernels, within
    float32 rounding of ComfyUI's forward; also where every image token is on one side of the index, as a
    sequence-parallel rank may hold them."""
    pytest.importorskip("triton")
    from sd_accel.accel.engine import fusions

    model = configs.build_dit("tiny-qwen-image", "comfy", comfyui_root=H.comfy_root(), device=DEVICE)
    if not _qwen_block_takes_timestep_zero(model):
        pytest.skip("ComfyUI 0.3.6x's block has no timestep_zero_index")
    configs.seed_dit_parameters(model, 0, quiet=1.0)
    block = model.transformer_blocks[0]
    kernels = _counted_adaln(monkeypatch)
    g = torch.Generator().manual_seed(7)
    img, txt, temb = (torch.randn(*shape, generator=g).to(DEVICE) for shape in ((2, 12, 64), (2, 5, 64), (4, 64)))
    pe = _qwen_table(model, torch.randint(0, 9, (2, 17, 3), generator=g).float().to(DEVICE))

    def run():
        return block(hidden_states=img, encoder_hidden_states=txt, encoder_hidden_states_mask=None, temb=temb,
                     image_rotary_emb=pe, timestep_zero_index=index)

    with torch.no_grad():
        undo, _ = fusions.apply(model, ["qwen_image"])
        fused = run()
        undo()
        plain = run()
    # text, then the image on each side of the index that holds tokens: a stream each, two adaLN passes a stream
    assert len(kernels) == 2 * (2 + (0 < index < 12))
    assert all(H.rel(a, b) <= FUSED_TOL for a, b in zip(fused, plain))


def test_fused_qwen_image_blocks_leave_calls_they_do_not_cover_to_comfyuis_forward(comfy_pytorch_attention,
                                                                                   monkeypatch):
    """A text mask and an attention override in transformer_options, and in ComfyUI 0.33 an attn1 patch (its attention
    calls it on the joint q, k, v and rotary table): the block's own forward serves the call (the override and the
    patch called by it, no kernel run); a block whose q norm has a per-call weight function (lowvram) keeps its
    forward."""
    pytest.importorskip("triton")
    from sd_accel.accel.engine import fusions

    model = configs.build_dit("tiny-qwen-image", "comfy", comfyui_root=H.comfy_root(), device=DEVICE)
    block = model.transformer_blocks[0]
    kernels = _counted_adaln(monkeypatch)
    g = torch.Generator().manual_seed(6)
    img, txt, temb = (torch.randn(*shape, generator=g).to(DEVICE) for shape in ((1, 12, 64), (1, 5, 64), (1, 64)))
    pe = _qwen_table(model, torch.randint(0, 9, (1, 17, 3), generator=g).float().to(DEVICE))
    override, overrides = H.attention_override()
    patched = []

    def attn1_patch(q, k, v, pe, attn_mask, extra_options):
        patched.append(extra_options["img_slice"])
        return {"q": q * 0.5}

    calls = [{"encoder_hidden_states_mask": torch.ones(1, 5, device=DEVICE)},
             {"transformer_options": {"optimized_attention_override": override}}]
    if _qwen_block_takes_timestep_zero(model):
        calls.append({"transformer_options": {"patches": {"attn1_patch": [attn1_patch]}}})

    def run(**kwargs):
        return block(hidden_states=img, encoder_hidden_states=txt, temb=temb, image_rotary_emb=pe,
                     **{"encoder_hidden_states_mask": None, **kwargs})

    with torch.no_grad():
        undo, _ = fusions.apply(model, ["qwen_image"])
        outs = [run(**c) for c in calls]
        assert not kernels and len(overrides) == 1 and len(patched) == (len(calls) > 2)
        fused = run()
        assert kernels
        undo()
        refs = [run(**c) for c in calls]
        plain = run()
    assert len(overrides) == 2 and len(patched) == 2 * (len(calls) > 2)
    assert all(torch.equal(a, b) for o, r in zip(outs, refs) for a, b in zip(o, r))
    assert all(H.rel(a, b) <= FUSED_TOL for a, b in zip(fused, plain))
    block.attn.norm_q.weight_function = [lambda w: w]
    undo, counts = fusions.apply(model, ["qwen_image"])
    assert counts["qwen_image"] == 2 and "forward" not in vars(block)
    undo()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_packed_qwen_image_projections_follow_the_hosts_weight_patching_and_unpack(comfy_pytorch_attention,
                                                                                   monkeypatch):
    """Each stream's q, k and v weights are rows of one buffer (packing.py), projected by one GEMM. An update in place
    (ComfyUI's weight_inplace_update) is read by it; a replaced Parameter (ComfyUI's LoRA patching) sends that stream's
    projections to their layers until the host puts the packed one back; either way the blocks' own forward's output.
    Unpacked, every weight has its own storage again and the model computes the same."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    import torch.nn.functional as F

    from sd_accel.accel.engine import fusions
    from sd_accel.accel.engine.fusions import packing

    model = configs.build_dit("tiny-qwen-image", "comfy", comfyui_root=H.comfy_root(), device=DEVICE)
    inp = configs.dit_example_inputs("tiny-qwen-image", batch=2, latent=(8, 10), device=DEVICE)
    canon = CanonicalDiT(model)
    attns = [block.attn for block in model.transformer_blocks]
    a = attns[0]
    gemms, layer_calls = [], []
    monkeypatch.setattr(packing, "F", SimpleNamespace(linear=lambda *args: gemms.append(1) or F.linear(*args)))
    hooks = [layer.register_forward_hook(lambda m, *_: layer_calls.append(m)) for layer in (a.to_k, a.add_k_proj)]

    def replaced(run):
        """run() with a's to_v weight replaced by another Parameter, as ComfyUI's LoRA patching does, then put back
        (its unpatching)."""
        packed = a.to_v.weight
        a.to_v.weight = torch.nn.Parameter(packed * 2, requires_grad=False)
        try:
            return run()
        finally:
            a.to_v.weight = packed

    with torch.no_grad():
        ref = canon(**inp)
        layer_calls.clear()
        undo, counts = fusions.apply(model, ["qwen_image"])
        assert counts["qwen_image"] == 3
        for attn in attns:
            for stream in ((attn.to_q, attn.to_k, attn.to_v), (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)):
                for tensors in ([layer.weight for layer in stream], [layer.bias for layer in stream]):
                    assert len({_storage(t) for t in tensors}) == 1
        fused = canon(**inp)
        assert rel(fused, ref) <= FUSED_TOL and len(gemms) == 2 * len(attns) and not layer_calls
        a.to_k.weight.mul_(3.0)  # in place: the packed GEMM reads it
        a.add_v_proj.bias.add_(1.0)
        inplace = canon(**inp)
        assert len(gemms) == 4 * len(attns) and not layer_calls
        lora = replaced(lambda: canon(**inp))
        # the image stream of that block projects through its layers, the text stream still packed
        assert layer_calls == [a.to_k] and len(gemms) == 6 * len(attns) - 1
        assert torch.equal(canon(**inp), inplace) and len(gemms) == 8 * len(attns) - 1  # packed again
        undo()
        plain_inplace = canon(**inp)
        plain_lora = replaced(lambda: canon(**inp))
    for h in hooks:
        h.remove()
    assert rel(inplace, ref) > 1e-3 and rel(inplace, plain_inplace) <= FUSED_TOL
    assert rel(lora, inplace) > 1e-3 and rel(lora, plain_lora) <= FUSED_TOL
    packing.unpack(model)
    storages = [_storage(p) for p in model.parameters()]
    assert len(set(storages)) == len(storages) and fusions.base.drop_packs(model) == []
    with torch.no_grad():
        assert torch.equal(canon(**inp), plain_inplace)


@pytest.mark.parametrize("name,fusion,blocks", [("tiny-flux", "flux", 5), ("tiny-sd3", "mmdit", 3),
                                                ("tiny-chroma", "chroma", 5), ("tiny-wan", "wan", 3),
                                                ("tiny-qwen-image", "qwen_image", 3)])
def test_fused_blocks_serve_under_another_attention_comfyui_chose_for_the_whole_host(comfy_pytorch_attention,
                                                                                      host_attention, monkeypatch,
                                                                                      caplog, name, fusion, blocks):
    """ComfyUI started with --use-split-cross-attention (as --use-sage-attention chooses sage, which needs a GPU): the
    fused blocks still serve, equal to ComfyUI's forward with its PyTorch attention; on the CPU, where nothing is
    timed, with SDPA, and they say so once."""
    import logging

    pytest.importorskip("triton")
    from sd_accel.accel.engine import fusions

    model = configs.build_dit(name, "comfy", comfyui_root=H.comfy_root(), device=DEVICE)
    inp = configs.dit_example_inputs(name, batch=2, latent=(8, 10), device=DEVICE)
    canon = CanonicalDiT(model)
    with torch.no_grad():
        ref = canon(**inp)  # ComfyUI's PyTorch attention
        split = H.use_comfy_attention("split", monkeypatch.setattr)
        sdpa = H.counted_sdpa(monkeypatch.setattr)
        undo, counts = fusions.apply(model)
        with caplog.at_level(logging.WARNING, logger="sd-accel"):
            out, again = canon(**inp), canon(**inp)
        undo()
    # ComfyUI 0.33's Chroma is built of Flux's blocks, which the flux fusion takes (as in the test above)
    fused = counts[fusion] + (counts["flux"] if fusion == "chroma" else 0)
    assert fused == blocks and sdpa and rel(out, ref) <= FUSED_TOL and torch.equal(out, again)
    said = [r.getMessage() for r in caplog.records if "ComfyUI's attention is split" in r.getMessage()]
    assert len(said) == 1 and "(--use-split-cross-attention)" in said[0], said
    if DEVICE == "cpu":  # Wan's cross-attention too runs the engine's attention: no call reaches ComfyUI's function
        assert not split, split
        assert "on the cpu nothing is timed: the fused blocks run PyTorch's SDPA" in said[0], said


def test_where_comfyuis_choice_is_timed_faster_the_fused_blocks_run_it_and_time_each_shape_once(
        comfy_pytorch_attention, host_attention, monkeypatch, caplog):
    """The timing itself needs a GPU: here it is told. Once per shape (Flux's double and single blocks attend over
    the same joint sequence), then the same choice at every call."""
    import logging

    pytest.importorskip("triton")
    from sd_accel.accel.engine import fusions

    model = configs.build_dit("tiny-flux", "comfy", comfyui_root=H.comfy_root(), device=DEVICE)
    inp = configs.dit_example_inputs("tiny-flux", batch=2, latent=(8, 10), device=DEVICE)
    canon = CanonicalDiT(model)
    timed = []
    monkeypatch.setattr(host_attention, "_may_time", lambda q: True)
    monkeypatch.setattr(host_attention, "call_ms", lambda fn, q, k, v: timed.append(q.shape) or (1.0 if timed[1:] else 2.0))
    with torch.no_grad():
        ref = canon(**inp)
        split = H.use_comfy_attention("split", monkeypatch.setattr)
        sdpa = H.counted_sdpa(monkeypatch.setattr)
        undo, _ = fusions.apply(model)
        with caplog.at_level(logging.WARNING, logger="sd-accel"):
            out = canon(**inp)
            calls = len(split)
            again = canon(**inp)
        undo()
    assert len(timed) == 2 and not sdpa and len(split) == 2 * calls == 8  # 4 blocks' attention, twice
    assert rel(out, ref) <= FUSED_TOL and torch.equal(out, again)
    said = [r.getMessage() for r in caplog.records if "ComfyUI's attention is split" in r.getMessage()]
    assert len(said) == 1 and "the fused blocks run it: 1.00 ms against 2.00 ms for PyTorch's SDPA" in said[0] \
        and "at 27 tokens" in said[0], said


def test_an_attention_override_or_another_nodes_function_runs_the_blocks_own_forward(comfy_pytorch_attention,
                                                                                      host_attention, monkeypatch):
    """A model patch's optimized_attention_override, per call, and a node's own function put in ComfyUI's place: the
    blocks' own forward calls them, as ComfyUI's does; the fused forward runs neither."""
    pytest.importorskip("triton")
    import comfy.ldm.flux.math

    from sd_accel.accel.engine import fusions
    from sd_accel.accel.engine.fusions.base import comfy_choice

    model = configs.build_dit("tiny-flux", "comfy", comfyui_root=H.comfy_root(), device=DEVICE)
    block = model.double_blocks[0]
    img, txt, vec = (torch.randn(*shape, device=DEVICE) for shape in ((1, 12, 64), (1, 5, 64), (1, 64)))
    pe = model.pe_embedder(torch.zeros(1, 17, 3, device=DEVICE))
    H.use_comfy_attention("split", monkeypatch.setattr)
    own = comfy.ldm.flux.math.optimized_attention
    override, overrides = H.attention_override()
    nodes = []

    def node(*args, **kwargs):
        nodes.append(1)
        return own(*args, **kwargs)

    sdpa = H.counted_sdpa(monkeypatch.setattr)
    with torch.no_grad():
        undo, _ = fusions.apply(model)
        block(img.clone(), txt.clone(), vec, pe, transformer_options={"optimized_attention_override": override})
        assert [f.__name__ for f in overrides] == ["attention_split"] and not sdpa
        monkeypatch.setattr(comfy.ldm.flux.math, "optimized_attention", node)
        block(img.clone(), txt.clone(), vec, pe)
        assert nodes == [1] and not sdpa and comfy_choice(node) is None
        monkeypatch.setattr(comfy.ldm.flux.math, "optimized_attention", own)
        block(img.clone(), txt.clone(), vec, pe)
        undo()
    # the fused forward's attention: once on the CPU; on a GPU also while it is timed against ComfyUI's choice
    assert (len(sdpa) == 1 if DEVICE == "cpu" else sdpa) and comfy_choice(own) == "split"


def test_the_check_for_comfyuis_pytorch_attention_agrees_with_its_registry(comfy_pytorch_attention):
    """comfy_pytorch, which the fused blocks ask at every call, says of each function what ComfyUI's registry says:
    its PyTorch attention, and no other of its functions, no node's own, no stand-in and no function at all."""
    import comfy.ldm.modules.attention as attention

    from sd_accel.accel.engine.attention import StandIn
    from sd_accel.accel.engine.fusions.base import comfy_choice, comfy_function, comfy_pytorch

    def node(*args, **kwargs):
        return attention.attention_pytorch(*args, **kwargs)

    stand_in = StandIn(attention.attention_pytorch, attention.attention_pytorch, lambda *a: None)
    registry = attention.REGISTERED_ATTENTION_FUNCTIONS
    for fn in (*registry.values(), node, stand_in, None):
        pytorch = any(name == "pytorch" and f is fn for name, f in registry.items())
        assert comfy_pytorch(fn) == pytorch == (comfy_choice(fn) == "pytorch"), fn
    assert comfy_function("comfy.ldm.flux.math") == (attention.attention_pytorch,) * 2


def test_a_cuda_graph_depends_on_the_attention_functions_the_fused_blocks_read(comfy_pytorch_attention, monkeypatch):
    """The torch path's graph token: another function in a place a fused forward reads changes it, and the same one
    back gives the same token (the fusions undone and made again, as suspend and resume do, change nothing)."""
    pytest.importorskip("triton")
    import comfy.ldm.flux.math
    import comfy.ldm.modules.attention as attention

    from sd_accel.accel.engine import fusions
    from sd_accel.accel.engine.attention import read

    model = configs.build_dit("tiny-flux", "comfy", comfyui_root=H.comfy_root())
    undo, _ = fusions.apply(model)
    pytorch = read()
    monkeypatch.setattr(comfy.ldm.flux.math, "optimized_attention", attention.attention_split)
    split = read()
    undo()
    monkeypatch.setattr(comfy.ldm.flux.math, "optimized_attention", attention.attention_pytorch)
    undo, _ = fusions.apply(model)
    again = read()
    undo()
    assert split != pytorch == again


def _dit_bf16(name, dtype=torch.bfloat16, form="comfy"):
    return configs.build_dit(name, form, comfyui_root=H.comfy_root(), dtype=dtype, device=DEVICE)


def _fused_output(model, inp, precision):
    from sd_accel.accel.engine import fp8, fusions

    undo, counts = fusions.apply(model)
    marks = fusions.Undo()
    counts["fp8"] = fp8.apply(model, precision, marks)
    try:
        with torch.no_grad():
            return CanonicalDiT(model)(**inp), counts
    finally:
        marks()
        undo()


def _bf16_model_and_inputs(request, form, name):
    """A tiny DiT in bfloat16 and its inputs, ComfyUI's PyTorch attention chosen for ComfyUI's classes."""
    pytest.importorskip("triton")
    if form == "comfy":
        request.getfixturevalue("comfy_pytorch_attention")
    return _dit_bf16(name, form=form), _bf16_inputs(name)


def _bf16_inputs(name):
    inp = configs.dit_example_inputs(name, batch=2, device=DEVICE)
    return {k: v.to(torch.bfloat16) if k in ("x", "context", "y") else v for k, v in inp.items()}


@pytest.mark.parametrize("form,name,projections", [("comfy", "tiny-flux", 20), ("comfy", "tiny-sd3", 15),
                                                  ("comfy", "tiny-chroma", 20), ("comfy", "tiny-wan", 20),
                                                  ("comfy", "tiny-qwen-image", 24), ("diffusers", "tiny-flux", 34),
                                                  ("diffusers", "tiny-sd3", 25)])
@pytest.mark.fp8_products(DEVICE)
def test_fp8_products_only_where_precision_says(request, form, name, projections):
    """precision auto leaves 16-bit weights 16-bit; fp8 takes every block projection (not the modulation) and stays
    close to the 16-bit fused forward; a weight changed in place is quantized again."""
    model, inp = _bf16_model_and_inputs(request, form, name)
    ref, counts = _fused_output(model, inp, "auto")
    assert counts["fp8"] == 0
    out, counts = _fused_output(model, inp, "fp8")
    assert counts["fp8"] == projections
    assert 1e-4 < rel(out, ref) <= 5e-2  # fp8 products: different, and close
    again, _ = _fused_output(model, inp, "fp8")
    assert torch.equal(again, out)
    if form == "diffusers" or name == "tiny-qwen-image":
        layer = model.transformer_blocks[0].attn.to_q
    elif name == "tiny-wan":
        layer = model.blocks[0].self_attn.q
    else:
        layer = model.joint_blocks[0].x_block.attn.qkv if name == "tiny-sd3" else model.double_blocks[0].img_attn.qkv
    with torch.no_grad():
        layer.weight.mul_(1.5)  # in place: same address, new version
    changed, _ = _fused_output(model, inp, "fp8")
    # the same call repeats bit for bit (above), so any real move is the weight's (diffusers' tiny SD3 on a GPU: 8e-4)
    assert rel(changed, out) > 1e-4
    assert _fused_output(model, inp, "16bit")[1]["fp8"] == 0


@pytest.mark.parametrize("form,name,projections", [("comfy", "tiny-flux", 20), ("comfy", "tiny-wan", 20),
                                                  ("diffusers", "tiny-sd3", 25)])
@pytest.mark.fp8_products(DEVICE)
def test_int8_products_take_what_fp8_takes_and_stay_closer_to_16_bit(request, form, name, projections):
    """precision int8 takes the block projections fp8 takes, as int8 products (7 bits a row where e4m3 keeps 3):
    closer to the 16-bit fused forward than fp8's, through every way a block hands a projection its input (the adaLN
    pass, the packed q/k/v, a single-stream block's split output projection, the MLP's activation); a weight changed in
    place is quantized again."""
    from sd_accel.accel.engine import fp8

    model, inp = _bf16_model_and_inputs(request, form, name)
    ref, _ = _fused_output(model, inp, "16bit")
    eight, _ = _fused_output(model, inp, "fp8")
    out, counts = _fused_output(model, inp, "int8")
    assert counts["fp8"] == projections
    assert 1e-4 < rel(out, ref) < rel(eight, ref)
    layer = next(layer for layer, modulation in fp8.projections(model) if not modulation)
    with torch.no_grad():
        layer.weight.mul_(1.5)
    changed, _ = _fused_output(model, inp, "int8")
    assert rel(changed, out) > 1e-4


def test_where_the_cpu_has_no_fp8_product_precision_fp8_says_why_and_runs_16_bit(monkeypatch, caplog):
    """torch 2.6 to 2.8 on the CPU (no row-wise _scaled_mm there; here said to be missing, so that every torch runs
    this): precision fp8 marks nothing, says why, and the output is the 16-bit fused forward's, bit for bit."""
    pytest.importorskip("triton")
    import logging

    from sd_accel.accel.engine import fp8

    monkeypatch.setattr(fp8, "_cpu_row_wise", lambda: False)
    assert fp8.supported(torch.device("cpu")) == (
        False, f"torch {torch.__version__} has no row-wise scaled fp8 matrix product on the CPU")
    # on the CPU whatever DEVICE is: the probe said no for the CPU only
    model = configs.build_dit("tiny-flux", "diffusers", dtype=torch.bfloat16, device="cpu")
    inp = {k: v.to(torch.bfloat16) if k in ("x", "context", "y") else v
           for k, v in configs.dit_example_inputs("tiny-flux", batch=2).items()}
    sixteen, _ = _fused_output(model, inp, "16bit")
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        out, counts = _fused_output(model, inp, "fp8")
    said = [r.getMessage() for r in caplog.records if r.name == "sd-accel"]
    assert said == [f"sd-accel: fp8 matrix products cannot run: torch {torch.__version__} has no row-wise scaled fp8 "
                    "matrix product on the CPU; the fp8 weights run through the host's own layers (widened to 16 "
                    "bits per call, or its own fp8 kernels)."]
    assert counts["fp8"] == 0 and torch.equal(out, sixteen)


@pytest.mark.fp8_products(DEVICE)
def test_weights_loaded_in_fp8_run_as_fp8_products_close_to_comfyuis_own_path(comfy_pytorch_attention):
    """ComfyUI's fp8_e4m3fn weight dtype: cast-on-the-fly layers holding fp8 weights. Their own forward widens each
    weight per call; the fused blocks take them as fp8 products (precision auto), and "16bit" widens them too."""
    pytest.importorskip("triton")
    model = _dit_bf16("tiny-flux", dtype=torch.float8_e4m3fn)
    canon = CanonicalDiT(model)
    assert canon.dtype == torch.bfloat16  # what ComfyUI feeds Flux (its manual-cast dtype) where it is not said
    assert CanonicalDiT(model, fed=torch.float16).dtype == torch.float16
    model.dtype = torch.bfloat16
    inp = _bf16_inputs("tiny-flux")
    with torch.no_grad():
        own = canon(**inp)
    out, counts = _fused_output(model, inp, "auto")
    assert counts["flux"] == 5 and counts["fp8"] == 26  # the modulation projections too: stored in fp8
    assert rel(out, own) <= 5e-2
    widened, counts = _fused_output(model, inp, "16bit")
    assert counts["fp8"] == 0 and rel(widened, own) <= 1e-2


def test_precision_is_checked():
    from sd_accel.accel.plan.options import TorchOptions, parse

    assert parse(TorchOptions, {"precision": "fp8"}).precision == "fp8"
    with pytest.raises(BadInput, match="Use one of: auto, 16bit, fp8"):
        parse(TorchOptions, {"precision": "int4"})


def test_the_fp8_module_imports_first():
    """accel/engine/fp8.py imported before any other engine module (what a tool or a host may do first): its fusions
    import fp8_attention, which imports it back, and must not find it half made."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sd_accel.accel.engine.fp8"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def _fp8_linear2(k: int, n: int):
    """A seeded single block's linear2 (k -> n, bf16) marked for fp8 products, with the Undo that unmarks it."""
    from sd_accel.accel.engine import fp8
    from sd_accel.accel.engine.fusions.base import Undo

    torch.manual_seed(0)
    block = type("SingleStreamBlock", (torch.nn.Module,), {})()
    block.linear2 = torch.nn.Linear(k, n, device=DEVICE, dtype=torch.bfloat16)
    undo = Undo()
    assert fp8.apply(block, "fp8", undo) == 1
    return block, undo


@pytest.mark.fp8_products(DEVICE)
def test_an_fp8_product_adds_little_to_the_rounding_of_its_operands():
    """A wide fp8 projection (K = 15,360, Flux's linear2) against the float32 product of its own e4m3 operands: on a
    GPU its partial sums are accumulated as the tensor cores do (fewer bits than float32, `use_fast_accum`), and what
    that loses must stay small beside what rounding the operands to e4m3 loses."""
    block, undo = _fp8_linear2(15360, 3072)
    x = torch.randn(256, 15360, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        y = block.linear2(x)
        w, b = block.linear2.weight.float(), block.linear2.bias.float()
    undo()

    def e4m3(t):  # per row, to e4m3's range and back
        s = t.abs().amax(dim=1, keepdim=True) / 448.0
        return (t / s).to(torch.float8_e4m3fn).float() * s

    exact = x.float() @ w.t() + b
    of_operands = e4m3(x.float()) @ e4m3(w).t() + b
    rounding = rel(of_operands, exact)
    assert 1e-2 < rounding < 5e-2  # e4m3's rounding of N(0, 1) operands
    assert rel(y, of_operands) < min(1e-2, rounding / 4)


@pytest.mark.fp8_products(DEVICE)
def test_an_fp8_product_cublas_declines_runs_in_16_bits_on_the_same_operands(monkeypatch):
    """cuBLASLt declines some fp8 shapes (CUBLAS_STATUS_NOT_SUPPORTED: LTX-2's audio MLP, 34 rows of 8192, on an
    H200): that product runs in 16 bits on the same e4m3 operands and scales, into `out` where given, and the shape is
    not offered to it again; any other error is raised."""
    from sd_accel.accel.engine import fp8

    monkeypatch.setattr(fp8, "_DECLINED", set())  # this test's shapes, not the process's
    block, undo = _fp8_linear2(512, 256)
    x = torch.randn(34, 512, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        want = block.linear2(x)
        real, calls = torch._scaled_mm, []

        def declines(*args, **kwargs):
            calls.append(args[0].shape)
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmulAlgoGetHeuristic`")

        monkeypatch.setattr(torch, "_scaled_mm", declines)
        got = block.linear2(x)
        out = torch.empty(34, 256, device=DEVICE, dtype=torch.bfloat16)
        into = fp8.matmul(fp8.quantized(x), block.linear2, out=out)
        assert len(calls) == 1  # tried once for that shape
        assert rel(got, want) < 1e-2 and into.data_ptr() == out.data_ptr() and torch.equal(into, got)

        def fails(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(torch, "_scaled_mm", fails)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            block.linear2(x[:16])
        monkeypatch.setattr(torch, "_scaled_mm", real)
    undo()


@pytest.mark.fp8_products(DEVICE)
def test_fp8_operands_stay_where_a_graph_read_them_and_follow_weight_changes(comfy_pytorch_attention):
    """A CUDA graph replays the fp8 copies and scales at the addresses it captured: they must outlive the end of a
    host's run (suspend/resume), and a weight changed between runs (in place, replaced, or an inference tensor the
    host says it patched) must be quantized again into that same memory before the next replay."""
    pytest.importorskip("triton")
    from sd_accel.accel.engine import fp8
    from sd_accel.accel.engine.backends import torch_fused
    from sd_accel.accel.plan.options import TorchOptions

    model = _dit_bf16("tiny-flux")
    engine = torch_fused.build(CanonicalDiT(model), TorchOptions(triton_kernels=True, precision="fp8"))
    inp = _bf16_inputs("tiny-flux")
    layer = model.double_blocks[0].img_attn.qkv
    first = engine(**inp)
    copy = fp8._weight(layer)
    where = (copy.q.data_ptr(), copy.scale.data_ptr())
    engine.suspend()  # the host's run ends; the graphs stay
    engine.resume()
    engine._fp8.refresh()  # what runs before a replay
    kept = fp8._weight(layer)
    assert (kept.q.data_ptr(), kept.scale.data_ptr()) == where and torch.equal(kept.q.float(), copy.q.float())
    assert torch.equal(engine(**inp), first)

    def requantized() -> torch.Tensor:
        engine._fp8.refresh()
        now = fp8._weight(layer)
        assert (now.q.data_ptr(), now.scale.data_ptr()) == where  # same memory: a captured graph reads it
        return (now.q.float() * now.scale.t()).to(torch.bfloat16)

    with torch.no_grad():
        layer.weight.mul_(1.5)  # a LoRA merged in place: same address, new version
    assert rel(requantized(), layer.weight) < 0.07
    with torch.no_grad():  # a LoRA the ComfyUI way: the Parameter replaced
        layer.weight = torch.nn.Parameter(layer.weight * -0.5, requires_grad=False)
    assert rel(requantized(), layer.weight) < 0.07
    with torch.inference_mode():  # a weight made in a host's inference_mode keeps no version: the host says so
        layer.weight = torch.nn.Parameter(layer.weight * 2, requires_grad=False)
    assert rel(requantized(), layer.weight) < 0.07
    with torch.inference_mode():
        layer.weight.mul_(0.25)
    engine.weights_changed()
    assert rel(requantized(), layer.weight) < 0.07
    engine.release()
    assert not fp8.marked(layer)


@pytest.mark.parametrize("name,projections", [("tiny-wan", 20), ("tiny-qwen-image", 28)])
@pytest.mark.fp8_products(DEVICE)
def test_wan_and_qwen_image_weights_loaded_in_fp8_run_as_fp8_products(comfy_pytorch_attention, name, projections):
    """Wan and Qwen-Image loaded with ComfyUI's fp8_e4m3fn weight dtype: precision auto takes their block projections
    (Qwen-Image's modulation projections too: stored in fp8) as fp8 products, close to ComfyUI's own widening path."""
    pytest.importorskip("triton")
    model = _dit_bf16(name, dtype=torch.float8_e4m3fn)
    model.dtype = torch.bfloat16
    inp = _bf16_inputs(name)
    with torch.no_grad():
        own = CanonicalDiT(model)(**inp)
    out, counts = _fused_output(model, inp, "auto")
    assert counts["fp8"] == projections and rel(out, own) <= 5e-2
    assert _fused_output(model, inp, "16bit")[1]["fp8"] == 0


@pytest.mark.fp8_products(DEVICE)
def test_fused_qwen_image_makes_its_projections_fp8_products(comfy_pytorch_attention, monkeypatch):
    """precision fp8 marks every projection of Qwen-Image's blocks (q, k, v, output and MLP of both streams: 12 a
    block; the modulation stays 16-bit); the fused blocks make each of them as an fp8 product (torch._scaled_mm, which
    runs on the CPU too), as the blocks' own forward does with the marks, and give its output within bfloat16's
    rounding (the tiny model's fused and own 16-bit outputs are some 6e-3 apart). The fusion packs q, k and v
    (packing.py), but their fp8 copies are per layer: a product each, not the packed 16-bit GEMM. A stream's output
    projection takes a product per sample (of a batch of several, a stream's part of the attention output is no view
    of rows: fusions/transformer.py project_part)."""
    pytest.importorskip("triton")
    from sd_accel.accel.engine import fp8, fusions

    model = _dit_bf16("tiny-qwen-image")
    inp = _bf16_inputs("tiny-qwen-image")
    products = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, f=torch._scaled_mm, **k: products.append(1) or f(*a, **k))
    marks = fusions.Undo()
    marked = fp8.apply(model, "fp8", marks)
    with torch.no_grad():
        own = CanonicalDiT(model)(**inp)
        own_products, products[:] = len(products), []
        undo, counts = fusions.apply(model, ["qwen_image"])
        out = CanonicalDiT(model)(**inp)
        undo()
    marks()
    attn = model.transformer_blocks[0].attn
    assert _storage(attn.to_q.weight) == _storage(attn.to_v.weight)
    extra = (inp["x"].shape[0] - 1) * 2 * len(model.transformer_blocks)  # two streams' output projections a block
    assert marked == 24 and counts["qwen_image"] == 3 and own_products == 24 and len(products) == 24 + extra > 24
    assert rel(out, own) <= 2e-2 and not torch.equal(out, own)


def test_wan_in_bfloat16_runs_on_the_torch_path_in_its_blocks_dtype(comfy_pytorch_attention):
    """ComfyUI builds Wan's patch embedding in float32 whatever the model's dtype (its first parameter): the engine
    still feeds the model bfloat16, as ComfyUI does, and gives ComfyUI's own output for it."""
    model = _dit_bf16("tiny-wan")
    assert next(model.parameters()).dtype == torch.float32  # the case: a float32 layer first
    inp = _bf16_inputs("tiny-wan")
    with torch.no_grad():
        own = model(inp["x"], inp["timesteps"], inp["context"])
        acc = accelerate(model, preference="torch", options={"cuda_graphs": False},
                         gpu=GpuInfo(vendor="cpu", family="cpu", name="cpu", dtypes=("float32", "bfloat16")))
        out = acc(inp["x"], inp["timesteps"], inp["context"])
    assert acc.unet.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    assert torch.equal(out, own)


def test_a_comfy_dit_rounded_to_bf16_keeps_what_comfyuis_class_keeps_in_float32(comfy_pytorch_attention):
    """The bench builds in float32 for its reference, then rounds: Wan's patch embedding stays float32 as ComfyUI
    builds it (its forward feeds it float32), every other weight goes to bf16, and the model still runs."""
    model = configs.build_dit("tiny-wan", "comfy", comfyui_root=H.comfy_root())
    configs.round_comfy_dit(model, "tiny-wan", torch.bfloat16)
    model.dtype = torch.bfloat16
    assert model.patch_embedding.weight.dtype == torch.float32
    assert {p.dtype for n, p in model.named_parameters() if not n.startswith("patch_embedding")} == {torch.bfloat16}
    inp = configs.dit_example_inputs("tiny-wan", batch=1, latent=(8, 8))
    with torch.no_grad():
        out = CanonicalDiT(model)(inp["x"].bfloat16(), inp["timesteps"], inp["context"].bfloat16())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


# Each family's adaLN modulation projections and the projections that write into its residual stream (and the last
# layer's), block indices left out: ComfyUI's classes, then diffusers'.
_QUIETED = {
    ("comfy", "tiny-flux"): {"double_blocks.img_mod.lin", "double_blocks.txt_mod.lin", "double_blocks.img_attn.proj",
                             "double_blocks.txt_attn.proj", "double_blocks.img_mlp.2", "double_blocks.txt_mlp.2",
                             "single_blocks.modulation.lin", "single_blocks.linear2", "final_layer.adaLN_modulation.1",
                             "final_layer.linear"},
    ("comfy", "tiny-chroma"): {"distilled_guidance_layer.out_proj", "double_blocks.img_attn.proj",
                               "double_blocks.txt_attn.proj", "double_blocks.img_mlp.2", "double_blocks.txt_mlp.2",
                               "single_blocks.linear2", "final_layer.linear"},
    ("comfy", "tiny-sd3"): {"joint_blocks.context_block.adaLN_modulation.1", "joint_blocks.context_block.attn.proj",
                            "joint_blocks.context_block.mlp.fc2", "joint_blocks.x_block.adaLN_modulation.1",
                            "joint_blocks.x_block.attn.proj", "joint_blocks.x_block.attn2.proj",
                            "joint_blocks.x_block.mlp.fc2", "final_layer.adaLN_modulation.1", "final_layer.linear"},
    ("comfy", "tiny-wan"): {"time_projection.1", "blocks.self_attn.o", "blocks.cross_attn.o", "blocks.ffn.2",
                            "head.head"},
    ("comfy", "tiny-qwen-image"): {"transformer_blocks.img_mod.1", "transformer_blocks.txt_mod.1",
                                   "transformer_blocks.attn.to_out.0", "transformer_blocks.attn.to_add_out",
                                   "transformer_blocks.img_mlp.net.2", "transformer_blocks.txt_mlp.net.2",
                                   "norm_out.linear", "proj_out"},
    ("diffusers", "tiny-flux"): {"transformer_blocks.norm1.linear", "transformer_blocks.norm1_context.linear",
                                 "transformer_blocks.attn.to_out.0", "transformer_blocks.attn.to_add_out",
                                 "transformer_blocks.ff.net.2", "transformer_blocks.ff_context.net.2",
                                 "single_transformer_blocks.norm.linear", "single_transformer_blocks.proj_out",
                                 "norm_out.linear", "proj_out"},
    ("diffusers", "tiny-sd3"): {"transformer_blocks.norm1.linear", "transformer_blocks.norm1_context.linear",
                                "transformer_blocks.attn.to_out.0", "transformer_blocks.attn.to_add_out",
                                "transformer_blocks.attn2.to_out.0", "transformer_blocks.ff.net.2",
                                "transformer_blocks.ff_context.net.2", "norm_out.linear", "proj_out"},
}


@pytest.mark.parametrize("form,name", list(_QUIETED))
def test_the_seeded_init_quiets_each_dits_modulation_and_residual_projections_and_no_others(request, form, name):
    """seed_dit_parameters scales down exactly the matrices of _QUIETED: a family left drawn at full scale has blocks
    far from the identity, and its error figures measure the init, not the precision."""
    if form == "comfy":
        request.getfixturevalue("comfy_pytorch_attention")
    model = configs.build_dit(name, form, comfyui_root=H.comfy_root())
    quiet = {n: p.clone() for n, p in model.named_parameters()}
    configs.seed_dit_parameters(model, 0, quiet=1.0)
    quieted = set()
    for n, p in model.named_parameters():
        if not torch.equal(p, quiet[n]):
            assert torch.allclose(quiet[n], 0.1 * p, rtol=1e-5, atol=0), n
            quieted.add(re.sub(r"^(\w*blocks)\.\d+\.", r"\1.", n.rsplit(".", 1)[0]))
    assert quieted == _QUIETED[form, name]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_the_mlps_linear_gelu_is_the_tanh_gelu(device, no_tf32):
    """The DiT MLPs' GELU is the tanh approximation; the fused MLP computes it in the product's epilogue on NVIDIA GPUs,
    whose call computes the exact GELU on the CPU. Through an identity product in float32 (TF32 off), the output is the
    tanh GELU of the input to float32 rounding, well apart from the exact GELU."""
    from sd_accel.accel.engine.fusions.transformer import linear_gelu

    x = torch.linspace(-5, 5, 4096, device=device).view(64, 64)
    out = linear_gelu(x.view(4, 16, 64), torch.eye(64, device=device), torch.zeros(64, device=device))
    assert out.shape == (4, 16, 64)
    tanh, exact = (torch.nn.functional.gelu(x, approximate=a).view(4, 16, 64) for a in ("tanh", "none"))
    assert (out - tanh).abs().max() <= 2e-5 < 2e-4 < (out - exact).abs().max()  # a fast tanh in the epilogue
    # bfloat16, the MLP's own dtype (cuBLASLt's epilogue where float32 may go another way): over [-3.5, -1] the GELU
    # is small, so the two GELUs lie bfloat16 steps apart (more than 2 at half the points)
    x = torch.linspace(-3.5, -1, 4096, device=device).to(torch.bfloat16)
    out = linear_gelu(x.view(64, 64), torch.eye(64, device=device, dtype=x.dtype),
                      torch.zeros(64, device=device, dtype=x.dtype)).view(-1)
    tanh, exact = (torch.nn.functional.gelu(x.float(), approximate=a).to(x.dtype) for a in ("tanh", "none"))

    def steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # bfloat16 values apart (same signs here)
        return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()

    assert steps(out, tanh).max() <= 1 and (steps(out, exact) > 2).float().mean() > 0.4
    # and through a product as the MLP runs it: within its rounding of the two steps apart
    g = torch.Generator(device="cpu").manual_seed(0)
    h, w, b = (torch.randn(*s, generator=g).to(device, torch.bfloat16) for s in ((2, 33, 64), (96, 64), (96,)))
    want = torch.nn.functional.gelu(torch.nn.functional.linear(h.float(), w.float(), b.float()), approximate="tanh")
    assert H.rel(linear_gelu(h, w, b).float(), want) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,bias", [(1, True), (3, True), (3, False)])
def test_a_streams_output_projection_over_a_batch_equals_the_layers_own(dtype, batch, bias):
    """A stream's part of a joint attention output, projected sample by sample into one output (of a batch of
    several the part is no view of rows), equals the layer's own call on the part: the text part, a middle part,
    the image part; with gradients on, the layer's own call runs (products into an output record no autograd)."""
    from sd_accel.accel.engine.fusions.transformer import project_part

    g = torch.Generator(device="cpu").manual_seed(batch)
    out = torch.randn(batch, 23, 16, generator=g).to(DEVICE, dtype)
    layer = torch.nn.Linear(16, 24, bias=bias).to(DEVICE, dtype)
    with torch.no_grad():
        for start, stop in ((0, 5), (5, 17), (5, 23), (0, 23)):
            got = project_part(out, start, stop, layer)
            want = layer(out[:, start:stop])
            assert got.shape == want.shape == (batch, stop - start, 24) and got.dtype == dtype
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bfloat16: the bias added before or after rounding
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    with torch.enable_grad():
        torch.testing.assert_close(project_part(out, 5, 17, layer), layer(out[:, 5:17]))
