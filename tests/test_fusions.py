"""The fusions put the Triton kernels into diffusers and ldm UNets without changing what they compute, and
undo leaves the modules exactly as they were (the same parameter names, the same forward)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sd_accel.accel.engine import fusions
from sd_accel.accel.engine.fusions.skip_layernorm import _plain_output_linear
from sd_accel.accel.models.configs import build_unet, example_inputs
from sd_accel.accel.models.spec import CanonicalUNet
from sd_accel.kernels import groupnorm
from ldm_unet import tiny_ldm_unet

pytestmark = pytest.mark.skipif(not groupnorm.supported(torch.zeros(1)) and not torch.cuda.is_available(),
                                reason="Triton kernels cannot run here (no GPU and no TRITON_INTERPRET=1)")


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _models():
    diff = CanonicalUNet(build_unet("tiny-sd15", seed=21))
    x, t, ctx, _ = example_inputs(diff.unet, latent=16, seed=22)
    yield "diffusers", diff, (x, t, ctx, None)
    ldm = CanonicalUNet(tiny_ldm_unet(seed=23))
    yield "ldm", ldm, (x, t, torch.randn(2, 77, ldm.spec.context_dim), None)


@pytest.mark.parametrize("form", ["diffusers", "ldm"])
def test_fused_unet_same_function_and_undo_restores(form):
    _, unet, (x, t, ctx, y) = next(m for m in _models() if m[0] == form)
    x = x.contiguous(memory_format=torch.channels_last)
    keys = list(unet.unet.state_dict())
    kinds = [type(m) for m in unet.unet.modules()]
    ref = unet(x, t, ctx, y)
    undo, counts = fusions.apply(unet.unet, ["layout", "groupnorm", "geglu"])
    n_norms = sum(isinstance(m, nn.GroupNorm) for m in unet.unet.modules())
    n_geglu = sum(type(m).__name__ == "GEGLU" for m in unet.unet.modules())
    n_transformers = sum(type(m).__name__ in ("Transformer2DModel", "SpatialTransformer") for m in unet.unet.modules())
    assert counts == {"layout": n_transformers, "groupnorm": n_norms, "geglu": n_geglu} and n_geglu > 0
    assert list(unet.unet.state_dict()) == keys  # LoRA keys still address the same tensors
    out = unet(x, t, ctx, y)
    assert rel(out, ref) <= 1e-5 and out.is_contiguous(memory_format=torch.channels_last)
    undo()
    assert not any(set(vars(m)) & {"forward", "_get_output_for_continuous_inputs"} for m in unet.unet.modules())
    assert [type(m) for m in unet.unet.modules()] == kinds
    assert torch.equal(unet(x, t, ctx, y), ref)


def test_time_embedding_keeps_its_silu():
    """diffusers shares one SiLU between the norms and the time embedding: only the norms' use is fused."""
    unet = CanonicalUNet(build_unet("tiny-sd15", seed=24))
    x, t, ctx, _ = example_inputs(unet.unet, latent=16, seed=25)
    t2 = torch.tensor([10.0, 990.0])
    ref = unet(x, t, ctx) - unet(x, t2, ctx)
    undo, _ = fusions.apply(unet.unet, ["groupnorm"])
    assert rel(unet(x, t, ctx) - unet(x, t2, ctx), ref) <= 1e-4
    undo()


def test_kernels_load_when_another_package_owns_the_name(monkeypatch):
    """Hugging Face's `kernels` package can shadow ours inside ComfyUI; the fusions must still find ours."""
    import sys
    import types

    from sd_accel.accel.engine.fusions.base import kernel_module

    monkeypatch.setitem(sys.modules, "kernels", types.ModuleType("kernels"))
    gn = kernel_module("groupnorm")
    assert hasattr(gn, "group_norm") and gn.__name__ != "kernels.groupnorm"


def _channels_last_model(form: str):
    """A tiny UNet and its input in channels_last, as the torch path runs them, with its output before fusing."""
    _, unet, (x, t, ctx, y) = next(m for m in _models() if m[0] == form)
    x = x.contiguous(memory_format=torch.channels_last)
    unet.unet.to(memory_format=torch.channels_last)
    return unet, (x, t, ctx, y), unet(x, t, ctx, y)


@pytest.mark.parametrize("form", ["diffusers", "ldm"])
def test_resnet_bias_fusion_same_function_and_undo_restores(form):
    unet, (x, t, ctx, y), ref = _channels_last_model(form)
    t2 = torch.tensor([10.0, 990.0])
    ref2 = unet(x, t2, ctx, y)
    undo, counts = fusions.apply(unet.unet, ["resnet", "groupnorm"])
    blocks = sum(type(m).__name__ in ("ResnetBlock2D", "ResBlock") for m in unet.unet.modules())
    assert counts["resnet"] == blocks > 0
    # every block's time projection a slice of one GEMM's output (one pack of all their weights)
    projections = [m.time_emb_proj if form == "diffusers" else m.emb_layers[1] for m in unet.unet.modules()
                   if type(m).__name__ in ("ResnetBlock2D", "ResBlock")]
    assert len({p.weight.untyped_storage().data_ptr() for p in projections}) == 1
    # (the tiny models stay on the CPU: on a GPU machine without the interpreter the blocks' own forwards run)
    fused = fusions.base.kernel_module("groupnorm").supported(x)
    calls = []
    hooks = [p.register_forward_hook(lambda *a: calls.append(1)) for p in projections]
    assert rel(unet(x, t, ctx, y), ref) <= 1e-5 and len(calls) == (0 if fused else len(projections))
    calls.clear()
    # the time embedding's SiLU and projections, computed once per call, are the new call's: no stale values
    assert rel(unet(x, t2, ctx, y), ref2) <= 1e-5 and rel(ref2, ref) > 1e-3
    with torch.no_grad():  # a weight updated in place between calls: the next call's GEMM reads it
        projections[-1].weight.mul_(3.0)
    calls.clear()
    shifted = unet(x, t, ctx, y)
    assert rel(shifted, ref) > 1e-4 and len(calls) == (0 if fused else len(projections))
    projections[0].weight = nn.Parameter(projections[0].weight.detach() * 2, requires_grad=False)
    calls.clear()
    doubled = unet(x, t, ctx, y)  # a replaced weight: that block projects on its own
    assert len(calls) == (1 if fused else len(projections)) and rel(doubled, shifted) > 1e-4
    for h in hooks:
        h.remove()
    undo()
    assert not any("forward" in vars(m) for m in unet.unet.modules())
    assert rel(unet(x, t, ctx, y), doubled) <= 1e-5


def test_resnet_fusion_leaves_what_it_does_not_cover_to_the_block(monkeypatch):
    from sd_accel.accel.engine.fusions import resnet
    from ldm_unet import ResBlock

    fused_calls = []
    block = resnet._block
    monkeypatch.setattr(resnet, "_block", lambda *a: fused_calls.append(1) or block(*a))

    # the kernels' device: the GPU where there is one, else the CPU under the interpreter
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # fp32 convolutions on both sides
    torch.manual_seed(0)
    scale_shift = ResBlock(64, 32, 64, groups=32, use_scale_shift_norm=True).eval().to(device)
    plain = ResBlock(64, 32, 96, groups=32).eval().to(device)
    undo, counts = fusions.apply(nn.Sequential(scale_shift, plain), ["resnet"])
    assert counts["resnet"] == 1 and "forward" in vars(plain) and "forward" not in vars(scale_shift)
    x = torch.randn(2, 64, 8, 8, device=device).contiguous(memory_format=torch.channels_last)
    emb = torch.randn(2, 32, device=device)
    fused = plain(x, emb)
    scale_shift(x, emb)
    assert len(fused_calls) == 1
    # ComfyUI's cast-on-the-fly convolution (weights cast per call): the block's own forward runs, same result
    plain.in_layers[2].comfy_cast_weights = True
    assert rel(plain(x, emb), fused) <= 1e-5 and len(fused_calls) == 1
    plain.in_layers[2].comfy_cast_weights = False
    plain(x.contiguous(), emb)  # NCHW input: the block's own forward
    assert len(fused_calls) == 1
    undo()
    assert rel(plain(x, emb), fused) <= 1e-5


@pytest.mark.parametrize("form", ["diffusers", "ldm"])
def test_skip_layernorm_fusion_same_function_and_undo_restores(form):
    _, unet, (x, t, ctx, y) = next(m for m in _models() if m[0] == form)
    ref = unet(x, t, ctx, y)
    undo, counts = fusions.apply(unet.unet, ["skip_layernorm", "geglu"])
    blocks = sum(type(m).__name__ == "BasicTransformerBlock" for m in unet.unet.modules())
    assert counts["skip_layernorm"] == blocks > 0
    block = next(m for m in unet.unet.modules() if type(m).__name__ == "BasicTransformerBlock")
    assert _plain_output_linear(block.ff, x.dtype) is block.ff.net[2]  # the residual add goes into its GEMM
    assert rel(unet(x, t, ctx, y), ref) <= 1e-5
    undo()
    assert not any("forward" in vars(m) for m in unet.unet.modules())
    assert torch.equal(unet(x, t, ctx, y), ref)


def test_sdpa_processor_drops_only_the_division_by_one_and_undo_restores():
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    _, unet, (x, t, ctx, y) = next(_models())
    ref = unet(x, t, ctx, y)
    attentions = [m for m in unet.unet.modules() if isinstance(m, Attention)]
    undo, counts = fusions.apply(unet.unet, ["sdpa_processor"])
    assert counts["sdpa_processor"] == len(attentions) > 0
    assert torch.equal(unet(x, t, ctx, y), ref)  # the same kernels, less the division by 1
    attn = attentions[0]
    tokens = torch.randn(2, 16, attn.query_dim)
    mask = torch.zeros(2, 1, 16)
    mask[:, :, 8:] = -1e4
    with torch.no_grad():
        expected = AttnProcessor2_0()(attn, tokens, attention_mask=mask)
        assert torch.equal(attn(tokens, attention_mask=mask), expected)  # a masked call: the original processor
    undo()
    assert all(type(m.processor) is AttnProcessor2_0 for m in attentions)
    assert torch.equal(unet(x, t, ctx, y), ref)
    scaled = Attention(32, heads=2, dim_head=16, rescale_output_factor=2.0)
    _, counts = fusions.apply(nn.Sequential(scaled), ["sdpa_processor"])
    assert counts["sdpa_processor"] == 0 and type(scaled.processor) is AttnProcessor2_0


@pytest.mark.parametrize("form", ["diffusers", "ldm"])
def test_upsample_fusion_same_function_and_undo_restores(form, monkeypatch):
    unet, (x, t, ctx, y), ref = _channels_last_model(form)
    upsamplers = [m for m in unet.unet.modules() if type(m).__name__ in ("Upsample2D", "Upsample")]
    undo, counts = fusions.apply(unet.unet, ["upsample"])
    assert counts["upsample"] == len(upsamplers) > 0
    kernel = fusions.base.kernel_module("upsample")
    runs = kernel.supported(x)  # the tiny models stay on the CPU: on a GPU machine the module's own forward runs
    calls = []
    monkeypatch.setattr(kernel, "upsample_nearest2x", lambda h, f=kernel.upsample_nearest2x: calls.append(1) or f(h))
    assert torch.equal(unet(x, t, ctx, y), ref)  # nearest upsampling is a copy: exact
    assert len(calls) == (len(upsamplers) if runs else 0)
    # a host asking for another size than 2x (odd latent sizes) gets the module's own interpolation
    up = upsamplers[0]
    h = torch.randn(1, up.channels, 3, 3).contiguous(memory_format=torch.channels_last)
    odd = up(h, (1, up.channels, 5, 5)) if form == "ldm" else up(h, output_size=(5, 5))
    assert odd.shape[-2:] == (5, 5) and len(calls) == (len(upsamplers) if runs else 0)
    # large enough inputs take the upsampling and the 3x3 convolution together (sub-pixel form)
    monkeypatch.setattr(kernel, "SUBPIXEL_MIN_PIXELS", 0)
    pairs = []
    monkeypatch.setattr(kernel, "upsample_conv3x3", lambda *a, f=kernel.upsample_conv3x3: pairs.append(1) or f(*a))
    assert rel(unet(x, t, ctx, y), ref) <= 1e-5
    assert len(pairs) == (len(upsamplers) if runs else 0) and len(calls) == (len(upsamplers) if runs else 0)
    undo()
    assert not any("forward" in vars(m) for m in unet.unet.modules())
    assert torch.equal(unet(x, t, ctx, y), ref)


@pytest.mark.parametrize("form", ["diffusers", "ldm"])
def test_conv_bias_fusion_same_function_and_undo_restores(form, monkeypatch):
    unet, (x, t, ctx, y), ref = _channels_last_model(form)
    convs = [m for m in unet.unet.modules() if isinstance(m, nn.Conv2d) and m.bias is not None]
    ran = []
    def channels_last_input(m, args):  # unconverted inputs (a transformer's NCHW output here) keep the conv's forward
        if not args[0].is_contiguous() and args[0].is_contiguous(memory_format=torch.channels_last):
            ran.append(1)

    hooks = [c.register_forward_pre_hook(channels_last_input) for c in convs]
    unet(x, t, ctx, y)
    undo, counts = fusions.apply(unet.unet, ["conv_bias"])
    assert counts["conv_bias"] == len(convs) > 0
    kernel = fusions.base.kernel_module("layernorm")
    runs = kernel.supported(x)  # the tiny models stay on the CPU: on a GPU machine the convolutions' own forward runs
    calls = []
    monkeypatch.setattr(kernel, "add_bias_residual", lambda *a, f=kernel.add_bias_residual: calls.append(1) or f(*a))
    n_ran = len(ran)
    out = unet(x, t, ctx, y)
    assert rel(out, ref) <= 1e-5 and len(calls) == (len(ran) - n_ran if runs else 0) > (0 if runs else -1)
    # NCHW input (a host that did not convert the model) and a LoRA-style weight function keep the conv's forward
    conv = convs[0]
    h = torch.randn(1, conv.in_channels, 8, 8)
    before = len(calls)
    assert torch.equal(conv(h), F.conv2d(h, conv.weight, conv.bias, conv.stride, conv.padding)) and len(calls) == before
    conv.weight_function = [lambda w: w * 2]  # ComfyUI's attribute: the fused path must not skip it
    h = h.contiguous(memory_format=torch.channels_last)
    conv(h)
    assert len(calls) == before
    del conv.weight_function
    for hook in hooks:
        hook.remove()
    undo()
    assert not any("forward" in vars(m) for m in unet.unet.modules())
    assert torch.equal(unet(x, t, ctx, y), ref)


def _attention_modules(unet: nn.Module) -> list[nn.Module]:
    return [m for m in unet.modules() if type(m).__name__ in ("Attention", "CrossAttention")]


@pytest.mark.parametrize("form", ["diffusers", "ldm"])
def test_packed_qkv_same_function_follows_the_hosts_weight_updates_and_unpacks(form, monkeypatch):
    from types import SimpleNamespace

    from sd_accel.accel.engine.fusions import packing

    _, unet, (x, t, ctx, y) = next(m for m in _models() if m[0] == form)
    names = ["sdpa_processor", "qkv"] if form == "diffusers" else ["qkv"]  # diffusers' projections: in its processor
    module = unet.unet
    values = {k: v.clone() for k, v in module.state_dict().items()}
    ref = unet(x, t, ctx, y)
    attentions = _attention_modules(module)
    undo, counts = fusions.apply(module, names)
    assert counts["qkv"] == len(attentions) > 0
    state = module.state_dict()
    assert list(state) == list(values) and all(torch.equal(state[k], v) for k, v in values.items())
    self_attn, cross_attn = attentions[0], attentions[1]  # a block's attn1 and attn2
    storage = self_attn.to_q.weight.untyped_storage().data_ptr()
    assert self_attn.to_v.weight.untyped_storage().data_ptr() == storage  # q, k and v: rows of one buffer
    # cross-attentions whose context is wider or narrower than their queries: the k and v of all of them in one
    # buffer, projected by one GEMM per UNet call
    cross = [m for m in attentions if m.to_k.in_features != m.to_q.in_features]
    assert cross
    kv_storage = cross[0].to_k.weight.untyped_storage().data_ptr()
    for m in cross:
        assert m.to_k.weight.untyped_storage().data_ptr() == m.to_v.weight.untyped_storage().data_ptr() == kv_storage
        assert m.to_q.weight.untyped_storage().data_ptr() != kv_storage
    gemms = []
    monkeypatch.setattr(packing, "F", SimpleNamespace(linear=lambda *a: gemms.append(1) or F.linear(*a)))
    per_call = len(attentions) - len(cross) + 1  # one per module with a pack of its own, one for all the others

    calls = []
    hooks = [m.to_k.register_forward_hook(lambda *a: calls.append(1)) for m in attentions]
    assert rel(unet(x, t, ctx, y), ref) <= 1e-5 and not calls  # every K came out of a packed GEMM
    assert len(gemms) == per_call
    with torch.inference_mode():  # how the torch path calls it
        assert rel(unet(x, t, ctx, y), ref) <= 1e-5 and len(gemms) == 2 * per_call

    with torch.no_grad():  # the host updates a weight in place (ComfyUI's weight_inplace_update): packed GEMMs read it
        self_attn.to_k.weight.mul_(1.5)
        cross_attn.to_v.weight.mul_(0.5)
        cross[-1].to_k.weight.mul_(0.5)
    inplace = unet(x, t, ctx, y)
    assert rel(inplace, ref) > 1e-3 and not calls and len(gemms) == 3 * per_call
    undo()
    packing.unpack(module)
    assert rel(unet(x, t, ctx, y), inplace) <= 1e-5  # the same weights, each in its own storage: the same function
    undo, _ = fusions.apply(module, names)
    calls.clear()
    # the host replaces Parameters (ComfyUI's LoRA patching): those modules compute with them through their Linears
    self_attn.to_k.weight = nn.Parameter(self_attn.to_k.weight.detach() * 2, requires_grad=False)
    cross[0].to_v.weight = nn.Parameter(cross[0].to_v.weight.detach() * 2, requires_grad=False)
    doubled = unet(x, t, ctx, y)
    assert len(calls) == 2 and rel(doubled, inplace) > 1e-3
    # a bias given to a layer packed without one (A1111 assigns one for a LoRA with a bias diff): counted too
    packed = next(m for m in attentions if m not in (self_attn, cross[0]) and m.to_v.bias is None)
    packed.to_v.bias = nn.Parameter(torch.full((packed.to_v.out_features,), 0.5, dtype=packed.to_v.weight.dtype))
    assert rel(unet(x, t, ctx, y), doubled) > 1e-3
    packed.to_v.bias = None
    assert rel(unet(x, t, ctx, y), doubled) <= 1e-5
    calls.clear()
    doubled = unet(x, t, ctx, y)
    assert len(calls) == 2
    undo()
    undo, counts = fusions.apply(module, names)  # the next run packs them again, with the new weights
    assert counts["qkv"] == len(attentions)
    assert self_attn.to_k.weight.untyped_storage().data_ptr() == self_attn.to_q.weight.untyped_storage().data_ptr()
    assert rel(unet(x, t, ctx, y), doubled) <= 1e-5 and len(calls) == 2
    for h in hooks:
        h.remove()

    undo()
    packing.unpack(module)
    storages = [p.untyped_storage().data_ptr() for p in module.parameters()]
    assert len(set(storages)) == len(storages)
    assert rel(unet(x, t, ctx, y), doubled) <= 1e-5
    assert not any("forward" in vars(m) or fusions.base.projections(m) is not None for m in module.modules())
    assert fusions.base.drop_packs(module) == []


def test_packed_weights_save_and_load_as_separate_tensors(tmp_path):
    """A checkpoint saved while the torch path holds the weights packed (ComfyUI's Save Checkpoint) is unaffected."""
    from safetensors.torch import load_file, save_file

    module = tiny_ldm_unet(seed=34)
    values = {k: v.clone() for k, v in module.state_dict().items()}
    _, counts = fusions.apply(module, ["qkv", "resnet"])
    assert counts["qkv"] > 0
    save_file(module.state_dict(), tmp_path / "unet.safetensors")
    loaded = load_file(tmp_path / "unet.safetensors")
    assert sorted(loaded) == sorted(values) and all(torch.equal(loaded[k], v) for k, v in values.items())


def test_comfyui_attention_with_a_value_or_mask_keeps_its_function():
    module = tiny_ldm_unet(seed=35)
    attn = next(m for m in _attention_modules(module) if m.to_k.in_features != m.to_q.in_features)
    g = torch.Generator().manual_seed(36)
    x = torch.randn(2, 16, attn.to_q.in_features, generator=g)
    ctx = torch.randn(2, 7, attn.to_k.in_features, generator=g)
    value, mask = torch.randn(2, 7, attn.to_v.in_features, generator=g), torch.zeros(2, 1, 16, 7)
    mask[..., 4:] = float("-inf")
    with torch.no_grad():
        refs = [attn(x, ctx), attn(x, ctx, value=value), attn(x, ctx, mask=mask)]
        undo, _ = fusions.apply(module, ["qkv"])
        assert fusions.base.projections(attn) is not None and "forward" in vars(attn)
        outs = [attn(x, ctx), attn(x, ctx, value=value), attn(x, ctx, mask=mask)]
    undo()
    assert all(rel(o, r) <= 1e-5 for o, r in zip(outs, refs))


def test_geglu_fusion_takes_the_projection_into_the_kernel_where_it_covers_it(monkeypatch):
    from diffusers.models.activations import GEGLU

    from sd_accel.accel.engine.fusions.base import kernel_module

    geglu = kernel_module("geglu")
    calls = []
    monkeypatch.setattr(geglu, "geglu_linear", lambda *a, f=geglu.geglu_linear: calls.append(1) or f(*a))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the kernels run (the CPU under the interpreter)
    torch.manual_seed(0)
    short, wide = GEGLU(64, 48).to(device).half(), GEGLU(geglu.LINEAR_MAX_K + 64, 48).to(device).half()
    # many rows (covered with TMA) and a short K (covered without); few rows and a long K: neither
    xs = [torch.randn(2, rows, m.proj.in_features, device=device).half()
          for m, rows in ((short, geglu.LINEAR_TMA_MIN_ROWS // 2), (wide, 9))]
    with torch.no_grad():
        refs = [m.float()(x.float()) for m, x in zip((short, wide), xs)]
        short.half(), wide.half()
        undo, counts = fusions.apply(nn.Sequential(short, wide), ["geglu"])
        outs = [m(x) for m, x in zip((short, wide), xs)]
        assert counts["geglu"] == 2 and len(calls) == 1  # the short projection only
        # ComfyUI's Linear casting its weights on the fly (lowvram): the module's own forward
        short.proj.__class__ = type("Linear", (nn.Linear,), {})
        short.proj.comfy_cast_weights = True
        assert rel(short(xs[0]).float(), refs[0]) <= 1e-2 and len(calls) == 1
    undo()
    assert all(rel(o.float(), r) <= 1e-2 for o, r in zip(outs, refs))


@pytest.mark.parametrize("way", ["in place", "through host memory"])
def test_unpack_gives_each_weight_its_own_storage_back(monkeypatch, way):
    from sd_accel.accel.engine.fusions import packing

    if way == "through host memory":
        monkeypatch.setattr(packing, "UNPACK_IN_PLACE_BYTES", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(8, 6), nn.Linear(8, 2))
    params = list(model.parameters())
    values = [p.detach().clone() for p in params]
    pack = packing.pack(model, list(model))
    assert pack.intact() and len({p.untyped_storage().data_ptr() for p in params}) == 2  # weights, biases
    x = torch.randn(3, 8)
    assert torch.allclose(pack.linear(x, 0, 3), torch.cat([m(x) for m in model], -1))
    del pack
    packing.unpack(model)
    assert list(model.parameters()) == params and fusions.base.drop_packs(model) == []
    assert len({p.untyped_storage().data_ptr() for p in params}) == len(params)
    assert all(torch.equal(p, v) and p.is_contiguous() for p, v in zip(params, values))


@pytest.mark.parametrize("way", ["in place", "through host memory"])
def test_unpack_skips_a_pack_whose_weights_the_host_replaced(monkeypatch, way):
    """ComfyUI's LoRA patching replaces Parameters and its unpatching puts others back: a pack can end with no layer
    reading it (SDXL's shared K/V pack, unpacked through host memory, when the model is unloaded after a LoRA)."""
    from sd_accel.accel.engine.fusions import packing

    if way == "through host memory":
        monkeypatch.setattr(packing, "UNPACK_IN_PLACE_BYTES", 0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(8, 6))
    packing.pack(model, list(model))
    replaced = [nn.Parameter(m.weight.detach().clone()) for m in model] + [nn.Parameter(m.bias.detach().clone())
                                                                          for m in model]
    for m, w, b in zip(model, replaced[:2], replaced[2:]):
        m.weight, m.bias = w, b
    packing.unpack(model)
    assert list(model.parameters()) == [replaced[0], replaced[2], replaced[1], replaced[3]]
    assert fusions.base.drop_packs(model) == []


def _cross_attention_module(form: str, device: str, dim_head: int = 64) -> nn.Module:
    """A cross-attention with 64-wide heads (SDXL's) unless told, as diffusers and ComfyUI build it, in fp16."""
    torch.manual_seed(40)
    if form == "diffusers":
        from diffusers.models.attention_processor import Attention

        attn = Attention(96, cross_attention_dim=80, heads=2, dim_head=dim_head)
    else:
        from ldm_unet import CrossAttention

        attn = CrossAttention(96, 80, heads=2, dim_head=dim_head)
    return attn.to(device).half()


@pytest.mark.parametrize("form", ["diffusers", "ldm"])
def test_cross_attention_fusion_runs_short_key_sets_through_the_kernel(form, monkeypatch):
    from sd_accel.accel.engine.fusions.base import kernel_module

    attention = kernel_module("attention")
    calls = []
    monkeypatch.setattr(attention, "attention", lambda *a, f=attention.attention: calls.append(a[1].shape) or f(*a))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the kernels run (the CPU under the interpreter)
    attn = _cross_attention_module(form, device)
    g = torch.Generator().manual_seed(41)
    x = torch.randn(2, 24, 96, generator=g).to(device).half()
    text, long_text = (torch.randn(2, n, 80, generator=g).to(device).half() for n in (77, attention.SHORT_KEYS + 8))
    with torch.no_grad():
        refs = [attn.float()(x.float(), text.float()), attn(x.float(), long_text.float())]
        attn.half()
        keys = set(vars(attn))
        undo, counts = fusions.apply(nn.Sequential(attn), ["sdpa_processor", "qkv", "cross_attention"])
        assert counts["cross_attention"] == 1
        outs = [attn(x, text), attn(x, long_text)]
        assert [s[1] for s in calls] == [77]  # the long key set went to SDPA
        undo()
        assert set(vars(attn)) == keys
        assert rel(attn(x, text).float(), refs[0]) <= 1e-2 and len(calls) == 1
    assert all(rel(o.float(), r) <= 1e-2 for o, r in zip(outs, refs))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("form", ["diffusers", "ldm"])
@pytest.mark.parametrize("dim_head", [40, 80, 160])  # SD1.5's head sizes, which the Triton kernel does not take
def test_short_key_sets_of_other_head_sizes_go_to_sdpa_kernels_that_build_no_plan_per_size(form, dim_head,
                                                                                           monkeypatch):
    """cuDNN's attention builds a plan per sequence length at every new image size: short key sets go to PyTorch's
    flash kernel (heads up to 128 wide) or its memory-efficient one instead, with the same result; long ones stay
    with the engine's choice."""
    import contextlib

    from sd_accel.accel.engine import attention as engine_attention

    chosen = []
    real = engine_attention.sdpa_kernels
    monkeypatch.setattr(engine_attention, "sdpa_kernels",
                        lambda preferred: chosen.append(preferred) or real(preferred))
    attn = _cross_attention_module(form, "cuda", dim_head)
    g = torch.Generator().manual_seed(43)
    x = torch.randn(2, 300, 96, generator=g).cuda().half()
    text, long_text = (torch.randn(2, n, 80, generator=g).cuda().half() for n in (77, 200))
    with torch.no_grad():
        refs = [attn.float()(x.float(), c.float()) for c in (text, long_text)]
        attn.half()
        undo, counts = fusions.apply(nn.Sequential(attn), ["sdpa_processor", "qkv", "cross_attention"])
        assert counts["cross_attention"] == 1
        with contextlib.ExitStack() as stack:
            stack.enter_context(real("cudnn"))  # as the torch path runs a UNet on NVIDIA
            outs = [attn(x, c) for c in (text, long_text)]
        undo()
    assert chosen == ["flash" if dim_head <= 128 else "efficient"]  # the long key set kept the engine's choice
    assert all(rel(o.float(), r) <= 1e-2 for o, r in zip(outs, refs))


def test_cross_attention_fusion_leaves_comfyuis_other_attention_functions_alone(monkeypatch):
    import ldm_unet
    from sd_accel.accel.engine.fusions.base import kernel_module

    attention = kernel_module("attention")
    calls = []
    monkeypatch.setattr(attention, "attention", lambda *a, f=attention.attention: calls.append(1) or f(*a))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    attn = _cross_attention_module("ldm", device)
    x = torch.randn(2, 24, 96).to(device).half()
    text = torch.randn(2, 77, 80).to(device).half()
    chosen = []

    def other(q, k, v, heads, **kwargs):  # another attention function (sage, xformers, ...) chosen by the user
        chosen.append("other")
        return ldm_unet.attention_pytorch(q, k, v, heads, **kwargs)

    with torch.no_grad():
        undo, _ = fusions.apply(nn.Sequential(attn), ["qkv", "cross_attention"])
        monkeypatch.setattr(ldm_unet, "optimized_attention", other)
        attn(x, text, transformer_options={})
        assert calls == [] and chosen == ["other"]
        monkeypatch.setattr(ldm_unet, "optimized_attention", ldm_unet.attention_pytorch)
        # a model patch's attention override, which ComfyUI's attention functions hand the call to
        attn(x, text, transformer_options={"optimized_attention_override": other})
        assert calls == []
        attn(x, text, transformer_options={})
        assert calls == [1]
        undo()


def test_order_runs_every_fusion_after_the_ones_it_names():
    from sd_accel.accel.engine.fusions import registry

    assert sorted(fusions.ORDER) == sorted(fusions.MODULES) and len(set(fusions.ORDER)) == len(fusions.ORDER)
    assert fusions.ORDER == tuple(f.name for f in registry.order(registry.declared()))  # deterministic
    for i, name in enumerate(fusions.ORDER):
        assert set(fusions.FUSIONS[name].after) <= set(fusions.ORDER[:i]), name
    assert {"sdpa_processor", "qkv"} <= set(fusions.FUSIONS["cross_attention"].after)


def test_registry_rejects_a_cycle_an_unknown_after_and_a_name_declared_twice():
    from sd_accel.accel.engine.fusions.registry import Fusion, order

    def f(name, *after):
        return Fusion(name, lambda model, undo: 0, after)

    # with no after between them, the listing decides; otherwise the after does
    assert [x.name for x in order([f("a"), f("b"), f("c")])] == ["a", "b", "c"]
    assert [x.name for x in order([f("a", "c"), f("b"), f("c")])] == ["b", "c", "a"]
    with pytest.raises(ValueError, match="cycle"):
        order([f("a", "b"), f("b", "a"), f("c")])
    with pytest.raises(ValueError, match="'nope'"):
        order([f("a", "nope")])
    with pytest.raises(ValueError, match="more than once"):
        order([f("a"), f("a")])


def test_named_fusions_run_in_the_registrys_order(monkeypatch):
    from dataclasses import replace

    ran = []
    for name in ("qkv", "layout"):
        entry = fusions.FUSIONS[name]
        monkeypatch.setitem(fusions.FUSIONS, name, replace(
            entry, apply=lambda model, undo, name=name, f=entry.apply: ran.append(name) or f(model, undo)))
    model = tiny_ldm_unet(seed=50)
    undo, counts = fusions.apply(model, ["qkv", "layout"])
    assert ran == ["layout", "qkv"] and list(counts) == ["layout", "qkv"]
    undo()
    fusions.packing.unpack(model)


def test_an_unknown_fusion_name_says_which_names_there_are():
    from sd_accel.accel.errors import BadInput

    model = tiny_ldm_unet(seed=51)
    with pytest.raises(BadInput, match="'qvk'") as e:
        fusions.apply(model, ["layout", "qvk"])
    assert all(name in str(e.value) for name in fusions.ORDER)
    assert not any("forward" in vars(m) for m in model.modules())  # nothing applied


def test_fusion_modules_import_no_sibling_fusion():
    """Shared helpers live in base, packing, registry and transformer (the DiTs'): a fusion module imports only those,
    so no two fusion modules import each other."""
    import ast
    import pathlib

    helpers = {"base", "packing", "registry", "transformer"}
    folder = pathlib.Path(fusions.__file__).parent
    for name in fusions.MODULES:
        tree = ast.parse((folder / f"{name}.py").read_text())
        siblings = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                siblings |= {node.module} if node.module else {a.name for a in node.names}
        assert siblings <= helpers, (name, siblings - helpers)


@pytest.mark.parametrize("form", ["diffusers", "ldm"])
def test_apply_and_undo_leave_no_attribute_on_any_module(form):
    """The fusions keep their state outside the modules: the only attributes they add are the patched methods
    themselves, and undo takes those away too."""
    unet, (x, t, ctx, y), ref = _channels_last_model(form)
    keys = {id(m): set(vars(m)) for m in unet.unet.modules()}
    undo, counts = fusions.apply(unet.unet)
    assert list(counts) == [n for n in fusions.ORDER if n not in fusions.DIT] and counts["qkv"] > 0
    assert rel(unet(x, t, ctx, y), ref) <= 1e-5
    for m in unet.unet.modules():
        if id(m) not in keys:  # a parameterless child put in (groupnorm's SiLU): the model's own again after undo
            continue
        added = set(vars(m)) - keys[id(m)]
        assert all(isinstance(vars(m)[k], types.MethodType) for k in added), (type(m).__name__, added)
    undo()
    fusions.packing.unpack(unet.unet)
    assert {id(m): set(vars(m)) for m in unet.unet.modules()} == keys
    assert torch.equal(unet(x, t, ctx, y), ref)
