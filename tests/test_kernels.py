"""Triton kernels against their torch references.

Without a GPU they run on the CPU through Triton's interpreter, which Triton chooses when it is first imported:
tests/conftest.py sets TRITON_INTERPRET=1 before anything imports it (and so does this module, run on its own).
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from sd_accel.accel.errors import BadInput  # noqa: E402
from sd_accel.kernels import attention as at  # noqa: E402
from sd_accel.kernels import common  # noqa: E402
from sd_accel.kernels import geglu as gg  # noqa: E402
from sd_accel.kernels import groupnorm as gn  # noqa: E402
from sd_accel.kernels import layernorm as ln  # noqa: E402
from sd_accel.kernels import upsample as up  # noqa: E402

if not gn.supported(torch.zeros(1, 8, 1, 1, device=DEVICE)):
    pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set, so it cannot run on the CPU in this process; "
                "tests/conftest.py sets it first: run pytest from the repository root.", allow_module_level=True)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       # The interpreter rounds fp32 -> bf16 by truncation (1 ulp, 2**-7), the GPU to nearest even.
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + offset).to(DEVICE, dtype)


def _close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


# ---- GroupNorm ----

GN_CASES = [
    # (shape, groups, channels_last, silu, dtype): SD UNet block (C=320, 16x16, batch 2), then odd shapes.
    ((2, 320, 16, 16), 32, True, True, torch.float32),
    ((2, 320, 16, 16), 32, False, False, torch.float32),
    ((2, 320, 16, 16), 32, True, True, torch.float16),
    ((2, 320, 16, 16), 32, True, False, torch.bfloat16),
    ((1, 96, 3, 5), 8, False, True, torch.float32),
    ((3, 40, 3, 5), 8, True, False, torch.float32),
    ((3, 40, 3, 5), 8, False, True, torch.float16),
    ((2, 9, 5, 3), 3, True, True, torch.float32),  # odd channel count: channels_last tiles one channel wide
]


@pytest.fixture(params=["whole groups", "split groups"])
def gn_path(request, monkeypatch):
    """GroupNorm both ways: small groups whole in one program each (one launch), and groups split into chunks
    (statistics, finalize and normalization launches), which larger groups take."""
    if request.param == "split groups":
        monkeypatch.setattr(gn, "WHOLE_GROUP_ELEMENTS", 0)
    return request.param


@pytest.mark.parametrize("shape,groups,channels_last,silu,dtype", GN_CASES)
def test_group_norm_matches_torch(shape, groups, channels_last, silu, dtype, gn_path):
    x = _randn(*shape, dtype=dtype, scale=2.0, offset=0.5)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = _randn(shape[1], dtype=dtype, seed=1), _randn(shape[1], dtype=dtype, seed=2)
    y = gn.group_norm(x, groups, w, b, eps=1e-5, silu=silu)
    ref = gn.group_norm_ref(x.float(), groups, w.float(), b.float(), eps=1e-5, silu=silu)
    assert y.dtype == dtype and y.shape == x.shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert y.is_contiguous(memory_format=fmt)
    _close(y, ref, dtype)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("shape", [(2, 640, 32, 32), (2, 960, 32, 32), (2, 2560, 8, 8), (2, 1280, 12, 12),
                                   (2, 1920, 24, 24)])
def test_group_norm_at_unet_shapes_of_several_resolutions(shape, channels_last):
    # 512, 768 and 1024 px UNets: groups split into partials of unequal size, merged by the finalize kernel (a
    # one-warp finalize got these wrong on a GPU while the interpreter was exact: docs/perf-notes.md)
    x = _randn(*shape, dtype=torch.float16)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = _randn(shape[1], dtype=torch.float16, seed=1), _randn(shape[1], dtype=torch.float16, seed=2)
    _close(gn.group_norm(x, 32, w, b, eps=1e-5, silu=True),
           gn.group_norm_ref(x.float(), 32, w.float(), b.float(), eps=1e-5, silu=True), torch.float16)


@pytest.mark.parametrize("shape,channels_last,dtype", [((2, 320, 8, 8), True, torch.float16),
                                                         ((3, 96, 5, 7), True, torch.float32),
                                                         ((1, 64, 4, 4), False, torch.float32)])
def test_group_norm_with_shift_is_group_norm_of_the_sum(shape, channels_last, dtype, gn_path):
    # A ResNet block's norm2 input: conv1's output + (time embedding + conv1's bias) per sample and channel.
    x = _randn(*shape, dtype=dtype, scale=2.0, offset=0.5)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    shift = _randn(*shape[:2], dtype=dtype, seed=3, scale=3.0)
    # the time projections of all blocks come from one GEMM: a block's shift is a column slice of its output
    sliced = _randn(shape[0], shape[1] + 40, dtype=dtype, seed=5, scale=3.0)[:, 24:24 + shape[1]]
    w, b = _randn(shape[1], dtype=dtype, seed=1), _randn(shape[1], dtype=dtype, seed=2)
    conv_bias = _randn(shape[1], dtype=dtype, seed=4)
    for shift, bias_of_shift in ((shift, None), (shift, conv_bias), (sliced, conv_bias)):
        y = gn.group_norm(x, 32, w, b, silu=True, shift=shift, shift_bias=bias_of_shift)
        ref = gn.group_norm_ref(x.float(), 32, w.float(), b.float(), silu=True, shift=shift.float(),
                                shift_bias=None if bias_of_shift is None else bias_of_shift.float())
        assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        _close(y, ref, dtype)
    with pytest.raises(BadInput, match="one value per sample and channel"):
        gn.group_norm(x, 32, w, b, shift=shift[:, :-1])
    with pytest.raises(BadInput, match="one value per channel together with shift"):
        gn.group_norm(x, 32, w, b, shift_bias=conv_bias)


def test_small_groups_take_one_launch_and_large_ones_are_split(monkeypatch):
    split = []
    partials = gn._partials
    monkeypatch.setattr(gn, "_partials", lambda *a, **k: split.append(a[0].shape) or partials(*a, **k))
    for shape in [(2, 1280, 8, 8), (2, 2560, 16, 16), (2, 640, 32, 32), (2, 960, 32, 32)]:  # SD1.5's levels 4 to 2
        x = _randn(*shape, dtype=torch.float16).to(memory_format=torch.channels_last)
        _close(gn.group_norm(x, 32, silu=True), gn.group_norm_ref(x.float(), 32, silu=True), torch.float16)
    assert split == [(2, 960, 32, 32)]  # 1024 pixels x 30 channels: more than one program serves well


def test_group_norm_without_affine(gn_path):
    x = _randn(2, 64, 4, 4).to(memory_format=torch.channels_last)
    _close(gn.group_norm(x, 32, None, None), F.group_norm(x, 32), torch.float32)


@pytest.mark.parametrize("channels_last", [True, False])
def test_group_norm_split_reduction_is_stable(monkeypatch, channels_last, gn_path):
    # Small tiles and chunks force many partials per group and many steps per program: the path a 4096 px VAE
    # decode takes. With a mean of 1000 and unit spread, fp32 sums of squares would lose the variance entirely.
    monkeypatch.setattr(common, "TILE", 256)
    monkeypatch.setattr(common, "INTERPRET_TILE", 256)
    monkeypatch.setattr(gn, "MIN_CHUNK", 64)
    monkeypatch.setattr(gn, "INTERPRET_PROGRAMS", 16)
    x = _randn(1, 64, 16, 16, offset=1000.0)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    part = gn._partials(x, 8, channels_last)
    assert part.entries // part.per_chunk > 1  # more than one chunk per group
    w, b = _randn(64, seed=1), _randn(64, seed=2)
    ref = F.group_norm(x.double(), 8, w.double(), b.double(), eps=1e-5)
    torch.testing.assert_close(gn.group_norm(x, 8, w, b).double(), ref, rtol=0, atol=2e-3)


def test_group_norm_stats_over_tiles_match_untiled():
    # The tiled VAE: statistics summed over tiles, then each tile normalized with them, equals the whole image.
    x = _randn(2, 64, 12, 10, offset=3.0).to(memory_format=torch.channels_last)
    w, b = _randn(64, seed=1), _randn(64, seed=2)
    tiles = [x[:, :, :5], x[:, :, 5:]]  # a view of a channels_last tensor: neither layout, copied by the kernel
    stats = [gn.group_norm_stats(t, 32) for t in tiles]
    for t, (s, sq, n) in zip(tiles, stats):
        for got, want in zip((s, sq, n), gn.group_norm_stats_ref(t, 32)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
    total, total_sq, count = (sum(parts) for parts in zip(*stats))
    mean, rstd = gn.mean_rstd(total, total_sq, count, eps=1e-5)
    out = torch.cat([gn.group_norm_apply(t, mean, rstd, w, b, silu=True) for t in tiles], dim=2)
    ref = gn.group_norm_ref(x, 32, w, b, eps=1e-5, silu=True)
    _close(out, ref, torch.float32)
    _close(gn.group_norm_apply(x, mean, rstd, w, b, silu=True), gn.group_norm_apply_ref(x, mean, rstd, w, b, silu=True),
           torch.float32)


def test_group_norm_errors_say_what_to_do():
    x = _randn(1, 40, 2, 2)
    with pytest.raises(BadInput, match="cannot be split into 6 groups.*divides the channel count"):
        gn.group_norm(x, 6, None, None)
    with pytest.raises(BadInput, match="weight has 8 elements"):
        gn.group_norm(x, 8, _randn(8), None)
    with pytest.raises(BadInput, match="float16, bfloat16 or float32"):
        gn.group_norm(x.double(), 8, None, None)
    with pytest.raises(BadInput, match=r"must both be \(N, G\)"):
        gn.group_norm_apply(x, torch.zeros(1, 8), torch.ones(8))


def test_supported_says_where_kernels_run():
    assert gn.supported(_randn(1, 8, 2, 2)) and gg.supported(_randn(4, 8)) and ln.supported(_randn(4, 8))
    assert not gn.supported(_randn(1, 8, 2, 2).double())
    assert not gn.supported(torch.empty(1, 8, 2, 2, device="meta"))
    assert not ln.supported(_randn(1, ln.MAX_C + 1))


# ---- GEGLU ----

@pytest.mark.parametrize("shape,bias,dtype", [
    ((2, 64, 2 * 1280), True, torch.float32),   # SD1.5 first level (C=320, D=4*C), 64 tokens
    ((2, 64, 2 * 1280), False, torch.float32),
    ((2, 64, 2 * 1280), True, torch.float16),
    ((2, 64, 2 * 1280), True, torch.bfloat16),
    ((3, 5, 14), True, torch.float32),          # odd: D=7, 15 rows
])
def test_geglu_matches_torch(shape, bias, dtype):
    h = _randn(*shape, dtype=dtype, scale=2.0)
    b = _randn(shape[-1], dtype=dtype, seed=1) if bias else None
    y = gg.geglu(h, b)
    assert y.shape == shape[:-1] + (shape[-1] // 2,) and y.dtype == dtype
    _close(y, gg.geglu_ref(h.float(), b.float() if bias else None), dtype)


def test_geglu_is_diffusers_geglu():
    from diffusers.models.activations import GEGLU

    torch.manual_seed(0)
    mod = GEGLU(32, 48).to(DEVICE)
    x = _randn(2, 7, 32)
    with torch.no_grad():
        h = F.linear(x, mod.proj.weight)
        _close(gg.geglu(h, mod.proj.bias), mod(x), torch.float32)


@pytest.mark.parametrize("path", ["tma", "persistent", "pointers"])
@pytest.mark.parametrize("tokens,k,d,bias", [
    (300, 320, 96, True),   # SD1.5's first level: K = 320 (D cut down from 1280), rows not a multiple of the tile
    (7, 40, 24, False),     # odd: K and D below one tile, a few rows; D not a multiple of the TMA kernel's N tile
    (130, 72, 70, True),    # K not a multiple of the K tile, D not of the N tile nor TMA-aligned (pointer kernel)
    (64, 1280, 40, True),   # a long K: 20 steps through the TMA kernel's pipeline
    (300, 64, 200, True),   # TMA-aligned D past one N tile, ragged: 10 tiles, several per persistent program
])
def test_geglu_linear_is_projection_then_geglu(monkeypatch, path, tokens, k, d, bias):
    if path != "pointers" and gg.TensorDescriptor is None:
        pytest.skip("this Triton has no tensor descriptors (triton.tools.tensor_descriptor) for the TMA kernels")
    monkeypatch.setattr(gg, "_tma", lambda x: path != "pointers")
    # Only large GEMMs take the persistent kernel: make every TMA call take it, or none.
    monkeypatch.setattr(gg, "LINEAR_TMA_PERSISTENT_WORK", 0 if path == "persistent" else 1 << 62)
    x = _randn(2, tokens, k, dtype=torch.float16)
    w = _randn(2 * d, k, dtype=torch.float16, seed=1, scale=k ** -0.5)
    b = _randn(2 * d, dtype=torch.float16, seed=2) if bias else None
    y = gg.geglu_linear(x, w, b)
    assert y.shape == (2, tokens, d) and y.dtype == torch.float16
    _close(y, gg.geglu_linear_ref(x.float(), w.float(), b.float() if bias else None), torch.float16)


def test_geglu_linear_covers_many_rows_with_tma_and_short_projections_without(monkeypatch):
    w = _randn(2 * 64, 320, dtype=torch.float16)
    wide = _randn(2 * 64, 640, dtype=torch.float16)
    rows = gg.LINEAR_TMA_MIN_ROWS
    monkeypatch.setattr(gg, "_tma", lambda x: False)
    assert gg.linear_covers(_randn(2, 8, 320, dtype=torch.float16), w)
    assert not gg.linear_covers(_randn(2, 8, 320, dtype=torch.float32), w.float())
    assert not gg.linear_covers(_randn(rows, 640, dtype=torch.float16), wide)
    monkeypatch.setattr(gg, "_tma", lambda x: True)
    assert gg.linear_covers(_randn(rows, 640, dtype=torch.float16), wide)
    assert not gg.linear_covers(_randn(rows - 1, 640, dtype=torch.float16), wide)
    assert not gg.linear_covers(_randn(rows, 644, dtype=torch.float16), _randn(2 * 64, 644, dtype=torch.float16))
    assert not gg.linear_covers(_randn(rows, 640, dtype=torch.float32), wide.float())
    with pytest.raises(BadInput, match="does not project"):
        gg.geglu_linear(_randn(2, 8, 32, dtype=torch.float16), w)


def test_geglu_linear_with_tma_takes_misaligned_input_through_the_pointer_kernel(monkeypatch):
    class Launches:
        def __init__(self, kernel):
            self.kernel, self.grids = kernel, []

        def __getitem__(self, grid):
            self.grids.append(grid)
            return self.kernel[grid]

    if gg.TensorDescriptor is None:
        pytest.skip("this Triton has no tensor descriptors (triton.tools.tensor_descriptor) for the TMA kernels")
    monkeypatch.setattr(gg, "_tma", lambda x: True)
    tma = Launches(gg._geglu_linear_tma_kernel)
    monkeypatch.setattr(gg, "_geglu_linear_tma_kernel", tma)
    w = _randn(2 * 32, 64, dtype=torch.float16, seed=1, scale=0.125)
    x = _randn(2 * 100 * 64 + 1, dtype=torch.float16)[1:].view(2, 100, 64)  # starts 2 bytes into its storage
    _close(gg.geglu_linear(x, w), gg.geglu_linear_ref(x.float(), w.float()), torch.float16)
    assert not tma.grids
    gg.geglu_linear(x.clone(), w)
    assert tma.grids


def test_geglu_rejects_odd_last_dim():
    with pytest.raises(BadInput, match="must be even"):
        gg.geglu(_randn(2, 7))


# ---- LayerNorm, SkipLayerNorm, BiasAdd ----

@pytest.mark.parametrize("shape,affine,dtype", [
    ((2, 64, 320), True, torch.float32),
    ((2, 64, 320), True, torch.float16),
    ((2, 64, 320), True, torch.bfloat16),
    ((3, 5, 40), False, torch.float32),
    ((2, 3, 2560), True, torch.float32),
])
def test_layer_norm_matches_torch(shape, affine, dtype):
    x = _randn(*shape, dtype=dtype, offset=4.0)
    r = _randn(*shape, dtype=dtype, seed=3)
    w = _randn(shape[-1], dtype=dtype, seed=1) if affine else None
    b = _randn(shape[-1], dtype=dtype, seed=2) if affine else None
    wf, bf = (w.float(), b.float()) if affine else (None, None)
    _close(ln.layer_norm(x, w, b, eps=1e-5), F.layer_norm(x.float(), shape[-1:], wf, bf, 1e-5), dtype)
    y, s = ln.layer_norm(x, w, b, eps=1e-5, residual=r)
    if dtype != torch.bfloat16:  # the sum is rounded once, like torch's add (bf16: see TOL)
        assert torch.equal(s, x + r)
    _close(s, x.float() + r.float(), dtype)
    _close(y, F.layer_norm(s.float(), shape[-1:], wf, bf, 1e-5), dtype)
    sb = _randn(shape[-1], dtype=dtype, seed=4)  # the next layer's bias joins the sum; the norm is of the sum alone
    y2, s2 = ln.layer_norm(x, w, b, eps=1e-5, residual=r, sum_bias=sb)
    _close(y2, y, dtype)
    _close(s2, s.float() + sb.float(), dtype)  # the rounded sum, then the bias added and rounded once


def test_layer_norm_large_offset():
    x = _randn(4, 320, offset=1000.0)
    torch.testing.assert_close(ln.layer_norm(x, None, None).double(), F.layer_norm(x.double(), (320,)),
                               rtol=0, atol=2e-3)


@pytest.mark.parametrize("shape,dtype", [((2, 64, 320), torch.float32), ((3, 5, 1300), torch.float16)])
def test_add_bias_residual(shape, dtype):
    x, r, b = _randn(*shape, dtype=dtype), _randn(*shape, dtype=dtype, seed=1), _randn(shape[-1], dtype=dtype, seed=2)
    _close(ln.add_bias_residual(x, b, r), x.float() + b.float() + r.float(), dtype)
    b2 = _randn(shape[-1], dtype=dtype, seed=3)  # a shortcut convolution's bias too
    _close(ln.add_bias_residual(x, b, r, b2), x.float() + b.float() + r.float() + b2.float(), dtype)
    _close(ln.add_bias_residual(x, b), x.float() + b.float(), dtype)  # a convolution's bias alone
    _close(ln.add_bias_residual(x, b, bias2=b2), x.float() + b.float() + b2.float(), dtype)
    with pytest.raises(BadInput, match="bias2 has"):
        ln.add_bias_residual(x, b, r, b2[:-1])


def test_layer_norm_errors_say_what_to_do():
    x = _randn(2, 8)
    with pytest.raises(BadInput, match="does not match x"):
        ln.layer_norm(x, None, None, residual=_randn(2, 4))
    with pytest.raises(BadInput, match="without a residual"):
        ln.layer_norm(x, None, None, sum_bias=_randn(8))
    with pytest.raises(BadInput, match="layer_norm_ref"):
        ln.layer_norm(_randn(1, ln.MAX_C + 1), None, None)


# ---- nearest 2x upsampling ----

@pytest.mark.parametrize("shape,dtype", [((2, 1280, 8, 8), torch.float16), ((3, 5, 7, 3), torch.float32),
                                         ((1, 1300, 2, 1), torch.bfloat16), ((2, 4, 1, 1), torch.float16)])
def test_upsample_nearest2x_matches_torch(shape, dtype):
    x = _randn(*shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    y = up.upsample_nearest2x(x)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, up.upsample_nearest2x_ref(x))  # a copy: exact


def test_upsample_nearest2x_errors_say_what_to_do():
    x = _randn(2, 8, 4, 4)  # NCHW, not channels_last
    assert not up.supported(x)
    with pytest.raises(BadInput, match="channels_last"):
        up.upsample_nearest2x(x)


@pytest.mark.parametrize("n,ci,co,h,w,dtype", [(2, 64, 64, 8, 8, torch.float16), (3, 12, 20, 3, 5, torch.float32),
                                                (1, 7, 5, 1, 1, torch.float32), (1, 40, 24, 4, 2, torch.bfloat16)])
def test_upsample_conv3x3_is_the_upsampling_then_the_convolution(n, ci, co, h, w, dtype):
    x = _randn(n, ci, h, w, dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight, bias = _randn(co, ci, 3, 3, dtype=dtype, seed=1, scale=(9 * ci) ** -0.5), _randn(co, dtype=dtype, seed=2)
    ref = up.upsample_conv3x3_ref(x.double(), weight.double(), bias.double())
    y = up.upsample_conv3x3(x, weight, bias)
    assert y.shape == ref.shape and y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last)
    # the yardstick is the rounding of the torch path's own upsample + conv at this dtype (TF32 for fp32 on a GPU)
    own = up.upsample_conv3x3_ref(x, weight, bias).double()
    tol = 2 * ((own - ref).norm() / ref.norm()).item() + (1e-5 if dtype == torch.float32 else 1e-3)
    assert ((y.double() - ref).norm() / ref.norm()).item() <= tol
    no_bias = up.upsample_conv3x3(x, weight.contiguous(memory_format=torch.channels_last))  # either weight layout
    assert ((no_bias.double() + bias.double()[:, None, None] - ref).norm() / ref.norm()).item() <= tol


def test_subpixel_weight_sums_the_taps_each_parity_sees():
    w = _randn(3, 2, 3, 3)
    sub = up.subpixel_weight(w).view(2, 2, 3, 2, 2, 2)  # (a, b, out, in, u, v)
    rows = [[[0], [1, 2]], [[0, 1], [2]]]  # parity, tap -> the 3x3 rows (columns) summed
    for a in range(2):
        for b in range(2):
            for u in range(2):
                for v in range(2):
                    expected = w[:, :, rows[a][u]][:, :, :, rows[b][v]].sum((2, 3))
                    torch.testing.assert_close(sub[a, b, :, :, u, v], expected)


def test_upsample_conv3x3_errors_and_coverage():
    x = _randn(2, 8, 4, 4)  # NCHW, not channels_last
    with pytest.raises(BadInput, match="channels_last"):
        up.upsample_conv3x3(x, _randn(8, 8, 3, 3))
    x = x.contiguous(memory_format=torch.channels_last)
    with pytest.raises(BadInput, match="does not fit"):
        up.upsample_conv3x3(x, _randn(8, 4, 3, 3))
    with pytest.raises(BadInput, match="bias has 3"):
        up.upsample_conv3x3(x, _randn(8, 8, 3, 3), _randn(3))
    with pytest.raises(BadInput, match="3, 3"):
        up.subpixel_weight(_randn(8, 8, 1, 1))
    # the 2x2 weights are made at every call: below SUBPIXEL_MIN_PIXELS input pixels they cost more than they save
    big = _randn(1, 8, 32, 32).contiguous(memory_format=torch.channels_last)
    assert up.conv_covers(big, _randn(8, 8, 3, 3)) and not up.conv_covers(x, _randn(8, 8, 3, 3))
    assert not up.conv_covers(big, _randn(8, 8, 1, 1)) and not up.conv_covers(big, _randn(8, 8, 3, 3).half())


# ---- attention ----

def _qkv_views(B, Lq, Lk, H, D, dtype, seed=0):
    """q, k and v as the packed projections hold them: per-head views of (B, tokens, n * H * D) outputs."""
    q = _randn(B, Lq, 3 * H * D, dtype=dtype, seed=seed)[..., H * D:2 * H * D].view(B, Lq, H, D)
    kv = _randn(B, Lk, 2 * H * D, dtype=dtype, seed=seed + 1)
    return q, kv[..., :H * D].view(B, Lk, H, D), kv[..., H * D:].view(B, Lk, H, D)


@pytest.mark.parametrize("B,Lq,Lk,H,D,dtype", [
    (2, 64, 77, 2, 64, torch.float16),  # SDXL's cross-attention, fewer queries and heads
    (2, 64, 77, 2, 64, torch.float32),
    (1, 37, 77, 3, 40, torch.float16),  # SD1.5's head size, an odd query count
    (3, 16, 5, 1, 80, torch.float32),
    (2, 130, 200, 2, 64, torch.float16),  # several key blocks, the last one partial
    (1, 1, 1, 1, 8, torch.float32),
])
def test_attention_matches_torch(B, Lq, Lk, H, D, dtype):
    q, k, v = _qkv_views(B, Lq, Lk, H, D, dtype)
    out = at.attention(q, k, v)
    ref = at.attention_ref(q.double(), k.double(), v.double())
    assert out.shape == (B, Lq, H, D) and out.dtype == dtype and out.is_contiguous()
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() <= (2e-3 if dtype == torch.float16 else 1e-5)
    scaled = at.attention(q, k, v, scale=0.3)  # a scale of the caller's
    ref = at.attention_ref(q.double(), k.double(), v.double(), scale=0.3)
    assert ((scaled.double() - ref).norm() / ref.norm()).item() <= (2e-3 if dtype == torch.float16 else 1e-5)


def test_attention_large_scores_stay_finite():
    """Scores far beyond fp16's range (no max subtracted, exp would overflow) still give a softmax."""
    q, k, v = _qkv_views(2, 16, 77, 2, 64, torch.float16)
    q = q * 40
    out = at.attention(q, k, v)
    ref = at.attention_ref(q.double(), k.double(), v.double())
    assert torch.isfinite(out).all() and ((out.double() - ref).norm() / ref.norm()).item() <= 5e-3


def test_attention_covers_short_key_sets_of_64_wide_heads():
    q, k, _ = _qkv_views(2, 16, 77, 2, 64, torch.float16)
    assert at.covers(q, k)
    assert not at.covers(q, _qkv_views(2, 16, at.SHORT_KEYS + 1, 2, 64, torch.float16)[1])  # self-attention
    assert not at.covers(*_qkv_views(2, 16, 77, 2, 40, torch.float16)[:2])  # SD1.5's heads: cuDNN is faster
    assert not at.covers(*_qkv_views(2, 16, 77, 2, 64, torch.float32)[:2])


def test_attention_errors_say_what_to_do():
    q, k, v = _qkv_views(2, 16, 7, 2, 64, torch.float32)
    with pytest.raises(BadInput, match="do not match q"):
        at.attention(q, k[:, :, :1], v[:, :, :1])
    with pytest.raises(BadInput, match="no keys"):
        at.attention(q, k[:, :0], v[:, :0])
    strided = _randn(2, 7, 2, 128)[..., ::2]  # every other element of the head dimension
    with pytest.raises(BadInput, match="must be contiguous"):
        at.attention(q, strided, strided)
    with pytest.raises(BadInput, match="over the kernel's"):
        big = _randn(1, 4, 1, at.MAX_HEAD_DIM * 2)
        at.attention(big, big, big)
    with pytest.raises(BadInput, match="batch, tokens, heads, head_dim"):
        at.attention(q.flatten(2), k.flatten(2), v.flatten(2))


# ---- bench, and running without Triton ----

def test_bench_smoke():
    from sd_accel.accel.cli.kernel_bench import bench_kernels

    rows = bench_kernels(device=DEVICE, tiny=True)
    assert {r["kernel"] for r in rows} == {"group_norm+silu", "geglu+bias", "geglu_linear", "swiglu",
                                              "quantize_rows", "quantize_rows+gelu", "quantize_rows+swiglu",
                                              "skip_layer_norm", "add_bias_residual",
                                              "upsample_nearest2x", "upsample_conv3x3", "attention"}
    for r in rows:
        assert r["triton_ms"] > 0 and r["torch_ms"] > 0 and r["copy_gbps"] > 0
        assert r["max_rel_err"] < 5e-3, r


def test_kernels_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from sd_accel.kernels import groupnorm\n"
        "from sd_accel.kernels.errors import Unavailable as BackendUnavailable\n"
        "assert not groupnorm.supported(torch.zeros(1, 8, 2, 2))\n"
        "try:\n"
        "    groupnorm.group_norm(torch.zeros(1, 8, 2, 2), 4)\n"
        "except BackendUnavailable as e:\n"
        "    assert 'pip install triton' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_dit_attention_bench_smoke():
    """bench --kernels' DiT attention rows: bf16 SDPA here, fp8 cuDNN where it runs (or why not)."""
    from sd_accel.accel.cli.attention_bench import bench_dit_attention, table

    rows = bench_dit_attention(device=DEVICE, tiny=True)
    assert rows[0]["way"] == "bf16 cuDNN (SDPA)" and rows[0]["ms"] > 0 and rows[0]["err_vs_fp32"] < 1e-2
    fp8 = [r for r in rows if r["way"].startswith("fp8 cuDNN")]
    assert fp8 and all(r["ms"] is None and r["note"].startswith("cannot run:") or r["err_vs_fp32"] < 8e-2
                       for r in fp8)
    assert "fp8 cuDNN" in table(rows)
