"""The ldm-style test UNet: it runs like ComfyUI's UNetModel, applies ControlNet residuals the same way, and
accel/models/spec.py recognises it."""

from __future__ import annotations

import torch
import pytest

from sd_accel.accel.errors import BadInput
from sd_accel.accel.models.spec import CanonicalUNet, inspect_unet
from ldm_unet import UNetModel, sd15_kwargs, sdxl_kwargs, tiny_ldm_unet


def _inputs(sdxl: bool, batch: int = 2, size: tuple[int, int] = (16, 16), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, *size, generator=g)
    t = torch.tensor([999.0, 10.0][:batch])
    context = torch.randn(batch, 7, 48 if sdxl else 32, generator=g)
    y = torch.randn(batch, 80, generator=g) if sdxl else None
    return x, t, context, y


def _skip_shapes(m: UNetModel, x, t, context, y) -> tuple[list[torch.Size], torch.Size]:
    shapes: list[torch.Size] = []
    hooks = [b.register_forward_hook(lambda mod, a, out: shapes.append(out.shape)) for b in m.input_blocks]
    middle: list[torch.Size] = []
    hooks.append(m.middle_block.register_forward_hook(lambda mod, a, out: middle.append(out.shape)))
    m(x, t, context, y)
    for h in hooks:
        h.remove()
    return shapes, middle[0]


@pytest.mark.parametrize("sdxl", [False, True])
@pytest.mark.parametrize("size", [(16, 16), (13, 11)])  # odd sizes: ComfyUI upsamples to the skip's size
def test_runs_with_the_latent_shape(sdxl, size):
    m = tiny_ldm_unet(sdxl)
    x, t, context, y = _inputs(sdxl, size=size)
    out = m(x, timesteps=t, context=context, y=y)
    assert out.shape == x.shape
    assert torch.isfinite(out).all() and out.std() > 0


def test_seeded():
    x, t, context, _ = _inputs(False)
    a, b, c = tiny_ldm_unet(seed=3)(x, t, context), tiny_ldm_unet(seed=3)(x, t, context), tiny_ldm_unet(seed=4)(x, t, context)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, c)


def test_sdxl_conditioning_reaches_the_output():
    m = tiny_ldm_unet(sdxl=True)
    x, t, context, y = _inputs(True)
    assert not torch.allclose(m(x, t, context, y), m(x, t, context, y + 1))
    assert not torch.allclose(m(x, t, context, y), m(x, t, context + 1, y))


@pytest.mark.parametrize("sdxl", [False, True])
def test_control_residuals_applied_and_caller_lists_untouched(sdxl):
    m = tiny_ldm_unet(sdxl)
    x, t, context, y = _inputs(sdxl)
    skips, middle = _skip_shapes(m, x, t, context, y)
    plain = m(x, t, context, y)

    zeros = {"middle": [torch.zeros(middle)], "output": [torch.zeros(s) for s in skips]}
    torch.testing.assert_close(m(x, t, context, y, control=zeros), plain, rtol=0, atol=0)

    g = torch.Generator().manual_seed(5)
    control = {"middle": [torch.randn(middle, generator=g)], "output": [torch.randn(s, generator=g) for s in skips]}
    lists = {k: list(v) for k, v in control.items()}
    values = {k: [c.clone() for c in v] for k, v in control.items()}
    out = m(x, t, context, y, control=control)
    assert not torch.allclose(out, plain)
    for k in control:
        assert len(control[k]) == len(lists[k]) and all(a is b for a, b in zip(control[k], lists[k]))
        assert all(torch.equal(a, b) for a, b in zip(control[k], values[k]))
    # A second call with the same dict gives the same result: nothing was consumed.
    torch.testing.assert_close(m(x, t, context, y, control=control), out)


def test_middle_residual_is_added_after_the_middle_block():
    m = tiny_ldm_unet()
    x, t, context, y = _inputs(False)
    _, middle = _skip_shapes(m, x, t, context, y)
    r = torch.randn(middle, generator=torch.Generator().manual_seed(2))
    hook = m.middle_block.register_forward_hook(lambda mod, a, out: out + r)
    expected = m(x, t, context)
    hook.remove()
    torch.testing.assert_close(m(x, t, context, control={"middle": [r], "output": []}), expected)


def test_last_output_residual_goes_to_the_deepest_skip():
    """ComfyUI pops output residuals from the end: the last one meets the first skip popped (the deepest)."""
    m = tiny_ldm_unet()
    x, t, context, y = _inputs(False)
    skips, _ = _skip_shapes(m, x, t, context, y)
    r = torch.randn(skips[-1], generator=torch.Generator().manual_seed(2))
    out = m(x, t, context, control={"output": [None] * (len(skips) - 1) + [r]})
    # The same as adding r to the skip's channels of the first output block's input (cat([h, skip])).
    c = skips[-1][1]
    hook = m.output_blocks[0].register_forward_pre_hook(
        lambda mod, args: (torch.cat([args[0][:, :-c], args[0][:, -c:] + r], 1),) + args[1:])
    expected = m(x, t, context)
    hook.remove()
    assert not torch.allclose(out, m(x, t, context))
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("sdxl,context_dim,adm", [(False, 32, 0), (True, 48, 80)])
def test_accel_recognises_it(sdxl, context_dim, adm):
    m = tiny_ldm_unet(sdxl)
    spec = inspect_unet(m)
    assert (spec.form, spec.context_dim, spec.adm_channels, spec.model_channels) == ("ldm", context_dim, adm, 32)
    x, t, context, y = _inputs(sdxl)
    canon = CanonicalUNet(m)
    torch.testing.assert_close(canon(x, t, context, y), m(x, t, context, y), rtol=0, atol=0)
    if sdxl:
        with pytest.raises(BadInput, match="needs the pooled"):
            canon.check(x, context, None)


@pytest.mark.parametrize("kwargs,family,context_dim,adm,params", [
    (sd15_kwargs(), "sd1", 768, 0, 859_520_964),      # the published SD1.5 UNet parameter count
    (sdxl_kwargs(), "sdxl", 2048, 2816, 2_567_463_684),  # the published SDXL base UNet parameter count
])
def test_full_configs_have_the_published_structure(kwargs, family, context_dim, adm, params):
    with torch.device("meta"):  # structure only: no memory, no time
        m = UNetModel(**kwargs)
    spec = inspect_unet(m)
    assert (spec.form, spec.family, spec.context_dim, spec.adm_channels, spec.num_params) == \
        ("ldm", family, context_dim, adm, params)
    assert len(m.input_blocks) == 3 * len(kwargs["channel_mult"]) and len(m.output_blocks) == len(m.input_blocks)


@pytest.mark.parametrize("sdxl,name", [(False, "tiny-sd15"), (True, "tiny-sdxl")])
def test_tiny_matches_the_tiny_diffusers_config(sdxl, name):
    from sd_accel.accel.models.configs import build_unet

    ldm, diffusers = tiny_ldm_unet(sdxl), build_unet(name)
    assert sum(p.numel() for p in ldm.parameters()) == sum(p.numel() for p in diffusers.parameters())
    assert len(ldm.state_dict()) == len(diffusers.state_dict())
